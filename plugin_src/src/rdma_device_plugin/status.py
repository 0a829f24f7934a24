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

The file is written by a small thread of its own from what the supervisor publishes
(published.NodeView: immutable, one reference) and the last allocations (appended on the gRPC
loop to a deque): a slow disk never delays either, and no lock is shared with them; the thread is
woken through a pipe. It sleeps until woken: idle, it wakes only every ``IDLE_RECHECK_SECONDS`` to
put back a file someone deleted, and every ``interval`` after a failed write (the directory not
there yet, or read-only) until one succeeds.

Each resource also says what the plugin knows of the kubelet's side: its registration's state,
whether the kubelet's stream is open, and whether the kubelet has *confirmed* it: an Allocate or
GetPreferredAllocation on the registered socket, which the kubelet sends only to the endpoint it
holds for the resource. Until then the figures are the plugin's belief (a kubelet that took
another registration for the resource looks the same from here): ``status`` says so and how to
see the kubelet's own figures.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .kubeletapi import HEALTHY, UNHEALTHY
from .published import NodeView
from .resources import ResourcePool
from .server import Hooks

STATUS_FILE = os.path.join("rdma-device-plugin", "status.json")
LAST_ALLOCATIONS = 10
IDLE_RECHECK_SECONDS = 30.0


def _utc(at: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(at))


def default_status_file(device_plugin_dir: str) -> str:
    return os.path.join(device_plugin_dir, STATUS_FILE)


def snapshot(view: NodeView, allocations: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The status document: each NIC's health and why come from its pool (the one rule, health.py);
    each resource's env is what a pod gets from its present NICs (workloadEnv) and what it leaves
    unset; each NIC's GID is the one NCCL uses for that env, its GPUs those of affinity.py."""
    resources, nics = [], {}
    gpus = view.affinity.nics
    registrations = {r.name: r for r in view.registrations}
    for pool in view.pools:
        env = [
            {
                "scope": scope,
                "env": dict(sorted(found.env.items())),
                "unset": [{"variable": u.variable, "reason": u.reason, "detail": u.detail} for u in found.unset],
            }
            for scope, found in pool.env
        ]
        entry: dict[str, Any] = {
            "name": pool.name,
            "capacity": len(pool.devices),
            "allocatable": pool.healthy,
            "env": env,
        }
        reg = registrations.get(pool.name)
        if reg is not None:
            entry["kubelet"] = {
                "registration": reg.state,
                "stream_open": reg.kubelet_stream,
                "confirmed": _utc(reg.confirmed_at) if reg.confirmed_at is not None else None,
                "unregistered_since": _utc(reg.unregistered_since) if reg.unregistered_since is not None else None,
            }
        resources.append(entry)
        present = {n.name: n for n in pool.nics.values()}
        for summary in pool.summary:
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
                "ports": list(view.port_states.get(name) or summary["ports"]),  # type: ignore[call-overload]
                "healthy": summary["healthy"],
                "why": summary["why"],
                "gid": summary["gid"],
                "gpus": found_gpus.to_dict() if found_gpus is not None else None,
            }
    return {
        "mode": view.pools[0].mode if view.pools else None,
        "health_probe": "failing" if view.probe_failing else "ok",
        "resources": resources,
        "nics": [nics[n] for n in sorted(nics)],
        "allocations": list(allocations),
    }


class _Signal:
    """Wakes the writer thread from any thread or coroutine: a byte in a pipe, no lock."""

    def __init__(self) -> None:
        self._read, self._write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)

    def set(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):  # full: it is set already; closed: stopping
            os.write(self._write, b"!")

    def wait(self, timeout: float) -> None:
        poller = select.poll()
        poller.register(self._read, select.POLLIN)
        poller.poll(max(0, int(timeout * 1000)))
        with contextlib.suppress(BlockingIOError):
            os.read(self._read, 4096)

    def close(self) -> None:
        os.close(self._read)
        os.close(self._write)


class StatusFileHooks(Hooks):
    def __init__(self, path: str, inner: Hooks | None = None, interval: float = 1.0) -> None:
        self.path = path
        self.inner = inner or Hooks()
        self.interval = interval
        self.view: NodeView | None = None
        # (unix time, resource, ok, seconds): the Allocate hook only appends; the writer formats.
        self.allocations: deque[tuple[float, str, bool, float]] = deque(maxlen=LAST_ALLOCATIONS)
        self._wake = _Signal()
        self._stopped = _Signal()  # ends the pause between two writes at once
        self._stopping = False
        self._written: dict[str, Any] | None = None
        self._thread = threading.Thread(target=self._run, name="status-file", daemon=True)
        self._thread.start()

    # ----------------------------------------------------------------- Hooks
    def allocated(self, resource: str, seconds: float, ok: bool) -> None:
        # On the gRPC loop at every Allocate: an append (atomic) and a byte in the pipe.
        self.inner.allocated(resource, seconds, ok)
        self.allocations.appendleft((time.time(), resource, ok, seconds))
        self._wake.set()

    def registered(self, resource: str) -> None:
        self.inner.registered(resource)

    def kubelet_restarted(self) -> None:
        self.inner.kubelet_restarted()
        self._wake.set()  # the kubelet cleaned its dir (CleanupPluginDirectory): make sure the file is still there

    def rediscovered(self) -> None:
        self.inner.rediscovered()

    def pools_ready(self, pools: Sequence[ResourcePool]) -> None:
        self.inner.pools_ready(pools)

    def stream_ended(self, resource: str) -> None:
        self.inner.stream_ended(resource)

    def probe_failed(self) -> None:
        self.inner.probe_failed()

    def published(self, view: NodeView) -> None:
        self.inner.published(view)
        self.view = view
        self._wake.set()

    def supervising(self, loops: Callable[[], Mapping[str, float]]) -> None:
        self.inner.supervising(loops)

    # ----------------------------------------------------------------- writer
    def write_now(self) -> None:
        view = self.view
        if view is None:
            return
        allocations = [
            {"time": _utc(at), "resource": resource, "ok": ok, "ms": round(seconds * 1000, 3)}
            for at, resource, ok, seconds in list(self.allocations)  # one C-level copy: atomic under the GIL
        ]
        doc = snapshot(view, allocations)
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
        while not self._stopping:
            self._wake.wait(timeout)
            if self._stopping:
                return
            try:
                self.write_now()
            except OSError:
                timeout = self.interval  # the directory may not exist yet or be read-only: retry soon
            else:
                timeout = IDLE_RECHECK_SECONDS
                # At most one write per interval: a burst of hooks (an Allocate storm) becomes one
                # write, and the writer does not take the GIL from the gRPC loop at every call.
                self._stopped.wait(self.interval)

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        self._stopped.set()
        self._thread.join(timeout=5)
        self._wake.close()
        self._stopped.close()
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


def _kubelet_line(k: Mapping[str, Any]) -> str:
    """What the plugin knows of the kubelet's side of one resource."""
    state = k.get("registration")
    if state == "stood down":
        return "stood down: a newer instance on the node serves it"
    if state != "registered":
        return f"NOT registered ({state}) since {k.get('unregistered_since')}"
    stream = "its stream open" if k.get("stream_open") else "its stream NOT open"
    if k.get("confirmed"):
        return f"registered, {stream}; confirmed by its first Allocate at {k['confirmed']}"
    return (
        f"registered, {stream}; not confirmed by the kubelet (no Allocate on this registration yet): the "
        "figures above are the plugin's; the kubelet's own: kubectl get node <node> -o "
        "jsonpath='{.status.allocatable}'"
    )


def render(doc: Mapping[str, Any]) -> str:
    """The status file as text: result first (mode, resources), then NICs, the env a pod gets, and
    the allocations."""
    lines = [f"mode: {doc.get('mode')}    (status written {doc.get('updated', '?')})"]
    if doc.get("health_probe") == "failing":
        lines.append("health probe: FAILING (see the log; the resources turn Unhealthy if it goes on)")
    for r in doc.get("resources", []):
        flag = "" if r["allocatable"] == r["capacity"] else "   <- NIC(s) unhealthy, see below"
        unset = any(e["unset"] for e in r.get("env", []))
        flag += "   <- env left unset, see below" if unset else ""
        lines.append(f"{r['name']}: capacity {r['capacity']}, allocatable {r['allocatable']}{flag}")
        if "kubelet" in r:
            lines.append(f"  kubelet: {_kubelet_line(r['kubelet'])}")
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
