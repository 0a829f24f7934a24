"""``rdma-device-plugin dra``: the DRA driver process.

One loop on the main thread, as the device plugin's supervisor: the port probe every
``health.intervalSeconds`` (one ``pread`` per port), the device list once a second (hot-plug,
removal) and a full re-list every ``rediscoveryIntervalSeconds``, all by the node inventory
(:class:`..inventory.NodeInventory`); after any change it rebuilds the published model (:mod:`.model`)
and hands it to the publisher thread (:mod:`.publisher`) and to the kubelet's health streams
(:mod:`.service`). gRPC runs in its own threads; prepare reads the current model and the inventory's
NIC sets (thread-safe).

The node inventory is the one the device plugin's pools read (a NIC in the first resource that
selects it): it gives the discovery, the health rule, the vanish grace and, per set of NICs, exactly
what Allocate hands a container (device nodes, env). The node's mode decides only which device
serves the extended resource (:mod:`.model`). What the driver decides (:mod:`.model`, :mod:`.claims`)
stands apart from the plumbing (:mod:`.kubeletplugin`, :mod:`.service`, :mod:`.publisher`), as in the
upstream kubeletplugin helper.
"""

from __future__ import annotations

import argparse
import http.client
import logging
import os
import random
import signal
import threading
import time
from types import FrameType
from typing import TYPE_CHECKING, Any

from ..config_view import ConfigCheck
from ..inventory import NodeInventory
from ..supervision import remove_health, write_health
from . import kubeapi, model, version
from .claims import Claims, read_boot_id
from .inventory import Inventory
from .kubeletplugin import Instances, Paths, SerializeLock, instance_uid
from .publisher import Publisher
from .service import DeviceHealth, HealthFeed, KubeletService
from .stats import RequestStats

if TYPE_CHECKING:
    from ..config import PluginConfig  # a model or its config_view (the DRA driver): attribute reads only

LOG = logging.getLogger("rdma_device_plugin.dra")
RELIST_CHECK_SECONDS = 1.0
PUBLISH_MAX_AGE_SECONDS = 300.0
# Orphaned prepared claims: the first pass right after the start (the kubelet may have missed what
# happened while the driver was down), then every 10 minutes as NVIDIA's gpu-kubelet-plugin does
# (cleanup.go, ResourceClaimCleanupInterval), each period drawn from 5-15 minutes so that a fleet
# started together does not ask in step. Orphans are rare (the kubelet unprepares what it prepared);
# what keeping one longer costs: docs/dra.md.
COLLECT_SECONDS = (300.0, 900.0)
VERSION_RETRY_SECONDS = 60.0  # a server below the floor: read /version again (an upgrade starts the driver)
VERSION_ERROR_RETRY_SECONDS = 5.0  # a server that did not answer


class Driver:
    def __init__(self, args: argparse.Namespace, config: PluginConfig, client: kubeapi.Client, uid: str) -> None:
        self.args = args
        self.config = config
        self.client = client
        self.node = args.node_name
        self.driver = args.driver_name
        self.started = time.monotonic()
        if any(r.numa_pools for r in config.resources):
            LOG.warning(
                "numaPools: <name>-numa<N> is served by a set device per NUMA node; <name>-local has no DRA "
                "counterpart (no Topology Manager alignment with device-plugin GPUs): its pods stay Pending here",
                extra={"fix": "docs/dra.md, Migrating: claims that match the GPU's numaNode or pcieRoot"},
            )
        self.nics = NodeInventory(config, args.sysfs_root, args.dev_root)
        self.inventory = Inventory(config, args.sysfs_root)
        self._published = model.build(self.driver, self.node, config.mode, [], [], {})
        self._published_lock = threading.Lock()
        self._key: object = None
        self.build_error = ""  # why the model of this node's NICs cannot be built (readiness)
        self.version_error = ""  # why the API server is not one this driver runs with (readiness)
        self.feed = HealthFeed()
        self.first_published: float | None = None  # seconds from start to the first slices in the API
        self.paths = Paths.of(args.kubelet_dir, self.driver, uid)
        self.instances = Instances(self.paths.plugin_dir)
        self.publisher = Publisher(
            client, self.driver, self.node, on_published=self._on_published, may_publish=self.instances.newest
        )
        state_dir = args.state_dir or os.path.join(args.kubelet_dir, "plugins", self.driver)
        boot_id = read_boot_id(args.procfs_root)
        # One node-wide lock (every instance's): held by the claims around what they decide on files.
        self.node_lock = SerializeLock(self.paths.lock)
        self.claims = Claims(
            client,
            self.driver,
            self.node,
            state_dir,
            args.cdi_dir,
            self.published,
            self.nics,
            boot_id,
            node_lock=self.node_lock.held,
        )
        self.stats = RequestStats()
        self.service = KubeletService(
            self.driver, self.paths, self.claims, self.feed, self._registered, stats=self.stats, serialize=False
        )
        self.metrics: Any = None  # .metrics.Metrics while serving them (--metrics-address)
        self.stop_event = threading.Event()
        self.stop_signal = ""  # set by the signal handler; logged by the loop
        self._unregistered_since: float | None = time.time()

    def published(self) -> model.Published:
        with self._published_lock:
            return self._published

    def claims_per_nic(self) -> dict[str, int]:
        """How many prepared claims hold each NIC (a set device counts for each of its NICs)."""
        refs = self.published().refs
        out: dict[str, int] = {}
        for rec in self.claims.prepared().values():
            nics = {n for d in rec.get("devices", []) if (ref := refs.get(d.get("device"))) for n in ref.nics}
            for nic in nics:
                out[nic] = out.get(nic, 0) + 1
        return out

    def _on_published(self, seconds: float) -> None:
        if self.first_published is None:
            self.first_published = time.monotonic() - self.started
            LOG.info("first ResourceSlices in the API", extra={"seconds_from_start": round(self.first_published, 3)})

    def _registered(self, ok: bool) -> None:
        self._unregistered_since = None if ok else (self._unregistered_since or time.time())
        if ok:
            self.instances.registered()
            self.publisher.poke()  # a kubelet (re)start wipes the node's slices: look now

    def rebuild(self, force: bool = False) -> bool:
        """Publish the model again when the NICs, their health or the topology changed; True when it did."""
        key = self.nics.key()
        if key == self._key and not force:
            return False
        views = self.inventory.views(self.nics)
        try:
            published = model.build(
                self.driver,
                self.node,
                self.config.mode,
                self.inventory.resources(),
                views,
                self.inventory.unhealthy_since,
            )
        except ValueError as exc:  # not marked handled: tried again at every pass, said once
            if str(exc) != self.build_error:
                LOG.error("cannot publish this node's NICs", extra={"error": str(exc)})
            self.build_error = str(exc)
            return False
        self._key, self.build_error = key, ""
        with self._published_lock:
            self._published = published
        self.publisher.set_specs(published.specs())
        self.feed.update([DeviceHealth(self.node, d, ok, why) for d, (ok, why) in published.health.items()])
        return True

    def _collect(self) -> None:
        try:
            self.claims.collect()
        except Exception:
            LOG.exception("collecting orphaned claims failed; tried again later")

    def _write_health(self, now: float) -> None:
        if not self.args.health_file:
            return
        interval = self.config.health.interval_seconds
        doc: dict[str, object] = {
            "pid": os.getpid(),
            "loops": {
                "probe": {"last": now, "max_age": max(60.0, 20 * interval)},
                # a pass every resync (30 s) or back-off step (30 s at most), failed or not: a
                # publisher that stopped passing is stuck, a restart may free it
                "publish": {"last": self.publisher.heartbeat, "max_age": PUBLISH_MAX_AGE_SECONDS},
            },
            "unregistered_since": {self.driver: self._unregistered_since} if self._unregistered_since else {},
            "registered": self._unregistered_since is None,
            "registered_means": "NotifyRegistrationStatus received",
            "not_ready": self.not_ready(),
        }
        write_health(self.args.health_file, doc)

    def not_ready(self) -> list[str]:
        """Why this instance does not serve its node yet, besides the kubelet's registration (readiness)."""
        if self.version_error:
            return [self.version_error]
        if self.build_error:
            return [f"cannot publish this node's NICs: {self.build_error}"]
        if self.publisher.superseded or self.publisher.in_sync.is_set():
            return []
        why = f": {self.publisher.last_error}" if self.publisher.last_error else ""
        return [f"this node's ResourceSlices (generation {self.publisher.generation}) are not all in the API yet{why}"]

    def _server_refusal(self) -> tuple[str, float]:
        """Why the API server is not one to run with ('' when it is), and when to read it again."""
        try:
            return version.refusal(self.client.get("/version")), VERSION_RETRY_SECONDS
        except (kubeapi.ApiError, http.client.HTTPException, OSError, ValueError) as exc:
            return f"cannot read the API server's version ({exc})", VERSION_ERROR_RETRY_SECONDS

    def _wait_for_a_supported_server(self) -> bool:
        """Start nothing (no sockets, no slices) until the API server is of the floor or later: live and
        not Ready meanwhile, saying why, rather than a crash loop that says it only in old logs. False
        when stopped first."""
        next_check, said = 0.0, ""
        while True:
            now = time.monotonic()
            if now >= next_check:
                why, retry = self._server_refusal()
                if not why:
                    if said:
                        LOG.info("the API server is of a supported version now: starting")
                    self.version_error = ""
                    return True
                if why != said:
                    LOG.error("not serving this node: the API server is not supported", extra={"error": why})
                said, self.version_error, next_check = why, why, now + retry
            if self.args.health_file:  # no registration expected yet: live, and readiness says why
                write_health(
                    self.args.health_file,
                    {
                        "pid": os.getpid(),
                        "loops": {"version": {"last": time.time(), "max_age": 60.0}},
                        "registered": False,
                        "not_ready": self.not_ready(),
                    },
                )
            if self.stop_event.wait(1.0):
                return False

    def _hand_over(self) -> None:
        """Serve on until a newer instance is registered, for at most ``--handover-seconds``: the
        mode-label switch deletes this pod as the other DaemonSet's starts, and without an overlap the
        kubelet fails prepares meanwhile (and wipes the slices after 30 s)."""
        deadline = time.monotonic() + self.args.handover_seconds
        if self.args.handover_seconds <= 0 or self.instances.newer_registered():
            return
        LOG.info("serving until a newer instance is registered", extra={"seconds": self.args.handover_seconds})
        while time.monotonic() < deadline:
            if self.instances.newer_registered():
                LOG.info("a newer instance is registered: handing over")
                return
            time.sleep(0.1)
        LOG.info("no newer instance registered: stopping", extra={"seconds": self.args.handover_seconds})

    def _serve_metrics(self) -> tuple[str, int]:
        """Serve the metrics; loaded only here: without --metrics-address no prometheus_client (memory)."""
        from ..metricsserver import auth_of
        from .metrics import Metrics, State

        state = State(
            driver=self.driver,
            mode=self.config.mode,
            health=lambda: self.published().health,
            claims_per_nic=self.claims_per_nic,
            publish_failures=lambda: self.publisher.failures,
            in_sync=self.publisher.in_sync.is_set,
            superseded=lambda: self.publisher.superseded,
            registered=lambda: self._unregistered_since is None,
        )
        self.metrics = Metrics(state, self.stats)
        tls, reviewer = auth_of(self.args)
        return self.metrics.serve(self.args.metrics_address, tls, reviewer)  # type: ignore[no-any-return]

    def _stop_metrics(self) -> None:
        if self.metrics is not None:
            self.metrics.stop()

    def run(self) -> int:
        if self.args.metrics_address:
            try:
                host, port = self._serve_metrics()
            except (OSError, ValueError) as exc:
                LOG.error("cannot serve metrics", extra={"address": self.args.metrics_address, "error": str(exc)})
                return 2
            LOG.info("serving Prometheus metrics", extra={"address": f"{host}:{port}"})
        if not self._wait_for_a_supported_server():
            self._stop_metrics()
            if self.args.health_file:
                remove_health(self.args.health_file)
            LOG.info("stopped")
            return 0
        self.instances.start()  # first: an older instance stops publishing once this one is alive
        self.nics.full()
        self.rebuild(force=True)
        self.publisher.start()
        self.service.start()
        interval = self.config.health.interval_seconds
        last_check = last_health = 0.0
        next_collect = 0.0
        collecting = threading.Thread()
        try:
            while not self.stop_event.wait(interval):
                now = time.monotonic()
                try:
                    if not self.nics.unchanged():
                        self.nics.probe()
                    if now - last_check >= RELIST_CHECK_SECONDS:
                        last_check = now
                        self.nics.check_devices()
                    self.rebuild()
                    if now >= next_collect and not collecting.is_alive():
                        next_collect = now + random.uniform(*COLLECT_SECONDS)  # a GET per claim: off this loop
                        collecting = threading.Thread(target=self._collect, name="collect", daemon=True)
                        collecting.start()
                except Exception:
                    LOG.exception("probe failed; the loop goes on")
                if now - last_health >= 1.0:
                    last_health = now
                    self._write_health(time.time())
        finally:
            if self.stop_signal:
                LOG.info("signal received, stopping", extra={"signal": self.stop_signal})
            self._hand_over()
            self.service.stop()
            self.node_lock.close()
            self.publisher.stop()
            self.instances.stop()
            self._stop_metrics()
            self.nics.close()
            if self.args.health_file:
                remove_health(self.args.health_file)
        LOG.info("stopped")
        return 0


def run(args: argparse.Namespace, config_check: ConfigCheck | None = None) -> int:
    if not args.node_name:
        LOG.error("no node name: give --node-name or set NODE_NAME (the chart sets it from spec.nodeName)")
        return 2
    # validated in a child process (cli starts it first): no pydantic in this one (memory: docs/dra.md)
    config = (config_check or ConfigCheck(args.config)).result()
    try:
        client = kubeapi.connect(args.kubeconfig)
    except kubeapi.ConfigError as exc:
        LOG.error("%s", exc)
        return 2
    try:
        uid = instance_uid(args.instance_uid)
        Paths.of(args.kubelet_dir, args.driver_name, uid)
    except ValueError as exc:
        LOG.error("%s", exc)
        return 2
    driver = Driver(args, config, client, uid)

    def on_signal(signum: int, frame: FrameType | None) -> None:
        # Flags only (as serve's): a log call here could be a reentrant write that loses the stop.
        driver.stop_signal = signal.Signals(signum).name
        driver.stop_event.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    LOG.info(
        "starting the DRA driver",
        extra={
            "driver": driver.driver,
            "node": driver.node,
            "mode": config.mode,
            "resources": [r.name for r in config.resources],
        },
    )
    return driver.run()
