"""Prometheus metrics scraped over HTTP from a real ``serve`` process."""

from __future__ import annotations

import socket
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

import grpc
import pytest
from conftest import plugin_socket, serve_command
from prometheus_client.parser import text_string_to_metric_families

from rdma_device_plugin.api import deviceplugin_pb2 as pb
from rdma_device_plugin.api import deviceplugin_pb2_grpc as pb_grpc
from rdma_device_plugin.metricsserver import parse_address
from rdma_kubesim import KubeletSimulator
from rdma_node import fixtures

RES = "rdma/hca"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def _get(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), float("nan"))


def test_metrics_over_http(sim: KubeletSimulator, start_plugin, node: fixtures.FixtureNode, dp_dir: Path) -> None:  # type: ignore[no-untyped-def]
    port = _free_port()
    plugin = start_plugin({"version": "v1", "mode": "exclusive"}, extra=["--metrics-address", f"127.0.0.1:{port}"])
    assert sim.wait_registered(RES), plugin.output()
    sim.allocate(RES, 1, pod="a")
    sim.allocate(RES, 1, pod="b")
    with grpc.insecure_channel(f"unix://{plugin_socket(dp_dir)}") as ch:
        req = pb.AllocateRequest()
        req.container_requests.add(devices_ids=["0000:ff:00.0"])
        with pytest.raises(grpc.RpcError):
            pb_grpc.DevicePluginStub(ch).Allocate(req, timeout=5)
    node.set_port_state("mlx5_bond_3", "DOWN")
    assert sim.wait_for(lambda: sim.allocatable(RES) == 3, timeout=5)
    sim.restart()
    assert sim.wait_registered(RES, timeout=5)

    m = _scrape(port)
    assert _get(m, "rdma_dp_devices", resource=RES, health="Healthy") == 3
    assert _get(m, "rdma_dp_devices", resource=RES, health="Unhealthy") == 1
    assert _get(m, "rdma_dp_port_active", nic="mlx5_bond_3", port="1") == 0
    assert _get(m, "rdma_dp_port_active", nic="mlx5_bond_0", port="1") == 1
    assert _get(m, "rdma_dp_port_state", nic="mlx5_bond_3", port="1", state="DOWN") == 1
    assert _get(m, "rdma_dp_allocations_total", resource=RES, result="ok") == 2
    assert _get(m, "rdma_dp_allocations_total", resource=RES, result="error") == 1
    assert _get(m, "rdma_dp_allocate_seconds_count", resource=RES) == 3
    assert _get(m, "rdma_dp_allocate_seconds_bucket", resource=RES, le="+Inf") == 3
    assert _get(m, "rdma_dp_registrations_total", resource=RES) == 2
    assert _get(m, "rdma_dp_kubelet_restarts_total") == 1
    assert _get(m, "rdma_dp_rediscoveries_total") >= 1
    # bound to the address given, nothing else
    with pytest.raises(OSError), socket.create_connection(("127.0.0.2", port), timeout=1):
        pass


def test_metrics_off_by_default(sim: KubeletSimulator, start_plugin) -> None:  # type: ignore[no-untyped-def]
    plugin = start_plugin()
    assert sim.wait_registered(RES)
    assert "serving Prometheus metrics" not in plugin.output()


def test_bad_metrics_address_exits_2(node: fixtures.FixtureNode, dp_dir: Path) -> None:
    proc = subprocess.run(
        serve_command(node, dp_dir, None, "--metrics-address", "nowhere"),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 2 and "must be HOST:PORT" in proc.stderr
    assert list(dp_dir.iterdir()) == []


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--metrics-auth", "kubernetes"], "--metrics-auth kubernetes needs --metrics-tls-cert and --metrics-tls-key"),
        (["--metrics-tls-cert", "/nonexistent.crt"], "--metrics-tls-cert and --metrics-tls-key go together"),
        (
            ["--metrics-tls-cert", "/nonexistent.crt", "--metrics-tls-key", "/nonexistent.key"],
            "--metrics-tls-cert /nonexistent.crt / --metrics-tls-key /nonexistent.key: cannot load them",
        ),
    ],
)
def test_bad_metrics_auth_flags_exit_2(
    node: fixtures.FixtureNode, dp_dir: Path, flags: list[str], message: str
) -> None:
    """Auth without a certificate (tokens in plain HTTP), half a certificate, unreadable files: one
    error naming the flag, before anything is registered."""
    proc = subprocess.run(
        serve_command(node, dp_dir, None, "--metrics-address", f"127.0.0.1:{_free_port()}", *flags),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert list(dp_dir.iterdir()) == []


class _Api:
    """The reviews' API calls, answered from a table (the real API server's answers:
    test_dra_cluster.py::test_scrapes_need_a_readers_token); counts them."""

    def __init__(self) -> None:
        self.calls = 0

    def create(self, path: str, obj: dict[str, Any]) -> dict[str, Any]:
        self.calls += 1
        if obj["kind"] == "TokenReview":
            token = obj["spec"]["token"]
            return {"status": {"authenticated": token != "bad", "user": {"username": token, "groups": []}}}
        return {"status": {"allowed": obj["spec"]["user"].startswith("reader")}}


def test_review_cache_is_bounded_and_expires() -> None:
    from rdma_device_plugin import metricsauth

    now = [0.0]
    api = _Api()
    reviewer = metricsauth.Reviewer(api, clock=lambda: now[0])  # type: ignore[arg-type]
    assert reviewer.check("") == 401 and reviewer.check("Basic abc") == 401 and api.calls == 0
    assert reviewer.check("Bearer reader-0") == 200 and reviewer.check("bearer  reader-0 ") == 200
    assert api.calls == 2
    for i in range(metricsauth.CACHE_ENTRIES + 10):  # many tokens: the oldest verdicts make room
        reviewer.check(f"Bearer other-{i}")
    assert len(reviewer._cache) == metricsauth.CACHE_ENTRIES
    calls, last = api.calls, f"Bearer other-{metricsauth.CACHE_ENTRIES + 9}"
    assert reviewer.check("Bearer reader-0") == 200 and api.calls == calls + 2  # evicted: reviewed again
    assert reviewer.check(last) == 403 and api.calls == calls + 2  # cached
    now[0] += metricsauth.DENIED_SECONDS + 1
    assert reviewer.check(last) == 403 and api.calls == calls + 4  # a refusal expires first
    assert reviewer.check("Bearer reader-0") == 200 and api.calls == calls + 4
    now[0] += metricsauth.ALLOWED_SECONDS
    assert reviewer.check("Bearer reader-0") == 200 and api.calls == calls + 6


def test_parse_address() -> None:
    assert parse_address("127.0.0.1:9108") == ("127.0.0.1", 9108)
    assert parse_address(":9108") == ("0.0.0.0", 9108)
    assert parse_address("[::1]:9108") == ("::1", 9108)
    for bad in ("9108", "host:", "host:0", "host:70000"):
        with pytest.raises(ValueError, match="HOST:PORT"):
            parse_address(bad)


def test_scrape_is_fast_enough_to_poll(sim: KubeletSimulator, start_plugin) -> None:  # type: ignore[no-untyped-def]
    port = _free_port()
    start_plugin(extra=["--metrics-address", f"127.0.0.1:{port}"])
    assert sim.wait_registered(RES)
    t0 = time.monotonic()
    m = _scrape(port)
    assert time.monotonic() - t0 < 1.0
    assert _get(m, "rdma_dp_devices", resource=RES, health="Healthy") == 1000


def test_metrics_alerts_rely_on(sim: KubeletSimulator, start_plugin, dp_dir: Path) -> None:  # type: ignore[no-untyped-def]
    """Registered / stream open / loop timestamps / NIC facts / stream ends, as docs/operations.md
    lists them. Only the kubelet's stream counts: five debugging clients' streams ending neither
    count as stream ends (RdmaReregistrationStorm) nor close the kubelet's."""
    port = _free_port()
    plugin = start_plugin(extra=["--metrics-address", f"127.0.0.1:{port}"])
    assert sim.wait_registered(RES), plugin.output()

    def scraped(name: str, **labels: str) -> float:
        return _get(_scrape(port), name, **labels)

    assert sim.wait_for(lambda: scraped("rdma_dp_kubelet_stream_open", resource=RES) == 1, timeout=30)
    m = _scrape(port)
    assert _get(m, "rdma_dp_resource_registered", resource=RES) == 1
    for loop in ("probe", "watch"):
        assert time.time() - _get(m, "rdma_dp_loop_last_success_timestamp_seconds", loop=loop) < 120
    info = {k: v for (name, k), v in m.items() if name == "rdma_dp_nic_info"}
    nic0 = dict(next(k for k in info if dict(k)["nic"] == "mlx5_bond_0"))
    assert nic0["link_layer"] == "Ethernet" and nic0["netdev"] == "bond0,eth0,eth1" and nic0["resource"] == RES
    assert nic0["numa_node"] == "0" and len(info) == 4
    assert [dict(k)["mode"] for (name, k) in m if name == "rdma_dp_build_info"] == ["shared"]
    assert _get(m, "rdma_dp_stream_ends_total", resource=RES) == 0
    for _ in range(5):  # a debugging client: opens a stream, reads the snapshot, goes
        with grpc.insecure_channel(f"unix://{plugin_socket(dp_dir)}") as ch:
            next(pb_grpc.DevicePluginStub(ch).ListAndWatch(pb.Empty(), timeout=30))
    time.sleep(1.5)  # a re-registration would have been sent by now, even after a backoff
    m = _scrape(port)
    assert _get(m, "rdma_dp_stream_ends_total", resource=RES) == 0
    assert _get(m, "rdma_dp_kubelet_stream_open", resource=RES) == 1
    assert _get(m, "rdma_dp_registrations_total", resource=RES) == 1
    assert sim.wait_for(lambda: plugin.output().count("a ListAndWatch stream of another client ended") == 5, 30)
    sim.end_stream(RES)
    assert sim.wait_for(lambda: scraped("rdma_dp_stream_ends_total", resource=RES) == 1, timeout=30), plugin.output()
    assert sim.wait_registered(RES, count=2, timeout=30)
    assert sim.wait_for(lambda: scraped("rdma_dp_resource_registered", resource=RES) == 1, timeout=30)


def test_a_vanished_nic_leaves_the_metrics(sim: KubeletSimulator, start_plugin, node: fixtures.FixtureNode) -> None:  # type: ignore[no-untyped-def]
    """Issue 31: the port map was only ever updated, so a removed NIC kept rdma_dp_port_active 1 and no
    alert fired. Now it is GONE while its pool holds it (health.vanishGraceSeconds), counted Unhealthy
    in rdma_dp_pool_nics, and drops out of every per-NIC series when the pool lets it go."""
    port = _free_port()
    config = {"version": "v1", "health": {"vanishGraceSeconds": 3}, "rediscoveryIntervalSeconds": 2}
    plugin = start_plugin(config, extra=["--metrics-address", f"127.0.0.1:{port}"])
    assert sim.wait_registered(RES), plugin.output()
    m = _scrape(port)
    assert _get(m, "rdma_dp_pool_nics", resource=RES, health="Healthy") == 4
    assert _get(m, "rdma_dp_port_active", nic="mlx5_bond_3", port="1") == 1
    node.remove_nic("mlx5_bond_3")

    def gone_marked() -> bool:
        m = _scrape(port)
        return (
            _get(m, "rdma_dp_port_state", nic="mlx5_bond_3", port="1", state="GONE") == 1
            and _get(m, "rdma_dp_port_active", nic="mlx5_bond_3", port="1") == 0
            and _get(m, "rdma_dp_pool_nics", resource=RES, health="Unhealthy") == 1
        )

    assert sim.wait_for(gone_marked, timeout=30), _scrape(port)
    m = _scrape(port)
    assert _get(m, "rdma_dp_pool_nics", resource=RES, health="Healthy") == 3
    assert not [k for k in m if k[0] == "rdma_dp_nic_info" and dict(k[1])["nic"] == "mlx5_bond_3"]
    assert not [
        k
        for k in m
        if k[0] == "rdma_dp_port_state" and dict(k[1]) == {"nic": "mlx5_bond_3", "port": "1", "state": "ACTIVE"}
    ]

    def released() -> bool:
        m = _scrape(port)
        return not [k for k in m if dict(k[1]).get("nic") == "mlx5_bond_3"] and (
            _get(m, "rdma_dp_pool_nics", resource=RES, health="Unhealthy") == 0
        )

    assert sim.wait_for(released, timeout=30), _scrape(port)
    assert _get(_scrape(port), "rdma_dp_pool_nics", resource=RES, health="Healthy") == 3


def test_port_state_changes_are_counted(sim: KubeletSimulator, start_plugin, node: fixtures.FixtureNode) -> None:  # type: ignore[no-untyped-def]
    """rdma_dp_port_state_changes_total counts each observed change of a port (the flap alert reads its
    increase over a window); it exists from the start at 0 for every port."""
    port = _free_port()
    plugin = start_plugin(extra=["--metrics-address", f"127.0.0.1:{port}"])
    assert sim.wait_registered(RES), plugin.output()
    m = _scrape(port)
    assert all(_get(m, "rdma_dp_port_state_changes_total", nic=f"mlx5_bond_{i}", port="1") == 0 for i in range(4))
    for state in ("DOWN", "ACTIVE", "DOWN", "ACTIVE"):
        node.set_port_state("mlx5_bond_1", state)
        want = HEALTHY_COUNT if state == "ACTIVE" else 0
        assert sim.wait_for(lambda want=want: sim.allocatable(RES) == want, timeout=30), plugin.output()
    m = _scrape(port)
    assert _get(m, "rdma_dp_port_state_changes_total", nic="mlx5_bond_1", port="1") == 4
    assert _get(m, "rdma_dp_port_state_changes_total", nic="mlx5_bond_0", port="1") == 0


HEALTHY_COUNT = 1000


def _threads(pid: int) -> int:
    with open(f"/proc/{pid}/status", encoding="ascii") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("Threads:"))


@pytest.mark.timeout(180)
def test_two_thousand_idle_connections_neither_restart_the_plugin_nor_block_a_scrape(  # type: ignore[no-untyped-def]
    sim: KubeletSimulator, start_plugin
) -> None:
    """Issue 39: prometheus_client's server started a thread per connection, so idle connections were
    threads (and memory) without bound in a 128 Mi container. 2,000 real TCP connections that send
    nothing: the plugin keeps its thread count, answers a scrape, and is the same process after."""
    import resource

    from rdma_device_plugin import metricsserver

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 2200:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(4096, hard), hard))
    port = _free_port()
    plugin = start_plugin({"version": "v1"}, extra=["--metrics-address", f"127.0.0.1:{port}"])
    assert sim.wait_registered(RES), plugin.output()
    _scrape(port)
    before = _threads(plugin.proc.pid)
    idle = []
    try:
        for _ in range(2000):
            idle.append(socket.create_connection(("127.0.0.1", port), timeout=10))
        m = _scrape(port)  # a new connection makes room: the longest idle one is closed
        assert _get(m, "rdma_dp_devices", resource=RES, health="Healthy") == 1000
        assert _threads(plugin.proc.pid) <= before + metricsserver.WORKERS, (before, _threads(plugin.proc.pid))
        # the oldest idle connections were closed by the plugin: reading them gives EOF at once
        idle[0].settimeout(10)
        assert idle[0].recv(1) == b""
    finally:
        for s in idle:
            s.close()
    assert plugin.proc.poll() is None, plugin.output()
    assert _get(_scrape(port), "rdma_dp_devices", resource=RES, health="Healthy") == 1000
