"""Issue 23 end to end: the real ``serve`` process, and a kubelet (the simulator and the kubelet's own
device manager, kubelet-dm-serve) allocating as it does for a pod.

- the env a container gets (``workloadEnv``): shared, exclusive, per-NUMA and -local pools,
  hostNetwork and non-hostNetwork, and NICs that disagree on the GID index (left unset, logged once,
  shown in the status file and as ``rdma_dp_env_unset``);
- GPU-NIC alignment with the kubelet's own Topology Manager (``single-numa-node``) and a stub GPU
  plugin registering ``nvidia.com/gpu`` with the fixture node's GPUs and their NUMA nodes.
"""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import BACKENDS, PluginProcess, free_port, start_kubelet, stop_kubelet
from gpu_stub import RESOURCE as GPU
from gpu_stub import GpuStubPlugin
from prometheus_client.parser import text_string_to_metric_families

from rdma_device_plugin.status import default_status_file
from rdma_kubesim import KubeletSimulator
from rdma_kubesim.real import RealKubelet
from rdma_node import fixtures

RES = "rdma/hca"
NODE0 = "mlx5_bond_0,mlx5_bond_1"  # the fixture node's NICs on NUMA node 0 ...
NODE1 = "mlx5_bond_2,mlx5_bond_3"  # ... and on node 1
ALL = f"{NODE0},{NODE1}"
UCX = {NODE0: "mlx5_bond_0:1,mlx5_bond_1:1", NODE1: "mlx5_bond_2:1,mlx5_bond_3:1"}
UCX_ALL = f"{UCX[NODE0]},{UCX[NODE1]}"
Kubelet = KubeletSimulator | RealKubelet


def host_env(nics: str, ucx: str) -> dict[str, str]:
    """What a hostNetwork container gets on the fixture node: the index of its IPv6 RoCE v2 GID."""
    return {"RDMA_DEVICES": nics, "NCCL_IB_HCA": "=" + nics, "NCCL_IB_GID_INDEX": "3", "UCX_NET_DEVICES": ucx}


@pytest.fixture
def kubelet_of(dp_dir: Path, short_tmp: Path) -> Iterator[Callable[..., Kubelet]]:
    made: list[Kubelet] = []

    def make(backend: str, **options: object) -> Kubelet:
        made.append(start_kubelet(backend, dp_dir, short_tmp / f"kubelet{len(made)}.log", **options))
        return made[-1]

    yield make
    for k in made:
        stop_kubelet(k)


def registered(k: Kubelet, plugin: PluginProcess, *resources: str) -> None:
    for resource in resources:
        assert k.wait_registered(resource, timeout=30), f"{resource} not registered\n{plugin.output()}"


# ------------------------------------------------------------------ the env, both kubelets


@pytest.mark.parametrize("backend", BACKENDS)
def test_shared_host_network(backend: str, kubelet_of, start_plugin) -> None:  # type: ignore[no-untyped-def]
    k = kubelet_of(backend)
    plugin = start_plugin()
    registered(k, plugin, RES)
    assert k.allocate(RES, 1, pod="p").envs == host_env(ALL, UCX_ALL)


@pytest.mark.parametrize("backend", BACKENDS)
def test_exclusive_host_network(backend: str, kubelet_of, start_plugin) -> None:  # type: ignore[no-untyped-def]
    k = kubelet_of(backend)
    plugin = start_plugin({"version": "v1", "mode": "exclusive"})
    registered(k, plugin, RES)
    first = k.allocate(RES, 2, pod="p")
    nics = ",".join(sorted(first.envs["RDMA_DEVICES"].split(",")))
    assert first.envs == host_env(nics, ",".join(f"{n}:1" for n in nics.split(",")))
    rest = k.allocate(RES, 2, pod="q").envs  # the other two NICs, each env their own
    assert set(rest["NCCL_IB_HCA"][1:].split(",")) == set(ALL.split(",")) - set(nics.split(","))


@pytest.mark.parametrize("backend", BACKENDS)
def test_non_host_network(backend: str, kubelet_of, start_plugin) -> None:  # type: ignore[no-untyped-def]
    """The pod's own GID is not in the table at Allocate: NCCL is told what to pick, not an index."""
    k = kubelet_of(backend)
    plugin = start_plugin(
        {"version": "v1", "nonHostNetwork": {"enabled": True}, "workloadEnv": {"addrRange": "2408:4005:301::/48"}}
    )
    registered(k, plugin, RES)
    assert k.allocate(RES, 1, pod="p").envs == {
        "RDMA_DEVICES": ALL,
        "NCCL_IB_HCA": "=" + ALL,
        "NCCL_IB_ADDR_FAMILY": "AF_INET6",
        "NCCL_IB_ROCE_VERSION_NUM": "2",
        "NCCL_IB_ADDR_RANGE": "2408:4005:301::/48",
        "UCX_NET_DEVICES": UCX_ALL,
        "NCCL_SOCKET_FAMILY": "AF_INET6",
    }


@pytest.mark.parametrize("backend", BACKENDS)
def test_per_numa_pools(backend: str, kubelet_of, start_plugin) -> None:  # type: ignore[no-untyped-def]
    k = kubelet_of(backend)
    plugin = start_plugin({"version": "v1", "resources": [{"numaPools": True}]})
    registered(k, plugin, RES, f"{RES}-numa0", f"{RES}-numa1", f"{RES}-local")
    assert set(map(tuple, k.numa(f"{RES}-numa1").values())) == {(1,)} and len(k.numa(f"{RES}-numa1")) == 1000
    assert len(k.numa(f"{RES}-local")) == 2000 and set(map(tuple, k.numa(f"{RES}-local").values())) == {(0,), (1,)}
    assert k.numa(RES)["hca-0"] == []  # the configured resource is served as before: no topology
    assert k.allocate(f"{RES}-numa1", 1, pod="a").envs == host_env(NODE1, UCX[NODE1])
    assert k.allocate(f"{RES}-numa0", 1, pod="b").envs == host_env(NODE0, UCX[NODE0])
    assert k.allocate(RES, 1, pod="c").envs == host_env(ALL, UCX_ALL)
    local = k.allocate(f"{RES}-local", 1, pod="d")
    [numa] = k.numa(f"{RES}-local")[local.ids[0]]
    nics = NODE0 if numa == 0 else NODE1
    assert local.envs == host_env(nics, UCX[nics])  # the NICs of the node of the device it got


@pytest.mark.parametrize("backend", BACKENDS)
def test_disagreeing_nics_leave_the_index_unset_and_say_so(  # type: ignore[no-untyped-def]
    backend: str, kubelet_of, start_plugin, short_tmp: Path, dp_dir: Path
) -> None:
    """mlx5_bond_1 carries an extra IPv4 address: its IPv6 RoCE v2 GID is at index 5, the others' at 3."""
    spec = fixtures.with_nic_changes(fixtures.lingjun_node(), "mlx5_bond_1", ipv4=("10.0.1.11",))
    fx = fixtures.write_node(str(short_tmp / "odd"), spec)
    k = kubelet_of(backend)
    port = free_port()
    plugin = start_plugin(extra=["--metrics-address", f"127.0.0.1:{port}"], fixture=fx)
    registered(k, plugin, RES)
    envs = k.allocate(RES, 1, pod="p").envs
    assert "NCCL_IB_GID_INDEX" not in envs
    assert envs["NCCL_IB_ADDR_FAMILY"] == "AF_INET6" and envs["NCCL_IB_ROCE_VERSION_NUM"] == "2"
    assert envs["NCCL_IB_HCA"] == "=" + ALL
    # logged once, in the status file, as a metric
    lines = [line for line in plugin.output().splitlines() if "NCCL_IB_GID_INDEX left unset" in line]
    assert len(lines) == 1, plugin.output()
    assert "mlx5_bond_1 port 1: 5 (RoCE v2 2408:4005:300:1::11)" in lines[0]

    def unset() -> list[tuple[str, str]]:
        path = Path(default_status_file(str(dp_dir)))
        doc = json.loads(path.read_text()) if path.exists() else {"resources": []}
        envs = [e for r in doc["resources"] if r["name"] == RES for e in r["env"]]
        return [(u["variable"], u["reason"]) for e in envs for u in e["unset"]]

    assert k.wait_for(lambda: unset() == [("NCCL_IB_GID_INDEX", "gid_index_differs")], timeout=30), unset()
    assert _metric(port, "rdma_dp_env_unset", resource=RES, variable="NCCL_IB_GID_INDEX") == {"gid_index_differs": 1.0}
    time.sleep(1.5)  # a re-list or two later: still said once
    assert sum("NCCL_IB_GID_INDEX left unset" in line for line in plugin.output().splitlines()) == 1


def _metric(port: int, name: str, **labels: str) -> dict[str, float]:
    """reason -> value of the samples of ``name`` with ``labels``."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return {
        s.labels.get("reason", ""): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    }


def test_nic_info_names_the_gpus_of_each_nic(sim: KubeletSimulator, start_plugin) -> None:  # type: ignore[no-untyped-def]
    port = free_port()
    plugin = start_plugin(extra=["--metrics-address", f"127.0.0.1:{port}"])
    registered(sim, plugin, RES)
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    info = {
        s.labels["nic"]: s.labels
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name == "rdma_dp_nic_info"
    }
    assert info["mlx5_bond_2"]["switch_gpus"] == "0000:58:00.0,0000:59:00.0"
    assert info["mlx5_bond_2"]["root_port_gpus"] == "0000:58:00.0,0000:59:00.0"
    assert info["mlx5_bond_2"]["numa_gpus"] == "0000:58:00.0,0000:59:00.0,0000:78:00.0,0000:79:00.0"
    assert _metric(port, "rdma_dp_env_unset") == {}  # nothing left unset on an agreeing node


# ------------------------------------------------------------------ the kubelet's own Topology Manager


@pytest.fixture
def aligned(kubelet_of, start_plugin, node: fixtures.FixtureNode, dp_dir: Path) -> Iterator[Callable[..., Any]]:  # type: ignore[no-untyped-def]
    """The real device manager under single-numa-node, the plugin with ``config``, and the stub GPU
    plugin serving the fixture node's 8 GPUs (4 per NUMA node) with their NUMA nodes."""
    stubs: list[GpuStubPlugin] = []

    def make(config: dict[str, object], *resources: str) -> tuple[RealKubelet, dict[str, int]]:
        k = kubelet_of("real", policy="single-numa-node")
        assert isinstance(k, RealKubelet)
        gpus = [(g.address, g.numa_node) for g in fixtures.lingjun_node().gpus]
        stubs.append(GpuStubPlugin(str(dp_dir), gpus).start())
        plugin = start_plugin(config)
        registered(k, plugin, GPU, *resources)
        return k, dict(gpus)

    yield make
    for stub in stubs:
        stub.stop()


def _admit(k: RealKubelet, pod: str, requests: dict[str, int]) -> dict[str, Any]:
    reply: dict[str, Any] = k.admit(pod, {"main": requests})
    return reply


def test_single_numa_node_aligns_gpus_and_per_numa_nics(aligned) -> None:  # type: ignore[no-untyped-def]
    k, gpu_numa = aligned({"version": "v1", "resources": [{"numaPools": True}]}, RES, f"{RES}-numa1")
    reply = _admit(k, "a", {GPU: 4, f"{RES}-numa1": 1})
    assert reply["ok"] and reply["admitted"], reply
    run = reply["containers"]["main"]
    assert {gpu_numa[g] for g in run["device_ids"][GPU]} == {1}  # the GPUs of NUMA node 1 ...
    assert run["envs"]["RDMA_DEVICES"] == NODE1 and run["envs"]["NCCL_IB_HCA"] == "=" + NODE1  # ... and its NICs
    assert run["envs"]["NCCL_IB_GID_INDEX"] == "3" and run["envs"]["UCX_NET_DEVICES"] == UCX[NODE1]
    assert set(run["envs"]["NVIDIA_VISIBLE_DEVICES"].split(",")) == set(run["device_ids"][GPU])
    assert sorted(d["host"] for d in run["devices"]) == sorted(
        ["/dev/infiniband/uverbs3", "/dev/infiniband/uverbs0", "/dev/infiniband/rdma_cm"]
    )
    # node 1's GPUs are taken: the same request cannot be aligned, and the kubelet itself says so
    refused = _admit(k, "b", {GPU: 4, f"{RES}-numa1": 1})
    assert not refused["ok"] and not refused["admitted"]
    assert refused["reason"] == "TopologyAffinityError"
    assert refused["error"] == "Resources cannot be allocated with Topology locality"
    # NICs of both nodes for one pod: no single NUMA node holds them
    both = _admit(k, "c", {GPU: 1, f"{RES}-numa0": 1, f"{RES}-numa1": 1})
    assert both["reason"] == "TopologyAffinityError", both


def test_the_local_pool_follows_the_gpus(aligned) -> None:  # type: ignore[no-untyped-def]
    """rdma/hca-local names no node: the Topology Manager picks the one that fits the GPUs."""
    k, gpu_numa = aligned({"version": "v1", "resources": [{"numaPools": True}]}, f"{RES}-local")
    first = _admit(k, "a", {GPU: 4, f"{RES}-local": 1})
    second = _admit(k, "b", {GPU: 4, f"{RES}-local": 1})
    for reply in (first, second):
        assert reply["ok"], reply
    for reply in (first, second):
        run = reply["containers"]["main"]
        [node] = {gpu_numa[g] for g in run["device_ids"][GPU]}
        assert run["envs"]["RDMA_DEVICES"] == (NODE0 if node == 0 else NODE1), run
    nodes = {gpu_numa[r["containers"]["main"]["device_ids"][GPU][0]] for r in (first, second)}
    assert nodes == {0, 1}  # the second pod's GPUs, and so its NICs, are on the other node
    assert _admit(k, "c", {GPU: 8, f"{RES}-local": 1})["reason"] == "TopologyAffinityError"


def test_exclusive_nics_align_with_the_gpus(aligned) -> None:  # type: ignore[no-untyped-def]
    k, gpu_numa = aligned({"version": "v1", "mode": "exclusive"}, RES)
    reply = _admit(k, "a", {GPU: 4, RES: 2})
    assert reply["ok"], reply
    run = reply["containers"]["main"]
    [node] = {gpu_numa[g] for g in run["device_ids"][GPU]}
    assert run["envs"]["RDMA_DEVICES"] == (NODE0 if node == 0 else NODE1)
    assert _admit(k, "b", {GPU: 4, RES: 3})["reason"] == "TopologyAffinityError"  # 2 NICs per node
