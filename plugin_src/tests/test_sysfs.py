"""Discovery reads kernel-shaped trees, symlinks included."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest

from rdma_node import fixtures, sysfs
from rdma_node.selectors import Selectors


def test_class_entries_are_symlinks_into_devices(node: fixtures.FixtureNode) -> None:
    link = Path(node.sysfs, "class", "infiniband", "mlx5_bond_0")
    assert link.is_symlink()
    # host bridge -> root port -> switch upstream port -> downstream port -> the NIC's PF0
    assert "/devices/pci0000:15/0000:15:01.0/0000:16:00.0/0000:17:02.0/0000:1a:00.0/infiniband/" in os.path.realpath(
        link
    )
    assert Path(link, "device").is_symlink()


def test_bonded_lingjun_node(node: fixtures.FixtureNode) -> None:
    nics = sysfs.read_nics(node.sysfs, node.dev)
    assert [n.name for n in nics] == ["mlx5_bond_0", "mlx5_bond_1", "mlx5_bond_2", "mlx5_bond_3"]
    bond0 = nics[0]
    assert bond0.pci_address == "0000:1a:00.0"
    assert (bond0.vendor, bond0.device_id, bond0.driver) == ("15b3", "1021", "mlx5_core")
    assert bond0.numa_node == 0 and nics[3].numa_node == 1
    assert set(bond0.netdevs) == {"eth0", "eth1", "bond0"}
    port = bond0.ports[0]
    assert (port.state, port.phys_state, port.link_layer) == ("ACTIVE", "LinkUp", "Ethernet")
    assert port.rate_gbps == 200.0
    assert any(g.type == "RoCE v2" and g.gid.startswith("2408:4005:0300:0000") and g.ndev == "bond0" for g in port.gids)
    assert bond0.fw_ver == "28.39.1002"
    assert not bond0.problems


def test_uverbs_found_through_ibdev_not_by_number(node: fixtures.FixtureNode) -> None:
    nics = {n.name: n for n in sysfs.read_nics(node.sysfs, node.dev)}
    # The fixture rotates numbering: mlx5_bond_0 owns uverbs1, mlx5_bond_3 owns uverbs0.
    assert nics["mlx5_bond_0"].uverbs is not None and nics["mlx5_bond_0"].uverbs.name == "uverbs1"
    assert nics["mlx5_bond_3"].uverbs is not None and nics["mlx5_bond_3"].uverbs.node_path == "/dev/infiniband/uverbs0"
    assert [c.name for c in nics["mlx5_bond_0"].umad] == ["umad1"]
    assert nics["mlx5_bond_0"].umad[0].port == 1


def test_node_paths_ignore_dev_root(node: fixtures.FixtureNode) -> None:
    nic = sysfs.read_nics(node.sysfs, node.dev)[0]
    assert nic.uverbs is not None and nic.uverbs.present
    assert nic.uverbs.node_path.startswith("/dev/infiniband/")
    assert sysfs.rdma_cm(node.dev).present
    assert not sysfs.rdma_cm(str(Path(node.root, "nowhere"))).present


def test_plain_infiniband_ports_and_numa_unknown(short_tmp: Path) -> None:
    spec = fixtures.lingjun_node(nics=2, bond=False, link_layer="InfiniBand", numa_nodes=0)
    fx = fixtures.write_node(str(short_tmp / "ib"), spec)
    nics = sysfs.read_nics(fx.sysfs, fx.dev)
    assert [n.name for n in nics] == ["mlx5_0", "mlx5_1"]
    assert all(n.numa_node is None for n in nics)
    assert nics[0].link_layers == ("InfiniBand",)
    assert nics[0].netdevs == ("eth0",)
    assert nics[0].ports[0].rate.startswith("400")


def test_missing_char_device_and_down_port(short_tmp: Path) -> None:
    spec = fixtures.with_nic_changes(
        fixtures.lingjun_node(nics=2), "mlx5_bond_1", char_device=False, port_state="DOWN", phys_state="Disabled"
    )
    fx = fixtures.write_node(str(short_tmp / "n"), spec)
    nic = {n.name: n for n in sysfs.read_nics(fx.sysfs, fx.dev)}["mlx5_bond_1"]
    assert nic.uverbs is not None and not nic.uverbs.present
    assert nic.ports[0].state == "DOWN" and nic.ports[0].phys_state == "Disabled"
    assert not nic.all_ports_active


def test_dangling_and_garbage_entries_are_skipped_or_flagged(node: fixtures.FixtureNode) -> None:
    os.symlink("../../devices/nowhere/infiniband/ghost", os.path.join(node.sysfs, "class", "infiniband", "ghost0"))
    state = Path(node.sysfs, "class", "infiniband", "mlx5_bond_1", "ports", "1", "state")
    state.write_text("garbage\n", encoding="utf-8")
    nics = {n.name: n for n in sysfs.read_nics(node.sysfs, node.dev)}
    assert "ghost0" not in nics
    assert nics["mlx5_bond_1"].ports[0].state == "UNKNOWN"
    assert nics["mlx5_bond_1"].problems


def test_remove_and_port_states(node: fixtures.FixtureNode) -> None:
    node.set_port_state("mlx5_bond_2", "DOWN")
    node.remove_nic("mlx5_bond_3")
    states = sysfs.read_port_states(node.sysfs, ["mlx5_bond_0", "mlx5_bond_2", "mlx5_bond_3"])
    assert states == {"mlx5_bond_0": ("ACTIVE",), "mlx5_bond_2": ("DOWN",), "mlx5_bond_3": None}
    assert "mlx5_bond_3" not in sysfs.list_rdma_devices(node.sysfs)
    assert not os.path.exists(os.path.join(node.dev, "infiniband", "uverbs0"))


def test_modules_and_netns(node: fixtures.FixtureNode, short_tmp: Path) -> None:
    assert sysfs.loaded_modules(node.sysfs, ["mlx5_core", "rdma_rxe"]) == {
        "mlx5_core": True,
        "rdma_rxe": False,
    }
    assert sysfs.module_version(node.sysfs, "mlx5_core") == "24.10-1.1.4"
    assert sysfs.netns_mode(node.sysfs) == "shared"
    spec = fixtures.NodeSpec(nics=(), netns_mode="exclusive")
    fx = fixtures.write_node(str(short_tmp / "x"), spec)
    assert sysfs.netns_mode(fx.sysfs) == "exclusive"


def test_selectors_pick_only_mellanox(short_tmp: Path) -> None:
    fx = fixtures.write_node(str(short_tmp / "m"), fixtures.lingjun_node(nics=2, extra_non_mellanox=True))
    nics = sysfs.read_nics(fx.sysfs, fx.dev)
    assert len(nics) == 3
    assert [n.name for n in Selectors().select(nics)] == ["mlx5_bond_0", "mlx5_bond_1"]
    assert [n.name for n in Selectors(vendors=("8086",)).select(nics)] == ["irdma0"]
    assert [n.name for n in Selectors(vendors=(), drivers=("ice",)).select(nics)] == ["irdma0"]
    assert [n.name for n in Selectors(if_names=("bond1",)).select(nics)] == ["mlx5_bond_1"]
    assert [n.name for n in Selectors(rdma_devices=("mlx5_bond_0",)).select(nics)] == ["mlx5_bond_0"]
    assert Selectors(link_types=("InfiniBand",)).select(nics) == []
    assert len(Selectors(device_ids=("0x1021",)).select(nics)) == 2
    assert Selectors.from_mapping({"vendors": ["15b3"], "ifNames": ["bond0"]}).if_names == ("bond0",)


def test_empty_dev_root_reads_char_device_presence_from_sysfs(node: fixtures.FixtureNode) -> None:
    """The chart mounts no host /dev: with dev_root "" a char device is present when its sysfs entry
    has the ``dev`` attribute devtmpfs creates the node from; same answer as looking in /dev."""
    from_dev = sysfs.read_nics(node.sysfs, node.dev)
    from_sysfs = sysfs.read_nics(node.sysfs, "")

    def chars(nics: list[sysfs.Nic]) -> list[tuple[object, ...]]:
        return [(n.name, n.uverbs, n.umad, n.issm) for n in nics]

    assert chars(from_sysfs) == chars(from_dev)
    assert all(n.uverbs is not None and n.uverbs.present for n in from_sysfs)
    assert sysfs.rdma_cm("", node.sysfs).present and sysfs.rdma_cm(node.dev).present
    # a class entry without its dev attribute (the device is going away) is not handed out
    entry = os.path.join(node.sysfs, "class", "infiniband_verbs", "uverbs1")
    os.unlink(os.path.join(os.path.realpath(entry), "dev"))
    nics = {n.name: n for n in sysfs.read_nics(node.sysfs, "")}
    assert nics["mlx5_bond_0"].uverbs is not None and not nics["mlx5_bond_0"].uverbs.present
    assert sum(1 for n in nics.values() if n.uverbs is not None and n.uverbs.present) == 3


def test_empty_dev_root_without_rdma_ucm(tmp_path: Path) -> None:
    node = fixtures.write_node(str(tmp_path / "n"), dataclasses.replace(fixtures.lingjun_node(), rdma_cm=False))
    assert not sysfs.rdma_cm("", node.sysfs).present and not sysfs.rdma_cm(node.dev).present


@pytest.mark.parametrize(("text", "nodes"), [("0", (0,)), ("0-1", (0, 1)), ("0,2-3", (0, 2, 3)), ("1-1\n", (1,))])
def test_numa_node_list_is_read_in_the_kernel_list_form(text: str, nodes: tuple[int, ...]) -> None:
    assert sysfs.parse_node_list(text) == nodes


@pytest.mark.parametrize("text", ["", "a", "3-1", "-1", "0-1024"])
def test_bad_numa_node_lists_are_refused(text: str) -> None:
    with pytest.raises(ValueError):
        sysfs.parse_node_list(text)


def test_numa_nodes_of_a_fixture_node_and_of_a_tree_without_them(node: fixtures.FixtureNode, tmp_path: Path) -> None:
    assert sysfs.numa_nodes(node.sysfs) == (0, 1)
    assert sysfs.numa_nodes(str(tmp_path)) == ()
    online = Path(node.sysfs, "devices", "system", "node", "online")
    online.write_text("garbage\n")
    assert sysfs.numa_nodes(node.sysfs) == ()
