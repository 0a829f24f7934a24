"""The simulator is at least as strict as kubelets 1.28-1.34 (see kubesim/kubelet.py for the sources).

Most cases drive it with a scripted device plugin (real gRPC over a real unix socket) so the
kubelet behaviour itself is pinned down; the last ones use the real plugin.
"""

from __future__ import annotations

import os
import queue
import socket
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest

from rdma_device_plugin.api import deviceplugin_pb2 as pb
from rdma_device_plugin.api import deviceplugin_pb2_grpc as pb_grpc
from rdma_device_plugin.kubesim import AllocationFailed, KubeletSimulator, topology

RES = "example.com/dev"


class ScriptedPlugin(pb_grpc.DevicePluginServicer):  # type: ignore[misc]
    """A device plugin whose ListAndWatch sends what the test puts in ``snapshots``."""

    def __init__(self, dp_dir: Path, name: str) -> None:
        self.dir, self.name = dp_dir, name
        self.snapshots: queue.Queue[list[Any] | None] = queue.Queue()
        self.preferred_requests: list[Any] = []
        self.streams_ended = 0
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
        pb_grpc.add_DevicePluginServicer_to_server(self, self.server)
        self.server.add_insecure_port(f"unix://{dp_dir / name}")
        self.server.start()

    def register(self, preferred: bool = False) -> None:
        with grpc.insecure_channel(f"unix://{self.dir / 'kubelet.sock'}") as ch:
            pb_grpc.RegistrationStub(ch).Register(
                pb.RegisterRequest(version="v1beta1", endpoint=self.name, resource_name=RES), timeout=15
            )

    def GetDevicePluginOptions(self, request: Any, context: Any) -> Any:
        return pb.DevicePluginOptions(get_preferred_allocation_available=True)

    def ListAndWatch(self, request: Any, context: Any) -> Iterator[Any]:
        try:
            while context.is_active():
                try:
                    devices = self.snapshots.get(timeout=0.1)
                except queue.Empty:
                    continue
                if devices is None:
                    return
                yield pb.ListAndWatchResponse(devices=devices)
        finally:
            self.streams_ended += 1

    def GetPreferredAllocation(self, request: Any, context: Any) -> Any:
        self.preferred_requests.append(request)
        resp = pb.PreferredAllocationResponse()
        for creq in request.container_requests:
            ids = list(creq.must_include_deviceIDs)
            ids += [d for d in creq.available_deviceIDs if d not in ids][: creq.allocation_size - len(ids)]
            resp.container_responses.add(deviceIDs=ids)
        return resp

    def Allocate(self, request: Any, context: Any) -> Any:
        resp = pb.AllocateResponse()
        for creq in request.container_requests:
            resp.container_responses.add(envs={"IDS": ",".join(creq.devices_ids)})
        return resp

    def stop(self) -> None:
        self.server.stop(0).wait(5)


def dev(i: str, health: str = "Healthy", numa: int | None = None) -> Any:
    d = pb.Device(ID=i, health=health)
    if numa is not None:
        d.topology.nodes.add(ID=numa)
    return d


@pytest.fixture
def plugins(dp_dir: Path) -> Iterator[list[ScriptedPlugin]]:
    made: list[ScriptedPlugin] = []
    yield made
    for p in made:
        p.stop()


def scripted(plugins: list[ScriptedPlugin], dp_dir: Path, name: str = "a.sock") -> ScriptedPlugin:
    p = ScriptedPlugin(dp_dir, name)
    plugins.append(p)
    return p


def test_an_id_listed_healthy_and_unhealthy_counts_twice_in_capacity(
    sim: KubeletSimulator, plugins: list[ScriptedPlugin], dp_dir: Path
) -> None:
    """genericDeviceUpdateCallback keeps two sets; GetCapacity adds their sizes."""
    p = scripted(plugins, dp_dir)
    p.register()
    p.snapshots.put([dev("x"), dev("x", "Unhealthy"), dev("y")])
    assert sim.wait_for(lambda: sim.capacity(RES) == 3)
    assert sim.allocatable(RES) == 2
    assert sim.node_status()["capacity"][RES] == "3"


def test_a_snapshot_over_4_mib_fails_the_stream(
    sim: KubeletSimulator, plugins: list[ScriptedPlugin], dp_dir: Path
) -> None:
    p = scripted(plugins, dp_dir)
    p.register()
    p.snapshots.put([dev(f"{'x' * 60}-{i}") for i in range(70_000)])  # about 4.9 MB
    assert sim.wait_for(lambda: bool(sim.stream_errors), timeout=30)
    assert sim.stream_errors[0] == (RES, "RESOURCE_EXHAUSTED")
    assert sim.allocatable(RES) == 0


def test_a_dead_endpoint_keeps_its_devices_for_the_grace_period_then_the_resource_drops(
    dp_dir: Path, plugins: list[ScriptedPlugin]
) -> None:
    sim = KubeletSimulator(str(dp_dir), stop_grace_seconds=1.0).start()
    try:
        p = scripted(plugins, dp_dir)
        p.register()
        p.snapshots.put([dev("x"), dev("y")])
        assert sim.wait_for(lambda: sim.allocatable(RES) == 2)
        p.snapshots.put(None)  # the plugin ends its stream
        assert sim.wait_for(lambda: sim.allocatable(RES) == 0)
        assert sim.capacity(RES) == 2, "devices stay (unhealthy) during the grace period"
        assert sim.wait_for(lambda: RES not in sim.node_status()["capacity"], timeout=10)
    finally:
        sim.stop()


@pytest.mark.parametrize("mode", ["buggy", "fixed"])
def test_an_old_stream_ending_after_re_registration(dp_dir: Path, plugins: list[ScriptedPlugin], mode: str) -> None:
    """kubernetes 121994/127803: re-registration does not close the old client; when the old
    stream ends, the buggy kubelet disconnects the *new* client (its stream is cut), the fixed
    one disconnects the old client, but either way PluginDisconnected marks the resource
    unhealthy by name."""
    sim = KubeletSimulator(str(dp_dir), reregistration=mode).start()  # type: ignore[arg-type]
    try:
        old = scripted(plugins, dp_dir, "old.sock")
        old.register()
        old.snapshots.put([dev("x")])
        assert sim.wait_registered(RES)
        new = scripted(plugins, dp_dir, "new.sock")
        new.register()
        new.snapshots.put([dev("x")])
        assert sim.wait_registered(RES, count=2)
        assert old.streams_ended == 0, "the kubelet left the old stream open"
        old.snapshots.put(None)  # the old stream ends now
        assert sim.wait_for(lambda: sim.allocatable(RES) == 0)
        cut = sim.wait_for(lambda: not sim.endpoints[RES].stream_open, timeout=3)
        assert cut is (mode == "buggy")
    finally:
        sim.stop()


def test_restart_removes_only_sockets(sim: KubeletSimulator, dp_dir: Path) -> None:
    (dp_dir / "DEPRECATION").write_text("", encoding="utf-8")
    (dp_dir / "notes.txt").write_text("keep", encoding="utf-8")
    (dp_dir / "sub").mkdir()
    stray = socket.socket(socket.AF_UNIX)
    stray.bind(str(dp_dir / "stale.sock"))
    stray.close()
    sim.restart()
    names = set(os.listdir(dp_dir))
    assert {"DEPRECATION", "notes.txt", "sub", "kubelet.sock", "kubelet_internal_checkpoint"} <= names
    assert "stale.sock" not in names


def test_init_container_devices_are_offered_again_to_the_app_container(
    sim: KubeletSimulator, plugins: list[ScriptedPlugin], dp_dir: Path
) -> None:
    p = scripted(plugins, dp_dir)
    p.register()
    p.snapshots.put([dev(f"d{i}") for i in range(6)])
    assert sim.wait_for(lambda: sim.allocatable(RES) == 6)
    init, app, side = sim.allocate_pod(
        "pod1",
        {RES: 1},
        containers=["app", "side"],
        init_containers=["init"],
        container_requests={"init": {RES: 2}, "app": {RES: 3}, "side": {RES: 1}},
    )
    assert set(init.ids) <= set(app.ids), "the app container reuses the init container's devices first"
    request = p.preferred_requests[-2].container_requests[0]
    assert sorted(request.must_include_deviceIDs) == sorted(init.ids) and request.allocation_size == 3
    assert not set(side.ids) & set(app.ids)


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


def test_exclusive_numa_packing_as_the_topology_manager_sees_it(  # type: ignore[no-untyped-def]
    dp_dir: Path, start_plugin
) -> None:
    """4 NICs, 2 per NUMA node: under single-numa-node a 2-NIC pod lands on one NUMA node and a
    3-NIC pod is refused by admission, as on a real node."""
    sim = KubeletSimulator(str(dp_dir), topology_policy="single-numa-node").start()
    try:
        start_plugin({"mode": "exclusive"})
        assert sim.wait_registered("rdma/hca", timeout=20)
        numa = {i: d.topology.nodes[0].ID for i, d in sim.devices("rdma/hca").items()}
        alloc = sim.allocate("rdma/hca", 2, pod="p1")
        assert len({numa[i] for i in alloc.ids}) == 1
        sim.release("p1")
        with pytest.raises(AllocationFailed, match="TopologyAffinityError"):
            sim.allocate("rdma/hca", 3, pod="p2")
    finally:
        sim.stop()


def test_dial_back_blocks_up_to_10_s_and_fails_registration(sim: KubeletSimulator, dp_dir: Path) -> None:
    """client.go dial: the kubelet waits (up to 10 s) for the plugin socket inside Register."""
    start = time.monotonic()
    with grpc.insecure_channel(f"unix://{dp_dir / 'kubelet.sock'}") as ch, pytest.raises(grpc.RpcError) as err:
        pb_grpc.RegistrationStub(ch).Register(
            pb.RegisterRequest(version="v1beta1", endpoint="nobody.sock", resource_name=RES), timeout=30
        )
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert time.monotonic() - start >= 9.0, "the kubelet gives the plugin 10 s to answer"
    assert sim.rejections == ["dial nobody.sock"]
