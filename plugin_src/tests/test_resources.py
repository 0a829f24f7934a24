"""Pool logic without gRPC: devices, health policies, allocation, preferred allocation."""

from __future__ import annotations

import pytest

from rdma_device_plugin.config import load_config_text
from rdma_device_plugin.resources import AllocationError, ResourcePool, build_pools, preferred_allocation
from rdma_node import fixtures, sysfs


def pool_for(node: fixtures.FixtureNode, text: str = "") -> ResourcePool:
    pool = build_pools(load_config_text(text or "{}"))[0]
    pool.set_nics(sysfs.read_nics(node.sysfs, node.dev))
    return pool


def healthy(pool: ResourcePool) -> int:
    return sum(d.health == "Healthy" for d in pool.snapshot()[1])


def test_shared_pool_is_1000_devices_with_stable_ids(node: fixtures.FixtureNode) -> None:
    pool = pool_for(node)
    devices = pool.snapshot()[1]
    assert len(devices) == 1000 and healthy(pool) == 1000
    assert devices[0].id == "hca-0" and devices[-1].id == "hca-999"
    assert all(d.numa_node is None for d in devices)
    again = pool_for(node)
    assert [d.id for d in again.snapshot()[1]] == [d.id for d in devices]


def test_shared_allocate_hands_out_every_nic(node: fixtures.FixtureNode) -> None:
    alloc = pool_for(node, "env: {NCCL_IB_GID_INDEX: '3'}").allocate(["hca-7"])
    paths = [d.host_path for d in alloc.devices]
    assert paths == [f"/dev/infiniband/uverbs{i}" for i in (1, 2, 3, 0)] + ["/dev/infiniband/rdma_cm"]
    assert all(d.container_path == d.host_path and d.permissions == "rw" for d in alloc.devices)
    assert alloc.envs == {
        "RDMA_DEVICES": "mlx5_bond_0,mlx5_bond_1,mlx5_bond_2,mlx5_bond_3",
        "NCCL_IB_HCA": "=mlx5_bond_0,mlx5_bond_1,mlx5_bond_2,mlx5_bond_3",  # workloadEnv (docs/nccl.md)
        "UCX_NET_DEVICES": "mlx5_bond_0:1,mlx5_bond_1:1,mlx5_bond_2:1,mlx5_bond_3:1",
        "NCCL_IB_GID_INDEX": "3",  # the config's env wins over the computed one (here the same index)
    }


def test_umad_and_issm_when_configured(node: fixtures.FixtureNode) -> None:
    alloc = pool_for(node, "charDevices: {umad: true, issm: true}").allocate(["hca-0"])
    names = [d.host_path.rsplit("/", 1)[1] for d in alloc.devices]
    assert {"umad1", "issm1", "uverbs1", "rdma_cm"} <= set(names)


def test_unknown_device_is_an_error(node: fixtures.FixtureNode) -> None:
    with pytest.raises(AllocationError, match=r"unknown device ID\(s\) \['hca-1000'\]"):
        pool_for(node).allocate(["hca-1000"])


@pytest.mark.parametrize(("policy", "after_down"), [("all", 0), ("any", 1000)])
def test_health_policy(node: fixtures.FixtureNode, policy: str, after_down: int) -> None:
    pool = pool_for(node, f"health: {{policy: {policy}}}")
    node.set_port_state("mlx5_bond_1", "DOWN")
    assert pool.set_port_states(sysfs.read_port_states(node.sysfs, sysfs.list_rdma_devices(node.sysfs))) == (
        policy == "all"
    )
    assert healthy(pool) == after_down
    node.set_port_state("mlx5_bond_1", "ACTIVE")
    pool.set_port_states(sysfs.read_port_states(node.sysfs, sysfs.list_rdma_devices(node.sysfs)))
    assert healthy(pool) == 1000


def test_vanished_nic_is_unhealthy_and_never_handed_out(node: fixtures.FixtureNode) -> None:
    pool = pool_for(node)
    node.remove_nic("mlx5_bond_2")
    pool.set_nics(sysfs.read_nics(node.sysfs, node.dev))
    assert healthy(pool) == 0  # policy all: a NIC that disappeared fails the pool until it returns
    alloc = pool.allocate(["hca-0"])
    assert "mlx5_bond_2" not in alloc.envs["RDMA_DEVICES"]
    assert "/dev/infiniband/uverbs3" not in [d.host_path for d in alloc.devices]


def test_no_selected_nic_advertises_nothing(node: fixtures.FixtureNode) -> None:
    pool = pool_for(node, "resources: [{name: rdma/hca, selectors: {vendors: ['8086']}}]")
    assert pool.snapshot()[1] == ()


def test_exclusive_devices_are_pci_addresses_with_numa(node: fixtures.FixtureNode) -> None:
    pool = pool_for(node, "mode: exclusive")
    devices = pool.snapshot()[1]
    assert [(d.id, d.numa_node) for d in devices] == [
        ("0000:1a:00.0", 0),
        ("0000:3a:00.0", 0),
        ("0000:5a:00.0", 1),
        ("0000:7a:00.0", 1),
    ]
    alloc = pool.allocate(["0000:5a:00.0"])
    assert [d.host_path for d in alloc.devices] == ["/dev/infiniband/uverbs3", "/dev/infiniband/rdma_cm"]
    assert alloc.envs["RDMA_DEVICES"] == "mlx5_bond_2"
    node.set_port_state("mlx5_bond_0", "DOWN")
    pool.set_port_states(sysfs.read_port_states(node.sysfs, sysfs.list_rdma_devices(node.sysfs)))
    assert [d.health for d in pool.snapshot()[1]] == ["Unhealthy", "Healthy", "Healthy", "Healthy"]


NUMA = {"a0": 0, "a1": 0, "b0": 1, "b1": 1, "b2": 1, "c0": 2, "x": None}


@pytest.mark.parametrize(
    ("available", "must", "size", "expected"),
    [
        (list(NUMA), [], 2, ["a0", "a1"]),  # best fit: the smallest NUMA node that holds 2
        (list(NUMA), [], 3, ["b0", "b1", "b2"]),
        (list(NUMA), [], 1, ["c0"]),
        (list(NUMA), ["b1"], 3, ["b1", "b0", "b2"]),  # must_include first, then its own node
        (list(NUMA), ["a0"], 3, ["a0", "a1", "c0"]),
        (list(NUMA), [], 7, ["b0", "b1", "b2", "a0", "a1", "c0", "x"]),
        (["a0", "b0"], ["zz"], 1, ["a0"]),  # never an ID outside available
        (["a0"], [], 3, ["a0"]),
        (list(NUMA), ["c0", "a0"], 2, ["c0", "a0"]),
    ],
)
def test_preferred_allocation(available: list[str], must: list[str], size: int, expected: list[str]) -> None:
    assert preferred_allocation(available, must, size, NUMA) == expected
