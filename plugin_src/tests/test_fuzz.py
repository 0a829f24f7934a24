"""Bad input: fuzz the config loader and the sysfs reader.

Contracts checked:
- ``load_config_data`` / ``load_config_text`` either return a valid ``PluginConfig`` or raise
  ``ConfigError`` with a message; never any other exception.
- ``sysfs.read_nics`` over malformed trees always returns a list: an unidentifiable NIC is
  skipped with a log line naming it; an identified NIC that is not fit for use is never
  Healthy. The oracle for "healthy" is written independently of the reader: the raw port
  state must be exactly the kernel's "4: ACTIVE" / "5: ACTIVE_DEFER" (bare code allowed).

Unreadable files: tests run as root, where chmod 000 does not block reads. Instead the
fixture uses what a real sysfs can actually produce for an attribute that cannot be read:
``read()`` failing with EIO or EACCES (injected by patching ``open`` in the sysfs module for
that one path), a symlink loop (ELOOP), a directory where a file should be (EISDIR), a
dangling symlink and a missing file. FIFOs are not used: sysfs never contains them.
"""

from __future__ import annotations

import builtins
import errno
import logging
import os
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import yaml
from conftest import serve_command
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rdma_device_plugin.config import ConfigError, PluginConfig, load_config_data, load_config_text
from rdma_device_plugin.resources import HEALTHY, ResourcePool, encode_devices
from rdma_kubesim import KubeletSimulator
from rdma_node import fixtures, sysfs

pytestmark = pytest.mark.timeout(90)

# --------------------------------------------------------------------------- config

_KEYS = [
    "version",
    "mode",
    "resources",
    "name",
    "sharedDevices",
    "selectors",
    "vendors",
    "deviceIDs",
    "drivers",
    "ifNames",
    "rdmaDevices",
    "linkTypes",
    "health",
    "intervalSeconds",
    "policy",
    "rediscoveryIntervalSeconds",
    "charDevices",
    "umad",
    "issm",
    "env",
    "nonHostNetwork",
    "enabled",
    "checks",
    "cdi",
    "kind",
]
_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
    st.sampled_from(
        ["v1", "v2", "shared", "exclusive", "rdma/hca", "Rdma/hca", "a/b/c", "15b3", "0x15b3", "Ethernet", "any"]
    ),
    st.binary(max_size=8),
)
_KEY = st.one_of(st.sampled_from(_KEYS), st.text(max_size=8), st.integers(), st.none())
_VALUES = st.recursive(
    _SCALARS,
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.dictionaries(_KEY, children, max_size=5),
    ),
    max_leaves=25,
)
_TOP = st.one_of(_VALUES, st.dictionaries(st.sampled_from(_KEYS), _VALUES, max_size=6))


def _check_config_outcome(call: Callable[[], PluginConfig]) -> None:
    try:
        config = call()
    except ConfigError as exc:
        assert str(exc).strip(), "ConfigError without a message"
        assert str(exc).startswith("invalid config") or "cannot read" in str(exc)
        return
    assert isinstance(config, PluginConfig)
    assert config.resources and all(r.name.count("/") == 1 for r in config.resources)
    assert 0 < config.health.interval_seconds <= 60


@settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(data=_TOP)
def test_config_data_is_config_or_config_error(data: Any) -> None:
    _check_config_outcome(lambda: load_config_data(data))


def _yamlish(data: Any) -> str:
    try:
        return yaml.safe_dump(data, default_flow_style=None)
    except yaml.YAMLError:
        return repr(data)


_YAML_TOKENS = st.sampled_from(
    [
        ":",
        " ",
        "\n",
        "- ",
        "[",
        "]",
        "{",
        "}",
        ",",
        "'",
        '"',
        "&a ",
        "*a",
        "!!str ",
        "!!int ",
        "!!binary ",
        "? ",
        "#",
        "version",
        "mode",
        "resources",
        "name",
        "sharedDevices",
        "health",
        "intervalSeconds",
        "1e3",
        "-1",
        "~",
        "null",
        "2001-13-45",
        "!!timestamp ",
    ]
)


@st.composite
def _yaml_texts(draw: st.DrawFn) -> str:
    text = _yamlish(draw(_TOP))
    for _ in range(draw(st.integers(0, 4))):  # mutate: insert tokens, delete spans
        pos = draw(st.integers(0, len(text)))
        if draw(st.booleans()):
            text = text[:pos] + draw(_YAML_TOKENS) + text[pos:]
        else:
            text = text[:pos] + text[pos + draw(st.integers(1, 5)) :]
    return text


@settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(text=st.one_of(_yaml_texts(), st.text(max_size=80)))
def test_config_text_is_config_or_config_error(text: str) -> None:
    _check_config_outcome(lambda: load_config_text(text))


# Regressions found by the fuzzers above (fixed in config.py).
@pytest.mark.parametrize(
    "text",
    [
        "version: 2001-13-45\n",  # implicit timestamp -> datetime ValueError
        "mode: !!timestamp x\n",  # explicit tag on a non-date -> AttributeError inside PyYAML
        "[" * 1000,  # deep nesting -> RecursionError in the YAML composer
    ],
    ids=["bad-date", "bad-timestamp-tag", "deep-nesting"],
)
def test_config_yaml_constructor_errors_are_config_errors(text: str) -> None:
    with pytest.raises(ConfigError, match="invalid config"):
        load_config_text(text)


@pytest.mark.parametrize(
    "data",
    [
        {"resources": [{"name": "rdma/hca\n"}]},  # the kubelet (Go regexp) rejects it at Register
        {"resources": [{"selectors": {"vendors": ["15b3\n"]}}]},  # silently selects no NIC
        {"env": {"NCCL_X\n": "1"}},  # not an environment variable name
    ],
    ids=["resource-name", "vendor", "env-name"],
)
def test_config_trailing_newline_is_rejected(data: dict[str, Any]) -> None:
    """re.match(...$) accepts "x\\n"; the kubelet's Go regexps do not."""
    with pytest.raises(ConfigError, match="invalid config"):
        load_config_data(data)


# --------------------------------------------------------------------------- sysfs

NICS = 4
_ACTIVE_BY_CODE = {4: "ACTIVE", 5: "ACTIVE_DEFER"}


def oracle_active(raw: str | None) -> bool:
    """Independent of the reader: the kernel prints '<code>: <name>'; a bare code is tolerated."""
    if raw is None:
        return False
    m = re.fullmatch(r"([0-9]+)\s*(?::(.*))?", raw.strip(), flags=re.DOTALL)
    if not m:
        return False
    name = _ACTIVE_BY_CODE.get(int(m.group(1)))
    return name is not None and (m.group(2) is None or m.group(2).strip() in ("", name))


def _uverbs_index(i: int) -> int:
    return (i + 1) % NICS  # lingjun_node rotates uverbs numbering


_PAYLOAD = st.one_of(
    st.text(max_size=24),
    st.binary(max_size=24).map(lambda b: b.decode("latin-1")),
    st.integers().map(str),
    st.sampled_from(
        [
            "",
            " ",
            "\n",
            "4: ACTIVE",
            "5: ACTIVE_DEFER",
            "4",
            "x: ACTIVE",
            "1: ACTIVE",
            "4: DOWN",
            "9: ACTIVE",
            "4: ACTIVE\x00",
            " 4: ACTIVE \n",
            "-1",
            "0x15b3",
            "15b3",
            "99999999999999999999",
            "1e3",
        ]
    ),
)
# What can be wrong with one attribute file.
_FILE_FAULTS = st.one_of(
    st.tuples(st.just("write"), _PAYLOAD),
    st.sampled_from([("missing", ""), ("dir", ""), ("loop", ""), ("dangling", ""), ("eio", ""), ("eacces", "")]),
)
_NIC_FAULT = st.one_of(
    st.none(),
    st.tuples(st.sampled_from(["state", "numa_node", "vendor", "rate", "ibdev"]), _FILE_FAULTS),
    st.tuples(
        st.sampled_from(["ports_missing", "class_link_dangling", "device_link_dangling", "dev_node_missing"]),
        st.just(("", "")),
    ),
)


class _Tree:
    """A fixture node whose entries can be broken and put back quickly (the disk here is slow)."""

    def __init__(self, root: str) -> None:
        self.fx = fixtures.write_node(root, fixtures.lingjun_node(nics=NICS))
        self.undo: list[Callable[[], None]] = []
        self.failing: dict[str, int] = {}  # realpath -> errno raised by open()

    def nic_path(self, i: int, *parts: str) -> str:
        return os.path.join(self.fx.sysfs, "class", "infiniband", f"mlx5_bond_{i}", *parts)

    def pci_path(self, i: int, *parts: str) -> str:
        return os.path.join(os.path.realpath(self.nic_path(i, "device")), *parts)

    def _move_away(self, path: str) -> None:
        backup = path + ".fuzz-orig"
        os.rename(path, backup)

        def restore() -> None:
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            elif os.path.lexists(path):
                os.unlink(path)
            os.rename(backup, path)

        self.undo.append(restore)

    def break_file(self, path: str, fault: str, payload: str) -> None:
        if fault in ("eio", "eacces"):
            self.failing[os.path.realpath(path)] = errno.EIO if fault == "eio" else errno.EACCES
            return
        self._move_away(path)
        if fault == "write":
            Path(path).write_bytes(payload.encode("utf-8", "surrogatepass"))
        elif fault == "dir":
            os.mkdir(path)
        elif fault == "loop":
            os.symlink(os.path.basename(path), path)  # points at itself: ELOOP
        elif fault == "dangling":
            os.symlink("nowhere/" + os.path.basename(path), path)

    def relink(self, link: str, target: str) -> None:
        self._move_away(link)
        os.symlink(target, link)

    def restore(self) -> None:
        while self.undo:
            self.undo.pop()()
        self.failing.clear()

    @contextmanager
    def failing_reads(self) -> Iterator[None]:
        real_open = builtins.open

        def fake_open(file: Any, *args: Any, **kwargs: Any) -> Any:
            code = self.failing.get(os.path.realpath(file)) if isinstance(file, str) else None
            if code is not None:
                raise OSError(code, os.strerror(code), file)
            return real_open(file, *args, **kwargs)

        with mock.patch.object(sysfs, "open", fake_open, create=True):
            yield


@pytest.fixture(scope="module")
def tree() -> Iterator[_Tree]:
    base = "/dev/shm" if os.access("/dev/shm", os.W_OK) else "/tmp"
    root = tempfile.mkdtemp(prefix="rdp-fuzz-", dir=base)
    try:
        yield _Tree(os.path.join(root, "node"))
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _apply(tree: _Tree, i: int, kind: str, fault: tuple[str, str]) -> None:
    how, payload = fault
    if kind == "state":
        tree.break_file(tree.nic_path(i, "ports", "1", "state"), how, payload)
    elif kind in ("numa_node", "vendor"):
        tree.break_file(tree.pci_path(i, kind), how, payload)
    elif kind == "rate":
        tree.break_file(tree.nic_path(i, "ports", "1", "rate"), how, payload)
    elif kind == "ibdev":
        k = _uverbs_index(i)
        tree.break_file(os.path.join(tree.fx.sysfs, "class", "infiniband_verbs", f"uverbs{k}", "ibdev"), how, payload)
    elif kind == "ports_missing":
        tree._move_away(tree.nic_path(i, "ports"))
    elif kind == "class_link_dangling":
        tree.relink(tree.nic_path(i), "../../devices/pci0000:00/gone/infiniband/" + f"mlx5_bond_{i}")
    elif kind == "device_link_dangling":
        tree.relink(tree.nic_path(i, "device"), "../../../gone")
    elif kind == "dev_node_missing":
        tree._move_away(os.path.join(tree.fx.dev, "infiniband", f"uverbs{_uverbs_index(i)}"))


def _raw(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            return fh.read()
    except OSError:
        return None


def _expect(tree: _Tree, i: int) -> tuple[bool, bool, bool]:
    """(identifiable, selected by the default Mellanox selector, healthy) from the raw tree."""
    name = f"mlx5_bond_{i}"
    ib = tree.nic_path(i)
    if not os.path.isdir(ib) or not os.path.isdir(os.path.realpath(os.path.join(ib, "device"))):
        return False, False, False
    vendor_path = tree.pci_path(i, "vendor")
    vendor = None if os.path.realpath(vendor_path) in tree.failing else _raw(vendor_path)
    if vendor is None or not vendor.strip():
        return False, False, False
    selected = vendor.strip().lower().removeprefix("0x") == "15b3"
    state_path = tree.nic_path(i, "ports", "1", "state")
    state = None if os.path.realpath(state_path) in tree.failing else _raw(state_path)
    k = _uverbs_index(i)
    ibdev_path = os.path.join(tree.fx.sysfs, "class", "infiniband_verbs", f"uverbs{k}", "ibdev")
    ibdev = None if os.path.realpath(ibdev_path) in tree.failing else _raw(ibdev_path)
    uverbs_ok = ibdev is not None and ibdev.strip() == name
    dev_ok = os.path.exists(os.path.join(tree.fx.dev, "infiniband", f"uverbs{k}"))
    return True, selected, selected and oracle_active(state) and uverbs_ok and dev_ok


@settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(faults=st.lists(_NIC_FAULT, min_size=NICS, max_size=NICS))
def test_read_nics_never_raises_nor_reports_a_broken_nic_healthy(
    tree: _Tree, faults: list[Any], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.clear()
    try:
        for i, fault in enumerate(faults):
            if fault is not None:
                _apply(tree, i, fault[0], fault[1])
        with caplog.at_level(logging.WARNING, logger=sysfs.LOG.name), tree.failing_reads():
            nics = sysfs.read_nics(tree.fx.sysfs, tree.fx.dev)
            states = sysfs.read_port_states(tree.fx.sysfs, [n.name for n in nics])
        assert isinstance(nics, list)
        by_name = {n.name: n for n in nics}
        expected = {i: _expect(tree, i) for i in range(NICS)}
        # Exclusive pool: one device per selected NIC, health per NIC.
        pool = ResourcePool(PluginConfig(mode="exclusive").resources[0], PluginConfig(mode="exclusive"))
        pool.set_nics(nics)
        after_discovery = {d.id: d.health for d in pool.snapshot()[1]}
        pool.set_port_states(states)
        after_probe = {d.id: d.health for d in pool.snapshot()[1]}
        for d in pool.snapshot()[1]:
            encode_devices([d])  # what ListAndWatch sends: must encode (e.g. NUMA within int64)
        for i, (identifiable, selected, healthy) in expected.items():
            name = f"mlx5_bond_{i}"
            context = f"{name} fault={faults[i]!r}"
            if not identifiable:
                assert name not in by_name, context
                assert any(name in r.getMessage() for r in caplog.records), f"{context}: skipped without a log line"
                continue
            assert name in by_name, context
            nic = by_name[name]
            if nic.numa_node is not None:
                assert 0 <= nic.numa_node < 1024, context
            pci = nic.pci_address
            if not selected:
                assert pci not in after_discovery, context
                continue
            want = HEALTHY if healthy else "Unhealthy"
            assert after_discovery[pci] == want, context
            assert after_probe[pci] == want, context
            if not healthy:  # a NIC that is not usable says why (problems) or has no usable char device
                assert nic.problems or not (nic.uverbs and nic.uverbs.present) or not nic.all_ports_active, context
    finally:
        tree.restore()
    # the tree is whole again for the next example
    assert len(sysfs.read_nics(tree.fx.sysfs, tree.fx.dev)) == NICS


def test_serve_with_garbage_sysfs_keeps_serving_and_marks_broken_nics_unhealthy(
    short_tmp: Path, dp_dir: Path, sim: KubeletSimulator
) -> None:
    """The real process over a node with garbage state, a missing ports dir and a dangling NIC link."""
    fx = fixtures.write_node(str(short_tmp / "bad"), fixtures.lingjun_node(nics=4))
    ib = Path(fx.sysfs, "class", "infiniband")
    (ib / "mlx5_bond_0" / "ports" / "1" / "state").write_text("x: ACTIVE\n", encoding="utf-8")
    shutil.rmtree(ib / "mlx5_bond_1" / "ports")
    (ib / "mlx5_bond_2" / "ports" / "1" / "state").write_bytes(b"\xff\xfe\x00")
    os.symlink("../../devices/pci0000:00/gone/infiniband/ghost", ib / "ghost9")
    cfg = short_tmp / "excl.yaml"
    cfg.write_text(yaml.safe_dump({"mode": "exclusive", "health": {"intervalSeconds": 0.1}}), encoding="utf-8")
    log = short_tmp / "bad.log"
    with open(log, "w", encoding="utf-8") as out:
        proc = subprocess.Popen(
            serve_command(fx, dp_dir, cfg),
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        assert sim.wait_registered("rdma/hca", timeout=15), log.read_text()
        time.sleep(0.5)  # several probes over the garbage
        health = {i: d.health for i, d in sim.devices("rdma/hca").items()}
        assert health == {
            "0000:1a:00.0": "Unhealthy",  # garbage state
            "0000:3a:00.0": "Unhealthy",  # no ports dir
            "0000:5a:00.0": "Unhealthy",  # binary state
            "0000:7a:00.0": "Healthy",
        }
        assert proc.poll() is None
        text = log.read_text(encoding="utf-8")
        assert "Traceback" not in text
        assert "ghost9 left out" in text
    finally:
        proc.terminate()
        proc.wait(10)
