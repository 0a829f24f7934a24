"""The DRA driver's Prometheus metrics (``dra --metrics-address HOST:PORT``; off by default), in the
device plugin's style (:mod:`..metrics`): its own registry, served by the plugin's bounded server
on the given address only (over HTTPS and behind a bearer token's review with --metrics-auth:
:mod:`..metricsauth`); state read at scrape time from what the driver last
published; prepare and unprepare counted in plain numbers under a small lock (the kubelet calls
them on several gRPC threads: :mod:`.stats`). Loaded only with --metrics-address: neither it nor
prometheus_client is in the driver's memory otherwise. The metrics and the alerts on them:
docs/operations.md, docs/alerts.md.

- ``rdma_dra_requests_total{operation,result}`` and ``rdma_dra_request_seconds{operation}``: the
  kubelet's NodePrepareResources / NodeUnprepareResources, per claim (result ``ok`` | ``error``);
- ``rdma_dra_devices_published{health}``: the devices of the node's slices, by taint;
- ``rdma_dra_publish_failures_total``: slice publishing passes that failed (API errors);
- ``rdma_dra_slices_in_sync``: 1 while the API holds the node's slices of the newest content (0 also
  while a newer instance publishes: ``rdma_dra_superseded``);
- ``rdma_dra_registered``: 1 while the kubelet has this instance registered;
- ``rdma_dra_claims_prepared{nic}``: the claims prepared on this node that hold each NIC;
- ``rdma_dra_build_info{version,driver,mode}``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from .. import __version__
from ..metricsserver import LATENCY_BUCKETS, BoundedHTTPServer, TlsSource, guarded_app, parse_address
from .stats import OPERATIONS, RequestStats


@dataclass
class State:
    """What a scrape reads, as functions of the driver (each returns its current value)."""

    driver: str
    mode: str
    health: Callable[[], Mapping[str, tuple[bool, str]]]  # device -> (healthy, why)
    claims_per_nic: Callable[[], Mapping[str, int]]
    publish_failures: Callable[[], int]
    in_sync: Callable[[], bool]
    superseded: Callable[[], bool]
    registered: Callable[[], bool]


class _Collector(Collector):
    def __init__(self, state: State, stats: RequestStats) -> None:
        self.state = state
        self.stats = stats

    def describe(self) -> list[Metric]:
        return []  # nothing to read at registration: the driver is still being built

    def collect(self) -> Iterator[Metric]:
        s = self.state
        info = GaugeMetricFamily("rdma_dra_build_info", "Driver version (1)", labels=["version", "driver", "mode"])
        info.add_metric([__version__, s.driver, s.mode], 1)
        yield info
        ok, error, buckets, total = self.stats.copy()
        requests = CounterMetricFamily(
            "rdma_dra_requests", "Claims the kubelet asked to prepare or unprepare", labels=["operation", "result"]
        )
        latency = HistogramMetricFamily(
            "rdma_dra_request_seconds", "Prepare / unprepare time per claim", labels=["operation"]
        )
        for op in OPERATIONS:
            requests.add_metric([op, "ok"], ok[op])
            requests.add_metric([op, "error"], error[op])
            cumulative, out = 0, []
            for bound, n in zip([*map(str, LATENCY_BUCKETS), "+Inf"], buckets[op], strict=True):
                cumulative += n
                out.append((bound, cumulative))
            latency.add_metric([op], out, total[op])
        yield requests
        yield latency
        health = list(s.health().values())
        devices = GaugeMetricFamily("rdma_dra_devices_published", "Devices in the node's slices", labels=["health"])
        devices.add_metric(["Healthy"], sum(1 for ok_, _ in health if ok_))
        devices.add_metric(["Unhealthy"], sum(1 for ok_, _ in health if not ok_))
        yield devices
        yield CounterMetricFamily(
            "rdma_dra_publish_failures", "Slice publishing passes that failed", value=s.publish_failures()
        )
        yield GaugeMetricFamily(
            "rdma_dra_slices_in_sync",
            "1 while the API holds the node's slices of the newest content",
            value=int(s.in_sync()),
        )
        yield GaugeMetricFamily(
            "rdma_dra_superseded",
            "1 while a newer instance of the driver publishes (rolling update)",
            value=int(s.superseded()),
        )
        yield GaugeMetricFamily(
            "rdma_dra_registered", "1 while the kubelet has this instance registered", value=int(s.registered())
        )
        per_nic = GaugeMetricFamily("rdma_dra_claims_prepared", "Prepared claims holding the NIC", labels=["nic"])
        for nic, n in sorted(s.claims_per_nic().items()):
            per_nic.add_metric([nic], n)
        yield per_nic


class Metrics:
    def __init__(self, state: State, stats: RequestStats) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_Collector(state, stats))
        self._server: Any = None

    def serve(self, address: str, tls: TlsSource | None = None, reviewer: Any = None) -> tuple[str, int]:
        host, port = parse_address(address)
        server = BoundedHTTPServer(host, port, guarded_app(self.registry, reviewer), tls)
        self._server = server
        return host, server.port

    def stop(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.close()
