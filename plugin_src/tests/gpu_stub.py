"""A stub GPU device plugin for Topology Manager tests: ``nvidia.com/gpu`` with one device per GPU,
each carrying its NUMA node, served over real gRPC on a unix socket and registered with the kubelet
the way NVIDIA's plugin does (v1beta1 ``Register`` with the socket's file name).

It differs from NVIDIA's plugin in what it does not need here: no NVML (the GPUs are given), no
health watch (every device stays Healthy), no preferred allocation, and it does not re-register
after a kubelet restart. ``Allocate`` answers ``NVIDIA_VISIBLE_DEVICES`` with the device IDs, so a
test sees which GPUs a container got.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator, Sequence
from concurrent import futures
from typing import Any

import grpc

from rdma_device_plugin.api import deviceplugin_pb2 as pb
from rdma_device_plugin.api import deviceplugin_pb2_grpc as pb_grpc

RESOURCE = "nvidia.com/gpu"


class _Servicer(pb_grpc.DevicePluginServicer):  # type: ignore[misc]
    def __init__(self, gpus: Sequence[tuple[str, int | None]], stop: threading.Event) -> None:
        self.gpus = list(gpus)
        self.stop = stop
        self.allocated: list[list[str]] = []

    def GetDevicePluginOptions(self, request: Any, context: Any) -> Any:
        return pb.DevicePluginOptions()

    def ListAndWatch(self, request: Any, context: Any) -> Iterator[Any]:
        devices = []
        for gpu_id, numa in self.gpus:
            device = pb.Device(ID=gpu_id, health="Healthy")
            if numa is not None:
                device.topology.nodes.add(ID=numa)
            devices.append(device)
        yield pb.ListAndWatchResponse(devices=devices)
        while context.is_active() and not self.stop.wait(0.1):
            pass

    def Allocate(self, request: Any, context: Any) -> Any:
        response = pb.AllocateResponse()
        for creq in request.container_requests:
            ids = list(creq.devices_ids)
            self.allocated.append(ids)
            response.container_responses.add(envs={"NVIDIA_VISIBLE_DEVICES": ",".join(ids)})
        return response

    def PreStartContainer(self, request: Any, context: Any) -> Any:
        return pb.PreStartContainerResponse()


class GpuStubPlugin:
    """Serve and register ``nvidia.com/gpu`` in ``device_plugin_dir``; :meth:`stop` ends it."""

    def __init__(
        self, device_plugin_dir: str, gpus: Sequence[tuple[str, int | None]], socket_name: str = "nvidia-gpu.sock"
    ) -> None:
        self.dir = device_plugin_dir
        self.socket_name = socket_name
        self.path = os.path.join(device_plugin_dir, socket_name)
        self._stop = threading.Event()
        self.servicer = _Servicer(gpus, self._stop)
        self._server: grpc.Server | None = None

    def start(self, timeout: float = 10.0) -> GpuStubPlugin:
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        pb_grpc.add_DevicePluginServicer_to_server(self.servicer, server)
        server.add_insecure_port(f"unix://{self.path}")
        server.start()
        self._server = server
        kubelet = os.path.join(self.dir, "kubelet.sock")
        with grpc.insecure_channel(f"unix://{kubelet}") as channel:
            pb_grpc.RegistrationStub(channel).Register(
                pb.RegisterRequest(version="v1beta1", endpoint=self.socket_name, resource_name=RESOURCE),
                timeout=timeout,
            )
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._server is not None:
            self._server.stop(grace=1).wait(5)
            self._server = None
