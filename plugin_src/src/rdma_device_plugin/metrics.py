"""Prometheus metrics (``--metrics-address HOST:PORT``; off by default).

A :class:`MetricsHooks` (the server's ``Hooks`` observer) owns its own registry and
serves it over HTTP with prometheus_client's threaded WSGI server bound to the given
address only. The metrics, their labels and the alerts built on them are listed in one
table: docs/operations.md ("Metrics"). Gauges that describe state are read at scrape
time (pools, NICs, the supervisor's loops), so a scrape never sees a stale copy. The port map is
replaced by every probe (it lists every RDMA device on the node), so a NIC that vanished drops out
of ``rdma_dp_port_*`` and ``rdma_dp_nic_info``; while a pool still holds it (health.vanishGraceSeconds)
it shows as ``rdma_dp_port_state{state="GONE"}`` and an Unhealthy NIC in ``rdma_dp_pool_nics``. With a
sysfs root, the NICs' own port counters are exported too, read at scrape time (:mod:`.port_counters`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from . import __version__, affinity, port_counters
from .kubeletapi import HEALTHY, UNHEALTHY
from .node.sysfs import ACTIVE_STATES, Nic
from .resources import ResourcePool
from .server import Hooks, LiveStatus

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
        with self.hooks.lock:
            ports = dict(self.hooks.ports)
            counted = dict(self.hooks.state_changes)
        gone: set[str] = set()
        for pool in self.hooks.pools:
            summary = pool.nic_summary()
            healthy = sum(1 for n in summary if n["healthy"])
            pool_nics.add_metric([pool.name, HEALTHY], healthy)
            pool_nics.add_metric([pool.name, UNHEALTHY], len(summary) - healthy)
            gone.update(str(n["name"]) for n in summary if not n["present"])
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
                changes.add_metric([nic, str(i)], counted.get((nic, i), 0))
        yield active
        yield state
        yield changes
        yield pool_nics
        yield from self._nics()
        yield from self._live()

    def _nics(self) -> Iterator[Metric]:
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
        with self.hooks.lock:
            nics = list(self.hooks.nics)
            gpus = dict(self.hooks.affinity.nics)
        owners: dict[str, str] = {}
        for pool in self.hooks.pools:  # numaPools: the NIC's first pool (the configured resource) names it
            for nic in pool.present_nics():
                owners.setdefault(nic.name, pool.name)
        for nic in nics:
            layers = sorted({p.link_layer for p in nic.ports if p.link_layer})
            numa = "" if nic.numa_node is None else str(nic.numa_node)
            labels = [nic.name, nic.pci_address, ",".join(layers), ",".join(sorted(nic.netdevs)), numa]
            info.add_metric([*labels, owners.get(nic.name, ""), *affinity.metric_labels(gpus.get(nic.name))], 1)
        yield info
        unset = GaugeMetricFamily(
            "rdma_dp_env_unset",
            "1 while a variable of the env NCCL reads (workloadEnv) is left unset for a resource's NICs, and why "
            "(gid_index_differs, no_suitable_gid)",
            labels=["resource", "variable", "reason"],
        )
        for pool in self.hooks.pools:
            seen = set()
            for _, env in pool.workload_env():
                for u in env.unset:
                    if (u.variable, u.reason) not in seen:
                        seen.add((u.variable, u.reason))
                        unset.add_metric([pool.name, u.variable, u.reason], 1)
        yield unset

    def _live(self) -> Iterator[Metric]:
        status = self.hooks.status() if self.hooks.status is not None else None
        if status is None:
            return
        registered = GaugeMetricFamily(
            "rdma_dp_resource_registered", "1 while the resource is registered with the kubelet", labels=["resource"]
        )
        streams = GaugeMetricFamily(
            "rdma_dp_kubelet_stream_open", "1 while the kubelet has a ListAndWatch stream open", labels=["resource"]
        )
        for pool in self.hooks.pools:
            registered.add_metric([pool.name], 1 if pool.name in status.registered else 0)
            streams.add_metric([pool.name], 1 if pool.name in status.kubelet_streams else 0)
        yield registered
        yield streams
        loops = GaugeMetricFamily(
            "rdma_dp_loop_last_success_timestamp_seconds",
            "Unix time a step of the supervisor loop last completed (probe: health probe, watch: kubelet socket watch)",
            labels=["loop"],
        )
        for name, last in sorted(status.loops.items()):
            loops.add_metric([name], last)
        yield loops


class MetricsHooks(Hooks):
    def __init__(self, registry: CollectorRegistry | None = None, sysfs_root: str | None = None) -> None:
        self.registry = registry or CollectorRegistry(auto_describe=True)
        self.lock = threading.Lock()
        self.pools: list[ResourcePool] = []
        self.ports: dict[str, tuple[str, ...] | None] = {}
        self.state_changes: dict[tuple[str, int], int] = {}  # (nic, port) -> changes observed
        self.nics: list[Nic] = []
        self.affinity = affinity.NodeAffinity({}, (), {})
        self.status: Callable[[], LiveStatus] | None = None
        self._server: Any = None
        self.info = Gauge(
            "rdma_dp_build_info", "Plugin version and mode (1)", ["version", "mode"], registry=self.registry
        )
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
        self.stream_ends = Counter(
            "rdma_dp_stream_ends",
            "ListAndWatch streams the kubelet ended while serving",
            ["resource"],
            registry=self.registry,
        )
        self.registry.register(_StateCollector(self))
        if sysfs_root is not None:
            self.registry.register(port_counters.PortCountersCollector(sysfs_root, self._present_nics))
        # (resource, ok) -> its counter and histogram children: labels() takes a lock and builds
        # a key at each call, and allocated() runs on the gRPC loop at every Allocate.
        self._allocate_children: dict[tuple[str, bool], tuple[Any, Any]] = {}

    # ------------------------------------------------------------------ Hooks

    def allocated(self, resource: str, seconds: float, ok: bool) -> None:
        children = self._allocate_children.get((resource, ok))
        if children is None:
            children = (self.allocations.labels(resource, "ok" if ok else "error"), self.latency.labels(resource))
            self._allocate_children[(resource, ok)] = children
        children[0].inc()
        children[1].observe(seconds)

    def registered(self, resource: str) -> None:
        self.registrations.labels(resource).inc()

    def kubelet_restarted(self) -> None:
        self.kubelet_restarts.inc()

    def rediscovered(self) -> None:
        self.rediscoveries.inc()

    def stream_ended(self, resource: str) -> None:
        self.stream_ends.labels(resource).inc()

    def nics_found(self, nics: Sequence[Nic]) -> None:
        with self.lock:
            self.nics = list(nics)

    def affinity_found(self, node: affinity.NodeAffinity) -> None:
        with self.lock:
            self.affinity = node

    def supervising(self, status: Callable[[], LiveStatus]) -> None:
        self.status = status

    def port_states(self, states: Mapping[str, tuple[str, ...] | None]) -> None:
        """Every probe and re-list passes every RDMA device on the node: the map is replaced, so a
        vanished NIC leaves it; a port whose state differs from the last one seen counts a change."""
        with self.lock:
            for nic, now in states.items():
                before = self.ports.get(nic)
                if now is None or before is None:
                    continue  # appearing or vanishing is not a port state change
                for i, (old, new) in enumerate(zip(before, now, strict=False), start=1):
                    if old != new:
                        self.state_changes[(nic, i)] = self.state_changes.get((nic, i), 0) + 1
            self.ports = dict(states)

    def _present_nics(self) -> list[Nic]:
        with self.lock:
            return list(self.nics)

    def pools_ready(self, pools: Sequence[ResourcePool]) -> None:
        self.pools = list(pools)
        for mode in sorted({pool.mode for pool in self.pools}):
            self.info.labels(__version__, mode).set(1)
        for pool in self.pools:  # make the series exist before the first call
            self.allocations.labels(pool.name, "ok")
            self.allocations.labels(pool.name, "error")
            self.latency.labels(pool.name)  # the dashboard's Allocate latency panel from the start
            self.registrations.labels(pool.name)
            self.stream_ends.labels(pool.name)

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
