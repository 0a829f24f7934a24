"""numa_pools: the pools numaPools makes, their device IDs and NUMA nodes, their NICs, and the
kubelet's message limit checked on the exact wire size (compared with protobuf's own)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from rdma_device_plugin import cdi, numa_pools
from rdma_device_plugin.api import deviceplugin_pb2 as pb
from rdma_device_plugin.config import ConfigError, load_config_data
from rdma_device_plugin.resources import RDMA_CM_PATH as RDMA_CM
from rdma_device_plugin.resources import ResourcePool, build_pools
from rdma_node import fixtures, sysfs


def test_numa_pools_make_a_pool_per_numa_node_and_a_local_pool() -> None:
    cfg = load_config_data({"resources": [{"numaPools": True, "sharedDevices": 3}, {"name": "rdma/ib"}]})
    specs = numa_pools.pool_specs(cfg, (1, 0))
    assert [(s.name, s.kind, s.numa_nodes, s.configured) for s in specs] == [
        ("rdma/hca", "whole", (), "rdma/hca"),
        ("rdma/hca-numa0", "numa", (0,), "rdma/hca"),
        ("rdma/hca-numa1", "numa", (1,), "rdma/hca"),
        ("rdma/hca-local", "local", (0, 1), "rdma/hca"),
        ("rdma/ib", "whole", (), "rdma/ib"),
    ]
    assert specs[0].devices() == (("hca-0", None), ("hca-1", None), ("hca-2", None))
    assert specs[2].devices() == (("hca-numa1-0", 1), ("hca-numa1-1", 1), ("hca-numa1-2", 1))
    assert [d for d, _ in specs[3].devices()] == [f"hca-local-{n}-{i}" for n in (0, 1) for i in range(3)]
    assert {n for _, n in specs[3].devices()} == {0, 1}
    assert all(not s.resource.numa_pools for s in specs[1:4])  # derived pools do not split again


def test_without_the_option_the_config_is_served_as_written() -> None:
    cfg = load_config_data({"resources": [{"name": "rdma/a"}, {"name": "rdma/b"}]})
    assert [s.name for s in numa_pools.pool_specs(cfg, (0, 1))] == ["rdma/a", "rdma/b"]
    # and with it, on a node whose NUMA nodes cannot be read: nothing to split by
    split = load_config_data({"resources": [{"name": "rdma/a", "numaPools": True}]})
    assert [s.name for s in numa_pools.pool_specs(split, ())] == ["rdma/a"]


def test_each_pool_hands_out_the_nics_of_its_numa_nodes(node: fixtures.FixtureNode) -> None:
    nics = sysfs.read_nics(node.sysfs, node.dev)
    specs = {s.name: s for s in numa_pools.pool_specs(load_config_data({"resources": [{"numaPools": True}]}), (0, 1))}
    assert [n.name for n in specs["rdma/hca-numa0"].nics(nics)] == ["mlx5_bond_0", "mlx5_bond_1"]
    assert [n.name for n in specs["rdma/hca-numa1"].nics(nics)] == ["mlx5_bond_2", "mlx5_bond_3"]
    assert len(specs["rdma/hca-local"].nics(nics)) == 4 and len(specs["rdma/hca"].nics(nics)) == 4


def test_a_nic_without_numa_node_is_only_in_the_whole_pool(short_tmp: Path) -> None:
    fx = fixtures.write_node(str(short_tmp / "n"), fixtures.lingjun_node(numa_nodes=0))
    nics = sysfs.read_nics(fx.sysfs, fx.dev)
    specs = numa_pools.pool_specs(load_config_data({"resources": [{"numaPools": True}]}), sysfs.numa_nodes(fx.sysfs))
    assert [s.name for s in specs] == ["rdma/hca", "rdma/hca-numa0", "rdma/hca-local"]
    assert [len(s.nics(nics)) for s in specs] == [4, 0, 0]
    [line] = numa_pools.without_numa(specs, {"rdma/hca": nics})
    assert line.startswith("NIC(s) mlx5_bond_0, mlx5_bond_1, mlx5_bond_2, mlx5_bond_3 have no NUMA node")


@pytest.mark.parametrize(("device_id", "numa"), [("hca-1", None), ("hca-numa0-999", 0), ("hca-local-7-99999", 7)])
def test_device_bytes_is_the_wire_size(device_id: str, numa: int | None) -> None:
    msg = pb.ListAndWatchResponse()
    device = msg.devices.add(ID=device_id, health="Unhealthy")
    if numa is not None:
        device.topology.nodes.add(ID=numa)
    assert numa_pools.device_bytes(device_id, numa) == msg.ByteSize()


def test_a_local_pool_over_the_message_limit_is_refused_with_the_key() -> None:
    cfg = load_config_data({"resources": [{"numaPools": True, "sharedDevices": 60000}]})
    assert numa_pools.snapshot_problems(numa_pools.pool_specs(cfg, (0,))) == []
    [problem] = numa_pools.snapshot_problems(numa_pools.pool_specs(cfg, (0, 1, 2, 3)))
    assert problem.startswith("resources[rdma/hca]: numaPools makes rdma/hca-local with 240000 devices")
    assert problem.endswith("lower sharedDevices")


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"mode": "exclusive", "resources": [{"numaPools": True}]}, "applies to shared mode only"),
        ({"resources": [{"numaPools": True}, {"name": "rdma/hca-numa3"}]}, "numaPools of rdma/hca makes"),
        ({"resources": [{"numaPools": True}, {"name": "rdma/hca-local"}]}, "numaPools of rdma/hca makes"),
        ({"resources": [{"numaPools": True}, {"name": "rdma/hca.numa1"}]}, "share a socket name with"),
        ({"resources": [{"name": "rdma/" + "a" * 55, "numaPools": True}]}, "numaPools makes names like"),
    ],
)
def test_config_refuses_numa_pools_that_cannot_work(data: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config_data(data)


# ------------------------------------------------------------ the pools serving them (resources.py)


def _pools(node: fixtures.FixtureNode, **resource: object) -> dict[str, ResourcePool]:
    config = load_config_data({"resources": [{"numaPools": True, **resource}]})
    pools = build_pools(config, sysfs.numa_nodes(node.sysfs))
    nics = sysfs.read_nics(node.sysfs, node.dev)
    for pool in pools:
        pool.set_nics(nics)
    return {p.name: p for p in pools}


def test_per_numa_pools_carry_their_node_and_hand_out_its_nics(node: fixtures.FixtureNode) -> None:
    pools = _pools(node, sharedDevices=5)
    assert list(pools) == ["rdma/hca", "rdma/hca-numa0", "rdma/hca-numa1", "rdma/hca-local"]
    _, whole = pools["rdma/hca"].snapshot()
    assert {d.numa_node for d in whole} == {None} and len(whole) == 5  # unchanged: no topology
    _, numa1 = pools["rdma/hca-numa1"].snapshot()
    assert [(d.id, d.numa_node) for d in numa1][:2] == [("hca-numa1-0", 1), ("hca-numa1-1", 1)]
    alloc = pools["rdma/hca-numa1"].allocate(["hca-numa1-3"])
    assert alloc.nics == ("mlx5_bond_2", "mlx5_bond_3")
    assert alloc.envs["NCCL_IB_HCA"] == "=mlx5_bond_2,mlx5_bond_3"
    assert alloc.envs["UCX_NET_DEVICES"] == "mlx5_bond_2:1,mlx5_bond_3:1"
    assert alloc.envs["NCCL_IB_GID_INDEX"] == "3"
    assert [d.host_path for d in alloc.devices] == ["/dev/infiniband/uverbs3", "/dev/infiniband/uverbs0", RDMA_CM]


def test_the_local_pool_hands_out_the_nics_of_its_devices_nodes(node: fixtures.FixtureNode) -> None:
    pool = _pools(node, sharedDevices=3)["rdma/hca-local"]
    _, devices = pool.snapshot()
    assert [(d.id, d.numa_node) for d in devices] == [(f"hca-local-{n}-{i}", n) for n in (0, 1) for i in range(3)]
    assert pool.allocate(["hca-local-0-2"]).nics == ("mlx5_bond_0", "mlx5_bond_1")
    assert pool.allocate(["hca-local-1-0", "hca-local-1-2"]).nics == ("mlx5_bond_2", "mlx5_bond_3")
    both = pool.allocate(["hca-local-1-0", "hca-local-0-0"])  # no policy: the kubelet may mix nodes
    assert both.nics == tuple(f"mlx5_bond_{i}" for i in range(4))
    assert pool.allocation_key(["hca-local-1-1"]) == ("1",) and pool.allocation_key(["hca-local-0-1"]) == ("0",)
    assert pool.allocate(["hca-local-1-1"]) is pool.allocate(["hca-local-1-2"])  # built once per node
    assert [scope for scope, _ in pool.workload_env()] == ["numa0", "numa1"]


def test_a_port_down_turns_only_its_nodes_devices_unhealthy(node: fixtures.FixtureNode) -> None:
    pools = _pools(node, sharedDevices=2)
    states = {f"mlx5_bond_{i}": ("ACTIVE",) for i in range(4)} | {"mlx5_bond_2": ("DOWN",)}
    for pool in pools.values():
        pool.set_port_states(states)
    health = {name: {(d.numa_node, d.health) for d in pool.snapshot()[1]} for name, pool in pools.items()}
    assert health["rdma/hca"] == {(None, "Unhealthy")}  # policy all: one NIC down
    assert health["rdma/hca-numa0"] == {(0, "Healthy")} and health["rdma/hca-numa1"] == {(1, "Unhealthy")}
    assert health["rdma/hca-local"] == {(0, "Healthy"), (1, "Unhealthy")}


def test_a_numa_node_without_nics_advertises_nothing(short_tmp: Path) -> None:
    spec = fixtures.lingjun_node()
    spec = replace(spec, nics=tuple(replace(n, numa_node=0) for n in spec.nics))  # every NIC on node 0
    fx = fixtures.write_node(
        str(short_tmp / "n"), replace(spec, gpus=(*spec.gpus[:4], replace(spec.gpus[4], numa_node=1)))
    )
    pools = _pools(fx, sharedDevices=2)
    assert list(pools) == ["rdma/hca", "rdma/hca-numa0", "rdma/hca-numa1", "rdma/hca-local"]
    assert pools["rdma/hca-numa1"].snapshot()[1] == ()
    assert {d.numa_node for d in pools["rdma/hca-local"].snapshot()[1]} == {0}


def test_cdi_names_per_pool_and_per_node_of_the_local_pool(node: fixtures.FixtureNode) -> None:
    config = load_config_data({"resources": [{"numaPools": True, "sharedDevices": 2}], "cdi": {"enabled": True}})
    pools = {p.name: p for p in build_pools(config, (0, 1))}
    nics = sysfs.read_nics(node.sysfs, node.dev)
    for pool in pools.values():
        pool.set_nics(nics)
    # every pool its own kind (numaPools makes several pools of one configured resource)
    assert pools["rdma/hca"].allocate(["hca-0"]).cdi_devices == ("rdma.lingjun.io/hca-hca=all",)
    assert pools["rdma/hca-numa1"].allocate(["hca-numa1-0"]).cdi_devices == ("rdma.lingjun.io/hca-hca-numa1=all",)
    local = pools["rdma/hca-local"]
    assert local.allocate(["hca-local-1-0"]).cdi_devices == ("rdma.lingjun.io/hca-hca-local=numa1",)
    assert local.allocate(["hca-local-0-0", "hca-local-1-1"]).cdi_devices == (
        "rdma.lingjun.io/hca-hca-local=numa0",
        "rdma.lingjun.io/hca-hca-local=numa1",
    )
    spec = cdi.build_spec("rdma.lingjun.io/hca-hca-local", "shared", nics, per_numa=True)
    by_name = {d["name"]: [n["path"] for n in d["containerEdits"]["deviceNodes"]] for d in spec["devices"]}
    assert by_name == {
        "numa0": ["/dev/infiniband/uverbs1", "/dev/infiniband/uverbs2"],
        "numa1": ["/dev/infiniband/uverbs3", "/dev/infiniband/uverbs0"],
    }
    assert spec["containerEdits"] == {
        "deviceNodes": [{"path": RDMA_CM, "hostPath": RDMA_CM, "type": "c", "permissions": "rw"}]
    }
