"""gRPC lifecycle of one resource: serve DevicePlugin on a unix socket, then register.

Order matters (kubelet behaviour 1): the server listens first, then Register is called
from the supervisor's thread while the server's worker threads answer the kubelet's
GetDevicePluginOptions dial-back inside that Register call.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent import futures
from typing import Any

import grpc

from .api import deviceplugin_pb2 as pb
from .api import deviceplugin_pb2_grpc as pb_grpc
from .resources import AllocationError, ContainerAllocation, Device, ResourcePool

LOG = logging.getLogger(__name__)

API_VERSION = "v1beta1"
KUBELET_SOCKET = "kubelet.sock"
# A stream wakes at least this often to notice cancellation and shutdown.
STREAM_POLL_SECONDS = 1.0


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


class Hooks:
    """Optional observers (metrics); every method is a no-op here."""

    def allocated(self, resource: str, seconds: float, ok: bool) -> None: ...

    def registered(self, resource: str) -> None: ...

    def kubelet_restarted(self) -> None: ...

    def rediscovered(self) -> None: ...

    def port_states(self, states: Mapping[str, tuple[str, ...] | None]) -> None: ...

    def pools_ready(self, pools: Sequence[ResourcePool]) -> None: ...


class DevicePluginServicer(pb_grpc.DevicePluginServicer):  # type: ignore[misc]
    def __init__(self, pool: ResourcePool, hooks: Hooks | None = None) -> None:
        self.pool = pool
        self.hooks = hooks or Hooks()

    def GetDevicePluginOptions(self, request: Any, context: Any) -> Any:
        return pb.DevicePluginOptions(
            pre_start_required=False,
            get_preferred_allocation_available=self.pool.mode == "exclusive",
        )

    def ListAndWatch(self, request: Any, context: Any) -> Iterator[Any]:
        version, devices = self.pool.snapshot()
        LOG.info("ListAndWatch opened", extra={"resource": self.pool.name, "devices": len(devices)})
        yield pb.ListAndWatchResponse(devices=[device_message(d) for d in devices])
        while context.is_active():
            new_version, devices, closed = self.pool.wait_change(version, STREAM_POLL_SECONDS)
            if closed:
                return
            if new_version != version:
                version = new_version
                healthy = sum(1 for d in devices if d.health == "Healthy")
                LOG.info(
                    "sending snapshot",
                    extra={"resource": self.pool.name, "devices": len(devices), "healthy": healthy},
                )
                yield pb.ListAndWatchResponse(devices=[device_message(d) for d in devices])

    def Allocate(self, request: Any, context: Any) -> Any:
        start = time.perf_counter()
        response = pb.AllocateResponse()
        try:
            for creq in request.container_requests:
                alloc = self.pool.allocate(list(creq.devices_ids))
                response.container_responses.append(allocation_message(alloc))
                LOG.info(
                    "allocated",
                    extra={"resource": self.pool.name, "ids": len(creq.devices_ids), "nics": ",".join(alloc.nics)},
                )
        except AllocationError as exc:
            self.hooks.allocated(self.pool.name, time.perf_counter() - start, False)
            LOG.warning("Allocate refused: %s", exc)
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        self.hooks.allocated(self.pool.name, time.perf_counter() - start, True)
        return response

    def GetPreferredAllocation(self, request: Any, context: Any) -> Any:
        response = pb.PreferredAllocationResponse()
        for creq in request.container_requests:
            ids = self.pool.preferred(
                list(creq.available_deviceIDs), list(creq.must_include_deviceIDs), creq.allocation_size
            )
            response.container_responses.add(deviceIDs=ids)
        return response

    def PreStartContainer(self, request: Any, context: Any) -> Any:
        return pb.PreStartContainerResponse()


class PluginServer:
    """One resource's gRPC server bound to ``<device_plugin_dir>/<socket_name>``."""

    def __init__(self, pool: ResourcePool, device_plugin_dir: str, socket_name: str, hooks: Hooks | None = None):
        self.pool = pool
        self.dir = device_plugin_dir
        self.socket_name = socket_name
        self.path = os.path.join(device_plugin_dir, socket_name)
        self.hooks = hooks or Hooks()
        self._server: grpc.Server | None = None
        self._inode: int | None = None

    def start(self) -> None:
        if len(self.path) > 107:
            raise OSError(f"socket path {self.path} is {len(self.path)} bytes; unix sockets allow 107")
        if os.path.lexists(self.path):  # stale socket or leftover file: grpc refuses to bind over it
            os.unlink(self.path)
        # Each open ListAndWatch stream holds a worker; leave room for concurrent Allocates.
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=32, thread_name_prefix="dp-grpc"))
        pb_grpc.add_DevicePluginServicer_to_server(DevicePluginServicer(self.pool, self.hooks), server)
        server.add_insecure_port(f"unix://{self.path}")
        server.start()
        self._server = server
        self._inode = os.stat(self.path).st_ino
        LOG.info("serving", extra={"resource": self.pool.name, "socket": self.path})

    def alive(self) -> bool:
        """False once the kubelet (or anyone) deleted or replaced our socket file."""
        try:
            return self._server is not None and os.stat(self.path).st_ino == self._inode
        except FileNotFoundError:
            return False

    def stop(self, grace: float = 0.5) -> None:
        server, self._server = self._server, None
        if server is None:
            return
        # grpc unlinks the path on stop; only ours, since a new server is never bound before this.
        server.stop(grace).wait(grace + 1.0)
        if self._inode is not None and os.path.exists(self.path):
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
