"""The simulator is at least as strict as kubelets 1.28-1.34 (see kubesim/kubelet.py for the sources).

Each case drives a kubelet with a scripted device plugin (real gRPC over a real unix socket), and
most run against both the simulator and the kubelet's own v1.32.10 device manager (``kubelet``
fixture): where the two disagree, the simulator is wrong.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import grpc
import pytest
from conftest import (
    FIXED_KINDS,
    REREGISTRATION_KINDS,
    ScriptedPlugin,
    device,
    real_kubelet_binary,
    start_kind,
    start_kubelet,
    stop_kubelet,
)

from rdma_device_plugin.api import deviceplugin_pb2 as pb
from rdma_device_plugin.api import deviceplugin_pb2_grpc as pb_grpc
from rdma_device_plugin.kubesim import CHECKPOINT, AllocationFailed, KubeletSimulator, topology
from rdma_device_plugin.kubesim.kubelet import checkpoint_checksum, is_extended_resource_name
from rdma_device_plugin.kubesim.real import RealKubelet, RealKubeletError

RES = "example.com/dev"
Kubelet = KubeletSimulator | RealKubelet


@pytest.fixture
def plugins(dp_dir: Path) -> Iterator[list[ScriptedPlugin]]:
    made: list[ScriptedPlugin] = []
    yield made
    for p in made:
        p.stop()


def scripted(plugins: list[ScriptedPlugin], dp_dir: Path, name: str = "a.sock", **options: bool) -> ScriptedPlugin:
    p = ScriptedPlugin(dp_dir, name, RES, **options)
    plugins.append(p)
    return p


def admit(
    kubelet: Kubelet,
    pod: str,
    containers: Mapping[str, int],
    init: Sequence[tuple[str, int, bool]] = (),
) -> dict[str, list[str]]:
    """Admit a pod asking ``containers`` {name: devices of RES} (``init``: (name, devices, sidecar));
    the device IDs each container got. Raises AllocationFailed or RealKubeletError when refused."""
    if isinstance(kubelet, RealKubelet):
        reply = kubelet.admit(pod, {n: {RES: c} for n, c in containers.items()}, [(n, {RES: c}, s) for n, c, s in init])
        if not reply.get("ok"):
            raise RealKubeletError(f"{reply.get('reason', '')} {reply.get('error')}")
        return {name: sorted(run["device_ids"].get(RES, [])) for name, run in reply["containers"].items()}
    allocs = kubelet.allocate_pod(
        pod,
        {},
        containers=list(containers),
        init_containers=[n for n, _, _ in init],
        container_requests={**{n: {RES: c} for n, c, _ in init}, **{n: {RES: c} for n, c in containers.items()}},
        sidecars=[n for n, _, s in init if s],
    )
    return {a.container: sorted(a.ids) for a in allocs}


REFUSED = (AllocationFailed, RealKubeletError)


# --------------------------------------------------------------------------- devices and health


def test_an_id_listed_healthy_and_unhealthy_counts_twice_in_capacity(
    kubelet: Kubelet, plugins: list[ScriptedPlugin], dp_dir: Path
) -> None:
    """genericDeviceUpdateCallback keeps two sets; GetCapacity adds their sizes."""
    p = scripted(plugins, dp_dir)
    p.register()
    p.snapshots.put([device("x"), device("x", "Unhealthy"), device("y")])
    assert kubelet.wait_for(lambda: kubelet.capacity(RES) == 3)
    assert kubelet.allocatable(RES) == 2
    assert kubelet.node_status()["capacity"][RES] == "3"


def test_a_snapshot_over_4_mib_fails_the_stream(kubelet: Kubelet, plugins: list[ScriptedPlugin], dp_dir: Path) -> None:
    p = scripted(plugins, dp_dir)
    p.register()
    p.snapshots.put([device("x"), device("y"), device("z")])
    assert kubelet.wait_for(lambda: kubelet.allocatable(RES) == 3)
    p.snapshots.put([device(f"{'x' * 60}-{i}") for i in range(70_000)])  # about 4.9 MB
    assert kubelet.wait_for(lambda: kubelet.allocatable(RES) == 0, timeout=30)  # the stream failed: disconnected
    assert kubelet.capacity(RES) == 3, "the devices of the last good message, all unhealthy"
    if isinstance(kubelet, KubeletSimulator):
        assert kubelet.stream_errors[0] == (RES, "RESOURCE_EXHAUSTED")


def test_a_dead_endpoint_keeps_its_devices_for_the_grace_period_then_the_resource_drops(
    dp_dir: Path, plugins: list[ScriptedPlugin]
) -> None:
    """Simulator only: the real grace period is 5 minutes (endpoint.go endpointStopGracePeriod)."""
    sim = KubeletSimulator(str(dp_dir), stop_grace_seconds=1.0).start()
    try:
        p = scripted(plugins, dp_dir)
        p.register()
        p.snapshots.put([device("x"), device("y")])
        assert sim.wait_for(lambda: sim.allocatable(RES) == 2)
        p.snapshots.put(None)  # the plugin ends its stream
        assert sim.wait_for(lambda: sim.allocatable(RES) == 0)
        assert sim.capacity(RES) == 2, "devices stay (unhealthy) during the grace period"
        assert sim.wait_for(lambda: RES not in sim.node_status()["capacity"], timeout=10)
    finally:
        sim.stop()


@pytest.mark.parametrize("kind", REREGISTRATION_KINDS)
def test_an_old_stream_ending_after_re_registration(
    dp_dir: Path, short_tmp: Path, plugins: list[ScriptedPlugin], kind: str
) -> None:
    """Re-registration does not close the old client. When the old stream ends, kubelets 1.28-1.34
    (the real v1.32 too) disconnect the *new* client (kubernetes 121994/127803) and mark the
    resource unhealthy by name; with PR 135437 (the real v1.37) only the old client goes."""
    kubelet = start_kind(kind, dp_dir, short_tmp)
    try:
        old = scripted(plugins, dp_dir, "old.sock")
        old.register()
        old.snapshots.put([device("x")])
        assert kubelet.wait_registered(RES)
        new = scripted(plugins, dp_dir, "new.sock")
        new.register()
        new.snapshots.put([device("x"), device("y")])
        assert kubelet.wait_registered(RES, count=2)
        assert kubelet.wait_for(lambda: kubelet.allocatable(RES) == 2)
        assert old.streams_ended == 0, "the kubelet left the old stream open"
        old.snapshots.put(None)  # the old stream ends now
        if kind in FIXED_KINDS:
            time.sleep(1.0)
            assert kubelet.allocatable(RES) == 2 and new.streams_ended == 0
        else:
            assert kubelet.wait_for(lambda: kubelet.allocatable(RES) == 0)
            assert kubelet.wait_for(lambda: new.streams_ended == 1, timeout=5), "the new client is cut"
    finally:
        stop_kubelet(kubelet)


@pytest.mark.parametrize("kind", FIXED_KINDS)
def test_a_second_registration_of_a_connected_path_is_refused_by_a_fixed_kubelet(
    dp_dir: Path, short_tmp: Path, plugins: list[ScriptedPlugin], kind: str
) -> None:
    """PR 135437 tracks endpoints by socket path: two instances must not share one (the plugin gives
    each instance a name of its own, sockets.py)."""
    kubelet = start_kind(kind, dp_dir, short_tmp)
    try:
        p = scripted(plugins, dp_dir)
        p.register()
        p.snapshots.put([device("x")])
        assert kubelet.wait_registered(RES)
        with pytest.raises(grpc.RpcError) as err:
            p.register()
        assert err.value.code() == grpc.StatusCode.UNKNOWN
        assert f"device plugin already connected: {dp_dir / p.name}" in (err.value.details() or "")
    finally:
        stop_kubelet(kubelet)


# --------------------------------------------------------------------------- registration


@pytest.mark.parametrize("kind", ["sim-1.28-1.34", "real-1.32", "real"])
def test_start_removes_every_file_but_directories_and_the_checkpoint(
    plugins: list[ScriptedPlugin], dp_dir: Path, short_tmp: Path, kind: str
) -> None:
    """1.32 manager.go CleanupPluginDirectory removes every file but directories and the
    checkpoint; v1.37 removes only sockets, and its registration server writes DEPRECATION
    (plugin/v1beta1/handler.go) at every start."""
    kubelet = start_kind(kind, dp_dir, short_tmp)
    request_cleanup = kubelet
    p = scripted(plugins, dp_dir)
    p.register()
    p.snapshots.put([device("x")])
    assert kubelet.wait_for((dp_dir / CHECKPOINT).exists)
    (dp_dir / "DEPRECATION").write_text("", encoding="utf-8")
    (dp_dir / "notes.txt").write_text("keep?", encoding="utf-8")
    (dp_dir / "sub").mkdir()
    (dp_dir / "sub" / "inside.txt").write_text("", encoding="utf-8")
    os.symlink("/nowhere", dp_dir / "dangling")
    stray = socket.socket(socket.AF_UNIX)
    stray.bind(str(dp_dir / "stale.sock"))
    stray.close()
    try:
        kubelet.restart()
        if kind == "real":
            kept = ["sub", "kubelet.sock", CHECKPOINT, "DEPRECATION", "notes.txt", "dangling"]
        else:
            kept = ["sub", "kubelet.sock", CHECKPOINT]
        assert sorted(os.listdir(dp_dir)) == sorted(kept)
        assert os.listdir(dp_dir / "sub") == ["inside.txt"]
    finally:
        stop_kubelet(request_cleanup)


def _register(dp_dir: Path, version: str, resource: str, endpoint: str) -> None:
    with grpc.insecure_channel(f"unix://{dp_dir / 'kubelet.sock'}") as ch:
        pb_grpc.RegistrationStub(ch).Register(
            pb.RegisterRequest(version=version, endpoint=endpoint, resource_name=resource), timeout=30
        )


def test_registration_errors_are_code_unknown_with_the_kubelets_text(
    kubelet: Kubelet, plugins: list[ScriptedPlugin], dp_dir: Path
) -> None:
    """server.go Register returns plain Go errors: gRPC code Unknown, the kubelet's own words."""
    scripted(plugins, dp_dir)
    with pytest.raises(grpc.RpcError) as err:
        _register(dp_dir, "v1alpha", RES, "a.sock")
    assert err.value.code() == grpc.StatusCode.UNKNOWN
    assert 'requested API version "v1alpha" is not supported by kubelet' in (err.value.details() or "")
    with pytest.raises(grpc.RpcError) as err:
        _register(dp_dir, "v1beta1", "Example.com/dev", "a.sock")
    assert err.value.code() == grpc.StatusCode.UNKNOWN
    assert err.value.details() == 'the ResourceName "Example.com/dev" is invalid'


# The kubelet's verdict on each name (v1helper.IsExtendedResourceName), checked against both kubelets.
NAMES = {
    "rdma/hca": True,
    "example.com/dev": True,
    "nvidia.com/gpu": True,
    "rdma.example.com/x.y_z": True,
    "rdma/" + "x" * 63: True,
    "a" * 244 + "/x": True,  # "requests." + name: a 253-byte prefix
    "hca": False,  # no "/": a native resource
    "kubernetes.io/x": False,
    "foo.kubernetes.io/x": False,
    "requests.rdma/hca": False,
    "Rdma/hca": False,
    "rdma/-x": False,
    "rdma/x-": False,
    "rdma/a/b": False,
    "rdma/": False,
    "rdma/" + "x" * 64: False,
    "a" * 245 + "/x": False,  # the prefix grows past 253 with "requests."
}


def test_the_extended_resource_name_rule_is_the_kubelets(
    kubelet: Kubelet, plugins: list[ScriptedPlugin], dp_dir: Path
) -> None:
    scripted(plugins, dp_dir)
    verdicts = {}
    for name in NAMES:
        try:
            _register(dp_dir, "v1beta1", name, "a.sock")
            verdicts[name] = True
        except grpc.RpcError as exc:
            assert "is invalid" in (exc.details() or ""), exc.details()
            verdicts[name] = False
    assert verdicts == NAMES
    assert {n: is_extended_resource_name(n) for n in NAMES} == NAMES


def test_dial_back_blocks_up_to_10_s_and_fails_registration(kubelet: Kubelet, dp_dir: Path) -> None:
    """client.go dial: the kubelet waits (up to 10 s) for the plugin socket inside Register."""
    start = time.monotonic()
    with pytest.raises(grpc.RpcError) as err:
        _register(dp_dir, "v1beta1", RES, "nobody.sock")
    assert err.value.code() == grpc.StatusCode.UNKNOWN
    assert "failed to dial device plugin" in (err.value.details() or "")
    assert time.monotonic() - start >= 9.0, "the kubelet gives the plugin 10 s to answer"


# --------------------------------------------------------------------------- allocation


@pytest.mark.parametrize("kind", ["sim-1.28-1.34", "real-1.32"])
def test_a_stopped_endpoint_refuses_allocate_and_preferred_allocation(
    plugins: list[ScriptedPlugin], dp_dir: Path, short_tmp: Path, kind: str
) -> None:
    """Kubelets 1.28-1.34: register twice from one path (the kubelet keeps the first client's
    stream), end the second stream: the current endpoint is stopped, yet the first stream can still
    fill the healthy set. Allocate and GetPreferredAllocation must then be refused (endpoint.go
    isStopped), never sent. (v1.37 refuses the second registration: the test below.)"""
    kubelet = start_kind(kind, dp_dir, short_tmp)
    request_cleanup = kubelet
    p = scripted(plugins, dp_dir)
    p.register()
    assert p.wait_streams(1)
    p.queues[0].put([device("x")])
    assert kubelet.wait_for(lambda: kubelet.allocatable(RES) == 1)
    p.register()
    assert p.wait_streams(2)
    p.queues[1].put(None)  # the current client's stream ends: its endpoint stops
    assert kubelet.wait_for(lambda: kubelet.allocatable(RES) == 0)
    p.queues[0].put([device("x"), device("y")])  # the orphan stream still feeds the device sets
    assert kubelet.wait_for(lambda: kubelet.allocatable(RES) == 2)
    try:
        with pytest.raises(REFUSED, match="stopped"):
            admit(kubelet, "p1", {"main": 1})
        assert not p.allocate_requests and not p.preferred_requests
    finally:
        stop_kubelet(request_cleanup)


def test_devices_are_chosen_and_sent_in_no_particular_order(
    kubelet: Kubelet, plugins: list[ScriptedPlugin], dp_dir: Path
) -> None:
    """The kubelet's device IDs are Go sets: which free device it takes and the order it sends IDs
    in (Allocate, GetPreferredAllocation) follow map order, not sorting."""
    p = scripted(plugins, dp_dir, preferred=False)
    p.register()
    p.snapshots.put([device(f"d{i}") for i in range(8)])
    assert kubelet.wait_for(lambda: kubelet.allocatable(RES) == 8)
    chosen, orders = set(), []
    for n in range(12):
        got = admit(kubelet, f"p{n}", {"main": 3})
        chosen.add(tuple(got["main"]))
        kubelet.release(f"p{n}")
    orders = [list(r.container_requests[0].devices_ids) for r in p.allocate_requests]
    assert len(orders) == 12 and all(len(o) == 3 for o in orders)
    assert any(o != sorted(o) for o in orders), orders
    assert len(chosen) > 1, "always the same devices: sorted, not map order"


def test_pre_start_container_is_called_with_a_30_s_deadline_when_the_plugin_asks(
    kubelet: Kubelet, plugins: list[ScriptedPlugin], dp_dir: Path
) -> None:
    p = scripted(plugins, dp_dir, pre_start=True)
    p.register()
    p.snapshots.put([device(f"d{i}") for i in range(4)])
    assert kubelet.wait_for(lambda: kubelet.allocatable(RES) == 4)
    got = admit(kubelet, "p1", {"main": 2})
    assert [sorted(r.devices_ids) for r in p.pre_start_requests] == [got["main"]]
    (pre_start,) = p.deadlines["PreStartContainer"]
    assert pre_start is not None and 20.0 < pre_start <= 30.5
    (allocate,) = p.deadlines["Allocate"]
    assert allocate is None or allocate > 3600, "Allocate has no deadline (endpoint.go allocate)"


def test_a_container_admitted_again_gets_no_new_allocate_but_needs_healthy_devices(
    kubelet: Kubelet, plugins: list[ScriptedPlugin], dp_dir: Path
) -> None:
    """manager.go devicesToAllocate: a container that has devices (a restart, a re-admission after a
    kubelet restart) keeps them without an Allocate call, but only while they are healthy."""
    p = scripted(plugins, dp_dir)
    p.register()
    p.snapshots.put([device(f"d{i}") for i in range(3)])
    assert kubelet.wait_for(lambda: kubelet.allocatable(RES) == 3)
    first = admit(kubelet, "p1", {"main": 1})["main"]
    assert len(p.allocate_requests) == 1
    assert admit(kubelet, "p1", {"main": 1})["main"] == first
    assert len(p.allocate_requests) == 1, "no second Allocate for the same container"
    p.snapshots.put([device(d, "Unhealthy" if d in first else "Healthy") for d in ("d0", "d1", "d2")])
    assert kubelet.wait_for(lambda: kubelet.allocatable(RES) == 2)
    with pytest.raises(REFUSED, match="previously allocated devices are no longer healthy"):
        admit(kubelet, "p1", {"main": 1})


def test_init_container_devices_are_reused_but_a_sidecars_are_not(
    kubelet: Kubelet, plugins: list[ScriptedPlugin], dp_dir: Path
) -> None:
    p = scripted(plugins, dp_dir)
    p.register()
    p.snapshots.put([device(f"d{i}") for i in range(8)])
    assert kubelet.wait_for(lambda: kubelet.allocatable(RES) == 8)
    got = admit(kubelet, "pod1", {"app": 3, "side": 1}, init=[("init", 2, False)])
    assert set(got["init"]) <= set(got["app"]), "the app container reuses the init container's devices first"
    request = p.preferred_requests[-2].container_requests[0]
    assert sorted(request.must_include_deviceIDs) == got["init"] and request.allocation_size == 3
    assert not set(got["side"]) & set(got["app"])
    # A restartable init container (a sidecar) runs on: its devices are not offered again.
    got = admit(kubelet, "pod2", {"app": 2}, init=[("sidecar", 2, True)])
    assert not set(got["sidecar"]) & set(got["app"])


def test_single_numa_node_hints_and_admission() -> None:
    numa = {"a": (0,), "b": (0,), "c": (1,), "d": (1,), "e": (1,)}
    hints = topology.device_hints(numa, available=list(numa), reusable=[], request=2)
    assert hints is not None
    preferred = {tuple(sorted(h.numa_nodes)) for h in hints if h.preferred}
    assert preferred == {(0,), (1,)}
    assert topology.single_numa_node(hints) == frozenset({0})
    three = topology.device_hints(numa, available=list(numa), reusable=[], request=3)
    assert topology.single_numa_node(three) == frozenset({1})
    with pytest.raises(ValueError, match="TopologyAffinityError"):
        topology.single_numa_node(topology.device_hints(numa, available=list(numa), reusable=[], request=4))
    assert topology.device_hints({"a": ()}, ["a"], [], 1) is None


@pytest.mark.parametrize("backend", ["sim", "real"])
def test_exclusive_numa_packing_as_the_topology_manager_sees_it(  # type: ignore[no-untyped-def]
    dp_dir: Path, short_tmp: Path, start_plugin, backend: str
) -> None:
    """4 NICs, 2 per NUMA node: under single-numa-node a 2-NIC pod lands on one NUMA node and a
    3-NIC pod is refused by admission, as on a real node."""
    options: dict[str, Any] = (
        {"topology_policy": "single-numa-node"} if backend == "sim" else {"policy": "single-numa-node"}
    )
    kubelet = start_kubelet(backend, dp_dir, short_tmp / "k.log", **options)
    try:
        start_plugin({"mode": "exclusive"})
        assert kubelet.wait_registered("rdma/hca", timeout=20)
        numa = {i: nodes[0] for i, nodes in kubelet.numa("rdma/hca").items()}
        alloc = kubelet.allocate("rdma/hca", 2, pod="p1")
        assert len({numa[i] for i in alloc.ids}) == 1
        kubelet.release("p1")
        with pytest.raises(REFUSED, match="TopologyAffinityError"):
            kubelet.allocate("rdma/hca", 3, pod="p2")
    finally:
        stop_kubelet(kubelet)


# --------------------------------------------------------------------------- checkpoint


def test_a_restored_resource_shows_0_until_its_plugin_registers(
    kubelet: Kubelet, plugins: list[ScriptedPlugin], dp_dir: Path
) -> None:
    """manager.go readCheckpoint: each registered resource comes back as a stopped endpoint with no
    devices (capacity and allocatable 0), its allocations kept, until the plugin registers."""
    p = scripted(plugins, dp_dir)
    p.register()
    p.snapshots.put([device(f"d{i}") for i in range(3)])
    assert kubelet.wait_for(lambda: kubelet.allocatable(RES) == 3)
    held = admit(kubelet, "p1", {"main": 1})["main"]
    kubelet.restart()
    assert kubelet.node_status() == {"capacity": {RES: "0"}, "allocatable": {RES: "0"}}
    with pytest.raises(REFUSED, match="no healthy devices present"):
        admit(kubelet, "p2", {"main": 1})
    p = scripted(plugins, dp_dir, "b.sock")  # the restart removed the plugin's socket: it serves anew
    p.register()
    p.snapshots.put([device(f"d{i}") for i in range(3)])
    assert kubelet.wait_for(lambda: kubelet.allocatable(RES) == 3)
    got = admit(kubelet, "p2", {"main": 2})["main"]
    assert not set(got) & set(held), "the restored allocation still holds its device"


def test_the_checkpoint_is_the_kubelets_v2_format_in_both_directions(
    dp_dir: Path, short_tmp: Path, plugins: list[ScriptedPlugin]
) -> None:
    """The simulator writes what the real kubelet reads back (IDs per NUMA node, the Allocate
    response, the spew/FNV-32a checksum), and reads back what it writes."""
    binary = real_kubelet_binary()
    sim = KubeletSimulator(str(dp_dir)).start()
    p = scripted(plugins, dp_dir)
    try:
        p.register()
        p.snapshots.put([device("d0", numa=0), device("d1", numa=1), device("d2")])
        assert sim.wait_for(lambda: sim.allocatable(RES) == 3)
        sim.allocate_pod("p1", {RES: 2})
    finally:
        sim.stop()
    doc = json.loads((dp_dir / CHECKPOINT).read_text(encoding="utf-8"))
    assert doc["Checksum"] == checkpoint_checksum(doc["Data"])
    real = RealKubelet(str(dp_dir), binary=binary, klog=str(short_tmp / "k.log"))
    try:
        reply = real.must("start", dir=str(dp_dir))
        assert reply["checkpoint_found"] and reply["restored"] == {RES: {"allocated": 2, "endpoint_stopped": True}}
        p = scripted(plugins, dp_dir, "b.sock")  # the start removed the plugin's socket: it serves anew
        p.register()
        p.snapshots.put([device("d0", numa=0), device("d1", numa=1), device("d2")])
        assert real.wait_for(lambda: real.allocatable(RES) == 3)
        # p1 is the node's pod: admitted again after the restart it keeps its devices (no Allocate);
        # a pod the kubelet does not know would be freed at the next allocation.
        assert real.admit("p1", {"main": {RES: 2}})["ok"]
        assert real.admit("p2", {"main": {RES: 1}})["ok"]  # the real kubelet rewrites the checkpoint
        assert len(p.allocate_requests) == 1, "p1 got no new Allocate"
        real.crash()
    finally:
        real.close()
    written = json.loads((dp_dir / CHECKPOINT).read_text(encoding="utf-8"))
    assert written["Checksum"] == checkpoint_checksum(written["Data"])
    sim = KubeletSimulator(str(dp_dir)).start()
    try:
        assert sim.checkpoint_restored == {RES: 3}
        assert sorted(a.pod for a in sim.allocations) == ["p1", "p2"]
    finally:
        sim.stop()


def test_node_status_sync_lags_the_kubelets_own_view(dp_dir: Path, plugins: list[ScriptedPlugin]) -> None:
    """The Node object sees capacity only at the kubelet's node-status sync (10 s on a real node): a
    short dip in the kubelet's own view can be invisible there."""
    sim = KubeletSimulator(str(dp_dir), node_status_sync_seconds=0.5).start()
    try:
        p = scripted(plugins, dp_dir)
        p.register()
        p.snapshots.put([device("x"), device("y")])
        assert sim.wait_for(lambda: sim.synced_node_status()["allocatable"] == {RES: "2"}, timeout=5)
        p.snapshots.put([device("x", "Unhealthy"), device("y")])
        assert sim.wait_for(lambda: sim.allocatable(RES) == 1)
        assert sim.synced_node_status()["allocatable"] == {RES: "2"}, "not synced yet"
        assert sim.wait_for(lambda: sim.synced_node_status()["allocatable"] == {RES: "1"}, timeout=5)
    finally:
        sim.stop()
