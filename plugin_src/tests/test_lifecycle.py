"""What the real kubelet and a real node do to a running plugin (issue 11), against the strict simulator.

Every test runs the real ``serve`` process. The only time bounds are protocol-level waits (how
long to wait for a registration or a snapshot before calling it lost).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from conftest import serve_command

from rdma_device_plugin.api import deviceplugin_pb2 as pb
from rdma_device_plugin.api import deviceplugin_pb2_grpc as pb_grpc
from rdma_device_plugin.kubesim import KubeletSimulator
from rdma_device_plugin.node import fixtures

RES = "rdma/hca"
SOCK = "rdma-dp-rdma_hca.sock"
FAST: dict[str, Any] = {"health": {"intervalSeconds": 0.1}, "rediscoveryIntervalSeconds": 0.5}


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
    assert "the kubelet ended the ListAndWatch stream of rdma/hca; registering again" in plugin.output()
    assert "Traceback" not in plugin.output()


@pytest.mark.timeout(120)
def test_allocate_answers_with_100_listandwatch_streams_open(  # type: ignore[no-untyped-def]
    sim: KubeletSimulator, start_plugin, dp_dir: Path
) -> None:
    """The kubelet never closes old clients and calls Allocate without a deadline: open streams
    must not take the workers Allocate needs (a 32-thread pool hung at the 32nd)."""
    plugin = start_plugin({"mode": "exclusive"})
    assert sim.wait_registered(RES), plugin.output()
    channels = [grpc.insecure_channel(f"unix://{dp_dir / SOCK}") for _ in range(10)]
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
    sim: KubeletSimulator, start_plugin, node: fixtures.FixtureNode, short_tmp: Path
) -> None:
    """Logged and ignored; health probing goes on (a port DOWN is still reported)."""
    plugin = start_plugin(FAST)
    assert sim.wait_registered(RES), plugin.output()
    config = short_tmp / "config0.yaml"
    config.write_bytes(b"mode: shared\n\xff\xfe\x00garbage\n")
    time.sleep(0.5)
    node.set_port_state("mlx5_bond_1", "DOWN")
    assert sim.wait_for(lambda: sim.allocatable(RES) == 0, timeout=10), plugin.output()[-3000:]
    config.write_text("mode: [unclosed\n", encoding="utf-8")
    time.sleep(0.5)
    node.set_port_state("mlx5_bond_1", "ACTIVE")
    assert sim.wait_for(lambda: sim.allocatable(RES) == 1000, timeout=10), plugin.output()[-3000:]
    out = plugin.output()
    assert "not UTF-8 text" in out and "not valid YAML" in out
    assert plugin.proc.poll() is None and "Traceback" not in out


def test_health_change_is_logged_as_a_person_reads_it(  # type: ignore[no-untyped-def]
    sim: KubeletSimulator, start_plugin, node: fixtures.FixtureNode
) -> None:
    plugin = start_plugin(FAST)
    assert sim.wait_registered(RES), plugin.output()
    node.set_port_state("mlx5_bond_1", "DOWN")
    assert sim.wait_for(lambda: sim.allocatable(RES) == 0, timeout=10)
    assert sim.wait_for(lambda: "mlx5_bond_1 port 1 DOWN: rdma/hca Unhealthy (policy all)" in plugin.output(), 10)


# --------------------------------------------------------------------------- liveness


def test_healthcheck_passes_while_serving_and_fails_when_stale(  # type: ignore[no-untyped-def]
    sim: KubeletSimulator, start_plugin, short_tmp: Path
) -> None:
    plugin = start_plugin(FAST)
    assert sim.wait_registered(RES), plugin.output()
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
    from rdma_device_plugin.daemon import Supervisor

    dp = short_tmp / "dp-live"
    dp.mkdir()
    health = short_tmp / "live.json"
    sup = Supervisor(PluginConfig(), node.sysfs, node.dev, str(dp), health_file=str(health))
    sup._registered.add(RES)
    sup._write_health()
    assert json.loads(health.read_text(encoding="utf-8"))["registered"] == [RES]
    sup._unregister(RES)  # e.g. the kubelet ended the stream
    sup._write_health()
    doc = json.loads(health.read_text(encoding="utf-8"))
    assert doc["registered"] == [] and RES in doc["unregistered_since"]


def test_liveness_allows_the_slower_link_event_poll(node: fixtures.FixtureNode, short_tmp: Path) -> None:
    """With link events the port poll may be as slow as linkEventsIntervalSeconds: the probe loop's
    allowed age follows it, or `healthcheck` would restart a healthy plugin between two polls."""
    from rdma_device_plugin.config import load_config_text
    from rdma_device_plugin.daemon import Supervisor

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


def test_two_instances_newer_serves_older_stands_down(  # type: ignore[no-untyped-def]
    sim: KubeletSimulator, start_plugin, dp_dir: Path
) -> None:
    old = start_plugin(FAST)
    assert sim.wait_registered(RES), old.output()
    new = start_plugin(FAST)
    assert sim.wait_for(lambda: "standing down" in old.output(), timeout=20), old.output()[-3000:]
    assert sim.wait_registered(RES, count=2, timeout=20)
    time.sleep(2.0)  # no fight: the count stays put
    settled = registrations(sim)
    time.sleep(2.0)
    assert registrations(sim) == settled, "the two instances keep replacing each other"
    inode = os.stat(dp_dir / SOCK).st_ino
    rc, _ = old.stop()
    assert rc == 0
    assert os.stat(dp_dir / SOCK).st_ino == inode, "the older instance removed the newer one's socket"
    assert sim.wait_for(lambda: sim.allocatable(RES) == 1000 and sim.endpoints[RES].stream_open, timeout=20)
    assert "Traceback" not in old.output() + new.output()


@pytest.mark.timeout(90)
def test_device_plugin_dir_removed_then_recreated(  # type: ignore[no-untyped-def]
    start_plugin, dp_dir: Path
) -> None:
    sim = KubeletSimulator(str(dp_dir)).start()
    plugin = start_plugin(FAST)
    try:
        assert sim.wait_registered(RES), plugin.output()
        sim.stop()
        # Gone in one step, as the plugin sees it (it serves a deleted socket again at once, so an
        # rmtree in place would race with it: ENOTEMPTY)
        gone = dp_dir.with_name(dp_dir.name + ".gone")
        os.rename(dp_dir, gone)
        shutil.rmtree(gone)
        time.sleep(1.5)
        assert plugin.proc.poll() is None
        sim = KubeletSimulator(str(dp_dir)).start()  # the kubelet re-creates it
        assert sim.wait_registered(RES, timeout=30), plugin.output()[-3000:]
        assert sim.allocatable(RES) == 1000
        out = plugin.output()
        assert "kubelet.sock is missing" in out
        assert out.count("WARNING rdma_device_plugin.daemon: cannot serve rdma/hca") == 1, "logged once, retried"
        assert "Traceback" not in out
    finally:
        sim.stop()


def test_unreadable_rdma_devices_are_logged_once_and_do_not_force_relists(  # type: ignore[no-untyped-def]
    sim: KubeletSimulator, start_plugin, node: fixtures.FixtureNode
) -> None:
    for name in ("rxe0", "siw0"):  # soft devices: no PCI function behind them
        os.makedirs(os.path.join(node.sysfs, "class", "infiniband", name, "ports", "1"))
    plugin = start_plugin({"health": {"intervalSeconds": 0.1}, "rediscoveryIntervalSeconds": 3600})
    assert sim.wait_registered(RES), plugin.output()
    time.sleep(2.0)  # about 20 probes
    out = plugin.output()
    assert out.count("RDMA device rxe0 left out") == 1 and out.count("RDMA device siw0 left out") == 1, out
    assert "RDMA devices changed on the node" not in out, "an unreadable device looked like a change at every probe"


def test_duplicate_ids_in_one_allocate_are_refused(  # type: ignore[no-untyped-def]
    sim: KubeletSimulator, start_plugin, dp_dir: Path
) -> None:
    plugin = start_plugin({"mode": "exclusive"})
    assert sim.wait_registered(RES), plugin.output()
    one = sorted(sim.devices(RES))[0]
    req = pb.AllocateRequest()
    req.container_requests.add(devices_ids=[one, one])
    with grpc.insecure_channel(f"unix://{dp_dir / SOCK}") as ch, pytest.raises(grpc.RpcError) as err:
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
        warned = "WARNING rdma_device_plugin.daemon: registration of rdma/hca with the kubelet failed"
        assert out.count(warned) == 1, out
        assert out.count("DEBUG   rdma_device_plugin.daemon: registration of rdma/hca") <= 5, "backoff: not 2/s"
        assert plugin.proc.poll() is None and "Traceback" not in out
    finally:
        blackhole.close()


def test_renamed_nic_is_the_same_device(  # type: ignore[no-untyped-def]
    sim: KubeletSimulator, start_plugin, node: fixtures.FixtureNode
) -> None:
    """LAG re-formation renames mlx5_bond_0 -> rocep31s0 on the same PCI function: the pool
    becomes Healthy again and Allocate hands out the new name."""
    plugin = start_plugin(FAST)
    assert sim.wait_registered(RES), plugin.output()
    spec = next(n for n in fixtures.lingjun_node(nics=4).nics if n.name == "mlx5_bond_0")
    node.remove_nic("mlx5_bond_0")
    assert sim.wait_for(lambda: sim.allocatable(RES) == 0, timeout=10)
    node.add_nic(replace(spec, name="rocep31s0"))
    assert sim.wait_for(lambda: sim.allocatable(RES) == 1000, timeout=10), plugin.output()[-3000:]
    alloc = sim.allocate(RES, 1, pod="p")
    assert "rocep31s0" in alloc.envs["RDMA_DEVICES"] and "mlx5_bond_0" not in alloc.envs["RDMA_DEVICES"]
    assert "NIC mlx5_bond_0 (0000:1a:00.0) is now named rocep31s0" in plugin.output()


def test_a_vanished_nic_leaves_the_pool_after_the_grace(  # type: ignore[no-untyped-def]
    sim: KubeletSimulator, start_plugin, node: fixtures.FixtureNode
) -> None:
    plugin = start_plugin({**FAST, "health": {"intervalSeconds": 0.1, "vanishGraceSeconds": 2}})
    assert sim.wait_registered(RES), plugin.output()
    node.remove_nic("mlx5_bond_3")
    assert sim.wait_for(lambda: sim.allocatable(RES) == 0, timeout=10)
    assert sim.wait_for(lambda: sim.allocatable(RES) == 1000, timeout=20), plugin.output()[-3000:]
    assert "mlx5_bond_3 (0000:7a:00.0) gone for" in plugin.output()
    assert "mlx5_bond_3" not in sim.allocate(RES, 1, pod="p").envs["RDMA_DEVICES"]


# --------------------------------------------------------------------------- start-up refusals (exit 2)


def _serve_once(node: fixtures.FixtureNode, dp_dir: Path, config: dict[str, Any], tmp: Path) -> Any:
    path = tmp / "refused.yaml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    return subprocess.run(serve_command(node, dp_dir, path), capture_output=True, text=True, timeout=60, check=False)


def test_exclusive_selectors_that_overlap_are_refused(  # type: ignore[no-untyped-def]
    sim: KubeletSimulator, node: fixtures.FixtureNode, dp_dir: Path, short_tmp: Path
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
    assert not sim.registrations


def test_socket_path_too_long_for_the_dir_is_refused(node: fixtures.FixtureNode, short_tmp: Path) -> None:
    deep = short_tmp / ("d" * 60) / ("e" * 20)
    deep.mkdir(parents=True)
    proc = _serve_once(node, deep, {"resources": [{"name": "rdma/" + "x" * 30}]}, short_tmp)
    assert proc.returncode == 2
    assert "unix sockets allow 107: shorten the resource name or the device-plugin dir" in proc.stderr
