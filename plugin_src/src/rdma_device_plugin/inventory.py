"""The node inventory: the node's RDMA NICs, their health and the env facts, read one way for both
APIs. The device plugin's pools (:mod:`.resources`, fed by :mod:`.discovery`) and the DRA driver
(:mod:`.dra.driver`) read the node here, so a NIC is usable, named, and given the same env whichever
API serves it.

- :class:`NodeReader`: what the node has. A full re-list (``rdma_node.sysfs.read_nics``) when the set
  of RDMA devices changes, a port read fails, a NIC is still without its uverbs node (re-checked
  1 s after, doubling to 30 s) or ``rediscoveryIntervalSeconds`` passes; between re-lists the port
  states, one ``pread`` per port (or pyverbs where it lists the NIC).
- :class:`NicStates`: a set of selected NICs by identity: present, seen (a vanished one stays,
  unhealthy, for ``health.vanishGraceSeconds``), each one's health by the one rule (:mod:`.health`)
  and its GID facts (:func:`.nccl_env.nic_facts`, read when the NICs change).
- :class:`ContainerRules`: what a container given some NICs gets (their char devices, ``rdma_cm``,
  the NCCL/UCX env of exactly those NICs, the config's env, ``RDMA_DEVICES``).
- :class:`NodeInventory`: the reader and one :class:`NicStates` per resource (a NIC in the first
  resource that selects it), with the GPUs per NIC: the DRA driver's whole view of the node.

No gRPC, no pools, no config parsing: the DRA driver reads the node without the device plugin's
serving machinery (plugin_src/tests/test_inventory.py pins the imports).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING

from rdma_node import sysfs
from rdma_node.selectors import Selectors
from rdma_node.sysfs import Nic

from . import affinity, logs, nccl_env, netchecks
from .health import NicHealth
from .nccl_env import NicFacts
from .supervision import Backoff, LogOnce
from .verbs import VerbsProbe

if TYPE_CHECKING:
    from .config import PluginConfig  # a model or its config_view (the DRA driver): attribute reads only

LOG = logging.getLogger(__name__)
RDMA_CM_PATH = "/dev/infiniband/rdma_cm"
UVERBS_RECHECK_SECONDS = 1.0
UVERBS_RECHECK_MAX_SECONDS = 30.0


def nic_identity(nic: Nic) -> str:
    """What makes a NIC the same NIC across renames: its PCI function, else its node GUID."""
    return nic.pci_address or f"guid:{nic.node_guid}"


def has_uverbs(nic: Nic) -> bool:
    return nic.uverbs is not None and nic.uverbs.present


@dataclass(frozen=True)
class DeviceSpec:
    container_path: str
    host_path: str
    permissions: str = "rw"


def facts_of(facts: Mapping[str, NicFacts], nics: Sequence[Nic]) -> list[NicFacts]:
    return [facts[nic_identity(n)] for n in nics if nic_identity(n) in facts]


@dataclass(frozen=True)
class ContainerRules:
    """What a container given NICs gets, fixed by the config at start (pure)."""

    env_settings: nccl_env.EnvSettings
    with_umad: bool
    with_issm: bool
    extra_env: Mapping[str, str]
    non_host_network: bool

    @classmethod
    def from_config(cls, config: PluginConfig) -> ContainerRules:
        extra_env = dict(config.env)
        if config.non_host_network.enabled:
            extra_env.update(config.non_host_network.env)
        return cls(
            env_settings=nccl_env.EnvSettings.from_config(config),
            with_umad=config.char_devices.umad,
            with_issm=config.char_devices.issm,
            extra_env=MappingProxyType(extra_env),
            non_host_network=config.non_host_network.enabled,
        )

    def device_specs(self, nics: Sequence[Nic]) -> list[DeviceSpec]:
        """The NICs' char devices, then ``rdma_cm``."""
        chars = [c for nic in nics for c in nic.char_devices(self.with_umad, self.with_issm)]
        return [*(DeviceSpec(c.node_path, c.node_path) for c in chars), DeviceSpec(RDMA_CM_PATH, RDMA_CM_PATH)]

    def env(self, nics: Sequence[Nic], facts: Mapping[str, NicFacts]) -> dict[str, str]:
        """The env of exactly these NICs (those with a uverbs device)."""
        nics = [n for n in nics if has_uverbs(n)]
        computed = nccl_env.workload_env(facts_of(facts, nics), self.env_settings).env
        return self.pod_env(tuple(n.name for n in nics), computed)

    def pod_env(self, names: tuple[str, ...], computed: Mapping[str, str]) -> dict[str, str]:
        """A container's env, low to high: computed (workloadEnv), non-hostNetwork defaults, the
        config's env, RDMA_DEVICES."""
        defaults = netchecks.default_env() if self.non_host_network else {}
        return {**computed, **defaults, **self.extra_env, "RDMA_DEVICES": ",".join(names)}


@dataclass(frozen=True)
class NicSet:
    """The present NICs of a :class:`NicStates` and their GID facts at one moment (by identity), for
    readers off the owner's thread: replaced as one, never changed."""

    nics: Mapping[str, Nic]
    facts: Mapping[str, NicFacts]

    def by_name(self) -> dict[str, Nic]:
        return {n.name: n for n in self.nics.values()}


class NicStates:
    """A set of selected NICs (one pool's, one resource's), changed by one owner thread only.

    Tracked by identity (PCI function, else node GUID), not by RDMA device name: a NIC renamed in
    place (udev rule, LAG re-formation) is the same NIC under its new name. A NIC gone for longer than
    health.vanishGraceSeconds leaves the set. ``present``, ``facts`` are replaced, never changed."""

    def __init__(
        self, name: str, vanish_grace: float, env_settings: nccl_env.EnvSettings, log: logging.Logger = LOG
    ) -> None:
        self.name = name  # what the log lines name (the resource)
        self.log = log  # the reader's (a pool logs as resources, as it always did)
        self.vanish_grace = vanish_grace
        self.env_settings = env_settings
        self.present: dict[str, Nic] = {}  # present and selected, by identity
        self.seen: dict[str, Nic] = {}  # every NIC selected (a vanished one stays, unhealthy, for the grace)
        self.health: dict[str, NicHealth] = {}
        self.gone_since: dict[str, float] = {}
        self.facts: dict[str, NicFacts] = {}  # by identity: each present NIC's GID facts
        self.nic_set = 0  # bumped when a re-list changes the NICs (their names, facts)
        self.current = NicSet(MappingProxyType({}), MappingProxyType({}))

    def set_nics(self, selected: Mapping[str, Nic], now: float) -> bool:
        """Apply a discovery result (identity -> NIC); True when the present NICs changed."""
        relisted = selected != self.present  # a re-list that finds the same NICs keeps the facts
        self.present = dict(selected)
        for key, nic in selected.items():
            old = self.seen.get(key)
            if old is not None and old.name != nic.name:
                self.log.info("NIC %s (%s) is now named %s", old.name, key, nic.name, extra={"resource": self.name})
            self.seen[key] = nic
            self.gone_since.pop(key, None)
            self.health[key] = NicHealth(True, tuple(p.state for p in nic.ports), has_uverbs(nic))
        for key in set(self.seen) - set(selected):
            self.health[key] = NicHealth(False, ())
            since = self.gone_since.setdefault(key, now)
            if now - since >= self.vanish_grace:
                gone = self.seen.pop(key)
                del self.health[key], self.gone_since[key]
                self.log.warning(
                    "NIC %s (%s) gone for %.0f s (health.vanishGraceSeconds): removed from %s",
                    gone.name,
                    key,
                    now - since,
                    self.name,
                    extra={"resource": self.name},
                )
        if relisted:
            self.nic_set += 1
            self.facts = {key: nccl_env.nic_facts(nic, self.env_settings) for key, nic in self.present.items()}
        self.current = NicSet(MappingProxyType(self.present), MappingProxyType(self.facts))
        return relisted

    def set_port_states(self, states: Mapping[str, tuple[str, ...] | None]) -> None:
        """Apply a health probe (RDMA device name -> port states, None when gone)."""
        by_name = {nic.name: key for key, nic in self.seen.items()}
        for name, ports in states.items():
            key = by_name.get(name)
            if key is not None:
                present = ports is not None and key in self.present
                self.health[key] = NicHealth(present, ports or (), has_uverbs(self.seen[key]))

    def present_nics(self) -> list[Nic]:
        """Selected NICs on the node, by RDMA device name."""
        return sorted(self.present.values(), key=lambda n: n.name)


class NodeReader:
    """What the node has: the RDMA NICs in sysfs and their port states (module doc)."""

    def __init__(
        self,
        sysfs_root: str,
        dev_root: str,
        rediscovery_seconds: float,
        verbs: VerbsProbe | None = None,
        log: logging.Logger = LOG,
    ) -> None:
        self.log = log  # the reader's (discovery logs as discovery, as it always did)
        self.sysfs_root = sysfs_root
        self.dev_root = dev_root
        self.rediscovery_seconds = rediscovery_seconds
        self.verbs = verbs  # port states through pyverbs when it lists devices, else sysfs
        self.names: list[str] = []  # every listed RDMA device, readable or not
        self._problems: dict[str, tuple[str, ...]] = {}
        self._unreadable: dict[str, str] = {}  # this re-list's unidentifiable devices -> why
        self._unreadable_logged: dict[str, str] = {}
        self._incomplete: frozenset[str] = frozenset()  # served NICs without a usable uverbs node, by identity
        # Re-listed for them 1 s after, doubling to 30 s: udev creates the node within moments of the
        # NIC, so a NIC still without one is waiting for a module (ib_uverbs) or a /dev that is not the host's.
        self._incomplete_backoff = Backoff(UVERBS_RECHECK_SECONDS, UVERBS_RECHECK_MAX_SECONDS)
        self._last_full = 0.0
        self._log_once = LogOnce(log)
        self._ports: sysfs.PortStateReader | None = None  # fast probe: open port-state files (issue 15)

    def _skipped(self, name: str, reason: str) -> None:
        """An RDMA device that cannot be identified (soft-RoCE rxe, siw, half-removed): logged once."""
        self._unreadable[name] = reason
        if self._unreadable_logged.get(name) != reason:
            self._unreadable_logged[name] = reason
            self.log.warning("RDMA device %s left out: %s", name, reason, extra={"nic": name})

    def read(self) -> list[Nic]:
        """A full re-list: every readable RDMA NIC (each NIC problem logged once)."""
        self._unreadable = {}
        names = sysfs.list_rdma_devices(self.sysfs_root)
        nics = sysfs.read_nics(self.sysfs_root, self.dev_root, on_skip=self._skipped)
        for gone in set(self._unreadable_logged) - set(self._unreadable):
            del self._unreadable_logged[gone]
        problems = {n.name: n.problems for n in nics if n.problems}
        for name, found in problems.items():
            if self._problems.get(name) != found:  # log a problem once, not at every re-list
                for problem in found:
                    self.log.warning("NIC problem", extra={"nic": name, "problem": problem})
        self._problems = problems
        # Every listed name, readable or not: an unreadable device must not look like a change
        # (and force a full re-list) at every probe.
        self.names = names
        self._last_full = time.monotonic()
        return nics

    def served(self, nics: Iterable[Nic]) -> None:
        """The NICs served after a re-list: one without a usable uverbs node (udev not done yet,
        ib_uverbs not loaded, the container's /dev not the host's) is said once and re-listed with
        backoff until it has one."""
        missing = {nic_identity(nic): nic for nic in nics if nic.uverbs is None or not nic.uverbs.present}
        for key, nic in missing.items():
            where = f"{nic.uverbs.node_path} is missing" if nic.uverbs else "no uverbs device names it in sysfs"
            self._log_once.problem(
                f"uverbs {key}",
                "%s has no uverbs character device (%s); it stays Unhealthy, and the NICs are re-listed %g s "
                "later, then at doubling intervals up to %g s, until it has one",
                nic.name,
                where,
                UVERBS_RECHECK_SECONDS,
                UVERBS_RECHECK_MAX_SECONDS,
                extra={"nic": nic.name},
            )
        for key in self._incomplete - missing.keys():
            self._log_once.cleared(f"uverbs {key}", "a NIC's uverbs character device is there now")
        if missing.keys() - self._incomplete:  # a new one: its first re-check a second from now
            self._incomplete_backoff.succeeded()
            self._incomplete_backoff.failed(time.monotonic())
        self._incomplete = frozenset(missing)

    def open_ports(self) -> None:
        if self._ports is not None:
            self._ports.close()
        self._ports = sysfs.PortStateReader(self.sysfs_root, [n for n in self.names if n not in self._unreadable])

    def close(self) -> None:
        if self._ports is not None:
            self._ports.close()
            self._ports = None

    @property
    def verbs_on(self) -> bool:
        return self.verbs is not None and self.verbs.available()

    def port_states(self, names: list[str]) -> dict[str, tuple[str, ...] | None] | None:
        """From pyverbs when available (sysfs for NICs it does not know), else from the open sysfs
        port-state files; None when one of those reads failed (the caller re-lists)."""
        if self.verbs is not None and self.verbs.available():
            states = self.verbs.port_states(names)
            missing = [n for n in names if n not in states]
            if missing:
                states.update(sysfs.read_port_states(self.sysfs_root, missing))
            return states
        if self._ports is None:
            return sysfs.read_port_states(self.sysfs_root, names)
        return self._ports.read()

    def probe_states(self) -> dict[str, tuple[str, ...] | None] | None:
        """Every readable listed NIC's port states (None: a read failed, re-list)."""
        names = self.names
        return self.port_states([n for n in names if n not in self._unreadable] if self._unreadable else names)

    @property
    def failed(self) -> str:
        return self._ports.failed if self._ports is not None else ""

    def unchanged(self, states: Mapping[str, tuple[str, ...] | None] | None) -> bool:
        """The idle fast probe: True when every port reads as ``states`` (one pread per port, no
        parsing). False for anything else (a change, a failed read, pyverbs, unreadable NICs)."""
        ports = self._ports
        if ports is None or self._unreadable or self.verbs_on:
            return False
        return ports.read() == states

    def check_devices(self, relist: Callable[[], object]) -> None:
        """Call ``relist`` when the set of RDMA devices changed (hot-plug, removal), the rediscovery
        interval passed, or a NIC without its uverbs node is due for a re-check (backoff)."""
        names = sysfs.list_rdma_devices(self.sysfs_root)
        now = time.monotonic()
        due = now - self._last_full >= self.rediscovery_seconds
        recheck = bool(self._incomplete) and self._incomplete_backoff.due(now)
        if names != self.names or due or recheck:
            if names != self.names:
                added = sorted(set(names) - set(self.names))
                removed = sorted(set(self.names) - set(names))
                self.log.info(
                    "RDMA devices changed on the node",
                    extra={"added": logs.names(added), "removed": logs.names(removed), "count": len(names)},
                )
                self.log.debug("RDMA devices changed on the node", extra={"before": self.names, "after": names})
            relist()
            if self._incomplete and recheck:
                self._incomplete_backoff.failed(now)


def owners(selectors: Sequence[tuple[str, Selectors]], nics: list[Nic]) -> dict[str, list[str]]:
    """NIC name -> the resources whose selectors select it, in config order."""
    out: dict[str, list[str]] = {}
    for name, selector in selectors:
        for nic in selector.select(nics):
            out.setdefault(nic.name, []).append(name)
    return out


class NodeInventory:
    """The node's NICs by resource, each NIC in the first resource that selects it (one owner, as
    exclusive mode hands NICs out), with their health, env facts and GPUs: one owner thread."""

    def __init__(self, config: PluginConfig, sysfs_root: str, dev_root: str, verbs: VerbsProbe | None = None) -> None:
        self.config = config
        self.reader = NodeReader(sysfs_root, dev_root, config.rediscovery_interval_seconds, verbs)
        self.rules = ContainerRules.from_config(config)
        self.selectors = [(r.name, Selectors.of(r.selectors)) for r in config.resources]
        grace = config.health.vanish_grace_seconds
        self.resources = {r.name: NicStates(r.name, grace, self.rules.env_settings) for r in config.resources}
        self.affinity = affinity.NodeAffinity({}, (), {})  # GPUs per served NIC, read at every re-list
        self.states: Mapping[str, tuple[str, ...] | None] = {}  # the port states applied last
        self._said = LogOnce(LOG)

    def full(self) -> list[Nic]:
        nics = self.reader.read()
        found = owners(self.selectors, nics)
        for name, res in sorted(found.items()):
            if len(res) > 1:
                self._said.problem(
                    f"overlap {name}",
                    "NIC %s is selected by resources %s; only %s gets it",
                    name,
                    ", ".join(res),
                    res[0],
                    level=logging.ERROR,
                )
        now = time.monotonic()
        before = self._health()
        for name, states in self.resources.items():
            if states.set_nics({nic_identity(n): n for n in nics if found.get(n.name, [""])[0] == name}, now):
                healthy = sum(1 for h in states.health.values() if h.healthy)
                names = logs.names(sorted(n.name for n in states.seen.values()))
                LOG.info("devices changed", extra={"resource": name, "nics": names, "healthy": healthy})
        served = sorted({n.name: n for s in self.resources.values() for n in s.present_nics()}.values(), key=_name)
        self.reader.served(served)
        self.affinity = affinity.read(self.reader.sysfs_root, served)
        self.reader.open_ports()
        if self.reader.verbs_on:
            self.states = {}  # set_nics applied sysfs states: pyverbs' must be applied again
            self._apply(self.reader.probe_states() or {})
        else:
            self.states = {n.name: tuple(p.state for p in n.ports) for n in nics}
        self._log_health(before)
        return nics

    def _health(self) -> dict[str, dict[str, NicHealth]]:
        return {name: dict(s.health) for name, s in self.resources.items()}

    def _log_health(self, before: Mapping[str, Mapping[str, NicHealth]]) -> None:
        """One line per NIC whose health changed (``health changed: mlx5_bond_1 port 1 DOWN``); none
        at the first discovery."""
        for name, s in self.resources.items():
            old = before.get(name)
            if not old:
                continue
            for key, health in sorted(s.health.items()):
                if old.get(key) != health and key in s.seen:
                    LOG.info("health changed: %s %s", s.seen[key].name, health.describe(), extra={"resource": name})

    def _apply(self, states: Mapping[str, tuple[str, ...] | None]) -> None:
        if states == self.states:
            return
        self.states = states
        for s in self.resources.values():
            s.set_port_states(states)

    def probe(self) -> None:
        """Port states only (one pread per port); a failed read re-lists at once."""
        states = self.reader.probe_states()
        if states is None:
            LOG.info("a port state read failed; re-listing the NICs", extra={"error": self.reader.failed})
            self.full()
            return
        before = self._health()
        self._apply(states)
        self._log_health(before)

    def unchanged(self) -> bool:
        return self.reader.unchanged(self.states)

    def check_devices(self) -> None:
        self.reader.check_devices(self.full)

    def close(self) -> None:
        self.reader.close()

    def key(self) -> object:
        """Changes whenever anything the NICs' views are made of changes (their set, health, GPUs)."""
        return (
            tuple((name, s.nic_set, tuple(sorted(s.health.items()))) for name, s in self.resources.items()),
            self.affinity,
        )


def _name(nic: Nic) -> str:
    return nic.name
