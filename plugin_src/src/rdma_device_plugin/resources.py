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

A pool's NICs, their health and GID facts are kept by the node inventory's
:class:`.inventory.NicStates` (the DRA driver keeps its NICs there too), and what a container given
NICs gets is the inventory's :class:`.inventory.ContainerRules`: one answer for both APIs.

One owner: a :class:`ResourcePool` is changed on one thread only (the supervisor's), with no lock.
After every change it publishes a :class:`PoolView`, an immutable picture of itself (devices, the
ListAndWatch message already serialized, NICs, health and why, the env a pod gets, the answers of
its NIC set), by replacing one reference. Every other reader (gRPC handlers on the gRPC loop, the
status-file and metrics threads) reads ``pool.view`` once and works on that object only, so an
answer is always computed from the state it describes and nothing waits for a re-list.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any

from rdma_node.selectors import Selectors
from rdma_node.sysfs import Nic

from . import cdi, nccl_env
from .api import deviceplugin_pb2 as pb
from .config import PluginConfig, ResourceConfig
from .health import Hold, NicHealth
from .inventory import RDMA_CM_PATH, ContainerRules, DeviceSpec, NicStates, facts_of, has_uverbs, nic_identity
from .kubeletapi import HEALTHY, UNHEALTHY
from .nccl_env import NicFacts, WorkloadEnv
from .numa_pools import LOCAL, PoolSpec, pool_specs
from .supervision import LogOnce

LOG = logging.getLogger(__name__)
__all__ = ["RDMA_CM_PATH", "DeviceSpec", "facts_of", "nic_identity"]  # the inventory's, named here as before


class AllocationError(Exception):
    """Allocate cannot be answered (unknown device ID, no NIC present)."""


@dataclass(frozen=True)
class Device:
    id: str
    health: str
    numa_node: int | None = None


@dataclass(frozen=True)
class ContainerAllocation:
    devices: tuple[DeviceSpec, ...]
    envs: dict[str, str]
    nics: tuple[str, ...]  # RDMA device names handed out
    cdi_devices: tuple[str, ...] = ()  # fully-qualified CDI names (cdi.enabled); then devices is empty


@dataclass(frozen=True)
class Rules:
    """What a pool hands out, fixed by the config at start: pure, shared by its owner and its readers."""

    name: str
    mode: str
    kind: str  # numa_pools: WHOLE, NUMA or LOCAL
    numa_of: Mapping[str, int | None]  # shared device ID -> its NUMA node
    container: ContainerRules  # the char devices and env a container given NICs gets
    cdi_kind: str | None

    @property
    def env_settings(self) -> nccl_env.EnvSettings:
        return self.container.env_settings

    def key(self, device_ids: Sequence[str]) -> tuple[str, ...]:
        """What an answer depends on: nothing in shared mode (every pod gets every NIC), the NUMA
        nodes of the IDs in a -local pool, the set of IDs in exclusive mode (sorted: the kubelet
        sends them in map order)."""
        if self.mode != "shared":
            return tuple(sorted(device_ids))
        if self.kind == LOCAL:
            return tuple(sorted({str(self.numa_of.get(d)) for d in device_ids}))
        return ()

    def shared_keys(self, nics: Mapping[str, Nic]) -> list[tuple[str, ...]]:
        """The allocation keys of a shared pool: one, or one per NUMA node of a -local pool."""
        if self.kind == LOCAL:
            return [(str(n),) for n in sorted({n.numa_node for n in nics.values() if n.numa_node is not None})]
        return [()]

    def nics_for(self, key: tuple[str, ...], nics: Mapping[str, Nic]) -> list[Nic]:
        """The present NICs an allocation key hands out (shared pools), by name."""
        ordered = sorted(nics.values(), key=lambda n: n.name)
        if self.kind == LOCAL:
            return [n for n in ordered if str(n.numa_node) in key]
        return ordered

    def allocation(self, nics: Sequence[Nic], facts: Mapping[str, NicFacts]) -> ContainerAllocation:
        nics = [n for n in nics if has_uverbs(n)]
        if not nics:
            raise AllocationError(f"no RDMA NIC of resource {self.name} is present on the node")
        names = tuple(n.name for n in nics)
        envs = self.container.env(nics, facts)
        if self.cdi_kind is not None:
            group = cdi.numa_group(nics) if self.kind == LOCAL else None
            return ContainerAllocation((), envs, names, cdi.allocation_devices(self.cdi_kind, self.mode, nics, group))
        return ContainerAllocation(tuple(self.container.device_specs(nics)), envs, names)


@dataclass(frozen=True, eq=False)
class PoolView:
    """A pool at one moment, for every reader off the owner's thread; never changes once published.

    ``answers`` and ``responses`` belong to its NIC set (views of one NIC set share them): the
    owner builds a shared pool's answers before publishing and never touches them again; readers
    add the answers of exclusive device sets (``answers``) and the gRPC layer its serialized
    responses (``responses``), on the gRPC loop only."""

    rules: Rules
    version: int  # bumped when the device list changes (the streams send on a new version)
    nic_set: int  # bumped when a re-list changes the NICs (their names, facts and answers)
    devices: tuple[Device, ...]
    device_ids: frozenset[str]
    message: bytes  # the ListAndWatchResponse of ``devices`` on the wire
    healthy: int
    nics: Mapping[str, Nic]  # present and selected, by identity
    facts: Mapping[str, NicFacts]  # their GID facts, by identity
    answers: dict[tuple[str, ...], ContainerAllocation]
    responses: dict[Any, Any]
    summary: tuple[Mapping[str, object], ...]  # every NIC the pool knows: presence, ports, health, why
    env: tuple[tuple[str, WorkloadEnv], ...]  # (scope, env) a pod gets from the present NICs
    closed: bool = False

    @property
    def name(self) -> str:
        return self.rules.name

    @property
    def mode(self) -> str:
        return self.rules.mode

    def present_nics(self) -> list[Nic]:
        """Selected NICs on the node, by RDMA device name."""
        return sorted(self.nics.values(), key=lambda n: n.name)

    def allocate(self, device_ids: Sequence[str]) -> ContainerAllocation:
        """What a container given ``device_ids`` receives: the same answer for the same set of IDs,
        whatever their order (exclusive NICs are handed out by PCI address)."""
        unknown = [d for d in device_ids if d not in self.device_ids]
        if unknown:
            raise AllocationError(f"unknown device ID(s) {unknown} for resource {self.name}")
        if not device_ids:
            raise AllocationError(f"empty device list for resource {self.name}")
        if len(set(device_ids)) != len(device_ids):
            dupes = sorted({d for d in device_ids if list(device_ids).count(d) > 1})
            raise AllocationError(f"device ID(s) {dupes} requested more than once for resource {self.name}")
        key = self.rules.key(device_ids)
        cached = self.answers.get(key)
        if cached is not None:
            return cached
        if self.mode == "shared":
            nics = self.rules.nics_for(key, self.nics)
        else:  # exclusive device IDs are PCI addresses, which are the NICs' identities
            gone = [d for d in key if d not in self.nics]
            if gone:
                raise AllocationError(f"NIC(s) {gone} of resource {self.name} are no longer present")
            nics = [self.nics[d] for d in key]
        alloc = self.rules.allocation(nics, self.facts)
        if len(self.answers) < 4096:  # bounded: a node has a handful of NICs
            self.answers[key] = alloc
        return alloc

    def preferred(self, available: Sequence[str], must_include: Sequence[str], size: int) -> list[str]:
        """Exclusive mode: must_include first, then NICs that keep the pod on the fewest NUMA nodes."""
        numa = {d.id: d.numa_node for d in self.devices}
        return preferred_allocation(available, must_include, size, numa)


def encode_devices(devices: Sequence[Device]) -> bytes:
    """A ListAndWatchResponse on the wire."""
    msg = pb.ListAndWatchResponse()
    for device in devices:
        entry = msg.devices.add(ID=device.id, health=device.health)
        if device.numa_node is not None:
            entry.topology.nodes.add(ID=device.numa_node)
    data: bytes = msg.SerializeToString()
    return data


class ResourcePool:
    """One advertised resource, changed by its owner only (the supervisor's thread: no lock).

    Interface: fed by :meth:`set_nics` (a discovery result), :meth:`set_port_states` (a probe),
    :meth:`set_held` (flap damping) and :meth:`set_probe_failure`; every change publishes a new
    :attr:`view` (module doc), then tells the listeners (:meth:`add_listener`). The read methods
    below read the view, so they are safe from any thread.
    """

    def __init__(
        self, resource: ResourceConfig, config: PluginConfig, spec: PoolSpec | None = None, pool_count: int = 0
    ) -> None:
        self.spec = spec or PoolSpec(resource, resource.name)
        self.resource = resource
        self.name = resource.name
        self.mode = config.mode
        self.policy = config.health.policy
        self.selectors: Selectors = Selectors.of(resource.selectors)
        pools = max(pool_count, len(config.resources))  # numaPools: every pool its own kind
        ids = self.spec.devices() if self.mode == "shared" else ()
        self.rules = Rules(
            name=self.name,
            mode=self.mode,
            kind=self.spec.kind,
            numa_of=MappingProxyType(dict(ids)),
            container=ContainerRules.from_config(config),
            cdi_kind=cdi.resource_kind(config.cdi.kind, resource.name, pools) if config.cdi.enabled else None,
        )
        self.cdi_kind = self.rules.cdi_kind
        # The selected NICs (present, seen, health, GID facts): the node inventory's, one per pool.
        self._state = NicStates(self.name, config.health.vanish_grace_seconds, self.rules.env_settings, LOG)
        self._version = 0
        self._devices: tuple[Device, ...] = ()
        self._device_ids: frozenset[str] = frozenset()
        # What Allocate hands out, by allocation key, and the gRPC layer's responses: one pair of
        # dicts per NIC set, new at every re-list that changes the NICs (never cleared in place:
        # views of the old set keep theirs).
        self._answers: dict[tuple[str, ...], ContainerAllocation] = {}
        self._responses: dict[Any, Any] = {}
        self._closed = False
        self._listeners: list[Callable[[], None]] = []  # told after every publication
        # Shared mode: the device list is all Healthy or all Unhealthy (a -local pool: per node), so
        # each is built once (a flip of a 100k pool is then a pick, not 100k new devices:
        # bench/bench_listandwatch.py), and so is its message (the last two).
        self._shared_lists: dict[object, tuple[Device, ...]] = {}
        self._encoded: list[tuple[tuple[Device, ...], bytes]] = []
        self._env: tuple[tuple[str, WorkloadEnv], ...] = ()  # (scope, env) of the pool's NICs: status, metrics
        self._said = LogOnce(LOG)  # a variable left unset: said once while it stays so
        self._probe_failure: str | None = None  # why no port can be vouched for (the probe keeps failing)
        self._held: dict[str, tuple[Hold, float]] = {}  # NICs held down after flapping: (hold, wall time it ends)
        self.view = self._view(b"")

    # ------------------------------------------------------------------ inputs

    def set_nics(self, nics: Iterable[Nic], now: float | None = None) -> bool:
        """Apply a discovery result; returns True when the advertised devices changed.

        NICs are tracked by identity (PCI function, else node GUID), not by RDMA device name: a
        NIC renamed in place (udev rule, LAG re-formation) is the same device under its new
        name. A NIC gone for longer than health.vanishGraceSeconds leaves the pool.
        """
        now = time.monotonic() if now is None else now
        selected = {nic_identity(n): n for n in self.spec.nics(self.selectors.select(nics))}
        if self._state.set_nics(selected, now):  # a re-list that finds the same NICs keeps the answers
            self._relisted()
        return self._publish()

    def _relisted(self) -> None:
        """The NICs changed (their GID facts read anew by the NIC state): build the answers of a shared
        pool now rather than at the first Allocate, and say once what its env leaves unset."""
        self._answers, self._responses = {}, {}  # names, char devices or GIDs changed
        if self.mode == "shared":
            for key in self.rules.shared_keys(self._state.present):
                nics = self.rules.nics_for(key, self._state.present)
                if any(has_uverbs(n) for n in nics):
                    self._answers[key] = self.rules.allocation(nics, self._state.facts)
        self._env = ()
        for scope, nics in self._env_scopes():
            found = nccl_env.workload_env(facts_of(self._state.facts, nics), self.rules.env_settings)
            full = self.rules.container.pod_env(tuple(n.name for n in nics if has_uverbs(n)), found.env)
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

    def _env_scopes(self) -> list[tuple[str, list[Nic]]]:
        """What the status shows a pod gets: the pool's NICs, or each NUMA node's of a -local pool."""
        if self.spec.kind == LOCAL:
            keys = self.rules.shared_keys(self._state.present)
            return [(f"numa{key[0]}", self.rules.nics_for(key, self._state.present)) for key in keys]
        return [("", sorted(self._state.present.values(), key=lambda n: n.name))] if self._state.present else []

    def set_port_states(self, states: Mapping[str, tuple[str, ...] | None]) -> bool:
        """Apply a health probe (RDMA device name -> port states, None when gone)."""
        self._state.set_port_states(states)
        return self._publish()

    def set_held(self, held: Mapping[str, Hold]) -> bool:
        """The NICs held down after flapping (by identity, node-wide): Unhealthy while held."""
        wall = time.time() - time.monotonic()
        self._held = {key: (hold, wall + hold.until) for key, hold in held.items() if key in self._state.seen}
        return self._publish()

    def set_probe_failure(self, reason: str | None) -> bool:
        """The health probe has failed for too long (``reason``): every device is Unhealthy until
        it works again (None)."""
        self._probe_failure = reason
        return self._publish()

    def close(self) -> None:
        """Wake every waiting stream so it can end (shutdown only)."""
        self._closed = True
        self._publish()

    @property
    def closed(self) -> bool:
        return self.view.closed

    def add_listener(self, listener: Callable[[], None]) -> None:
        self._listeners.append(listener)

    def remove_listener(self, listener: Callable[[], None]) -> None:
        if listener in self._listeners:
            self._listeners.remove(listener)

    # ------------------------------------------------------------------ owner state

    def health_changes(self, before: Mapping[str, NicHealth]) -> list[str]:
        """Human-readable lines for NICs whose health differs from ``before`` (a copy of health_state())."""
        out = [
            f"{self._state.seen[key].name} {health.describe()}"
            for key, health in sorted(self._state.health.items())
            if before.get(key) != health and key not in self._held  # a held NIC's flaps: see discovery
        ]
        if not out:
            return []
        state = self._devices[0].health if self.mode == "shared" and self._devices else None
        effect = f"{self.name} {state} (policy {self.policy})" if state else f"{self.name} devices updated"
        return [f"{line}: {effect}" for line in out]

    def health_state(self) -> dict[str, NicHealth]:
        return dict(self._state.health)

    def nic_names(self) -> dict[str, str]:
        """Identity -> RDMA device name of every NIC the pool knows."""
        return {key: nic.name for key, nic in self._state.seen.items()}

    def _usable(self, key: str) -> bool:
        health = self._state.health.get(key)
        return (
            self._probe_failure is None
            and key in self._state.present
            and key not in self._held
            and health is not None
            and health.healthy
        )

    def _health_of(self, keys: Sequence[str]) -> str:
        usable = [self._usable(key) for key in keys]
        ok = all(usable) if self.policy == "all" else any(usable)
        return HEALTHY if ok else UNHEALTHY

    def _device_list(self) -> tuple[Device, ...]:
        if self.mode != "shared":
            return tuple(
                Device(nic.pci_address, HEALTHY if self._usable(key) else UNHEALTHY, nic.numa_node)
                for key, nic in sorted(self._state.seen.items(), key=lambda kv: kv[1].pci_address)
            )
        if not self._state.seen:
            return ()  # nothing selected on this node: advertise nothing rather than 1k of nothing
        if self.spec.kind == LOCAL:  # one block per NUMA node with NICs, each with its own health
            by_node: dict[int, list[str]] = {}
            for key, nic in self._state.seen.items():
                if nic.numa_node is not None:
                    by_node.setdefault(nic.numa_node, []).append(key)
            state = tuple(sorted((n, self._health_of(keys)) for n, keys in by_node.items()))
            devices = self._shared_lists.get(state)
            if devices is None:
                if len(self._shared_lists) >= 8:  # bounded: nodes x 2 health states come and go
                    self._shared_lists.clear()
                per_node = dict(state)
                devices = tuple(Device(i, per_node[n], n) for i, n in self.rules.numa_of.items() if n in per_node)
                self._shared_lists[state] = devices
            return devices
        health = self._health_of(list(self._state.seen))
        found = self._shared_lists.get(health)
        if found is None:
            found = self._shared_lists[health] = tuple(Device(i, health, n) for i, n in self.rules.numa_of.items())
        return found

    def _message(self, devices: tuple[Device, ...]) -> bytes:
        """Serialized once per device list; the last two kept (a port flipping back and forth)."""
        if self._encoded and self._encoded[0][0] is devices:
            return self._encoded[0][1]
        found = next((data for listed, data in self._encoded if listed == devices), None)
        if found is None:
            found = encode_devices(devices)
            self._encoded = [(devices, found), *self._encoded[:1]]
        return found

    def _publish(self) -> bool:
        """Publish a new view when anything a reader sees changed; tell the listeners. True when the
        device list changed (what the kubelet sees)."""
        devices = self._device_list()
        changed = devices != self._devices
        if changed:
            self._devices = devices
            self._device_ids = frozenset(d.id for d in devices)
            self._version += 1
        self.view = self._view(self._message(devices))  # one reference: readers see the old or the new, whole
        for listener in list(self._listeners):
            listener()
        return changed

    def _view(self, message: bytes) -> PoolView:
        devices = self._devices
        return PoolView(
            rules=self.rules,
            version=self._version,
            nic_set=self._state.nic_set,
            devices=devices,
            device_ids=self._device_ids,
            message=message,
            healthy=sum(1 for d in devices if d.health == HEALTHY),
            nics=MappingProxyType(self._state.present),
            facts=MappingProxyType(self._state.facts),
            answers=self._answers,
            responses=self._responses,
            summary=tuple(self._summary()),
            env=self._env,
            closed=self._closed,
        )

    def _summary(self) -> list[dict[str, object]]:
        out: list[dict[str, object]] = []
        for key, nic in sorted(self._state.seen.items(), key=lambda kv: kv[1].name):
            health = self._state.health.get(key, NicHealth(False, ()))
            out.append(
                {
                    "name": nic.name,
                    "pci_address": nic.pci_address,
                    "present": key in self._state.present,
                    "ports": list(health.ports),
                    "healthy": self._usable(key),
                    "why": self._probe_failure or health.why or self._held_why(key),
                    "numa_node": nic.numa_node,
                    "gid": self._gid_shown(key),
                }
            )
        return out

    def _held_why(self, key: str) -> str:
        held = self._held.get(key)
        if held is None:
            return ""
        hold, until = held
        at = time.strftime("%H:%M:%S", time.gmtime(until))
        return f"held down after {hold.flaps} flaps: Healthy at {at} UTC if it stays up (health.flapDamping)"

    def _gid_shown(self, key: str) -> str:
        """NCCL's GID on the NIC's first RoCE port for the family the pool's env uses ("" without)."""
        facts = self._state.facts.get(key)
        family = next((env.family for _, env in self._env if env.family), "")
        picks = facts.picks_for(family) if facts is not None and family else ()
        return picks[0].shown if picks else ""

    # ------------------------------------------------------------------ reads (the view: any thread)

    def snapshot(self) -> tuple[int, tuple[Device, ...]]:
        view = self.view
        return view.version, view.devices

    def present_nics(self) -> list[Nic]:
        """Selected NICs currently on the node, by RDMA device name."""
        return self.view.present_nics()

    def nic_summary(self) -> list[dict[str, object]]:
        """Every NIC the pool has seen, by name: identity, presence, ports, health and why."""
        return [dict(n) for n in self.view.summary]

    def workload_env(self) -> tuple[tuple[str, WorkloadEnv], ...]:
        """(scope, env) a pod gets from the pool's present NICs (its whole env, and what was left
        unset): one entry (scope ""), or one per NUMA node (``numa0`` ...) of a -local pool.
        Exclusive mode: a pod given every NIC."""
        return self.view.env

    def allocation_key(self, device_ids: Sequence[str]) -> tuple[str, ...]:
        return self.rules.key(device_ids)

    def allocate(self, device_ids: Sequence[str]) -> ContainerAllocation:
        return self.view.allocate(device_ids)

    def preferred(self, available: Sequence[str], must_include: Sequence[str], size: int) -> list[str]:
        return self.view.preferred(available, must_include, size)


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
