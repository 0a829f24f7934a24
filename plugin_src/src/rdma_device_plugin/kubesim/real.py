"""The kubelet's own device manager as a test and benchmark backend.

``kubelet-managers`` (kube/cmd/kubelet-managers, built by ``make kube`` from the Kubernetes v1.37
this repository pins) runs the kubelet's device manager (registration server, endpoint clients,
checkpoint, Topology Manager admission) behind a JSON-lines protocol on stdin/stdout
(kube/README.md); ``kubelet-dm-serve`` of v1.32 speaks the same protocol for the older kubelets'
behaviour. :class:`RealKubelet` drives either with the same public methods the tests use on
:class:`~.kubelet.KubeletSimulator` (``wait_registered``, ``capacity``, ``allocatable``, ``health``,
``allocate``, ``restart`` ...), so one test runs against both; where they disagree the simulator is
wrong. Never imported by ``serve``.

What the real one cannot do: end a stream on demand (the kubelet only cuts a client when another
stream of the resource ends: register a second client and end its stream, as a handover does), or
show the plugin's snapshots one by one (``record_start``/``record_stop`` give every change of
capacity and allocatable instead, polled every 2 ms).
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..kubeletapi import HEALTHY, KUBELET_SOCKET, UNHEALTHY
from .kubelet import format_quantity

# The kubelet's own managers, built by scripts/kube-build.sh (`make kube`) from the modules this
# repository pins: "1.37" is kube/cmd/kubelet-managers (kube/go.mod), "1.32" the device manager of
# v1.32 (kube/v1.32/go.mod), kept for the 1.28-1.34 re-registration behaviour (kubernetes 121994).
# The environment variables name a binary instead.
BINARIES = {
    "1.37": ("RDMA_REAL_KUBELET", "--print-bin", "kubelet-managers"),
    "1.32": ("RDMA_REAL_KUBELET_1_32", "--print-legacy-bin", "kubelet-dm-serve"),
}
ENV_BINARY, _, BINARY_NAME = BINARIES["1.37"]
# this file is <repo>/plugin_src/src/rdma_device_plugin/kubesim/real.py
_BUILD_SCRIPT = Path(__file__).resolve().parents[4] / "scripts" / "kube-build.sh"


def find_binary(version: str = "1.37") -> tuple[str | None, str]:
    """(path of the kubelet's managers of ``version``, "") or (None, why not, naming the fix)."""
    env_name, flag, name = BINARIES[version]
    env = os.environ.get(env_name)
    if env:
        if os.access(env, os.X_OK):
            return env, ""
        return None, f"${env_name}={env} is not an executable file"
    if not _BUILD_SCRIPT.exists():
        return None, f"{name}: no {_BUILD_SCRIPT} (not a checkout of the repository): set ${env_name}"
    out = subprocess.run(["bash", str(_BUILD_SCRIPT), flag], capture_output=True, text=True, check=False)
    path = Path(out.stdout.strip()) / name
    if out.returncode == 0 and os.access(path, os.X_OK):
        return str(path), ""
    why = out.stderr.strip() or f"{path} is not built"
    return None, f"the kubelet's managers ({name}, Kubernetes {version}): {why}; build them with `make kube`"


class RealKubeletError(RuntimeError):
    """The tool answered ``ok: false`` to a request that must succeed."""


@dataclass
class Allocation:
    """What a container asking for devices got: the same attributes as the simulator's."""

    pod: str
    container: str
    resource: str
    ids: list[str]
    device_paths: list[str]
    envs: dict[str, str]
    cdi_devices: list[str] = field(default_factory=list)


class RealKubelet:
    """One ``kubelet-dm-serve`` process; a kubelet running on ``device_plugin_dir`` after :meth:`start`."""

    def __init__(
        self,
        device_plugin_dir: str,
        *,
        numa_nodes: int = 2,
        policy: str = "none",
        klog: str | None = None,
        binary: str | None = None,
        version: str = "1.37",
    ) -> None:
        found, why = (binary, "") if binary else find_binary(version)
        if found is None:
            raise FileNotFoundError(why)
        self.dir = device_plugin_dir
        self.numa_nodes = numa_nodes
        self.policy = policy
        self.klog = klog or device_plugin_dir.rstrip("/") + ".klog"
        self.socket = os.path.join(device_plugin_dir, KUBELET_SOCKET)
        self.restarts = 0
        self._lock = threading.Lock()  # one request at a time: the protocol is one line in, one out
        self._proc = subprocess.Popen(
            [found, "-klog", self.klog],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self._started = False

    # ------------------------------------------------------------------ protocol

    def call(self, op: str, **fields: Any) -> dict[str, Any]:
        """One request, its response (``ok`` may be false: the caller decides)."""
        assert self._proc.stdin is not None and self._proc.stdout is not None
        with self._lock:
            self._proc.stdin.write(json.dumps({"op": op, **fields}) + "\n")
            self._proc.stdin.flush()
            line = self._proc.stdout.readline()
        if not line:
            raise RealKubeletError(f"{BINARY_NAME} exited (rc {self._proc.poll()}); see {self.klog}")
        reply: dict[str, Any] = json.loads(line)
        return reply

    def must(self, op: str, **fields: Any) -> dict[str, Any]:
        reply = self.call(op, **fields)
        if not reply.get("ok"):
            raise RealKubeletError(f"{op}: {reply.get('error')}")
        return reply

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> RealKubelet:
        os.makedirs(self.dir, exist_ok=True)
        self.must("start", dir=self.dir, numa_nodes=self.numa_nodes, policy=self.policy)
        self._started = True
        return self

    def stop(self) -> None:
        """A clean stop (``ManagerImpl.Stop``: kubelet.sock removed)."""
        if self._started:
            self.must("stop")
            self._started = False

    def crash(self) -> None:
        """Stopped as a killed kubelet: kubelet.sock stays."""
        self.must("crash")
        self._started = False

    def restart(self) -> None:
        """A kubelet restart: the process dies (kubelet.sock left), a new one starts on the same dir."""
        self.crash()
        self.must("start")
        self._started = True
        self.restarts += 1

    def close(self) -> None:
        if self._proc.poll() is None:
            try:
                self.call("quit")
                self._proc.wait(timeout=10)
            except (OSError, ValueError, RealKubeletError, subprocess.TimeoutExpired):
                self._proc.kill()
                self._proc.wait()
        for stream in (self._proc.stdin, self._proc.stdout):
            if stream is not None:
                stream.close()

    # ------------------------------------------------------------------ what the kubelet holds

    def _resource(self, resource: str) -> dict[str, Any]:
        found: dict[str, Any] = self.must("devices")["resources"].get(resource, {})
        return found

    def capacity(self, resource: str) -> int:
        return int(self.must("capacity")["capacity"].get(resource, 0))

    def allocatable(self, resource: str) -> int:
        return int(self.must("capacity")["allocatable"].get(resource, 0))

    def node_status(self) -> dict[str, dict[str, str]]:
        """What the kubelet holds for the node status (GetCapacity), as the simulator shows it."""
        reply = self.must("capacity")
        return {k: {r: format_quantity(int(n)) for r, n in reply[k].items()} for k in ("capacity", "allocatable")}

    def health(self, resource: str) -> dict[str, str]:
        """Device ID -> "Healthy"/"Unhealthy", as the kubelet holds them."""
        res = self._resource(resource)
        out = {d["id"]: UNHEALTHY for d in res.get("unhealthy", [])}
        out.update({d["id"]: HEALTHY for d in res.get("healthy", [])})
        return out

    def numa(self, resource: str) -> dict[str, list[int]]:
        res = self._resource(resource)
        return {d["id"]: list(d["numa"] or []) for d in res.get("healthy", []) + res.get("unhealthy", [])}

    def endpoint(self, resource: str) -> dict[str, Any]:
        """``endpoint``, ``endpoint_stopped`` and ``options`` of the resource (empty when unknown)."""
        res = self._resource(resource)
        return {k: res[k] for k in ("endpoint", "endpoint_stopped", "options") if k in res}

    def options(self, resource: str) -> dict[str, bool]:
        """The options the plugin gave at registration (empty when none)."""
        found: dict[str, bool] = self.endpoint(resource).get("options") or {}
        return found

    def registration_count(self, resource: str) -> int:
        """Registration requests for the resource since the kubelet last started."""
        return int(self.must("status")["registrations"].get(resource, 0))

    # ------------------------------------------------------------------ waiting

    def wait_for(self, predicate: Callable[[], bool], timeout: float = 10.0, interval: float = 0.01) -> bool:
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() >= deadline:
                return False
            time.sleep(interval)
        return True

    def wait_registered(self, resource: str, count: int = 1, timeout: float = 10.0) -> bool:
        """``count`` registrations since the kubelet started, the endpoint live and its devices in."""
        deadline = time.monotonic() + timeout
        reply = self.call("wait", **{"for": {"registrations": {resource: count}}, "timeout_ms": timeout * 1000})
        if not reply.get("ok"):
            return False

        def live() -> bool:
            res = self._resource(resource)
            return bool(res.get("endpoint")) and not res.get("endpoint_stopped") and bool(res.get("healthy"))

        return self.wait_for(live, max(0.0, deadline - time.monotonic()))

    def wait_allocatable(self, resource: str, n: int, timeout: float = 10.0) -> bool:
        reply = self.call("wait", **{"for": {"allocatable": {resource: n}}, "timeout_ms": timeout * 1000})
        return bool(reply.get("ok"))

    def record_start(self) -> None:
        self.must("record_start")

    def record_stop(self) -> dict[str, Any]:
        return self.must("record_stop")

    # ------------------------------------------------------------------ pods

    def admit(
        self,
        pod: str,
        containers: Mapping[str, Mapping[str, int]],
        init_containers: Sequence[tuple[str, Mapping[str, int], bool]] = (),
    ) -> dict[str, Any]:
        """Admit a pod (the Topology Manager, Allocate, GetDeviceRunContainerOptions); the raw reply.

        ``init_containers``: (name, requests, sidecar) in order; a sidecar has restartPolicy Always."""
        spec: dict[str, Any] = {
            "uid": pod,
            "name": pod,
            "containers": [{"name": n, "requests": dict(r)} for n, r in containers.items()],
            "init_containers": [
                {"name": n, "requests": dict(r), **({"restart_policy": "Always"} if sidecar else {})}
                for n, r, sidecar in init_containers
            ],
        }
        return self.call("admit", pod=spec)

    def allocate(self, resource: str, count: int = 1, pod: str = "pod", container: str = "main") -> Allocation:
        """Admit a pod of one container asking for ``count`` of ``resource``."""
        reply = self.admit(pod, {container: {resource: count}})
        if not reply.get("ok"):
            raise RealKubeletError(f"admit {pod}: {reply.get('reason', '')} {reply.get('error')}")
        return to_allocation(pod, container, resource, reply["containers"][container])

    def release(self, pod: str) -> None:
        self.must("remove", uid=pod)


def to_allocation(pod: str, container: str, resource: str, run: Mapping[str, Any]) -> Allocation:
    """A container's ``RUNOPTS`` as an :class:`Allocation`."""
    return Allocation(
        pod=pod,
        container=container,
        resource=resource,
        ids=list(run["device_ids"].get(resource, [])),
        device_paths=[d["host"] for d in run["devices"]],
        envs=dict(run["envs"]),
        cdi_devices=list(run["cdi_devices"]),
    )


def longest_zero_window(transitions: Sequence[Mapping[str, Any]], resource: str, until_ms: float) -> float:
    """Milliseconds of the longest stretch in a ``record_stop`` with ``resource`` allocatable 0 (or
    absent, or no kubelet running), up to ``until_ms``."""
    longest = 0.0
    zero_since: float | None = None
    for t in transitions:
        zero = not t.get("running") or not t.get("allocatable", {}).get(resource)
        if zero and zero_since is None:
            zero_since = float(t["ms"])
        elif not zero and zero_since is not None:
            longest = max(longest, float(t["ms"]) - zero_since)
            zero_since = None
    if zero_since is not None:
        longest = max(longest, until_ms - zero_since)
    return longest
