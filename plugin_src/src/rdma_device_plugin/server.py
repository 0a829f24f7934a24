"""gRPC lifecycle of one resource: serve DevicePlugin on a unix socket, then register.

Order matters (kubelet behaviour 1): the server listens first, then Register is called
from the supervisor's thread while the server answers the kubelet's GetDevicePluginOptions
dial-back inside that Register call.

Every server runs on one asyncio loop (``grpc.aio``) in its own thread: an open
ListAndWatch stream costs a coroutine, not a worker thread, so no number of open streams
(the kubelet never closes old clients on re-registration) can starve Allocate, which the
kubelet calls without a deadline.

The socket is bound under a temporary name and renamed into place: the rename replaces the
path atomically (the kubelet never sees it missing), and grpc's own unlink of its bound path
(at bind and at stop) then never touches a socket another instance put at the real path.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from .api import deviceplugin_pb2 as pb
from .api import deviceplugin_pb2_grpc as pb_grpc
from .node.sysfs import Nic
from .resources import AllocationError, ContainerAllocation, Device, ResourcePool

LOG = logging.getLogger(__name__)

API_VERSION = "v1beta1"
KUBELET_SOCKET = "kubelet.sock"
# sockaddr_un.sun_path is 108 bytes including the terminating NUL.
MAX_SOCKET_PATH = 107


def device_message(device: Device) -> Any:
    msg = pb.Device(ID=device.id, health=device.health)
    if device.numa_node is not None:
        msg.topology.nodes.add(ID=device.numa_node)
    return msg


def allocation_message(alloc: ContainerAllocation) -> Any:
    resp = pb.ContainerAllocateResponse(envs=alloc.envs)
    for spec in alloc.devices:
        resp.devices.add(container_path=spec.container_path, host_path=spec.host_path, permissions=spec.permissions)
    for name in alloc.cdi_devices:
        resp.cdi_devices.add(name=name)
    return resp


@dataclass(frozen=True)
class LiveStatus:
    """What the supervisor shows the metrics at scrape time."""

    loops: Mapping[str, float]  # loop name -> wall time it last completed
    registered: frozenset[str]  # resources registered with the current kubelet
    streams: Mapping[str, int]  # resource -> ListAndWatch streams open


class Hooks:
    """Optional observers (metrics); every method is a no-op here."""

    def allocated(self, resource: str, seconds: float, ok: bool) -> None: ...

    def registered(self, resource: str) -> None: ...

    def kubelet_restarted(self) -> None: ...

    def rediscovered(self) -> None: ...

    def port_states(self, states: Mapping[str, tuple[str, ...] | None]) -> None: ...

    def pools_ready(self, pools: Sequence[ResourcePool]) -> None: ...

    def nics_found(self, nics: Sequence[Nic]) -> None: ...

    def stream_ended(self, resource: str) -> None: ...

    def supervising(self, status: Callable[[], LiveStatus]) -> None: ...


_TMP_IDS = itertools.count()


class _Loop:
    """The one asyncio loop every plugin server runs on, in a daemon thread started on first use."""

    _lock = threading.Lock()
    _loop: asyncio.AbstractEventLoop | None = None
    _keep: Any = None

    @classmethod
    def get(cls) -> asyncio.AbstractEventLoop:
        with cls._lock:
            if cls._loop is None:
                loop = asyncio.new_event_loop()
                threading.Thread(target=loop.run_forever, name="dp-grpc-aio", daemon=True).start()
                cls._loop = loop
                # grpc.aio shuts its completion queue down when its last object goes away (the
                # only server stopped for a restart), and a poller callback still queued then
                # fails with EBADF. An idle, never-connected channel keeps it up for good.
                cls._keep = asyncio.run_coroutine_threadsafe(cls._hold(), loop).result(30)
            return cls._loop

    @staticmethod
    async def _hold() -> Any:
        return grpc.aio.insecure_channel("unix:///dev/null")

    @classmethod
    def run(cls, coro: Any, timeout: float = 30.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, cls.get()).result(timeout)


class _Changes:
    """Wakes every stream of a pool when its devices change (the pool calls ``notify`` from any thread)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.event = asyncio.Event()

    def notify(self) -> None:
        self.loop.call_soon_threadsafe(self._fire)

    def _fire(self) -> None:
        event, self.event = self.event, asyncio.Event()
        event.set()


class DevicePluginServicer(pb_grpc.DevicePluginServicer):  # type: ignore[misc]
    def __init__(
        self,
        pool: ResourcePool,
        hooks: Hooks | None = None,
        changes: _Changes | None = None,
        on_stream_end: Callable[[str], None] | None = None,
    ) -> None:
        self.pool = pool
        self.hooks = hooks or Hooks()
        self.changes = changes
        self.on_stream_end = on_stream_end
        self.stopping = False
        self.streams = 0  # open ListAndWatch streams
        # The pool hands out the same ContainerAllocation objects until its NICs change (shared
        # mode: one for every pod), so the whole AllocateResponse is built once per combination
        # and reused: keyed by the allocations' identities, which are kept alive in the entry so
        # an id is never reused while it is a key. Read-only once built (grpc only serializes it).
        # Emptied when the pool drops its allocations, so answers of replaced NIC sets are not kept.
        self._responses: dict[tuple[int, ...], tuple[tuple[ContainerAllocation, ...], Any]] = {}
        self._responses_version = pool.allocations_version

    def _response(self, allocs: tuple[ContainerAllocation, ...]) -> Any:
        if self._responses_version != self.pool.allocations_version:
            self._responses.clear()
            self._responses_version = self.pool.allocations_version
        key = tuple(map(id, allocs))
        entry = self._responses.get(key)
        if entry is not None and all(a is b for a, b in zip(entry[0], allocs, strict=True)):
            return entry[1]
        if len(self._responses) >= 4096:  # bounded: a node has a handful of NICs
            self._responses.clear()
        response = pb.AllocateResponse(container_responses=[allocation_message(a) for a in allocs])
        self._responses[key] = (allocs, response)
        # Once per new answer, not per call (the kubelet logs every allocation itself; a log line
        # per call cost more than building the answer, issue 11): what this resource hands out now.
        LOG.info(
            "Allocate answer",
            extra={"resource": self.pool.name, "nics": ";".join(",".join(a.nics) for a in allocs)},
        )
        return response

    async def GetDevicePluginOptions(self, request: Any, context: Any) -> Any:
        return pb.DevicePluginOptions(
            pre_start_required=False,
            get_preferred_allocation_available=self.pool.mode == "exclusive",
        )

    async def ListAndWatch(self, request: Any, context: Any) -> AsyncIterator[Any]:
        assert self.changes is not None
        version, devices = self.pool.snapshot()
        self.streams += 1
        LOG.info("ListAndWatch opened", extra={"resource": self.pool.name, "devices": len(devices)})
        try:
            yield pb.ListAndWatchResponse(devices=[device_message(d) for d in devices])
            while not self.stopping:
                event = self.changes.event
                if self.pool.closed:
                    return
                new_version, devices = self.pool.snapshot()
                if new_version == version:
                    await event.wait()
                    continue
                version = new_version
                healthy = sum(1 for d in devices if d.health == "Healthy")
                LOG.info(
                    "sending snapshot",
                    extra={"resource": self.pool.name, "devices": len(devices), "healthy": healthy},
                )
                yield pb.ListAndWatchResponse(devices=[device_message(d) for d in devices])
        finally:
            self.streams -= 1
            if not self.stopping and not self.pool.closed and self.on_stream_end is not None:
                self.on_stream_end(self.pool.name)

    async def Allocate(self, request: Any, context: Any) -> Any:
        start = time.perf_counter()
        try:
            allocs = tuple(self.pool.allocate(list(creq.devices_ids)) for creq in request.container_requests)
        except AllocationError as exc:
            self.hooks.allocated(self.pool.name, time.perf_counter() - start, False)
            LOG.warning("Allocate refused: %s", exc)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        response = self._response(allocs)
        if LOG.isEnabledFor(logging.DEBUG):  # per call: only at --log-level debug
            nics = ";".join(",".join(a.nics) for a in allocs)
            LOG.debug("allocated", extra={"resource": self.pool.name, "containers": len(allocs), "nics": nics})
        self.hooks.allocated(self.pool.name, time.perf_counter() - start, True)
        return response

    async def GetPreferredAllocation(self, request: Any, context: Any) -> Any:
        response = pb.PreferredAllocationResponse()
        for creq in request.container_requests:
            ids = self.pool.preferred(
                list(creq.available_deviceIDs), list(creq.must_include_deviceIDs), creq.allocation_size
            )
            response.container_responses.add(deviceIDs=ids)
        return response

    async def PreStartContainer(self, request: Any, context: Any) -> Any:
        return pb.PreStartContainerResponse()


class PluginServer:
    """One resource's gRPC server bound to ``<device_plugin_dir>/<socket_name>``."""

    def __init__(
        self,
        pool: ResourcePool,
        device_plugin_dir: str,
        socket_name: str,
        hooks: Hooks | None = None,
        on_stream_end: Callable[[str], None] | None = None,
    ):
        self.pool = pool
        self.dir = device_plugin_dir
        self.socket_name = socket_name
        self.path = os.path.join(device_plugin_dir, socket_name)
        self.hooks = hooks or Hooks()
        self.on_stream_end = on_stream_end
        self._server: grpc.aio.Server | None = None
        self._servicer: DevicePluginServicer | None = None
        self._inode: int | None = None

    @property
    def serving(self) -> bool:
        return self._server is not None

    def start(self) -> None:
        """Bind under a temporary name, then rename over the path (replacing a stale socket)."""
        if len(self.path) > MAX_SOCKET_PATH:
            raise OSError(f"socket path {self.path} is {len(self.path)} bytes; unix sockets allow {MAX_SOCKET_PATH}")
        tmp = os.path.join(self.dir, f".{os.getpid()}.{next(_TMP_IDS)}")  # shorter than any socket name
        loop = _Loop.get()
        changes = _Changes(loop)
        servicer = DevicePluginServicer(self.pool, self.hooks, changes, self.on_stream_end)

        async def start() -> grpc.aio.Server:
            server = grpc.aio.server()
            pb_grpc.add_DevicePluginServicer_to_server(servicer, server)
            server.add_insecure_port(f"unix://{tmp}")
            await server.start()
            return server

        if not os.path.isdir(self.dir):
            raise OSError(f"the device-plugin dir {self.dir} does not exist")
        try:
            server = _Loop.run(start())
        except RuntimeError as exc:  # grpc: "Failed to bind to address ..." (read-only or vanished dir)
            raise OSError(f"cannot bind a unix socket in {self.dir}: {exc}") from None
        try:
            os.rename(tmp, self.path)
            self._inode = os.stat(self.path).st_ino
        except OSError:
            _Loop.run(server.stop(0))
            raise
        self.pool.add_listener(changes.notify)
        self._server, self._servicer = server, servicer
        LOG.info("serving", extra={"resource": self.pool.name, "socket": self.path})

    def state(self) -> str:
        """ "ours", "missing" (deleted: a kubelet restart) or "replaced" (another instance's socket)."""
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return "missing"
        return "ours" if self._server is not None and st.st_ino == self._inode else "replaced"

    def alive(self) -> bool:
        """False once the kubelet (or anyone) deleted or replaced our socket file."""
        return self.state() == "ours"

    def open_streams(self) -> int:
        return self._servicer.streams if self._servicer is not None else 0

    def stop(self, grace: float = 0.5) -> None:
        server, self._server = self._server, None
        servicer, self._servicer = self._servicer, None
        if server is None:
            return
        if servicer is not None:
            servicer.stopping = True
            if servicer.changes is not None:
                self.pool.remove_listener(servicer.changes.notify)
                servicer.changes.notify()  # wake its streams so they end
        # grpc unlinks only its bound (temporary) path; the real path only if it is still ours.
        _Loop.run(server.stop(grace), timeout=grace + 10.0)
        try:
            if os.stat(self.path).st_ino == self._inode:
                os.unlink(self.path)
        except FileNotFoundError:
            pass

    def register(self, timeout: float = 10.0) -> None:
        """Register with the kubelet; raises grpc.RpcError or OSError on failure."""
        kubelet = os.path.join(self.dir, KUBELET_SOCKET)
        with grpc.insecure_channel(f"unix://{kubelet}") as channel:
            stub = pb_grpc.RegistrationStub(channel)
            stub.Register(
                pb.RegisterRequest(
                    version=API_VERSION,
                    endpoint=self.socket_name,
                    resource_name=self.pool.name,
                    options=pb.DevicePluginOptions(get_preferred_allocation_available=self.pool.mode == "exclusive"),
                ),
                timeout=timeout,
            )
        self.hooks.registered(self.pool.name)
        LOG.info("registered with kubelet", extra={"resource": self.pool.name, "endpoint": self.socket_name})
