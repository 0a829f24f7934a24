"""Shared fixtures: fixture nodes, the kubelet (the simulator, or the kubelet's own device manager),
and a real ``serve`` process."""

from __future__ import annotations

import os
import queue
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml

from rdma_device_plugin import sockets
from rdma_device_plugin.api import deviceplugin_pb2 as pb
from rdma_device_plugin.api import deviceplugin_pb2_grpc as pb_grpc
from rdma_kubesim import KubeletSimulator
from rdma_kubesim.plugin import serve_command as plugin_serve_command
from rdma_kubesim.real import RealKubelet, find_binary
from rdma_node import fixtures

BACKENDS = ("sim", "real")  # the kubelet simulator, the kubelet's own device manager (v1.37, make kube)


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A short temp dir: unix socket paths must stay under 108 bytes (pytest's tmp_path can exceed it)."""
    path = tempfile.mkdtemp(prefix="rdp-", dir="/tmp")
    yield Path(path)
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def node(short_tmp: Path) -> fixtures.FixtureNode:
    return fixtures.write_node(str(short_tmp / "node"), fixtures.lingjun_node(nics=4, bond=True))


@pytest.fixture
def dp_dir(short_tmp: Path) -> Path:
    d = short_tmp / "dp"
    d.mkdir()
    return d


@pytest.fixture
def sim(dp_dir: Path) -> Iterator[KubeletSimulator]:
    s = KubeletSimulator(str(dp_dir)).start()
    yield s
    s.stop()


def real_kubelet_binary(version: str = "1.37") -> str:
    """The kubelet's own managers of ``version``; a missing build fails the test (`make kube` builds it)."""
    binary, why = find_binary(version)
    if binary is None:
        pytest.fail(why)
    return binary


def start_kubelet(backend: str, dp_dir: Path, log: Path, **options: object) -> KubeletSimulator | RealKubelet:
    """A kubelet on ``dp_dir``: "sim" (the simulator, ``options`` its keywords), "real" (v1.37) or
    "real-1.32" (the device manager of kubelets 1.28-1.34)."""
    if backend == "sim":
        return KubeletSimulator(str(dp_dir), **options).start()  # type: ignore[arg-type]
    version = "1.32" if backend == "real-1.32" else "1.37"
    return RealKubelet(  # type: ignore[arg-type]
        str(dp_dir), binary=real_kubelet_binary(version), klog=str(log), **options
    ).start()


# Re-registration behaviour (kubernetes 121994/127803): kubelets 1.28-1.34 cut the newly registered
# client when an older stream of the resource ends; kubelets with PR 135437 (v1.37 here) track
# endpoints by socket path. Each behaviour runs on the simulator and on the real device manager.
REREGISTRATION_KINDS = ("sim-1.28-1.34", "sim-fixed", "real-1.32", "real")
FIXED_KINDS = ("sim-fixed", "real")


def start_kind(kind: str, dp_dir: Path, short_tmp: Path) -> KubeletSimulator | RealKubelet:
    """A kubelet of one of REREGISTRATION_KINDS on ``dp_dir``."""
    if kind.startswith("real"):
        return start_kubelet(kind, dp_dir, short_tmp / "k.log")
    return start_kubelet("sim", dp_dir, short_tmp, reregistration="fixed" if kind in FIXED_KINDS else "buggy")


def stop_kubelet(kubelet: KubeletSimulator | RealKubelet) -> None:
    if isinstance(kubelet, RealKubelet):
        kubelet.close()
    else:
        kubelet.stop()


@pytest.fixture(params=BACKENDS)
def kubelet(request: pytest.FixtureRequest, dp_dir: Path, short_tmp: Path) -> Iterator[KubeletSimulator | RealKubelet]:
    """Both kubelets: the test runs against the simulator and against the kubelet's own device
    manager (v1.37). Where they disagree, the simulator is wrong."""
    k = start_kubelet(request.param, dp_dir, short_tmp / "kubelet.log")
    yield k
    stop_kubelet(k)


def plugin_socket(dp_dir: Path, resource: str = "rdma/hca") -> Path:
    """The socket the newest plugin instance serves for ``resource`` (names: rdma_device_plugin.sockets)."""
    found = [s for s in sockets.instances(str(dp_dir), resource) if not s.retiring]
    assert found, f"no socket of {resource} in {dp_dir}: {sorted(os.listdir(dp_dir))}"
    return dp_dir / found[-1].name


class PluginProcess:
    """The real ``rdma-device-plugin serve`` running as a child process."""

    def __init__(self, proc: subprocess.Popen[str], log: Path) -> None:
        self.proc = proc
        self.log = log

    def output(self) -> str:
        return self.log.read_text(encoding="utf-8")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10.0) -> tuple[int, float]:
        start = time.monotonic()
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            # Where it hangs: faulthandler's stacks of every thread (SIGUSR1, serve registers it).
            self.proc.send_signal(signal.SIGUSR1)
            time.sleep(1.0)
            self.proc.kill()
            self.proc.wait(timeout=10)
            tail = self.output()[-12000:]
            raise AssertionError(f"still running {timeout:.0f} s after signal {sig}:\n{tail}") from None
        return rc, time.monotonic() - start


def serve_command(fx: fixtures.FixtureNode, dp_dir: Path, config: Path | None = None, *extra: str) -> list[str]:
    """The real ``rdma-device-plugin serve`` command line for a fixture node."""
    options = ["--health-file", str(dp_dir.parent / "health.json")]
    if config is not None:
        options += ["--config", str(config)]
    return plugin_serve_command(fx, str(dp_dir), *options, *extra)


@pytest.fixture
def start_plugin(short_tmp: Path, node: fixtures.FixtureNode, dp_dir: Path) -> Iterator[Callable[..., PluginProcess]]:
    procs: list[PluginProcess] = []

    def start(
        config: dict[str, object] | None = None,
        extra: list[str] | None = None,
        fixture: fixtures.FixtureNode | None = None,
        prefix: list[str] | None = None,
    ) -> PluginProcess:
        cfg = None
        if config is not None:
            cfg = short_tmp / f"config{len(procs)}.yaml"
            cfg.write_text(yaml.safe_dump(config), encoding="utf-8")
        extra = list(extra or [])
        if procs and "--health-file" not in extra:  # a second instance keeps a liveness file of its own
            extra += ["--health-file", str(short_tmp / f"health{len(procs)}.json")]
        cmd = (prefix or []) + serve_command(fixture or node, dp_dir, cfg, "--log-level", "debug", *extra)
        log = short_tmp / f"plugin{len(procs)}.log"
        fh = open(log, "w", encoding="utf-8")  # noqa: SIM115 - closed with the process
        proc = subprocess.Popen(
            cmd, stdout=fh, stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"}
        )
        p = PluginProcess(proc, log)
        procs.append(p)
        return p

    yield start
    for p in procs:
        if p.proc.poll() is None:
            p.proc.kill()
            p.proc.wait()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ScriptedPlugin(pb_grpc.DevicePluginServicer):  # type: ignore[misc]
    """A device plugin whose ListAndWatch streams send what the test puts in their queues (None
    ends a stream): real gRPC on a real unix socket, to drive a kubelet through cases the real
    plugin avoids. ``snapshots`` is the queue of the newest stream (of the next one, before any)."""

    def __init__(self, dp_dir: Path, name: str, resource: str, preferred: bool = True, pre_start: bool = False) -> None:
        self.dir, self.name, self.resource = dp_dir, name, resource
        self.preferred, self.pre_start = preferred, pre_start
        self.queues: list[queue.Queue[list[Any] | None]] = []  # one per stream, in opening order
        self._next: queue.Queue[list[Any] | None] = queue.Queue()
        self.preferred_requests: list[Any] = []
        self.allocate_requests: list[Any] = []
        self.pre_start_requests: list[Any] = []
        self.deadlines: dict[str, list[float | None]] = {"Allocate": [], "PreStartContainer": []}  # seconds left
        self.streams_ended = 0
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
        pb_grpc.add_DevicePluginServicer_to_server(self, self.server)
        self.server.add_insecure_port(f"unix://{dp_dir / name}")
        self.server.start()

    @property
    def snapshots(self) -> queue.Queue[list[Any] | None]:
        return self.queues[-1] if self.queues else self._next

    def register(self, version: str = "v1beta1", resource: str | None = None) -> None:
        with grpc.insecure_channel(f"unix://{self.dir / 'kubelet.sock'}") as ch:
            pb_grpc.RegistrationStub(ch).Register(
                pb.RegisterRequest(version=version, endpoint=self.name, resource_name=resource or self.resource),
                timeout=15,
            )

    def wait_streams(self, n: int, timeout: float = 15.0) -> bool:
        deadline = time.monotonic() + timeout
        while len(self.queues) < n:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True

    def GetDevicePluginOptions(self, request: Any, context: Any) -> Any:
        return pb.DevicePluginOptions(
            get_preferred_allocation_available=self.preferred, pre_start_required=self.pre_start
        )

    def ListAndWatch(self, request: Any, context: Any) -> Iterator[Any]:
        mine, self._next = self._next, queue.Queue()
        self.queues.append(mine)
        try:
            while context.is_active():
                try:
                    devices = mine.get(timeout=0.1)
                except queue.Empty:
                    continue
                if devices is None:
                    return
                yield pb.ListAndWatchResponse(devices=devices)
        finally:
            self.streams_ended += 1

    def GetPreferredAllocation(self, request: Any, context: Any) -> Any:
        self.preferred_requests.append(request)
        resp = pb.PreferredAllocationResponse()
        for creq in request.container_requests:
            ids = list(creq.must_include_deviceIDs)
            ids += sorted(d for d in creq.available_deviceIDs if d not in ids)[: creq.allocation_size - len(ids)]
            resp.container_responses.add(deviceIDs=ids)
        return resp

    def Allocate(self, request: Any, context: Any) -> Any:
        self.allocate_requests.append(request)
        self.deadlines["Allocate"].append(context.time_remaining())
        resp = pb.AllocateResponse()
        for creq in request.container_requests:
            resp.container_responses.add(envs={"IDS": ",".join(creq.devices_ids)})
        return resp

    def PreStartContainer(self, request: Any, context: Any) -> Any:
        self.pre_start_requests.append(request)
        self.deadlines["PreStartContainer"].append(context.time_remaining())
        return pb.PreStartContainerResponse()

    def stop(self) -> None:
        self.server.stop(0).wait(5)


def device(i: str, health: str = "Healthy", numa: int | None = None) -> Any:
    d = pb.Device(ID=i, health=health)
    if numa is not None:
        d.topology.nodes.add(ID=numa)
    return d
