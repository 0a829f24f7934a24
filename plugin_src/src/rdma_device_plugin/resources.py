"""Resource pools: which devices a resource advertises, their health, and what Allocate hands out.

Pure logic, no I/O: a pool is fed NIC lists (from discovery) and port states (from the
health probe) and answers with device lists and allocations. The gRPC layer and the
supervisor call it; tests drive it directly.

Shared mode: a pool is ``sharedDevices`` virtual devices over every selected NIC; a pod
that gets any of them gets the char devices of every NIC in the pool. With ``numaPools`` a resource
also makes per-NUMA pools (devices carrying their node, that node's NICs) and a ``-local`` pool
(devices per node; a pod gets the NICs of its devices' nodes): :mod:`.numa_pools`.
Exclusive mode: a pool has one device per NIC, ID = the NIC's PCI address, with its NUMA
node as topology; a pod gets only the NICs it was given.

Every answer carries the env NCCL and UCX read for exactly its NICs (:mod:`.nccl_env`): each NIC's
GID facts are read when the NICs change (a re-list), and the answer for a NIC set is built once and
kept until they change again (shared pools build theirs right away), so Allocate only looks it up.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from . import cdi, nccl_env, netchecks
from .config import PluginConfig, ResourceConfig
from .health import Hold, NicHealth
from .kubeletapi import HEALTHY, UNHEALTHY
from .nccl_env import NicFacts, WorkloadEnv
from .node.selectors import Selectors
from .node.sysfs import Nic
from .numa_pools import LOCAL, PoolSpec, pool_specs
from .supervision import LogOnce

LOG = logging.getLogger(__name__)
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
    # The pool's allocations_version it was built under: whoever caches something made from it
    # keys it by this, read with the answer (never after: a re-list may have come in between).
    generation: int = field(default=0, compare=False)


def _has_uverbs(nic: Nic) -> bool:
    return nic.uverbs is not None and nic.uverbs.present


def nic_identity(nic: Nic) -> str:
    """What makes a NIC the same NIC across renames: its PCI function, else its node GUID."""
    return nic.pci_address or f"guid:{nic.node_guid}"


class ResourcePool:
    """One advertised resource. Thread-safe: discovery, the health probe and gRPC calls share it.

    Interface: fed by :meth:`set_nics` (a discovery result) and :meth:`set_port_states` (a probe);
    read through :meth:`snapshot` (versioned device list), :meth:`allocate` and :meth:`preferred`;
    listeners (:meth:`add_listener`) hear of every device change, called outside the pool's lock.
    """

    def __init__(
        self, resource: ResourceConfig, config: PluginConfig, spec: PoolSpec | None = None, pool_count: int = 0
    ) -> None:
        self.spec = spec or PoolSpec(resource, resource.name)
        self.resource = resource
        self.name = resource.name
        self.mode = config.mode
        self.policy = config.health.policy
        self.selectors: Selectors = resource.selectors.to_selectors()
        self.extra_env = dict(config.env)
        self.non_host_network = config.non_host_network.enabled
        if config.non_host_network.enabled:
            self.extra_env.update(config.non_host_network.env)
        pools = max(pool_count, len(config.resources))  # numaPools: every pool its own kind
        self.cdi_kind = cdi.resource_kind(config.cdi.kind, resource.name, pools) if config.cdi.enabled else None
        self.env_settings = nccl_env.EnvSettings.from_config(config)
        self.with_umad = config.char_devices.umad
        self.with_issm = config.char_devices.issm
        self._lock = threading.Lock()
        self._nics: dict[str, Nic] = {}  # present and selected, by identity (nic_identity)
        self._seen: dict[str, Nic] = {}  # every NIC selected (a vanished one stays, unhealthy, for the grace)
        self._health: dict[str, NicHealth] = {}
        self._gone_since: dict[str, float] = {}
        self.vanish_grace = config.health.vanish_grace_seconds
        self._version = 0
        self._devices: tuple[Device, ...] = ()
        self._device_ids: frozenset[str] = frozenset()  # derived from _devices, for Allocate
        # What Allocate hands out, by allocation_key: built once per NIC set and dropped when it
        # changes (shared mode: one entry for every pod).
        self._allocations: dict[tuple[str, ...], ContainerAllocation] = {}
        # Bumped whenever those cached allocations are dropped (the NICs changed): whoever caches
        # something built from them (the gRPC answers) drops it too.
        self.allocations_version = 0
        self._closed = False
        self._listeners: list[Callable[[], None]] = []  # called, outside the lock, when devices change
        ids = self.spec.devices() if self.mode == "shared" else ()
        self._shared_ids = tuple(i for i, _ in ids)
        self._numa_of = {i: n for i, n in ids}  # device ID -> its NUMA node (per-NUMA and -local pools)
        # Shared mode: the device list is all Healthy or all Unhealthy (a -local pool: per node), so
        # each is built once (a flip of a 100k pool is then a pick, not 100k new devices:
        # bench/bench_listandwatch.py).
        self._shared_lists: dict[object, tuple[Device, ...]] = {}
        self._facts: dict[str, NicFacts] = {}  # by identity: each present NIC's GID facts (nccl_env)
        self._env: tuple[tuple[str, WorkloadEnv], ...] = ()  # (scope, env) of the pool's NICs: status, metrics
        self._said = LogOnce(LOG)  # a variable left unset: said once while it stays so
        self._probe_failure: str | None = None  # why no port can be vouched for (the probe keeps failing)
        self._held: dict[str, Hold] = {}  # NICs held down after flapping (health.FlapDamping), by identity

    # ------------------------------------------------------------------ inputs

    def set_nics(self, nics: Iterable[Nic], now: float | None = None) -> bool:
        """Apply a discovery result; returns True when the advertised devices changed.

        NICs are tracked by identity (PCI function, else node GUID), not by RDMA device name: a
        NIC renamed in place (udev rule, LAG re-formation) is the same device under its new
        name. A NIC gone for longer than health.vanishGraceSeconds leaves the pool.
        """
        now = time.monotonic() if now is None else now
        selected = {nic_identity(n): n for n in self.spec.nics(self.selectors.select(nics))}
        with self._lock:
            relisted = selected != self._nics  # a re-list that finds the same NICs keeps the answers
            if relisted:
                self._allocations.clear()  # names, char devices or GIDs changed
                self.allocations_version += 1
            self._nics = selected
            for key, nic in selected.items():
                old = self._seen.get(key)
                if old is not None and old.name != nic.name:
                    LOG.info("NIC %s (%s) is now named %s", old.name, key, nic.name, extra={"resource": self.name})
                self._seen[key] = nic
                self._gone_since.pop(key, None)
                self._health[key] = NicHealth(True, tuple(p.state for p in nic.ports), _has_uverbs(nic))
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
            if relisted:
                self._relisted()
            changed = self._recompute()
        return self._notify(changed)

    def _relisted(self) -> None:
        """The NICs changed (under the lock): read their GID facts, build the answers of a shared pool
        now rather than at the first Allocate, and say once what its env leaves unset."""
        self._facts = {key: nccl_env.nic_facts(nic, self.env_settings) for key, nic in self._nics.items()}
        if self.mode == "shared":
            for key in self._shared_keys():
                nics = self._nics_for(key)
                if any(_has_uverbs(n) for n in nics):
                    self._allocations[key] = self._allocation_of(nics)
        self._env = ()
        for scope, nics in self._env_scopes():
            found = nccl_env.workload_env(self._facts_of(nics), self.env_settings)
            full = self._pod_env(tuple(n.name for n in nics if _has_uverbs(n)), found.env)
            self._env += ((scope, replace(found, env=full)),)
        for scope, env in self._env:
            where = f"{self.name}{f' ({scope})' if scope else ''}"
            unset = {u.variable: u for u in env.unset}
            for variable in nccl_env.VARIABLES:
                if variable in unset:
                    extra: dict[str, object] = {
                        "resource": self.name,
                        "variable": variable,
                        "reason": unset[variable].reason,
                    }
                    self._said.problem(f"{scope} {variable}", "%s: %s", where, unset[variable].message(), extra=extra)
                elif variable in env.env:
                    self._said.cleared(f"{scope} {variable}", f"{where}: {variable}={env.env[variable]} set again")

    def _shared_keys(self) -> list[tuple[str, ...]]:
        """The allocation keys of a shared pool: one, or one per NUMA node of a -local pool."""
        if self.spec.kind == LOCAL:
            return [(str(n),) for n in sorted({n.numa_node for n in self._nics.values() if n.numa_node is not None})]
        return [()]

    def _nics_for(self, key: tuple[str, ...]) -> list[Nic]:
        """The present NICs an allocation key hands out (shared pools), by name."""
        nics = sorted(self._nics.values(), key=lambda n: n.name)
        if self.spec.kind == LOCAL:
            return [n for n in nics if str(n.numa_node) in key]
        return nics

    def _env_scopes(self) -> list[tuple[str, list[Nic]]]:
        """What the status shows a pod gets: the pool's NICs, or each NUMA node's of a -local pool."""
        if self.spec.kind == LOCAL:
            return [(f"numa{key[0]}", self._nics_for(key)) for key in self._shared_keys()]
        return [("", sorted(self._nics.values(), key=lambda n: n.name))] if self._nics else []

    def _facts_of(self, nics: Sequence[Nic]) -> list[NicFacts]:
        return [self._facts[nic_identity(n)] for n in nics if nic_identity(n) in self._facts]

    def set_port_states(self, states: dict[str, tuple[str, ...] | None]) -> bool:
        """Apply a health probe (RDMA device name -> port states, None when gone)."""
        with self._lock:
            by_name = {nic.name: key for key, nic in self._seen.items()}
            for name, ports in states.items():
                key = by_name.get(name)
                if key is not None:
                    present = ports is not None and key in self._nics
                    self._health[key] = NicHealth(present, ports or (), _has_uverbs(self._seen[key]))
            changed = self._recompute()
        return self._notify(changed)

    def health_changes(self, before: dict[str, NicHealth]) -> list[str]:
        """Human-readable lines for NICs whose health differs from ``before`` (a copy of health_state())."""
        out = []
        with self._lock:
            for key, health in sorted(self._health.items()):
                if before.get(key) != health and key not in self._held:  # a held NIC's flaps: see discovery
                    out.append(f"{self._seen[key].name} {health.describe()}")
            state = self._devices[0].health if self.mode == "shared" and self._devices else None
        if not out:
            return []
        effect = f"{self.name} {state} (policy {self.policy})" if state else f"{self.name} devices updated"
        return [f"{line}: {effect}" for line in out]

    def set_probe_failure(self, reason: str | None) -> bool:
        """The health probe has failed for too long (``reason``): every device is Unhealthy until
        it works again (None)."""
        with self._lock:
            self._probe_failure = reason
            changed = self._recompute()
        return self._notify(changed)

    def set_held(self, held: Mapping[str, Hold]) -> bool:
        """The NICs held down after flapping (by identity, node-wide): Unhealthy while held."""
        with self._lock:
            self._held = {key: hold for key, hold in held.items() if key in self._seen}
            changed = self._recompute()
        return self._notify(changed)

    def health_state(self) -> dict[str, NicHealth]:
        with self._lock:
            return dict(self._health)

    def close(self) -> None:
        """Wake every waiting stream so it can end (shutdown only)."""
        with self._lock:
            self._closed = True
        self._notify(True)

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

    def _usable(self, key: str) -> bool:
        health = self._health.get(key)
        return (
            self._probe_failure is None
            and key in self._nics
            and key not in self._held
            and health is not None
            and health.healthy
        )

    def _recompute(self) -> bool:
        """Derive the device list (under the lock); True when it changed."""
        if self.mode == "shared":
            devices = self._shared_devices()
        else:
            devices = tuple(
                Device(nic.pci_address, HEALTHY if self._usable(key) else UNHEALTHY, nic.numa_node)
                for key, nic in sorted(self._seen.items(), key=lambda kv: kv[1].pci_address)
            )
        if devices == self._devices:
            return False
        if self.mode != "shared" or not self._device_ids:  # shared IDs never change
            self._device_ids = frozenset(d.id for d in devices)
        self._devices = devices
        self._version += 1
        return True

    def _notify(self, changed: bool) -> bool:
        """Tell the listeners, outside the lock: one may take its time (a stream encodes the snapshot)."""
        if changed:
            with self._lock:
                listeners = list(self._listeners)
            for listener in listeners:
                listener()
        return changed

    def _health_of(self, keys: Sequence[str]) -> str:
        usable = [self._usable(key) for key in keys]
        ok = all(usable) if self.policy == "all" else any(usable)
        return HEALTHY if ok else UNHEALTHY

    def _shared_devices(self) -> tuple[Device, ...]:
        if not self._seen:
            return ()  # nothing selected on this node: advertise nothing rather than 1k of nothing
        if self.spec.kind == LOCAL:  # one block per NUMA node with NICs, each with its own health
            by_node: dict[int, list[str]] = {}
            for key, nic in self._seen.items():
                if nic.numa_node is not None:
                    by_node.setdefault(nic.numa_node, []).append(key)
            state = tuple(sorted((n, self._health_of(keys)) for n, keys in by_node.items()))
            devices = self._shared_lists.get(state)
            if devices is None:
                if len(self._shared_lists) >= 8:  # bounded: nodes x 2 health states come and go
                    self._shared_lists.clear()
                per_node = dict(state)
                devices = tuple(Device(i, per_node[n], n) for i, n in self._numa_of.items() if n in per_node)
                self._shared_lists[state] = devices
            return devices
        health = self._health_of(list(self._seen))
        found = self._shared_lists.get(health)
        if found is None:
            found = self._shared_lists[health] = tuple(Device(i, health, n) for i, n in self._numa_of.items())
        return found

    def snapshot(self) -> tuple[int, tuple[Device, ...]]:
        with self._lock:
            return self._version, self._devices

    def nic_names(self) -> dict[str, str]:
        """Identity -> RDMA device name of every NIC the pool knows."""
        with self._lock:
            return {key: nic.name for key, nic in self._seen.items()}

    def present_nics(self) -> list[Nic]:
        """Selected NICs currently on the node, by RDMA device name."""
        with self._lock:
            return sorted(self._nics.values(), key=lambda n: n.name)

    def nic_summary(self) -> list[dict[str, object]]:
        """Every NIC the pool has seen, by name: identity, presence, ports, health and why."""
        with self._lock:
            out: list[dict[str, object]] = []
            for key, nic in sorted(self._seen.items(), key=lambda kv: kv[1].name):
                health = self._health.get(key, NicHealth(False, ()))
                out.append(
                    {
                        "name": nic.name,
                        "pci_address": nic.pci_address,
                        "present": key in self._nics,
                        "ports": list(health.ports),
                        "healthy": self._usable(key),
                        "why": self._probe_failure or health.why or self._held_why(key),
                        "numa_node": nic.numa_node,
                        "gid": self._gid_shown(key),
                    }
                )
            return out

    def _held_why(self, key: str) -> str:
        hold = self._held.get(key)
        if hold is None:
            return ""
        left = max(0.0, hold.until - time.monotonic())
        return f"held down after {hold.flaps} flaps: Healthy in {left:.0f} s if it stays up (health.flapDamping)"

    def _gid_shown(self, key: str) -> str:
        """NCCL's GID on the NIC's first RoCE port for the family the pool's env uses ("" without)."""
        facts = self._facts.get(key)
        family = next((env.family for _, env in self._env if env.family), "")
        picks = facts.picks_for(family) if facts is not None and family else ()
        return picks[0].shown if picks else ""

    def workload_env(self) -> tuple[tuple[str, WorkloadEnv], ...]:
        """(scope, env) a pod gets from the pool's present NICs (its whole env, and what was left
        unset): one entry (scope ""), or one per NUMA node (``numa0`` ...) of a -local pool.
        Exclusive mode: a pod given every NIC."""
        with self._lock:
            return self._env

    # ------------------------------------------------------------------ Allocate

    def allocation_key(self, device_ids: Sequence[str]) -> tuple[str, ...]:
        """What an answer depends on: nothing in shared mode (every pod gets every NIC), the NUMA
        nodes of the IDs in a -local pool, the set of IDs in exclusive mode (sorted: the kubelet
        sends them in map order)."""
        if self.mode != "shared":
            return tuple(sorted(device_ids))
        if self.spec.kind == LOCAL:
            return tuple(sorted({str(self._numa_of.get(d)) for d in device_ids}))
        return ()

    def allocate(self, device_ids: Sequence[str]) -> ContainerAllocation:
        """What a container given ``device_ids`` receives: the same answer for the same set of IDs,
        whatever their order (exclusive NICs are handed out by PCI address)."""
        with self._lock:
            unknown = [d for d in device_ids if d not in self._device_ids]
            if unknown:
                raise AllocationError(f"unknown device ID(s) {unknown} for resource {self.name}")
            if not device_ids:
                raise AllocationError(f"empty device list for resource {self.name}")
            if len(set(device_ids)) != len(device_ids):
                dupes = sorted({d for d in device_ids if list(device_ids).count(d) > 1})
                raise AllocationError(f"device ID(s) {dupes} requested more than once for resource {self.name}")
            key = self.allocation_key(device_ids)
            cached = self._allocations.get(key)
            if cached is not None:
                return cached
            if self.mode == "shared":
                nics = self._nics_for(key)
            else:  # exclusive device IDs are PCI addresses, which are the NICs' identities
                gone = [d for d in key if d not in self._nics]
                if gone:
                    raise AllocationError(f"NIC(s) {gone} of resource {self.name} are no longer present")
                nics = [self._nics[d] for d in key]
            alloc = self._allocation_of(nics)
            if len(self._allocations) < 4096:  # bounded: a node has a handful of NICs
                self._allocations[key] = alloc
            return alloc

    def _allocation_of(self, nics: list[Nic]) -> ContainerAllocation:
        nics = [n for n in nics if _has_uverbs(n)]
        if not nics:
            raise AllocationError(f"no RDMA NIC of resource {self.name} is present on the node")
        return self._container_allocation(nics)

    def _container_allocation(self, nics: list[Nic]) -> ContainerAllocation:
        chars = [c for nic in nics for c in nic.char_devices(self.with_umad, self.with_issm)]
        specs = [DeviceSpec(c.node_path, c.node_path) for c in chars]
        specs.append(DeviceSpec(RDMA_CM_PATH, RDMA_CM_PATH))
        names = tuple(n.name for n in nics)
        envs = self._pod_env(names, nccl_env.workload_env(self._facts_of(nics), self.env_settings).env)
        if self.cdi_kind is not None:
            group = cdi.numa_group(nics) if self.spec.kind == LOCAL else None
            devices = cdi.allocation_devices(self.cdi_kind, self.mode, nics, group)
            return ContainerAllocation((), envs, names, devices, self.allocations_version)
        return ContainerAllocation(tuple(specs), envs, names, generation=self.allocations_version)

    def _pod_env(self, names: tuple[str, ...], computed: dict[str, str]) -> dict[str, str]:
        """A container's env, low to high: computed (workloadEnv), non-hostNetwork defaults, the
        config's env, RDMA_DEVICES."""
        defaults = netchecks.default_env() if self.non_host_network else {}
        return {**computed, **defaults, **self.extra_env, "RDMA_DEVICES": ",".join(names)}

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


def build_pools(config: PluginConfig, numa_nodes: Sequence[int] = ()) -> list[ResourcePool]:
    """Every pool of the config on a node with these NUMA nodes (numaPools makes per-node pools)."""
    specs = pool_specs(config, numa_nodes)
    return [ResourcePool(s.resource, config, s, len(specs)) for s in specs]
