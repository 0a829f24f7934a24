"""Resource pools: which devices a resource advertises, their health, and what Allocate hands out.

Pure logic, no I/O: a pool is fed NIC lists (from discovery) and port states (from the
health probe) and answers with device lists and allocations. The gRPC layer and the
supervisor call it; tests drive it directly.

Shared mode: a pool is ``sharedDevices`` virtual devices over every selected NIC; a pod
that gets any of them gets the char devices of every NIC in the pool.
Exclusive mode: a pool has one device per NIC, ID = the NIC's PCI address, with its NUMA
node as topology; a pod gets only the NICs it was given.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from . import cdi, netchecks
from .config import PluginConfig, ResourceConfig
from .node.selectors import Selectors
from .node.sysfs import ACTIVE_STATES, Nic

LOG = logging.getLogger(__name__)
HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"
RDMA_CM_PATH = "/dev/infiniband/rdma_cm"


class AllocationError(Exception):
    """Allocate cannot be answered (unknown device ID, no NIC present)."""


@dataclass(frozen=True)
class Device:
    id: str
    health: str
    numa_node: int | None = None


@dataclass(frozen=True)
class DeviceSpec:
    container_path: str
    host_path: str
    permissions: str = "rw"


@dataclass(frozen=True)
class ContainerAllocation:
    devices: tuple[DeviceSpec, ...]
    envs: dict[str, str]
    nics: tuple[str, ...]  # RDMA device names handed out
    cdi_devices: tuple[str, ...] = ()  # fully-qualified CDI names (cdi.enabled); then devices is empty


@dataclass(frozen=True)
class NicHealth:
    """What the health probe knows about one NIC the pool has seen."""

    present: bool
    ports: tuple[str, ...]  # port states; empty when gone

    @property
    def healthy(self) -> bool:
        return self.present and bool(self.ports) and all(s in ACTIVE_STATES for s in self.ports)


def nic_identity(nic: Nic) -> str:
    """What makes a NIC the same NIC across renames: its PCI function, else its node GUID."""
    return nic.pci_address or f"guid:{nic.node_guid}"


class ResourcePool:
    """One advertised resource. Thread-safe: discovery, the health probe and gRPC calls share it."""

    def __init__(self, resource: ResourceConfig, config: PluginConfig) -> None:
        self.resource = resource
        self.name = resource.name
        self.mode = config.mode
        self.policy = config.health.policy
        self.selectors: Selectors = resource.selectors.to_selectors()
        self.extra_env = dict(config.env)
        self.non_host_network = config.non_host_network.enabled
        if config.non_host_network.enabled:
            self.extra_env.update(config.non_host_network.env)
        self.cdi_kind = (
            cdi.resource_kind(config.cdi.kind, resource.name, len(config.resources)) if config.cdi.enabled else None
        )
        self.with_umad = config.char_devices.umad
        self.with_issm = config.char_devices.issm
        self._lock = threading.Condition()
        self._nics: dict[str, Nic] = {}  # present and selected, by identity (nic_identity)
        self._seen: dict[str, Nic] = {}  # every NIC selected (a vanished one stays, unhealthy, for the grace)
        self._health: dict[str, NicHealth] = {}
        self._gone_since: dict[str, float] = {}
        self.vanish_grace = config.health.vanish_grace_seconds
        self._version = 0
        self._devices: tuple[Device, ...] = ()
        self._device_ids: frozenset[str] = frozenset()  # derived from _devices, for Allocate
        self._shared_allocation: ContainerAllocation | None = None  # shared mode: the same for every pod
        # exclusive mode: one answer per requested ID list, derived once per NIC change
        self._exclusive_allocations: dict[tuple[str, ...], ContainerAllocation] = {}
        # Bumped whenever those cached allocations are dropped (the NICs changed): whoever caches
        # something built from them (the gRPC answers) drops it too.
        self.allocations_version = 0
        self._closed = False
        self._listeners: list[Callable[[], None]] = []  # called (under the lock) when devices change
        short = self.name.split("/", 1)[1]
        self._shared_ids = tuple(f"{short}-{i}" for i in range(resource.shared_devices))

    # ------------------------------------------------------------------ inputs

    def set_nics(self, nics: Iterable[Nic], now: float | None = None) -> bool:
        """Apply a discovery result; returns True when the advertised devices changed.

        NICs are tracked by identity (PCI function, else node GUID), not by RDMA device name: a
        NIC renamed in place (udev rule, LAG re-formation) is the same device under its new
        name. A NIC gone for longer than health.vanishGraceSeconds leaves the pool.
        """
        now = time.monotonic() if now is None else now
        selected = {nic_identity(n): n for n in self.selectors.select(nics)}
        with self._lock:
            if selected != self._nics:  # a re-list that finds the same NICs keeps the answers
                self._shared_allocation = None  # names or char devices changed
                self._exclusive_allocations.clear()
                self.allocations_version += 1
            self._nics = selected
            for key, nic in selected.items():
                old = self._seen.get(key)
                if old is not None and old.name != nic.name:
                    LOG.info("NIC %s (%s) is now named %s", old.name, key, nic.name, extra={"resource": self.name})
                self._seen[key] = nic
                self._gone_since.pop(key, None)
                self._health[key] = NicHealth(True, tuple(p.state for p in nic.ports))
            for key in set(self._seen) - set(selected):
                self._health[key] = NicHealth(False, ())
                since = self._gone_since.setdefault(key, now)
                if now - since >= self.vanish_grace:
                    gone = self._seen.pop(key)
                    del self._health[key], self._gone_since[key]
                    LOG.warning(
                        "NIC %s (%s) gone for %.0f s (health.vanishGraceSeconds): removed from %s",
                        gone.name,
                        key,
                        now - since,
                        self.name,
                        extra={"resource": self.name},
                    )
            return self._recompute()

    def set_port_states(self, states: dict[str, tuple[str, ...] | None]) -> bool:
        """Apply a health probe (RDMA device name -> port states, None when gone)."""
        with self._lock:
            by_name = {nic.name: key for key, nic in self._seen.items()}
            for name, ports in states.items():
                key = by_name.get(name)
                if key is not None:
                    self._health[key] = NicHealth(ports is not None, ports or ())
            return self._recompute()

    def health_changes(self, before: dict[str, NicHealth]) -> list[str]:
        """Human-readable lines for NICs whose health differs from ``before`` (a copy of health_state())."""
        out = []
        with self._lock:
            for key, health in sorted(self._health.items()):
                was = before.get(key)
                if was == health:
                    continue
                name = self._seen[key].name
                if not health.present:
                    what = "gone"
                else:
                    what = ", ".join(f"port {i} {state}" for i, state in enumerate(health.ports, 1)) or "no ports"
                out.append(f"{name} {what}")
            state = self._devices[0].health if self.mode == "shared" and self._devices else None
        if not out:
            return []
        effect = f"{self.name} {state} (policy {self.policy})" if state else f"{self.name} devices updated"
        return [f"{line}: {effect}" for line in out]

    def health_state(self) -> dict[str, NicHealth]:
        with self._lock:
            return dict(self._health)

    def close(self) -> None:
        """Wake every waiting stream so it can end (shutdown only)."""
        with self._lock:
            self._closed = True
            self._lock.notify_all()
            for listener in self._listeners:
                listener()

    @property
    def closed(self) -> bool:
        return self._closed

    def add_listener(self, listener: Callable[[], None]) -> None:
        with self._lock:
            self._listeners.append(listener)

    def remove_listener(self, listener: Callable[[], None]) -> None:
        with self._lock:
            if listener in self._listeners:
                self._listeners.remove(listener)

    # ------------------------------------------------------------------ state

    def _nic_usable(self, name: str) -> bool:
        nic = self._nics.get(name)
        health = self._health.get(name)
        return bool(
            nic is not None and health is not None and health.healthy and nic.uverbs is not None and nic.uverbs.present
        )

    def _recompute(self) -> bool:
        if self.mode == "shared":
            devices = self._shared_devices()
        else:
            devices = tuple(
                Device(nic.pci_address, HEALTHY if self._nic_usable(name) else UNHEALTHY, nic.numa_node)
                for name, nic in sorted(self._seen.items(), key=lambda kv: kv[1].pci_address)
            )
        if devices == self._devices:
            return False
        self._devices = devices
        self._device_ids = frozenset(d.id for d in devices)
        self._version += 1
        self._lock.notify_all()
        for listener in self._listeners:
            listener()
        return True

    def _shared_devices(self) -> tuple[Device, ...]:
        if not self._seen:
            return ()  # nothing selected on this node: advertise nothing rather than 1k of nothing
        usable = [self._nic_usable(name) for name in self._seen]
        ok = all(usable) if self.policy == "all" else any(usable)
        health = HEALTHY if ok else UNHEALTHY
        if self._devices and self._devices[0].health == health:
            return self._devices  # unchanged: no need to rebuild (and compare) every device at each probe
        return tuple(Device(i, health) for i in self._shared_ids)

    def snapshot(self) -> tuple[int, tuple[Device, ...]]:
        with self._lock:
            return self._version, self._devices

    def present_nics(self) -> list[Nic]:
        """Selected NICs currently on the node, by RDMA device name."""
        with self._lock:
            return sorted(self._nics.values(), key=lambda n: n.name)

    def nic_summary(self) -> list[dict[str, object]]:
        with self._lock:
            return [
                {
                    "name": nic.name,
                    "pci_address": nic.pci_address,
                    "present": key in self._nics,
                    "healthy": self._nic_usable(key),
                    "numa_node": nic.numa_node,
                }
                for key, nic in sorted(self._seen.items(), key=lambda kv: kv[1].name)
            ]

    # ------------------------------------------------------------------ Allocate

    def allocate(self, device_ids: Sequence[str]) -> ContainerAllocation:
        with self._lock:
            unknown = [d for d in device_ids if d not in self._device_ids]
            if unknown:
                raise AllocationError(f"unknown device ID(s) {unknown} for resource {self.name}")
            if not device_ids:
                raise AllocationError(f"empty device list for resource {self.name}")
            if len(set(device_ids)) != len(device_ids):
                dupes = sorted({d for d in device_ids if list(device_ids).count(d) > 1})
                raise AllocationError(f"device ID(s) {dupes} requested more than once for resource {self.name}")
            if self.mode == "shared":
                if self._shared_allocation is None:
                    self._shared_allocation = self._allocation_of(sorted(self._nics.values(), key=lambda n: n.name))
                return self._shared_allocation
            # Exclusive device IDs are PCI addresses, which are the NICs' identities.
            key = tuple(device_ids)
            cached = self._exclusive_allocations.get(key)
            if cached is not None:
                return cached
            gone = [d for d in device_ids if d not in self._nics]
            if gone:
                raise AllocationError(f"NIC(s) {gone} of resource {self.name} are no longer present")
            alloc = self._allocation_of([self._nics[d] for d in device_ids])
            if len(self._exclusive_allocations) < 4096:  # bounded: a node has a handful of NICs
                self._exclusive_allocations[key] = alloc
            return alloc

    def _allocation_of(self, nics: list[Nic]) -> ContainerAllocation:
        nics = [n for n in nics if n.uverbs is not None and n.uverbs.present]
        if not nics:
            raise AllocationError(f"no RDMA NIC of resource {self.name} is present on the node")
        return self._container_allocation(nics)

    def _container_allocation(self, nics: list[Nic]) -> ContainerAllocation:
        chars = [c for nic in nics for c in nic.char_devices(self.with_umad, self.with_issm)]
        specs = [DeviceSpec(c.node_path, c.node_path) for c in chars]
        specs.append(DeviceSpec(RDMA_CM_PATH, RDMA_CM_PATH))
        names = tuple(n.name for n in nics)
        defaults = netchecks.default_env(names) if self.non_host_network else {}
        envs = {**defaults, **self.extra_env, "RDMA_DEVICES": ",".join(names)}
        if self.cdi_kind is not None:
            return ContainerAllocation((), envs, names, cdi.allocation_devices(self.cdi_kind, self.mode, nics))
        return ContainerAllocation(tuple(specs), envs, names)

    # ------------------------------------------------------------------ preferred allocation

    def preferred(self, available: Sequence[str], must_include: Sequence[str], size: int) -> list[str]:
        """Exclusive mode: must_include first, then NICs that keep the pod on the fewest NUMA nodes."""
        with self._lock:
            numa = {d.id: d.numa_node for d in self._devices}
        return preferred_allocation(available, must_include, size, numa)


def preferred_allocation(
    available: Sequence[str], must_include: Sequence[str], size: int, numa: dict[str, int | None]
) -> list[str]:
    """Pick ``size`` IDs from ``available``: every must_include ID first, then the fewest NUMA nodes.

    NUMA nodes already used by must_include are filled first; then, if one NUMA node can hold
    the rest, the smallest such node (best fit, keeping big nodes free for big pods); otherwise
    the nodes with the most free NICs. NICs without NUMA affinity come last. Ties break on NUMA
    ID then device ID, so the answer is deterministic. Never returns an ID outside ``available``.
    """
    avail = list(dict.fromkeys(available))
    avail_set = set(avail)
    chosen = [d for d in dict.fromkeys(must_include) if d in avail_set][: max(size, 0)]
    need = size - len(chosen)
    if need <= 0:
        return chosen
    free = sorted(d for d in avail if d not in set(chosen))
    groups: dict[int | None, list[str]] = {}
    for d in free:
        groups.setdefault(numa.get(d), []).append(d)
    used = {numa.get(d) for d in chosen}
    for n in sorted(n for n in groups if n in used and n is not None):
        take = groups[n][:need]
        chosen += take
        need -= len(take)
    others = [n for n in groups if n not in used and n is not None]
    while need > 0 and others:
        fits = [n for n in others if len(groups[n]) >= need]
        pick = min(fits, key=lambda n: (len(groups[n]), n)) if fits else max(others, key=lambda n: (len(groups[n]), -n))
        others.remove(pick)
        take = groups[pick][:need]
        chosen += take
        need -= len(take)
    if need > 0:
        chosen += groups.get(None, [])[:need]
    return chosen


def build_pools(config: PluginConfig) -> list[ResourcePool]:
    return [ResourcePool(r, config) for r in config.resources]
