"""Fault and load tests: the real ``serve`` process against both kubelets (the simulator and the
kubelet's own device manager, the ``kubelet`` fixture) where a test needs no simulator internals.

Kubelet restarts under load, port flaps, NIC hot-plug during Allocates, 200 concurrent
Allocates with the stream open, and SIGKILL of the plugin itself. The only time bounds
asserted are protocol-level waits (how long to wait for a re-registration or a snapshot
before calling it lost); speed figures live in bench/bench_plugin.py.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import pytest
from conftest import plugin_socket

from rdma_device_plugin.api import deviceplugin_pb2 as pb
from rdma_device_plugin.api import deviceplugin_pb2_grpc as pb_grpc
from rdma_kubesim import CHECKPOINT, AllocationFailed, KubeletSimulator
from rdma_kubesim.real import RealKubelet, RealKubeletError
from rdma_node import fixtures

RES = "rdma/hca"
Kubelet = KubeletSimulator | RealKubelet
STATUS_DIR = "rdma-device-plugin"  # the status file's directory (status.py), kept by kubelet restarts
INTERVAL = 0.1  # health probe interval used by these tests
REDISCOVERY = 1.0  # rediscoveryIntervalSeconds of these tests
FAST: dict[str, Any] = {"health": {"intervalSeconds": INTERVAL}, "rediscoveryIntervalSeconds": REDISCOVERY}
# Every port change reaches the kubelet: the flap tests below keep snapshots in flight and check the
# last one; holding a flapping NIC down is test_damping.py's subject.
UNDAMPED: dict[str, Any] = {**FAST, "health": {"intervalSeconds": INTERVAL, "flapDamping": {"enabled": False}}}
SPECS = {n.name: n for n in fixtures.lingjun_node(nics=4).nics}  # the conftest `node` fixture
NAMES = sorted(SPECS)
UVERBS = {name: f"/dev/infiniband/uverbs{spec.uverbs}" for name, spec in SPECS.items()}
ALL_PATHS = [UVERBS[n] for n in NAMES] + ["/dev/infiniband/rdma_cm"]
ACTIVE = ("ACTIVE", "ACTIVE_DEFER")


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def thread_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def alloc_request(*ids: str) -> Any:
    req = pb.AllocateRequest()
    req.container_requests.add(devices_ids=list(ids))
    return req


def paths_of(resp: Any) -> list[str]:
    assert len(resp.container_responses) == 1
    return [d.host_path for d in resp.container_responses[0].devices]


@contextmanager
def plugin_stub(dp_dir: Path) -> Iterator[Any]:
    """A client of the plugin's socket now (a kubelet restart makes the plugin serve a new name)."""
    with grpc.insecure_channel(f"unix://{plugin_socket(dp_dir)}") as ch:
        yield pb_grpc.DevicePluginStub(ch)


def dir_entries(dp_dir: Path) -> list[str]:
    """The device-plugin dir with the plugin's one socket shown as SOCK."""
    return sorted("SOCK" if e.startswith("rdma-dp-rdma_hca.") else e for e in os.listdir(dp_dir))


# --------------------------------------------------------------------------- kubelet restarts


@pytest.mark.timeout(180)
def test_kubelet_restarts_50_times_at_random_moments(  # type: ignore[no-untyped-def]
    kubelet: Kubelet, start_plugin, node: fixtures.FixtureNode, dp_dir: Path
) -> None:
    """50 kubelet restarts while ports flap (snapshots in flight) and Allocates run: the
    plugin re-registers every time, exactly once per start, and leaks no socket, fd or thread."""
    plugin = start_plugin(UNDAMPED)
    assert kubelet.wait_registered(RES), plugin.output()
    pid = plugin.proc.pid
    with plugin_stub(dp_dir) as stub:  # warm the gRPC worker pool before the baseline
        for i in range(20):
            assert paths_of(stub.Allocate(alloc_request(f"hca-{i}"), timeout=10)) == ALL_PATHS
    time.sleep(0.5)
    fds0, threads0 = fd_count(pid), thread_count(pid)

    stop = threading.Event()
    stats: Counter[str] = Counter()
    errors: list[str] = []

    def flapper() -> None:  # keeps snapshots flowing, so restarts land mid-send
        rng = random.Random(1)
        while not stop.is_set():
            name = rng.choice(NAMES)
            node.set_port_state(name, "DOWN")
            time.sleep(rng.uniform(0, 0.03))
            node.set_port_state(name, "ACTIVE")
            time.sleep(rng.uniform(0, 0.03))

    def direct_allocator() -> None:  # Allocates in flight when the kubelet restarts
        rng = random.Random(2)
        while not stop.is_set():
            try:
                with plugin_stub(dp_dir) as stub:  # the socket of now: a restart serves a new name
                    while not stop.is_set():
                        ids = alloc_request(f"hca-{rng.randrange(1000)}")
                        if paths_of(stub.Allocate(ids, timeout=5)) != ALL_PATHS:
                            errors.append("wrong device paths")
                        stats["direct ok"] += 1
            except grpc.RpcError as exc:  # the socket is gone until the plugin re-serves
                if exc.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
                    errors.append(f"direct {exc.code().name}: {exc.details()}")
                stats["direct unavailable"] += 1
                time.sleep(0.01)
            except AssertionError:  # between the kubelet's cleanup and the plugin's new socket
                time.sleep(0.01)

    def kubelet_allocator() -> None:  # the simulator's own Allocate, cut by its restart
        n = 0
        while not stop.is_set():
            n += 1
            try:
                kubelet.allocate(RES, 1, pod=f"k{n}")
                stats["kubelet ok"] += 1
                kubelet.release(f"k{n}")
            except (AllocationFailed, RealKubeletError) as exc:
                msg = str(exc)
                # refused: pool unhealthy right now, kubelet between restart and re-registration, or cut
                expected = ("healthy", "unregistered", "stopped", "not running", "endpoint", "UNAVAILABLE", "CANCELLED")
                if not any(e in msg for e in expected):
                    errors.append(f"kubelet: {msg}")
                stats["kubelet refused"] += 1
            except ValueError:  # "Cannot invoke RPC on closed channel": the restart closed it
                stats["kubelet cut"] += 1
            time.sleep(0.005)

    threads = [threading.Thread(target=f, daemon=True) for f in (flapper, direct_allocator, kubelet_allocator)]
    for t in threads:
        t.start()
    rng = random.Random(3)
    try:
        for n in range(50):
            time.sleep(rng.uniform(0, 0.12))  # a random moment relative to flaps and Allocates
            kubelet.restart()
            assert kubelet.wait_registered(RES, timeout=10), (n, plugin.output()[-4000:])
            assert plugin.proc.poll() is None
    finally:
        stop.set()
        for t in threads:
            t.join(10)
    for name in NAMES:
        node.set_port_state(name, "ACTIVE")
    assert kubelet.wait_for(lambda: kubelet.allocatable(RES) == 1000, timeout=5), "the 51st stream stopped delivering"
    time.sleep(1.0)  # let the last Allocate clients and old servers wind down
    registrations = "\n".join(line for line in plugin.output().splitlines() if "regist" in line or "socket" in line)
    assert kubelet.registration_count(RES) == 1, (
        f"one registration per kubelet start, no more, no fewer:\n{registrations[-6000:]}"
    )
    assert kubelet.restarts == 50
    assert not errors, errors[:5]
    assert stats["direct ok"] > 0 and stats["kubelet ok"] > 0, stats
    assert dir_entries(dp_dir) == sorted([CHECKPOINT, "kubelet.sock", "SOCK", STATUS_DIR])
    fds1, threads1 = fd_count(pid), thread_count(pid)
    assert fds1 <= fds0 + 3, f"fd leak: {fds0} -> {fds1} over 50 restarts"
    assert threads1 <= threads0 + 6, f"thread leak: {threads0} -> {threads1} over 50 restarts"
    with plugin_stub(dp_dir) as stub:
        assert paths_of(stub.Allocate(alloc_request("hca-7"), timeout=10)) == ALL_PATHS
    out = plugin.output()
    assert "Traceback" not in out, out[max(0, out.find("Traceback") - 1500) :][:4000]


# --------------------------------------------------------------------------- port flaps


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["shared", "exclusive"])
def test_200_port_flaps_last_snapshot_matches_final_state(  # type: ignore[no-untyped-def]
    sim: KubeletSimulator, start_plugin, short_tmp: Path, mode: str
) -> None:
    """200 state changes on random ports of 2-port NICs, in bursts faster and slower than
    the probe: after every burst the simulator's last snapshot converges to the state
    computed from the fixture, and stays there (no stale snapshot after it)."""
    spec = fixtures.NodeSpec(nics=tuple(replace(n, ports=2) for n in fixtures.lingjun_node(nics=4).nics))
    fx = fixtures.write_node(str(short_tmp / "flap"), spec)
    plugin = start_plugin({**UNDAMPED, "mode": mode}, fixture=fx)
    assert sim.wait_registered(RES), plugin.output()
    pci = {n.name: n.pci_address for n in spec.nics}
    states = {(name, port): "ACTIVE" for name in NAMES for port in (1, 2)}

    def expected() -> object:
        ok = {name: all(states[name, p] in ACTIVE for p in (1, 2)) for name in NAMES}
        if mode == "exclusive":
            return {pci[n]: "Healthy" if ok[n] else "Unhealthy" for n in NAMES}
        return (1000, 1000 if all(ok.values()) else 0)

    def observed() -> object:
        if mode == "exclusive":
            return {i: d.health for i, d in sim.devices(RES).items()}
        return (sim.capacity(RES), sim.allocatable(RES))

    def last_snapshot_matches(want: object) -> bool:
        snap = sim.endpoints[RES].snapshots[-1]
        if mode == "shared":
            return (snap[1], snap[2]) == want
        assert isinstance(want, dict)
        return (snap[1], snap[2]) == (4, list(want.values()).count("Healthy")) and observed() == want

    rng = random.Random(11 if mode == "shared" else 12)
    changes = 0
    for burst in range(10):
        for _ in range(20):
            key = rng.choice(sorted(states))
            new = rng.choice(["ACTIVE", "ACTIVE", "ACTIVE", "ACTIVE_DEFER", "DOWN", "INIT", "ARMED"])
            fx.set_port_state(key[0], new, port=key[1])
            states[key] = new
            changes += 1
            time.sleep(rng.choice([0, 0, 0, 0.01, 0.1]))  # some changes coalesce within one probe
        want = expected()
        assert sim.wait_for(lambda w=want: last_snapshot_matches(w), timeout=5), (burst, observed(), want)
    assert changes == 200
    time.sleep(5 * INTERVAL)  # several more probes: nothing newer and different may arrive
    assert last_snapshot_matches(expected()), (observed(), expected())
    assert sim.registration_count(RES) == 1 and sim.endpoints[RES].stream_open, "the one stream carried every update"
    assert "Traceback" not in plugin.output()


# --------------------------------------------------------------------------- hot-plug

# A removal is noticed by the probe (its NIC names changed) or, at the latest, by the next
# rediscovery; PROBE_RUN bounds the time the re-list itself takes. CI runs showed answers still
# naming a removed NIC 0.35 s and 0.60 s after the removal (probe interval 0.1 s): the probe does
# not always see the change, so the guarantee tested is the rediscovery interval's.
PROBE_RUN = 0.25


@pytest.mark.timeout(60)
def test_hot_plug_never_hands_out_a_removed_nic(  # type: ignore[no-untyped-def]
    kubelet: Kubelet, start_plugin, node: fixtures.FixtureNode, dp_dir: Path
) -> None:
    """NICs removed and re-added while 4 threads call Allocate: an answer to a request sent
    after removal completed + one probe interval (+ probe run time) and received before the
    re-add began never contains the removed NIC's uverbs path; no call fails; the plugin
    survives and uses the re-added NICs again."""
    plugin = start_plugin(FAST)
    assert kubelet.wait_registered(RES), plugin.output()
    records: list[tuple[float, float, list[str] | grpc.RpcError]] = []
    lock = threading.Lock()
    stop = threading.Event()

    def caller(seed: int) -> None:
        rng = random.Random(seed)
        with plugin_stub(dp_dir) as stub:
            while not stop.is_set():
                t_send = time.monotonic()
                out: list[str] | grpc.RpcError
                try:
                    out = paths_of(stub.Allocate(alloc_request(f"hca-{rng.randrange(1000)}"), timeout=10))
                except grpc.RpcError as exc:
                    out = exc
                with lock:
                    records.append((t_send, time.monotonic(), out))

    threads = [threading.Thread(target=caller, args=(i,), daemon=True) for i in range(4)]
    for t in threads:
        t.start()
    windows: list[tuple[str, float, float]] = []  # (NIC, removal completed, re-add started)
    rng = random.Random(5)
    try:
        for _ in range(6):
            victims = rng.sample(NAMES, rng.choice([1, 1, 2]))
            for v in victims:
                node.remove_nic(v)
            removed = time.monotonic()
            time.sleep(rng.uniform(1.5, 1.9))  # longer than REDISCOVERY + PROBE_RUN: answers to check
            readd = time.monotonic()
            for v in victims:
                node.add_nic(SPECS[v])
            windows += [(v, removed, readd) for v in victims]
            time.sleep(rng.uniform(0.2, 0.4))
    finally:
        stop.set()
        for t in threads:
            t.join(15)
    failures = [r for r in records if isinstance(r[2], grpc.RpcError)]
    assert not failures, failures[:3]  # two or more NICs stay present: shared Allocate always has NICs
    checked = 0
    for t_send, t_recv, out in records:
        assert isinstance(out, list)
        for name, removed, readd in windows:
            if t_send >= removed + REDISCOVERY + PROBE_RUN and t_recv <= readd:
                checked += 1
                assert UVERBS[name] not in out, (name, t_send - removed, out)
    assert checked >= 50, f"only {checked} answers fell inside removal windows; the check proved nothing"
    assert plugin.proc.poll() is None
    # every NIC is back: within a rediscovery interval the answers name all four again
    with plugin_stub(dp_dir) as stub:
        deadline = time.monotonic() + 5
        while paths_of(stub.Allocate(alloc_request("hca-1"), timeout=10)) != ALL_PATHS:
            assert time.monotonic() < deadline, "re-added NICs never came back"
            time.sleep(0.1)
    assert "Traceback" not in plugin.output()


# --------------------------------------------------------------------------- load


@pytest.mark.timeout(60)
def test_200_concurrent_allocates_while_the_stream_delivers(  # type: ignore[no-untyped-def]
    kubelet: Kubelet, start_plugin, node: fixtures.FixtureNode, dp_dir: Path
) -> None:
    """Waves of 200 concurrent Allocates run without pause while a port goes down and up:
    every call succeeds with the right devices and both health flips reach the simulator
    over the one ListAndWatch stream while the load is on."""
    plugin = start_plugin(FAST)
    assert kubelet.wait_registered(RES), plugin.output()
    stop = threading.Event()
    in_flight = threading.Event()
    stats: Counter[str] = Counter()
    bad: list[str] = []

    def load() -> None:
        with plugin_stub(dp_dir) as stub:
            while not stop.is_set():
                futures = [stub.Allocate.future(alloc_request(f"hca-{i}"), timeout=60) for i in range(200)]
                in_flight.set()
                for f in futures:
                    try:
                        if paths_of(f.result()) == ALL_PATHS:
                            stats["ok"] += 1
                        else:
                            bad.append("wrong paths")
                    except grpc.RpcError as exc:
                        bad.append(f"{exc.code().name}: {exc.details()}")
                stats["waves"] += 1

    loader = threading.Thread(target=load, daemon=True)
    loader.start()
    assert in_flight.wait(10)
    node.set_port_state("mlx5_bond_1", "DOWN")
    assert kubelet.wait_for(lambda: kubelet.allocatable(RES) == 0, timeout=10), "flip to Unhealthy lost under load"
    down_seen_during_load = loader.is_alive()
    node.set_port_state("mlx5_bond_1", "ACTIVE")
    assert kubelet.wait_for(lambda: kubelet.allocatable(RES) == 1000, timeout=10), "flip to Healthy lost under load"
    up_seen_during_load = loader.is_alive()
    stop.set()
    loader.join(60)
    assert not loader.is_alive()
    assert down_seen_during_load and up_seen_during_load
    assert not bad, bad[:5]
    assert stats["ok"] == 200 * stats["waves"] and stats["waves"] >= 1, stats
    assert kubelet.registration_count(RES) == 1 and kubelet.allocatable(RES) == 1000
    assert plugin.proc.poll() is None


# --------------------------------------------------------------------------- SIGKILL


@pytest.mark.timeout(90)
@pytest.mark.parametrize("mode", ["shared", "exclusive"])
def test_sigkilled_plugin_comes_back_with_the_same_device_ids(  # type: ignore[no-untyped-def]
    kubelet: Kubelet, start_plugin, dp_dir: Path, mode: str
) -> None:
    """SIGKILL while the kubelet holds allocations: the restarted plugin advertises the same IDs,
    all Healthy, Allocate of the held IDs gives the same devices as before, and the dead
    instance's socket is gone (the new one removes it when it takes over)."""
    config = {**FAST, "mode": mode}
    first = start_plugin(config)
    assert kubelet.wait_registered(RES), first.output()
    ids_before = set(kubelet.health(RES))
    assert len(ids_before) == (4 if mode == "exclusive" else 1000)
    held = [kubelet.allocate(RES, 2 if mode == "exclusive" else 1, pod="p1"), kubelet.allocate(RES, 1, pod="p2")]
    rc, _ = first.stop(signal.SIGKILL)
    assert rc == -signal.SIGKILL
    # the kubelet's view of a dead plugin: stream ended, everything unhealthy
    assert kubelet.wait_allocatable(RES, 0, timeout=10)
    second = start_plugin(config)
    assert kubelet.wait_registered(RES, count=2, timeout=15), second.output()
    health = kubelet.health(RES)
    assert set(health) == ids_before
    assert set(health.values()) == {"Healthy"}
    with plugin_stub(dp_dir) as stub:
        for alloc in held:
            assert set(alloc.ids) <= set(health)
            assert paths_of(stub.Allocate(alloc_request(*alloc.ids), timeout=10)) == alloc.device_paths
    assert kubelet.wait_for(
        lambda: dir_entries(dp_dir) == sorted([CHECKPOINT, "kubelet.sock", "SOCK", STATUS_DIR]), 10
    ), os.listdir(dp_dir)
    # the line follows the unlink: under load the listing can see the socket gone before it is logged
    assert kubelet.wait_for(lambda: "removed the stale socket" in second.output(), 5), second.output()
    assert "Traceback" not in second.output()
