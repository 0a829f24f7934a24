"""Exclusive mode end to end: the real ``serve`` process against the kubelet simulator."""

from __future__ import annotations

import time
from pathlib import Path

import grpc
import yaml

from rdma_device_plugin.api import deviceplugin_pb2 as pb
from rdma_device_plugin.api import deviceplugin_pb2_grpc as pb_grpc
from rdma_device_plugin.kubesim import KubeletSimulator
from rdma_device_plugin.node import fixtures

RES = "rdma/hca"
SOCK = "rdma-dp-rdma_hca.sock"
EXCLUSIVE = {"version": "v1", "mode": "exclusive"}
# fixtures.lingjun_node(nics=4, numa_nodes=2): bus 0x1a + 0x20*i, two NICs per NUMA node
PCI = ["0000:1a:00.0", "0000:3a:00.0", "0000:5a:00.0", "0000:7a:00.0"]
NAMES = ["mlx5_bond_0", "mlx5_bond_1", "mlx5_bond_2", "mlx5_bond_3"]
UVERBS = {n: f"/dev/infiniband/uverbs{(i + 1) % 4}" for i, n in enumerate(NAMES)}


def _health(sim: KubeletSimulator) -> dict[str, str]:
    return {i: d.health for i, d in sim.devices(RES).items()}


def test_one_device_per_nic_with_numa_topology(sim: KubeletSimulator, start_plugin, short_tmp: Path) -> None:  # type: ignore[no-untyped-def]
    spec = fixtures.with_nic_changes(fixtures.lingjun_node(nics=4, numa_nodes=2), "mlx5_bond_3", numa_node=-1)
    node = fixtures.write_node(str(short_tmp / "n1"), spec)
    plugin = start_plugin(EXCLUSIVE, fixture=node)
    assert sim.wait_registered(RES), plugin.output()
    devices = sim.devices(RES)
    assert sorted(devices) == PCI
    numa = {i: [n.ID for n in d.topology.nodes] for i, d in devices.items()}
    assert numa == {PCI[0]: [0], PCI[1]: [0], PCI[2]: [1], PCI[3]: []}  # numa_node -1 carries no topology
    assert sim.node_status() == {"capacity": {RES: "4"}, "allocatable": {RES: "4"}}
    assert sim.endpoints[RES].options.get_preferred_allocation_available
    assert "mode=exclusive" in plugin.output()


def test_preferred_allocation_is_numa_aware_and_allocate_hands_out_only_given_nics(
    sim: KubeletSimulator, start_plugin, dp_dir: Path
) -> None:  # type: ignore[no-untyped-def]
    start_plugin(EXCLUSIVE)
    assert sim.wait_registered(RES)
    first = sim.allocate(RES, 1, pod="a")
    assert first.ids == [PCI[0]]  # best fit: the smallest NUMA node that holds the request, lowest ID
    # Free now: 3a (NUMA 0), 5a and 7a (NUMA 1). Sorted-first would be 3a+5a (two NUMA nodes);
    # the plugin's preference keeps the pod on NUMA 1.
    second = sim.allocate(RES, 2, pod="b")
    assert second.ids == [PCI[2], PCI[3]]
    assert second.device_paths == [UVERBS["mlx5_bond_2"], UVERBS["mlx5_bond_3"], "/dev/infiniband/rdma_cm"]
    assert second.envs["RDMA_DEVICES"] == "mlx5_bond_2,mlx5_bond_3"
    assert first.device_paths == [UVERBS["mlx5_bond_0"], "/dev/infiniband/rdma_cm"]
    assert first.envs["RDMA_DEVICES"] == "mlx5_bond_0"
    # must_include is honoured and the rest fills its NUMA node first
    with grpc.insecure_channel(f"unix://{dp_dir / SOCK}") as ch:
        req = pb.PreferredAllocationRequest()
        req.container_requests.add(available_deviceIDs=PCI, must_include_deviceIDs=[PCI[3]], allocation_size=2)
        resp = pb_grpc.DevicePluginStub(ch).GetPreferredAllocation(req, timeout=5)
    assert list(resp.container_responses[0].deviceIDs) == [PCI[3], PCI[2]]


def test_per_nic_health(sim: KubeletSimulator, start_plugin, node: fixtures.FixtureNode) -> None:  # type: ignore[no-untyped-def]
    start_plugin(EXCLUSIVE)
    assert sim.wait_registered(RES)
    node.set_port_state("mlx5_bond_1", "DOWN")
    assert sim.wait_for(lambda: _health(sim).get(PCI[1]) == "Unhealthy", timeout=5)
    assert _health(sim) == {PCI[0]: "Healthy", PCI[1]: "Unhealthy", PCI[2]: "Healthy", PCI[3]: "Healthy"}
    assert sim.node_status() == {"capacity": {RES: "4"}, "allocatable": {RES: "3"}}
    node.remove_nic("mlx5_bond_2")  # disappears: only its device turns Unhealthy, it stays in capacity
    assert sim.wait_for(lambda: _health(sim).get(PCI[2]) == "Unhealthy", timeout=5)
    assert _health(sim) == {PCI[0]: "Healthy", PCI[1]: "Unhealthy", PCI[2]: "Unhealthy", PCI[3]: "Healthy"}
    node.set_port_state("mlx5_bond_1", "ACTIVE")
    assert sim.wait_for(lambda: _health(sim).get(PCI[1]) == "Healthy", timeout=5)
    alloc = sim.allocate(RES, 2, pod="p")
    assert alloc.ids == [PCI[0], PCI[1]]  # the vanished NIC is never offered; NUMA 0 holds both


def test_mode_is_read_at_start_and_a_mode_change_on_disk_is_flagged(sim: KubeletSimulator, start_plugin) -> None:  # type: ignore[no-untyped-def]
    plugin = start_plugin(EXCLUSIVE)
    assert sim.wait_registered(RES)
    assert "mode=exclusive" in plugin.output()
    cfg = Path(plugin.proc.args[plugin.proc.args.index("--config") + 1])
    cfg.write_text(yaml.safe_dump({"version": "v1", "mode": "shared"}), encoding="utf-8")
    deadline = time.monotonic() + 5
    while "takes effect only when the plugin restarts" not in plugin.output() and time.monotonic() < deadline:
        time.sleep(0.1)
    out = plugin.output()
    assert "mode shared differs from the running mode exclusive" in out, out
    # still serving the mode it started with
    assert sim.capacity(RES) == 4 and sim.endpoints[RES].options.get_preferred_allocation_available
    assert out.count("differs from the running mode") == 1  # warned once per change, not every probe
