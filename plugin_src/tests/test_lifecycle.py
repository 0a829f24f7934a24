"""What the kubelet and a real node do to a running plugin (issues 11 and 21).

Every test runs the real ``serve`` process, most against both kubelets: the strict simulator and
the kubelet's own device manager (``kubelet`` fixture, kubesim/real.py). The only time bounds are
protocol-level waits (how long to wait for a registration or a snapshot before calling it lost);
figures live in bench/.
"""

from __future__ import annotations

import errno
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from conftest import (
    FIXED_KINDS,
    REREGISTRATION_KINDS,
    ScriptedPlugin,
    device,
    free_port,
    plugin_socket,
    real_kubelet_binary,
    serve_command,
    start_kind,
    start_kubelet,
    stop_kubelet,
)

from rdma_device_plugin import sockets
from rdma_device_plugin.api import deviceplugin_pb2 as pb
from rdma_device_plugin.api import deviceplugin_pb2_grpc as pb_grpc
from rdma_kubesim import KubeletSimulator
from rdma_kubesim.handover import Plan, race_trial
from rdma_kubesim.real import RealKubelet
from rdma_node import fixtures

RES = "rdma/hca"
FAST: dict[str, Any] = {"health": {"intervalSeconds": 0.1}, "rediscoveryIntervalSeconds": 0.5}
Kubelet = KubeletSimulator | RealKubelet


def registrations(sim: KubeletSimulator, resource: str = RES) -> int:
    return sum(1 for _, r in sim.registrations if r == resource)


@pytest.fixture(params=["buggy", "fixed"])
def strict_sim(request: pytest.FixtureRequest, dp_dir: Path) -> Any:
    """Both kubelet behaviours; the buggy one with its teardown race widened."""
    mode = request.param
    sim = KubeletSimulator(str(dp_dir), reregistration=mode, stale_teardown_delay=0.2 if mode == "buggy" else 0.0)
    yield sim.start()
    sim.stop()


# --------------------------------------------------------------------------- kubelet events


@pytest.mark.timeout(90)
def test_kubelet_ending_the_stream_gets_a_new_registration_and_a_full_snapshot(  # type: ignore[no-untyped-def]
    strict_sim: KubeletSimulator, start_plugin
) -> None:
    sim = strict_sim
    plugin = start_plugin(FAST)
    assert sim.wait_registered(RES), plugin.output()
    for n in range(3):
        sim.end_stream(RES)
        if sim.reregistration == "buggy":  # a fixed kubelet may disconnect the old client after the new one came
            assert sim.wait_for(lambda: sim.allocatable(RES) == 0, timeout=10)
        assert sim.wait_for(
            lambda n=n: registrations(sim) >= n + 2 and sim.endpoints[RES].stream_open and sim.allocatable(RES) == 1000,
            timeout=20,
        ), plugin.output()[-3000:]
    time.sleep(1.5)  # no re-registration storm afterwards
    settled = registrations(sim)
    time.sleep(1.5)
    assert registrations(sim) == settled
    assert sim.allocatable(RES) == 1000 and sim.endpoints[RES].stream_open
    out = plugin.output()
    # The first at once; the buggy kubelet's widened race cuts the next registration too: a repeat, backed off.
    assert "the kubelet ended the ListAndWatch stream of rdma/hca; registering again at once" in out
    assert "Traceback" not in out


@pytest.mark.timeout(120)
def test_allocate_answers_with_100_listandwatch_streams_open(  # type: ignore[no-untyped-def]
    sim: KubeletSimulator, start_plugin, dp_dir: Path
) -> None:
    """The kubelet never closes old clients and calls Allocate without a deadline: open streams
    must not take the workers Allocate needs (a 32-thread pool hung at the 32nd)."""
    plugin = start_plugin({"mode": "exclusive"})
    assert sim.wait_registered(RES), plugin.output()
    channels = [grpc.insecure_channel(f"unix://{plugin_socket(dp_dir)}") for _ in range(10)]
    streams = []
    try:
        for i in range(100):
            stream = pb_grpc.DevicePluginStub(channels[i % 10]).ListAndWatch(pb.Empty())
            next(stream)  # the first snapshot: the stream is open on the server
            streams.append(stream)
        stub = pb_grpc.DevicePluginStub(channels[0])
        ids = sorted(sim.devices(RES))
        req = pb.AllocateRequest()
        req.container_requests.add(devices_ids=ids[:1])
        resp = stub.Allocate(req, timeout=60)  # a generous wait: a starved server never answers
        assert len(resp.container_responses) == 1
        preq = pb.PreferredAllocationRequest()
        preq.container_requests.add(available_deviceIDs=ids, allocation_size=2)
        assert len(stub.GetPreferredAllocation(preq, timeout=60).container_responses[0].deviceIDs) == 2
        assert sim.allocate(RES, 1, pod="p").ids
    finally:
        for s in streams:
            s.cancel()
        for ch in channels:
            ch.close()
    assert "Traceback" not in plugin.output()


@pytest.mark.timeout(90)
def test_config_file_edited_into_invalid_bytes_or_yaml_while_running(  # type: ignore[no-untyped-def]
    kubelet: Kubelet, start_plugin, node: fixtures.FixtureNode, short_tmp: Path
) -> None:
    """Logged and ignored; health probing goes on (a port DOWN is still reported)."""
    plugin = start_plugin(FAST)
    assert kubelet.wait_registered(RES), plugin.output()
    config = short_tmp / "config0.yaml"
    config.write_bytes(b"mode: shared\n\xff\xfe\x00garbage\n")
    time.sleep(0.5)
    node.set_port_state("mlx5_bond_1", "DOWN")
    assert kubelet.wait_for(lambda: kubelet.allocatable(RES) == 0, timeout=10), plugin.output()[-3000:]
    config.write_text("mode: [unclosed\n", encoding="utf-8")
    time.sleep(0.5)
    node.set_port_state("mlx5_bond_1", "ACTIVE")
    assert kubelet.wait_for(lambda: kubelet.allocatable(RES) == 1000, timeout=10), plugin.output()[-3000:]
    out = plugin.output()
    assert "not UTF-8 text" in out and "not valid YAML" in out
    assert plugin.proc.poll() is None and "Traceback" not in out


def test_health_change_is_logged_as_a_person_reads_it(  # type: ignore[no-untyped-def]
    kubelet: Kubelet, start_plugin, node: fixtures.FixtureNode
) -> None:
    plugin = start_plugin(FAST)
    assert kubelet.wait_registered(RES), plugin.output()
    node.set_port_state("mlx5_bond_1", "DOWN")
    assert kubelet.wait_for(lambda: kubelet.allocatable(RES) == 0, timeout=10)
    assert kubelet.wait_for(lambda: "mlx5_bond_1 port 1 DOWN: rdma/hca Unhealthy (policy all)" in plugin.output(), 10)


# --------------------------------------------------------------------------- liveness


def test_healthcheck_passes_while_serving_and_fails_when_stale(  # type: ignore[no-untyped-def]
    kubelet: Kubelet, start_plugin, short_tmp: Path
) -> None:
    plugin = start_plugin(FAST)
    assert kubelet.wait_registered(RES), plugin.output()
    health = short_tmp / "health.json"
    cmd = [sys.executable, "-m", "rdma_device_plugin", "healthcheck", "--health-file", str(health)]
    ok = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)
    assert ok.returncode == 0, ok.stderr
    # A frozen process: the loops stop completing, the file goes stale.
    doc = json.loads(health.read_text(encoding="utf-8"))
    plugin.proc.send_signal(signal.SIGSTOP)
    try:
        stale = {**doc, "loops": {k: {**v, "last": v["last"] - 3600} for k, v in doc["loops"].items()}}
        health.write_text(json.dumps(stale), encoding="utf-8")
        bad = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)
        assert bad.returncode == 1 and "loop probe has not completed" in bad.stderr
        unreg = {**doc, "unregistered_since": {RES: time.time() - 3600}}
        health.write_text(json.dumps(unreg), encoding="utf-8")
        bad = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)
        assert bad.returncode == 1 and "rdma/hca has not been registered" in bad.stderr
    finally:
        plugin.proc.send_signal(signal.SIGCONT)
    missing = subprocess.run([*cmd[:-1], str(short_tmp / "nope")], capture_output=True, text=True, check=False)
    assert missing.returncode == 1 and "cannot read the health file" in missing.stderr


def test_liveness_file_says_a_registration_change_at_once(node: fixtures.FixtureNode, short_tmp: Path) -> None:
    """The liveness file is rewritten every few seconds when nothing changes (issue 15: fewer
    wake-ups), but a registration change is written at the next pass, not at the next period."""
    from rdma_device_plugin.config import PluginConfig
    from rdma_device_plugin.registration import State
    from rdma_device_plugin.supervisor import Supervisor

    dp = short_tmp / "dp-live"
    dp.mkdir()
    health = short_tmp / "live.json"
    sup = Supervisor(PluginConfig(), node.sysfs, node.dev, str(dp), health_file=str(health))
    registration = sup.registrations[0]
    registration._set(State.REGISTERED)
    sup._write_health()
    assert json.loads(health.read_text(encoding="utf-8"))["registered"] == [RES]
    registration._set(State.SERVING)  # e.g. the kubelet ended the stream
    sup._write_health()
    doc = json.loads(health.read_text(encoding="utf-8"))
    assert doc["registered"] == [] and RES in doc["unregistered_since"]


def test_liveness_allows_the_slower_link_event_poll(node: fixtures.FixtureNode, short_tmp: Path) -> None:
    """With link events the port poll may be as slow as linkEventsIntervalSeconds: the probe loop's
    allowed age follows it, or `healthcheck` would restart a healthy plugin between two polls."""
    from rdma_device_plugin.config import load_config_text
    from rdma_device_plugin.supervisor import Supervisor

    dp = short_tmp / "dp-slow"
    dp.mkdir()
    health = short_tmp / "slow.json"
    config = load_config_text("health: {intervalSeconds: 0.1, linkEventsIntervalSeconds: 30}", "test")
    sup = Supervisor(config, node.sysfs, node.dev, str(dp), health_file=str(health))
    sup.heartbeats["probe"] = sup.heartbeats["watch"] = time.time()
    sup._write_health()
    loops = json.loads(health.read_text(encoding="utf-8"))["loops"]
    assert loops["probe"]["max_age"] >= 5 * 30 and loops["watch"]["max_age"] == 10.0


# --------------------------------------------------------------------------- node events


@pytest.mark.timeout(90)
@pytest.mark.parametrize("backend", ["sim", "real"])
def test_device_plugin_dir_removed_then_recreated(  # type: ignore[no-untyped-def]
    start_plugin, dp_dir: Path, short_tmp: Path, backend: str
) -> None:
    kubelet = start_kubelet(backend, dp_dir, short_tmp / "kubelet.log")
    plugin = start_plugin(FAST)
    try:
        assert kubelet.wait_registered(RES), plugin.output()
        stop_kubelet(kubelet)
        # Gone in one step, as the plugin sees it (it serves a deleted socket again at once, so an
        # rmtree in place would race with it: ENOTEMPTY)
        gone = dp_dir.with_name(dp_dir.name + ".gone")
        os.rename(dp_dir, gone)
        shutil.rmtree(gone)
        time.sleep(1.5)
        assert plugin.proc.poll() is None
        kubelet = start_kubelet(backend, dp_dir, short_tmp / "kubelet2.log")  # the kubelet re-creates it
        assert kubelet.wait_registered(RES, timeout=30), plugin.output()[-3000:]
        assert kubelet.allocatable(RES) == 1000
        out = plugin.output()
        assert "kubelet.sock is missing" in out
        # Logged once per episode and reason, not per retry: within an episode a warning comes again
        # only when its reason changes (the dir is missing, then the kubelet's start empties the
        # re-created dir under the socket being bound), and each episode ends with one recovery
        # line. (With the real kubelet a second episode can occur for the same reason.)
        pattern = r"WARNING +\S+: cannot serve rdma/hca at \S+ \((.*)\); retrying|INFO +\S+: (serving rdma/hca again)"
        episodes: list[list[str]] = [[]]
        for reason, recovered in re.findall(pattern, out):
            if recovered:
                assert episodes[-1], f"a recovery line with no warning before it:\n{out[-3000:]}"
                episodes.append([])
            else:
                assert reason not in episodes[-1][-1:], f"the same warning twice in one episode:\n{out[-3000:]}"
                episodes[-1].append(reason)
        assert episodes[-1] == [] and 2 <= len(episodes) <= 3, out[-3000:]
        assert "Traceback" not in out
    finally:
        stop_kubelet(kubelet)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", ["sim", "real"])
@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None, reason="needs root and unshare (util-linux)")
def test_a_bind_mounted_device_plugin_dir_deleted_on_the_host_makes_the_plugin_exit(  # type: ignore[no-untyped-def]
    start_plugin, dp_dir: Path, short_tmp: Path, backend: str
) -> None:
    """Issue 30: the chart bind-mounts the host's device-plugin dir (hostPath). Deleted on the host,
    the kubelet creates a new one, but the container's mount still shows the deleted directory: the
    plugin would wait for a kubelet.sock that never appears there. It exits non-zero with one clear
    line instead, so that the container restarts onto the new directory. Run in a mount namespace
    of its own, with the dir bind-mounted as in a pod."""
    host = short_tmp / "host-dp"
    host.mkdir()
    kubelet = start_kubelet(backend, host, short_tmp / "kubelet.log")
    pod = ["unshare", "--mount", "--propagation", "private", "sh", "-c"]
    pod += ['mount --bind "$1" "$2" && shift 2 && exec "$@"', "sh", str(host), str(dp_dir)]
    if subprocess.run([*pod[:4], "true"], capture_output=True, check=False).returncode != 0:
        pytest.skip("no mount namespace here")
    plugin = start_plugin(FAST, prefix=pod)
    try:
        assert kubelet.wait_registered(RES, timeout=30), plugin.output()
        stop_kubelet(kubelet)
        # The host's rm -rf (the pod's mount keeps the deleted directory). The plugin serves a fresh
        # socket when the kubelet's stream ends: one bound between rmtree's listing and its rmdir
        # fails it (ENOTEMPTY), so again until the directory is gone; once it is, nothing can be bound.
        while host.exists():
            try:
                shutil.rmtree(host)
            except OSError as exc:
                if exc.errno not in (errno.ENOTEMPTY, errno.ENOENT):
                    raise
        host.mkdir()
        kubelet = start_kubelet(backend, host, short_tmp / "kubelet2.log")  # a kubelet on the new one
        rc = plugin.proc.wait(timeout=30)
        assert rc == 4, plugin.output()[-3000:]
        out = plugin.output()
        assert out.count("was deleted on the host") == 1, out[-3000:]
        line = next(x for x in out.splitlines() if "was deleted on the host" in x)
        assert f"the device-plugin dir {dp_dir} was deleted on the host" in line and "exiting" in line
        assert "Traceback" not in out
    finally:
        stop_kubelet(kubelet)


def test_unreadable_rdma_devices_are_logged_once_and_do_not_force_relists(  # type: ignore[no-untyped-def]
    kubelet: Kubelet, start_plugin, node: fixtures.FixtureNode
) -> None:
    for name in ("rxe0", "siw0"):  # soft devices: no PCI function behind them
        os.makedirs(os.path.join(node.sysfs, "class", "infiniband", name, "ports", "1"))
    plugin = start_plugin({"health": {"intervalSeconds": 0.1}, "rediscoveryIntervalSeconds": 3600})
    assert kubelet.wait_registered(RES), plugin.output()
    time.sleep(2.0)  # about 20 probes
    out = plugin.output()
    assert out.count("RDMA device rxe0 left out") == 1 and out.count("RDMA device siw0 left out") == 1, out
    assert "RDMA devices changed on the node" not in out, "an unreadable device looked like a change at every probe"


@pytest.mark.timeout(120)
def test_a_nic_without_its_uverbs_node_is_said_once_and_rechecked_with_backoff(  # type: ignore[no-untyped-def]
    sim: KubeletSimulator, start_plugin, short_tmp: Path
) -> None:
    """Issue 30: a selected NIC whose /dev/infiniband/uverbsN is missing (udev not done, ib_uverbs not
    loaded) was re-listed every second, silently. One warning; re-listed 1 s later, then at doubling
    intervals; Healthy as soon as a re-check finds the node."""
    spec = fixtures.with_nic_changes(fixtures.lingjun_node(nics=4), "mlx5_bond_3", char_device=False)
    fx = fixtures.write_node(str(short_tmp / "no-uverbs"), spec)
    port = free_port()
    config = {"health": {"intervalSeconds": 0.1}, "rediscoveryIntervalSeconds": 3600}
    plugin = start_plugin(config, fixture=fx, extra=["--metrics-address", f"127.0.0.1:{port}"])
    assert sim.wait_registered(RES, timeout=30), plugin.output()
    assert sim.allocatable(RES) == 0  # policy all: the NIC without uverbs is Unhealthy
    t0 = time.monotonic()

    def relists() -> float:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
            text = resp.read().decode()
        return float(re.search(r"^rdma_dp_rediscoveries_total (\S+)$", text, re.M).group(1))  # type: ignore[union-attr]

    start = relists()
    time.sleep(10.0)
    elapsed = time.monotonic() - t0
    done = relists() - start
    assert done <= 4, f"{done} re-lists in {elapsed:.0f} s: not backing off (a second each before)"
    out = plugin.output()
    assert out.count("WARNING rdma_device_plugin.discovery: mlx5_bond_3 has no uverbs") == 1, out[-3000:]
    uverbs = next(n for n in spec.nics if n.name == "mlx5_bond_3").uverbs
    Path(fx.dev, "infiniband", f"uverbs{uverbs}").touch()  # udev catches up
    assert sim.wait_allocatable(RES, 1000, timeout=40), plugin.output()[-3000:]
    # Said by the re-list after it published the pool (the kubelet may see 1000 first).
    assert sim.wait_for(lambda: "a NIC's uverbs character device is there now" in plugin.output(), timeout=10)


def test_duplicate_ids_in_one_allocate_are_refused(  # type: ignore[no-untyped-def]
    kubelet: Kubelet, start_plugin, dp_dir: Path
) -> None:
    plugin = start_plugin({"mode": "exclusive"})
    assert kubelet.wait_registered(RES), plugin.output()
    one = sorted(kubelet.health(RES))[0]
    req = pb.AllocateRequest()
    req.container_requests.add(devices_ids=[one, one])
    with grpc.insecure_channel(f"unix://{plugin_socket(dp_dir)}") as ch, pytest.raises(grpc.RpcError) as err:
        pb_grpc.DevicePluginStub(ch).Allocate(req, timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "more than once" in (err.value.details() or "")


def test_registration_retries_back_off_and_log_once(start_plugin, dp_dir: Path) -> None:  # type: ignore[no-untyped-def]
    """A kubelet.sock that refuses registration (a plain socket nobody answers gRPC on)."""
    import socket

    blackhole = socket.socket(socket.AF_UNIX)
    blackhole.bind(str(dp_dir / "kubelet.sock"))
    try:
        plugin = start_plugin(FAST)
        time.sleep(6.0)
        out = plugin.output()
        warned = "WARNING rdma_device_plugin.supervisor: registration of rdma/hca with the kubelet keeps failing"
        assert out.count(warned) == 1, out
        assert out.count("DEBUG   rdma_device_plugin.supervisor: registration of rdma/hca") <= 5, "backoff: not 2/s"
        assert plugin.proc.poll() is None and "Traceback" not in out
    finally:
        blackhole.close()


def test_renamed_nic_is_the_same_device(  # type: ignore[no-untyped-def]
    kubelet: Kubelet, start_plugin, node: fixtures.FixtureNode
) -> None:
    """LAG re-formation renames mlx5_bond_0 -> rocep31s0 on the same PCI function: the pool
    becomes Healthy again and Allocate hands out the new name."""
    plugin = start_plugin(FAST)
    assert kubelet.wait_registered(RES), plugin.output()
    spec = next(n for n in fixtures.lingjun_node(nics=4).nics if n.name == "mlx5_bond_0")
    node.remove_nic("mlx5_bond_0")
    assert kubelet.wait_for(lambda: kubelet.allocatable(RES) == 0, timeout=10)
    node.add_nic(replace(spec, name="rocep31s0"))
    assert kubelet.wait_for(lambda: kubelet.allocatable(RES) == 1000, timeout=10), plugin.output()[-3000:]
    alloc = kubelet.allocate(RES, 1, pod="p")
    assert "rocep31s0" in alloc.envs["RDMA_DEVICES"] and "mlx5_bond_0" not in alloc.envs["RDMA_DEVICES"]
    assert "NIC mlx5_bond_0 (0000:1a:00.0) is now named rocep31s0" in plugin.output()


def test_a_vanished_nic_leaves_the_pool_after_the_grace(  # type: ignore[no-untyped-def]
    kubelet: Kubelet, start_plugin, node: fixtures.FixtureNode
) -> None:
    plugin = start_plugin({**FAST, "health": {"intervalSeconds": 0.1, "vanishGraceSeconds": 2}})
    assert kubelet.wait_registered(RES), plugin.output()
    node.remove_nic("mlx5_bond_3")
    assert kubelet.wait_for(lambda: kubelet.allocatable(RES) == 0, timeout=10)
    assert kubelet.wait_for(lambda: kubelet.allocatable(RES) == 1000, timeout=20), plugin.output()[-3000:]
    assert "mlx5_bond_3 (0000:7a:00.0) gone for" in plugin.output()
    assert "mlx5_bond_3" not in kubelet.allocate(RES, 1, pod="p").envs["RDMA_DEVICES"]


# --------------------------------------------------------------------------- start-up refusals (exit 2)


def _serve_once(node: fixtures.FixtureNode, dp_dir: Path, config: dict[str, Any], tmp: Path) -> Any:
    path = tmp / "refused.yaml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    return subprocess.run(serve_command(node, dp_dir, path), capture_output=True, text=True, timeout=60, check=False)


def test_exclusive_selectors_that_overlap_are_refused(  # type: ignore[no-untyped-def]
    kubelet: Kubelet, node: fixtures.FixtureNode, dp_dir: Path, short_tmp: Path
) -> None:
    config = {
        "mode": "exclusive",
        "resources": [
            {"name": "rdma/a", "selectors": {"rdmaDevices": ["mlx5_bond_0", "mlx5_bond_1"]}},
            {"name": "rdma/b", "selectors": {"rdmaDevices": ["mlx5_bond_1", "mlx5_bond_2"]}},
        ],
    }
    proc = _serve_once(node, dp_dir, config, short_tmp)
    assert proc.returncode == 2, proc.stderr
    assert "NIC mlx5_bond_1 is selected by resources rdma/a, rdma/b" in proc.stderr
    assert kubelet.registration_count("rdma/a") == kubelet.registration_count("rdma/b") == 0


def test_socket_path_too_long_for_the_dir_is_refused(node: fixtures.FixtureNode, short_tmp: Path) -> None:
    deep = short_tmp / ("d" * 60) / ("e" * 20)
    deep.mkdir(parents=True)
    proc = _serve_once(node, deep, {"resources": [{"name": "rdma/" + "x" * 30}]}, short_tmp)
    assert proc.returncode == 2
    assert "unix sockets allow 107: shorten the resource name or the device-plugin dir" in proc.stderr


# --------------------------------------------------------------------------- only the kubelet's stream counts


@pytest.mark.timeout(120)
def test_a_debugging_clients_streams_ending_change_nothing(  # type: ignore[no-untyped-def]
    kubelet: Kubelet, start_plugin, dp_dir: Path
) -> None:
    """Five short-lived ListAndWatch clients (grpcurl, a debugging tool) used to be taken for the
    kubelet: five re-registrations and WARNINGs. The kubelet's stream is the first opened after
    Register (server.py); the others end with a debug line."""
    plugin = start_plugin(FAST)
    assert kubelet.wait_registered(RES), plugin.output()
    before = kubelet.registration_count(RES)
    for _ in range(5):
        with grpc.insecure_channel(f"unix://{plugin_socket(dp_dir)}") as ch:
            first = next(pb_grpc.DevicePluginStub(ch).ListAndWatch(pb.Empty(), timeout=30))
            assert len(first.devices) == 1000
    time.sleep(1.5)  # a re-registration would have been sent by now, even after a backoff
    out = plugin.output()
    assert kubelet.registration_count(RES) == before, out[-3000:]
    assert "the kubelet ended the ListAndWatch stream" not in out
    assert kubelet.allocatable(RES) == 1000
    assert kubelet.wait_for(lambda: plugin.output().count("a ListAndWatch stream of another client ended") == 5, 30)
    out = plugin.output()
    assert "Traceback" not in out, out[max(0, out.find("Traceback") - 1500) :][:5000]  # the record around it


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["sim-1.28-1.34", "real-1.32"])
def test_the_kubelet_cutting_its_stream_gets_a_registration_at_once(  # type: ignore[no-untyped-def]
    start_plugin, dp_dir: Path, short_tmp: Path, kind: str
) -> None:
    """A 1.28-1.34 kubelet cuts the client registered now when an older client's stream of the
    resource ends (kubernetes 121994): another plugin registered rdma/hca first, the real one
    registers, the other's stream ends. The plugin registers again at once, not after a backoff.
    (v1.37 cuts only the other client: test_handover_to_a_new_instance[real] shows it.)"""
    kubelet = start_kind(kind, dp_dir, short_tmp)
    other = ScriptedPlugin(dp_dir, "other.sock", RES)
    try:
        other.register()
        other.snapshots.put([device(f"x{i}") for i in range(3)])
        assert kubelet.wait_for(lambda: kubelet.allocatable(RES) == 3, timeout=30)
        plugin = start_plugin(FAST)
        assert kubelet.wait_registered(RES, count=2, timeout=30), plugin.output()
        assert kubelet.wait_allocatable(RES, 1000, timeout=30)
        other.snapshots.put(None)  # the older stream ends: the kubelet cuts the plugin's client
        assert kubelet.wait_registered(RES, count=3, timeout=30), plugin.output()[-3000:]
        assert kubelet.wait_allocatable(RES, 1000, timeout=30)
        out = plugin.output()
        assert "the kubelet ended the ListAndWatch stream of rdma/hca; registering again at once" in out
        assert "Traceback" not in out
    finally:
        other.stop()
        stop_kubelet(kubelet)


# --------------------------------------------------------------------------- handover between two instances


def _stand_down_and_exit(old: Any, new: Any, kubelet: Kubelet, dp_dir: Path) -> None:
    """The old instance stood down and its files are gone; the new one serves; the old one exits
    without touching the new one's files."""
    assert kubelet.wait_for(lambda: "standing down" in old.output(), timeout=30), old.output()[-3000:]
    newest = sockets.parse(plugin_socket(dp_dir).name)
    assert newest is not None
    assert kubelet.wait_for(
        lambda: {s.instance for s in sockets.instances(str(dp_dir), RES)} == {newest.instance}, timeout=30
    ), os.listdir(dp_dir)
    assert kubelet.wait_allocatable(RES, 1000, timeout=30)
    health = dp_dir.parent / "health1.json"
    assert kubelet.wait_for(lambda: RES in _health(health).get("registered", []), timeout=30)
    rc, _ = old.stop()
    assert rc == 0
    assert kubelet.wait_allocatable(RES, 1000, timeout=30)
    assert "was removed; serving it again" not in new.output(), "the old instance removed the new one's socket"


def _health(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text(encoding="utf-8"))  # type: ignore[no-any-return]
    except (OSError, ValueError):
        return {}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("slow", [False, True], ids=["plain", "slow"])
@pytest.mark.parametrize("kind", REREGISTRATION_KINDS)
def test_handover_to_a_new_instance(  # type: ignore[no-untyped-def]
    start_plugin, dp_dir: Path, short_tmp: Path, kind: str, slow: bool
) -> None:
    """A DaemonSet rolling update: the new instance registers while the old one serves (slow: the
    old one paused meanwhile, a throttled pod). Every instance has its own socket names; once the
    kubelet holds the new one's stream it renames the old one's socket, the old one stands down and
    removes it when its streams are over.

    Kubelets with PR 135437 (endpoints by socket path, the real v1.37): allocatable never drops to
    0. Kubelets 1.28-1.34 (the simulator's default, and the real v1.32): the old stream's end cuts
    the new client, which registers again on a fresh socket once the old one's streams are over: one
    short window at 0, no backoff in it."""
    kubelet = start_kind(kind, dp_dir, short_tmp)
    try:
        old = start_plugin(FAST)
        assert kubelet.wait_registered(RES, timeout=30), old.output()
        kubelet.record_start()
        if slow:
            old.proc.send_signal(signal.SIGSTOP)
        try:
            new = start_plugin(FAST)
            assert kubelet.wait_registered(RES, count=2, timeout=30), new.output()
            if slow:
                time.sleep(0.3)
        finally:
            old.proc.send_signal(signal.SIGCONT)
        _stand_down_and_exit(old, new, kubelet, dp_dir)
        time.sleep(0.5)  # nothing else happens afterwards
        record = kubelet.record_stop()
        zero_windows = sum(
            1
            for a, b in zip(record["transitions"], record["transitions"][1:], strict=False)
            if a.get("allocatable", {}).get(RES) and not b.get("allocatable", {}).get(RES)
        )
        out = new.output()
        if kind in FIXED_KINDS:
            assert zero_windows == 0, record["transitions"]
            assert "the kubelet ended the ListAndWatch stream" not in out
        else:
            assert zero_windows == 1, record["transitions"]
            assert "the kubelet ended the ListAndWatch stream of rdma/hca; registering again" in out
            assert "registration of rdma/hca with the kubelet failed" not in out
            assert "did not open the ListAndWatch stream" not in out
        assert "took over rdma/hca from an older instance: renamed its socket" in out
        assert kubelet.allocatable(RES) == 1000
        assert kubelet.allocate(RES, 1, pod="after").envs["RDMA_DEVICES"]  # the endpoint it holds answers
        assert "Traceback" not in old.output() + out
    finally:
        stop_kubelet(kubelet)


@pytest.mark.timeout(180)
def test_an_older_instances_register_reaching_the_kubelet_last_never_leaves_0(  # type: ignore[no-untyped-def]
    start_plugin, dp_dir: Path
) -> None:
    """Issue 30: the older instance's Register reaches a 1.28-1.34 kubelet after the newer one's (the
    simulator holds it until the newer one is connected; the newer one is paused meanwhile, so it
    cannot act on it). The kubelet's client is then the older one's; the newer one takes over, the
    older one stands down, and its stream's end disconnects that client: allocatable 0 with the newer
    one's stream open and nothing cut on its side. The newer one registers again once the older
    one's socket went: allocatable comes back and the endpoint answers Allocate."""
    sim = KubeletSimulator(str(dp_dir), reregistration="buggy").start()
    held, release, older_connected = threading.Event(), threading.Event(), threading.Event()
    procs: dict[str, Any] = {}
    first: list[str] = []

    def choreography(phase: str, endpoint: str) -> None:
        if not first:
            first.append(endpoint)  # the older instance's
        older = endpoint == first[0]
        if phase == "received" and older and not held.is_set():
            held.set()
            release.wait(30)
        elif phase == "connected" and older:
            older_connected.set()
        elif phase == "connected" and not older and not release.is_set():
            procs["new"].proc.send_signal(signal.SIGSTOP)  # it cannot see what comes next
            release.set()
            older_connected.wait(30)
            procs["new"].proc.send_signal(signal.SIGCONT)

    sim.on_register = choreography
    try:
        procs["old"] = old = start_plugin(FAST)
        assert held.wait(30), old.output()
        procs["new"] = new = start_plugin(FAST)
        assert older_connected.wait(30), new.output()
        assert sim.wait_for(lambda: "standing down" in old.output(), timeout=30), old.output()[-3000:]
        older = sockets.parse(first[0])
        assert older is not None

        def served_by_the_newer() -> bool:
            ep = sim.endpoints[RES]
            return (
                sockets.parse(ep.socket).instance != older.instance  # type: ignore[union-attr]
                and ep.stream_open
                and ep.stop_time is None
                and sim.allocatable(RES) == 1000
            )

        assert sim.wait_for(served_by_the_newer, timeout=30), (
            f"older:\n{old.output()[-3000:]}\nnewer:\n{new.output()[-3000:]}"
        )
        assert sim.allocate(RES, 1, pod="after").envs["RDMA_DEVICES"]
        assert "Traceback" not in old.output() + new.output()
    finally:
        sim.on_register = None
        release.set()
        for p in procs.values():
            p.proc.send_signal(signal.SIGCONT)
        sim.stop()


@pytest.mark.timeout(600)
@pytest.mark.parametrize("version", ["1.37", "1.32"])
def test_two_instances_racing_against_the_kubelets_device_manager(short_tmp: Path, version: str) -> None:
    """Issue 30, against the kubelet's own device manager (v1.37: endpoints by socket path; v1.32:
    the 1.28-1.34 cut of the client registered last): two instances started 0-50 ms apart, one of
    them stalled (SIGSTOP) for 0-3 s early on, then the one started first exits. Every trial ends
    at the full count within 1 s of that exit, with a live endpoint (a pod is admitted).
    bench/bench_handover.py runs a hundred of these on each version and reports the time below the count."""
    binary = real_kubelet_binary(version)
    node = fixtures.write_node(str(short_tmp / "node"), fixtures.lingjun_node(nics=4))
    rng = random.Random(30)
    for i in range(6):
        trial = race_trial(binary, node, str(short_tmp), Plan.draw(rng), name=f"t{i}")
        assert trial.ok, (trial, Path(trial.logs[0]).read_text()[-2000:], Path(trial.logs[1]).read_text()[-2000:])


@pytest.mark.timeout(120)
@pytest.mark.skipif(shutil.which("unshare") is None, reason="unshare (util-linux) is not installed")
def test_handover_between_two_instances_that_are_both_pid_1(  # type: ignore[no-untyped-def]
    sim: KubeletSimulator, start_plugin, dp_dir: Path
) -> None:
    """In a pod the plugin is PID 1: two instances on a node share the PID, so nothing of a
    socket name may come from it (the temporary names `.{pid}.{n}` did)."""
    pid1 = ["unshare", "--pid", "--kill-child=SIGTERM"]
    if subprocess.run([*pid1, "true"], capture_output=True, check=False).returncode != 0:
        pytest.skip("no PID namespace here")
    old = start_plugin(FAST, prefix=pid1)
    assert sim.wait_registered(RES), old.output()
    new = start_plugin(FAST, prefix=pid1)
    assert sim.wait_for(lambda: "standing down" in old.output(), timeout=30), old.output()[-3000:]
    assert sim.wait_registered(RES, count=2, timeout=30)

    def served(p: Any) -> set[str]:
        return {line.split("socket=")[1].split()[0] for line in p.output().splitlines()
                if "INFO    rdma_device_plugin.server: serving" in line}  # fmt: skip

    # Each registration is of a fresh name, so the new instance may have served two by now (the
    # simulator cuts its client when the old stream ends, as kubelets 1.28-1.34 do): no name is shared.
    old_names, new_names = served(old), served(new)
    assert old_names and new_names and not old_names & new_names, (old_names, new_names)
    instances = {sockets.parse(Path(n).name).instance for n in old_names | new_names}  # type: ignore[union-attr]
    assert len(instances) == 2, instances
    # unshare ignores SIGTERM while it waits: the plugin (its child) gets it, as from the kubelet
    with open(f"/proc/{old.proc.pid}/task/{old.proc.pid}/children", encoding="ascii") as fh:
        os.kill(int(fh.read().split()[0]), signal.SIGTERM)
    assert old.proc.wait(timeout=30) == 0
    assert sim.wait_allocatable(RES, 1000, timeout=30) and sim.endpoints[RES].stream_open
    assert "Traceback" not in old.output() + new.output()


@pytest.mark.timeout(120)
def test_stood_down_instance_serves_again_when_the_newer_one_dies(  # type: ignore[no-untyped-def]
    kubelet: Kubelet, start_plugin, dp_dir: Path
) -> None:
    """A rollout that fails: the new pod is killed after taking over. Its socket is left behind,
    listened on by nobody; the stood-down instance sees that within a second or two and serves again."""
    old = start_plugin(FAST)
    assert kubelet.wait_registered(RES), old.output()
    new = start_plugin(FAST)
    assert kubelet.wait_for(lambda: "standing down" in old.output(), timeout=30), old.output()[-3000:]
    new.stop(signal.SIGKILL)
    assert kubelet.wait_for(lambda: "no newer instance serves rdma/hca any more" in old.output(), timeout=30)
    assert kubelet.wait_allocatable(RES, 1000, timeout=30), old.output()[-3000:]
    assert kubelet.wait_for(lambda: "removed the stale socket" in old.output(), timeout=30)
    assert [s.instance for s in sockets.instances(str(dp_dir), RES)] == [
        sockets.parse(plugin_socket(dp_dir).name).instance  # type: ignore[union-attr]
    ]
    assert "Traceback" not in old.output()


# --------------------------------------------------------------------------- a kubelet that never answers


class HungKubelet:
    """A kubelet.sock that accepts connections and never answers: Register waits for its deadline."""

    def __init__(self, dp_dir: Path) -> None:
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.bind(str(dp_dir / "kubelet.sock"))
        self.sock.listen(16)
        self.accepted: list[socket.socket] = []
        self.connected = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted.append(conn)
            self.connected.set()

    def close(self) -> None:
        self.sock.close()
        for conn in self.accepted:
            conn.close()


def _status_file(dp_dir: Path) -> dict[str, Any]:
    from rdma_device_plugin.status import default_status_file

    try:
        with open(default_status_file(str(dp_dir)), encoding="utf-8") as fh:
            return json.load(fh)  # type: ignore[no-any-return]
    except (OSError, ValueError):
        return {}


@pytest.mark.timeout(120)
def test_a_kubelet_that_never_answers_freezes_nothing(  # type: ignore[no-untyped-def]
    start_plugin, node: fixtures.FixtureNode, dp_dir: Path, short_tmp: Path
) -> None:
    """Register to a kubelet.sock that accepts and never answers runs on the gRPC loop: the
    supervisor loop goes on probing (a port DOWN reaches the pool and the status file at once), the
    liveness file stays fresh, and SIGTERM exits long before Register's 10 s deadline."""
    hung = HungKubelet(dp_dir)
    try:
        plugin = start_plugin(FAST)
        assert hung.connected.wait(30), plugin.output()
        health = short_tmp / "health.json"
        t0 = time.monotonic()
        node.set_port_state("mlx5_bond_1", "DOWN")
        deadline = t0 + 5.0
        while _status_file(dp_dir).get("resources", [{}])[0].get("allocatable") != 0:
            assert time.monotonic() < deadline, "the port DOWN did not reach the pool: the loop is blocked"
            time.sleep(0.05)
        # The liveness file is rewritten at least every 3 s by the loop: never stale while Register waits.
        oldest = 0.0
        while time.monotonic() - t0 < 12.0:
            doc = json.loads(health.read_text(encoding="utf-8"))
            oldest = max(oldest, time.time() - min(loop["last"] for loop in doc["loops"].values()))
            time.sleep(0.2)
        assert oldest < 5.0, f"a loop step did not complete for {oldest:.1f} s"
        check = subprocess.run(
            [sys.executable, "-m", "rdma_device_plugin", "healthcheck", "--health-file", str(health)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert check.returncode == 0, check.stderr
        hung.connected.clear()
        assert hung.connected.wait(30), "no new Register attempt"  # a Register is in flight now
        time.sleep(0.5)
        rc, took = plugin.stop()
        assert rc == 0 and took < 5.0, f"SIGTERM took {took:.1f} s with a Register in flight"
        assert "Traceback" not in plugin.output()
    finally:
        hung.close()
