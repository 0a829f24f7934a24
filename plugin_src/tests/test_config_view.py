"""The DRA driver's config: validated by the one schema in a child process, read in the driver as
plain values (config_view). Every field must read as the model's, errors must be the schema's own."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from rdma_device_plugin.config import ConfigError, PluginConfig, load_config
from rdma_device_plugin.config_view import ConfigCheck, Frozen, load_config_view

CONFIGS = {
    "defaults": None,
    "shared, every section": """
version: v1
mode: shared
resources:
  - name: rdma/hca
    sharedDevices: 500
    numaPools: true
    selectors: {vendors: ["0x15B3"], deviceIDs: ["1021"], drivers: [mlx5_core], linkTypes: [Ethernet]}
  - name: rdma/storage
    selectors: {ifNames: [eth9], rdmaDevices: [mlx5_9]}
health:
  intervalSeconds: 0.25
  policy: any
  flapDamping: {enabled: false, halfLifeSeconds: 7.5}
  vanishGraceSeconds: 0
rediscoveryIntervalSeconds: 30
charDevices: {umad: true}
env: {NCCL_DEBUG: INFO, EMPTY: ""}
nonHostNetwork: {enabled: true, checks: warn, env: {NCCL_SOCKET_FAMILY: AF_INET6}}
cdi: {enabled: true, kind: rdma.example.org/hca}
workloadEnv: {addrFamily: AF_INET6, addrRange: "2408:4005:300::1/56", roceVersion: 2, ucx: false}
""",
    "exclusive": """
version: v1
mode: exclusive
resources: [{name: rdma/nic}]
""",
}


def _write(tmp_path: Path, text: str | None) -> str | None:
    if text is None:
        return None
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return str(path)


def _same(view: Any, model: Any, where: str) -> None:
    """Every field of ``model`` reads the same from ``view``, recursively."""
    if isinstance(model, BaseModel):
        assert isinstance(view, Frozen), where
        assert type(view).__name__ == "Frozen" and view._kind == type(model).__name__, where
        for name in type(model).model_fields:
            _same(getattr(view, name), getattr(model, name), f"{where}.{name}")
    elif isinstance(model, list):
        assert isinstance(view, list) and len(view) == len(model), where
        for i, (v, m) in enumerate(zip(view, model, strict=True)):
            _same(v, m, f"{where}[{i}]")
    else:
        assert type(view) is type(model) and view == model, (where, view, model)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_the_view_reads_every_field_as_the_model_does(tmp_path: Path, name: str) -> None:
    path = _write(tmp_path, CONFIGS[name])
    model, view = load_config(path), load_config_view(path)
    _same(view, model, "config")
    assert view == load_config_view(path)
    if name != "defaults":
        assert view != load_config_view(None)


def test_the_view_holds_what_validation_made_of_the_input(tmp_path: Path) -> None:
    view = load_config_view(_write(tmp_path, CONFIGS["shared, every section"]))
    assert view.resources[0].selectors.vendors == ["15b3"]  # normalised by the schema's validator
    assert view.workload_env.addr_range == "2408:4005:300::/56"
    assert view.resources[1].shared_devices == 1000 and view.resources[1].selectors.vendors == ["15b3"]  # defaults
    assert view.non_host_network.env == {"NCCL_SOCKET_FAMILY": "AF_INET6"}


def test_the_view_is_read_only_and_names_a_missing_field() -> None:
    view = load_config_view(None)
    with pytest.raises(AttributeError, match="read-only"):
        view.mode = "exclusive"  # type: ignore[misc]
    with pytest.raises(AttributeError, match="PluginConfig has no field 'modes'"):
        view.modes  # type: ignore[attr-defined]  # noqa: B018


def test_a_bad_config_fails_with_the_schemas_own_message(tmp_path: Path) -> None:
    path = _write(tmp_path, "version: v1\nmode: weird\nhealth: {intervalSeconds: -1}\nbogus: 1\n")
    with pytest.raises(ConfigError) as model_error:
        load_config(path)
    with pytest.raises(ConfigError) as view_error:
        load_config_view(path)
    assert str(view_error.value) == str(model_error.value)
    assert "health.intervalSeconds" in str(view_error.value) and "bogus: unknown key" in str(view_error.value)
    with pytest.raises(ConfigError, match=r"cannot read config file .*missing\.yaml.*check --config"):
        load_config_view(str(tmp_path / "missing.yaml"))


def test_a_check_that_cannot_run_names_its_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "executable", "/bin/false")
    command = r"its check \(/bin/false -P -m rdma_device_plugin\.config_view\) failed \(exit code 1"
    with pytest.raises(ConfigError, match=command):
        ConfigCheck(None).result()
    monkeypatch.setattr(sys, "executable", "/nonexistent/python")
    with pytest.raises(ConfigError, match="FileNotFoundError"):
        ConfigCheck(None).result()


def test_the_models_and_the_view_are_the_same_schema() -> None:
    """A field added to a model reaches the view without a second list: the view is built from the
    model's own fields (a new type of value fails loudly in encode instead)."""
    fields = set(PluginConfig.model_fields)
    assert fields <= set(load_config_view(None)._fields)
