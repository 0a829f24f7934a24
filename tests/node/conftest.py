"""The real-node tier: one control plane (kube_pytest's session cluster) and one real node joined to
it (scripts/real_node.py: the kubelet, containerd and runc from the pinned modules), shared by every
test of this directory. The node is one per machine (the kubelet's device-plugin socket path is
fixed), so this tier runs in one lane only (make test-node)."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

from kube_cluster import Cluster  # noqa: E402
from kube_pytest import Kube, session_cluster, wait_for  # noqa: E402
from real_node import RealNode  # noqa: E402

pytest_plugins = ["kube_pytest"]

NODE = "rdma-node-0"
# The chart's default affinity: a Lingjun node pool's label (a kubelet may set it on itself).
LABELS = {"alibabacloud.com/lingjun-worker": "true"}


# RDMA_NODE_REUSE=DIR: run the tier against the cluster and node already up in DIR (make cluster-up &&
# make node-up: out/cluster), and leave them up; otherwise the session starts and stops its own.
REUSE = os.environ.get("RDMA_NODE_REUSE", "")


@pytest.fixture(scope="session")
def kube_cluster() -> Iterator[Cluster]:
    if REUSE:
        yield Cluster(Path(REUSE).resolve())
        return
    yield from session_cluster()


@pytest.fixture(scope="session")
def real_node(kube_cluster: Cluster) -> Iterator[RealNode]:
    node = RealNode(kube_cluster, NODE, LABELS)
    if REUSE:
        assert node.state(), f"RDMA_NODE_REUSE={REUSE}: no node runs there (make node-up)"
        yield node
        return
    node.up()
    yield node
    left = node.down()
    assert not left, f"the real node left processes behind: {left}"


class Pods:
    """Pods on the real node: create, wait, read logs and exec, as a user does with kubectl."""

    def __init__(self, kube: Kube, node: RealNode) -> None:
        self.kube, self.node = kube, node

    def create(self, manifest: dict[str, Any]) -> None:
        self.kube.kubectl("create", "-f", "-", input=json.dumps(manifest))

    def get(self, ns: str, name: str) -> dict[str, Any]:
        r = self.kube.kubectl("get", "pod", "-n", ns, name, "-o", "json", check=False)
        return dict(json.loads(r.stdout)) if r.returncode == 0 else {}

    def wait_phase(self, ns: str, name: str, phases: tuple[str, ...], timeout: float = 180) -> dict[str, Any]:
        pod = wait_for(lambda: (p := self.get(ns, name)) and p["status"].get("phase") in phases and p, timeout)
        if not pod:
            raise AssertionError(f"pod {ns}/{name} not {phases} within {timeout:.0f} s: {self.describe(ns, name)}")
        return dict(pod)

    def wait_ready(self, ns: str, name: str, timeout: float = 180) -> dict[str, Any]:
        def ready() -> dict[str, Any] | None:
            p = self.get(ns, name)
            conds = {c["type"]: c["status"] for c in p.get("status", {}).get("conditions", [])}
            return p if conds.get("Ready") == "True" else None

        pod = wait_for(ready, timeout)
        if not pod:
            raise AssertionError(f"pod {ns}/{name} not Ready within {timeout:.0f} s: {self.describe(ns, name)}")
        return dict(pod)

    def logs(self, ns: str, name: str, container: str | None = None) -> str:
        args = ["logs", "-n", ns, name] + (["-c", container] if container else [])
        return self.kube.kubectl(*args).stdout

    def exec(self, ns: str, name: str, *argv: str, container: str | None = None) -> str:
        args = ["exec", "-n", ns, name] + (["-c", container] if container else []) + ["--", *argv]
        return self.kube.kubectl(*args).stdout

    def delete(self, ns: str, name: str, wait: bool = True) -> None:
        self.kube.kubectl("delete", "pod", "-n", ns, name, "--ignore-not-found", f"--wait={str(wait).lower()}")

    def describe(self, ns: str, name: str) -> str:
        r = self.kube.kubectl("describe", "pod", "-n", ns, name, check=False)
        return r.stdout[-3000:] + r.stderr[-500:]


@pytest.fixture(scope="session")
def pods(kube: Kube, real_node: RealNode) -> Pods:
    return Pods(kube, real_node)


def node_status(kube: Kube) -> dict[str, Any]:
    return dict(kube.get("node", NODE)["status"])


def wait_allocatable(kube: Kube, resource: str, want: str, timeout: float = 120) -> dict[str, Any]:
    """The Node status once allocatable[resource] == want (as `kubectl describe node` shows it)."""
    status = wait_for(
        lambda: (s := node_status(kube)) and s.get("allocatable", {}).get(resource) == want and s, timeout
    )
    if not status:
        now = node_status(kube)
        raise AssertionError(
            f"allocatable {resource} is {now.get('allocatable', {}).get(resource)!r}, not {want!r}, "
            f"after {timeout:.0f} s (capacity {now.get('capacity', {}).get(resource)!r})"
        )
    return dict(status)


def since(t0: float) -> str:
    return f"{time.monotonic() - t0:.1f} s"
