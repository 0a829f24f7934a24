"""The fast health probe: port-state files opened once, re-read with pread; a failed read re-lists."""

from __future__ import annotations

import builtins
import errno
import os

import pytest

from rdma_device_plugin.config import PluginConfig
from rdma_device_plugin.discovery import Discovery
from rdma_device_plugin.resources import HEALTHY, UNHEALTHY, build_pools
from rdma_device_plugin.server import Hooks
from rdma_node import fixtures, sysfs


class Count(Hooks):
    def __init__(self) -> None:
        self.relists = 0

    def rediscovered(self) -> None:
        self.relists += 1


def test_reader_sees_new_states_through_open_files(node: fixtures.FixtureNode) -> None:
    names = sysfs.list_rdma_devices(node.sysfs)
    reader = sysfs.PortStateReader(node.sysfs, names)
    try:
        assert reader.read() == {n: ("ACTIVE",) for n in names}
        node.set_port_state("mlx5_bond_2", "DOWN")
        assert reader.read() == {**{n: ("ACTIVE",) for n in names}, "mlx5_bond_2": ("DOWN",)}
        node.set_port_state("mlx5_bond_2", "ACTIVE")
        assert reader.read() == {n: ("ACTIVE",) for n in names}
    finally:
        reader.close()


def test_probe_opens_no_file(node: fixtures.FixtureNode, monkeypatch: pytest.MonkeyPatch) -> None:
    config = PluginConfig()
    pools = build_pools(config)
    discovery = Discovery(config, pools, node.sysfs, node.dev)
    discovery.full()
    opened: list[str] = []
    real_open = os.open

    real_builtin_open = builtins.open

    def counting_open(path: str, *args: object, **kwargs: object) -> object:
        opened.append(str(path))
        if isinstance(args[0] if args else kwargs.get("flags"), int):
            return real_open(path, *args, **kwargs)  # type: ignore[arg-type]
        return real_builtin_open(path, *args, **kwargs)  # type: ignore[call-overload]

    for state, health in (("DOWN", UNHEALTHY), ("ACTIVE", HEALTHY)):
        node.set_port_state("mlx5_bond_1", state)
        with monkeypatch.context() as m:
            m.setattr(os, "open", counting_open)
            m.setattr(builtins, "open", counting_open)
            discovery.probe()
        assert {d.health for d in pools[0].snapshot()[1]} == {health}
    discovery.close()
    assert opened == [], opened


def test_a_failed_read_relists(node: fixtures.FixtureNode, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a real node a removed device's sysfs attribute fails with ENODEV: the probe re-lists."""
    config = PluginConfig()
    hooks = Count()
    discovery = Discovery(config, build_pools(config), node.sysfs, node.dev, hooks=hooks)
    discovery.full()
    discovery.probe()
    assert hooks.relists == 1
    real_pread = os.pread

    def enodev(fd: int, n: int, offset: int) -> bytes:
        raise OSError(errno.ENODEV, os.strerror(errno.ENODEV))

    monkeypatch.setattr(os, "pread", enodev)
    discovery.probe()
    assert hooks.relists == 2
    monkeypatch.setattr(os, "pread", real_pread)
    discovery.probe()
    assert hooks.relists == 2  # the new reader works: no further re-list
    discovery.close()


def test_torn_read_is_read_again(node: fixtures.FixtureNode, monkeypatch: pytest.MonkeyPatch) -> None:
    """A value caught half-rewritten ("4: ACTIV") is read once more rather than reported UNKNOWN."""
    reader = sysfs.PortStateReader(node.sysfs, ["mlx5_bond_0"])
    real_pread = os.pread
    torn = [b"4: ACTIV"]

    def once_torn(fd: int, n: int, offset: int) -> bytes:
        return torn.pop() if torn else real_pread(fd, n, offset)

    monkeypatch.setattr(os, "pread", once_torn)
    assert reader.read() == {"mlx5_bond_0": ("ACTIVE",)}
    reader.close()


def test_a_nic_gone_before_its_ports_are_opened_fails_the_reader(node: fixtures.FixtureNode) -> None:
    """Listed by a re-list, removed before the reader opens its ports: with no descriptor to fail,
    the NIC would look present until the next device list; the reader must fail instead."""
    node.remove_nic("mlx5_bond_2")
    reader = sysfs.PortStateReader(node.sysfs, ["mlx5_bond_0", "mlx5_bond_2"])
    try:
        assert reader.read() is None
        assert "mlx5_bond_2 is gone" in reader.failed
    finally:
        reader.close()


def test_a_removed_nic_fails_the_reads_of_its_open_ports(node: fixtures.FixtureNode) -> None:
    """The fixture's stand-in for kernfs deactivation (ENODEV): an open state attribute reads empty."""
    reader = sysfs.PortStateReader(node.sysfs, ["mlx5_bond_0", "mlx5_bond_2"])
    try:
        assert reader.read() == {"mlx5_bond_0": ("ACTIVE",), "mlx5_bond_2": ("ACTIVE",)}
        node.remove_nic("mlx5_bond_2")
        assert reader.read() is None and "mlx5_bond_2" in reader.failed
    finally:
        reader.close()
