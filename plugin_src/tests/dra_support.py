"""What the DRA tests share: a cluster of upstream v1.37.2 components (scripts/kube_cluster.py), nodes
that join it with the kubelet's own managers (kubelet-managers), the driver as a real process on a
fixture node, the chart's DeviceClasses, and small API helpers (the driver's own HTTPS client).

Nothing here decides an outcome: pods are scheduled by the real scheduler (its DRA allocator),
admitted and prepared by the kubelet's DRA manager, and the tests read the API and the node's files.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

import pytest
import yaml

from rdma_device_plugin.dra import kubeapi
from rdma_device_plugin.dra.kubeletplugin import Paths
from rdma_node import fixtures

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "rdma-device-plugin"
sys.path.insert(0, str(ROOT / "scripts"))
import kube_cluster  # noqa: E402

DRIVER = "rdma.lingjun.io"
SLICES = "/apis/resource.k8s.io/v1/resourceslices"
DEVICE_CLASS_API = "resource.k8s.io/v1/DeviceClass"
T = TypeVar("T")


def kube_bin() -> Path:
    """The v1.37.2 binaries (KUBE_BIN, else scripts/kube-build.sh --print-bin), or skip saying how to build."""
    try:
        b = kube_cluster.kube_bin()
    except kube_cluster.ClusterError as exc:
        pytest.skip(str(exc))
    missing = [c for c in (*kube_cluster.COMPONENTS, "kubelet-managers") if not (b / c).exists()]
    if missing:
        pytest.skip(f"{', '.join(missing)} not built in {b}: run make kube (or set KUBE_BIN)")
    return b


def wait_for(what: str, check: Callable[[], T | None], timeout: float = 120.0, every: float = 0.2) -> T:
    """``check()`` until it returns something truthy; fails with ``what`` and the last value."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what} (last: {last!r})")


def chart_objects(values: dict[str, Any]) -> list[dict[str, Any]]:
    """The chart rendered by Helm's own engine (helm_python) as `helm install` into this v1.37 cluster
    does (its discovery: resource.k8s.io/v1 with DeviceClass)."""
    import helm_python
    from helm_python import _native

    chart = helm_python.Chart.load(str(CHART))
    opts = {"name": "rdma", "namespace": "kube-system", "kube_version": "v1.37.2", "api_versions": [DEVICE_CLASS_API]}
    rendered = json.loads(_native.call_string("helm_render", chart._raw(), json.dumps(values), json.dumps(opts)))
    return [doc for path, text in rendered.items() if path.endswith(".yaml") for doc in yaml.safe_load_all(text) if doc]


class Api:
    """The driver's HTTPS client on the cluster's admin kubeconfig, and a few object helpers."""

    def __init__(self, kubeconfig: Path) -> None:
        self.client = kubeapi.connect(str(kubeconfig))

    def get(self, path: str, **query: str) -> dict[str, Any]:
        return self.client.get(path, query or None)

    def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        return self.client.create(path_of(obj, collection=True), obj)

    def apply(self, obj: dict[str, Any]) -> dict[str, Any]:
        try:
            return self.create(obj)
        except kubeapi.ApiError as exc:
            if exc.code != 409:
                raise
            cur = self.client.get(path_of(obj))
            obj = {**obj, "metadata": {**obj["metadata"], "resourceVersion": cur["metadata"]["resourceVersion"]}}
            return self.client.update(path_of(obj), obj)

    def delete(self, obj: dict[str, Any]) -> None:
        with kubeapi.suppress_not_found():
            self.client.delete(path_of(obj))

    def slices(self, node: str, driver: str = DRIVER) -> list[dict[str, Any]]:
        return self.get(SLICES, fieldSelector=f"spec.nodeName={node},spec.driver={driver}")["items"]

    def pod(self, name: str, namespace: str = "default") -> dict[str, Any] | None:
        try:
            return self.get(f"/api/v1/namespaces/{namespace}/pods/{name}")
        except kubeapi.ApiError as exc:
            if exc.code == 404:
                return None
            raise

    def claim(self, name: str, namespace: str = "default") -> dict[str, Any]:
        return self.get(f"/apis/resource.k8s.io/v1/namespaces/{namespace}/resourceclaims/{name}")


_PLURAL = {
    "Pod": ("/api/v1", "pods", True),
    "ResourceClaim": ("/apis/resource.k8s.io/v1", "resourceclaims", True),
    "DeviceClass": ("/apis/resource.k8s.io/v1", "deviceclasses", False),
    "ResourceSlice": ("/apis/resource.k8s.io/v1", "resourceslices", False),
    "Node": ("/api/v1", "nodes", False),
    "ServiceAccount": ("/api/v1", "serviceaccounts", True),
    "ClusterRole": ("/apis/rbac.authorization.k8s.io/v1", "clusterroles", False),
    "ClusterRoleBinding": ("/apis/rbac.authorization.k8s.io/v1", "clusterrolebindings", False),
    "ValidatingAdmissionPolicy": ("/apis/admissionregistration.k8s.io/v1", "validatingadmissionpolicies", False),
    "ValidatingAdmissionPolicyBinding": (
        "/apis/admissionregistration.k8s.io/v1",
        "validatingadmissionpolicybindings",
        False,
    ),
}


def path_of(obj: dict[str, Any], collection: bool = False) -> str:
    base, plural, namespaced = _PLURAL[obj["kind"]]
    ns = f"/namespaces/{obj['metadata'].get('namespace', 'default')}" if namespaced else ""
    return f"{base}{ns}/{plural}" + ("" if collection else f"/{obj['metadata']['name']}")


# --------------------------------------------------------------------------- objects


def claim(name: str, requests: list[dict[str, Any]], constraints: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    devices: dict[str, Any] = {"requests": requests}
    if constraints:
        devices["constraints"] = constraints
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {"devices": devices},
    }


def request(name: str, device_class: str, *selectors: str, capacity: dict[str, str] | None = None) -> dict[str, Any]:
    exactly: dict[str, Any] = {"deviceClassName": device_class}
    if selectors:
        exactly["selectors"] = [{"cel": {"expression": s}} for s in selectors]
    if capacity:
        exactly["capacity"] = {"requests": capacity}
    return {"name": name, "exactly": exactly}


def nic_is(rdma_device: str) -> str:
    return f'device.attributes["{DRIVER}"].rdmaDevice == "{rdma_device}"'


def pod(
    name: str, node: str, claims: Iterable[str] = (), limits: dict[str, str] | None = None, grace: int | None = None
) -> dict[str, Any]:
    """A pod for ``node`` (nodeSelector on its hostname, so the scheduler still decides whether it fits)."""
    names = list(claims)
    container: dict[str, Any] = {"name": "c", "image": "registry.example.com/workload:1", "resources": {}}
    if limits:
        container["resources"]["limits"] = limits
    if names:
        container["resources"]["claims"] = [{"name": f"c{i}"} for i in range(len(names))]
    spec: dict[str, Any] = {
        "containers": [container],
        "nodeSelector": {"kubernetes.io/hostname": node},
    }
    if grace is not None:  # 0: deleting the pod removes it from the API at once (the kubelet cleans up after)
        spec["terminationGracePeriodSeconds"] = grace
    if names:
        spec["resourceClaims"] = [{"name": f"c{i}", "resourceClaimName": n} for i, n in enumerate(names)]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": "default"}, "spec": spec}


def running(api: Api, name: str) -> dict[str, Any] | None:
    p = api.pod(name)
    return p if p and p["status"].get("phase") == "Running" else None


def unschedulable(api: Api, name: str) -> str | None:
    """The scheduler's message when it found no node for the pod (None while it has not said so)."""
    p = api.pod(name)
    for c in (p or {}).get("status", {}).get("conditions", []):
        if c["type"] == "PodScheduled" and c["status"] == "False" and c.get("reason") == "Unschedulable":
            return str(c.get("message", ""))
    return None


def allocated_devices(api: Api, name: str) -> list[str]:
    alloc = api.claim(name)["status"].get("allocation")
    return [r["device"] for r in alloc["devices"]["results"]] if alloc else []


# --------------------------------------------------------------------------- a node with the driver


class DraNode:
    """A node joined to the cluster (kubelet-managers), a fixture node's sysfs, and the driver process."""

    def __init__(
        self,
        cluster: kube_cluster.Cluster,
        name: str,
        root: Path,
        index: int,
        mode: str = "shared",
        spec: fixtures.NodeSpec | None = None,
        config: dict[str, Any] | None = None,
    ) -> None:
        self.name, self.root, self.mode = name, root, mode
        self.fixture = fixtures.write_node(str(root / "fx"), spec or fixtures.lingjun_node(nics=4))
        self.kubelet_dir = root / "var/lib/kubelet"
        self.cdi_dir = root / "var/run/cdi"
        self.state_dir = self.kubelet_dir / "plugins" / DRIVER
        cfg = {"version": "v1", "mode": mode, "health": {"vanishGraceSeconds": 300}, **(config or {})}
        self.config = root / "dra-config.yaml"
        self.config.write_text(yaml.safe_dump(cfg))
        labels = {"node-restriction.kubernetes.io/rdma-mode": mode}
        self.node = kube_cluster.Node(
            cluster, name, root, index=index, labels=labels, capacity={"pods": "2000"}
        ).start()
        self.kubeconfig = cluster.kubeconfig
        self.proc: subprocess.Popen[bytes] | None = None
        self.uid = ""
        self.log = root / "dra-driver.log"

    def start_driver(self, uid: str = "") -> DraNode:
        """Start the driver as a new pod would: its own UID (random unless given) names its sockets."""
        self.uid = uid or str(uuid.uuid4())
        self.proc = self.spawn(self.uid, self.config, self.log, self.root / "dra.health")
        return self

    def spawn(self, uid: str, config: Path, log: Path, health: Path, *extra: str) -> subprocess.Popen[bytes]:
        """A driver process on this node (another instance beside :attr:`proc`: a rolling update)."""
        argv = [
            sys.executable,
            "-m",
            "rdma_device_plugin",
            "dra",
            "--config",
            str(config),
            "--node-name",
            self.name,
            "--kubeconfig",
            str(self.kubeconfig),
            "--kubelet-dir",
            str(self.kubelet_dir),
            "--cdi-dir",
            str(self.cdi_dir),
            "--sysfs-root",
            self.fixture.sysfs,
            "--dev-root",
            self.fixture.dev,
            "--procfs-root",
            self.fixture.procfs,
            "--health-file",
            str(health),
            "--log-format",
            "json",
            *extra,
        ]
        with log.open("ab") as out:
            return subprocess.Popen(
                argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env={**os.environ, "POD_UID": uid}
            )

    @property
    def endpoint(self) -> Path:
        """The running instance's DRA socket (``plugins/<driver>/dra-<uid>.sock``)."""
        return Path(Paths.of(str(self.kubelet_dir), DRIVER, self.uid).endpoint)

    def stop_driver(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(timeout=30)
        self.proc = None

    def log_lines(self, log: Path | None = None) -> list[dict[str, Any]]:
        out = []
        for line in (log or self.log).read_text(errors="replace").splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
        return out

    def close(self) -> None:
        self.stop_driver()
        self.node.close()

    def cdi(self, device_ids: Iterable[str]) -> tuple[dict[str, str], list[str]]:
        """What a container runtime applies for these CDI device IDs (``kind=name``), from the specs
        in the node's CDI dir: (env, device node paths), spec-wide edits once per spec."""
        env: dict[str, str] = {}
        nodes: list[str] = []
        specs = []
        for f in sorted(os.listdir(self.cdi_dir)) if self.cdi_dir.exists() else []:
            specs.append(json.loads((self.cdi_dir / f).read_text()))
        used: set[int] = set()
        for qualified in device_ids:
            kind, name = qualified.split("=", 1)
            found = [
                (i, s, d) for i, s in enumerate(specs) if s["kind"] == kind for d in s["devices"] if d["name"] == name
            ]
            assert len(found) == 1, f"CDI device {qualified}: {len(found)} matches in {self.cdi_dir}"
            i, spec, device = found[0]
            edits = [device["containerEdits"]] + ([spec.get("containerEdits", {})] if i not in used else [])
            used.add(i)
            for e in edits:
                env.update(dict(kv.split("=", 1) for kv in e.get("env", [])))
                nodes += [n["path"] for n in e.get("deviceNodes", [])]
        return env, nodes

    def got(self, pod_name: str) -> tuple[dict[str, str], list[str]]:
        """The container's env and device nodes as the runtime makes them from its CDI devices."""
        rec = self.node.record("default", pod_name)
        assert rec is not None, f"no record of pod {pod_name} on {self.name}"
        return self.cdi(rec["containers"]["c"]["cdi_devices"])  # type: ignore[index]


def slice_devices(slices: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {d["name"]: d for s in slices for d in s["spec"].get("devices") or []}
