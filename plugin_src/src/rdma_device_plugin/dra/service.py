"""The kubelet-facing gRPC of a DRA driver: plugin registration, DRAPlugin ``v1`` and ``v1beta1``,
DRAResourceHealth ``v1``, over unix sockets (the protos are k8s.io/kubelet's, ``api/``).

How the kubelet finds and uses it (``pkg/kubelet/cm/dra/plugin/dra_plugin_manager.go``, v1.37):
its plugin watcher sees the registration socket appear in ``<kubelet-dir>/plugins_registry``, calls
``GetInfo`` (type ``DRAPlugin``, the driver name, the endpoint, and as "versions" the gRPC services
offered: ``v1.DRAPlugin``, ``v1beta1.DRAPlugin``, ``v1.DRAResourceHealth``), picks the newest
DRAPlugin service it knows (``servicesSupportedByKubelet``: v1 first) and answers with
``NotifyRegistrationStatus``. It then dials the endpoint for NodePrepareResources /
NodeUnprepareResources and, with ``ResourceHealthStatus`` (beta, on in v1.36+), opens one
NodeWatchResources stream and reads device health from it into the pods' ``allocatedResourcesStatus``.
A device not reported again within its ``health_check_timeout_seconds`` becomes Unknown, so the
full list is re-sent every ``resend`` seconds besides every change.

Generic over a :class:`Backend` so the tests' stub GPU driver serves the same code.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent import futures
from dataclasses import dataclass
from typing import Any, Protocol

import grpc

from ..api import dra_v1_pb2 as v1
from ..api import dra_v1_pb2_grpc as v1_grpc
from ..api import dra_v1beta1_pb2 as v1beta1
from ..api import dra_v1beta1_pb2_grpc as v1beta1_grpc
from ..api import drahealth_v1_pb2 as health_pb
from ..api import drahealth_v1_pb2_grpc as health_grpc
from ..api import pluginregistration_v1_pb2 as reg_pb
from ..api import pluginregistration_v1_pb2_grpc as reg_grpc
from .kubeletplugin import FileId, Paths, PreparedDevice, PrepareError, SerializeLock, remove_own, serve_at
from .stats import RequestStats

LOG = logging.getLogger(__name__)
DRA_PLUGIN_TYPE = "DRAPlugin"  # pluginregistration/v1 constants.go
SERVICES = ("v1.DRAPlugin", "v1beta1.DRAPlugin", "v1.DRAResourceHealth")  # <proto package>.<service>
HEALTH_TIMEOUT_SECONDS = 60


class Backend(Protocol):
    def prepare(self, namespace: str, uid: str, name: str) -> list[PreparedDevice]: ...

    def unprepare(self, namespace: str, uid: str, name: str) -> None: ...


@dataclass(frozen=True)
class DeviceHealth:
    pool: str
    device: str
    healthy: bool
    message: str = ""


class HealthFeed:
    """The devices' health as the streams send it: a versioned full list, changed by the driver."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._devices: tuple[DeviceHealth, ...] = ()
        self._version = 0
        self._closed = False

    def update(self, devices: Sequence[DeviceHealth]) -> bool:
        devices = tuple(sorted(devices, key=lambda d: (d.pool, d.device)))
        with self._cond:
            if devices == self._devices:
                return False
            self._devices = devices
            self._version += 1
            self._cond.notify_all()
        return True

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def wait(self, seen: int, timeout: float) -> tuple[int, tuple[DeviceHealth, ...], bool]:
        """(version, devices, closed) once the version moved past ``seen`` or ``timeout`` passed."""
        with self._cond:
            self._cond.wait_for(lambda: self._version != seen or self._closed, timeout)
            return self._version, self._devices, self._closed


class _Registration(reg_grpc.RegistrationServicer):  # type: ignore[misc]
    def __init__(self, driver: str, endpoint: str, on_registered: Any) -> None:
        self.driver = driver
        self.endpoint = endpoint
        self.on_registered = on_registered

    def GetInfo(self, request: Any, context: Any) -> Any:
        return reg_pb.PluginInfo(
            type=DRA_PLUGIN_TYPE, name=self.driver, endpoint=self.endpoint, supported_versions=list(SERVICES)
        )

    def NotifyRegistrationStatus(self, request: Any, context: Any) -> Any:
        if request.plugin_registered:
            LOG.info("registered with the kubelet", extra={"driver": self.driver, "endpoint": self.endpoint})
        else:
            LOG.error(
                "the kubelet refused the registration",
                extra={"driver": self.driver, "error": request.error, "fix": "see the kubelet's log for the plugin"},
            )
        self.on_registered(bool(request.plugin_registered))
        return reg_pb.RegistrationStatusResponse()


def _claims(request: Any) -> list[tuple[str, str, str]]:
    return [(c.namespace, c.uid, c.name) for c in request.claims]


class _Prepare:
    """One implementation of NodePrepareResources / NodeUnprepareResources for both API versions."""

    def __init__(
        self, backend: Backend, pb: Any, with_share_id: bool, stats: RequestStats | None, lock: SerializeLock | None
    ) -> None:
        self.backend = backend
        self.pb = pb
        self.with_share_id = with_share_id
        self.stats = stats
        self.lock = lock

    def _record(self, operation: str, t0: float, ok: bool) -> None:
        if self.stats is not None:
            self.stats.record(operation, time.perf_counter() - t0, ok)

    def _serialized(self) -> contextlib.AbstractContextManager[None]:
        return self.lock.held() if self.lock is not None else contextlib.nullcontext()

    def NodePrepareResources(self, request: Any, context: Any) -> Any:
        with self._serialized():
            return self._prepare(request)

    def NodeUnprepareResources(self, request: Any, context: Any) -> Any:
        with self._serialized():
            return self._unprepare(request)

    def _prepare(self, request: Any) -> Any:
        out = self.pb.NodePrepareResourcesResponse()
        for namespace, uid, name in _claims(request):
            t0 = time.perf_counter()
            try:
                devices = self.backend.prepare(namespace, uid, name)
            except PrepareError as exc:
                LOG.error("prepare failed", extra={"claim": f"{namespace}/{name}", "uid": uid, "error": str(exc)})
                out.claims[uid].error = str(exc)
                self._record("prepare", t0, False)
                continue
            except Exception as exc:  # one claim's surprise must not fail the others
                LOG.exception("prepare failed", extra={"claim": f"{namespace}/{name}", "uid": uid})
                out.claims[uid].error = f"claim {namespace}/{name}: {type(exc).__name__}: {exc}"
                self._record("prepare", t0, False)
                continue
            self._record("prepare", t0, True)
            entry = out.claims[uid]
            for d in devices:
                dev = entry.devices.add(
                    request_names=d.requests, pool_name=d.pool, device_name=d.device, cdi_device_ids=d.cdi_device_ids
                )
                if self.with_share_id and d.share_id:
                    dev.share_id = d.share_id
        return out

    def _unprepare(self, request: Any) -> Any:
        out = self.pb.NodeUnprepareResourcesResponse()
        for namespace, uid, name in _claims(request):
            t0 = time.perf_counter()
            try:
                self.backend.unprepare(namespace, uid, name)
                out.claims[uid].error = ""
                self._record("unprepare", t0, True)
            except Exception as exc:
                LOG.exception("unprepare failed", extra={"claim": f"{namespace}/{name}", "uid": uid})
                out.claims[uid].error = f"claim {namespace}/{name}: {type(exc).__name__}: {exc}"
                self._record("unprepare", t0, False)
        return out


class _PrepareV1(_Prepare, v1_grpc.DRAPluginServicer):  # type: ignore[misc]
    pass


class _PrepareV1beta1(_Prepare, v1beta1_grpc.DRAPluginServicer):  # type: ignore[misc]
    pass


class _Health(health_grpc.DRAResourceHealthServicer):  # type: ignore[misc]
    def __init__(self, feed: HealthFeed, stop: threading.Event, resend: float) -> None:
        self.feed = feed
        self.stop = stop
        self.resend = resend

    def NodeWatchResources(self, request: Any, context: Any) -> Iterator[Any]:
        seen = -1
        while not self.stop.is_set() and context.is_active():
            version, devices, closed = self.feed.wait(seen, self.resend if seen >= 0 else 0)
            if closed:
                return
            seen = version
            now = int(time.time())
            yield health_pb.NodeWatchResourcesResponse(
                devices=[
                    health_pb.DeviceHealth(
                        device=health_pb.DeviceIdentifier(pool_name=d.pool, device_name=d.device),
                        health=health_pb.HEALTHY if d.healthy else health_pb.UNHEALTHY,
                        last_updated_time=now,
                        health_check_timeout_seconds=HEALTH_TIMEOUT_SECONDS,
                        message=d.message[:1024],
                    )
                    for d in devices
                ]
            )


class KubeletService:
    """Both servers of one instance (:mod:`.kubeletplugin`: its own sockets, the node-wide serialization).
    Start serves the endpoint first, then the registration socket (what the kubelet watches); stop
    removes the registration socket first (the kubelet goes on with another instance's registration,
    if any), lets prepares in flight end, then removes the endpoint; never a socket it did not make."""

    def __init__(
        self,
        driver: str,
        paths: Paths,
        backend: Backend,
        feed: HealthFeed,
        on_registered: Any = None,
        resend: float = 20.0,
        stats: RequestStats | None = None,
        serialize: bool = True,
    ) -> None:
        self.driver = driver
        self.paths = paths
        self.feed = feed
        self.stop_event = threading.Event()
        self.registered = threading.Event()
        self._on_registered = on_registered
        self._ids: dict[str, FileId] = {}

        def registered(ok: bool) -> None:
            if ok:
                self.registered.set()
            if on_registered is not None:
                on_registered(ok)

        # serialize: every prepare and unprepare holds the node's lock for the whole call (upstream's
        # default, kubeletplugin.Serialize(true)); False for a backend that locks what it decides itself
        # (the claims: a call's API reads then run beside other calls, issue 38's prepare p99).
        self.lock = SerializeLock(paths.lock) if serialize else None
        self._dra = grpc.server(futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="dra"))
        v1_grpc.add_DRAPluginServicer_to_server(_PrepareV1(backend, v1, True, stats, self.lock), self._dra)
        v1beta1_grpc.add_DRAPluginServicer_to_server(
            _PrepareV1beta1(backend, v1beta1, False, stats, self.lock), self._dra
        )
        health_grpc.add_DRAResourceHealthServicer_to_server(_Health(feed, self.stop_event, resend), self._dra)
        self._reg = grpc.server(futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="dra-reg"))
        reg_grpc.add_RegistrationServicer_to_server(_Registration(driver, paths.endpoint, registered), self._reg)

    def start(self) -> None:
        self._ids[self.paths.endpoint] = serve_at(self._dra, self.paths.endpoint)
        self._ids[self.paths.registration] = serve_at(self._reg, self.paths.registration)
        LOG.info(
            "serving the kubelet",
            extra={"registration": self.paths.registration, "endpoint": self.paths.endpoint, "services": SERVICES},
        )

    def stop(self) -> None:
        self.stop_event.set()
        self.feed.close()
        remove_own(self.paths.registration, self._ids.get(self.paths.registration))
        self._reg.stop(None).wait()
        self._dra.stop(2).wait()
        remove_own(self.paths.endpoint, self._ids.get(self.paths.endpoint))
        if self.lock is not None:
            self.lock.close()
