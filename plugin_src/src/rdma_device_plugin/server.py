"""gRPC of one resource: the DevicePlugin service on a unix socket, and the call to Register.

Every server runs on one asyncio loop (``grpc.aio``) in its own thread, and so does every call to
the kubelet (``Register``): an open ListAndWatch stream costs a coroutine, not a worker thread, so
no number of open streams (the kubelet never closes old clients on re-registration) can starve
Allocate, which the kubelet calls without a deadline; and a kubelet that never answers Register
holds a coroutine, never the supervisor loop. The loop answers the kubelet's dial-back
(``GetDevicePluginOptions`` inside ``Register``) while the Register coroutine waits.

Each server start binds a socket name of its own (:mod:`.sockets`: per instance and per start), so
grpc's own unlink of its bound path (at bind and at stop) only ever touches this server's file.

The kubelet's stream: the kubelet opens exactly one ListAndWatch per registration, on the
connection it dialled during Register, right after Register (plugin/v1beta1/handler.go
connectClient starts runClient -> client.go Run). gRPC does not tell a server which connection a
call came on (``context.peer()`` is ``unix:`` for every unix-socket client), so the plugin takes the
first ListAndWatch opened after it sent Register as the kubelet's; any other stream (a debugging
client, grpcurl, a client the kubelet left open) ends with a debug line and nothing else. A client
that opened a stream in the milliseconds between Register and the kubelet's own call would be taken
for the kubelet (its end would cost one spare registration).

Handlers read only what the pool's owner (the supervisor's thread) publishes: ``pool.view``, an
immutable picture read once per call (:mod:`.resources`), whose ListAndWatch message is already
serialized, so every stream sends the same bytes. No lock is shared with that thread: what the
handlers learn (a stream of the kubelet opened or ended, its first Allocate) goes to the
supervisor as an event (``on_stream``), and what the observers count on this loop stays here.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from typing import Any

import grpc

from . import logs, sockets
from .api import deviceplugin_pb2 as pb
from .api import deviceplugin_pb2_grpc as pb_grpc
from .kubeletapi import API_VERSION, MAX_SOCKET_PATH
from .published import NodeView
from .resources import AllocationError, ContainerAllocation, ResourcePool

LOG = logging.getLogger(__name__)

REGISTER_TIMEOUT_SECONDS = 10.0  # the kubelet's own dial-back waits up to 10 s (client.go dial)


def allocation_message(alloc: ContainerAllocation) -> Any:
    resp = pb.ContainerAllocateResponse(envs=alloc.envs)
    for spec in alloc.devices:
        resp.devices.add(container_path=spec.container_path, host_path=spec.host_path, permissions=spec.permissions)
    for name in alloc.cdi_devices:
        resp.cdi_devices.add(name=name)
    return resp


class Hooks:
    """Optional observers (status file, metrics); every method is a no-op here. ``allocated`` runs on
    the gRPC loop at every Allocate (an implementation keeps it to an append or an int); the others
    on the supervisor's thread. What they show comes from what the supervisor publishes."""

    def allocated(self, resource: str, seconds: float, ok: bool) -> None: ...

    def registered(self, resource: str) -> None: ...

    def kubelet_restarted(self) -> None: ...

    def rediscovered(self) -> None: ...

    def pools_ready(self, pools: Sequence[ResourcePool]) -> None: ...

    def stream_ended(self, resource: str) -> None:
        """The kubelet's ListAndWatch stream of ``resource`` ended while serving."""

    def probe_failed(self) -> None:
        """A run of the health probe failed (raised)."""

    def published(self, view: NodeView) -> None:
        """The supervisor published a new picture of the node (published.NodeView)."""

    def supervising(self, loops: Callable[[], Mapping[str, float]]) -> None:
        """Where to read when each step of the supervisor loop last completed (an immutable mapping)."""


class _Loop:
    """The one asyncio loop every plugin server and kubelet call runs on, in a daemon thread."""

    _lock = threading.Lock()  # threads starting the loop (the supervisor's, a test's); never taken on it
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
    def submit(cls, coro: Any) -> concurrent.futures.Future[Any]:
        return asyncio.run_coroutine_threadsafe(coro, cls.get())

    @classmethod
    def run(cls, coro: Any, timeout: float = 30.0) -> Any:
        return cls.submit(coro).result(timeout)


class _Wake:
    """Wakes the streams of one server on the loop (``notify`` is safe from any thread)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.event = asyncio.Event()

    def notify(self) -> None:
        self.loop.call_soon_threadsafe(self._fire)

    def _fire(self) -> None:
        event, self.event = self.event, asyncio.Event()
        event.set()


# An event of a server for the supervisor: (resource, server, what) with what one of
# "kubelet opened", "kubelet ended", "other ended" (streams) and "kubelet called" (the first Allocate
# or GetPreferredAllocation).
StreamEvent = Callable[[str, "PluginServer", str], None]


def _user_agent(context: Any) -> str:
    for key, value in context.invocation_metadata() or ():
        if key == "user-agent":
            return str(value)
    return ""


class DevicePluginServicer(pb_grpc.DevicePluginServicer):  # type: ignore[misc]
    """Reads only ``pool.view`` (the owner's published picture), once per call: no lock, no state of
    the pool's owner; everything else here is the gRPC loop's own."""

    def __init__(
        self,
        pool: ResourcePool,
        wake: _Wake,
        hooks: Hooks | None = None,
        on_stream: Callable[[str], None] | None = None,
    ) -> None:
        self.pool = pool
        self.wake = wake
        self.hooks = hooks or Hooks()
        self.on_stream = on_stream  # "kubelet opened", "kubelet ended", "other ended"
        self.stopping = False
        self.streams = 0  # open ListAndWatch streams, the kubelet's and others'
        self.ended = asyncio.Event()  # set when stopping and no stream is open any more
        self._expect_kubelet = False  # the next stream is the kubelet's (Register was sent)
        self._kubelet_stream: object | None = None  # the kubelet's open stream
        self._confirmed = False  # a kubelet call came (see _kubelet_called)

    @property
    def kubelet_stream_open(self) -> bool:
        return self._kubelet_stream is not None

    def expect_kubelet(self, on: bool = True) -> None:
        """Register is being sent (on: the next stream opened is the kubelet's, and a stream of an
        earlier registration no longer is) or failed (off)."""
        self._expect_kubelet = on
        if on:
            self._kubelet_stream = None

    def _response(self, requests: Sequence[Sequence[str]]) -> Any:
        # One view for the whole call: the answer, and its cached response, are those of the NIC set
        # the view describes (the AllocateResponse of each answer is built once per NIC set).
        view = self.pool.view
        allocs = [view.allocate(ids) for ids in requests]  # validates the IDs every time
        key = tuple(view.rules.key(ids) for ids in requests)
        response = view.responses.get(key)
        if response is not None:
            return response
        response = pb.AllocateResponse(container_responses=[allocation_message(a) for a in allocs])
        if len(view.responses) < 4096:  # bounded: a node has a handful of NICs
            view.responses[key] = response
        # Once per new answer, not per call (the kubelet logs every allocation itself; a log line
        # per call cost more than building the answer, issue 11): what this resource hands out now.
        LOG.info(
            "Allocate answer",
            extra={"resource": self.pool.name, "nics": ";".join(logs.names(a.nics) for a in allocs)},
        )
        return response

    async def GetDevicePluginOptions(self, request: Any, context: Any) -> Any:
        return pb.DevicePluginOptions(
            pre_start_required=False,
            get_preferred_allocation_available=self.pool.mode == "exclusive",
        )

    async def ListAndWatch(self, request: Any, context: Any) -> AsyncIterator[bytes]:
        me = object()
        kubelet = self._expect_kubelet
        if kubelet:
            self._expect_kubelet = False
            self._kubelet_stream = me
        self.streams += 1
        view = self.pool.view
        version = view.version
        LOG.info(
            "ListAndWatch opened",
            extra={"resource": self.pool.name, "kubelet": kubelet, "client": _user_agent(context)},
        )
        if kubelet and self.on_stream is not None:
            self.on_stream("kubelet opened")
        try:
            yield view.message
            while not self.stopping and not view.closed:
                event = self.wake.event
                view = self.pool.view
                if view.version == version:
                    await event.wait()
                    continue
                version = view.version
                LOG.info(
                    "sending snapshot",
                    extra={"resource": self.pool.name, "healthy": view.healthy, "bytes": len(view.message)},
                )
                yield view.message
        finally:
            self.streams -= 1
            if self.stopping and not self.streams:
                self.ended.set()
            ours = self._kubelet_stream is me
            if ours:
                self._kubelet_stream = None
            if not self.stopping and not self.pool.view.closed:
                if ours:
                    if self.on_stream is not None:
                        self.on_stream("kubelet ended")
                else:
                    LOG.debug(
                        "a ListAndWatch stream of another client ended",
                        extra={"resource": self.pool.name, "client": _user_agent(context)},
                    )
                    if self.on_stream is not None:
                        self.on_stream("other ended")

    def _kubelet_called(self) -> None:
        """Allocate and GetPreferredAllocation come only from the kubelet, only to the endpoint it
        holds for the resource: the first one tells the supervisor that this registration is it."""
        if not self._confirmed:
            self._confirmed = True
            if self.on_stream is not None:
                self.on_stream("kubelet called")

    async def Allocate(self, request: Any, context: Any) -> Any:
        start = time.perf_counter()
        self._kubelet_called()
        try:
            response = self._response([list(creq.devices_ids) for creq in request.container_requests])
        except AllocationError as exc:
            self.hooks.allocated(self.pool.name, time.perf_counter() - start, False)
            LOG.warning("Allocate refused: %s", exc)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if LOG.isEnabledFor(logging.DEBUG):  # per call: only at --log-level debug
            LOG.debug("allocated", extra={"resource": self.pool.name, "containers": len(request.container_requests)})
        self.hooks.allocated(self.pool.name, time.perf_counter() - start, True)
        return response

    async def GetPreferredAllocation(self, request: Any, context: Any) -> Any:
        self._kubelet_called()
        response = pb.PreferredAllocationResponse()
        view = self.pool.view
        for creq in request.container_requests:
            ids = view.preferred(
                list(creq.available_deviceIDs), list(creq.must_include_deviceIDs), creq.allocation_size
            )
            response.container_responses.add(deviceIDs=ids)
        return response

    async def PreStartContainer(self, request: Any, context: Any) -> Any:
        return pb.PreStartContainerResponse()


def _method_handlers(servicer: DevicePluginServicer) -> Any:
    """The generated service table, with ListAndWatch sending the view's pre-serialized bytes."""

    class _Capture:
        handlers: dict[str, Any] = {}

        def add_generic_rpc_handlers(self, handlers: Any) -> None: ...

        def add_registered_method_handlers(self, name: str, handlers: dict[str, Any]) -> None:
            self.handlers = dict(handlers)

    capture = _Capture()
    pb_grpc.add_DevicePluginServicer_to_server(servicer, capture)
    capture.handlers["ListAndWatch"] = grpc.unary_stream_rpc_method_handler(
        servicer.ListAndWatch, request_deserializer=pb.Empty.FromString, response_serializer=None
    )
    return capture.handlers


class SocketVanished(OSError):
    """The socket file was deleted between bind and the first look at it."""


class PluginServer:
    """One resource's gRPC server on ``<device_plugin_dir>/<socket_name>`` (a name used once)."""

    def __init__(
        self,
        pool: ResourcePool,
        device_plugin_dir: str,
        socket_name: str,
        hooks: Hooks | None = None,
        on_stream: StreamEvent | None = None,
    ):
        self.pool = pool
        self.dir = device_plugin_dir
        self.socket_name = socket_name
        self.path = os.path.join(device_plugin_dir, socket_name)
        self.hooks = hooks or Hooks()
        self.on_stream = on_stream
        self._server: grpc.aio.Server | None = None
        self._notify: Callable[[], None] | None = None
        self._servicer: DevicePluginServicer | None = None
        self._inode: int | None = None

    @property
    def serving(self) -> bool:
        return self._server is not None

    def start(self) -> None:
        """Bind and listen (raises OSError when the path cannot be bound)."""
        if len(self.path.encode()) > MAX_SOCKET_PATH:
            raise OSError(f"socket path {self.path} is {len(self.path)} bytes; unix sockets allow {MAX_SOCKET_PATH}")
        if not os.path.isdir(self.dir):
            raise OSError(f"the device-plugin dir {self.dir} does not exist")
        loop = _Loop.get()
        wake = _Wake(loop)

        def stream_event(what: str) -> None:
            if self.on_stream is not None:
                self.on_stream(self.pool.name, self, what)

        servicer = DevicePluginServicer(self.pool, wake, self.hooks, stream_event)
        handlers = _method_handlers(servicer)

        async def start() -> grpc.aio.Server:
            server = grpc.aio.server()
            server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("v1beta1.DevicePlugin", handlers),))
            server.add_insecure_port(f"unix://{self.path}")
            await server.start()
            return server

        try:
            server = _Loop.run(start())
        except RuntimeError as exc:  # grpc: "Failed to bind to address ..." (read-only or vanished dir)
            raise OSError(f"cannot bind a unix socket in {self.dir}: {exc}") from None
        # A newer instance may have renamed it to <name>.retiring already (taking over): still ours
        # (a name is used once), and present() then says it is gone.
        for path in (self.path, self.path + sockets.RETIRING):
            with contextlib.suppress(FileNotFoundError):
                self._inode = os.lstat(path).st_ino
                os.chmod(path, sockets.SOCKET_MODE)
                break
        else:
            _Loop.run(server.stop(0))
            raise SocketVanished(f"plugin socket {self.path} was removed as it was bound")
        self._notify = wake.notify
        self.pool.add_listener(self._notify)  # the pool's owner publishes, then wakes our streams
        self._server, self._servicer = server, servicer
        LOG.info("serving", extra={"resource": self.pool.name, "socket": self.path})

    def present(self) -> bool:
        """False once the kubelet (or another instance taking over) removed our socket file."""
        try:
            return os.lstat(self.path).st_ino == self._inode
        except FileNotFoundError:
            return False

    def open_streams(self) -> int:
        return self._servicer.streams if self._servicer is not None else 0

    @property
    def kubelet_stream_open(self) -> bool:
        return self._servicer is not None and self._servicer.kubelet_stream_open

    async def stop_async(self, grace: float = 0.5) -> None:
        """Stop serving (on the loop): the file is renamed <name>.retiring (other instances wait for
        our streams' ends), the streams end, then the file goes."""
        server, self._server = self._server, None
        servicer, self._servicer = self._servicer, None
        if server is None:
            return
        with contextlib.suppress(OSError):
            if os.lstat(self.path).st_ino == self._inode:
                os.rename(self.path, self.path + sockets.RETIRING)
        if servicer is not None:
            servicer.stopping = True
            if servicer.streams:
                servicer.wake.notify()  # wake its streams so they end
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(servicer.ended.wait(), grace)
        # Our streams are over: the file goes now, not after the server's shutdown, as it tells the
        # instance that stays to register again (:mod:`.registration`).
        self._unlink()
        await server.stop(grace)
        self._unlink()

    def _unlink(self) -> None:
        """Our file, under the name we served or renamed by a newer instance that took over: never a
        file that is not ours."""
        for path in (self.path, self.path + sockets.RETIRING):
            try:
                if os.lstat(path).st_ino == self._inode:
                    os.unlink(path)
            except FileNotFoundError:
                pass

    def forget(self) -> None:
        """No more wake-ups from the pool (on the pool owner's thread, as every listener change)."""
        if self._notify is not None:
            self.pool.remove_listener(self._notify)
            self._notify = None

    def stop(self, grace: float = 0.5) -> None:
        self.forget()
        _Loop.run(self.stop_async(grace), timeout=grace + 10.0)

    def stop_soon(self, grace: float = 0.5) -> concurrent.futures.Future[None]:
        """Stop on the loop without waiting for it (an Allocate in flight gets its grace there)."""
        self.forget()
        return _Loop.submit(self.stop_async(grace))

    def register(
        self, kubelet: sockets.SocketPin, timeout: float = REGISTER_TIMEOUT_SECONDS
    ) -> concurrent.futures.Future[None]:
        """Send Register on the loop to the kubelet start ``kubelet`` pins (never to one started
        since); the future fails with grpc.RpcError or OSError. The pin is closed when it is done."""
        future = _Loop.submit(self._register(kubelet, timeout))
        future.add_done_callback(lambda _: kubelet.abandon())  # cancelled before it started
        return future

    async def _register(self, kubelet: sockets.SocketPin, timeout: float) -> None:
        target = kubelet.take()
        if target is None:
            raise OSError("the registration was cancelled")
        try:
            servicer = self._servicer
            if servicer is None:
                raise OSError(f"{self.path} is not being served")
            servicer.expect_kubelet()
            request = pb.RegisterRequest(
                version=API_VERSION,
                endpoint=self.socket_name,
                resource_name=self.pool.name,
                options=pb.DevicePluginOptions(get_preferred_allocation_available=self.pool.mode == "exclusive"),
            )
            try:
                # A connection of its own: never a subchannel backing off after the kubelet restarted.
                options = [("grpc.use_local_subchannel_pool", 1)]
                async with grpc.aio.insecure_channel(target, options=options) as channel:
                    await pb_grpc.RegistrationStub(channel).Register(request, timeout=timeout)
            except grpc.aio.AioRpcError as exc:  # its text names kubelet.sock, not the pin's fd
                servicer.expect_kubelet(False)
                raise grpc.aio.AioRpcError(
                    exc.code(),
                    exc.initial_metadata(),
                    exc.trailing_metadata(),
                    kubelet.named(exc.details() or ""),
                    kubelet.named(exc.debug_error_string() or ""),
                ) from None
            except BaseException:
                servicer.expect_kubelet(False)
                raise
        finally:
            kubelet.close()
        LOG.info("registered with kubelet", extra={"resource": self.pool.name, "endpoint": self.socket_name})


def stop_all(
    servers: Iterable[PluginServer], stopping: Iterable[concurrent.futures.Future[None]] = (), grace: float = 0.5
) -> None:
    """Stop servers together, and let the ones already stopping finish: the exit takes one grace
    period, not one per resource."""

    servers = list(servers)
    for server in servers:
        server.forget()

    async def stop() -> None:
        await asyncio.gather(*(s.stop_async(grace) for s in servers))

    _Loop.run(stop(), timeout=grace + 10.0)
    concurrent.futures.wait(list(stopping), timeout=grace + 1.0)
