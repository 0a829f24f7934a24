"""The node's status at a glance: a JSON file the plugin keeps current, and its text rendering.

:class:`StatusFileHooks` is a ``server.Hooks`` observer (wrapping any other, e.g. metrics) that
rewrites ``--status-file`` atomically whenever what it shows changes (default
``<device-plugin-dir>/rdma-device-plugin/status.json``: the DaemonSet already mounts that dir
read-write, and a kubelet restart deletes the dir's files but keeps its subdirectories, see
kubernetes pkg/kubelet/cm/devicemanager/manager.go, CleanupPluginDirectory):
mode, each resource's capacity and allocatable (devices, healthy devices: what the kubelet
reports), each NIC with port states, netdevs, NUMA node, health and why, the GID NCCL uses and its
GPUs (switch, root port, NUMA node), the env a pod gets per resource (and what is left unset), and the last
allocations. ``rdma-device-plugin status`` prints it (:func:`render`).

The hooks fire on the supervisor and gRPC threads once the pools applied a change, so the file
is written by a small thread that re-reads the pools after each hook (a slow disk never delays
them). It sleeps until a hook fires: idle, it wakes only every ``IDLE_RECHECK_SECONDS`` to put
back a file someone deleted, and every ``interval`` after a failed write (the directory not
there yet, or read-only) until one succeeds.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .affinity import NodeAffinity
from .health import Hold
from .kubeletapi import HEALTHY, UNHEALTHY
from .node.sysfs import Nic
from .resources import ResourcePool
from .server import Hooks, LiveStatus

STATUS_FILE = os.path.join("rdma-device-plugin", "status.json")
LAST_ALLOCATIONS = 10
IDLE_RECHECK_SECONDS = 30.0


def _utc(at: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(at))


def default_status_file(device_plugin_dir: str) -> str:
    return os.path.join(device_plugin_dir, STATUS_FILE)


def snapshot(
    pools: Sequence[ResourcePool],
    states: Mapping[str, tuple[str, ...] | None],
    allocations: Sequence[dict[str, Any]],
    node_affinity: NodeAffinity | None = None,
) -> dict[str, Any]:
    """The status document: each NIC's health and why come from its pool (the one rule, health.py);
    each resource's env is what a pod gets from its present NICs (workloadEnv) and what it leaves
    unset; each NIC's GID is the one NCCL uses for that env, its GPUs those of affinity.py."""
    resources, nics = [], {}
    gpus = node_affinity.nics if node_affinity is not None else {}
    for pool in pools:
        _, devices = pool.snapshot()
        healthy = sum(1 for d in devices if d.health == HEALTHY)
        env = [
            {
                "scope": scope,
                "env": dict(sorted(found.env.items())),
                "unset": [{"variable": u.variable, "reason": u.reason, "detail": u.detail} for u in found.unset],
            }
            for scope, found in pool.workload_env()
        ]
        resources.append({"name": pool.name, "capacity": len(devices), "allocatable": healthy, "env": env})
        present = {n.name: n for n in pool.present_nics()}
        for summary in pool.nic_summary():
            name = str(summary["name"])
            if name in nics:  # numaPools: the NIC's first pool (the configured resource) names it
                continue
            nic = present.get(name)
            found_gpus = gpus.get(name)
            nics[name] = {
                "name": name,
                "resource": pool.name,
                "pci_address": summary["pci_address"],
                "netdevs": list(nic.netdevs) if nic else [],
                "numa_node": summary["numa_node"],
                "ports": list(states.get(name) or summary["ports"]),  # type: ignore[call-overload]
                "healthy": summary["healthy"],
                "why": summary["why"],
                "gid": summary["gid"],
                "gpus": found_gpus.to_dict() if found_gpus is not None else None,
            }
    return {
        "mode": pools[0].mode if pools else None,
        "resources": resources,
        "nics": [nics[n] for n in sorted(nics)],
        "allocations": list(allocations),
    }


class StatusFileHooks(Hooks):
    def __init__(self, path: str, inner: Hooks | None = None, interval: float = 1.0) -> None:
        self.path = path
        self.inner = inner or Hooks()
        self.interval = interval
        self.pools: Sequence[ResourcePool] = ()
        self.states: dict[str, tuple[str, ...] | None] = {}
        self.affinity: NodeAffinity | None = None
        # (unix time, resource, ok, seconds): the Allocate hook only appends; the writer formats.
        self.allocations: deque[tuple[float, str, bool, float]] = deque(maxlen=LAST_ALLOCATIONS)
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._written: dict[str, Any] | None = None
        self._thread = threading.Thread(target=self._run, name="status-file", daemon=True)
        self._thread.start()

    # ----------------------------------------------------------------- Hooks
    def allocated(self, resource: str, seconds: float, ok: bool) -> None:
        # On the gRPC loop at every Allocate: keep it to an append (deque.appendleft is atomic).
        self.inner.allocated(resource, seconds, ok)
        self.allocations.appendleft((time.time(), resource, ok, seconds))
        if not self._wake.is_set():
            self._wake.set()

    def registered(self, resource: str) -> None:
        self.inner.registered(resource)
        self._wake.set()

    def kubelet_restarted(self) -> None:
        self.inner.kubelet_restarted()
        self._wake.set()  # the kubelet cleaned its dir (CleanupPluginDirectory): make sure the file is still there

    def rediscovered(self) -> None:
        self.inner.rediscovered()
        self._wake.set()

    def port_states(self, states: Mapping[str, tuple[str, ...] | None]) -> None:
        self.inner.port_states(states)
        with self._lock:
            self.states.update(states)
        self._wake.set()

    def pools_ready(self, pools: Sequence[ResourcePool]) -> None:
        self.inner.pools_ready(pools)
        self.pools = pools
        for pool in pools:  # any change of devices or health (a probe failing too long, a hold-down)
            pool.add_listener(self._wake.set)
        self._wake.set()

    def affinity_found(self, node: NodeAffinity) -> None:
        self.inner.affinity_found(node)
        self.affinity = node
        self._wake.set()

    # Observed only by the wrapped hooks (metrics); forwarded so that wrapping loses nothing.
    def nics_found(self, nics: Sequence[Nic]) -> None:
        self.inner.nics_found(nics)

    def stream_ended(self, resource: str) -> None:
        self.inner.stream_ended(resource)

    def probe_failed(self) -> None:
        self.inner.probe_failed()
        self._wake.set()

    def held_down(self, holds: Mapping[str, Hold]) -> None:
        self.inner.held_down(holds)

    def supervising(self, status: Callable[[], LiveStatus]) -> None:
        self.inner.supervising(status)

    # ----------------------------------------------------------------- writer
    def write_now(self) -> None:
        with self._lock:
            states = dict(self.states)
        allocations = [
            {"time": _utc(at), "resource": resource, "ok": ok, "ms": round(seconds * 1000, 3)}
            for at, resource, ok, seconds in list(self.allocations)  # one C-level copy: atomic under the GIL
        ]
        doc = snapshot(self.pools, states, allocations, self.affinity)
        if doc == self._written and os.path.exists(self.path):
            return
        directory = os.path.dirname(self.path) or "."
        os.makedirs(directory, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".status-", suffix=".tmp", dir=directory)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                json.dump(dict(doc, updated=_utc(time.time())), fh, indent=2)
            os.replace(tmp, self.path)  # readers never see a half-written file
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        self._written = doc

    def _run(self) -> None:
        timeout = self.interval
        while not self._stop.is_set():
            self._wake.wait(timeout)
            self._wake.clear()
            try:
                self.write_now()
            except OSError:
                timeout = self.interval  # the directory may not exist yet or be read-only: retry soon
            else:
                timeout = IDLE_RECHECK_SECONDS
                # At most one write per interval: a burst of hooks (an Allocate storm) becomes one
                # write, and the writer does not take the GIL from the gRPC loop at every call.
                self._stop.wait(self.interval)

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=5)
        stop = getattr(self.inner, "stop", None)
        if stop is not None:
            stop()
        with contextlib.suppress(OSError):
            os.unlink(self.path)  # no stale status once the plugin is gone
        with contextlib.suppress(OSError):
            os.rmdir(os.path.dirname(self.path))  # and no empty directory in the kubelet's dir


def _gpus(counts: Mapping[str, Sequence[str]] | None) -> str:
    """``2/2/4``: the NIC's GPUs under its switch / root port / NUMA node (cumulative)."""
    if counts is None:
        return "-"
    return "/".join(str(len(counts.get(level, ()))) for level in ("switch", "root_port", "numa"))


def render(doc: Mapping[str, Any]) -> str:
    """The status file as text: result first (mode, resources), then NICs, the env a pod gets, and
    the allocations."""
    lines = [f"mode: {doc.get('mode')}    (status written {doc.get('updated', '?')})"]
    for r in doc.get("resources", []):
        flag = "" if r["allocatable"] == r["capacity"] else "   <- NIC(s) unhealthy, see below"
        unset = any(e["unset"] for e in r.get("env", []))
        flag += "   <- env left unset, see below" if unset else ""
        lines.append(f"{r['name']}: capacity {r['capacity']}, allocatable {r['allocatable']}{flag}")
    rows = [("NIC", "PCI", "NETDEVS", "NUMA", "PORTS", "HEALTH", "WHY", "NCCL GID", "GPUS sw/rp/numa")]
    for n in doc.get("nics", []):
        rows.append(
            (
                n["name"],
                n["pci_address"],
                ",".join(n["netdevs"]) or "-",
                "-" if n["numa_node"] is None else str(n["numa_node"]),
                ",".join(n["ports"]) or "-",
                HEALTHY if n["healthy"] else UNHEALTHY,
                n["why"] or "-",
                n.get("gid") or "-",
                _gpus(n.get("gpus")),
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines.append("")
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    for r in doc.get("resources", []):
        for e in r.get("env", []):
            lines.append("")
            lines.append(f"env a pod gets ({r['name']}{', ' + e['scope'] if e['scope'] else ''}):")
            lines += [f"  {k}={v}" for k, v in e["env"].items()]
            lines += [f"  unset {u['variable']} ({u['reason']}): {u['detail']}" for u in e["unset"]]
    allocs = doc.get("allocations", [])
    lines.append("")
    lines.append("last allocations:" if allocs else "last allocations: none since the plugin started")
    for a in allocs:
        lines.append(f"  {a['time']}  {a['resource']}  {'ok' if a['ok'] else 'FAILED'}  {a['ms']} ms")
    return "\n".join(lines)
