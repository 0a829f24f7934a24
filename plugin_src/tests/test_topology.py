"""node.pcie (the PCI reader) and node.topology (GPU-NIC affinity, pure): on the fixture's PCIe tree,
on hand-made placements, and on this machine's real /sys."""

from __future__ import annotations

from pathlib import Path

import pytest

from rdma_node import fixtures, pcie, sysfs, topology
from rdma_node.topology import Placement


@pytest.mark.parametrize(
    ("text", "gts"),
    [
        ("32.0 GT/s PCIe", 32.0),  # Linux 5.x+: pci_speed_string()
        ("2.5 GT/s PCIe", 2.5),
        ("8 GT/s", 8.0),  # before: "%s GT/s"
        ("Unknown", None),  # a link that is down
        ("Unknown speed", None),
        ("", None),
        (None, None),
    ],
)
def test_parse_speed(text: str | None, gts: float | None) -> None:
    assert pcie.parse_speed(text) == gts


def test_gpus_and_nics_in_the_fixture_tree(node: fixtures.FixtureNode) -> None:
    gpus = pcie.read_gpus(node.sysfs)
    assert [g.address for g in gpus] == [g.address for g in fixtures.lingjun_node().gpus]
    first = gpus[0]
    assert first.is_gpu and first.vendor == "10de" and first.pci_class == "030200" and first.driver == "nvidia"
    assert first.path == ("pci0000:15", "0000:15:01.0", "0000:16:00.0", "0000:17:00.0", "0000:18:00.0")
    assert first.link is not None and (first.link.speed, first.link.width) == (2.5, 16)
    assert (first.link.expected_speed, first.link.expected_width) == (32.0, 16)
    nic = pcie.read_function(node.sysfs, "0000:1a:00.0")
    assert nic is not None and not nic.is_gpu and nic.numa_node == 0 and nic.driver == "mlx5_core"
    bridge = pcie.read_function(node.sysfs, "0000:16:00.0")
    assert bridge is not None and bridge.pci_class == "060400" and not bridge.is_gpu
    assert pcie.read_function(node.sysfs, "0000:ff:00.0") is None


def test_affinity_of_the_fixture_node(node: fixtures.FixtureNode) -> None:
    gpus = [topology.placement(g) for g in pcie.read_gpus(node.sysfs)]
    nics = {}
    for nic in sysfs.read_nics(node.sysfs, node.dev):
        fn = pcie.read_function(node.sysfs, nic.pci_address)
        assert fn is not None
        nics[nic.name] = topology.placement(fn)
    mapped = topology.node_map(nics, gpus)
    assert mapped["mlx5_bond_1"] == {
        "switch": ("0000:38:00.0", "0000:39:00.0"),
        "root_port": ("0000:38:00.0", "0000:39:00.0"),
        "numa": ("0000:18:00.0", "0000:19:00.0", "0000:38:00.0", "0000:39:00.0"),
    }
    assert topology.closest_nics(gpus[0], nics) == ("switch", ("mlx5_bond_0",))
    assert topology.closest_nics(gpus[-1], {"mlx5_bond_0": nics["mlx5_bond_0"]}) == (None, ())


def _p(address: str, *bridges: str, numa: int | None = 0) -> Placement:
    return Placement(address, (*bridges, address), numa)


@pytest.mark.parametrize(
    ("a", "b", "level"),
    [
        # behind one switch (two downstream ports of the same upstream port)
        (_p("0000:18:00.0", "pci0000:15", "0000:15:01.0", "0000:16:00.0", "0000:17:00.0"),
         _p("0000:1a:00.0", "pci0000:15", "0000:15:01.0", "0000:16:00.0", "0000:17:02.0"), "switch"),
        # one directly under the root port, the other behind a switch below it
        (_p("0000:16:00.0", "pci0000:15", "0000:15:01.0"),
         _p("0000:1a:00.0", "pci0000:15", "0000:15:01.0", "0000:16:00.0", "0000:17:02.0"), "root_port"),
        # two root ports of one host bridge: through the CPU, same NUMA node
        (_p("0000:16:00.0", "pci0000:15", "0000:15:01.0"), _p("0000:17:00.0", "pci0000:15", "0000:15:02.0"), "numa"),
        # different host bridges on one NUMA node
        (_p("0000:18:00.0", "pci0000:15", "0000:15:01.0"), _p("0000:38:00.0", "pci0000:35", "0000:35:01.0"), "numa"),
        # different NUMA nodes, or unknown ones
        (_p("0000:18:00.0", "pci0000:15", "0000:15:01.0"),
         _p("0000:58:00.0", "pci0000:55", "0000:55:01.0", numa=1), None),
        (_p("0000:18:00.0", "pci0000:15", "0000:15:01.0", numa=None),
         _p("0000:38:00.0", "pci0000:35", "0000:35:01.0", numa=None), None),
        # attached to the host bridge itself
        (_p("0000:00:03.0", "pci0000:00"), _p("0000:00:04.0", "pci0000:00"), "numa"),
    ],
)  # fmt: skip
def test_shared_level(a: Placement, b: Placement, level: str | None) -> None:
    assert topology.shared_level(a, b) == level
    assert topology.shared_level(b, a) == level


def test_affinity_is_cumulative() -> None:
    nic = _p("0000:1a:00.0", "pci0000:15", "0000:15:01.0", "0000:16:00.0", "0000:17:02.0")
    gpus = [
        _p("0000:18:00.0", "pci0000:15", "0000:15:01.0", "0000:16:00.0", "0000:17:00.0"),
        _p("0000:15:02.0", "pci0000:15", "0000:15:01.0"),
        _p("0000:38:00.0", "pci0000:35", "0000:35:01.0"),
        _p("0000:58:00.0", "pci0000:55", "0000:55:01.0", numa=1),
    ]
    assert topology.affinity(nic, gpus) == {
        "switch": ("0000:18:00.0",),
        "root_port": ("0000:15:02.0", "0000:18:00.0"),
        "numa": ("0000:15:02.0", "0000:18:00.0", "0000:38:00.0"),
    }


def test_the_real_sys_reads_without_error() -> None:
    if not Path("/sys/bus/pci/devices").is_dir():
        pytest.skip("no /sys/bus/pci on this machine")
    addresses = pcie.list_addresses("/sys")
    functions = [pcie.read_function("/sys", a) for a in addresses]
    assert functions and all(f is not None and f.path[0].startswith("pci") for f in functions)
    # a conventional PCI function (virtio) has no link attributes; a PCIe one has all four
    for f in functions:
        assert f is not None
        has_link = Path("/sys/bus/pci/devices", f.address, "current_link_width").exists()
        assert (f.link is not None) == has_link
    assert [g.address for g in pcie.read_gpus("/sys")] == [f.address for f in functions if f and f.is_gpu]
