"""Prepare and unprepare (the kubelet's NodePrepareResources / NodeUnprepareResources), per claim.

Prepare reads the claim from the API server (the kubelet sends namespace, name and UID only), takes
the allocation results of this driver on this node's pool, maps each device to its NICs
(:class:`.model.DeviceRef`), and writes one CDI spec per claim (``<cdi-dir>/<driver>-claim_<uid>.json``,
kind ``<driver>/claim``): a CDI device per allocated device with its NICs' char devices, and in the
spec-wide edits ``rdma_cm`` and the env of exactly the claim's NICs, by the rules the device plugin's
Allocate answers with (:class:`..inventory.ContainerRules`: the NCCL/UCX env of ``workloadEnv``, the
config's env, ``RDMA_DEVICES``). The answer names the CDI devices, per request.

What was prepared is kept per claim in ``<state-dir>/claims/<uid>.json`` (written before the answer,
read at start) with the boot it was made in (``/proc/sys/kernel/random/boot_id``: a record of an
earlier boot is dropped at start, its CDI spec with it) and a digest of the claim's allocation: a
prepare called again (a kubelet restart, a retry) gets the same answer, without writing anything,
while the allocation is the same; an allocation rewritten since is prepared anew. Unprepare removes
the CDI spec and that record, and succeeds for a claim it does not know (called again, or never
prepared here). Calls for one claim run one at a time; the node's serialization lock (every
instance's) is held only around the records' re-read, the conflict check and the writes, so the API
reads of simultaneous prepares run side by side.

The last line of defence: the scheduler's counters keep an exclusive view of a NIC apart from its
shared and set views, but an allocation written around the scheduler (by an admin, a bug, a stale
allocator) is refused here, naming both claims: a NIC prepared for one claim in a view is not
prepared for another claim in a conflicting view (exclusive beside anything), unless that claim is
gone from the API (an orphan: its record is dropped at that prepare).

The kubelet's claim UID is checked (a Kubernetes UID: a UUID) before it names a file, and the claim's
namespace and name are escaped in URLs. :meth:`Claims.collect` removes what no claim owns any more:
CDI specs without a record, records (and specs) of claims gone from the API, replaced or deallocated.

Errors are per claim and name what to look at: a NIC that vanished or is not usable (port not
ACTIVE, no uverbs device) when first prepared, a claim re-created under the same name, an allocation
for another node, a NIC held by another claim in a conflicting view.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict
from typing import Any

from rdma_node.sysfs import Nic

from ..inventory import DeviceSpec, NodeInventory, has_uverbs, nic_identity
from . import kubeapi
from .containers import claims_by_container, pods_of
from .kubeletplugin import PreparedDevice, PrepareError
from .model import EXCLUSIVE, SET, DeviceRef, Published

LOG = logging.getLogger(__name__)
CDI_VERSION = "0.6.0"
RDMA_CM = "/dev/infiniband/rdma_cm"
BOOT_ID = "sys/kernel/random/boot_id"  # below the procfs root
STALE_TEMP_SECONDS = 60.0  # a temp file of a CDI spec write this old was cut short
POD_CACHE = 1024  # pods whose containers' NICs are kept, oldest forgotten first
# What the API server makes a UID (a UUID, util/uuid): nothing else may name a file.
_UID = re.compile(r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}")


class ClaimError(PrepareError):
    """This claim cannot be prepared; the message names the claim and what to look at."""


def cdi_kind(driver: str) -> str:
    return f"{driver}/claim"


def cdi_file(cdi_dir: str, driver: str, uid: str) -> str:
    return os.path.join(cdi_dir, f"{driver}-claim_{uid}.json")


def check_uid(uid: str) -> None:
    if not _UID.fullmatch(uid):
        raise ClaimError(
            f"claim UID {uid!r} is not a Kubernetes UID (a UUID such as 0f8e6a52-3c1d-4b8e-9f7a-2d5c6b1e4a90): "
            "refused before it names a file; the caller is not the kubelet"
        )


def read_boot_id(procfs_root: str) -> str:
    """This boot's ID ("" when the file cannot be read: records are then kept across boots)."""
    try:
        with open(os.path.join(procfs_root, BOOT_ID), encoding="ascii") as fh:
            return fh.read().strip()
    except (OSError, ValueError) as exc:
        LOG.warning("no boot ID: prepared claims cannot be told from an earlier boot's", extra={"error": str(exc)})
        return ""


def allocation_digest(allocation: Any) -> str:
    return hashlib.sha256(json.dumps(allocation, sort_keys=True).encode()).hexdigest()


def base_request(name: str) -> str:
    """``req/sub`` -> ``req`` (a firstAvailable subrequest is reported under its request)."""
    return name.split("/", 1)[0]


def _node(spec: DeviceSpec) -> dict[str, str]:
    return {"path": spec.container_path, "hostPath": spec.host_path, "type": "c", "permissions": spec.permissions}


def _write_json(path: str, doc: Any) -> None:
    """Atomically (temp file in the same dir, then rename): a reader never sees half a file."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".json", dir=os.path.dirname(path))
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(doc, fh, indent=2)
            fh.write("\n")
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _remove(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def conflict(mine: dict[str, Any], theirs: dict[str, Any]) -> list[str]:
    """The NICs (identities) two held views share where one of them is exclusive."""
    if EXCLUSIVE not in (mine["view"], theirs["view"]):
        return []
    return sorted(set(mine["nics"]) & set(theirs["nics"]))


class Claims:
    """Prepared claims of this node: the CDI specs and their records."""

    def __init__(
        self,
        client: kubeapi.Client,
        driver: str,
        node: str,
        state_dir: str,
        cdi_dir: str,
        published: Callable[[], Published],
        nics: NodeInventory,
        boot_id: str = "",
        node_lock: Callable[[], contextlib.AbstractContextManager[None]] | None = None,
    ) -> None:
        self.client = client
        self.driver = driver
        self.node = node
        self.records_dir = os.path.join(state_dir, "claims")
        self.cdi_dir = cdi_dir
        self.published = published
        self.nics = nics
        self.boot_id = boot_id
        self._lock = threading.Lock()  # the records (and the conflict check with the write it allows)
        self._claim_locks: dict[str, tuple[threading.Lock, list[int]]] = {}  # uid -> (lock, [users])
        self._prepared: dict[str, dict[str, Any]] = {}
        self._fresh: set[str] = set()  # claims prepared since the orphan collector's last pass
        self._pod_nics: dict[str, list[tuple[list[str], frozenset[str], frozenset[tuple[str, str]]]]] = {}
        # The node's serialization lock (kubeletplugin.SerializeLock: every prepare and unprepare of every
        # instance of the driver on the node holds it), for what decides on files another instance may be
        # writing. The records on disk are the one truth: during a rolling update two instances prepare
        # and unprepare beside each other, so each call reads again what changed there (_sync).
        self._node_lock = node_lock or contextlib.nullcontext
        self._seen: dict[str, tuple[int, int, int]] = {}  # record file -> (inode, mtime, size) as last read
        os.makedirs(self.records_dir, exist_ok=True)
        with self._node_lock():
            for entry in os.listdir(self.records_dir):
                if entry.startswith(".tmp-"):  # a write cut short
                    _remove(os.path.join(self.records_dir, entry))
            self._sync()
            self._fresh.clear()  # found at the start: asked about at the first pass
            self._collect_files()

    def _read_record(self, entry: str) -> dict[str, Any] | None:
        """A record file of this boot, or None (unreadable: said; of an earlier boot: dropped with its spec)."""
        path = os.path.join(self.records_dir, entry)
        try:
            with open(path, encoding="utf-8") as fh:
                rec = json.load(fh)
            uid = str(rec["uid"])
            check_uid(uid)
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, ClaimError) as exc:
            LOG.warning("unreadable prepared-claim record ignored", extra={"file": entry, "error": str(exc)})
            return None
        # A reboot: the kubelet prepares its pods' claims again; nothing of the old boot holds (a
        # record written before boots were kept counts as this boot's).
        if self.boot_id and rec.get("boot", self.boot_id) != self.boot_id:
            _remove(cdi_file(self.cdi_dir, self.driver, uid))
            _remove(path)
            LOG.info("prepared claim of an earlier boot dropped", extra={"uid": uid, "boot": rec.get("boot")})
            return None
        return dict(rec)

    def _sync(self) -> None:
        """The records as the node's disk has them: files another instance wrote or removed since the
        last read are read again or forgotten (a stat per record; a changed one is parsed)."""
        try:
            entries = [e for e in os.listdir(self.records_dir) if e.endswith(".json") and not e.startswith(".tmp-")]
        except FileNotFoundError:
            entries = []
        with self._lock:
            seen: dict[str, tuple[int, int, int]] = {}
            for entry in entries:
                try:
                    st = os.stat(os.path.join(self.records_dir, entry))
                except FileNotFoundError:
                    continue
                sig = (st.st_ino, st.st_mtime_ns, st.st_size)
                uid = entry[: -len(".json")]
                if self._seen.get(entry) != sig or uid not in self._prepared:
                    rec = self._read_record(entry)
                    if rec is None:
                        self._prepared.pop(uid, None)
                        continue
                    if self._prepared.get(uid) != rec:
                        self._fresh.add(uid)  # prepared by another instance: asked about from the next pass
                    self._prepared[uid] = rec
                seen[entry] = sig
            for uid in [u for u in self._prepared if f"{u}.json" not in seen]:
                del self._prepared[uid]  # unprepared (or collected) by another instance
                self._fresh.discard(uid)
            self._seen = seen

    def prepared(self) -> dict[str, dict[str, Any]]:
        with self._lock:
            return dict(self._prepared)

    @contextlib.contextmanager
    def _serialized(self, uid: str, wait: bool = True) -> Iterator[bool]:
        """One prepare or unprepare of a claim at a time (the kubelet may retry while one runs); with
        ``wait`` False it yields False at once when a call for the claim runs."""
        with self._lock:
            lock, users = self._claim_locks.setdefault(uid, (threading.Lock(), [0]))
            users[0] += 1
        try:
            got = lock.acquire(blocking=wait)
            try:
                yield got
            finally:
                if got:
                    lock.release()
        finally:
            with self._lock:
                users[0] -= 1
                if not users[0]:
                    del self._claim_locks[uid]

    # ------------------------------------------------------------------ prepare

    def prepare(self, namespace: str, uid: str, name: str) -> list[PreparedDevice]:
        check_uid(uid)
        with self._serialized(uid):
            return self._prepare(namespace, uid, name)

    def _cached(self, uid: str, digest: str, say: bool = True) -> list[PreparedDevice] | None:
        """The answer already prepared for this allocation of the claim, here or by another instance
        (call under the node lock: the records as the disk has them); ``say``: log a changed allocation."""
        self._sync()
        with self._lock:
            rec = self._prepared.get(uid)
        if rec is not None and rec.get("allocation") == digest and os.path.exists(rec["cdi"]):
            return [PreparedDevice(**d) for d in rec["devices"]]
        if say and rec is not None and rec.get("allocation", digest) != digest:
            LOG.warning("claim's allocation changed since it was prepared: prepared anew", extra={"uid": uid})
        return None

    def _prepare(self, namespace: str, uid: str, name: str) -> list[PreparedDevice]:
        t0, cpu0, api0 = time.monotonic(), time.thread_time(), self.client.waited()
        where = f"claim {namespace}/{name}"
        try:
            claim = self.client.get(kubeapi.claim_path(namespace, name))
        except kubeapi.ApiError as exc:
            raise ClaimError(f"{where}: reading it from the API server failed ({exc})") from exc
        if claim.get("metadata", {}).get("uid") != uid:
            raise ClaimError(
                f"{where} has UID {claim.get('metadata', {}).get('uid')}, the kubelet asked for {uid}: "
                "it was deleted and created again; the pod must be re-created"
            )
        allocation = (claim.get("status") or {}).get("allocation")
        if not allocation:
            raise ClaimError(f"{where} is not allocated")
        digest = allocation_digest(allocation)
        # The node lock only where the call decides on files (the records, the conflict check, the
        # writes); the API reads and the spec's build run beside other calls (issue 38: ten pods at once
        # queued behind each other's GETs). The claim's own lock keeps one call per claim in this process.
        with self._node_lock():
            cached = self._cached(uid, digest)
        if cached is not None:
            return cached
        results = [
            r
            for r in (allocation.get("devices") or {}).get("results") or []
            if r.get("driver") == self.driver and r.get("pool") == self.node
        ]
        others = [
            f"{r.get('pool')}/{r.get('device')}"
            for r in (allocation.get("devices") or {}).get("results") or []
            if r.get("driver") == self.driver and r.get("pool") != self.node
        ]
        if others:
            raise ClaimError(f"{where}: devices {others} of {self.driver} are not on node {self.node}")
        companions = self._companions(where, namespace, name, claim)
        devices, spec, held = self._build(where, uid, results, companions)
        path = cdi_file(self.cdi_dir, self.driver, uid)
        rec = {
            "uid": uid,
            "namespace": namespace,
            "name": name,
            "cdi": path,
            "devices": [asdict(d) for d in devices],
            "held": held,
            "allocation": digest,
            "boot": self.boot_id,
        }
        with self._node_lock():
            cached = self._cached(uid, digest, say=False)  # prepared meanwhile by another instance (a rollout)
            if cached is not None:
                return cached
            self._collect_in_the_way(uid, held)
            with self._lock:  # the check and the write it allows, as one step against other claims
                self._refuse_conflicts(where, uid, held)
                _write_json(path, spec)
                _write_json(os.path.join(self.records_dir, f"{uid}.json"), rec)
                self._prepared[uid] = rec
                self._seen.pop(f"{uid}.json", None)  # read back by the next _sync (cheap: one record)
                self._fresh.add(uid)
        LOG.info(
            "claim prepared",
            extra={
                "claim": f"{namespace}/{name}",
                "uid": uid,
                "devices": [d.device for d in devices],
                "cdi": path,
                "seconds": round(time.monotonic() - t0, 4),  # the driver's part of the kubelet's call
                "cpu_seconds": round(time.thread_time() - cpu0, 4),  # its own CPU in it (the rest is waiting)
                "api_seconds": round(self.client.waited() - api0, 4),  # in its reads of the claim and the pod
            },
        )
        return devices

    def _collect_in_the_way(self, uid: str, held: list[dict[str, Any]]) -> None:
        """Other claims' records that conflict with ``held``, whose claims are gone from the API (a quorum
        read): dropped now rather than at the collector's next pass, so an orphan never refuses a claim
        the scheduler allocated. A claim with a call running is left to the refusal (no lock order)."""
        with self._lock:
            holders = sorted(
                (other, rec)
                for other, rec in self._prepared.items()
                if other != uid and any(conflict(m, t) for t in rec.get("held") or [] for m in held)
            )
        for other, rec in holders:
            with self._serialized(other, wait=False) as got:
                if not got or other not in self.prepared():
                    continue
                try:
                    alive, claim = self._holds(other, rec, cached=False)
                except kubeapi.ApiError as exc:
                    LOG.warning("orphan check skipped", extra={"uid": other, "error": str(exc)})
                    continue
                if not alive:
                    self._drop_orphan(other, rec, claim)

    def _drop_orphan(self, uid: str, rec: dict[str, Any], claim: dict[str, Any]) -> None:
        self._drop(uid)
        LOG.info(
            "orphaned prepared claim removed",
            extra={"claim": f"{rec['namespace']}/{rec['name']}", "uid": uid, "in_api": bool(claim)},
        )

    def _refuse_conflicts(self, where: str, uid: str, held: list[dict[str, Any]]) -> None:
        for other, rec in sorted(self._prepared.items()):
            if other == uid:
                continue
            for theirs in rec.get("held") or []:
                for mine in held:
                    shared = conflict(mine, theirs)
                    if shared:
                        names = [mine["names"].get(n, n) for n in shared]
                        raise ClaimError(
                            f"{where}: NIC {', '.join(names)} ({', '.join(shared)}) is already prepared for claim "
                            f"{rec.get('namespace')}/{rec.get('name')} (UID {other}) as its {theirs['view']} device "
                            f"{theirs['device']}; this claim's {mine['view']} device {mine['device']} cannot be "
                            "prepared beside it (an exclusive view of a NIC excludes every other view of it). "
                            "The scheduler never allocates this: check who wrote the claims' status.allocation"
                        )

    def _nics_of(self, claim: dict[str, Any], published: Published) -> dict[str, str]:
        """RDMA device name -> resource of the NICs a claim holds from this driver on this node."""
        out: dict[str, str] = {}
        for r in ((claim.get("status") or {}).get("allocation") or {}).get("devices", {}).get("results") or []:
            ref = published.refs.get(str(r.get("device")))
            if r.get("driver") == self.driver and r.get("pool") == self.node and ref is not None:
                out.update({n: ref.resource for n in ref.nics})
        return out

    def _companions(self, where: str, namespace: str, name: str, claim: dict[str, Any]) -> dict[str, str]:
        """The NICs (name -> resource) of this driver in the containers that use this claim, its own
        and those of their other claims (:mod:`.containers`): the env of its spec names them all."""
        unions: dict[frozenset[tuple[str, str]], list[str]] = {}
        for pod_name, pod_uid in pods_of(claim):
            containers = self._pod_nics.get(pod_uid)
            if containers is None:
                containers = self._containers(where, namespace, pod_name, pod_uid, name, claim)
            for users, names, nics in containers:
                if name in names:
                    unions.setdefault(nics, []).extend(users)
        if len(unions) > 1:
            shown = "; ".join(
                f"{', '.join(sorted(users))}: {', '.join(sorted(n for n, _ in nics)) or 'none'}"
                for nics, users in sorted(unions.items(), key=lambda kv: sorted(kv[1]))
            )
            raise ClaimError(
                f"{where} is used by containers that hold different sets of {self.driver} NICs ({shown}): "
                "the env of its CDI spec can name one set only; give those containers claims of their own"
            )
        return dict(next(iter(unions))) if unions else {}

    def _containers(
        self, where: str, namespace: str, pod_name: str, pod_uid: str, name: str, claim: dict[str, Any]
    ) -> list[tuple[list[str], frozenset[str], frozenset[tuple[str, str]]]]:
        """A pod's containers that use claims: (``pod/container``, their claims, their NICs of this
        driver). A bound pod's claims stay allocated as they are while it exists: kept per pod."""
        try:
            pod = self.client.get(kubeapi.pod_path(namespace, pod_name))
        except kubeapi.ApiError as exc:
            if kubeapi.not_found(exc):
                return []
            raise ClaimError(f"{where}: reading pod {namespace}/{pod_name} failed ({exc})") from exc
        if pod.get("metadata", {}).get("uid") != pod_uid:
            return []
        published = self.published()
        fetched = {name: claim}
        out = []
        for container, names in sorted(claims_by_container(pod).items()):
            nics: dict[str, str] = {}
            for other in sorted(names):
                if other not in fetched:
                    try:
                        fetched[other] = self.client.get(kubeapi.claim_path(namespace, other))
                    except kubeapi.ApiError as exc:
                        if not kubeapi.not_found(exc):
                            raise ClaimError(f"{where}: reading claim {namespace}/{other} failed ({exc})") from exc
                        fetched[other] = {}
                nics.update(self._nics_of(fetched[other], published))
            out.append(([f"{pod_name}/{container}"], frozenset(names), frozenset(nics.items())))
        with self._lock:
            self._pod_nics[pod_uid] = out
            while len(self._pod_nics) > POD_CACHE:
                del self._pod_nics[next(iter(self._pod_nics))]
        return out

    def _build(
        self, where: str, uid: str, results: list[dict[str, Any]], companions: dict[str, str]
    ) -> tuple[list[PreparedDevice], dict[str, Any], list[dict[str, Any]]]:
        published = self.published()
        refs: dict[str, DeviceRef] = {}
        requests: dict[str, list[str]] = {}
        shares: dict[str, str | None] = {}
        for r in results:
            device = str(r.get("device"))
            ref = published.refs.get(device)
            if ref is None:
                raise ClaimError(
                    f"{where}: device {device} is not on node {self.node} any more (its NIC vanished?); "
                    "see `rdma-device-plugin discover` on the node"
                )
            healthy, why = published.health.get(device, (True, ""))
            if not healthy and ref.view != SET:
                raise ClaimError(f"{where}: NIC {ref.nics[0]} (device {device}) is not usable: {why}")
            refs[device] = ref
            requests.setdefault(device, [])
            if base_request(str(r.get("request", ""))) not in requests[device]:
                requests[device].append(base_request(str(r.get("request", ""))))
            shares.setdefault(device, r.get("shareID"))
        owners = sorted({ref.resource for ref in refs.values()})
        if len(owners) > 1:
            raise ClaimError(f"{where} holds NICs of resources {owners}: ask one resource's NICs per claim")
        kind = cdi_kind(self.driver)
        spec: dict[str, Any] = {"cdiVersion": CDI_VERSION, "kind": kind, "devices": []}
        out: list[PreparedDevice] = []
        held: list[dict[str, Any]] = []
        if not refs:
            return out, spec, held
        nic_set = self.nics.resources[owners[0]].current  # one moment's NICs and facts (another thread's)
        present = nic_set.by_name()
        nics_of: dict[str, list[str]] = {}
        for device, ref in refs.items():
            names = [n for n in ref.nics if n in present] if ref.view == SET else list(ref.nics)
            gone = [n for n in names if n not in present]
            if gone or not names:
                missing = ", ".join(gone or ref.nics)
                raise ClaimError(f"{where}: NIC {missing} (device {device}) is gone from node {self.node}")
            nics_of[device] = names
            ids = {nic_identity(present[n]): n for n in names}
            held.append({"device": device, "view": ref.view, "nics": sorted(ids), "names": ids})
        mixed = sorted({r for r in companions.values() if r != owners[0]})
        if mixed:
            raise ClaimError(
                f"{where}: a container that uses it holds NICs of resources {[owners[0], *mixed]} through its "
                "claims: their env can name one resource's NICs only; ask one resource's NICs per container"
            )
        # The container's other claims' NICs too (one env for all of them): those present on the node.
        every = sorted({n for names in nics_of.values() for n in names} | (set(companions) & set(present)))
        rules = self.nics.rules
        whole = sorted((present[n] for n in every), key=lambda n: n.pci_address)  # as Allocate orders them
        env = rules.env(self._usable(where, owners[0], whole), nic_set.facts)
        for device in sorted(refs):
            nodes: list[dict[str, str]] = []
            for n in nics_of[device]:
                one = rules.device_specs(self._usable(where, owners[0], [present[n]]))
                nodes += [_node(d) for d in one if d.container_path != RDMA_CM]
            cdi_name = f"{uid}-{device}"
            spec["devices"].append({"name": cdi_name, "containerEdits": {"deviceNodes": nodes}})
            out.append(PreparedDevice(requests[device], self.node, device, [f"{kind}={cdi_name}"], shares[device]))
        spec["containerEdits"] = {
            "env": [f"{k}={v}" for k, v in sorted(env.items())],
            "deviceNodes": [_node(DeviceSpec(RDMA_CM, RDMA_CM))],
        }
        return out, spec, held

    @staticmethod
    def _usable(where: str, resource: str, nics: list[Nic]) -> list[Nic]:
        """The NICs with a uverbs device (what a container can be given), as the device plugin's Allocate."""
        usable = [n for n in nics if has_uverbs(n)]
        if not usable:
            raise ClaimError(f"{where}: no RDMA NIC of resource {resource} is present on the node")
        return usable

    # ------------------------------------------------------------------ unprepare

    def unprepare(self, namespace: str, uid: str, name: str) -> None:
        check_uid(uid)
        with self._serialized(uid), self._node_lock():
            self._sync()
            self._drop(uid)
        LOG.info("claim unprepared", extra={"claim": f"{namespace}/{name}", "uid": uid})

    def _drop(self, uid: str) -> None:
        with self._lock:
            rec = self._prepared.pop(uid, None)
            self._fresh.discard(uid)
            _remove(rec["cdi"] if rec else cdi_file(self.cdi_dir, self.driver, uid))
            _remove(os.path.join(self.records_dir, f"{uid}.json"))
            self._seen.pop(f"{uid}.json", None)

    # ------------------------------------------------------------------ orphans

    def _collect_files(self) -> None:
        """CDI specs of this driver's claims without a record (a crash between the two writes, a
        record of an earlier boot), and temp files of writes cut short: only old ones, since the
        device plugin may write its own spec in the same dir (same temp prefix) at this moment."""
        prefix = f"{self.driver}-claim_"
        try:
            entries = sorted(os.listdir(self.cdi_dir))
        except FileNotFoundError:
            return
        with self._lock:
            known = {os.path.basename(r["cdi"]) for r in self._prepared.values()}
            for entry in entries:
                path = os.path.join(self.cdi_dir, entry)
                orphan = entry.startswith(prefix) and entry.endswith(".json") and entry not in known
                with contextlib.suppress(FileNotFoundError):
                    if entry.startswith(".tmp-") and time.time() - os.stat(path).st_mtime > STALE_TEMP_SECONDS:
                        orphan = True
                if orphan:
                    _remove(path)
                    LOG.info("orphaned CDI spec removed", extra={"file": entry})

    def _holds(self, uid: str, rec: dict[str, Any], cached: bool) -> tuple[bool, dict[str, Any]]:
        """Whether the API still has the claim of ``rec``, allocated (the same UID); and the claim
        ({} when gone). ``cached``: from the API server's watch cache (resourceVersion "0": no etcd
        read, maybe a moment old), else a quorum read."""
        query = {"resourceVersion": "0"} if cached else None
        try:
            claim = self.client.get(kubeapi.claim_path(str(rec["namespace"]), str(rec["name"])), query)
        except kubeapi.ApiError as exc:
            if not kubeapi.not_found(exc):
                raise
            claim = {}
        same = claim.get("metadata", {}).get("uid") == uid
        return same and bool((claim.get("status") or {}).get("allocation")), claim

    def collect(self) -> int:
        """Drop the records of claims gone from the API (or re-created, or deallocated: no pod can use
        them), and CDI specs without a record; the number of claims dropped. The kubelet unprepares
        what it knows; this catches what it forgot (its state lost, a claim deleted while it was down).

        What it costs the API server (issue 38, docs/dra.md): a claim prepared since the previous pass
        is not asked about (it was read moments ago; a short-lived claim never is); the others with a
        GET from the API server's watch cache, and only a claim that looks gone there is read again
        from etcd before its record is dropped (a watch cache may lag behind the prepare's read)."""
        dropped = 0
        with self._node_lock():
            self._sync()
        with self._lock:
            skip, self._fresh = self._fresh, set()
        for uid, rec in sorted(self.prepared().items()):
            if uid in skip:
                continue
            try:
                held, claim = self._holds(uid, rec, cached=True)
                if not held:
                    held, claim = self._holds(uid, rec, cached=False)
            except kubeapi.ApiError as exc:
                LOG.warning("orphan check skipped", extra={"uid": uid, "error": str(exc)})
                continue
            if held:
                continue
            # The claim's lock first, then the node's: the order of a prepare and an unprepare.
            with self._serialized(uid), self._node_lock():
                self._sync()
                if self.prepared().get(uid) != rec:
                    continue  # unprepared meanwhile, here or by another instance
                self._drop_orphan(uid, rec, claim)
                dropped += 1
        with self._node_lock():
            self._sync()
            self._collect_files()
        return dropped
