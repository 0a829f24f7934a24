"""affinity: per NIC the GPUs sharing its PCIe switch, root port or NUMA node, read from fixture
nodes through node.pcie, and what the plugin shows of it (NFD facts, metric labels)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from rdma_device_plugin import affinity
from rdma_node import fixtures, sysfs


def _read(tmp: Path, spec: fixtures.NodeSpec) -> affinity.NodeAffinity:
    fx = fixtures.write_node(str(tmp / "node"), spec)
    return affinity.read(fx.sysfs, sysfs.read_nics(fx.sysfs, fx.dev))


def test_lingjun_node_every_nic_has_two_gpus_under_its_switch(tmp_path: Path) -> None:
    node = _read(tmp_path, fixtures.lingjun_node())
    bond0 = node.nics["mlx5_bond_0"]
    assert bond0.switch == ("0000:18:00.0", "0000:19:00.0")
    assert bond0.root_port == bond0.switch  # the switch hangs off the root port: cumulative
    assert bond0.numa == ("0000:18:00.0", "0000:19:00.0", "0000:38:00.0", "0000:39:00.0")
    assert node.nics["mlx5_bond_3"].numa == ("0000:58:00.0", "0000:59:00.0", "0000:78:00.0", "0000:79:00.0")
    assert {a.closest for a in node.nics.values()} == {"switch"}
    assert len(node.gpus) == 8 and node.affine_nics == 4 and node.weakest == "switch"
    assert affinity.nfd_facts(node) == {"rdma-gpu-affine-nics": "4", "rdma-gpu-nic-affinity": "switch"}
    assert affinity.metric_labels(bond0) == (
        "0000:18:00.0,0000:19:00.0",
        "0000:18:00.0,0000:19:00.0",
        "0000:18:00.0,0000:19:00.0,0000:38:00.0,0000:39:00.0",
    )
    assert bond0.to_dict()["switch"] == ["0000:18:00.0", "0000:19:00.0"]


def test_gpus_moved_off_the_nic_switches_show_numa_affinity_only(tmp_path: Path) -> None:
    """GPUs under their own root ports (no shared switch): every NIC reaches GPUs through the CPU only."""
    spec = fixtures.lingjun_node()
    gpus = tuple(
        replace(
            g, pcie_path=(f"pci0000:{0xC0 + i:02x}", f"0000:{0xC0 + i:02x}:01.0"), address=f"0000:{0xC1 + i:02x}:00.0"
        )
        for i, g in enumerate(spec.gpus)
    )
    node = _read(tmp_path, replace(spec, gpus=gpus))
    assert {a.closest for a in node.nics.values()} == {"numa"}
    assert node.affine_nics == 0 and node.weakest == "numa"
    assert affinity.nfd_facts(node)["rdma-gpu-affine-nics"] == "0"


def test_a_gpu_on_a_numa_node_without_nics_is_the_weakest(tmp_path: Path) -> None:
    spec = fixtures.lingjun_node()
    gpus = (*spec.gpus, fixtures.GpuSpec(address="0000:e1:00.0", numa_node=2, pcie_path=("pci0000:e0", "0000:e0:01.0")))
    node = _read(tmp_path, replace(spec, gpus=gpus))
    assert node.gpu_closest["0000:e1:00.0"] == "none" and node.weakest == "none"


def test_a_node_without_gpus_has_no_gpu_labels(tmp_path: Path) -> None:
    node = _read(tmp_path, replace(fixtures.lingjun_node(), gpus=()))
    assert node.gpus == () and affinity.nfd_facts(node) == {}
    assert {a.closest for a in node.nics.values()} == {"none"}
    assert affinity.metric_labels(None) == ("", "", "")
