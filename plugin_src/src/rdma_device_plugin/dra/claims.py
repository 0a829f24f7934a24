"""Prepare and unprepare (the kubelet's NodePrepareResources / NodeUnprepareResources), per claim.

Prepare reads the claim from the API server (the kubelet sends namespace, name and UID only), takes
the allocation results of this driver on this node's pool, maps each device to its NICs
(:class:`.model.DeviceRef`), and writes one CDI spec per claim (``<cdi-dir>/<driver>-claim_<uid>.json``,
kind ``<driver>/claim``): a CDI device per allocated device with its NICs' char devices, and in the
spec-wide edits ``rdma_cm`` and the env of exactly the claim's NICs, computed by the device plugin's
own pool (:meth:`..resources.ResourcePool.allocate`: the NCCL/UCX env of ``workloadEnv``, the config's
env, ``RDMA_DEVICES``). The answer names the CDI devices, per request.

Idempotent: what was prepared is kept per claim in ``<state-dir>/claims/<uid>.json`` (written before
the answer, read at start), so a prepare called again (a kubelet restart, a retry) gets the same
answer without touching the API server; unprepare removes the CDI spec and that record, and succeeds
for a claim it does not know (called again, or never prepared here).

Errors are per claim and name what to look at: a NIC that vanished or is not usable (port not
ACTIVE, no uverbs device) when first prepared, a claim re-created under the same name, an allocation
for another node.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
import threading
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from ..resources import AllocationError, ContainerAllocation, DeviceSpec, ResourcePool
from . import kubeapi
from .model import SET, DeviceRef, Published

LOG = logging.getLogger(__name__)
CDI_VERSION = "0.6.0"
RDMA_CM = "/dev/infiniband/rdma_cm"


class ClaimError(Exception):
    """This claim cannot be prepared; the message names the claim and what to look at."""


@dataclass(frozen=True)
class PreparedDevice:
    requests: list[str]
    pool: str
    device: str
    cdi_device_ids: list[str]
    share_id: str | None = None


def cdi_kind(driver: str) -> str:
    return f"{driver}/claim"


def cdi_file(cdi_dir: str, driver: str, uid: str) -> str:
    return os.path.join(cdi_dir, f"{driver}-claim_{uid}.json")


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
        pools: Sequence[ResourcePool],
    ) -> None:
        self.client = client
        self.driver = driver
        self.node = node
        self.records_dir = os.path.join(state_dir, "claims")
        self.cdi_dir = cdi_dir
        self.published = published
        self.pools = {p.name: p for p in pools}
        self._lock = threading.Lock()
        self._prepared: dict[str, dict[str, Any]] = {}
        os.makedirs(self.records_dir, exist_ok=True)
        for entry in sorted(os.listdir(self.records_dir)):
            if entry.endswith(".json"):
                try:
                    with open(os.path.join(self.records_dir, entry), encoding="utf-8") as fh:
                        rec = json.load(fh)
                    self._prepared[str(rec["uid"])] = rec
                except (OSError, ValueError, KeyError) as exc:
                    LOG.warning("unreadable prepared-claim record ignored", extra={"file": entry, "error": str(exc)})

    def prepared(self) -> dict[str, dict[str, Any]]:
        with self._lock:
            return dict(self._prepared)

    # ------------------------------------------------------------------ prepare

    def prepare(self, namespace: str, uid: str, name: str) -> list[PreparedDevice]:
        with self._lock:
            rec = self._prepared.get(uid)
        if rec is not None and os.path.exists(rec["cdi"]):
            return [PreparedDevice(**d) for d in rec["devices"]]
        where = f"claim {namespace}/{name}"
        try:
            claim = self.client.get(f"/apis/resource.k8s.io/v1/namespaces/{namespace}/resourceclaims/{name}")
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
        devices, spec = self._build(where, uid, results)
        path = cdi_file(self.cdi_dir, self.driver, uid)
        _write_json(path, spec)
        rec = {"uid": uid, "namespace": namespace, "name": name, "cdi": path, "devices": [asdict(d) for d in devices]}
        _write_json(os.path.join(self.records_dir, f"{uid}.json"), rec)
        with self._lock:
            self._prepared[uid] = rec
        LOG.info(
            "claim prepared",
            extra={"claim": f"{namespace}/{name}", "uid": uid, "devices": [d.device for d in devices], "cdi": path},
        )
        return devices

    def _build(
        self, where: str, uid: str, results: list[dict[str, Any]]
    ) -> tuple[list[PreparedDevice], dict[str, Any]]:
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
        if not refs:
            return out, spec
        pool = self.pools[owners[0]]
        present = {n.name: n for n in pool.present_nics()}
        nics_of: dict[str, list[str]] = {}
        for device, ref in refs.items():
            names = [n for n in ref.nics if n in present] if ref.view == SET else list(ref.nics)
            gone = [n for n in names if n not in present]
            if gone or not names:
                missing = ", ".join(gone or ref.nics)
                raise ClaimError(f"{where}: NIC {missing} (device {device}) is gone from node {self.node}")
            nics_of[device] = names
        every = sorted({n for names in nics_of.values() for n in names})
        whole = self._allocate(where, pool, [present[n].pci_address for n in every])
        for device in sorted(refs):
            nodes: list[dict[str, str]] = []
            for n in nics_of[device]:
                one = self._allocate(where, pool, [present[n].pci_address])
                nodes += [_node(d) for d in one.devices if d.container_path != RDMA_CM]
            cdi_name = f"{uid}-{device}"
            spec["devices"].append({"name": cdi_name, "containerEdits": {"deviceNodes": nodes}})
            out.append(PreparedDevice(requests[device], self.node, device, [f"{kind}={cdi_name}"], shares[device]))
        spec["containerEdits"] = {
            "env": [f"{k}={v}" for k, v in sorted(whole.envs.items())],
            "deviceNodes": [_node(DeviceSpec(RDMA_CM, RDMA_CM))],
        }
        return out, spec

    @staticmethod
    def _allocate(where: str, pool: ResourcePool, addresses: list[str]) -> ContainerAllocation:
        try:
            return pool.allocate(addresses)
        except AllocationError as exc:
            raise ClaimError(f"{where}: {exc}") from exc

    # ------------------------------------------------------------------ unprepare

    def unprepare(self, namespace: str, uid: str, name: str) -> None:
        with self._lock:
            rec = self._prepared.pop(uid, None)
        _remove(rec["cdi"] if rec else cdi_file(self.cdi_dir, self.driver, uid))
        _remove(os.path.join(self.records_dir, f"{uid}.json"))
        if rec is not None:
            LOG.info("claim unprepared", extra={"claim": f"{namespace}/{name}", "uid": uid})
