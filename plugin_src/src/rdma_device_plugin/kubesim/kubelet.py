"""A kubelet device manager stand-in, at least as strict as kubelets 1.28-1.34.

It speaks the real v1beta1 protocol over real unix sockets and mirrors
``pkg/kubelet/cm/devicemanager`` (kubernetes/kubernetes), including its known bugs:

- Registration (``plugin/v1beta1/server.go`` ``Register`` -> ``handler.go`` ``connectClient``):
  version and resource name checked, the plugin dialled back blocking for up to 10 s
  (``client.go`` ``dial``), then ``GetDevicePluginOptions`` without a deadline
  (``manager.go`` ``PluginConnected``), then ListAndWatch in its own thread (``runClient``).
- Re-registration does not close the old client. When the old client's stream ends,
  ``runClient`` disconnects whatever client is registered under the resource *now*
  (``reregistration="buggy"``, kubelets up to the fix for kubernetes issues 121994/127803: the
  new registration's stream is cut) or the client of the same socket path
  (``reregistration="fixed"``). Either way ``Disconnect`` calls ``PluginDisconnected`` by
  resource name, which marks the *current* endpoint's devices unhealthy and stamps its stop time.
- Devices are kept in two sets, healthy and unhealthy (``genericDeviceUpdateCallback``): an ID
  listed twice with both healths counts twice in capacity. Capacity = |healthy| + |unhealthy|,
  allocatable = |healthy|; a stopped endpoint keeps its devices for 5 minutes, then the resource
  is dropped (``GetCapacity``, ``endpoint.go`` ``stopGracePeriodExpired``).
- ListAndWatch messages over 4 MiB fail the stream (gRPC's default receive limit; the kubelet's
  ``dial`` sets none).
- Allocate and GetPreferredAllocation are called without deadlines (``endpoint.go``
  ``allocate``/``getPreferredAllocation`` use ``context.Background()``); init-container devices
  are offered again to app containers as ``must_include`` (``manager.go`` ``Allocate``,
  ``devicesToAllocate``); an optional ``single-numa-node`` Topology Manager (``topology.py``).
- A restart deletes only the sockets in the directory (``server.go`` ``removeContents``).
"""

from __future__ import annotations

import json
import logging
import os
import stat
import threading
import time
from collections.abc import Callable, Sequence
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any, Literal

import grpc

from ..api import deviceplugin_pb2 as pb
from ..api import deviceplugin_pb2_grpc as pb_grpc
from ..config import resource_name_problem
from . import topology

LOG = logging.getLogger(__name__)
CHECKPOINT = "kubelet_internal_checkpoint"
KUBELET_SOCKET = "kubelet.sock"
DIAL_TIMEOUT_SECONDS = 10.0  # client.go dial
STOP_GRACE_SECONDS = 300.0  # endpoint.go endpointStopGracePeriod
MAX_RECEIVE_BYTES = 4 * 1024 * 1024  # grpc-go default MaxCallRecvMsgSize; the kubelet keeps it
HEALTHY = "Healthy"

Reregistration = Literal["buggy", "fixed"]


@dataclass
class _Client:
    """client.go ``client``: one registration's connection and its ListAndWatch stream."""

    resource: str
    socket: str  # endpoint file name, as registered
    path: str
    channel: grpc.Channel
    stub: Any
    stream: Any = None
    stream_open: bool = False


@dataclass
class Endpoint:
    """manager.go ``endpointInfo``: the endpoint of a resource and the options it reported."""

    resource: str
    socket: str
    options: Any
    client: _Client
    devices: dict[str, Any] = field(default_factory=dict)  # allDevices: ID -> pb.Device (last wins)
    snapshots: list[tuple[float, int, int]] = field(default_factory=list)  # (time, capacity, allocatable)
    stop_time: float | None = None

    @property
    def stub(self) -> Any:
        return self.client.stub

    @property
    def stream_open(self) -> bool:
        return self.client.stream_open


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
    def __init__(
        self,
        device_plugin_dir: str,
        node_name: str = "lingjun-node-0",
        *,
        reregistration: Reregistration = "buggy",
        stop_grace_seconds: float = STOP_GRACE_SECONDS,
        stale_teardown_delay: float = 0.0,
        topology_policy: Literal["none", "single-numa-node"] = "none",
    ) -> None:
        self.dir = device_plugin_dir
        self.node_name = node_name
        self.reregistration = reregistration
        self.stop_grace_seconds = stop_grace_seconds
        # Delay between a stream's end and runClient's teardown: widens the real race in which a
        # plugin re-registers before the kubelet tears down the old client (kubernetes 121994).
        self.stale_teardown_delay = stale_teardown_delay
        self.topology_policy = topology_policy
        self.endpoints: dict[str, Endpoint] = {}
        self.healthy: dict[str, set[str]] = {}
        self.unhealthy: dict[str, set[str]] = {}
        self._clients: dict[str, list[_Client]] = {}
        self.allocations: list[Allocation] = []
        self.registrations: list[tuple[float, str]] = []
        self.rejections: list[str] = []
        self.stream_errors: list[tuple[str, str]] = []  # (resource, gRPC status) of streams that failed
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
            clients = [c for cs in self._clients.values() for c in cs]
            self._clients.clear()
            self.endpoints.clear()
            self.healthy.clear()
            self.unhealthy.clear()
            self._cond.notify_all()
        for c in clients:
            _close(c)

    def restart(self) -> None:
        """What a kubelet restart does to the device-plugin dir: server.go ``removeContents``
        removes every unix socket (plugins watch this) and nothing else."""
        self.stop()
        for entry in os.listdir(self.dir):
            path = os.path.join(self.dir, entry)
            try:
                if stat.S_ISSOCK(os.lstat(path).st_mode):
                    os.unlink(path)
            except FileNotFoundError:
                pass
        self.restarts += 1
        self.start()

    def _write_checkpoint(self) -> None:
        data = {
            "Data": {
                "PodDeviceEntries": [
                    {"PodUID": a.pod, "ContainerName": a.container, "ResourceName": a.resource, "DeviceIDs": a.ids}
                    for a in self.allocations
                ],
                "RegisteredDevices": {r: sorted(ids) for r, ids in self.healthy.items()},
            },
            "Checksum": 0,
        }
        with open(os.path.join(self.dir, CHECKPOINT), "w", encoding="utf-8") as fh:
            json.dump(data, fh)

    # ------------------------------------------------------------------ handler.go: clients

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
        # The kubelet is its own process: never share a subchannel (and its reconnect backoff
        # after the socket vanished) with other clients in this process. The receive limit is
        # gRPC's default, stated so that it is visible.
        channel = grpc.insecure_channel(
            f"unix://{path}",
            options=[("grpc.use_local_subchannel_pool", 1), ("grpc.max_receive_message_length", MAX_RECEIVE_BYTES)],
        )
        client = _Client(request.resource_name, request.endpoint, path, channel, pb_grpc.DevicePluginStub(channel))
        # handler.go connectClient: registerClient first, then Connect; on failure deregister.
        self._register_client(client)
        try:
            grpc.channel_ready_future(channel).result(timeout=DIAL_TIMEOUT_SECONDS)
            # manager.go PluginConnected: no deadline.
            options = client.stub.GetDevicePluginOptions(pb.Empty())
        except (grpc.FutureTimeoutError, grpc.RpcError) as exc:
            self._deregister_client(client)
            channel.close()
            self.rejections.append(f"dial {request.endpoint}")
            context.abort(grpc.StatusCode.UNAVAILABLE, f"cannot dial plugin at {path}: {exc}")
        with self._cond:
            # PluginConnected replaces the endpoint; the old client is NOT closed.
            self.endpoints[request.resource_name] = Endpoint(request.resource_name, request.endpoint, options, client)
            self.registrations.append((time.monotonic(), request.resource_name))
            self._cond.notify_all()
        threading.Thread(
            target=self._run_client, args=(client,), name=f"law-{request.resource_name}", daemon=True
        ).start()
        return pb.Empty()

    def _register_client(self, c: _Client) -> None:
        with self._cond:
            if self.reregistration == "buggy":
                self._clients[c.resource] = [c]  # s.clients[name] = c
            else:
                self._clients.setdefault(c.resource, []).append(c)

    def _deregister_client(self, c: _Client) -> None:
        with self._cond:
            clients = self._clients.get(c.resource, [])
            if self.reregistration == "buggy":
                self._clients.pop(c.resource, None)  # delete(s.clients, name): whichever is there
                return
            for i, other in enumerate(clients):
                if other.path == c.path:
                    del clients[i]
                    break
            if not clients:
                self._clients.pop(c.resource, None)

    def _get_client(self, c: _Client) -> _Client | None:
        with self._cond:
            clients = self._clients.get(c.resource, [])
            if self.reregistration == "buggy":
                return clients[0] if clients else None  # by resource name only
            return next((o for o in clients if o.path == c.path), None)

    def _run_client(self, c: _Client) -> None:
        """handler.go runClient: Run, then disconnect the client found *now* (see module doc)."""
        self._run(c)
        if self.stale_teardown_delay:
            time.sleep(self.stale_teardown_delay)
        found = self._get_client(c)
        if found is None:
            return
        self._deregister_client(found)
        _close(found)  # client.go Disconnect: close the connection (its stream ends) ...
        self._plugin_disconnected(found.resource)  # ... then PluginDisconnected by resource name

    def _run(self, c: _Client) -> None:
        """client.go Run: one ListAndWatch, every response to the device manager, no retry."""
        try:
            stream = c.stub.ListAndWatch(pb.Empty())
            c.stream = stream
            with self._cond:
                c.stream_open = True
                self._cond.notify_all()
            for resp in stream:
                self._receive(c, resp)
        except grpc.RpcError as exc:
            code = exc.code() if hasattr(exc, "code") else None
            if code is not None and code != grpc.StatusCode.CANCELLED:
                self.stream_errors.append((c.resource, code.name))
                LOG.info("ListAndWatch ended unexpectedly", extra={"resource": c.resource, "code": code.name})
        finally:
            with self._cond:
                c.stream_open = False
                self._cond.notify_all()

    # ------------------------------------------------------------------ manager.go

    def _receive(self, c: _Client, resp: Any) -> None:
        """PluginListAndWatchReceiver -> genericDeviceUpdateCallback: two sets, not de-duplicated."""
        with self._cond:
            ep = self.endpoints.get(c.resource)
            healthy = {d.ID for d in resp.devices if d.health == HEALTHY}
            unhealthy = {d.ID for d in resp.devices if d.health != HEALTHY}
            self.healthy[c.resource] = healthy
            self.unhealthy[c.resource] = unhealthy
            if ep is not None:
                ep.devices = {d.ID: d for d in resp.devices}
                if ep.client is c:
                    ep.snapshots.append((time.monotonic(), len(healthy) + len(unhealthy), len(healthy)))
            self._write_checkpoint()
            self._cond.notify_all()

    def _plugin_disconnected(self, resource: str) -> None:
        """PluginDisconnected: markResourceUnhealthy and stamp the stop time of the current endpoint."""
        with self._cond:
            ep = self.endpoints.get(resource)
            if ep is not None:
                moved = self.healthy.get(resource, set())
                self.healthy[resource] = set()
                self.unhealthy[resource] = self.unhealthy.get(resource, set()) | moved
                ep.stop_time = time.monotonic()
                ep.snapshots.append((time.monotonic(), len(self.unhealthy[resource]), 0))
            self._cond.notify_all()

    def _expire(self) -> None:
        """GetCapacity: drop a resource whose endpoint stopped more than the grace period ago."""
        now = time.monotonic()
        for resource in list(self.endpoints):
            ep = self.endpoints[resource]
            if ep.stop_time is not None and now - ep.stop_time > self.stop_grace_seconds:
                del self.endpoints[resource]
                self.healthy.pop(resource, None)
                self.unhealthy.pop(resource, None)

    # ------------------------------------------------------------------ status

    def capacity(self, resource: str) -> int:
        with self._cond:
            self._expire()
            if resource not in self.endpoints:
                return 0
            return len(self.healthy.get(resource, ())) + len(self.unhealthy.get(resource, ()))

    def allocatable(self, resource: str) -> int:
        with self._cond:
            self._expire()
            return len(self.healthy.get(resource, ())) if resource in self.endpoints else 0

    def devices(self, resource: str) -> dict[str, Any]:
        """The devices of a resource with the health the kubelet holds for them."""
        with self._cond:
            self._expire()
            ep = self.endpoints.get(resource)
            if ep is None:
                return {}
            healthy = self.healthy.get(resource, set())
            return {
                i: pb.Device(ID=i, health=HEALTHY if i in healthy else "Unhealthy", topology=d.topology)
                for i, d in ep.devices.items()
            }

    def node_status(self) -> dict[str, dict[str, str]]:
        """The part of ``kubectl get node -o yaml`` the device manager owns."""
        with self._cond:
            self._expire()
            names = sorted(self.endpoints)
        return {
            "capacity": {r: format_quantity(self.capacity(r)) for r in names},
            "allocatable": {r: format_quantity(self.allocatable(r)) for r in names},
        }

    def end_stream(self, resource: str) -> None:
        """The kubelet side ends the current ListAndWatch stream (its connection broke)."""
        with self._cond:
            ep = self.endpoints.get(resource)
        if ep is not None and ep.client.stream is not None:
            ep.client.stream.cancel()

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

    # ------------------------------------------------------------------ allocation (manager.go)

    def allocate(self, resource: str, count: int = 1, pod: str = "pod", container: str = "main") -> Allocation:
        """Admit one container asking for ``count`` of ``resource``, as the device manager does."""
        return self.allocate_pod(pod, {resource: count}, containers=[container])[-1]

    def allocate_pod(
        self,
        pod: str,
        requests: dict[str, int],
        containers: Sequence[str] = ("main",),
        init_containers: Sequence[str] = (),
        container_requests: dict[str, dict[str, int]] | None = None,
    ) -> list[Allocation]:
        """Admit a pod: init containers first, their devices reusable by later containers.

        ``container_requests`` overrides ``requests`` per container name.
        """
        reuse: dict[str, set[str]] = {}  # manager.go devicesToReuse[podUID]
        out: list[Allocation] = []
        for name in list(init_containers) + list(containers):
            for resource, count in (container_requests or {}).get(name, requests).items():
                alloc = self._allocate_container(pod, name, resource, count, reuse.get(resource, set()))
                out.append(alloc)
                if name in init_containers:
                    reuse.setdefault(resource, set()).update(alloc.ids)  # addContainerAllocatedResources
                else:
                    reuse[resource] = reuse.get(resource, set()) - set(alloc.ids)  # remove...
        return out

    def _allocate_container(
        self, pod: str, container: str, resource: str, count: int, reusable: set[str]
    ) -> Allocation:
        ids, ep = self._devices_to_allocate(resource, count, reusable)
        areq = pb.AllocateRequest()
        areq.container_requests.add(devices_ids=ids)
        try:
            aresp = ep.stub.Allocate(areq)  # endpoint.go allocate: no deadline
        except grpc.RpcError as exc:
            raise AllocationFailed(f"Allocate failed: {exc.code().name}: {exc.details()}") from None
        if len(aresp.container_responses) != 1:
            raise AllocationFailed(f"Allocate returned {len(aresp.container_responses)} container responses")
        alloc = Allocation(pod, container, resource, ids, aresp.container_responses[0])
        with self._cond:
            self.allocations.append(alloc)
            self._write_checkpoint()
        return alloc

    def _devices_to_allocate(self, resource: str, count: int, reusable: set[str]) -> tuple[list[str], Endpoint]:
        """manager.go devicesToAllocate (with filterByAffinity and the preferred-allocation call)."""
        with self._cond:
            self._expire()
            ep = self.endpoints.get(resource)
            if ep is None or resource not in self.healthy:
                raise AllocationFailed(f"can't allocate unregistered device {resource}")
            in_use = {i for a in self.allocations if a.resource == resource for i in a.ids}
            allocated: list[str] = []
            for d in sorted(reusable):
                if len(allocated) < count:
                    allocated.append(d)
            if len(allocated) == count:
                return allocated, ep
            needed = count - len(allocated)
            available = self.healthy[resource] - in_use - set(allocated)
            if len(available) < needed:
                raise AllocationFailed(
                    f"requested number of devices unavailable for {resource}. "
                    f"Requested: {needed}, Available: {len(available)}"
                )
            numa_of = {i: tuple(n.ID for n in d.topology.nodes) for i, d in ep.devices.items()}
            options = ep.options
            stub = ep.stub
        affinity = None
        if self.topology_policy == "single-numa-node":
            try:
                affinity = topology.single_numa_node(topology.device_hints(numa_of, available, allocated, count))
            except ValueError as exc:
                raise AllocationFailed(str(exc)) from None
        if affinity is None:
            aligned, unaligned, no_affinity = set(), set(), set(available)
        else:
            aligned = {d for d in available if set(numa_of.get(d, ())) & affinity}
            no_affinity = {d for d in available if not numa_of.get(d)}
            unaligned = available - aligned - no_affinity

        def take(pool: Sequence[str] | set[str]) -> bool:
            for d in sorted(pool) if isinstance(pool, set) else pool:
                if len(allocated) == count:
                    break
                if d not in allocated:
                    allocated.append(d)
            return len(allocated) == count

        def preferred(candidates: set[str]) -> list[str]:
            if not options.get_preferred_allocation_available:
                return []
            req = pb.PreferredAllocationRequest()
            req.container_requests.add(
                available_deviceIDs=sorted(candidates | set(allocated)),
                must_include_deviceIDs=list(allocated),
                allocation_size=count,
            )
            resp = stub.GetPreferredAllocation(req)  # endpoint.go getPreferredAllocation: no deadline
            return list(resp.container_responses[0].deviceIDs)

        if needed < len(aligned):  # strictly less, as the kubelet has it
            if take([d for d in preferred(aligned) if d in aligned]) or take(aligned):
                return allocated, ep
            raise AllocationFailed("unexpectedly allocated less resources than required")
        if take(aligned):
            return allocated, ep
        if take([d for d in preferred(available) if d in available]):
            return allocated, ep
        if take(unaligned) or take(no_affinity):
            return allocated, ep
        raise AllocationFailed("unexpectedly allocated less resources than required")

    def release(self, pod: str) -> None:
        with self._cond:
            self.allocations = [a for a in self.allocations if a.pod != pod]
            self._write_checkpoint()


def _close(c: _Client) -> None:
    if c.stream is not None:
        c.stream.cancel()
    c.channel.close()


class _Registration(pb_grpc.RegistrationServicer):  # type: ignore[misc]
    def __init__(self, sim: KubeletSimulator) -> None:
        self.sim = sim

    def Register(self, request: Any, context: Any) -> Any:
        return self.sim._register(request, context)
