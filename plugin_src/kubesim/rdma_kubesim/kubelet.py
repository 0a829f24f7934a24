"""A kubelet device manager stand-in, at least as strict as kubelets 1.28-1.34.

It speaks the real v1beta1 protocol over real unix sockets and mirrors
``pkg/kubelet/cm/devicemanager`` (kubernetes/kubernetes; checked against the real v1.32.10 code run
by ``kubesim/real.py``, which the tests run side by side with it), including its known bugs:

- Start (``manager.go`` ``Start`` -> ``readCheckpoint``, plugin/v1beta1/``server.go`` ``Start`` ->
  ``CleanupPluginDirectory``): every non-directory entry of the dir but ``kubelet_internal_checkpoint``
  is removed (1.32; newer kubelets remove only sockets), then the checkpoint is read back: the
  allocations come back and each registered resource is a *stopped* endpoint with no devices
  (capacity and allocatable 0) until its plugin registers; then ``kubelet.sock`` is served.
- Registration (``server.go`` ``Register`` -> ``handler.go`` ``connectClient``): version and resource
  name checked (``v1helper.IsExtendedResourceName``, written out here from the kubelet's rule), the
  plugin dialled back blocking for up to 10 s (``client.go`` ``dial``), then
  ``GetDevicePluginOptions`` without a deadline (``manager.go`` ``PluginConnected``), then
  ListAndWatch in its own thread (``runClient``). Every refusal is a Go error: gRPC code Unknown.
- Re-registration does not close the old client. ``reregistration="buggy"`` (kubelets 1.28-1.34,
  kubernetes issues 121994/127803): clients are kept by resource name, and when a client's stream
  ends ``runClient`` disconnects whatever client is registered under the name *now* (a new
  registration's stream is cut), then ``PluginDisconnected`` by name marks the current endpoint's
  devices unhealthy and stops it. ``"fixed"`` (kubernetes PR 135437): clients and endpoints are
  tracked by socket path, an old client's end disconnects only that client and touches the
  resource only while its endpoint is the current one, and a second registration of a path whose
  client is still connected is refused.
- Devices are kept in two sets, healthy and unhealthy (``genericDeviceUpdateCallback``): an ID
  listed twice with both healths counts twice in capacity. Capacity = |healthy| + |unhealthy|,
  allocatable = |healthy|; a stopped endpoint keeps its devices for 5 minutes, then the resource
  is dropped (``GetCapacity``, ``endpoint.go`` ``stopGracePeriodExpired``). A stopped endpoint
  refuses Allocate, GetPreferredAllocation and PreStartContainer (``endpoint.go`` ``isStopped``).
- ListAndWatch messages over 4 MiB fail the stream (gRPC's default receive limit; the kubelet's
  ``dial`` sets none).
- Allocation (``manager.go`` ``Allocate``, ``devicesToAllocate``, ``allocateContainerResources``):
  device IDs are sets, so the devices chosen and the IDs sent (Allocate, GetPreferredAllocation,
  PreStartContainer) come in no particular order (Go map order; here a seeded shuffle); Allocate
  and GetPreferredAllocation have no deadline, PreStartContainer 30 s and is called when the
  plugin asks for it; init-container devices are offered again to later containers as
  ``must_include``, except a restartable init container's (a sidecar keeps them); a container that
  already has devices (a restart, a re-admission) gets no Allocate call, but its resource must be
  registered and its devices still healthy. Allocations are checkpointed in the v2 format (IDs per
  NUMA node, the Allocate response, an FNV-32a checksum of the spew dump, as the kubelet computes
  it), so the real kubelet reads what this one wrote.
- An optional ``single-numa-node`` Topology Manager computes hints from ``TopologyInfo``
  (``topology.py``); an optional node-status sync (``node_status_sync_seconds``, 10 s on a real node)
  for tests that reason about the Node object rather than the kubelet's own view.

Where it still differs: there is no container runtime (nothing is "already running" after a
restart) and no API server; ``release`` frees a pod's devices at once (the kubelet frees them at
its next allocation once the pod is gone).
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import os
import random
import re
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any, Literal

import grpc

from rdma_device_plugin.api import deviceplugin_pb2 as pb
from rdma_device_plugin.api import deviceplugin_pb2_grpc as pb_grpc
from rdma_device_plugin.kubeletapi import (
    API_VERSION,
    CHECKPOINT,
    HEALTHY,
    KUBELET_SOCKET,
    MAX_MESSAGE_BYTES,
    PRE_START_CONTAINER_TIMEOUT_SECONDS,
    UNHEALTHY,
)

from . import topology

LOG = logging.getLogger(__name__)
DIAL_TIMEOUT_SECONDS = 10.0  # client.go dial
STOP_GRACE_SECONDS = 300.0  # endpoint.go endpointStopGracePeriod
NODE_WITHOUT_TOPOLOGY = -1  # manager.go nodeWithoutTopology: the NUMA key of devices without one

Reregistration = Literal["buggy", "fixed"]

# --------------------------------------------------------------------------- the kubelet's name rule

_DNS1123_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_QUALIFIED_NAME = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]")


def is_extended_resource_name(name: str) -> bool:
    """``pkg/apis/core/v1/helper.IsExtendedResourceName``: not native (has a ``/``, no
    ``kubernetes.io/``), not ``requests.``-prefixed, and ``requests.<name>`` is a qualified name
    (``apimachinery validation.IsQualifiedName``: a DNS-1123 subdomain prefix of at most 253, a name
    of at most 63)."""
    if "/" not in name or "kubernetes.io/" in name or name.startswith("requests."):
        return False
    parts = ("requests." + name).split("/")
    if len(parts) != 2:
        return False
    prefix, short = parts
    if not prefix or len(prefix) > 253 or not _DNS1123_SUBDOMAIN.fullmatch(prefix):
        return False
    return bool(short) and len(short) <= 63 and bool(_QUALIFIED_NAME.fullmatch(short))


# --------------------------------------------------------------------------- the v2 checkpoint


def _fnv32a(data: bytes) -> int:
    h = 0x811C9DC5
    for b in data:
        h = ((h ^ b) * 0x01000193) & 0xFFFFFFFF
    return h


def _spew_list(values: Sequence[str] | None) -> str:
    return "<nil>" if values is None else "[" + " ".join(values) + "]"


def checkpoint_checksum(data: dict[str, Any]) -> int:
    """``checksum.New(cp.Data)``: FNV-32a of the checkpoint data as ``spew`` prints it with ``%#v``
    (``k8s.io/apiserver/pkg/util/hash.DeepHashObject``: types of struct fields, sorted map keys,
    bytes as decimal numbers)."""
    entries = data.get("PodDeviceEntries")
    if entries is None:
        dump = "([]checkpoint.PodDevicesEntry)<nil>"
    else:
        items = []
        for e in entries:
            numa = e.get("DeviceIDs")
            if numa is None:
                ids = "(checkpoint.DevicesPerNUMA)<nil>"
            else:
                pairs = sorted((int(k), v) for k, v in numa.items())
                ids = "(checkpoint.DevicesPerNUMA)map[" + " ".join(f"{k}:{_spew_list(v)}" for k, v in pairs) + "]"
            raw = e.get("AllocResp")
            resp = "<nil>" if raw is None else "[" + " ".join(str(b) for b in base64.b64decode(raw)) + "]"
            items.append(
                f"{{PodUID:(string){e['PodUID']} ContainerName:(string){e['ContainerName']} "
                f"ResourceName:(string){e['ResourceName']} DeviceIDs:{ids} AllocResp:([]uint8){resp}}}"
            )
        dump = "([]checkpoint.PodDevicesEntry)[" + " ".join(items) + "]"
    registered = data.get("RegisteredDevices")
    if registered is None:
        reg = "<nil>"
    else:
        reg = "map[" + " ".join(f"{k}:{_spew_list(v)}" for k, v in sorted(registered.items())) + "]"
    text = f"(checkpoint.checkpointData){{PodDeviceEntries:{dump} RegisteredDevices:(map[string][]string){reg}}}"
    return _fnv32a(text.encode())


# --------------------------------------------------------------------------- state


@dataclass
class _Client:
    """client.go ``client``: one registration's connection and its ListAndWatch stream."""

    resource: str
    socket: str  # endpoint file name, as registered
    path: str
    channel: grpc.Channel
    stub: Any
    generation: int  # the kubelet start that made it: a stopped kubelet's clients change nothing
    stream: Any = None
    stream_open: bool = False


@dataclass
class Endpoint:
    """manager.go ``endpointInfo``: the endpoint of a resource and the options it reported. One
    restored from the checkpoint has no client, no options and is stopped."""

    resource: str
    socket: str
    options: Any
    client: _Client | None
    devices: dict[str, Any] = field(default_factory=dict)  # allDevices: ID -> pb.Device (last wins)
    snapshots: list[tuple[float, int, int]] = field(default_factory=list)  # (time, capacity, allocatable)
    stop_time: float | None = None

    @property
    def stub(self) -> Any:
        return self.client.stub if self.client is not None else None

    @property
    def stream_open(self) -> bool:
        return self.client is not None and self.client.stream_open

    @property
    def stopped(self) -> bool:
        return self.stop_time is not None


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
        seed: int | None = None,
        node_status_sync_seconds: float | None = None,
    ) -> None:
        self.dir = device_plugin_dir
        self.node_name = node_name
        self.reregistration = reregistration
        self.stop_grace_seconds = stop_grace_seconds
        # Delay between a stream's end and runClient's teardown: widens the real race in which a
        # plugin re-registers before the kubelet tears down the old client (kubernetes 121994).
        self.stale_teardown_delay = stale_teardown_delay
        # Called in the Register handler with ("received", endpoint) before the client is recorded
        # and ("connected", endpoint) after PluginConnected: a test blocks there to choose the order
        # in which two registrations reach the device manager (as a plugin slow to connect does).
        self.on_register: Callable[[str, str], None] | None = None
        self.topology_policy = topology_policy
        self.node_status_sync_seconds = node_status_sync_seconds
        self._rng = random.Random(seed)  # Go's map order, reproducibly
        self.endpoints: dict[str, Endpoint] = {}
        self.healthy: dict[str, set[str]] = {}
        self.unhealthy: dict[str, set[str]] = {}
        self._clients: dict[str, list[_Client]] = {}
        self.allocations: list[Allocation] = []
        self.registrations: list[tuple[float, str]] = []
        self.rejections: list[str] = []
        self.stream_errors: list[tuple[str, str]] = []  # (resource, gRPC status) of streams that failed
        self.pre_starts: list[tuple[str, list[str]]] = []  # (resource, IDs) of PreStartContainer calls
        self.checkpoint_restored: dict[str, int] = {}  # resource -> allocated devices read back at start
        self._cond = threading.Condition()
        self._server: grpc.Server | None = None
        self._generation = 0  # bumped at every start and stop: the running kubelet's clients only
        self._started_at = 0.0
        self._starts_seen = 0  # registrations before the last start
        self.restarts = 0
        self._record: list[dict[str, Any]] | None = None
        self._record_t0 = 0.0
        self._synced: dict[str, dict[str, str]] = {"capacity": {}, "allocatable": {}}
        self._sync_stop = threading.Event()
        self._sync_thread: threading.Thread | None = None

    # ------------------------------------------------------------------ lifecycle

    @property
    def socket(self) -> str:
        return os.path.join(self.dir, KUBELET_SOCKET)

    @property
    def started_at(self) -> float:
        """When the last start began (time.monotonic): the kubelet.sock a plugin reacts to is newer."""
        return self._started_at

    def start(self) -> KubeletSimulator:
        """manager.go Start: clean the dir, read the checkpoint back, serve kubelet.sock."""
        os.makedirs(self.dir, exist_ok=True)
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="kubelet-sim"))
        pb_grpc.add_RegistrationServicer_to_server(_Registration(self), server)
        with self._cond:  # after a stopped kubelet's last write, as a new process comes after the old
            self._cleanup_dir()
            self._read_checkpoint()
            self._generation += 1
            self._started_at = time.monotonic()
            self._starts_seen = len(self.registrations)
            self._server = server
        server.add_insecure_port(f"unix://{self.socket}")
        server.start()
        with self._cond:
            self._recorded()
        if self.node_status_sync_seconds and self._sync_thread is None:
            self._sync_stop.clear()
            self._sync_thread = threading.Thread(target=self._sync_node_status, name="kubelet-sim-sync", daemon=True)
            self._sync_thread.start()
        return self

    def stop(self) -> None:
        with self._cond:
            server, self._server = self._server, None  # no checkpoint write from here on
        if server is not None:
            server.stop(0).wait(2)
        self._sync_stop.set()
        thread, self._sync_thread = self._sync_thread, None
        if thread is not None:
            thread.join(5)
        with self._cond:
            self._generation += 1  # like a dead process: its clients' late messages go nowhere
            clients = [c for cs in self._clients.values() for c in cs]
            self._clients.clear()
            self.endpoints.clear()
            self.healthy.clear()
            self.unhealthy.clear()
            self._recorded()
            self._cond.notify_all()
        for c in clients:
            _close(c)

    def restart(self) -> None:
        """A kubelet restart: the process goes (its clients' connections close), a new one starts."""
        self.stop()
        self.restarts += 1
        self.start()

    def _cleanup_dir(self) -> None:
        """manager.go CleanupPluginDirectory (1.32): remove every entry but directories and the checkpoint."""
        for entry in os.listdir(self.dir):
            path = os.path.join(self.dir, entry)
            if entry == CHECKPOINT or (os.path.isdir(path) and not os.path.islink(path)):
                continue
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)

    # ------------------------------------------------------------------ checkpoint (checkpoint/checkpoint.go)

    def _checkpoint_data(self) -> dict[str, Any]:
        entries = []
        for a in self.allocations:
            ep = self.endpoints.get(a.resource)
            per_numa: dict[str, list[str]] = {}
            for i in a.ids:
                nodes = [n.ID for n in ep.devices[i].topology.nodes] if ep is not None and i in ep.devices else []
                for n in nodes or [NODE_WITHOUT_TOPOLOGY]:
                    per_numa.setdefault(str(n), []).append(i)
            entries.append(
                {
                    "PodUID": a.pod,
                    "ContainerName": a.container,
                    "ResourceName": a.resource,
                    "DeviceIDs": per_numa,
                    # The kubelet's gogo-generated Marshal writes map entries (envs, annotations)
                    # sorted by key (sortkeys.Strings): deterministic, the same bytes at every write.
                    "AllocResp": base64.b64encode(a.response.SerializeToString(deterministic=True)).decode(),
                }
            )
        registered = {r: self._unsorted(ids) for r, ids in self.healthy.items()}
        return {"PodDeviceEntries": entries or None, "RegisteredDevices": registered}

    def _write_checkpoint(self) -> None:
        """Under the lock; a stopped kubelet writes nothing (its process is gone)."""
        if self._server is None:
            return
        data = self._checkpoint_data()
        doc = {"Data": data, "Checksum": checkpoint_checksum(data)}
        path = os.path.join(self.dir, CHECKPOINT)
        with open(path + ".tmp", "w", encoding="utf-8") as fh:
            json.dump(doc, fh, separators=(",", ":"))
        os.replace(path + ".tmp", path)

    def _read_checkpoint(self) -> None:
        """manager.go readCheckpoint: allocations back, each registered resource a stopped endpoint
        with no devices; a corrupt checkpoint is ignored (logged, as the kubelet does)."""
        self.checkpoint_restored = {}
        try:
            with open(os.path.join(self.dir, CHECKPOINT), encoding="utf-8") as fh:
                doc = json.load(fh)
            data = doc["Data"]
            if checkpoint_checksum(data) != doc["Checksum"]:
                raise ValueError("checksum mismatch")
        except FileNotFoundError:
            return
        except (OSError, ValueError, KeyError, TypeError) as exc:
            LOG.warning("continue after failing to read the checkpoint: %s", exc)
            return
        with self._cond:
            self.allocations = []
            for e in data.get("PodDeviceEntries") or []:
                response = pb.ContainerAllocateResponse.FromString(base64.b64decode(e["AllocResp"] or ""))
                ids = sorted({i for v in (e["DeviceIDs"] or {}).values() for i in v or []})
                self.allocations.append(Allocation(e["PodUID"], e["ContainerName"], e["ResourceName"], ids, response))
                self.checkpoint_restored[e["ResourceName"]] = self.checkpoint_restored.get(e["ResourceName"], 0) + len(
                    ids
                )
            now = time.monotonic()
            for resource in data.get("RegisteredDevices") or {}:
                self.healthy[resource] = set()
                self.unhealthy[resource] = set()
                self.endpoints[resource] = Endpoint(resource, "", None, None, stop_time=now)

    # ------------------------------------------------------------------ handler.go: clients

    def _refuse(self, context: Any, what: str, message: str) -> None:
        """A Go error from Register reaches the plugin as gRPC code Unknown with its text."""
        self.rejections.append(what)
        context.abort(grpc.StatusCode.UNKNOWN, message)

    def _register(self, request: Any, context: Any) -> Any:
        with self._cond:
            self.registrations.append((time.monotonic(), request.resource_name))
            self._cond.notify_all()
        if request.version != API_VERSION:
            self._refuse(
                context,
                f"version {request.version}",
                f'requested API version "{request.version}" is not supported by kubelet. '
                f'Supported versions are ["{API_VERSION}"]',
            )
        if not is_extended_resource_name(request.resource_name):
            self._refuse(
                context, f"resource {request.resource_name}", f'the ResourceName "{request.resource_name}" is invalid'
            )
        if "/" in request.endpoint:  # stricter than the kubelet, which joins it to the dir as given
            self._refuse(
                context, f"endpoint {request.endpoint}", "endpoint must be a file name in the device-plugin dir"
            )
        path = os.path.join(self.dir, request.endpoint)
        if self.on_register is not None:
            self.on_register("received", request.endpoint)
        if self.reregistration == "fixed" and self._get_client(request.resource_name, path) is not None:
            self._refuse(
                context,
                f"duplicate {request.endpoint}",
                f"device plugin already connected: {path}",  # the v1.37 manager.go PluginConnected text
            )
        # The kubelet is its own process: never share a subchannel (and its reconnect backoff
        # after the socket vanished) with other clients in this process. The receive limit is
        # gRPC's default, stated so that it is visible.
        channel = grpc.insecure_channel(
            f"unix://{path}",
            options=[("grpc.use_local_subchannel_pool", 1), ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)],
        )
        client = _Client(
            request.resource_name, request.endpoint, path, channel, pb_grpc.DevicePluginStub(channel), self._generation
        )
        # handler.go connectClient: registerClient first, then Connect; on failure deregister.
        self._register_client(client)
        try:
            grpc.channel_ready_future(channel).result(timeout=DIAL_TIMEOUT_SECONDS)
        except grpc.FutureTimeoutError as exc:
            self._deregister_client(client)
            channel.close()
            self._refuse(context, f"dial {request.endpoint}", f"failed to dial device plugin: {exc!r}")
        try:
            options = client.stub.GetDevicePluginOptions(pb.Empty())  # manager.go PluginConnected: no deadline
        except grpc.RpcError as exc:
            self._deregister_client(client)
            channel.close()
            self._refuse(context, f"options {request.endpoint}", f"failed to get device plugin options: {exc}")
        with self._cond:
            if client.generation != self._generation:  # the kubelet stopped meanwhile
                channel.close()
                context.abort(grpc.StatusCode.UNAVAILABLE, "the kubelet is stopping")
            # PluginConnected replaces the endpoint; the old client is NOT closed.
            self.endpoints[request.resource_name] = Endpoint(request.resource_name, request.endpoint, options, client)
            self._cond.notify_all()
        if self.on_register is not None:
            self.on_register("connected", request.endpoint)
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

    def _get_client(self, resource: str, path: str) -> _Client | None:
        with self._cond:
            clients = self._clients.get(resource, [])
            if self.reregistration == "buggy":
                return clients[0] if clients else None  # by resource name only
            return next((o for o in clients if o.path == path), None)

    def _run_client(self, c: _Client) -> None:
        """handler.go runClient: Run, then disconnect the client found *now* (see module doc)."""
        self._run(c)
        if self.stale_teardown_delay:
            time.sleep(self.stale_teardown_delay)
        found = self._get_client(c.resource, c.path)
        if found is None:
            return
        self._deregister_client(found)
        _close(found)  # client.go Disconnect: close the connection (its stream ends) ...
        self._plugin_disconnected(found)  # ... then PluginDisconnected

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
        except (grpc.RpcError, ValueError) as exc:  # ValueError: the channel was already closed
            code = exc.code() if isinstance(exc, grpc.RpcError) else None
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
            if c.generation != self._generation:
                return
            ep = self.endpoints.get(c.resource)
            healthy = {d.ID for d in resp.devices if d.health == HEALTHY}
            unhealthy = {d.ID for d in resp.devices if d.health != HEALTHY}
            self.healthy[c.resource] = healthy
            self.unhealthy[c.resource] = unhealthy
            if ep is not None:
                ep.devices = {d.ID: d for d in resp.devices}
                if ep.client is c:
                    ep.snapshots.append((time.monotonic(), len(healthy) + len(unhealthy), len(healthy)))
            self._recorded()
            self._write_checkpoint()
            self._cond.notify_all()

    def _plugin_disconnected(self, c: _Client) -> None:
        """PluginDisconnected: mark the resource unhealthy and stop its current endpoint. Buggy
        kubelets do it by resource name; fixed ones only when the endpoint is that client's."""
        with self._cond:
            ep = self.endpoints.get(c.resource)
            if c.generation != self._generation or ep is None:
                return
            if self.reregistration == "fixed" and ep.client is not c:
                return  # an older endpoint of the resource: the current one stays
            moved = self.healthy.get(c.resource, set())
            self.healthy[c.resource] = set()
            self.unhealthy[c.resource] = self.unhealthy.get(c.resource, set()) | moved
            ep.stop_time = time.monotonic()
            ep.snapshots.append((time.monotonic(), len(self.unhealthy[c.resource]), 0))
            self._recorded()
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
                self._recorded()

    def _unsorted(self, ids: Iterable[str]) -> list[str]:
        """A Go set's UnsortedList: map order."""
        out = list(ids)
        self._rng.shuffle(out)
        return out

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
                i: pb.Device(ID=i, health=HEALTHY if i in healthy else UNHEALTHY, topology=d.topology)
                for i, d in ep.devices.items()
            }

    def health(self, resource: str) -> dict[str, str]:
        """Device ID -> health, as the kubelet holds them (the same method as RealKubelet's)."""
        with self._cond:
            self._expire()
            if resource not in self.endpoints:
                return {}
            out = dict.fromkeys(self.unhealthy.get(resource, ()), UNHEALTHY)
            out.update(dict.fromkeys(self.healthy.get(resource, ()), HEALTHY))
            return out

    def numa(self, resource: str) -> dict[str, list[int]]:
        return {i: [n.ID for n in d.topology.nodes] for i, d in self.devices(resource).items()}

    def options(self, resource: str) -> dict[str, bool]:
        """The options the plugin gave at registration (empty when none), as RealKubelet's."""
        with self._cond:
            ep = self.endpoints.get(resource)
            if ep is None or ep.options is None:
                return {}
            return {
                "pre_start_required": ep.options.pre_start_required,
                "get_preferred_allocation_available": ep.options.get_preferred_allocation_available,
            }

    def registration_count(self, resource: str) -> int:
        """Registration requests for the resource since this kubelet last started."""
        with self._cond:
            return sum(1 for _, r in self.registrations[self._starts_seen :] if r == resource)

    def _capacities(self) -> tuple[dict[str, int], dict[str, int]]:
        names = sorted(self.endpoints)
        return (
            {r: len(self.healthy.get(r, ())) + len(self.unhealthy.get(r, ())) for r in names},
            {r: len(self.healthy.get(r, ())) for r in names},
        )

    def node_status(self) -> dict[str, dict[str, str]]:
        """What the kubelet holds for the node status (GetCapacity), at this moment."""
        with self._cond:
            self._expire()
            capacity, allocatable = self._capacities()
        return {
            "capacity": {r: format_quantity(n) for r, n in capacity.items()},
            "allocatable": {r: format_quantity(n) for r, n in allocatable.items()},
        }

    def synced_node_status(self) -> dict[str, dict[str, str]]:
        """What the API server's Node object shows: node_status as of the last sync
        (``node_status_sync_seconds``; without it, the kubelet's view itself)."""
        if not self.node_status_sync_seconds:
            return self.node_status()
        with self._cond:
            return {k: dict(v) for k, v in self._synced.items()}

    def _sync_node_status(self) -> None:
        assert self.node_status_sync_seconds
        while True:
            status = self.node_status()
            with self._cond:
                self._synced = status
            if self._sync_stop.wait(self.node_status_sync_seconds):
                return

    # ------------------------------------------------------------------ recording (as RealKubelet's)

    def _recorded(self) -> None:
        """Called under the lock at every change of capacity or allocatable."""
        if self._record is None:
            return
        capacity, allocatable = self._capacities()
        entry = {"running": self._server is not None, "capacity": capacity, "allocatable": allocatable}
        last = self._record[-1] if self._record else None
        if last is None or {k: last[k] for k in entry} != entry:
            self._record.append({**entry, "ms": (time.monotonic() - self._record_t0) * 1000})

    def record_start(self) -> None:
        with self._cond:
            self._record, self._record_t0 = [], time.monotonic()
            self._recorded()

    def record_stop(self) -> dict[str, Any]:
        """Every change of capacity and allocatable since record_start (the real tool's format)."""
        with self._cond:
            transitions, self._record = self._record or [], None
            return {"transitions": transitions, "ms": (time.monotonic() - self._record_t0) * 1000}

    # ------------------------------------------------------------------ waiting

    def end_stream(self, resource: str) -> None:
        """The kubelet side ends the current ListAndWatch stream (its connection broke)."""
        with self._cond:
            ep = self.endpoints.get(resource)
        if ep is not None and ep.client is not None and ep.client.stream is not None:
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
        """``count`` registrations since the kubelet started, the endpoint's stream open and its devices in."""
        return self.wait_for(
            lambda: (
                self.registration_count(resource) >= count
                and resource in self.endpoints
                and self.endpoints[resource].stream_open
                and bool(self.endpoints[resource].snapshots)
            ),
            timeout,
        )

    def wait_allocatable(self, resource: str, n: int, timeout: float = 10.0) -> bool:
        return self.wait_for(lambda: self.allocatable(resource) == n, timeout)

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
        sidecars: Sequence[str] = (),
    ) -> list[Allocation]:
        """Admit a pod: init containers first, their devices reusable by later containers unless
        they are sidecars (restartable init containers, named in ``sidecars``); then what the
        kubelet does when it starts each container (PreStartContainer if the plugin asks for it).
        A container that already has devices (admitted before: a container restart or a
        re-admission after a kubelet restart) gets no new Allocate call.

        ``container_requests`` overrides ``requests`` per container name.
        """
        reuse: dict[str, set[str]] = {}  # manager.go devicesToReuse[podUID]
        out: list[Allocation] = []
        for name in list(init_containers) + list(containers):
            for resource, count in (container_requests or {}).get(name, requests).items():
                alloc = self._allocate_container(pod, name, resource, count, reuse.get(resource, set()))
                out.append(alloc)
                if name in init_containers and name not in sidecars:
                    reuse.setdefault(resource, set()).update(alloc.ids)  # addContainerAllocatedResources
                else:
                    reuse[resource] = reuse.get(resource, set()) - set(alloc.ids)  # remove...
        for alloc in out:  # GetDeviceRunContainerOptions -> callPreStartContainerIfNeeded
            self._pre_start(alloc)
        return out

    def _existing(self, pod: str, container: str, resource: str) -> Allocation | None:
        with self._cond:
            return next(
                (a for a in self.allocations if (a.pod, a.container, a.resource) == (pod, container, resource)), None
            )

    def _allocate_container(
        self, pod: str, container: str, resource: str, count: int, reusable: set[str]
    ) -> Allocation:
        existing = self._existing(pod, container, resource)
        ids, ep = self._devices_to_allocate(resource, count, reusable, existing)
        if existing is not None:
            return existing  # needed == 0: nothing to do
        if ep.stopped or ep.stub is None:
            raise AllocationFailed(f"endpoint {resource} has been stopped")  # endpoint.go allocate
        generation = self._generation
        areq = pb.AllocateRequest()
        areq.container_requests.add(devices_ids=self._unsorted(ids))
        try:
            aresp = ep.stub.Allocate(areq)  # endpoint.go allocate: no deadline
        except grpc.RpcError as exc:
            raise AllocationFailed(f"Allocate failed: {exc.code().name}: {exc.details()}") from None
        if not aresp.container_responses:
            raise AllocationFailed(f"no containers return in allocation response {aresp}")
        alloc = Allocation(pod, container, resource, sorted(ids), aresp.container_responses[0])
        with self._cond:
            if generation != self._generation:
                raise AllocationFailed("the kubelet stopped during the allocation")
            self.allocations.append(alloc)
            self._write_checkpoint()
        return alloc

    def _pre_start(self, alloc: Allocation) -> None:
        """manager.go callPreStartContainerIfNeeded: only when the plugin asked for it; 30 s."""
        with self._cond:
            ep = self.endpoints.get(alloc.resource)
        if ep is None:
            raise AllocationFailed(f"endpoint not found in cache for a registered resource: {alloc.resource}")
        if ep.options is None or not ep.options.pre_start_required:
            return
        if ep.stopped or ep.stub is None:
            raise AllocationFailed(f"endpoint {alloc.resource} has been stopped")
        ids = self._unsorted(alloc.ids)
        try:
            ep.stub.PreStartContainer(
                pb.PreStartContainerRequest(devices_ids=ids), timeout=PRE_START_CONTAINER_TIMEOUT_SECONDS
            )
        except grpc.RpcError as exc:
            raise AllocationFailed(f"device plugin PreStartContainer rpc failed with err: {exc.code().name}") from None
        self.pre_starts.append((alloc.resource, ids))

    def _devices_to_allocate(
        self, resource: str, count: int, reusable: set[str], existing: Allocation | None
    ) -> tuple[list[str], Endpoint]:
        """manager.go devicesToAllocate (with filterByAffinity and the preferred-allocation call)."""
        with self._cond:
            self._expire()
            if existing is not None and len(existing.ids) != count:
                raise AllocationFailed(
                    f'pod "{existing.pod}" container "{existing.container}" changed request for resource '
                    f'"{resource}" from {len(existing.ids)} to {count}'
                )
            ep = self.endpoints.get(resource)
            healthy = self.healthy.get(resource)
            if ep is None or healthy is None:
                raise AllocationFailed(f"cannot allocate unregistered device {resource}")
            if not healthy:
                raise AllocationFailed(f"no healthy devices present; cannot allocate unhealthy devices {resource}")
            if existing is not None:
                if not healthy.issuperset(existing.ids):
                    raise AllocationFailed(
                        f"previously allocated devices are no longer healthy; cannot allocate unhealthy devices "
                        f"{resource}"
                    )
                return list(existing.ids), ep
            in_use = {i for a in self.allocations if a.resource == resource for i in a.ids}
            allocated: list[str] = []
            for d in self._unsorted(reusable):
                if len(allocated) < count:
                    allocated.append(d)
            if len(allocated) == count:
                return allocated, ep
            needed = count - len(allocated)
            available = healthy - in_use - set(allocated)
            numa_of = {i: tuple(n.ID for n in d.topology.nodes) for i, d in ep.devices.items()}
            options = ep.options
            stopped = ep.stopped
            stub = ep.stub
        affinity = None
        if self.topology_policy == "single-numa-node":  # admission (hints) comes before allocation
            try:
                affinity = topology.single_numa_node(topology.device_hints(numa_of, available, allocated, count))
            except ValueError as exc:
                raise AllocationFailed(str(exc)) from None
        if len(available) < needed:
            raise AllocationFailed(
                f"requested number of devices unavailable for {resource}. "
                f"Requested: {needed}, Available: {len(available)}"
            )
        if affinity is None:
            aligned, unaligned, no_affinity = set(), set(), set(available)
        else:
            aligned = {d for d in available if set(numa_of.get(d, ())) & affinity}
            no_affinity = {d for d in available if not numa_of.get(d)}
            unaligned = available - aligned - no_affinity

        def take(pool: set[str]) -> bool:
            for d in self._unsorted(pool - set(allocated)):  # for device := range devices.Difference(...)
                if len(allocated) == count:
                    break
                allocated.append(d)
            return len(allocated) == count

        def preferred(candidates: set[str]) -> set[str]:
            if options is None or not options.get_preferred_allocation_available:
                return set()
            if stopped or stub is None:  # endpoint.go getPreferredAllocation
                raise AllocationFailed(f"endpoint {resource} has been stopped")
            req = pb.PreferredAllocationRequest()
            req.container_requests.add(
                available_deviceIDs=self._unsorted(candidates | set(allocated)),
                must_include_deviceIDs=self._unsorted(allocated),
                allocation_size=count,
            )
            resp = stub.GetPreferredAllocation(req)  # endpoint.go getPreferredAllocation: no deadline
            return set(resp.container_responses[0].deviceIDs) if resp.container_responses else set()

        if needed < len(aligned):  # strictly less, as the kubelet has it
            if take(preferred(aligned) & aligned) or take(aligned):
                return allocated, ep
            raise AllocationFailed("unexpectedly allocated less resources than required")
        if take(aligned):
            return allocated, ep
        if take(preferred(available) & available):
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
