"""Supervisor: discovery, health probing, serving every pool, and surviving kubelet restarts.

Threads: one supervisor loop (the main thread) does everything periodic, each step supervised
on its own: the health probe (port states at the health interval; a NIC re-list when the set of
RDMA devices changes or the rediscovery interval passes), the socket watch (kubelet restart,
lost plugin socket, ended streams, (re)registration), the config watch and the liveness file.
It sleeps on kernel notifications (events.py: inotify on the device-plugin dir and the config
dir, rtnetlink link events where the NICs' netdevs are visible) rather than polling what they
cover (issue 15). The gRPC servers run on their own asyncio thread (server.py).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import select
import signal
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType

import grpc

from . import cdi, events, netchecks, nfd
from .config import ConfigError, PluginConfig, load_config, socket_name, socket_path_problems
from .node import sysfs
from .resources import NicHealth, ResourcePool, build_pools
from .server import KUBELET_SOCKET, Hooks, LiveStatus, PluginServer
from .supervision import Backoff, LogOnce, remove_health, write_health
from .verbs import VerbsProbe, verbs_unusable_reason

LOG = logging.getLogger(__name__)

WATCH_SECONDS = 0.1  # socket watch period when the device-plugin dir cannot be watched (inotify)
SLOW_SECONDS = 1.0  # socket watch and config file without a notification, liveness file, lost watches
COALESCE_SECONDS = 0.02
FOLLOW_UP_SECONDS = 2.0  # after a link event, probe fast: a driver may update the port state later
# The liveness file is rewritten when what it says changes and at least this often: well inside
# the loops' max_age (10 s) that `healthcheck` allows, so a live plugin never looks stale.
HEALTH_WRITE_SECONDS = 3.0


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
        self.verbs = verbs  # port states through pyverbs when it lists devices, else sysfs
        self.hooks = hooks or Hooks()
        self.cdi: dict[str, cdi.SpecWriter] = {}  # resource name -> its CDI spec (cdi.enabled)
        self._names: list[str] = []
        self._problems: dict[str, tuple[str, ...]] = {}
        self._incomplete = False
        self._last_full = 0.0
        self._unreadable: dict[str, str] = {}  # this re-list's unidentifiable devices -> why
        self._unreadable_logged: dict[str, str] = {}
        self._log_once = LogOnce(LOG)
        self._ports: sysfs.PortStateReader | None = None  # fast probe: open port-state files (issue 15)
        self._states: dict[str, tuple[str, ...] | None] | None = None  # last states applied
        self.features: nfd.FeatureFile | None = None  # --nfd-features-file (issue 15)
        self.coverage = events.LinkCoverage(frozenset(), ())  # set by every re-list

    def _skipped(self, name: str, reason: str) -> None:
        """An RDMA device that cannot be identified (soft-RoCE rxe, siw, half-removed): logged once."""
        self._unreadable[name] = reason
        if self._unreadable_logged.get(name) != reason:
            self._unreadable_logged[name] = reason
            LOG.warning("RDMA device %s left out: %s", name, reason, extra={"nic": name})

    def owners(self, nics: list[sysfs.Nic]) -> dict[str, list[str]]:
        """NIC name -> the resources whose selectors select it, in config order."""
        out: dict[str, list[str]] = {}
        for pool in self.pools:
            for nic in pool.selectors.select(nics):
                out.setdefault(nic.name, []).append(pool.name)
        return out

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
        self._unreadable = {}
        names = sysfs.list_rdma_devices(self.sysfs_root)
        nics = sysfs.read_nics(self.sysfs_root, self.dev_root, on_skip=self._skipped)
        for gone in set(self._unreadable_logged) - set(self._unreadable):
            del self._unreadable_logged[gone]
        problems = {n.name: n.problems for n in nics if n.problems}
        for name, found in problems.items():
            if self._problems.get(name) != found:  # log a problem once, not at every re-list
                for problem in found:
                    LOG.warning("NIC problem", extra={"nic": name, "problem": problem})
        self._problems = problems
        # Every listed name, readable or not: an unreadable device must not look like a change
        # (and force a full re-list) at every probe.
        self._names = names
        self._last_full = time.monotonic()
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
        for pool in self.pools:
            mine = [n for n in nics if owners.get(n.name, [pool.name])[0] == pool.name]
            before = pool.health_state()
            if pool.set_nics(mine):
                LOG.info("devices changed", extra={"resource": pool.name, "nics": pool.nic_summary()})
            self._log_health(pool, before)
        # A selected NIC whose uverbs node is not there yet (udev still creating it) is
        # re-read at every probe, so it becomes usable without waiting for the rediscovery timer.
        self._incomplete = any(
            nic.uverbs is None or not nic.uverbs.present for pool in self.pools for nic in pool.present_nics()
        )
        self.hooks.rediscovered()
        self.hooks.nics_found(nics)
        if self.features is not None:
            self.features.update([n for pool in self.pools for n in pool.present_nics()])
        self.coverage = events.link_coverage(
            [n for pool in self.pools for n in pool.present_nics()],
            lambda netdev: sysfs.netdev_ifindex(self.sysfs_root, netdev),
        )
        self._open_ports([n for n in names if n not in self._unreadable])
        if self.verbs is not None and self.verbs.available():
            self._states = None  # set_nics applied sysfs states: pyverbs' must be applied again
            self._apply_states(self.port_states(self._names) or {})
        else:
            self._states = {n.name: tuple(p.state for p in n.ports) for n in nics}
            self.hooks.port_states(self._states)
        for pool in self.pools:
            writer = self.cdi.get(pool.name)
            if writer is not None:
                try:
                    writer.update(pool.present_nics())
                except OSError as exc:
                    LOG.error("cannot write CDI spec", extra={"path": writer.path, "error": str(exc)})
        return nics

    def _open_ports(self, names: list[str]) -> None:
        if self._ports is not None:
            self._ports.close()
        self._ports = sysfs.PortStateReader(self.sysfs_root, names)

    def close(self) -> None:
        if self._ports is not None:
            self._ports.close()
            self._ports = None

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

    def _apply_states(self, states: dict[str, tuple[str, ...] | None]) -> None:
        if states is self._states:
            return  # nothing changed: the common case at every fast probe (the reader's same dict)
        if states == self._states:
            self._states = states  # the reader's dict from now on: the identity test above holds
            return
        self._states = states
        for pool in self.pools:
            before = pool.health_state()
            pool.set_port_states(states)
            self._log_health(pool, before)
        self.hooks.port_states(states)  # after the pools: the status file re-reads them on this hook

    @staticmethod
    def _log_health(pool: ResourcePool, before: dict[str, NicHealth]) -> None:
        """One line per NIC whose health changed, as a person reads it:
        ``mlx5_bond_1 port 1 DOWN: rdma/hca Unhealthy (policy all)``."""
        if not before:
            return  # first discovery: "resource ready" says it
        for line in pool.health_changes(before):
            LOG.info("health changed: %s", line, extra={"resource": pool.name})

    def check_devices(self) -> None:
        """Re-list the NICs when the set of RDMA devices changed (hot-plug, removal), one is still
        incomplete, or the rediscovery interval passed."""
        names = sysfs.list_rdma_devices(self.sysfs_root)
        due = time.monotonic() - self._last_full >= self.config.rediscovery_interval_seconds
        if names != self._names or due or self._incomplete:
            if names != self._names:
                LOG.info("RDMA devices changed on the node", extra={"before": self._names, "after": names})
            self.full()

    def unchanged(self) -> bool:
        """The idle fast probe: True when every port reads as last applied (one pread per port,
        no parsing). False for anything else (a change, a failed read, pyverbs, unreadable NICs):
        :meth:`probe` then does the full work, reading the same values again."""
        ports = self._ports
        if ports is None or self._unreadable or (self.verbs is not None and self.verbs.available()):
            return False
        return ports.read() is self._states

    def probe(self) -> None:
        """Port states only, one pread per port: the frequent step. A removed NIC fails its reads
        and is re-listed at once; an added one waits for :meth:`check_devices` (once a second)."""
        names = self._names
        states = self.port_states([n for n in names if n not in self._unreadable] if self._unreadable else names)
        if states is None:
            failed = self._ports.failed if self._ports is not None else ""
            LOG.info("a port state read failed; re-listing the NICs", extra={"error": failed})
            self.full()
            return
        self._apply_states(states)


class Supervisor:
    def __init__(
        self,
        config: PluginConfig,
        sysfs_root: str,
        dev_root: str,
        device_plugin_dir: str,
        hooks: Hooks | None = None,
        procfs_root: str = "/proc",
        cdi_dir: str | None = None,
        config_path: str | None = None,
        verbs: VerbsProbe | None = None,
        health_file: str | None = None,
    ) -> None:
        problems = socket_path_problems(config, device_plugin_dir)
        if problems:
            raise ConfigError("invalid config for this device-plugin dir:\n" + "\n".join(f"  - {p}" for p in problems))
        self.config = config
        self.dir = device_plugin_dir
        self.sysfs_root = sysfs_root
        self.procfs_root = procfs_root
        self.config_path = config_path
        self.health_file = health_file
        self._config_seen = self._config_mtime()
        self.pools = build_pools(config)
        self.hooks = hooks or Hooks()
        self.hooks.pools_ready(self.pools)
        self.discovery = Discovery(config, self.pools, sysfs_root, dev_root, verbs, self.hooks)
        for pool in self.pools:
            if cdi_dir and pool.cdi_kind is not None:
                self.discovery.cdi[pool.name] = cdi.SpecWriter(
                    cdi_dir, pool.cdi_kind, config.mode, config.char_devices.umad, config.char_devices.issm
                )
        self.servers = [
            PluginServer(p, device_plugin_dir, socket_name(p.name), self.hooks, self._stream_ended) for p in self.pools
        ]
        self.stop_event = threading.Event()
        self._kubelet_id: tuple[int, int] | None = None
        self._registered: set[str] = set()
        self._stood_down: set[str] = set()  # another (newer) instance serves these
        self._ended: set[str] = set()  # resources whose ListAndWatch stream ended (from the gRPC loop)
        self._ended_lock = threading.Lock()
        self._register_backoff = {s.pool.name: Backoff() for s in self.servers}
        self._serve_backoff = {s.pool.name: Backoff() for s in self.servers}
        self._unregistered_since: dict[str, float] = {s.pool.name: time.time() for s in self.servers}
        self.heartbeats: dict[str, float] = {}  # loop step name -> wall time it last completed
        self._health_written = 0.0
        self._changes = 0  # bumped when registration state changes: the liveness file says so at once
        self._health_said = -1
        # The loop sleeps in select(): a write to this pipe ends the sleep (stop, stream end).
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._dir_watch: events.DirWatch | None = None
        self._config_watch: events.DirWatch | None = None  # the config file's directory
        self._links: events.LinkEvents | None = None
        self._links_failed = False
        self._kubelet_present = False
        self._watched_at = 0.0
        self._poller = select.poll()
        self._poller.register(self._wake_r, select.POLLIN)
        self._sources: dict[int, events.DirWatch | events.LinkEvents] = {}
        self._coverage_said: tuple[bool, events.LinkCoverage] | None = None
        self._kubelet_sock = os.path.join(device_plugin_dir, KUBELET_SOCKET)
        self.once = LogOnce(LOG)
        self.hooks.supervising(self.live_status)

    def live_status(self) -> LiveStatus:
        return LiveStatus(
            loops=dict(self.heartbeats),
            registered=frozenset(self._registered),
            streams={s.pool.name: s.open_streams() if s.serving else 0 for s in self.servers},
        )

    # ------------------------------------------------------------------ threads

    def _loop(self) -> None:
        """The supervisor loop: every step supervised and time-stamped on its own ("probe", "watch":
        the loop labels of the metrics, the alert and the liveness file).

        It sleeps in one ``select`` on the wake pipe and the kernel's notifications, and wakes for:
        a port-state probe (every ``health.intervalSeconds``, or ``linkEventsIntervalSeconds`` while
        link events cover every selected port), a link event (probe at once, then fast for a while),
        a change in the device-plugin dir (kubelet restart, lost socket), a stream end or a stop,
        a change of the config file, a registration retry that is due, and once a second for the
        rest (sockets and config in case a notification was lost, liveness file, lost watches).
        An idle plugin on a node whose netdevs it sees wakes about once a second; without them, at
        the probe interval (issue 15).
        """
        fast = self.config.health.interval_seconds
        relaxed = self.config.health.link_events_interval_seconds
        now = time.monotonic()
        next_probe = next_slow = now
        follow_until = 0.0  # after a link event, probe at the fast interval until then
        watch_due = True
        while not self.stop_event.is_set():
            now = time.monotonic()
            soon = now + COALESCE_SECONDS  # what falls due this soon runs now: one wake-up, not two
            if soon >= next_slow:
                next_slow = now + SLOW_SECONDS
                self._supervised("event sources", self._keep_watching)
                self._supervised("health probe", self._check_devices)
                self._supervised("config watch", self._watch_config)
                watch_due = True
            covered = self._links is not None and self.discovery.coverage.complete
            period = relaxed if covered and now >= follow_until else fast
            if soon >= next_probe:
                next_probe = now + period
                self._supervised("health probe", self._probe)
                self.heartbeats["probe"] = time.time()  # a pass completed (a failed step is logged)
            watch_at = self._next_watch()
            if watch_due or soon >= watch_at:
                watch_due = False
                self._watched_at = now
                if self._supervised("socket watch", self._tick):
                    self.heartbeats["watch"] = time.time()
                self._supervised("health file", self._write_health)
                watch_at = self._next_watch()
            # A retry the pass could not act on (its due time passed) must not make this a busy loop.
            other = min(next_slow, max(watch_at, now + WATCH_SECONDS))
            woke = self._wait(min(next_probe, other) - time.monotonic())
            # The idle fast path: while only probes fall due, sleep and re-read the port states with
            # as little Python as possible: in a pod network this runs 10 times a second (issue 15).
            # Anything else (a change, a failed read, a notification) goes back to the full pass.
            while not woke and next_probe + period < other - COALESCE_SECONDS and self.discovery.unchanged():
                next_probe = time.monotonic() + period
                self.heartbeats["probe"] = time.time()
                woke = self._wait(next_probe - time.monotonic())
            for ready in woke:
                if ready is self._dir_watch:
                    watch_due = True
                elif ready is self._config_watch:
                    self._supervised("config watch", self._watch_config)
                elif ready is self._links:
                    follow_until = time.monotonic() + FOLLOW_UP_SECONDS
                    next_probe = 0.0
                else:
                    watch_due = True  # a stream ended (or a stop): look at the sockets now

    def _watching(self, source: events.DirWatch | events.LinkEvents, on: bool) -> None:
        """(Un)register a notification source with the loop's poll set."""
        if on:
            self._poller.register(source.fileno(), select.POLLIN)
            self._sources[source.fileno()] = source
        else:
            self._poller.unregister(source.fileno())
            del self._sources[source.fileno()]
            source.close()

    def _wait(self, timeout: float) -> list[object]:
        """Sleep until a notification or ``timeout``; which sources had something (drained).
        One ``poll`` on descriptors registered once: the cheapest sleep, it runs 10 times a second."""
        out: list[object] = []
        for fd, _mask in self._poller.poll(max(0, int(timeout * 1000 + 0.999))):
            source = self._sources.get(fd)
            if source is None:  # the wake pipe
                with contextlib.suppress(BlockingIOError):
                    os.read(self._wake_r, 4096)
                out.append(fd)
                continue
            try:
                seen = (
                    source.drain(self.discovery.coverage.netdevs)
                    if isinstance(source, events.LinkEvents)
                    else source.drain()
                )
            except OSError as exc:  # a notification source broke: drop it, polling covers for it
                self._lost(source, exc)
                out.append(fd)  # look at everything once now
                continue
            if seen:
                out.append(source)
        return out

    def _lost(self, source: events.DirWatch | events.LinkEvents, exc: OSError) -> None:
        LOG.warning("a notification source failed (%s); polling instead", exc, extra={"source": type(source).__name__})
        self._watching(source, False)
        if source is self._links:
            self._links, self._links_failed = None, True
            self._say_coverage()
        elif source is self._dir_watch:
            self._dir_watch = None  # re-opened at the next once-a-second pass
        elif source is self._config_watch:
            self._config_watch = None

    def _next_watch(self) -> float:
        """When the socket watch must run next without a notification: at the polling period when
        the device-plugin dir cannot be watched, else when a retry (serve, register) is due."""
        if self._dir_watch is None:
            return self._watched_at + WATCH_SECONDS
        due = float("inf")
        for server in self.servers:
            name = server.pool.name
            if name in self._stood_down:
                continue
            if not server.serving:
                due = min(due, self._serve_backoff[name].next_at)
            elif name not in self._registered and self._kubelet_present:
                due = min(due, self._register_backoff[name].next_at)
        return due

    def _probe(self) -> None:
        self.discovery.probe()
        self._say_coverage()  # a failed read re-lists, which may change the coverage

    def _check_devices(self) -> None:
        """Hot-plug, a NIC still incomplete, the rediscovery timer; and say when coverage changed."""
        self.discovery.check_devices()
        self._say_coverage()

    def _say_coverage(self) -> None:
        """One line when how port changes are noticed changes (events vs polling)."""
        now = (self._links is not None, self.discovery.coverage)
        if now == self._coverage_said:
            return
        self._coverage_said = now
        health = self.config.health
        if now[0] and now[1].complete:
            LOG.info(
                "port states: re-read at once on link events of %s; polled every %g s besides",
                ",".join(sorted(now[1].netdevs)),
                health.link_events_interval_seconds,
            )
        else:
            why = "; ".join(now[1].uncovered) if now[0] else "linkEvents off or unavailable"
            LOG.info("port states: polled every %g s (%s)", health.interval_seconds, why or "no NIC selected")

    def _keep_watching(self) -> None:
        """Open the notifications that are missing: at start, and after a watched dir went away."""
        if self._dir_watch is not None and not self._dir_watch.alive:
            self._watching(self._dir_watch, False)
            self._dir_watch = None
            LOG.info("the device-plugin dir watch ended (dir removed?); polling it until it can be watched again")
        if self._dir_watch is None:
            try:
                self._dir_watch = events.DirWatch(
                    self.dir, names=[KUBELET_SOCKET, *(os.path.basename(s.path) for s in self.servers)]
                )
            except OSError as exc:
                self.once.problem(
                    "dir watch", "cannot watch %s (%s); polling it every %g s", self.dir, exc, WATCH_SECONDS
                )
            else:
                self._watching(self._dir_watch, True)
                self.once.cleared("dir watch", f"watching {self.dir} for kubelet restarts")
        if self._config_watch is not None and not self._config_watch.alive:
            self._watching(self._config_watch, False)
            self._config_watch = None
        if self.config_path and self._config_watch is None:
            path = os.path.abspath(self.config_path)
            # A ConfigMap volume swaps the "..data" symlink the file points through.
            with contextlib.suppress(OSError):  # unwatchable: the once-a-second stat still sees a change
                self._config_watch = events.DirWatch(
                    os.path.dirname(path), events.FILE_EVENTS, [os.path.basename(path), "..data"]
                )
                self._watching(self._config_watch, True)
        if self._links is None and self.config.health.link_events and not self._links_failed:
            try:
                self._links = events.LinkEvents()
            except OSError as exc:
                self._links_failed = True  # no netlink here (seccomp, old kernel): polling it is, for good
                LOG.warning("cannot listen to link events (%s); port states are polled", exc)
            else:
                self._watching(self._links, True)
            self._say_coverage()

    def wake(self) -> None:
        """Run the loop's next pass now (a stop, a stream end); safe from any thread and signal handler."""
        with contextlib.suppress(BlockingIOError):
            os.write(self._wake_w, b"!")

    def _supervised(self, what: str, step: Callable[[], None]) -> bool:
        """Run one step of a loop; an exception is logged once (with its context) and the loop goes on."""
        try:
            step()
        except Exception as exc:  # a loop must never die: log, and try again next time
            self.once.problem(what, "%s failed (%s: %s); retrying", what, type(exc).__name__, exc, level=logging.ERROR)
            LOG.debug("%s failed", what, exc_info=True)
            return False
        if what in self.once.pending:  # the common case builds no message
            self.once.cleared(what, f"{what} works again")
        return True

    # ------------------------------------------------------------------ config changes (applied on restart)

    def _config_mtime(self) -> int | None:
        if not self.config_path:
            return None
        try:
            return os.stat(self.config_path).st_mtime_ns
        except OSError:
            return None

    def _watch_config(self) -> None:
        """The config is read at start only: say so when the file changes, loudly for a mode change."""
        mtime = self._config_mtime()
        if mtime is None or mtime == self._config_seen:
            return
        self._config_seen = mtime
        try:
            new = load_config(self.config_path)
        except ConfigError as exc:
            LOG.warning("config file changed but is invalid; still running with the config read at start: %s", exc)
            return
        if new.mode != self.config.mode:
            LOG.warning(
                "config file changed: mode %s differs from the running mode %s; the new mode takes effect only "
                "when the plugin restarts (move RDMA pods off the node first: their allocations would break)",
                new.mode,
                self.config.mode,
                extra={"running_mode": self.config.mode, "config_mode": new.mode, "config": self.config_path},
            )
        elif new != self.config:
            LOG.info("config file changed; the changes take effect when the plugin restarts")

    # ------------------------------------------------------------------ non-hostNetwork

    def check_non_host_network(self) -> list[netchecks.Finding]:
        """Start checks (nonHostNetwork.enabled); raises ChecksFailed when enforced and failing."""
        selected = {n.name: n for pool in self.pools for n in pool.present_nics()}
        gids: dict[str, list[str]] | None = None
        verbs = self.discovery.verbs
        if verbs is not None and verbs.available():
            known = set(verbs.devices())
            gids = {n: [g for g, t in verbs.gids(n) if t == "RoCE v2"] for n in selected if n in known}
        findings = netchecks.read_and_check(list(selected.values()), self.sysfs_root, self.procfs_root, gids)
        enforce = self.config.non_host_network.checks == "enforce"
        if not findings:
            LOG.info(
                "non-hostNetwork checks passed: RDMA netns mode shared, IPv6 on every selected NIC's netdev",
                extra={"netdevs": ",".join(sorted({netchecks.gid_netdev(n) for n in selected.values()}))},
            )
        for finding in findings:
            LOG.log(
                logging.ERROR if enforce else logging.WARNING,
                "non-hostNetwork check failed: %s",
                finding.message(),
                extra={"nic": finding.nic, "netdev": finding.netdev, "checks": self.config.non_host_network.checks},
            )
        if findings and enforce:
            for writer in self.discovery.cdi.values():
                writer.remove()
            raise netchecks.ChecksFailed(findings)
        if findings:
            LOG.warning("serving despite failed non-hostNetwork checks (nonHostNetwork.checks: warn)")
        return findings

    # ------------------------------------------------------------------ kubelet events

    def _kubelet_identity(self) -> tuple[int, int] | None:
        try:
            st = os.stat(self._kubelet_sock)
            return (st.st_ino, st.st_ctime_ns)
        except OSError:
            return None

    def _stream_ended(self, resource: str) -> None:
        """Called on the gRPC loop when a ListAndWatch stream ends while we are serving."""
        with self._ended_lock:
            self._ended.add(resource)
        self.wake()  # the loop may sleep for a second: the re-registration must not wait for it

    def _unregister(self, name: str) -> None:
        if name in self._registered:
            self._registered.discard(name)
            self._unregistered_since[name] = time.time()
            self._changes += 1

    def _tick(self) -> None:
        """One pass of the main loop: react to every kubelet and socket event, then (re)register."""
        now = time.monotonic()
        kubelet = self._kubelet_identity()
        self._kubelet_present = kubelet is not None  # registration retries wait for it (dir watch)
        if kubelet is None:
            self.once.problem("kubelet", "kubelet.sock is missing in %s: waiting for the kubelet", self.dir)
        else:
            self.once.cleared("kubelet", "kubelet.sock is back")
        if kubelet is not None and kubelet != self._kubelet_id:
            if self._kubelet_id is not None:
                LOG.info("kubelet.sock re-created: kubelet restarted; registering every resource again")
                self.hooks.kubelet_restarted()
            self._kubelet_id = kubelet
            for server in self.servers:
                self._unregister(server.pool.name)
                self._register_backoff[server.pool.name].now_please()
        ended: set[str] = set()
        if self._ended:  # read without the lock: the common case, nothing ended
            with self._ended_lock:
                ended, self._ended = self._ended, set()
        for name in sorted(ended):
            self.hooks.stream_ended(name)
            if name in self._registered:
                LOG.warning(
                    "the kubelet ended the ListAndWatch stream of %s; registering again", name, extra={"resource": name}
                )
                self._unregister(name)
                self._register_backoff[name].wait_then_retry(now)
        for server in self.servers:
            self._keep_serving(server, now)
        if kubelet is not None:
            for server in self.servers:
                name = server.pool.name
                if server.serving and name not in self._registered and self._register_backoff[name].due(now):
                    self._register(server, now)

    def _keep_serving(self, server: PluginServer, now: float) -> None:
        name = server.pool.name
        state = server.state() if server.serving else "stopped"
        if state == "ours":
            return
        if state == "replaced":
            LOG.warning(
                "another instance now serves %s at %s (a newer pod on this node); standing down without touching "
                "its socket",
                name,
                server.path,
                extra={"resource": name},
            )
            server.stop()
            self._stood_down.add(name)
            self._changes += 1
            self._unregister(name)
            return
        if state == "missing":
            LOG.info("plugin socket %s was removed; serving it again", server.path, extra={"resource": name})
            server.stop()
            self._unregister(name)
        if name in self._stood_down:
            if os.path.lexists(server.path):
                return  # the other instance still serves it
            LOG.info("the other instance's socket is gone; serving %s again", name, extra={"resource": name})
            self._stood_down.discard(name)
            self._changes += 1
        backoff = self._serve_backoff[name]
        if not backoff.due(now):
            return
        try:
            server.start()
        except (OSError, RuntimeError) as exc:
            backoff.failed(now)
            self.once.problem(
                f"serve {name}",
                "cannot serve %s at %s (%s); retrying with backoff up to 5 s",
                name,
                server.path,
                exc,
                extra={"resource": name},
            )
            return
        backoff.succeeded()
        self.once.cleared(f"serve {name}", f"serving {name} again", extra={"resource": name})
        self._unregister(name)
        self._register_backoff[name].now_please()

    def _register(self, server: PluginServer, now: float) -> None:
        name = server.pool.name
        backoff = self._register_backoff[name]
        try:
            server.register()
        except (grpc.RpcError, OSError) as exc:
            detail = exc.details() if isinstance(exc, grpc.RpcError) else str(exc)
            backoff.failed(now)
            self.once.problem(
                f"register {name}",
                "registration of %s with the kubelet failed: %s; retrying with backoff (0.5 s doubling to 5 s)",
                name,
                detail,
                extra={"resource": name},
            )
            return
        if backoff.failures:
            LOG.info("registered %s after %d failed attempts", name, backoff.failures, extra={"resource": name})
        self.once.cleared(f"register {name}")
        backoff.succeeded()
        self._registered.add(name)
        self._unregistered_since.pop(name, None)
        self._changes += 1

    def _write_health(self) -> None:
        if not self.health_file:
            return
        if self._changes == self._health_said and time.time() - self._health_written < HEALTH_WRITE_SECONDS:
            return
        # Stamped before writing: a failing write is retried at the same pace, not at every pass.
        self._health_written, self._health_said = time.time(), self._changes
        health = self.config.health
        probe_max = max(10.0, 5 * max(health.interval_seconds, health.link_events_interval_seconds))
        doc = {
            "pid": os.getpid(),
            "time": time.time(),
            "loops": {
                name: {"last": last, "max_age": probe_max if name == "probe" else 10.0}
                for name, last in self.heartbeats.items()
            },
            "registered": sorted(self._registered),
            "stood_down": sorted(self._stood_down),
            "unregistered_since": {n: t for n, t in self._unregistered_since.items() if n not in self._stood_down},
        }
        write_health(self.health_file, doc)

    def run(self) -> None:
        nics = self.discovery.full()
        overlap = self.discovery.exclusive_overlaps(nics)
        if overlap:
            raise ConfigError("invalid config: " + "; ".join(overlap))
        for pool in self.pools:
            LOG.info(
                "resource ready",
                extra={
                    "resource": pool.name,
                    "mode": self.config.mode,
                    "nics": ",".join(n["name"] for n in pool.nic_summary()),  # type: ignore[misc]
                    "devices": len(pool.snapshot()[1]),
                },
            )
        if not any(pool.nic_summary() for pool in self.pools):
            LOG.warning("no RDMA NIC matches any resource's selectors", extra={"found": [n.name for n in nics]})
        if self.config.non_host_network.enabled:
            self.check_non_host_network()
        self.heartbeats["probe"] = self.heartbeats["watch"] = time.time()
        try:
            self._loop()
        finally:
            for pool in self.pools:
                pool.close()
            self.discovery.close()
            for source in list(self._sources.values()):
                self._watching(source, False)
            for server in self.servers:
                self._supervised("stop", server.stop)
            if self.discovery.features is not None:
                self.discovery.features.remove()  # the node's NFD labels go with the plugin
            os.close(self._wake_r)
            os.close(self._wake_w)
            if self.health_file:
                remove_health(self.health_file)
            LOG.info("stopped")


def serve(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    hooks: Hooks | None = None
    metrics_address = args.metrics_address
    if metrics_address:
        from .metrics import MetricsHooks

        metrics = MetricsHooks()
        try:
            host, port = metrics.serve(metrics_address)
        except (OSError, ValueError) as exc:
            print(f"rdma-device-plugin: cannot serve metrics on {metrics_address}: {exc}", file=sys.stderr)
            return 2
        LOG.info("serving Prometheus metrics", extra={"address": f"{host}:{port}"})
        hooks = metrics
    from .status import StatusFileHooks, default_status_file

    hooks = StatusFileHooks(args.status_file or default_status_file(args.device_plugin_dir), hooks)
    verbs = VerbsProbe()
    unusable = verbs_unusable_reason(args.verbs_dev_dir)
    if unusable:
        verbs.skip(unusable)  # not even imported: libibverbs could not open a device here
    verbs.available()  # decides pyverbs vs sysfs once, with one log line
    supervisor = Supervisor(
        config,
        args.sysfs_root,
        args.dev_root,
        args.device_plugin_dir,
        hooks,
        procfs_root=args.procfs_root,
        cdi_dir=args.cdi_dir if config.cdi.enabled else None,
        config_path=args.config,
        verbs=verbs,
        health_file=args.health_file or None,
    )

    if args.nfd_features_file:
        supervisor.discovery.features = nfd.FeatureFile(
            args.nfd_features_file, config.mode, args.sysfs_root, args.procfs_root, config.rediscovery_interval_seconds
        )

    def on_signal(signum: int, frame: FrameType | None) -> None:
        LOG.info("signal received, stopping", extra={"signal": signal.Signals(signum).name})
        supervisor.stop_event.set()
        supervisor.wake()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    LOG.info(
        "starting",
        extra={
            "mode": config.mode,
            "resources": ",".join(r.name for r in config.resources),
            "config": args.config or "(built-in defaults)",
            "note": "the mode is read at start; a config with another mode takes effect on restart",
        },
    )
    try:
        supervisor.run()
    except netchecks.ChecksFailed as exc:
        print("rdma-device-plugin: non-hostNetwork checks failed; not serving:", file=sys.stderr)
        for finding in exc.findings:
            print(f"  - {finding.message()}", file=sys.stderr)
        print("  (set nonHostNetwork.checks: warn to serve anyway)", file=sys.stderr)
        return 3
    finally:
        verbs.close()
        stop = getattr(hooks, "stop", None)
        if stop is not None:
            stop()
    return 0
