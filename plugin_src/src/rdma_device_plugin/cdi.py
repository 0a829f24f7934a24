"""Container Device Interface (CDI) specs for the selected NICs (``cdi.enabled``).

One spec file per resource in ``--cdi-dir`` (default /var/run/cdi), ``cdiVersion``
0.6.0, JSON, written atomically (temp file in the same dir + rename) and only when its
content changes. With CDI on, Allocate answers with ``cdi_devices`` (fully-qualified
``<kind>=<device>``) instead of device specs; envs are still returned.

Naming:
- kind: ``cdi.kind`` (default ``rdma.lingjun.io/hca``) when the plugin serves one pool;
  with several (resources, or the pools ``numaPools`` makes), each gets
  ``<cdi.kind>-<resource short name>`` so device names never clash between spec files of the
  same kind.
- file: ``<vendor>-<class>.json``, e.g. ``rdma.lingjun.io-hca.json``.
- shared mode: one device ``all`` whose containerEdits hold every NIC's uverbs (plus
  umad/issm when configured) and ``rdma_cm``; a ``-local`` pool (numaPools) has one device per
  NUMA node instead, ``numa<N>`` with that node's NICs, and an allocation names the nodes it got.
- exclusive mode: one device per NIC named after its RDMA device (``mlx5_bond_0``),
  with that NIC's char devices; ``rdma_cm`` is in the spec-wide containerEdits.

Lifecycle: the spec is refreshed whenever discovery sees the NIC set change (a NIC that
vanished is dropped from it). It is deliberately KEPT on shutdown: running containers
were created from it and a runtime may re-read it (container restart) while the plugin
is being upgraded or restarted; a stale entry only names char devices the kubelet no
longer hands out. Delete ``<cdi-dir>/<file>`` by hand when uninstalling.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
from collections.abc import Sequence
from typing import Any

from rdma_node.sysfs import NODE_DEV_DIR, RDMA_CM, Nic

LOG = logging.getLogger(__name__)

CDI_VERSION = "0.6.0"
SHARED_DEVICE = "all"


def resource_kind(base_kind: str, resource: str, resource_count: int) -> str:
    if resource_count <= 1:
        return base_kind
    return f"{base_kind}-{resource.split('/', 1)[1]}"


def spec_file_name(kind: str) -> str:
    return kind.replace("/", "-") + ".json"


def device_name(nic: Nic) -> str:
    """CDI device name of a NIC in exclusive mode (RDMA device names are valid CDI names)."""
    return nic.name


def _node(path: str) -> dict[str, Any]:
    return {"path": path, "hostPath": path, "type": "c", "permissions": "rw"}


def numa_group(nics: Sequence[Nic]) -> tuple[int, ...]:
    """The NUMA nodes of ``nics`` (a -local pool's CDI devices are per node)."""
    return tuple(sorted({n.numa_node for n in nics if n.numa_node is not None}))


def build_spec(
    kind: str, mode: str, nics: Sequence[Nic], umad: bool = False, issm: bool = False, per_numa: bool = False
) -> dict[str, Any]:
    """The CDI spec (plain data) for one resource's present NICs (``per_numa``: a -local pool)."""
    rdma_cm = _node(f"{NODE_DEV_DIR}/{RDMA_CM}")
    usable = sorted((n for n in nics if n.uverbs is not None and n.uverbs.present), key=lambda n: n.name)
    spec: dict[str, Any] = {"cdiVersion": CDI_VERSION, "kind": kind, "devices": []}
    if mode == "shared" and per_numa:
        for node in numa_group(usable):
            nodes = [_node(c.node_path) for n in usable if n.numa_node == node for c in n.char_devices(umad, issm)]
            spec["devices"].append({"name": f"numa{node}", "containerEdits": {"deviceNodes": nodes}})
        spec["containerEdits"] = {"deviceNodes": [rdma_cm]}
    elif mode == "shared":
        if usable:
            nodes = [_node(c.node_path) for n in usable for c in n.char_devices(umad, issm)]
            spec["devices"].append({"name": SHARED_DEVICE, "containerEdits": {"deviceNodes": [*nodes, rdma_cm]}})
    else:
        for nic in usable:
            nodes = [_node(c.node_path) for c in nic.char_devices(umad, issm)]
            spec["devices"].append({"name": device_name(nic), "containerEdits": {"deviceNodes": nodes}})
        spec["containerEdits"] = {"deviceNodes": [rdma_cm]}
    return spec


def qualified(kind: str, name: str) -> str:
    return f"{kind}={name}"


def allocation_devices(
    kind: str, mode: str, nics: Sequence[Nic], numa_nodes: Sequence[int] | None = None
) -> tuple[str, ...]:
    """Fully-qualified CDI device names for an allocation of ``nics`` (``numa_nodes``: of a -local pool)."""
    if mode == "shared" and numa_nodes is not None:
        return tuple(qualified(kind, f"numa{n}") for n in numa_nodes)
    if mode == "shared":
        return (qualified(kind, SHARED_DEVICE),)
    return tuple(qualified(kind, device_name(n)) for n in nics)


class SpecWriter:
    """Writes one resource's spec into ``cdi_dir`` atomically, only when it changes."""

    def __init__(
        self, cdi_dir: str, kind: str, mode: str, umad: bool = False, issm: bool = False, per_numa: bool = False
    ) -> None:
        self.dir = cdi_dir
        self.kind = kind
        self.mode = mode
        self.umad = umad
        self.issm = issm
        self.per_numa = per_numa
        self.path = os.path.join(cdi_dir, spec_file_name(kind))
        self._last: dict[str, Any] | None = None

    def update(self, nics: Sequence[Nic]) -> bool:
        """Write the spec for ``nics``; True when the file was (re)written."""
        spec = build_spec(self.kind, self.mode, nics, self.umad, self.issm, self.per_numa)
        if spec == self._last and os.path.exists(self.path):
            return False
        os.makedirs(self.dir, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".json", dir=self.dir)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                json.dump(spec, fh, indent=2)
                fh.write("\n")
            os.chmod(tmp, 0o644)
            os.replace(tmp, self.path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
        self._last = spec
        LOG.info("CDI spec written", extra={"path": self.path, "devices": [d["name"] for d in spec["devices"]]})
        return True

    def remove(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        self._last = None
