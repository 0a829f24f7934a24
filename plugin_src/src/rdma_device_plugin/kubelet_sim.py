"""A kubelet stand-in for tests, benchmarks and the local default (no cluster exists here).

It speaks the real v1beta1 protocol over real unix sockets and behaves as the kubelet's
device manager does (see docs/kubelet-simulator.md): serves Registration on
``kubelet.sock``; validates version and resource name; dials the plugin back and calls
GetDevicePluginOptions inside Register; opens ListAndWatch once and keeps capacity and
allocatable from every full snapshot (allocatable = devices whose health is exactly
"Healthy"); marks everything unhealthy when a stream ends; allocates only healthy,
unallocated devices (asking GetPreferredAllocation when advertised and intersecting the
answer with the available set); and can restart (every socket deleted except its
checkpoint file, ``kubelet.sock`` re-created).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import grpc

from .api import deviceplugin_pb2 as pb
from .api import deviceplugin_pb2_grpc as pb_grpc
from .config import resource_name_problem

LOG = logging.getLogger(__name__)
CHECKPOINT = "kubelet_internal_checkpoint"
KUBELET_SOCKET = "kubelet.sock"


@dataclass
class Endpoint:
    resource: str
    socket: str
    options: Any
    channel: grpc.Channel
    stub: Any
    devices: dict[str, Any] = field(default_factory=dict)  # ID -> pb.Device
    snapshots: list[tuple[float, int, int]] = field(default_factory=list)  # (time, capacity, allocatable)
    stream_open: bool = False
    stream: Any = None


class Allocation:
    def __init__(self, pod: str, container: str, resource: str, ids: list[str], response: Any):
        self.pod, self.container, self.resource, self.ids, self.response = pod, container, resource, ids, response

    @property
    def device_paths(self) -> list[str]:
        return [d.host_path for d in self.response.devices]

    @property
    def envs(self) -> dict[str, str]:
        return dict(self.response.envs)


class AllocationFailed(Exception):
    pass


def format_quantity(n: int) -> str:
    """Kubernetes canonical DecimalSI form: 1000 -> "1k", 1500 -> "1500"."""
    for suffix, factor in (("E", 10**18), ("P", 10**15), ("T", 10**12), ("G", 10**9), ("M", 10**6), ("k", 10**3)):
        if n and n % factor == 0:
            return f"{n // factor}{suffix}"
    return str(n)


class KubeletSimulator:
    def __init__(self, device_plugin_dir: str, node_name: str = "lingjun-node-0") -> None:
        self.dir = device_plugin_dir
        self.node_name = node_name
        self.endpoints: dict[str, Endpoint] = {}
        self.allocations: list[Allocation] = []
        self.registrations: list[tuple[float, str]] = []
        self.rejections: list[str] = []
        self._cond = threading.Condition()
        self._server: grpc.Server | None = None
        self.restarts = 0

    # ------------------------------------------------------------------ lifecycle

    @property
    def socket(self) -> str:
        return os.path.join(self.dir, KUBELET_SOCKET)

    def start(self) -> KubeletSimulator:
        os.makedirs(self.dir, exist_ok=True)
        self._write_checkpoint()
        if os.path.lexists(self.socket):
            os.unlink(self.socket)
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="kubelet-sim"))
        pb_grpc.add_RegistrationServicer_to_server(_Registration(self), server)
        server.add_insecure_port(f"unix://{self.socket}")
        server.start()
        self._server = server
        return self

    def stop(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.stop(0).wait(2)
        with self._cond:
            for ep in self.endpoints.values():
                self._close_endpoint(ep)
            self.endpoints.clear()
            self._cond.notify_all()

    def restart(self) -> None:
        """What a kubelet restart does to the device-plugin dir."""
        self.stop()
        for entry in os.listdir(self.dir):
            if entry != CHECKPOINT:
                path = os.path.join(self.dir, entry)
                if not os.path.isdir(path):
                    os.unlink(path)
        self.restarts += 1
        self.start()

    def _write_checkpoint(self) -> None:
        data = {
            "Data": {
                "PodDeviceEntries": [
                    {"PodUID": a.pod, "ContainerName": a.container, "ResourceName": a.resource, "DeviceIDs": a.ids}
                    for a in self.allocations
                ],
                "RegisteredDevices": {r: sorted(ep.devices) for r, ep in self.endpoints.items()},
            },
            "Checksum": 0,
        }
        with open(os.path.join(self.dir, CHECKPOINT), "w", encoding="utf-8") as fh:
            json.dump(data, fh)

    # ------------------------------------------------------------------ registration

    def _register(self, request: Any, context: Any) -> Any:
        if request.version != "v1beta1":
            self.rejections.append(f"version {request.version}")
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"unsupported API version {request.version!r}")
        problem = resource_name_problem(request.resource_name)
        if problem:
            self.rejections.append(f"resource {request.resource_name}")
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"invalid resource name {request.resource_name!r}: {problem}"
            )
        if "/" in request.endpoint:
            self.rejections.append(f"endpoint {request.endpoint}")
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "endpoint must be a file name in the device-plugin dir")
        path = os.path.join(self.dir, request.endpoint)
        # The kubelet is its own process: never share a subchannel (and its reconnect
        # backoff after the socket vanished) with other clients living in this process.
        channel = grpc.insecure_channel(f"unix://{path}", options=[("grpc.use_local_subchannel_pool", 1)])
        try:
            grpc.channel_ready_future(channel).result(timeout=10)
            stub = pb_grpc.DevicePluginStub(channel)
            options = stub.GetDevicePluginOptions(pb.Empty(), timeout=10)
        except (grpc.FutureTimeoutError, grpc.RpcError) as exc:
            channel.close()
            self.rejections.append(f"dial {request.endpoint}")
            context.abort(grpc.StatusCode.UNAVAILABLE, f"cannot dial plugin at {path}: {exc}")
        ep = Endpoint(request.resource_name, request.endpoint, options, channel, stub)
        with self._cond:
            old = self.endpoints.get(request.resource_name)
            if old is not None:
                self._close_endpoint(old)
            self.endpoints[request.resource_name] = ep
            self.registrations.append((time.monotonic(), request.resource_name))
            self._cond.notify_all()
        threading.Thread(target=self._watch, args=(ep,), name=f"law-{request.resource_name}", daemon=True).start()
        return pb.Empty()

    def _close_endpoint(self, ep: Endpoint) -> None:
        if ep.stream is not None:
            ep.stream.cancel()
        ep.channel.close()

    def _watch(self, ep: Endpoint) -> None:
        try:
            stream = ep.stub.ListAndWatch(pb.Empty())
            ep.stream = stream
            ep.stream_open = True
            for resp in stream:
                with self._cond:
                    ep.devices = {d.ID: d for d in resp.devices}
                    cap = len(ep.devices)
                    alloc = sum(1 for d in resp.devices if d.health == "Healthy")
                    ep.snapshots.append((time.monotonic(), cap, alloc))
                    self._cond.notify_all()
        except grpc.RpcError:
            pass
        finally:
            with self._cond:
                ep.stream_open = False
                # The kubelet marks every device of an ended stream unhealthy.
                ep.devices = {
                    i: pb.Device(ID=i, health="Unhealthy", topology=d.topology) for i, d in ep.devices.items()
                }
                if self.endpoints.get(ep.resource) is ep:
                    ep.snapshots.append((time.monotonic(), len(ep.devices), 0))
                self._cond.notify_all()

    # ------------------------------------------------------------------ status

    def capacity(self, resource: str) -> int:
        with self._cond:
            ep = self.endpoints.get(resource)
            return len(ep.devices) if ep else 0

    def allocatable(self, resource: str) -> int:
        with self._cond:
            ep = self.endpoints.get(resource)
            return sum(1 for d in ep.devices.values() if d.health == "Healthy") if ep else 0

    def devices(self, resource: str) -> dict[str, Any]:
        with self._cond:
            ep = self.endpoints.get(resource)
            return dict(ep.devices) if ep else {}

    def node_status(self) -> dict[str, dict[str, str]]:
        """The part of ``kubectl get node -o yaml`` the device manager owns."""
        with self._cond:
            names = sorted(self.endpoints)
        return {
            "capacity": {r: format_quantity(self.capacity(r)) for r in names},
            "allocatable": {r: format_quantity(self.allocatable(r)) for r in names},
        }

    def wait_for(self, predicate: Callable[[], bool], timeout: float = 10.0) -> bool:
        deadline = time.monotonic() + timeout
        with self._cond:
            while not predicate():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cond.wait(min(remaining, 0.05))
        return True

    def wait_registered(self, resource: str, count: int = 1, timeout: float = 10.0) -> bool:
        return self.wait_for(
            lambda: (
                sum(1 for _, r in self.registrations if r == resource) >= count
                and resource in self.endpoints
                and self.endpoints[resource].stream_open
                and bool(self.endpoints[resource].snapshots)
            ),
            timeout,
        )

    # ------------------------------------------------------------------ allocation

    def allocate(self, resource: str, count: int = 1, pod: str = "pod", container: str = "main") -> Allocation:
        """Admit one container asking for ``count`` of ``resource``, as the device manager does."""
        with self._cond:
            ep = self.endpoints.get(resource)
            if ep is None:
                raise AllocationFailed(f"resource {resource} is not registered")
            used = {i for a in self.allocations if a.resource == resource for i in a.ids}
            free = sorted(i for i, d in ep.devices.items() if d.health == "Healthy" and i not in used)
        if len(free) < count:
            raise AllocationFailed(f"requested {count} {resource}, {len(free)} available")
        ids = free[:count]
        if ep.options.get_preferred_allocation_available:
            req = pb.PreferredAllocationRequest()
            req.container_requests.add(available_deviceIDs=free, must_include_deviceIDs=[], allocation_size=count)
            resp = ep.stub.GetPreferredAllocation(req, timeout=10)
            preferred = [i for i in resp.container_responses[0].deviceIDs if i in set(free)]
            if len(preferred) == count:
                ids = preferred
        areq = pb.AllocateRequest()
        areq.container_requests.add(devices_ids=ids)
        try:
            aresp = ep.stub.Allocate(areq, timeout=30)
        except grpc.RpcError as exc:
            raise AllocationFailed(f"Allocate failed: {exc.code().name}: {exc.details()}") from None
        if not aresp.container_responses:
            raise AllocationFailed("Allocate returned no container response")
        alloc = Allocation(pod, container, resource, ids, aresp.container_responses[0])
        with self._cond:
            self.allocations.append(alloc)
            self._write_checkpoint()
        return alloc

    def release(self, pod: str) -> None:
        with self._cond:
            self.allocations = [a for a in self.allocations if a.pod != pod]
            self._write_checkpoint()


class _Registration(pb_grpc.RegistrationServicer):  # type: ignore[misc]
    def __init__(self, sim: KubeletSimulator) -> None:
        self.sim = sim

    def Register(self, request: Any, context: Any) -> Any:
        return self.sim._register(request, context)
