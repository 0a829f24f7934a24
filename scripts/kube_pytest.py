"""pytest fixtures for tests against the real components (kube_cluster.py): one local control plane
per test session, nodes that join it (kubelet-managers), and the Helm v4 binary built beside them.

Use from a conftest: ``sys.path.insert(0, <repo>/scripts); pytest_plugins = ["kube_pytest"]``.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from kube_cluster import Cluster, Node, kube_bin, plugin_images

# The plugin's image runs as the checkout's plugin on a joined node (kube/README.md, "images").
PLUGIN_IMAGES = plugin_images()


def wait_for(predicate: Callable[[], Any], timeout: float = 60.0, interval: float = 0.25) -> Any:
    """The predicate's first truthy value within timeout, else the last (falsy) one."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() >= deadline:
            return value
        time.sleep(interval)


@pytest.fixture(scope="session")
def kube_cluster() -> Iterator[Cluster]:
    """A control plane of upstream Kubernetes (built by `make kube`) for the whole session."""
    yield from session_cluster()


def session_cluster() -> Iterator[Cluster]:
    """kube_cluster's body: a cluster in a short directory under /tmp, stopped and removed after."""
    bin_dir = kube_bin()
    if not (bin_dir / "kube-apiserver").exists():
        pytest.fail(f"no Kubernetes components in {bin_dir}: build them with `make kube`")
    d = Path(tempfile.mkdtemp(prefix="kc-", dir="/tmp"))
    cluster = Cluster(d, bin=bin_dir)
    cluster.up()
    yield cluster
    left = cluster.down()
    shutil.rmtree(d, ignore_errors=True)
    assert not left, f"processes of the test cluster would not stop: {left}"


class Kube:
    """kubectl and helm against one cluster, with JSON results."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.bin = Path(str(cluster.state()["bin"]))

    def kubectl(self, *args: str, input: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
        r = self.cluster.kubectl(*args, input=input)
        if check and r.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)}: rc {r.returncode}\n{r.stdout}\n{r.stderr}")
        return r

    def get(self, *args: str) -> dict[str, Any]:
        return dict(json.loads(self.kubectl("get", *args, "-o", "json").stdout))

    def apply(self, obj: dict[str, Any] | list[dict[str, Any]]) -> None:
        items = obj if isinstance(obj, list) else [obj]
        self.kubectl(
            "apply",
            "--server-side",
            "--force-conflicts",
            "-f",
            "-",
            input=json.dumps({"apiVersion": "v1", "kind": "List", "items": items}),
        )

    def helm(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        r = subprocess.run(
            [str(self.bin / "helm"), "--kubeconfig", str(self.cluster.kubeconfig), *args],
            capture_output=True,
            text=True,
            check=False,
            timeout=300,
        )
        if check and r.returncode != 0:
            raise AssertionError(f"helm {' '.join(args)}: rc {r.returncode}\n{r.stdout}\n{r.stderr}")
        return r


@pytest.fixture(scope="session")
def kube(kube_cluster: Cluster) -> Kube:
    return Kube(kube_cluster)


@pytest.fixture
def kube_nodes(kube_cluster: Cluster, kube: Kube) -> Iterator[Callable[..., Node]]:
    """A factory of nodes joined to the session's cluster; each is stopped and its Node object deleted
    at the end of the test. Keywords go to :class:`kube_cluster.Node` (labels, images, ...)."""
    made: list[tuple[Node, Path]] = []

    def make(name: str, **kw: Any) -> Node:
        root = Path(tempfile.mkdtemp(prefix="kn-", dir="/tmp"))
        node = Node(kube_cluster, name, root, index=len(made) + 1, **kw)
        made.append((node, root))
        return node

    yield make
    for node, root in made:
        node.close()
        kube.kubectl("delete", "node", node.name, "--ignore-not-found", "--wait=false", check=False)
        shutil.rmtree(root, ignore_errors=True)
