"""The device model: what a node's NICs look like as ``resource.k8s.io/v1`` ResourceSlices (pure logic).

One pool per node (named after the node), two slices (the API takes ``sharedCounters`` and
``devices`` only in separate slices of one pool). For every selected NIC ``<n>`` (its PCI address
made a DNS label, ``0000:1a:00.0`` -> ``0000-1a-00-0``, as the device plugin keys exclusive devices:
the kernel's probe order can give ``mlx5_N`` to another NIC after a reboot or a firmware change, the
PCI function stays; a NIC without one is keyed by its node GUID, else its RDMA device name):

- ``<n>``: the NIC **shared** (``allowMultipleAllocations``): capacity ``slots`` (the resource's
  ``sharedDevices``, each claim takes 1 unless it asks more) and ``bandwidth`` (the port rate in
  bit/s, each claim takes 0 unless it asks some), so up to ``sharedDevices`` claims share it;
- ``<n>-x``: the same NIC **exclusive** (one claim at a time);
- and per resource one device ``all-<short name>`` (``all-hca`` for ``rdma/hca``), the node's NICs of
  that resource **shared as a set**: what a device-plugin pod of shared mode gets (every NIC).

The three views of one NIC cannot collide because they consume the NIC's counter in the pool's one
counter set (``nics``): the counter is worth S = the shared views of the NIC (its ``<n>`` plus every
``all-*`` that holds it); each shared view consumes 1, **once** however many claims share it (the
allocator charges a multi-allocatable device's counters at its first share only:
``allocator_incubating.go``, "Skip the counter check for an allow-multiple device in use"); the
exclusive view consumes S. So shares of a NIC coexist, and an exclusive allocation needs the NIC
free of every share, and keeps it free of them.

``rdma/hca`` pods keep working (KEP-5004: a DeviceClass with ``extendedResourceName: rdma/hca``
selects the devices whose ``extendedResource`` attribute is ``rdma/hca``): on a shared-mode node
that is ``all-hca`` (one device, every NIC, shared by up to ``sharedDevices`` pods), on an
exclusive-mode node each NIC's ``<n>-x`` (one whole NIC per unit). docs/design.md explains the choice.

Health: a NIC whose port left ACTIVE, that lost its uverbs device or that vanished gets a
``NoSchedule`` taint on its views (``DRADeviceTaints``, GA in v1.37): no new allocation, claims that
hold it keep it; a vanished NIC's devices leave the slice after ``health.vanishGraceSeconds``. A set
device is tainted by the resource's ``health.policy`` (all/any of its NICs), as a shared pool's health is.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rdma_node.sysfs import Nic

from ..config_base import numa_resource_name
from ..health import NicHealth

STANDARD = "resource.kubernetes.io"
PCI_BUS_ID = f"{STANDARD}/pciBusID"
PCIE_ROOT = f"{STANDARD}/pcieRoot"
NUMA_NODE = f"{STANDARD}/numaNode"
COUNTER_SET = "nics"
EXCLUSIVE_SUFFIX = "-x"
SET_PREFIX = "all-"
SLOTS = "slots"
BANDWIDTH = "bandwidth"
SHARED, EXCLUSIVE, SET = "shared", "exclusive", "set"
# Kinds of slice in the pool (a label on each, so the publisher finds its own).
COUNTERS_SLICE, DEVICES_SLICE = "counters", "devices"
MAX_NICS = 32  # counters in one counter set (ResourceSliceMaxCountersPerCounterSet)
MAX_COUNTER_SETS = 8  # counter sets in a slice (ResourceSliceMaxCounterSets)
MAX_CONSUMPTIONS = 2  # counter sets one device consumes from (ResourceSliceMaxDeviceCounterConsumptionsPerDevice)
MAX_DEVICES = 64  # devices in a slice that uses counters or taints (ResourceSliceMaxDevicesWithAdvancedFeatures)
MAX_ATTR_VALUE = 64  # DeviceAttributeMaxValueLength
MAX_NAME = 63  # a device name is a DNS label
_LABEL = re.compile(r"[^a-z0-9-]+")
_RATE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*Gb/sec")


@dataclass(frozen=True)
class NicView:
    """One NIC as the driver publishes it: sysfs facts, health, topology and the GID of the env's family."""

    nic: Nic
    health: NicHealth
    resource: str  # the resource that owns it (first selecting one, config order)
    pcie_root: str = ""  # "pci0000:15" (the host bridge: KEP-4381's resource.kubernetes.io/pcieRoot)
    switch_gpus: tuple[str, ...] = ()  # GPUs under the NIC's PCIe switch (PCI addresses)
    gid: str = ""  # the RoCE v2 GID NCCL uses (node's env family), "" for InfiniBand or none suitable
    gid_index: int | None = None
    gid_family: str = ""


@dataclass(frozen=True)
class ResourceView:
    name: str  # rdma/hca
    budget: int  # sharedDevices: claims that share one device
    policy: str  # health.policy: all | any
    numa_pools: bool = False  # also a set per NUMA node (<name>-numa<N>), shared mode


@dataclass(frozen=True)
class DeviceRef:
    """What a published device stands for: the view and the NICs (by RDMA device name) it hands out."""

    name: str
    view: str  # SHARED | EXCLUSIVE | SET
    nics: tuple[str, ...]
    resource: str


@dataclass
class Published:
    """The pool's two slice specs and the index prepare uses."""

    counters: dict[str, Any] | None  # None on a node without NICs: the pool is one empty devices slice
    devices: dict[str, Any]
    refs: dict[str, DeviceRef] = field(default_factory=dict)
    health: dict[str, tuple[bool, str]] = field(default_factory=dict)  # device -> (healthy, why)
    more_devices: list[dict[str, Any]] = field(default_factory=list)  # beyond MAX_DEVICES: slices devices-1, ...

    def specs(self) -> dict[str, dict[str, Any]]:
        out = {DEVICES_SLICE: self.devices}
        out.update({f"{DEVICES_SLICE}-{i}": spec for i, spec in enumerate(self.more_devices, 1)})
        if self.counters is not None:
            out[COUNTERS_SLICE] = self.counters
        return out

    def all_devices(self) -> list[dict[str, Any]]:
        return [d for spec in (self.devices, *self.more_devices) for d in spec["devices"]]


def dns_label(name: str) -> str:
    """A kernel name as a DNS label (``mlx5_bond_0`` -> ``mlx5-bond-0``): the API refuses ``_``."""
    return _LABEL.sub("-", name.lower()).strip("-")[:60].strip("-")


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "backslashreplace")).hexdigest()[:8]


def nic_key(nic: Nic) -> str:
    """What names a NIC's devices: its PCI address, else its node GUID, else its RDMA device name."""
    if nic.pci_address:
        return nic.pci_address
    return f"guid-{nic.node_guid}" if nic.node_guid else nic.name


def device_names(nics: Mapping[str, str], reserved: Sequence[str] = ()) -> dict[str, str]:
    """RDMA device name -> device name, from each NIC's key (:func:`nic_key`), unique and valid: a key
    that collides (``mlx5_0`` and ``MLX5-0`` without PCI addresses) or makes no label (a non-UTF-8
    ``\\xNN`` name) gets a hash of the key."""
    taken = set(reserved)
    out: dict[str, str] = {}
    for name, key in sorted(nics.items(), key=lambda nk: (nk[1] != nk[1].lower(), nk[1])):  # lowercase wins
        label = dns_label(key)
        if not label or label in taken or label + EXCLUSIVE_SUFFIX in taken or label.endswith(EXCLUSIVE_SUFFIX):
            label = f"{label[:50]}-{_digest(key)}".strip("-") if label else f"nic-{_digest(key)}"
        taken.update((label, label + EXCLUSIVE_SUFFIX))
        out[name] = label
    return out


def set_device_name(resource: str, taken: Sequence[str] = ()) -> str:
    """``all-<short name>`` within a DNS label's 63 characters: a long or colliding one
    (``a.example.com/hca`` beside ``b.example.com/hca``) is cut and ends with a hash of the resource."""
    name = SET_PREFIX + dns_label(resource.split("/", 1)[-1])
    if len(name) > MAX_NAME or name in taken:
        name = f"{name[: MAX_NAME - 9].rstrip('-')}-{_digest(resource)}"
    return name


def rate_gbps(rate: str) -> float | None:
    """``"200 Gb/sec (4X HDR)"`` (the kernel's ``ports/<n>/rate``) -> 200.0."""
    m = _RATE.match(rate or "")
    return float(m.group(1)) if m else None


def taint_value(health: NicHealth) -> str:
    """Why, as a label value: ``gone``, ``no-ports``, ``port-down``, ``no-uverbs``."""
    if not health.present:
        return "gone"
    if not health.ports:
        return "no-ports"
    bad = [s for s in health.ports if s not in ("ACTIVE", "ACTIVE_DEFER")]
    if bad:
        return dns_label("port-" + bad[0])[:63] or "port-down"
    return "no-uverbs"


def _str(value: str) -> dict[str, str]:
    return {"string": value}


def _attrs(v: NicView) -> dict[str, Any]:
    nic = v.nic
    a: dict[str, Any] = {
        "rdmaDevice": _str(nic.name[:MAX_ATTR_VALUE]),
        "resource": _str(v.resource),
    }
    if nic.pci_address:
        a[PCI_BUS_ID] = _str(nic.pci_address)
    if v.pcie_root:
        a[PCIE_ROOT] = _str(v.pcie_root)
    if nic.numa_node is not None:
        a[NUMA_NODE] = {"int": nic.numa_node}
    netdev = nic.compute_netdevs[0] if nic.compute_netdevs else ""
    if netdev:
        a["netdev"] = _str(netdev[:MAX_ATTR_VALUE])
    if nic.ports:
        port = nic.ports[0]
        a["linkLayer"] = _str(port.link_layer)
        if port.rate:
            a["rate"] = _str(port.rate[:MAX_ATTR_VALUE])
        gbps = rate_gbps(port.rate)
        if gbps is not None:
            a["rateGbps"] = {"int": int(gbps)}
    if nic.fw_ver:
        a["firmware"] = _str(nic.fw_ver[:MAX_ATTR_VALUE])
    if nic.vendor:
        a["pciVendor"] = _str(nic.vendor)
    if nic.device_id:
        a["pciDevice"] = _str(nic.device_id)
    if v.gid:
        a["gid"] = _str(v.gid)
        a["gidFamily"] = _str(v.gid_family)
        if v.gid_index is not None:
            a["gidIndex"] = {"int": v.gid_index}
    a["switchGpuCount"] = {"int": len(v.switch_gpus)}
    gpus = ",".join(v.switch_gpus)
    if len(gpus) > MAX_ATTR_VALUE:  # the PCI domain is the same on every GPU of a node: leave it out
        gpus = ",".join(g.split(":", 1)[-1] for g in v.switch_gpus)
    if v.switch_gpus and len(gpus) <= MAX_ATTR_VALUE:
        a["switchGpus"] = _str(gpus)
    return a


def _taints(healthy: bool, why: str, since: str) -> list[dict[str, str]]:
    if healthy:
        return []
    return [{"key": "rdma.lingjun.io/unhealthy", "value": why, "effect": "NoSchedule", "timeAdded": since}]


def build(
    driver: str,
    node: str,
    mode: str,
    resources: Sequence[ResourceView],
    nics: Sequence[NicView],
    since: Mapping[str, str],
    generation: int = 1,
) -> Published:
    """The pool's slices. ``since``: RDMA device name -> when it became unhealthy (taint timeAdded,
    RFC 3339), so a republish keeps it. ``mode``: which view serves the extended resource."""
    too_long = [r.name for r in resources if len(r.name) > MAX_ATTR_VALUE]
    if too_long:
        raise ValueError(
            f"resource name(s) {too_long} longer than {MAX_ATTR_VALUE} characters: the DRA attributes that name "
            f"a device's resource (resource, extendedResource) hold at most {MAX_ATTR_VALUE}; "
            "give the resource (resources[].name) a shorter name to serve it through DRA"
        )
    by_name = {v.nic.name: v for v in nics}
    budgets = {r.name: r.budget for r in resources}
    # The set devices: per resource every NIC of it, and with numaPools (shared mode) the NICs of each
    # NUMA node (extended resource <name>-numa<N>): (device name, extended resource, resource, members).
    sets: list[tuple[str, str, ResourceView, list[str]]] = []
    for r in resources:
        members = sorted(n for n, v in by_name.items() if v.resource == r.name)
        if not members:
            continue
        sets.append((set_device_name(r.name, [s[0] for s in sets]), r.name, r, members))
        nodes = {m for n in members if (m := by_name[n].nic.numa_node) is not None and m >= 0}
        for node_of in sorted(nodes) if r.numa_pools and mode == "shared" else ():
            local = [n for n in members if by_name[n].nic.numa_node == node_of]
            extended = numa_resource_name(r.name, node_of)
            if len(extended) > MAX_ATTR_VALUE:
                raise ValueError(
                    f"numaPools of resource {r.name}: {extended} is longer than {MAX_ATTR_VALUE} characters (a "
                    "DRA attribute value); give the resource a shorter name to serve its NUMA pools through DRA"
                )
            sets.append((set_device_name(extended, [s[0] for s in sets]), extended, r, local))
    in_sets = {n: sum(1 for s in sets if n in s[3]) for n in by_name}
    names = device_names({n: nic_key(v.nic) for n, v in by_name.items()}, reserved=[s[0] for s in sets])
    counter_set = counter_sets(
        node, [r.name for r in resources], {n: (v.resource, names[n]) for n, v in by_name.items()}
    )
    devices: list[dict[str, Any]] = []
    refs: dict[str, DeviceRef] = {}
    health: dict[str, tuple[bool, str]] = {}
    counters: dict[str, int] = {}
    for name in sorted(by_name, key=lambda n: names[n]):  # by device name: a rename moves nothing
        v = by_name[name]
        label = names[name]
        healthy = v.health.healthy
        why = "" if healthy else taint_value(v.health)
        taints = _taints(healthy, why, since.get(name, ""))
        shares = 1 + in_sets[name]  # its shared view, and the sets that hold it
        counters[label] = shares
        attrs = _attrs(v)
        gbps = rate_gbps(v.nic.ports[0].rate) if v.nic.ports else None
        budget = budgets.get(v.resource, 1)
        capacity: dict[str, Any] = {
            SLOTS: {
                "value": str(budget),
                "requestPolicy": {"default": "1", "validRange": {"min": "1", "max": str(budget)}},
            }
        }
        if gbps:
            bw = f"{int(gbps * 1000)}M"  # bit/s; each claim takes none unless it asks some
            capacity[BANDWIDTH] = {
                "value": bw,
                "requestPolicy": {"default": "0", "validRange": {"min": "0", "max": bw}},
            }
        shared = {
            "name": label,
            "allowMultipleAllocations": True,
            "attributes": {**attrs, "sharing": _str(SHARED)},
            "capacity": capacity,
            "consumesCounters": [{"counterSet": counter_set[name], "counters": {label: {"value": "1"}}}],
        }
        x_attrs = {**attrs, "sharing": _str(EXCLUSIVE)}
        if mode == "exclusive":
            x_attrs["extendedResource"] = _str(v.resource)
        exclusive: dict[str, Any] = {
            "name": label + EXCLUSIVE_SUFFIX,
            "attributes": x_attrs,
            "consumesCounters": [{"counterSet": counter_set[name], "counters": {label: {"value": str(shares)}}}],
        }
        if gbps:
            exclusive["capacity"] = {BANDWIDTH: {"value": f"{int(gbps * 1000)}M"}}
        for d, view in ((shared, SHARED), (exclusive, EXCLUSIVE)):
            if taints:
                d["taints"] = taints
            devices.append(d)
            dname = label + (EXCLUSIVE_SUFFIX if view == EXCLUSIVE else "")
            refs[dname] = DeviceRef(dname, view, (name,), v.resource)
            health[dname] = (healthy, v.health.why)
    for set_name, extended, r, members in sets:
        usable = [by_name[n].health.healthy for n in members]
        healthy = all(usable) if r.policy == "all" else any(usable)
        bad = [n for n in members if not by_name[n].health.healthy]
        why = "" if healthy else f"{', '.join(bad)}: " + "; ".join(by_name[n].health.why for n in bad)
        attrs = {"resource": _str(r.name), "sharing": _str(SET), "nicCount": {"int": len(members)}}
        if mode == "shared":
            attrs["extendedResource"] = _str(extended)
        numa = sorted({numa_of for n in members if (numa_of := by_name[n].nic.numa_node) is not None})
        if len(numa) == 1:
            attrs[NUMA_NODE] = {"int": numa[0]}
        device: dict[str, Any] = {
            "name": set_name,
            "allowMultipleAllocations": True,
            "attributes": attrs,
            "capacity": {
                SLOTS: {
                    "value": str(r.budget),
                    "requestPolicy": {"default": "1", "validRange": {"min": "1", "max": str(r.budget)}},
                }
            },
            "consumesCounters": [
                {
                    "counterSet": cs,
                    "counters": {
                        names[n]: {"value": "1"}
                        for n in sorted(members, key=lambda m: names[m])
                        if counter_set[n] == cs
                    },
                }
                for cs in sorted({counter_set[n] for n in members}, key=_set_order)
            ],
        }
        if not healthy:
            first = min((since.get(n, "") for n in bad), default="")
            device["taints"] = _taints(
                False, "nics-unhealthy" if len(bad) > 1 else taint_value(by_name[bad[0]].health), first
            )
        devices.append(device)
        refs[set_name] = DeviceRef(set_name, SET, tuple(members), r.name)
        health[set_name] = (healthy, why)
    # MAX_DEVICES per slice: more go to more slices of the pool (a NIC's two views stay in one).
    chunks = [devices[i : i + MAX_DEVICES] for i in range(0, len(devices), MAX_DEVICES)] or [[]]
    pool = {"name": node, "generation": generation, "resourceSliceCount": len(chunks) + (1 if counters else 0)}
    common = {"driver": driver, "nodeName": node, "pool": pool}
    counters_spec = None
    if counters:
        by_set: dict[str, dict[str, Any]] = {}
        for name in sorted(by_name, key=lambda n: names[n]):
            by_set.setdefault(counter_set[name], {})[names[name]] = {"value": str(counters[names[name]])}
        shared_counters = [{"name": cs, "counters": by_set[cs]} for cs in sorted(by_set, key=_set_order)]
        counters_spec = {**common, "sharedCounters": shared_counters}
    return Published(
        counters_spec, {**common, "devices": chunks[0]}, refs, health, [{**common, "devices": c} for c in chunks[1:]]
    )


def _set_order(name: str) -> int:
    return int(name.rsplit("-", 1)[1]) if "-" in name else 0


def counter_sets(node: str, resources: Sequence[str], nics: Mapping[str, tuple[str, str]]) -> dict[str, str]:
    """RDMA device name -> the counter set that holds its NIC's counter (``nics``: name -> (resource,
    device name)). Up to MAX_NICS NICs share one set; more take a set per MAX_NICS NICs of each resource
    (``nics``, ``nics-1``, ...), so a resource's set device consumes from at most
    MAX_CONSUMPTIONS of them. Beyond the API's limits: a ValueError that says which."""
    if len(nics) <= MAX_NICS:
        return {n: COUNTER_SET for n in nics}
    out: dict[str, str] = {}
    index = 0
    for r in resources:
        members = sorted((label, n) for n, (owner, label) in nics.items() if owner == r)
        if len(members) > MAX_NICS * MAX_CONSUMPTIONS:
            raise ValueError(
                f"{len(members)} NICs of resource {r} on node {node}: its all-NICs device can count at most "
                f"{MAX_NICS * MAX_CONSUMPTIONS} ({MAX_CONSUMPTIONS} counter sets of {MAX_NICS}); "
                "split them between resources (selectors)"
            )
        for i in range(0, len(members), MAX_NICS):
            for _, n in members[i : i + MAX_NICS]:
                out[n] = COUNTER_SET if index == 0 else f"{COUNTER_SET}-{index}"
            index += 1
    if index > MAX_COUNTER_SETS:
        raise ValueError(
            f"{len(nics)} NICs selected on node {node} need {index} counter sets, a pool holds at most "
            f"{MAX_COUNTER_SETS} ({MAX_NICS} NICs each, per resource); narrow the resources' selectors"
        )
    return out
