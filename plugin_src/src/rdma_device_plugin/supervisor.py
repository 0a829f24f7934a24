"""The supervisor: one loop on the main thread runs everything periodic, and never blocks.

Each step is supervised and time-stamped on its own (``probe``: discovery and the health probe;
``watch``: the kubelet and the registrations; the loop labels of the metrics, the stale-loop alert
and the liveness file). It sleeps in one ``poll`` on kernel notifications (events.py: inotify on
the device-plugin dir and the config dir, rtnetlink link events where the NICs' netdevs are
visible) and on a wake pipe the gRPC loop writes to (a stream of the kubelet opened or ended, a
Register answered: :mod:`.server`). Calls to the kubelet run on the gRPC loop, so a kubelet that
never answers delays nothing here. Registration is one state machine per resource
(:mod:`.registration`); what the node has comes from :mod:`.discovery`.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import contextlib
import faulthandler
import functools
import logging
import os
import select
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import FrameType, MappingProxyType

from rdma_node import sysfs

from . import cdi, events, logs, netchecks, nfd, numa_pools, sockets
from .config import PluginConfig, load_config, socket_path_problems
from .config_base import ConfigError
from .discovery import Discovery
from .kubeletapi import CHECKPOINT, KUBELET_SOCKET
from .published import NodeView, RegistrationView
from .registration import Registration
from .resources import build_pools
from .server import Hooks, PluginServer, stop_all
from .supervision import LogOnce, remove_health, write_health
from .verbs import VerbsProbe, verbs_unusable_reason

LOG = logging.getLogger(__name__)

WATCH_SECONDS = 0.1  # socket watch period when the device-plugin dir cannot be watched (inotify)
SLOW_SECONDS = 1.0  # socket watch and config file without a notification, liveness file, lost watches
COALESCE_SECONDS = 0.02
FOLLOW_UP_SECONDS = 2.0  # after a link event, probe fast: a driver may update the port state later
# The liveness file is rewritten when what it says changes and at least this often: well inside
# the loops' max_age (10 s) that `healthcheck` allows, so a live plugin never looks stale.
HEALTH_WRITE_SECONDS = 3.0
STOP_GRACE_SECONDS = 0.5  # open streams get this long to end at exit (all servers together)
KUBELET_MISSING_WARN_SECONDS = 60.0  # kubelet.sock gone this long is more than a kubelet restart
EXIT_DIR_DELETED = 4  # serve's exit code when the device-plugin dir was deleted under it
PORT_PROBE = "port probe"  # the two steps of the health probe (failures are counted per step)
DEVICE_CHECK = "device check"


@dataclass
class ProbeEpisode:
    """A probe step failing since ``since`` (monotonic), ``failures`` runs in a row."""

    since: float
    failures: int = 0
    error: str = ""


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
        lock: sockets.InstanceLock | None = None,
    ) -> None:
        problems = socket_path_problems(config, device_plugin_dir)
        if problems:
            raise ConfigError.listing("for this device-plugin dir", problems)
        self.config = config
        self.dir = device_plugin_dir
        self.sysfs_root = sysfs_root
        self.procfs_root = procfs_root
        self.config_path = config_path
        self.health_file = health_file
        self._config_seen = self._config_mtime()
        self.pools = build_pools(config, self._numa_nodes(config, sysfs_root))
        problems = numa_pools.snapshot_problems([p.spec for p in self.pools])
        if problems:
            raise ConfigError.listing("for this node", problems)
        self.hooks = hooks or Hooks()
        self.hooks.pools_ready(self.pools)
        self.discovery = Discovery(config, self.pools, sysfs_root, dev_root, verbs, self.hooks)
        for pool in self.pools:
            if cdi_dir and pool.cdi_kind is not None:
                self.discovery.cdi[pool.name] = cdi.SpecWriter(
                    cdi_dir,
                    pool.cdi_kind,
                    config.mode,
                    config.char_devices.umad,
                    config.char_devices.issm,
                    per_numa=pool.spec.kind == numa_pools.LOCAL,
                )
        self.stop_event = threading.Event()
        self.stop_signal = ""  # set by serve's signal handler; logged by the loop
        self.once = LogOnce(LOG)
        # Events from the gRPC loop (streams, Register results), run here in order.
        # appended on the gRPC loop, popped here: a deque's append and popleft need no lock
        self._inbox: collections.deque[Callable[[], None]] = collections.deque()
        self.registrations = [
            Registration(pool, device_plugin_dir, self.hooks, self._stream_event, self._register_done, self.once)
            for pool in self.pools
        ]
        self._kubelet_id: tuple[int, int] | None = None
        self.heartbeats: dict[str, float] = {}  # loop step name -> wall time it last completed
        self.exit_reason: str | None = None  # why the loop ended by itself (serve then exits non-zero)
        self._kubelet_missing_since: float | None = None
        self._probe_episodes: dict[str, ProbeEpisode] = {}  # the probe steps failing now
        self._probe_blocked: str | None = None  # why every resource is Unhealthy (the probe failed too long)
        self._health_written = 0.0
        self._health_said = -1
        # The loop sleeps in poll(): a write to this pipe ends the sleep (stop, gRPC event).
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
        self.lock = lock or sockets.InstanceLock(device_plugin_dir)
        self._loops: Mapping[str, float] = MappingProxyType({})  # published copy of heartbeats
        self.view: NodeView | None = None  # published for the status file and metrics (published.py)
        self.hooks.supervising(lambda: self._loops)

    @staticmethod
    def _numa_nodes(config: PluginConfig, sysfs_root: str) -> tuple[int, ...]:
        """The node's NUMA nodes, read once at start for numaPools (the kubelet's own view)."""
        if not any(r.numa_pools for r in config.resources) or config.mode != "shared":
            return ()
        nodes = sysfs.numa_nodes(sysfs_root)
        if not nodes:
            LOG.warning(
                "numaPools: cannot read the node's NUMA nodes (%s/devices/system/node/online); serving the "
                "configured resources only",
                sysfs_root,
            )
        return nodes

    def _beat(self, *steps: str) -> None:
        """A step of the loop completed: its heartbeat, published as a new immutable mapping."""
        now = time.time()
        for step in steps:
            self.heartbeats[step] = now
        self._loops = MappingProxyType(dict(self.heartbeats))

    def _publish(self) -> None:
        """Publish a new NodeView when anything in it changed (every part is replaced on change,
        never changed in place, so comparing them is cheap)."""
        view = NodeView(
            pools=tuple(pool.view for pool in self.pools),
            port_states=self.discovery.states,
            nics=self.discovery.nics,
            affinity=self.discovery.affinity,
            held=self.discovery.held,
            registrations=tuple(
                RegistrationView(r.name, r.state.value, r.kubelet_stream_open, r.confirmed_at, r.unregistered_since)
                for r in self.registrations
            ),
            probe_failing=bool(self._probe_episodes),
            state_changes=self.discovery.state_changes,
        )
        old = self.view
        if (
            old is not None
            and all(
                getattr(view, f) is getattr(old, f)
                for f in ("port_states", "nics", "affinity", "held", "state_changes")
            )
            and view.pools == old.pools
            and view.registrations == old.registrations
            and (view.probe_failing == old.probe_failing)
        ):
            return
        self.view = view
        self.hooks.published(view)

    # ------------------------------------------------------------------ threads

    def _loop(self) -> None:
        """The supervisor loop: every step supervised and time-stamped on its own ("probe", "watch":
        the loop labels of the metrics, the alert and the liveness file).

        It sleeps in one ``poll`` on the wake pipe and the kernel's notifications, and wakes for:
        a port-state probe (every ``health.intervalSeconds``, or ``linkEventsIntervalSeconds`` while
        link events cover every selected port), a link event (probe at once, then fast for a while),
        a change in the device-plugin dir (kubelet restart, lost socket), a gRPC event (a stream of the
        kubelet opened or ended, a Register answered) or a stop,
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
            slow = soon >= next_slow
            if slow:
                next_slow = now + SLOW_SECONDS
                self._supervised("event sources", self._keep_watching)
                self._supervised("instance lock", self._hold_lock)
                self._probe_run(DEVICE_CHECK, self._check_devices)
                self._supervised("config watch", self._watch_config)
                watch_due = True
            covered = self._links is not None and self.discovery.coverage.complete
            period = relaxed if covered and now >= follow_until else fast
            if soon >= next_probe:
                next_probe = now + period
                self._probe_run(PORT_PROBE, self._probe)
            watch_at = self._next_watch()
            if watch_due or soon >= watch_at:
                watch_due = False
                self._watched_at = now
                if self._supervised("socket watch", functools.partial(self._watch_sockets, slow)):
                    self._beat("watch")
                self._supervised("health file", self._write_health)
                watch_at = self._next_watch()
            self._supervised("publish", self._publish)  # what this pass changed, for the other threads
            # A retry the pass could not act on (its due time passed) must not make this a busy loop.
            other = min(next_slow, max(watch_at, now + WATCH_SECONDS))
            woke = self._wait(min(next_probe, other) - time.monotonic())
            # The idle fast path: while only probes fall due, sleep and re-read the port states with
            # as little Python as possible: in a pod network this runs 10 times a second (issue 15).
            # Anything else (a change, a failed read, a notification) goes back to the full pass.
            while not woke and next_probe + period < other - COALESCE_SECONDS and self._unchanged():
                next_probe = time.monotonic() + period
                self._beat("probe")  # a probe that succeeded: the port states are read
                woke = self._wait(next_probe - time.monotonic())
            for ready in woke:
                if isinstance(ready, events.DirWatch) and ready is self._dir_watch:
                    watch_due = True
                    if not ready.alive:  # the dir itself was removed or moved
                        self._check_dir()
                elif ready is self._config_watch:
                    self._supervised("config watch", self._watch_config)
                elif ready is self._links:
                    follow_until = time.monotonic() + FOLLOW_UP_SECONDS
                    next_probe = 0.0
                else:
                    watch_due = True  # a gRPC event (stream, Register result) or a stop: look now

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
        the device-plugin dir cannot be watched, else when a registration's retry or deadline is due."""
        if self._dir_watch is None:
            return self._watched_at + WATCH_SECONDS
        return min((r.next_due(self._kubelet_present) for r in self.registrations), default=float("inf"))

    def _unchanged(self) -> bool:
        """The idle fast probe; a failing one goes back to the full probe, which counts the failure."""
        try:
            return self.discovery.unchanged()
        except Exception:
            return False

    def probe_bound(self) -> float:
        """How long the probe may go without a success: the liveness file's max age for the probe loop,
        and how long failures last before every resource turns Unhealthy."""
        health = self.config.health
        return max(10.0, 5 * max(health.interval_seconds, health.link_events_interval_seconds))

    def _probe_run(self, what: str, step: Callable[[], None]) -> None:
        """A probe run: ``port probe`` (the port states) or ``device check`` (the device list and its
        re-list). A failure is a failure: it is counted (metrics), logged once per episode, the probe's
        heartbeat moves only when the port probe succeeds, and after ``probe_bound`` seconds of
        failing every resource turns Unhealthy: the plugin cannot vouch for ports it cannot read
        (and liveness fails, its heartbeat being that old)."""
        try:
            step()
        except Exception as exc:
            self._probe_failed(what, exc)
        else:
            self._probe_succeeded(what)

    def _probe_failed(self, what: str, exc: Exception) -> None:
        now = time.monotonic()
        self.hooks.probe_failed()
        episode = self._probe_episodes.setdefault(what, ProbeEpisode(now))
        episode.failures += 1
        episode.error = f"{type(exc).__name__}: {exc}"
        if episode.failures == 1:
            LOG.error(
                "%s failed (%s); retried at every probe; failing for %g s, every resource turns Unhealthy and "
                "liveness fails",
                what,
                episode.error,
                self.probe_bound(),
            )
        LOG.debug("%s failed", what, exc_info=True)
        if self._probe_blocked is None and now - episode.since >= self.probe_bound():
            self._probe_blocked = f"the {what} has failed for {now - episode.since:.0f} s ({episode.error})"
            LOG.error("%s: every resource is Unhealthy until it works again", self._probe_blocked)
            for pool in self.pools:
                pool.set_probe_failure(self._probe_blocked)

    def _probe_succeeded(self, what: str) -> None:
        if what == PORT_PROBE:
            self._beat("probe")
        episode = self._probe_episodes.pop(what, None)
        if episode is None:
            return
        LOG.info(
            "%s works again after %d failed runs in %.1f s",
            what,
            episode.failures,
            time.monotonic() - episode.since,
        )
        if self._probe_blocked is not None and not self._probe_episodes:
            self._probe_blocked = None
            for pool in self.pools:
                pool.set_probe_failure(None)

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
                logs.names(sorted(now[1].netdevs)),
                health.link_events_interval_seconds,
            )
        else:
            uncovered = now[1].uncovered
            why = "; ".join(uncovered[:1]) if now[0] else "linkEvents off or unavailable"
            if now[0] and len(uncovered) > 1:
                why += f"; and {len(uncovered) - 1} more NICs"
            LOG.info("port states: polled every %g s (%s)", health.interval_seconds, why or "no NIC selected")
            LOG.debug("port states: no link events for: %s", "; ".join(uncovered))

    def _check_dir(self) -> None:
        """Exit when the device-plugin dir we see was deleted: a link count of 0 means our view of it is
        a bind mount (the chart's hostPath) of a directory the host removed. The kubelet creates a new
        one, which only a new container sees: waiting here would wait for a kubelet.sock that never
        appears in this one (until liveness gives up, minutes later)."""
        try:
            links = os.stat(self.dir).st_nlink
        except OSError:
            return  # gone from our view too (no bind mount): it is polled until it comes back
        if links == 0 and self.exit_reason is None:
            self.exit_reason = (
                f"the device-plugin dir {self.dir} was deleted on the host (its directory has no links left); "
                "exiting so that the container restarts with the new one"
            )
            LOG.critical("%s", self.exit_reason)
            self.stop_event.set()
            self.wake()

    def _keep_watching(self) -> None:
        """Open the notifications that are missing: at start, and after a watched dir went away."""
        self._check_dir()
        if self._dir_watch is not None and not self._dir_watch.alive:
            self._watching(self._dir_watch, False)
            self._dir_watch = None
            LOG.info("the device-plugin dir watch ended (dir removed?); polling it until it can be watched again")
        if self._dir_watch is None:
            try:
                self._dir_watch = events.DirWatch(
                    self.dir,
                    names=[KUBELET_SOCKET],
                    prefixes=[sockets.base_name(r.name) + "." for r in self.registrations],
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
                extra={"netdevs": logs.names(sorted({netchecks.gid_netdev(n) for n in selected.values()}))},
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
        return sockets.file_id(self._kubelet_sock)

    def _post(self, event: Callable[[], None]) -> None:
        """From the gRPC loop: run ``event`` on the supervisor's thread at its next pass, which starts now."""
        self._inbox.append(event)
        self.wake()

    def _stream_event(self, resource: str, server: PluginServer, what: str) -> None:
        registration = next(r for r in self.registrations if r.name == resource)
        self._post(lambda: registration.stream_event(server, what, time.monotonic()))

    def _register_done(
        self, registration: Registration, server: PluginServer, future: concurrent.futures.Future[None]
    ) -> None:
        self._post(lambda: registration.register_done(server, future))

    def _watch_sockets(self, slow: bool) -> None:
        """One pass of the socket watch: the kubelet's socket, the gRPC events, then every
        registration's step ((re)serve, (re)register, hand over)."""
        kubelet = self._kubelet_identity()
        self._kubelet_present = kubelet is not None  # registration retries wait for it (dir watch)
        if kubelet is None:
            # A kubelet restart removes it for a moment: INFO; still missing a minute later: WARNING.
            now = time.monotonic()
            self._kubelet_missing_since = self._kubelet_missing_since or now
            late = now - self._kubelet_missing_since >= KUBELET_MISSING_WARN_SECONDS
            self.once.problem(
                "kubelet",
                "kubelet.sock is missing in %s: waiting for the kubelet%s",
                self.dir,
                f" (for {KUBELET_MISSING_WARN_SECONDS:.0f} s now)" if late else "",
                level=logging.WARNING if late else logging.INFO,
            )
        else:
            self._kubelet_missing_since = None
            self.once.cleared("kubelet", "kubelet.sock is back")
        if kubelet is not None and kubelet != self._kubelet_id:
            if self._kubelet_id is not None:
                LOG.info("kubelet.sock re-created: kubelet restarted; registering every resource again")
                self.hooks.kubelet_restarted()
                for registration in self.registrations:
                    registration.kubelet_restarted()
            self._kubelet_id = kubelet
        while self._inbox:
            self._inbox.popleft()()
        now = time.monotonic()  # after the events: a retry they scheduled "now" is due in this pass
        for registration in self.registrations:
            registration.step(now, self._kubelet_present, slow)
        if self._dir_watch is not None:  # the kubelet's checkpoint matters while a takeover waits for it
            awaiting = any(r.awaiting_takeover for r in self.registrations)
            self._dir_watch.names = frozenset([KUBELET_SOCKET, CHECKPOINT] if awaiting else [KUBELET_SOCKET])

    def _write_health(self) -> None:
        if not self.health_file:
            return
        changes = sum(r.changes for r in self.registrations)
        if changes == self._health_said and time.time() - self._health_written < HEALTH_WRITE_SECONDS:
            return
        # Stamped before writing: a failing write is retried at the same pace, not at every pass.
        self._health_written, self._health_said = time.time(), changes
        probe_max = self.probe_bound()
        doc = {
            "pid": os.getpid(),
            "instance": sockets.INSTANCE,
            "time": time.time(),
            "loops": {
                name: {"last": last, "max_age": probe_max if name == "probe" else 10.0}
                for name, last in self.heartbeats.items()
            },
            "registered": sorted(r.name for r in self.registrations if r.registered),
            "stood_down": sorted(r.name for r in self.registrations if r.stood_down),
            "unregistered_since": {
                r.name: r.unregistered_since for r in self.registrations if r.unregistered_since is not None
            },
            "sockets": {r.name: r.server.socket_name for r in self.registrations if r.server is not None},
        }
        write_health(self.health_file, doc)

    def _hold_lock(self) -> None:
        """Hold this instance's lock (sockets.InstanceLock); again after the dir was re-created."""
        if self.lock.held:
            return
        try:
            self.lock.acquire()
        except OSError as exc:
            self.once.problem(
                "instance lock",
                "cannot hold the instance lock %s (%s); other instances judge this one by its sockets",
                self.lock.path,
                exc,
            )
        else:
            self.once.cleared("instance lock", f"holding the instance lock {self.lock.path}")

    def run(self) -> None:
        self._hold_lock()  # serve() took it already, before anything else
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
                    "nics": logs.names([str(n["name"]) for n in pool.nic_summary()]),
                    "devices": len(pool.snapshot()[1]),
                },
            )
        if not any(pool.nic_summary() for pool in self.pools):
            LOG.warning(
                "no RDMA NIC matches any resource's selectors", extra={"found": logs.names([n.name for n in nics])}
            )
        if self.config.non_host_network.enabled:
            self.check_non_host_network()
        self._beat("probe", "watch")
        self._publish()
        try:
            self._loop()
        finally:
            if self.stop_signal:
                LOG.info("signal received, stopping", extra={"signal": self.stop_signal})
            self.lock.release()  # first: the sockets that go next then say that this instance is ending
            stopped = [r.stop() for r in self.registrations]
            servers = [server for found, _ in stopped for server in found]
            stopping = [f for _, futures in stopped for f in futures]
            for pool in self.pools:
                pool.close()
            self.discovery.close()
            for source in list(self._sources.values()):
                self._watching(source, False)
            self._supervised("stop", lambda: stop_all(servers, stopping, STOP_GRACE_SECONDS))
            if self.discovery.features is not None:
                self.discovery.features.remove()  # the node's NFD labels go with the plugin
            os.close(self._wake_r)
            os.close(self._wake_w)
            if self.health_file:
                remove_health(self.health_file)
            LOG.info("stopped")


def serve(args: argparse.Namespace) -> int:
    # First of all, before the config is even read: an older instance on the node no longer
    # registers once this lock exists (registration.py). Failing, the supervisor says so and retries.
    lock = sockets.InstanceLock(args.device_plugin_dir)
    with contextlib.suppress(OSError):
        lock.acquire()
    try:
        return _serve(args, lock)
    finally:
        lock.release()


def _serve(args: argparse.Namespace, lock: sockets.InstanceLock) -> int:
    config = load_config(args.config)
    hooks: Hooks | None = None
    metrics_address = args.metrics_address
    if metrics_address:
        from .metrics import MetricsHooks
        from .metricsserver import auth_of

        metrics = MetricsHooks(sysfs_root=args.sysfs_root)  # port counters read from it at scrape time
        try:
            tls, reviewer = auth_of(args)  # the API server is reviewed only with --metrics-auth kubernetes
            host, port = metrics.serve(metrics_address, tls, reviewer)
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
        lock=lock,
    )

    if args.nfd_features_file:
        supervisor.discovery.features = nfd.FeatureFile(
            args.nfd_features_file, config.mode, args.sysfs_root, args.procfs_root, config.rediscovery_interval_seconds
        )

    def on_signal(signum: int, frame: FrameType | None) -> None:
        # Flags only: the signal can arrive while this thread is inside a log write, and a log call
        # here would be a reentrant write (RuntimeError) raised before the stop was recorded.
        supervisor.stop_signal = signal.Signals(signum).name
        supervisor.stop_event.set()
        supervisor.wake()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    # `kill -USR1`: every thread's stack on stderr (a stop that hangs shows where).
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    LOG.info(
        "starting",
        extra={
            "mode": config.mode,
            "resources": ",".join(p.name for p in supervisor.pools),
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
    return EXIT_DIR_DELETED if supervisor.exit_reason else 0
