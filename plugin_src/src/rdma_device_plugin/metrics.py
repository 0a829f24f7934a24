"""Prometheus metrics (``--metrics-address HOST:PORT``; off by default).

A :class:`MetricsHooks` (the server's ``Hooks`` observer) owns its own registry and serves it over
HTTP (:class:`.metricsserver.BoundedHTTPServer`: prometheus_client's WSGI app in bounded threads) bound to the
given address only; with ``--metrics-auth kubernetes`` over HTTPS, to reviewed bearer tokens only
(:mod:`.metricsauth`, loaded only then). The metrics, their labels and the alerts built on them are
listed in one table: docs/operations.md ("Metrics"). Gauges that describe state are read at scrape
time from what the supervisor last published (published.NodeView, the loops' heartbeats): immutable,
so a scrape takes no lock the supervisor or the gRPC loop takes. Allocate is counted on the gRPC
loop in plain numbers only that loop writes (no prometheus_client lock on that path); the scrape
reads copies. The port map is replaced by every probe (it lists every RDMA device on the node), so a
NIC that vanished drops out of ``rdma_dp_port_*`` and ``rdma_dp_nic_info``; while a pool still holds
it (health.vanishGraceSeconds) it shows as ``rdma_dp_port_state{state="GONE"}`` and an Unhealthy NIC
in ``rdma_dp_pool_nics``; port state changes are counted by their owner (discovery) and published
with the view. With a sysfs root, the NICs' own port counters are exported too, read at scrape time
(:mod:`.port_counters`) for the NICs of the last published re-list.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterator, Mapping, Sequence
from types import MappingProxyType
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from rdma_node.sysfs import ACTIVE_STATES, Nic

from . import __version__, affinity, port_counters
from .kubeletapi import HEALTHY, UNHEALTHY
from .metricsserver import LATENCY_BUCKETS, BoundedHTTPServer, TlsSource, guarded_app, parse_address
from .published import NodeView
from .resources import ResourcePool
from .server import Hooks


class _AllocateStats:
    """One resource's Allocate calls, written on the gRPC loop only; read (copied) by scrapes."""

    def __init__(self) -> None:
        self.ok = 0
        self.error = 0
        self.buckets = [0] * (len(LATENCY_BUCKETS) + 1)  # per bucket, +Inf last (not cumulative)
        self.total = 0.0


class _StateCollector(Collector):
    def __init__(self, hooks: MetricsHooks) -> None:
        self.hooks = hooks

    def collect(self) -> Iterator[Metric]:
        yield from self._allocations()
        view = self.hooks.view
        if view is None:
            return
        devices = GaugeMetricFamily(
            "rdma_dp_devices", "Devices advertised to the kubelet", labels=["resource", "health"]
        )
        for pool in view.pools:
            devices.add_metric([pool.name, HEALTHY], pool.healthy)
            devices.add_metric([pool.name, UNHEALTHY], len(pool.devices) - pool.healthy)
        yield devices
        active = GaugeMetricFamily("rdma_dp_port_active", "1 when the RDMA port is ACTIVE", labels=["nic", "port"])
        state = GaugeMetricFamily("rdma_dp_port_state", "Current RDMA port state (1)", labels=["nic", "port", "state"])
        changes = CounterMetricFamily(
            "rdma_dp_port_state_changes",
            "Port state changes the plugin observed (probe or link event), for flap alerts over a window",
            labels=["nic", "port"],
        )
        pool_nics = GaugeMetricFamily(
            "rdma_dp_pool_nics",
            "NICs a resource's pool holds, by health: a vanished NIC counts Unhealthy until health.vanishGraceSeconds",
            labels=["resource", "health"],
        )
        ports = dict(view.port_states)
        gone: set[str] = set()
        for pool in view.pools:
            healthy = sum(1 for n in pool.summary if n["healthy"])
            pool_nics.add_metric([pool.name, HEALTHY], healthy)
            pool_nics.add_metric([pool.name, UNHEALTHY], len(pool.summary) - healthy)
            gone.update(str(n["name"]) for n in pool.summary if not n["present"])
        for nic in sorted(gone - {n for n, s in ports.items() if s is not None}):
            ports[nic] = None  # held by a pool, gone from sysfs: marked until the pool lets it go
        for nic, states in sorted(ports.items()):
            if states is None:
                active.add_metric([nic, "1"], 0)
                state.add_metric([nic, "1", "GONE"], 1)
                continue
            for i, s in enumerate(states, start=1):
                active.add_metric([nic, str(i)], 1 if s in ACTIVE_STATES else 0)
                state.add_metric([nic, str(i), s], 1)
                changes.add_metric([nic, str(i)], view.state_changes.get((nic, i), 0))
        yield active
        yield state
        yield changes
        yield pool_nics
        yield from self._nics(view)
        yield from self._live(view)

    def _allocations(self) -> Iterator[Metric]:
        calls = CounterMetricFamily("rdma_dp_allocations", "Allocate calls by result", labels=["resource", "result"])
        latency = HistogramMetricFamily("rdma_dp_allocate_seconds", "Allocate latency", labels=["resource"])
        for resource, stats in sorted(self.hooks.allocate_stats.items()):
            counts = list(stats.buckets)  # one C-level copy each: consistent enough for a scrape
            calls.add_metric([resource, "ok"], stats.ok)
            calls.add_metric([resource, "error"], stats.error)
            cumulative, buckets = 0, []
            for bound, n in zip([*map(str, LATENCY_BUCKETS), "+Inf"], counts, strict=True):
                cumulative += n
                buckets.append((bound, cumulative))
            latency.add_metric([resource], buckets, stats.total)
        yield calls
        yield latency

    def _nics(self, view: NodeView) -> Iterator[Metric]:
        info = GaugeMetricFamily(
            "rdma_dp_nic_info",
            'RDMA NIC facts (1): link layer, netdevs, NUMA node ("" when none), the resource serving it and the '
            "GPUs (PCI addresses) sharing its PCIe switch, root port or NUMA node (cumulative)",
            labels=[
                "nic",
                "pci_address",
                "link_layer",
                "netdev",
                "numa_node",
                "resource",
                "switch_gpus",
                "root_port_gpus",
                "numa_gpus",
            ],
        )
        gpus = view.affinity.nics
        owners: dict[str, str] = {}
        for pool in view.pools:  # numaPools: the NIC's first pool (the configured resource) names it
            for nic in pool.nics.values():
                owners.setdefault(nic.name, pool.name)
        for nic in view.nics:
            layers = sorted({p.link_layer for p in nic.ports if p.link_layer})
            numa = "" if nic.numa_node is None else str(nic.numa_node)
            labels = [nic.name, nic.pci_address, ",".join(layers), ",".join(sorted(nic.netdevs)), numa]
            info.add_metric([*labels, owners.get(nic.name, ""), *affinity.metric_labels(gpus.get(nic.name))], 1)
        yield info
        held = GaugeMetricFamily(
            "rdma_dp_nic_held_down",
            "1 while the NIC is held down after flapping (health.flapDamping): Unhealthy even while its ports are up",
            labels=["nic"],
        )
        for nic in view.nics:
            held.add_metric([nic.name], 1 if nic.name in view.held else 0)
        yield held
        unset = GaugeMetricFamily(
            "rdma_dp_env_unset",
            "1 while a variable of the env NCCL reads (workloadEnv) is left unset for a resource's NICs, and why "
            "(gid_index_differs, no_suitable_gid)",
            labels=["resource", "variable", "reason"],
        )
        for pool in view.pools:
            seen = set()
            for _, env in pool.env:
                for u in env.unset:
                    if (u.variable, u.reason) not in seen:
                        seen.add((u.variable, u.reason))
                        unset.add_metric([pool.name, u.variable, u.reason], 1)
        yield unset

    def _live(self, view: NodeView) -> Iterator[Metric]:
        registered = GaugeMetricFamily(
            "rdma_dp_resource_registered", "1 while the resource is registered with the kubelet", labels=["resource"]
        )
        streams = GaugeMetricFamily(
            "rdma_dp_kubelet_stream_open", "1 while the kubelet has a ListAndWatch stream open", labels=["resource"]
        )
        for pool in view.pools:
            registered.add_metric([pool.name], 1 if pool.name in view.registered else 0)
            streams.add_metric([pool.name], 1 if pool.name in view.kubelet_streams else 0)
        yield registered
        yield streams
        loops = GaugeMetricFamily(
            "rdma_dp_loop_last_success_timestamp_seconds",
            "Unix time a step of the supervisor loop last completed (probe: health probe, watch: kubelet socket watch)",
            labels=["loop"],
        )
        for name, last in sorted(self.hooks.loops().items()):
            loops.add_metric([name], last)
        yield loops
        failing = GaugeMetricFamily(
            "rdma_dp_probe_failing", "1 while the health probe fails (from its first failed run to its next success)"
        )
        failing.add_metric([], 1 if view.probe_failing else 0)
        yield failing


class MetricsHooks(Hooks):
    def __init__(self, registry: CollectorRegistry | None = None, sysfs_root: str | None = None) -> None:
        self.registry = registry or CollectorRegistry(auto_describe=True)
        self.view: NodeView | None = None  # what the supervisor published last
        self.loops: Callable[[], Mapping[str, float]] = lambda: MappingProxyType({})
        self.allocate_stats: dict[str, _AllocateStats] = {}  # per resource, from pools_ready on
        self._server: Any = None
        self.info = Gauge(
            "rdma_dp_build_info", "Plugin version and mode (1)", ["version", "mode"], registry=self.registry
        )
        self.registrations = Counter(
            "rdma_dp_registrations", "Successful registrations with the kubelet", ["resource"], registry=self.registry
        )
        self.kubelet_restarts = Counter("rdma_dp_kubelet_restarts", "Kubelet restarts noticed", registry=self.registry)
        self.rediscoveries = Counter("rdma_dp_rediscoveries", "Full NIC re-listings", registry=self.registry)
        self.stream_ends = Counter(
            "rdma_dp_stream_ends",
            "ListAndWatch streams the kubelet ended while serving",
            ["resource"],
            registry=self.registry,
        )
        self.probe_failures = Counter(
            "rdma_dp_probe_failures", "Runs of the health probe that failed (raised)", registry=self.registry
        )
        self.registry.register(_StateCollector(self))
        if sysfs_root is not None:
            self.registry.register(port_counters.PortCountersCollector(sysfs_root, self._present_nics))

    # ------------------------------------------------------------------ Hooks

    def allocated(self, resource: str, seconds: float, ok: bool) -> None:
        """On the gRPC loop: plain numbers only that loop writes."""
        stats = self.allocate_stats.get(resource)
        if stats is None:
            stats = self.allocate_stats[resource] = _AllocateStats()
        if ok:
            stats.ok += 1
        else:
            stats.error += 1
        stats.buckets[bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1
        stats.total += seconds

    def registered(self, resource: str) -> None:
        self.registrations.labels(resource).inc()

    def kubelet_restarted(self) -> None:
        self.kubelet_restarts.inc()

    def rediscovered(self) -> None:
        self.rediscoveries.inc()

    def stream_ended(self, resource: str) -> None:
        self.stream_ends.labels(resource).inc()

    def probe_failed(self) -> None:
        self.probe_failures.inc()

    def published(self, view: NodeView) -> None:
        self.view = view

    def supervising(self, loops: Callable[[], Mapping[str, float]]) -> None:
        self.loops = loops

    def _present_nics(self) -> list[Nic]:
        """The NICs of the last published re-list (the port counters' scrape reads theirs)."""
        view = self.view
        return list(view.nics) if view is not None else []

    def pools_ready(self, pools: Sequence[ResourcePool]) -> None:
        for mode in sorted({pool.mode for pool in pools}):
            self.info.labels(__version__, mode).set(1)
        # The series exist before the first call (the dashboard's Allocate latency panel from the start).
        self.allocate_stats = {pool.name: _AllocateStats() for pool in pools}
        for pool in pools:
            self.registrations.labels(pool.name)
            self.stream_ends.labels(pool.name)

    # ------------------------------------------------------------------ HTTP

    def serve(self, address: str, tls: TlsSource | None = None, reviewer: Any = None) -> tuple[str, int]:
        host, port = parse_address(address)
        server = BoundedHTTPServer(host, port, guarded_app(self.registry, reviewer), tls)
        self._server = server
        return host, server.port

    def stop(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.close()
