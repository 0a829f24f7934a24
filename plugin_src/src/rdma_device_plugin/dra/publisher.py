"""Keeps this node's ResourceSlices in the API server equal to what the driver publishes.

Slices go missing on their own: the kubelet deletes every slice of its node when it starts
(``DRAPluginManager.wipeResourceSlices`` at ``NewDRAPluginManager``), and a driver's slices 30 s
after its plugin disconnected; an operator may delete them. So the publisher does not write once:
a watch on the node's slices of this driver (field selectors ``spec.nodeName``, ``spec.driver``)
wakes it on every change, and a re-list every ``resync`` seconds catches a lost watch; each pass
compares what is there with what should be and writes only the difference (create a missing slice,
rewrite one that differs, delete strays). Every change of content moves the pool to a new
generation (the allocator uses only a pool's newest generation, and only when all its slices are
there: ``resourceSliceCount``).

The slices carry the Node as owner (garbage-collected with it) and a label with their kind
(``counters``/``devices``), by which the publisher finds its own.
"""

from __future__ import annotations

import copy
import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from . import kubeapi

LOG = logging.getLogger(__name__)
SLICES = "/apis/resource.k8s.io/v1/resourceslices"
KIND_LABEL = "rdma.lingjun.io/slice"


def _canonical(spec: dict[str, Any]) -> str:
    """A spec without its generation, for "is the content the same" (the generation follows content)."""
    s = copy.deepcopy(spec)
    s.get("pool", {}).pop("generation", None)
    return json.dumps(s, sort_keys=True)


class Publisher:
    """One thread: reconcile on demand (:meth:`set_specs`), on watch events and every ``resync``."""

    def __init__(
        self,
        client: kubeapi.Client,
        driver: str,
        node: str,
        resync: float = 30.0,
        on_published: Callable[[float], None] | None = None,
        may_publish: Callable[[], bool] | None = None,
    ) -> None:
        self.client = client
        self.may_publish = may_publish  # False while a newer instance of the driver publishes (rolling update)
        self.superseded = False
        self.driver = driver
        self.node = node
        self.resync = resync
        self.on_published = on_published
        self._specs: dict[str, dict[str, Any]] = {}
        self._written: dict[str, tuple[str, str]] = {}  # kind -> (resourceVersion, canonical content)
        self._generation = 0
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._owner: list[dict[str, Any]] | None = None
        self._threads: list[threading.Thread] = []
        self.passes = 0  # reconcile passes that wrote something (tests, logs)
        self.writes = 0
        self.failures = 0  # passes that failed (metrics)
        self.last_error = ""
        self.heartbeat = time.time()  # the loop's last pass, ok or not (liveness: a hung publisher)
        self.in_sync = threading.Event()  # the API holds exactly the current specs

    @property
    def generation(self) -> int:
        return self._generation

    @property
    def selector(self) -> str:
        return f"spec.nodeName={self.node},spec.driver={self.driver}"

    def set_specs(self, specs: dict[str, dict[str, Any]]) -> None:
        with self._lock:
            if {k: _canonical(v) for k, v in specs.items()} == {k: _canonical(v) for k, v in self._specs.items()}:
                return
            self._specs = copy.deepcopy(specs)
            self.in_sync.clear()
        self._wake.set()

    def poke(self) -> None:
        """Look at the API now (e.g. the kubelet registered us again: it may have wiped the slices)."""
        self._wake.set()

    def start(self) -> None:
        for target, name in ((self._loop, "slices"), (self._watch, "slices-watch")):
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self.client.close_watches()  # a watch blocks in a read until the server sends something
        for t in self._threads:
            t.join(timeout=5)

    def delete_all(self) -> None:
        """Remove this node's slices of the driver (uninstall)."""
        for item in self._list():
            with kubeapi.suppress_not_found():
                self.client.delete(f"{SLICES}/{item['metadata']['name']}")

    # ------------------------------------------------------------------ the loop

    def _loop(self) -> None:
        backoff = 1.0
        while not self._stop.is_set():
            self._wake.wait(self.resync)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self.reconcile()
                self.heartbeat = time.time()
                backoff = 1.0
                if self.last_error:
                    LOG.info("ResourceSlices published again", extra={"node": self.node})
                self.last_error = ""
            except (kubeapi.ApiError, OSError, ValueError) as exc:
                if str(exc) != self.last_error:
                    LOG.error(
                        "cannot publish ResourceSlices",
                        extra={
                            "node": self.node,
                            "error": str(exc),
                            "fix": "check the driver's RBAC and the API server",
                        },
                    )
                self.last_error = str(exc)
                self.failures += 1
                self.heartbeat = time.time()
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 30.0)
                self._wake.set()

    def _list(self) -> list[dict[str, Any]]:
        doc = self.client.get(SLICES, {"fieldSelector": self.selector})
        return list(doc.get("items") or [])

    def _owner_refs(self) -> list[dict[str, Any]]:
        if self._owner is None:
            try:
                node = self.client.get(f"/api/v1/nodes/{self.node}")
                uid = node["metadata"]["uid"]
                self._owner = [{"apiVersion": "v1", "kind": "Node", "name": self.node, "uid": uid, "controller": True}]
            except kubeapi.ApiError as exc:
                LOG.warning("slices published without the Node as owner", extra={"node": self.node, "error": str(exc)})
                return []
        return self._owner

    def reconcile(self) -> bool:
        """One pass; True when it wrote something."""
        with self._lock:
            specs = copy.deepcopy(self._specs)
        if not specs:
            return False
        if self.may_publish is not None and not self.may_publish():
            if not self.superseded:
                LOG.info(
                    "a newer instance of the driver publishes this node's ResourceSlices", extra={"node": self.node}
                )
            self.superseded = True
            return False
        self.superseded = False
        t0 = time.monotonic()
        existing: dict[str, list[dict[str, Any]]] = {}
        for item in self._list():
            kind = (item["metadata"].get("labels") or {}).get(KIND_LABEL, "")
            existing.setdefault(kind, []).append(item)
        want = {k: _canonical(v) for k, v in specs.items()}
        # one slice per kind is ours; duplicates and other kinds are strays
        current = {k: items[0] for k, items in existing.items() if k in specs and len(items) == 1}
        # Ours and unchanged: the slice still has the resourceVersion our last write of this
        # content got (the server normalizes quantities and times, so its spec is not compared).
        same = all(
            k in current and self._written.get(k) == (current[k]["metadata"]["resourceVersion"], want[k]) for k in specs
        )
        writes = 0
        if not same:
            gens = [int(i["spec"]["pool"].get("generation", 0)) for items in existing.values() for i in items]
            self._generation = max([self._generation, *gens]) + 1
            for kind, wanted in specs.items():
                spec = {**wanted, "pool": {**wanted["pool"], "generation": self._generation}}
                metadata: dict[str, Any] = {"labels": {KIND_LABEL: kind}, "ownerReferences": self._owner_refs()}
                body = {
                    "apiVersion": "resource.k8s.io/v1",
                    "kind": "ResourceSlice",
                    "metadata": metadata,
                    "spec": spec,
                }
                cur = current.get(kind)
                if cur is not None:
                    metadata["name"] = cur["metadata"]["name"]
                    metadata["resourceVersion"] = cur["metadata"]["resourceVersion"]
                    out = self.client.update(f"{SLICES}/{cur['metadata']['name']}", body)
                else:
                    metadata["generateName"] = f"{self.node[:200]}-{self.driver[:40]}-"
                    out = self.client.create(SLICES, body)
                self._written[kind] = (out["metadata"]["resourceVersion"], want[kind])
                writes += 1
        for kind, items in existing.items():
            for item in items:
                if current.get(kind) is item:
                    continue
                with kubeapi.suppress_not_found():
                    self.client.delete(f"{SLICES}/{item['metadata']['name']}")
                writes += 1
        with self._lock:
            if specs == self._specs:
                self.in_sync.set()
        if writes:
            self.passes += 1
            self.writes += writes
            LOG.info(
                "ResourceSlices published",
                extra={"node": self.node, "generation": self._generation, "writes": writes, "kinds": sorted(specs)},
            )
            if self.on_published is not None:
                self.on_published(time.monotonic() - t0)
        return writes > 0

    # ------------------------------------------------------------------ the watch

    def _watch(self) -> None:
        while not self._stop.is_set():
            try:
                rv = self.client.get(SLICES, {"fieldSelector": self.selector, "limit": "1"})["metadata"].get(
                    "resourceVersion", ""
                )
                self._wake.set()  # something may have changed while no watch was open
                for event in self.client.watch(
                    SLICES, {"fieldSelector": self.selector, "resourceVersion": rv, "timeoutSeconds": "300"}, self._stop
                ):
                    if event.get("type") in ("DELETED", "MODIFIED", "ADDED"):
                        meta = event.get("object", {}).get("metadata", {})
                        kind = (meta.get("labels") or {}).get(KIND_LABEL, "")
                        written = self._written.get(kind)
                        if event["type"] == "DELETED":
                            self.in_sync.clear()  # e.g. the kubelet's start wiped them: not ready until rewritten
                        if written is None or written[0] != meta.get("resourceVersion") or event["type"] == "DELETED":
                            self._wake.set()
                    elif event.get("type") == "ERROR":
                        break  # e.g. 410 Gone: list and watch again
            except (kubeapi.ApiError, OSError, ValueError) as exc:
                LOG.debug("slice watch ended", extra={"error": str(exc)})
                self._stop.wait(1.0)
