"""numa_pools: the pools numaPools makes, their device IDs and NUMA nodes, their NICs, and the
kubelet's message limit checked on the exact wire size (compared with protobuf's own)."""

from __future__ import annotations

from pathlib import Path

import pytest

from rdma_device_plugin import numa_pools
from rdma_device_plugin.api import deviceplugin_pb2 as pb
from rdma_device_plugin.config import ConfigError, load_config_data
from rdma_device_plugin.node import fixtures, sysfs


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
