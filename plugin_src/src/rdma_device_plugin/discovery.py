"""Discovery: what the node has, fed to the pools.

The node is read by the node inventory's reader (:class:`.inventory.NodeReader`, which the DRA
driver reads too): a full re-list when the set of RDMA devices changes, a port read fails, a NIC is
still incomplete (its uverbs node not created yet) or ``rediscoveryIntervalSeconds`` passes; between
re-lists the cheap port probe (one ``pread`` per port, compared with the last bytes before any
parsing). Whether a NIC is usable is decided by the one health rule
(:mod:`.health`), applied by the pools; discovery logs each NIC whose health changed, the way a
person reads it. It also keeps the CDI specs, the NFD feature file and the link-event coverage
current at every re-list.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from types import MappingProxyType

from rdma_node import sysfs

from . import affinity, cdi, events, health, inventory, logs, nfd, numa_pools
from .config import PluginConfig
from .health import NicHealth
from .inventory import NodeReader
from .resources import ResourcePool
from .server import Hooks
from .supervision import LogOnce
from .verbs import VerbsProbe

LOG = logging.getLogger(__name__)


class Discovery:
    """Feeds the pools from sysfs: full re-list on change or timer, cheap port probe otherwise."""

    def __init__(
        self,
        config: PluginConfig,
        pools: list[ResourcePool],
        sysfs_root: str,
        dev_root: str,
        verbs: VerbsProbe | None = None,
        hooks: Hooks | None = None,
    ):
        self.config = config
        self.pools = pools
        self.sysfs_root = sysfs_root
        self.dev_root = dev_root
        self.reader = NodeReader(sysfs_root, dev_root, config.rediscovery_interval_seconds, verbs, LOG)
        self.hooks = hooks or Hooks()
        self.cdi: dict[str, cdi.SpecWriter] = {}  # resource name -> its CDI spec (cdi.enabled)
        self._log_once = LogOnce(LOG)
        self._states: dict[str, tuple[str, ...] | None] | None = None  # last states applied
        self.features: nfd.FeatureFile | None = None  # --nfd-features-file (issue 15)
        self.coverage = events.LinkCoverage(frozenset(), ())  # set by every re-list
        self.affinity = affinity.NodeAffinity({}, (), {})  # GPUs per served NIC, read at every re-list
        damping = config.health.flap_damping
        self.damping = (
            health.FlapDamping(damping.half_life_seconds, damping.suppress_penalty, damping.max_hold_down_seconds)
            if damping.enabled
            else None
        )
        self.holds: dict[str, health.Hold] = {}  # NICs held down now, by identity
        # For the published node view (supervisor): replaced, never changed in place.
        self.held: Mapping[str, health.Hold] = MappingProxyType({})  # the same, by name
        self.nics: tuple[sysfs.Nic, ...] = ()  # every RDMA NIC found at the last re-list
        self.state_changes: Mapping[tuple[str, int], int] = MappingProxyType({})  # (nic, port) -> changes seen
        self._counted: Mapping[str, tuple[str, ...] | None] = {}  # the states the counts last compared

    @property
    def verbs(self) -> VerbsProbe | None:
        return self.reader.verbs

    def owners(self, nics: list[sysfs.Nic]) -> dict[str, list[str]]:
        """NIC name -> the resources whose selectors select it, in config order."""
        return inventory.owners([(pool.name, pool.selectors) for pool in self.pools], nics)

    def exclusive_overlaps(self, nics: list[sysfs.Nic]) -> list[str]:
        """Exclusive mode: a NIC selected by two resources would go "exclusively" to two pods."""
        if self.config.mode != "exclusive":
            return []
        return [
            f"in exclusive mode NIC {name} is selected by resources {', '.join(owners)}; make their selectors "
            "disjoint (e.g. rdmaDevices or ifNames per resource)"
            for name, owners in sorted(self.owners(nics).items())
            if len(owners) > 1
        ]

    def full(self) -> list[sysfs.Nic]:
        nics = self.reader.read()
        owners = self.owners(nics) if self.config.mode == "exclusive" else {}
        for name, res in sorted(owners.items()):
            if len(res) > 1:
                self._log_once.problem(
                    f"overlap {name}",
                    "NIC %s is selected by resources %s in exclusive mode; only %s gets it",
                    name,
                    ", ".join(res),
                    res[0],
                    level=logging.ERROR,
                )
        befores = [pool.health_state() for pool in self.pools]
        changed = []
        for pool in self.pools:
            mine = [n for n in nics if owners.get(n.name, [pool.name])[0] == pool.name]
            if pool.set_nics(mine):
                changed.append(pool)
        self._damp()
        for pool, before in zip(self.pools, befores, strict=True):
            if pool in changed:
                summary = pool.nic_summary()
                LOG.info(
                    "devices changed",
                    extra={
                        "resource": pool.name,
                        "nics": logs.names([str(n["name"]) for n in summary]),
                        "count": len(summary),
                        "healthy": sum(1 for n in summary if n["healthy"]),
                    },
                )
                LOG.debug("devices changed", extra={"resource": pool.name, "nics": summary})
            self._log_health(pool, before)
        self.reader.served({n.name: n for pool in self.pools for n in pool.present_nics()}.values())
        self.hooks.rediscovered()
        self.nics = tuple(nics)
        served = sorted({n.name: n for pool in self.pools for n in pool.present_nics()}.values(), key=lambda n: n.name)
        self._say_numa_less()
        self.affinity = affinity.read(self.sysfs_root, served)
        if self.features is not None:
            self.features.update(served, self.affinity)
        self.coverage = events.link_coverage(
            [n for pool in self.pools for n in pool.present_nics()],
            lambda netdev: sysfs.netdev_ifindex(self.sysfs_root, netdev),
        )
        self.reader.open_ports()
        if self.reader.verbs_on:
            self._states = None  # set_nics applied sysfs states: pyverbs' must be applied again
            self._apply_states(self.port_states(self.reader.names) or {})
        else:
            self._states = {n.name: tuple(p.state for p in n.ports) for n in nics}
            self._count_changes(self._states)
        for pool in self.pools:
            writer = self.cdi.get(pool.name)
            if writer is not None:
                try:
                    writer.update(pool.present_nics())
                except OSError as exc:
                    LOG.error("cannot write CDI spec", extra={"path": writer.path, "error": str(exc)})
        return nics

    def _say_numa_less(self) -> None:
        """numaPools: a selected NIC without a NUMA node is in no per-NUMA pool (said once)."""
        selected = {p.spec.configured: p.present_nics() for p in self.pools if p.spec.kind == numa_pools.WHOLE}
        lines = numa_pools.without_numa([p.spec for p in self.pools], selected)
        for line in lines:
            self._log_once.problem(f"numa-less {line}", "%s", line)
        for key in [k for k in self._log_once.pending if k.startswith("numa-less ") and k[10:] not in lines]:
            self._log_once.cleared(key)

    @property
    def states(self) -> Mapping[str, tuple[str, ...] | None]:
        """The port states applied last (replaced at every change, never changed in place)."""
        return self._states or {}

    def close(self) -> None:
        self.reader.close()

    def port_states(self, names: list[str]) -> dict[str, tuple[str, ...] | None] | None:
        """From pyverbs when available (sysfs for NICs it does not know), else from the open sysfs
        port-state files; None when one of those reads failed (the caller re-lists)."""
        return self.reader.port_states(names)

    def _apply_states(self, states: dict[str, tuple[str, ...] | None]) -> None:
        if states == self._states:
            if self.holds:
                self._damp()  # a hold-down may have ended
            return  # nothing changed: the common case at every fast probe
        self._states = states
        self._count_changes(states)
        befores = [pool.health_state() for pool in self.pools]
        for pool in self.pools:
            pool.set_port_states(states)
        self._damp()
        for pool, before in zip(self.pools, befores, strict=True):
            self._log_health(pool, before)

    def _count_changes(self, states: Mapping[str, tuple[str, ...] | None]) -> None:
        """Every port whose state differs from the last states seen counts a change (a NIC appearing
        or vanishing is none): rdma_dp_port_state_changes_total, which the flap alert reads."""
        counts: dict[tuple[str, int], int] | None = None
        for nic, now in states.items():
            before = self._counted.get(nic)
            if now is None or before is None:
                continue
            for i, (old, new) in enumerate(zip(before, now, strict=False), start=1):
                if old != new:
                    counts = dict(self.state_changes) if counts is None else counts
                    counts[(nic, i)] = counts.get((nic, i), 0) + 1
        if counts is not None:
            self.state_changes = MappingProxyType(counts)  # replaced: a published view keeps its own
        self._counted = states

    def _damp(self) -> None:
        """Flap damping (health.FlapDamping) of every NIC's verdict; the pools hold the NICs it holds."""
        if self.damping is None:
            return
        usable = {key: nic.healthy for pool in self.pools for key, nic in pool.health_state().items()}
        names = {key: name for pool in self.pools for key, name in pool.nic_names().items()}
        holds = self.damping.observe(usable, time.monotonic())
        for key in holds.keys() - self.holds.keys():
            LOG.warning(
                "%s held down after %d flaps: Unhealthy until it stays up for %.0f s (health.flapDamping)",
                names.get(key, key),
                holds[key].flaps,
                holds[key].until - time.monotonic(),
                extra={"nic": names.get(key, key)},
            )
        for key in self.holds.keys() - holds.keys():
            if key in usable:
                LOG.info("%s no longer held down", names.get(key, key), extra={"nic": names.get(key, key)})
        if holds != self.holds:
            self.holds = holds
            for pool in self.pools:
                pool.set_held(holds)
            self.held = MappingProxyType({names.get(key, key): hold for key, hold in holds.items()})

    def hold_due(self, now: float) -> bool:
        """A hold-down ends by now: the next probe must look even if no port changed."""
        return any(hold.until <= now for hold in self.holds.values())

    @staticmethod
    def _log_health(pool: ResourcePool, before: dict[str, NicHealth]) -> None:
        """One line per NIC whose health changed, as a person reads it:
        ``mlx5_bond_1 port 1 DOWN: rdma/hca Unhealthy (policy all)``."""
        if not before:
            return  # first discovery: "resource ready" says it
        for line in pool.health_changes(before):
            LOG.info("health changed: %s", line, extra={"resource": pool.name})

    def check_devices(self) -> None:
        """Re-list the NICs when the set of RDMA devices changed (hot-plug, removal), the rediscovery
        interval passed, or a NIC without its uverbs node is due for a re-check (backoff)."""
        self.reader.check_devices(self.full)

    def unchanged(self) -> bool:
        """The idle fast probe: True when every port reads as last applied (one pread per port,
        no parsing). False for anything else (a change, a failed read, pyverbs, unreadable NICs):
        :meth:`probe` then does the full work, reading the same values again."""
        if self.holds and self.hold_due(time.monotonic()):
            return False
        return self.reader.unchanged(self._states)

    def probe(self) -> None:
        """Port states only, one pread per port: the frequent step. A removed NIC fails its reads
        and is re-listed at once; an added one waits for :meth:`check_devices` (once a second)."""
        states = self.reader.probe_states()
        if states is None:
            LOG.info("a port state read failed; re-listing the NICs", extra={"error": self.reader.failed})
            self.full()
            return
        self._apply_states(states)
