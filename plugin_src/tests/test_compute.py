"""node.compute and the SR-IOV reader: which RDMA devices a node validation holds to the RoCE/NCCL settings."""

from __future__ import annotations

from pathlib import Path

import pytest

from rdma_device_plugin.node import compute, fixtures, sysfs


def _read(root: Path, spec: fixtures.NodeSpec) -> list[sysfs.Nic]:
    node = fixtures.write_node(str(root), spec)
    return sysfs.read_nics(node.sysfs, node.dev)


def test_vfs_are_read_as_such_and_never_compute(short_tmp: Path) -> None:
    nics = {n.name: n for n in _read(short_tmp / "n", fixtures.sriov_node())}
    pf, idle, in_pod = nics["mlx5_0"], nics["mlx5_2"], nics["mlx5_3"]
    assert (pf.physfn, pf.vfs) == ("", 8)
    # drivers/pci/iov.c: the VF's physfn link names its PF
    assert (idle.physfn, in_pod.physfn) == ("0000:1a:00.0", "0000:1a:00.0") and idle.is_vf
    assert idle.pci_address == "0000:1a:00.2" and in_pod.pci_address == "0000:1a:00.3"
    assert idle.ports[0].state == "DOWN" and idle.netdevs == ("eth0v0",)
    # the pod's netdev is not the host's: its GIDs name one the host does not have
    assert in_pod.ports[0].active and {g.ndev for g in in_pod.ports[0].gids} == {"net1"}
    roles = compute.classify(list(nics.values()), compute.Compute())
    assert [n.name for n in roles.compute] == ["mlx5_0", "mlx5_1"]
    assert roles.vf_devices == ["mlx5_2", "mlx5_3", "mlx5_4", "mlx5_5"] and roles.vfs == 16 and roles.other == {}


def test_storage_ports_of_an_infiniband_node_are_not_compute(short_tmp: Path) -> None:
    nics = _read(short_tmp / "n", fixtures.dgx_h100_node())
    roles = compute.classify(nics, compute.Compute())
    assert [n.name for n in roles.compute] == [f"mlx5_{i}" for i in range(8)] and roles.link_types == ("InfiniBand",)
    assert roles.other == {
        "mlx5_8": "Ethernet on a node whose compute ports are InfiniBand",
        "mlx5_9": "Ethernet on a node whose compute ports are InfiniBand",
    }
    # given explicitly, the storage ports can be compute too (a RoCE-only node's choice)
    both = compute.classify(nics, compute.Compute(link_types=("Ethernet", "InfiniBand")))
    assert len(both.compute) == 10 and both.other == {}


def test_the_compute_network_separates_roce_storage_ports(short_tmp: Path) -> None:
    spec = fixtures.ipv4_roce_node()
    storage = fixtures.NicSpec(
        name="mlx5_4", pci_address="0000:a0:00.0", uverbs=4, netdevs=("ens8f0",), ipv4=("192.168.100.11",), mtu=1500
    )
    nics = _read(short_tmp / "n", fixtures.NodeSpec(nics=(*spec.nics, storage)))
    roles = compute.classify(nics, compute.Compute(networks=("10.0.0.0/16",)))
    assert [n.name for n in roles.compute] == [f"mlx5_bond_{i}" for i in range(4)]
    assert roles.other == {"mlx5_4": "no RoCE v2 GID on the compute network (192.168.100.11)"}
    # the per-node override names them outright; a name the node lacks is reported
    named = compute.classify(nics, compute.Compute(nics=("mlx5_bond_0", "mlx5_9")))
    assert [n.name for n in named.compute] == ["mlx5_bond_0"] and named.missing == ["mlx5_9"]
    assert named.other["mlx5_4"] == "not in compute_nics"


@pytest.mark.parametrize(
    ("options", "error"),
    [
        ({"link_types": ("ethernet",)}, "compute_link_types must be Ethernet and/or InfiniBand, not ['ethernet']"),
        ({"networks": ("10.0.0/8x",)}, "compute_networks: '10.0.0/8x' is not a network"),
    ],
)
def test_bad_selectors_name_the_option(options: dict[str, tuple[str, ...]], error: str) -> None:
    with pytest.raises(ValueError, match=None) as caught:
        compute.Compute(**options)
    assert error in str(caught.value)
