"""pyverbs: the real library where it imports, the fallback logic through a fake module, and serve on sysfs."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from rdma_device_plugin.config import load_config_data
from rdma_device_plugin.discovery import Discovery
from rdma_device_plugin.resources import build_pools
from rdma_device_plugin.verbs import VerbsProbe, load_pyverbs_device
from rdma_kubesim import KubeletSimulator
from rdma_node import fixtures
from rdma_node import verbs as node_verbs

RES = "rdma/hca"


def _real_pyverbs() -> Any:
    try:
        return load_pyverbs_device()
    except ImportError:
        return None


REAL = _real_pyverbs()
HAS_RDMA = bool(os.listdir("/sys/class/infiniband")) if os.path.isdir("/sys/class/infiniband") else False


@pytest.mark.skipif(REAL is None, reason="pyverbs does not import here (apt-get install python3-pyverbs)")
@pytest.mark.skipif(HAS_RDMA, reason="this machine has RDMA devices: the no-device path cannot be exercised")
def test_real_pyverbs_without_devices_raises_and_probe_falls_back(caplog: pytest.LogCaptureFixture) -> None:
    from pyverbs.pyverbs_error import PyverbsRDMAError

    with pytest.raises(PyverbsRDMAError):  # it raises, it does not return []
        REAL.get_device_list()
    probe = VerbsProbe()
    with caplog.at_level(logging.INFO, logger="rdma_device_plugin.verbs"):
        assert probe.available() is False
        assert probe.available() is False  # decided once
    assert "PyverbsRDMAError" in probe.reason
    lines = [r.getMessage() for r in caplog.records if r.name == "rdma_device_plugin.verbs"]
    assert lines == [f"port state and GIDs from sysfs: {probe.reason}"]  # one clear line
    assert probe.port_states(["mlx5_0"]) == {}


# --------------------------------------------------------------------------- fake pyverbs


class FakeRDMAError(Exception):
    pass


class FakeContext:
    def __init__(self, mod: FakeVerbs, name: str) -> None:
        if name not in mod.ports:
            raise FakeRDMAError(f"no device {name}")
        self.mod, self.name, self.closed = mod, name, False
        mod.opened.append(name)

    def query_device(self) -> Any:
        return SimpleNamespace(phys_port_cnt=len(self.mod.ports[self.name]))

    def query_port(self, port: int) -> Any:
        if self.name in self.mod.broken:
            raise FakeRDMAError("device removed")
        return SimpleNamespace(state=self.mod.ports[self.name][port - 1], gid_tbl_len=3)

    def query_gid(self, port: int, index: int) -> str:
        return [
            "FE80:0000:0000:0000:bace:f6ff:fe00:0001",
            "2408:4005:0300:0000:0000:0000:0000:0011",
            "0000:" * 7 + "0000",
        ][index]

    def query_gid_type(self, port: int, index: int) -> int:
        return index  # 0 IB/RoCE v1, 1 RoCE v2

    def close(self) -> None:
        self.closed = True


class FakeVerbs:
    """Stands in for ``pyverbs.device``: get_device_list() and Context(name=...)."""

    def __init__(self, ports: dict[str, list[int]] | None = None, raise_list: bool = False) -> None:
        self.ports = ports or {}
        self.raise_list = raise_list
        self.broken: set[str] = set()
        self.opened: list[str] = []

    def get_device_list(self) -> list[Any]:
        if self.raise_list:
            raise FakeRDMAError("Failed to get devices list")
        return [SimpleNamespace(name=n.encode()) for n in self.ports]

    def Context(self, name: str) -> FakeContext:
        return FakeContext(self, name)


def _missing() -> Any:
    raise ImportError("No module named 'pyverbs'")


@pytest.mark.parametrize(
    ("loader", "reason"),
    [
        (_missing, "pyverbs does not import (ImportError"),
        (
            lambda: FakeVerbs(raise_list=True),
            "pyverbs lists no RDMA devices (FakeRDMAError: Failed to get devices list)",
        ),
        (lambda: FakeVerbs({}), "pyverbs lists no RDMA devices (empty list)"),
    ],
    ids=["no-import", "list-raises", "empty"],
)
def test_fallback_to_sysfs_with_one_log_line(loader: Any, reason: str, caplog: pytest.LogCaptureFixture) -> None:
    probe = VerbsProbe(loader)
    with caplog.at_level(logging.INFO, logger="rdma_device_plugin.verbs"):
        assert not probe.available()
        assert not probe.available()
    assert probe.reason.startswith(reason)
    assert [r.getMessage() for r in caplog.records] == [f"port state and GIDs from sysfs: {probe.reason}"]
    assert probe.devices() == [] and probe.gids("mlx5_0") == []


def test_port_states_and_gids_from_verbs() -> None:
    fake = FakeVerbs({"mlx5_0": [4], "mlx5_1": [4, 1]})
    probe = VerbsProbe(lambda: fake)
    assert probe.available() and probe.reason == "pyverbs lists mlx5_0,mlx5_1"
    assert probe.port_states(["mlx5_0", "mlx5_1", "mlx5_9"]) == {"mlx5_0": ("ACTIVE",), "mlx5_1": ("ACTIVE", "DOWN")}
    probe.port_states(["mlx5_0"])
    assert fake.opened == ["mlx5_0", "mlx5_1"]  # contexts are kept between probes
    assert probe.gids("mlx5_0") == [
        ("fe80:0000:0000:0000:bace:f6ff:fe00:0001", "IB/RoCE v1"),
        ("2408:4005:0300:0000:0000:0000:0000:0011", "RoCE v2"),
    ]  # zero GIDs are skipped
    fake.broken.add("mlx5_1")
    assert probe.port_states(["mlx5_1"]) == {"mlx5_1": None}  # query error: gone, context dropped
    del fake.ports["mlx5_0"]
    assert probe.port_states(["mlx5_0"]) == {}  # unknown to verbs now: left to sysfs


def test_discovery_takes_port_state_from_verbs_and_sysfs_for_the_rest(short_tmp: Path) -> None:
    node = fixtures.write_node(str(short_tmp / "n"), fixtures.lingjun_node(nics=4))
    config = load_config_data({"mode": "exclusive", "rediscoveryIntervalSeconds": 3600})
    pools = build_pools(config)
    # verbs knows bond_0 (DOWN although sysfs says ACTIVE) and bond_1; bond_2/3 come from sysfs
    fake = FakeVerbs({"mlx5_bond_0": [1], "mlx5_bond_1": [4]})
    discovery = Discovery(config, pools, node.sysfs, node.dev, verbs=VerbsProbe(lambda: fake))
    discovery.full()
    health = {d.id: d.health for d in pools[0].snapshot()[1]}
    assert health == {
        "0000:1a:00.0": "Unhealthy",
        "0000:3a:00.0": "Healthy",
        "0000:5a:00.0": "Healthy",
        "0000:7a:00.0": "Healthy",
    }
    fake.ports["mlx5_bond_0"] = [4]
    node.set_port_state("mlx5_bond_3", "DOWN")
    discovery.probe()
    health = {d.id: d.health for d in pools[0].snapshot()[1]}
    assert health["0000:1a:00.0"] == "Healthy" and health["0000:7a:00.0"] == "Unhealthy"


def test_serve_falls_back_to_sysfs_and_serves(  # type: ignore[no-untyped-def]
    sim: KubeletSimulator, start_plugin, short_tmp: Path
) -> None:
    """With a usable-looking uverbs node in the process's /dev/infiniband, pyverbs is tried
    (and, on this machine without RDMA hardware, falls back to sysfs with its reason)."""
    verbs_dev = short_tmp / "infiniband"
    verbs_dev.mkdir()
    (verbs_dev / "uverbs0").write_text("", encoding="utf-8")
    plugin = start_plugin(extra=["--verbs-dev-dir", str(verbs_dev)])
    assert sim.wait_registered(RES), plugin.output()
    assert sim.allocatable(RES) == 1000
    out = plugin.output()
    assert out.count("port state and GIDs from sysfs") == 1, out
    if REAL is not None and not HAS_RDMA:
        assert "pyverbs lists no RDMA devices (PyverbsRDMAError" in out


def test_serve_does_not_import_pyverbs_without_uverbs_devices(  # type: ignore[no-untyped-def]
    sim: KubeletSimulator, start_plugin, short_tmp: Path
) -> None:
    """The chart's unprivileged pod has no /dev/infiniband: libibverbs could open nothing, so
    pyverbs is not even imported (its import costs memory) and sysfs is used, said once."""
    plugin = start_plugin(extra=["--verbs-dev-dir", str(short_tmp / "no-such-dir")])
    assert sim.wait_registered(RES), plugin.output()
    out = plugin.output()
    assert out.count("port state and GIDs from sysfs: pyverbs not used:") == 1, out
    assert "does not exist in this container" in out
    assert "pyverbs does not import" not in out and "pyverbs lists" not in out


# --------------------------------------------------------------------------- the node module's read


def test_node_read_opens_every_selected_nic_and_names_the_ones_verbs_cannot_open() -> None:
    """rdma_node_info's view (node/verbs.read): sysfs selects bond_0..2; verbs lists bond_0 and
    bond_1 but cannot open bond_1; bond_2 is not listed at all."""
    fake = FakeVerbs({"mlx5_bond_0": [4], "mlx5_bond_1": [4]})
    refuse = fake.Context

    def context(name: str) -> FakeContext:
        if name == "mlx5_bond_1":
            raise FakeRDMAError("Failed to open device")
        return refuse(name)

    fake.Context = context  # type: ignore[method-assign]
    seen = node_verbs.read(["mlx5_bond_0", "mlx5_bond_1", "mlx5_bond_2"], lambda: fake)
    assert seen.used and seen.status == "pyverbs lists mlx5_bond_0,mlx5_bond_1"
    assert seen.ports == {"mlx5_bond_0": ["ACTIVE"]}
    assert seen.gids["mlx5_bond_0"][1] == ("2408:4005:0300:0000:0000:0000:0000:0011", "RoCE v2")
    messages = {c.nic: (c.passed, c.message()) for c in seen.checks()}
    assert messages["mlx5_bond_0"] == (True, "mlx5_bond_0: opened through libibverbs (ports ACTIVE)")
    assert messages["mlx5_bond_1"] == (
        False,
        "mlx5_bond_1: libibverbs cannot open it (FakeRDMAError: Failed to open device). Fix: " + node_verbs.FIX_OPEN,
    )
    assert messages["mlx5_bond_2"] == (
        False,
        "mlx5_bond_2: sysfs lists it but libibverbs does not. Fix: " + node_verbs.FIX_PROVIDER,
    )


@pytest.mark.parametrize(
    ("loader", "status", "failed"),
    [
        (_missing, "pyverbs not importable: sysfs only", []),
        (
            lambda: FakeVerbs(raise_list=True),
            "pyverbs could not list devices (FakeRDMAError: Failed to get devices list): sysfs only",
            ["mlx5_bond_0"],
        ),
    ],
    ids=["no-import", "list-raises"],
)
def test_node_read_without_usable_pyverbs(loader: Any, status: str, failed: list[str]) -> None:
    seen = node_verbs.read(["mlx5_bond_0"], loader)
    assert not seen.used and seen.status == status and seen.ports == {}
    assert [c.nic for c in seen.checks() if not c.passed] == failed
