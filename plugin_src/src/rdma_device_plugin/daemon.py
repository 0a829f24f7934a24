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
import threading
import time
from types import FrameType

import grpc

from .config import PluginConfig, load_config
from .node import sysfs
from .resources import ResourcePool, build_pools, socket_name
from .server import KUBELET_SOCKET, Hooks, PluginServer

LOG = logging.getLogger(__name__)

WATCH_SECONDS = 0.1  # socket watch period: a kubelet restart is noticed within this
REGISTER_RETRY_SECONDS = 0.5


class Discovery:
    """Feeds the pools from sysfs: full re-list on change or timer, cheap port probe otherwise."""

    def __init__(self, config: PluginConfig, pools: list[ResourcePool], sysfs_root: str, dev_root: str):
        self.config = config
        self.pools = pools
        self.sysfs_root = sysfs_root
        self.dev_root = dev_root
        self._names: list[str] = []
        self._last_full = 0.0
        self.rediscoveries = 0

    def full(self) -> list[sysfs.Nic]:
        nics = sysfs.read_nics(self.sysfs_root, self.dev_root)
        for nic in nics:
            for problem in nic.problems:
                LOG.warning("NIC problem", extra={"nic": nic.name, "problem": problem})
        self._names = [n.name for n in nics]
        self._last_full = time.monotonic()
        self.rediscoveries += 1
        for pool in self.pools:
            if pool.set_nics(nics):
                LOG.info("devices changed", extra={"resource": pool.name, "nics": pool.nic_summary()})
        return nics

    def probe(self) -> None:
        names = sysfs.list_rdma_devices(self.sysfs_root)
        due = time.monotonic() - self._last_full >= self.config.rediscovery_interval_seconds
        if names != self._names or due:
            if names != self._names:
                LOG.info("RDMA devices changed on the node", extra={"before": self._names, "after": names})
            self.full()
            return
        states = sysfs.read_port_states(self.sysfs_root, names)
        for pool in self.pools:
            if pool.set_port_states(states):
                LOG.info("health changed", extra={"resource": pool.name, "nics": pool.nic_summary()})


class Supervisor:
    def __init__(
        self,
        config: PluginConfig,
        sysfs_root: str,
        dev_root: str,
        device_plugin_dir: str,
        hooks: Hooks | None = None,
    ) -> None:
        self.config = config
        self.dir = device_plugin_dir
        self.pools = build_pools(config)
        self.discovery = Discovery(config, self.pools, sysfs_root, dev_root)
        self.hooks = hooks or Hooks()
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
    supervisor = Supervisor(config, args.sysfs_root, args.dev_root, args.device_plugin_dir)

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
    supervisor.run()
    return 0
