"""Supervisor: discovery, health probing, serving every pool, and surviving kubelet restarts.

Threads: the main thread watches sockets (kubelet restart, lost plugin socket) and
(re)registers; one probe thread reads port states at the health interval and re-lists
NICs when the set of RDMA devices changes or the rediscovery interval passes; gRPC
worker threads answer the kubelet.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
from types import FrameType

import grpc

from . import cdi, netchecks
from .config import ConfigError, PluginConfig, load_config
from .node import sysfs
from .resources import ResourcePool, build_pools, socket_name
from .server import KUBELET_SOCKET, Hooks, PluginServer
from .verbs import VerbsProbe

LOG = logging.getLogger(__name__)

WATCH_SECONDS = 0.1  # socket watch period: a kubelet restart is noticed within this
REGISTER_RETRY_SECONDS = 0.5


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

    def full(self) -> list[sysfs.Nic]:
        nics = sysfs.read_nics(self.sysfs_root, self.dev_root)
        problems = {n.name: n.problems for n in nics if n.problems}
        for name, found in problems.items():
            if self._problems.get(name) != found:  # log a problem once, not at every re-list
                for problem in found:
                    LOG.warning("NIC problem", extra={"nic": name, "problem": problem})
        self._problems = problems
        self._names = [n.name for n in nics]
        self._last_full = time.monotonic()
        for pool in self.pools:
            if pool.set_nics(nics):
                LOG.info("devices changed", extra={"resource": pool.name, "nics": pool.nic_summary()})
        # A selected NIC whose uverbs node is not there yet (udev still creating it) is
        # re-read at every probe, so it becomes usable without waiting for the rediscovery timer.
        self._incomplete = any(
            nic.uverbs is None or not nic.uverbs.present for pool in self.pools for nic in pool.present_nics()
        )
        self.hooks.rediscovered()
        if self.verbs is not None and self.verbs.available():
            self._apply_states(self.port_states(self._names))
        else:
            self.hooks.port_states({n.name: tuple(p.state for p in n.ports) for n in nics})
        for pool in self.pools:
            writer = self.cdi.get(pool.name)
            if writer is not None:
                try:
                    writer.update(pool.present_nics())
                except OSError as exc:
                    LOG.error("cannot write CDI spec", extra={"path": writer.path, "error": str(exc)})
        return nics

    def port_states(self, names: list[str]) -> dict[str, tuple[str, ...] | None]:
        """From pyverbs when available (sysfs for NICs it does not know), else from sysfs."""
        if self.verbs is not None and self.verbs.available():
            states = self.verbs.port_states(names)
            missing = [n for n in names if n not in states]
            if missing:
                states.update(sysfs.read_port_states(self.sysfs_root, missing))
            return states
        return sysfs.read_port_states(self.sysfs_root, names)

    def _apply_states(self, states: dict[str, tuple[str, ...] | None]) -> None:
        self.hooks.port_states(states)
        for pool in self.pools:
            if pool.set_port_states(states):
                LOG.info("health changed", extra={"resource": pool.name, "nics": pool.nic_summary()})

    def probe(self) -> None:
        names = sysfs.list_rdma_devices(self.sysfs_root)
        due = time.monotonic() - self._last_full >= self.config.rediscovery_interval_seconds
        if names != self._names or due or self._incomplete:
            if names != self._names:
                LOG.info("RDMA devices changed on the node", extra={"before": self._names, "after": names})
            self.full()
            return
        self._apply_states(self.port_states(names))


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
    ) -> None:
        self.config = config
        self.dir = device_plugin_dir
        self.sysfs_root = sysfs_root
        self.procfs_root = procfs_root
        self.config_path = config_path
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
        self.servers = [PluginServer(p, device_plugin_dir, socket_name(p.name), self.hooks) for p in self.pools]
        self.stop_event = threading.Event()
        self._kubelet_id: tuple[int, int] | None = None
        self._registered: set[str] = set()

    # ------------------------------------------------------------------ threads

    def _probe_loop(self) -> None:
        interval = self.config.health.interval_seconds
        while not self.stop_event.wait(interval):
            try:
                self.discovery.probe()
            except Exception:  # never let a bad sysfs read kill health probing
                LOG.exception("health probe failed; retrying next interval")
            self._watch_config()

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

    def _kubelet_identity(self) -> tuple[int, int] | None:
        try:
            st = os.stat(os.path.join(self.dir, KUBELET_SOCKET))
            return (st.st_ino, st.st_ctime_ns)
        except FileNotFoundError:
            return None

    def _restart_servers(self, reason: str) -> None:
        LOG.info("(re)starting plugin servers", extra={"reason": reason})
        for server in self.servers:
            server.stop()
        for server in self.servers:
            server.start()
        self._registered.clear()

    def _register_pending(self) -> None:
        for server in self.servers:
            if server.pool.name in self._registered:
                continue
            try:
                server.register()
                self._registered.add(server.pool.name)
            except (grpc.RpcError, OSError) as exc:
                detail = exc.details() if isinstance(exc, grpc.RpcError) else str(exc)
                LOG.warning("registration failed; retrying", extra={"resource": server.pool.name, "error": detail})

    def run(self) -> None:
        nics = self.discovery.full()
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
        os.makedirs(self.dir, exist_ok=True)
        self._restart_servers("start")
        probe = threading.Thread(target=self._probe_loop, name="health-probe", daemon=True)
        probe.start()
        last_attempt = 0.0
        try:
            while not self.stop_event.is_set():
                kubelet = self._kubelet_identity()
                if kubelet is not None and kubelet != self._kubelet_id:
                    if self._kubelet_id is not None:
                        LOG.info("kubelet.sock re-created: kubelet restarted")
                        self.hooks.kubelet_restarted()
                        self._restart_servers("kubelet restarted")
                    self._kubelet_id = kubelet
                    self._registered.clear()
                    last_attempt = 0.0
                if not all(s.alive() for s in self.servers):
                    self._restart_servers("plugin socket lost")
                    last_attempt = 0.0
                pending = len(self._registered) < len(self.servers)
                if kubelet is not None and pending and time.monotonic() - last_attempt >= REGISTER_RETRY_SECONDS:
                    last_attempt = time.monotonic()
                    self._register_pending()
                self.stop_event.wait(WATCH_SECONDS)
        finally:
            for pool in self.pools:
                pool.close()
            for server in self.servers:
                server.stop()
            probe.join(timeout=2)
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
    )

    def on_signal(signum: int, frame: FrameType | None) -> None:
        LOG.info("signal received, stopping", extra={"signal": signal.Signals(signum).name})
        supervisor.stop_event.set()

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
