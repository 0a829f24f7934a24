"""Keeps this node's ResourceSlices in the API server equal to what the driver publishes.

Slices go missing on their own: the kubelet deletes every slice of its node when it starts
(``DRAPluginManager.wipeResourceSlices`` at ``NewDRAPluginManager``), and a driver's slices 30 s
after its plugin disconnected; an operator may delete them. So the publisher does not write once:
as an informer does, it LISTs the node's slices of this driver once (field selectors
``spec.nodeName``, ``spec.driver``) and then WATCHes them, keeping a copy in memory; every event
wakes the loop, which compares that copy with what should be and writes only the difference (create
a missing slice, rewrite one whose content differs, delete strays). At rest a node makes no LIST:
the watch resumes from its last resourceVersion (bookmarks keep it fresh) and only a 410 Gone
lists again; the loop's ``resync`` pass reads the copy, not the API.

"Differs" is judged by content, not resourceVersion: a slice's spec against the server's own form
of what should be there (the server normalizes quantities and defaults fields), learned from the
answer to our write or, for a slice we did not write (a previous instance's), from a dry-run update.
An edit of labels or annotations rewrites nothing. Every change of content moves the pool to a new
generation (the allocator uses only a pool's newest generation, and only when all its slices are
there: ``resourceSliceCount``); the counters slice is written before the devices slice that
consumes its counters, so a pool is never seen with devices whose counter set is missing.

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
MAX_RACES = 5  # passes in a row that meet a change under their write before it counts as a failure


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
        # kind -> (canonical wanted content, canonical content as the server stores it)
        self._server_form: dict[str, tuple[str, str]] = {}
        self._cache: dict[str, dict[str, Any]] = {}  # name -> the slice as the watch last saw it
        self._cache_lock = threading.Lock()
        self._synced = threading.Event()  # the cache holds the API's view (a watch runs)
        self._rv = ""  # the resourceVersion the watch resumes from
        self.lists = 0  # LIST requests made (bench: requests per node at rest)
        self.watches = 0  # WATCH requests made
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
        races = 0  # passes in a row whose write met a change the copy had not seen yet
        while not self._stop.is_set():
            woken = self._wake.wait(self.resync)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                # after a race, a pass no watch event woke reads the API itself (the watch may be stuck)
                self.reconcile(fresh=bool(races) and not woken)
                races = 0
                self.heartbeat = time.time()
                backoff = 1.0
                if self.last_error:
                    LOG.info("ResourceSlices published again", extra={"node": self.node})
                self.last_error = ""
            except Raced as exc:
                # No back-off: the watch event of that change (the kubelet's start deletes every slice
                # of its node, one by one) wakes the next pass, which then sees it. Issue 38 measured a
                # 1 s back-off here as 1.05 s from a kubelet restart to the slices.
                races += 1
                self.heartbeat = time.time()
                LOG.debug("a slice changed under a write; looking again", extra={"error": str(exc), "races": races})
                if races < MAX_RACES:
                    continue
                self._failed(exc)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 30.0)
                self._wake.set()
            except (kubeapi.ApiError, OSError, ValueError) as exc:
                self._failed(exc)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 30.0)
                self._wake.set()

    def _failed(self, exc: Exception) -> None:
        if str(exc) != self.last_error:
            LOG.error(
                "cannot publish ResourceSlices",
                extra={"node": self.node, "error": str(exc), "fix": "check the driver's RBAC and the API server"},
            )
        self.last_error = str(exc)
        self.failures += 1
        self.heartbeat = time.time()

    def _list(self) -> list[dict[str, Any]]:
        self.lists += 1
        doc = self.client.get(SLICES, {"fieldSelector": self.selector})
        self._rv = str(doc.get("metadata", {}).get("resourceVersion", ""))
        return list(doc.get("items") or [])

    def _existing(self, fresh: bool = False) -> list[dict[str, Any]]:
        """The node's slices: the watch's copy while it runs, else (or ``fresh``) a LIST."""
        if self._synced.is_set() and not fresh:
            with self._cache_lock:
                return list(self._cache.values())
        return self._list()

    def _remember(self, obj: dict[str, Any], deleted: bool = False) -> None:
        """Put an object into the copy unless the copy already has a newer one of that name."""
        name = obj["metadata"]["name"]
        with self._cache_lock:
            have = self._cache.get(name)
            if have is not None and _newer(
                have["metadata"].get("resourceVersion", ""), obj["metadata"].get("resourceVersion", "")
            ):
                return
            if deleted:
                self._cache.pop(name, None)
            else:
                self._cache[name] = obj

    def _server_content(self, kind: str, wanted: dict[str, Any], cur: dict[str, Any] | None) -> str | None:
        """``wanted`` in the server's normalized form (canonical), None when there is no slice to ask with."""
        key = _canonical(wanted)
        known = self._server_form.get(kind)
        if known is not None and known[0] == key:
            return known[1]
        if cur is None:
            return None
        spec = {**wanted, "pool": {**wanted["pool"], "generation": cur["spec"]["pool"].get("generation", 0)}}
        body = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": cur["metadata"], "spec": spec}
        out = self._put(cur, body, {"dryRun": "All"})
        form = _canonical(out["spec"])
        self._server_form[kind] = (key, form)
        return form

    def _put(self, cur: dict[str, Any], body: dict[str, Any], query: dict[str, str] | None = None) -> dict[str, Any]:
        """Update the slice ``cur`` (as the copy has it) to ``body``; :class:`Raced` when it is gone or newer."""
        try:
            return self.client.request("PUT", f"{SLICES}/{cur['metadata']['name']}", body, query=query)
        except kubeapi.ApiError as exc:
            if kubeapi.not_found(exc) or kubeapi.conflict(exc):
                raise Raced(str(exc)) from exc
            raise

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

    def reconcile(self, fresh: bool = False) -> bool:
        """One pass (on a LIST rather than the watch's copy when ``fresh``); True when it wrote something.
        :class:`Raced` when a write met a change of the slice that the copy did not have yet."""
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
        for item in self._existing(fresh):
            kind = (item["metadata"].get("labels") or {}).get(KIND_LABEL, "")
            existing.setdefault(kind, []).append(item)
        # one slice per kind is ours; duplicates and other kinds are strays
        current = {k: items[0] for k, items in existing.items() if k in specs and len(items) == 1}
        # Unchanged: every kind there, of one generation, with the content the server would store
        gens = {int(c["spec"]["pool"].get("generation", 0)) for c in current.values()}
        same = len(current) == len(specs) and len(gens) == 1
        for kind in specs if same else ():
            if _canonical(current[kind]["spec"]) != self._server_content(kind, specs[kind], current[kind]):
                same = False
                break
        writes = 0
        if same:
            self._generation = max(self._generation, *gens)
        else:
            all_gens = [int(i["spec"]["pool"].get("generation", 0)) for items in existing.values() for i in items]
            self._generation = max([self._generation, *all_gens]) + 1
            # the counters before the devices that consume them
            for kind in sorted(specs, key=lambda k: "sharedCounters" not in specs[k]):
                wanted = specs[kind]
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
                    # others' labels and annotations stay (an edit of them alone rewrites nothing)
                    metadata["labels"] = {**(cur["metadata"].get("labels") or {}), KIND_LABEL: kind}
                    if cur["metadata"].get("annotations"):
                        metadata["annotations"] = cur["metadata"]["annotations"]
                    out = self._put(cur, body)
                else:
                    metadata["generateName"] = f"{self.node[:200]}-{self.driver[:40]}-"
                    out = self.client.create(SLICES, body)
                self._server_form[kind] = (_canonical(wanted), _canonical(out["spec"]))
                self._remember(out)
                writes += 1
        for kind, items in existing.items():
            for item in items:
                if current.get(kind) is item:
                    continue
                with kubeapi.suppress_not_found():
                    self.client.delete(f"{SLICES}/{item['metadata']['name']}")
                self._remember(item, deleted=True)
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
        """LIST once, then WATCH from the last resourceVersion for as long as the server allows; LIST
        again only when the server no longer has that version (410 Gone) or the watch failed."""
        while not self._stop.is_set():
            try:
                if not self._rv or not self._synced.is_set():
                    items = self._list()
                    with self._cache_lock:
                        self._cache = {i["metadata"]["name"]: i for i in items}
                    self._synced.set()
                    self._wake.set()  # something may have changed while no watch was open
                self.watches += 1
                query = {"fieldSelector": self.selector, "resourceVersion": self._rv, "timeoutSeconds": "300"}
                for event in self.client.watch(SLICES, query, self._stop):
                    kind, obj = event.get("type"), event.get("object", {})
                    if kind == "ERROR":
                        self._synced.clear()  # e.g. 410 Gone: list and watch again
                        break
                    rv = obj.get("metadata", {}).get("resourceVersion", "")
                    if rv:
                        self._rv = rv
                    if kind == "BOOKMARK":
                        continue
                    if kind in ("ADDED", "MODIFIED", "DELETED"):
                        if kind == "DELETED":
                            self.in_sync.clear()  # e.g. the kubelet's start wiped them: not ready until rewritten
                        self._remember(obj, deleted=kind == "DELETED")
                        self._wake.set()
            except (kubeapi.ApiError, OSError, ValueError) as exc:
                LOG.debug("slice watch ended", extra={"error": str(exc)})
                self._synced.clear()
                self._stop.wait(1.0)


class Raced(Exception):
    """A write met a change of the slice the watch had not delivered yet: deleted (404) or changed (409)."""


def _newer(a: str, b: str) -> bool:
    """resourceVersion ``a`` is newer than ``b`` (etcd's are integers; anything else: not known)."""
    return a.isdigit() and b.isdigit() and int(a) > int(b)
