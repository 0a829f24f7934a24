"""Prometheus metrics (``--metrics-address HOST:PORT``; off by default).

A :class:`MetricsHooks` (the server's ``Hooks`` observer) owns its own registry and
serves it over HTTP with prometheus_client's threaded WSGI server bound to the given
address only. Metrics:

- ``rdma_dp_devices{resource,health}``: devices advertised, by health (gauge, read from
  the pools at scrape time)
- ``rdma_dp_port_active{nic,port}``: 1 when the port is ACTIVE/ACTIVE_DEFER, else 0;
  ``rdma_dp_port_state{nic,port,state}``: 1 for the current state (gauges)
- ``rdma_dp_allocations_total{resource,result}``: Allocate calls, result ok|error
- ``rdma_dp_allocate_seconds{resource}``: Allocate latency (histogram)
- ``rdma_dp_registrations_total{resource}``: successful registrations with the kubelet
- ``rdma_dp_kubelet_restarts_total``: kubelet restarts noticed
- ``rdma_dp_rediscoveries_total``: full NIC re-listings
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from .node.sysfs import ACTIVE_STATES
from .resources import HEALTHY, UNHEALTHY, ResourcePool
from .server import Hooks

LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


def parse_address(address: str) -> tuple[str, int]:
    """``HOST:PORT`` / ``[v6]:PORT`` / ``:PORT`` (all addresses) -> (host, port)."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--metrics-address {address!r} must be HOST:PORT, e.g. 127.0.0.1:9108")
    host = host.strip("[]") or "0.0.0.0"
    return host, int(port)


class _StateCollector(Collector):
    def __init__(self, hooks: MetricsHooks) -> None:
        self.hooks = hooks

    def collect(self) -> Iterator[Metric]:
        devices = GaugeMetricFamily(
            "rdma_dp_devices", "Devices advertised to the kubelet", labels=["resource", "health"]
        )
        for pool in self.hooks.pools:
            _, devs = pool.snapshot()
            healthy = sum(1 for d in devs if d.health == HEALTHY)
            devices.add_metric([pool.name, HEALTHY], healthy)
            devices.add_metric([pool.name, UNHEALTHY], len(devs) - healthy)
        yield devices
        active = GaugeMetricFamily("rdma_dp_port_active", "1 when the RDMA port is ACTIVE", labels=["nic", "port"])
        state = GaugeMetricFamily("rdma_dp_port_state", "Current RDMA port state (1)", labels=["nic", "port", "state"])
        with self.hooks.lock:
            ports = dict(self.hooks.ports)
        for nic, states in sorted(ports.items()):
            if states is None:
                active.add_metric([nic, "1"], 0)
                state.add_metric([nic, "1", "GONE"], 1)
                continue
            for i, s in enumerate(states, start=1):
                active.add_metric([nic, str(i)], 1 if s in ACTIVE_STATES else 0)
                state.add_metric([nic, str(i), s], 1)
        yield active
        yield state


class MetricsHooks(Hooks):
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry(auto_describe=True)
        self.lock = threading.Lock()
        self.pools: list[ResourcePool] = []
        self.ports: dict[str, tuple[str, ...] | None] = {}
        self._server: Any = None
        self.allocations = Counter(
            "rdma_dp_allocations", "Allocate calls by result", ["resource", "result"], registry=self.registry
        )
        self.latency = Histogram(
            "rdma_dp_allocate_seconds",
            "Allocate latency",
            ["resource"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.registrations = Counter(
            "rdma_dp_registrations", "Successful registrations with the kubelet", ["resource"], registry=self.registry
        )
        self.kubelet_restarts = Counter("rdma_dp_kubelet_restarts", "Kubelet restarts noticed", registry=self.registry)
        self.rediscoveries = Counter("rdma_dp_rediscoveries", "Full NIC re-listings", registry=self.registry)
        self.registry.register(_StateCollector(self))

    # ------------------------------------------------------------------ Hooks

    def allocated(self, resource: str, seconds: float, ok: bool) -> None:
        self.allocations.labels(resource, "ok" if ok else "error").inc()
        self.latency.labels(resource).observe(seconds)

    def registered(self, resource: str) -> None:
        self.registrations.labels(resource).inc()

    def kubelet_restarted(self) -> None:
        self.kubelet_restarts.inc()

    def rediscovered(self) -> None:
        self.rediscoveries.inc()

    def port_states(self, states: Mapping[str, tuple[str, ...] | None]) -> None:
        with self.lock:
            self.ports.update(states)

    def pools_ready(self, pools: Sequence[ResourcePool]) -> None:
        self.pools = list(pools)
        for pool in self.pools:  # make the series exist before the first call
            self.allocations.labels(pool.name, "ok")
            self.allocations.labels(pool.name, "error")
            self.registrations.labels(pool.name)

    # ------------------------------------------------------------------ HTTP

    def serve(self, address: str) -> tuple[str, int]:
        host, port = parse_address(address)
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        self._server = server
        return host, int(server.server_address[1])

    def stop(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()
