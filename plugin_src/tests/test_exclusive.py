"""Exclusive mode end to end: the real ``serve`` process against both kubelets (the simulator and
the kubelet's own device manager)."""

from __future__ import annotations

import time
from pathlib import Path

import grpc
import yaml
from conftest import plugin_socket

from rdma_device_plugin.api import deviceplugin_pb2 as pb
from rdma_device_plugin.api import deviceplugin_pb2_grpc as pb_grpc
from rdma_kubesim import KubeletSimulator
from rdma_kubesim.real import RealKubelet
from rdma_node import fixtures

RES = "rdma/hca"
EXCLUSIVE = {"version": "v1", "mode": "exclusive"}
# fixtures.lingjun_node(nics=4, numa_nodes=2): bus 0x1a + 0x20*i, two NICs per NUMA node
PCI = ["0000:1a:00.0", "0000:3a:00.0", "0000:5a:00.0", "0000:7a:00.0"]
NAMES = ["mlx5_bond_0", "mlx5_bond_1", "mlx5_bond_2", "mlx5_bond_3"]
UVERBS = {n: f"/dev/infiniband/uverbs{(i + 1) % 4}" for i, n in enumerate(NAMES)}
Kubelet = KubeletSimulator | RealKubelet


def test_one_device_per_nic_with_numa_topology(kubelet: Kubelet, start_plugin, short_tmp: Path) -> None:  # type: ignore[no-untyped-def]
    spec = fixtures.with_nic_changes(fixtures.lingjun_node(nics=4, numa_nodes=2), "mlx5_bond_3", numa_node=-1)
    node = fixtures.write_node(str(short_tmp / "n1"), spec)
    plugin = start_plugin(EXCLUSIVE, fixture=node)
    assert kubelet.wait_registered(RES), plugin.output()
    assert sorted(kubelet.health(RES)) == PCI
    assert kubelet.numa(RES) == {PCI[0]: [0], PCI[1]: [0], PCI[2]: [1], PCI[3]: []}  # -1 carries no topology
    assert kubelet.node_status() == {"capacity": {RES: "4"}, "allocatable": {RES: "4"}}
    assert kubelet.options(RES)["get_preferred_allocation_available"]
    assert "mode=exclusive" in plugin.output()


def test_preferred_allocation_is_numa_aware_and_allocate_hands_out_only_given_nics(
    kubelet: Kubelet, start_plugin, dp_dir: Path
) -> None:  # type: ignore[no-untyped-def]
    start_plugin(EXCLUSIVE)
    assert kubelet.wait_registered(RES)
    first = kubelet.allocate(RES, 1, pod="a")
    assert first.ids == [PCI[0]]  # best fit: the smallest NUMA node that holds the request, lowest ID
    # Free now: 3a (NUMA 0), 5a and 7a (NUMA 1). Sorted-first would be 3a+5a (two NUMA nodes);
    # the plugin's preference keeps the pod on NUMA 1.
    second = kubelet.allocate(RES, 2, pod="b")
    assert sorted(second.ids) == [PCI[2], PCI[3]]
    # In PCI order whatever order the kubelet sent the IDs in (Go map order).
    assert second.device_paths == [UVERBS["mlx5_bond_2"], UVERBS["mlx5_bond_3"], "/dev/infiniband/rdma_cm"]
    assert second.envs["RDMA_DEVICES"] == "mlx5_bond_2,mlx5_bond_3"
    assert first.device_paths == [UVERBS["mlx5_bond_0"], "/dev/infiniband/rdma_cm"]
    assert first.envs["RDMA_DEVICES"] == "mlx5_bond_0"
    # must_include is honoured and the rest fills its NUMA node first
    with grpc.insecure_channel(f"unix://{plugin_socket(dp_dir)}") as ch:
        req = pb.PreferredAllocationRequest()
        req.container_requests.add(available_deviceIDs=PCI, must_include_deviceIDs=[PCI[3]], allocation_size=2)
        resp = pb_grpc.DevicePluginStub(ch).GetPreferredAllocation(req, timeout=5)
    assert list(resp.container_responses[0].deviceIDs) == [PCI[3], PCI[2]]


def test_the_same_nics_get_the_same_answer_whatever_the_id_order(  # type: ignore[no-untyped-def]
    kubelet: Kubelet, start_plugin, dp_dir: Path
) -> None:
    """The kubelet sends device IDs in map order: RDMA_DEVICES and the device list must not differ
    pod to pod for the same NICs (they did: the answer followed the request's order)."""
    plugin = start_plugin(EXCLUSIVE)
    assert kubelet.wait_registered(RES)
    answers = set()
    with grpc.insecure_channel(f"unix://{plugin_socket(dp_dir)}") as ch:
        stub = pb_grpc.DevicePluginStub(ch)
        for ids in ([PCI[3], PCI[0], PCI[2]], [PCI[0], PCI[2], PCI[3]], [PCI[2], PCI[3], PCI[0]]):
            req = pb.AllocateRequest()
            req.container_requests.add(devices_ids=ids)
            answers.add(stub.Allocate(req, timeout=10).SerializeToString(deterministic=True))
    assert len(answers) == 1
    resp = pb.AllocateResponse.FromString(answers.pop()).container_responses[0]
    assert resp.envs["RDMA_DEVICES"] == "mlx5_bond_0,mlx5_bond_2,mlx5_bond_3"
    assert [d.host_path for d in resp.devices] == [UVERBS[NAMES[i]] for i in (0, 2, 3)] + ["/dev/infiniband/rdma_cm"]
    assert plugin.output().count("Allocate answer") == 1, "one cached answer for one set of NICs"


def test_per_nic_health(kubelet: Kubelet, start_plugin, node: fixtures.FixtureNode) -> None:  # type: ignore[no-untyped-def]
    start_plugin(EXCLUSIVE)
    assert kubelet.wait_registered(RES)
    node.set_port_state("mlx5_bond_1", "DOWN")
    assert kubelet.wait_for(lambda: kubelet.health(RES).get(PCI[1]) == "Unhealthy", timeout=5)
    assert kubelet.health(RES) == {PCI[0]: "Healthy", PCI[1]: "Unhealthy", PCI[2]: "Healthy", PCI[3]: "Healthy"}
    assert kubelet.node_status() == {"capacity": {RES: "4"}, "allocatable": {RES: "3"}}
    node.remove_nic("mlx5_bond_2")  # disappears: only its device turns Unhealthy, it stays in capacity
    assert kubelet.wait_for(lambda: kubelet.health(RES).get(PCI[2]) == "Unhealthy", timeout=5)
    assert kubelet.health(RES) == {PCI[0]: "Healthy", PCI[1]: "Unhealthy", PCI[2]: "Unhealthy", PCI[3]: "Healthy"}
    node.set_port_state("mlx5_bond_1", "ACTIVE")
    assert kubelet.wait_for(lambda: kubelet.health(RES).get(PCI[1]) == "Healthy", timeout=5)
    alloc = kubelet.allocate(RES, 2, pod="p")
    assert sorted(alloc.ids) == [PCI[0], PCI[1]]  # the vanished NIC is never offered; NUMA 0 holds both


def test_mode_is_read_at_start_and_a_mode_change_on_disk_is_flagged(kubelet: Kubelet, start_plugin) -> None:  # type: ignore[no-untyped-def]
    plugin = start_plugin(EXCLUSIVE)
    assert kubelet.wait_registered(RES)
    assert "mode=exclusive" in plugin.output()
    cfg = Path(plugin.proc.args[plugin.proc.args.index("--config") + 1])
    # Replaced in one step, as a ConfigMap update does (a write in place is two changes: empty, then full).
    tmp = cfg.with_suffix(".new")
    tmp.write_text(yaml.safe_dump({"version": "v1", "mode": "shared"}), encoding="utf-8")
    tmp.rename(cfg)
    deadline = time.monotonic() + 5
    while "takes effect only when the plugin restarts" not in plugin.output() and time.monotonic() < deadline:
        time.sleep(0.1)
    out = plugin.output()
    assert "mode shared differs from the running mode exclusive" in out, out
    # still serving the mode it started with
    assert kubelet.capacity(RES) == 4 and kubelet.options(RES)["get_preferred_allocation_available"]
    assert out.count("differs from the running mode") == 1  # warned once per change, not every probe
