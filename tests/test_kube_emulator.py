"""The Kubernetes API emulator (scripts/kube-emulator.py) answers what the plays send as the apiserver
does: pagination from one snapshot (410 when the token is too old), set-based label selectors and
the apiserver's field-selector whitelist, server-owned status, merge and JSON patches, dryRun,
cordon, label validation, and the Eviction subresource with PodDisruptionBudgets
(pkg/registry/core/pod/storage/eviction.go). Each test talks to a real emulator process through
the real kubernetes client; the selector and patch tests run the same assertions against the real
kube-apiserver v1.37.2 (the ``api`` fixture's ``real`` case), so the stand-in, which only
bench/fleet.py uses, must agree with the component it stands in for. Pagination expiry (etcd
compaction) and evictions under a budget whose status the test writes cannot be set up on the real
server: there the disruption controller owns the status (molecule/mode-switch evicts for real)."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
pytest_plugins = ["kube_pytest"]  # the real case: the session's control plane (kube_cluster)

EMULATOR = [sys.executable, str(ROOT / "scripts" / "kube-emulator.py")]


@pytest.fixture
def kubeconfig(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "kubeconfig"
    start = [*EMULATOR, "start", "--port", "0", "--kubeconfig", str(path), "--continue-ttl", "2"]
    subprocess.run([*start, "--pod-termination", "0.3"], check=True, capture_output=True, timeout=60)
    try:
        yield path
    finally:
        subprocess.run([*EMULATOR, "stop", "--kubeconfig", str(path)], check=False, capture_output=True, timeout=60)


@pytest.fixture(params=["emulator", "real"])
def api(request: pytest.FixtureRequest) -> Iterator[Any]:
    """A CoreV1Api on the emulator, or on the session's real kube-apiserver (scripts/kube_pytest.py),
    where the Node objects this test made are deleted afterwards (other tests share that server)."""
    if request.param == "emulator":
        yield _api(request.getfixturevalue("kubeconfig"))
        return
    from kubernetes.client import ApiException

    core = _api(request.getfixturevalue("kube_cluster").kubeconfig)
    yield core
    for name in NODES:
        with contextlib.suppress(ApiException):  # 404: not every test makes every node
            core.delete_node(name)


def _api(kubeconfig: Path) -> Any:
    from kubernetes import client, config

    return client.CoreV1Api(config.new_client_from_config(str(kubeconfig)))


def _error(call: Any) -> tuple[int, dict[str, Any]]:
    from kubernetes.client import ApiException

    with pytest.raises(ApiException) as info:
        call()
    return info.value.status, json.loads(info.value.body)


def _stats(kubeconfig: Path) -> dict[str, int]:
    server = yaml.safe_load(kubeconfig.read_text())["clusters"][0]["cluster"]["server"]
    with urllib.request.urlopen(server + "/kube-emulator/requests", timeout=10) as resp:
        counts: dict[str, int] = json.load(resp)
    return counts


NODES = [f"gpu-{i:02d}" for i in range(7)]


def _names(items: Any) -> list[str]:
    """The names of the listed Node objects this file makes (the real server has other tests' nodes)."""
    return [n.metadata.name for n in items if n.metadata.name in NODES]


def _nodes(api: Any, n: int) -> None:
    for i in range(n):
        labels = {"pool": "a" if i % 2 else "b", "kubernetes.io/hostname": f"gpu-{i:02d}"}
        if i % 3 == 0:
            labels["rdma.lingjun.io/mode"] = "exclusive"
        api.create_node(
            {
                "apiVersion": "v1",
                "kind": "Node",
                "metadata": {"name": f"gpu-{i:02d}", "labels": labels},
                "status": {"capacity": {"rdma/hca": "1k"}, "allocatable": {"rdma/hca": "1k"}},
            }
        )


def test_pagination_reads_one_snapshot_and_expires(kubeconfig: Path) -> None:
    api = _api(kubeconfig)
    _nodes(api, 7)
    first = api.list_node(limit=3)
    assert [n.metadata.name for n in first.items] == ["gpu-00", "gpu-01", "gpu-02"]
    assert first.metadata.remaining_item_count == 4
    api.delete_node("gpu-04")  # pages after the first come from the first page's snapshot
    second = api.list_node(limit=3, _continue=first.metadata._continue)
    assert [n.metadata.name for n in second.items] == ["gpu-03", "gpu-04", "gpu-05"]
    third = api.list_node(limit=3, _continue=second.metadata._continue)
    assert [n.metadata.name for n in third.items] == ["gpu-06"] and not third.metadata._continue
    assert third.items[0].kind is None  # list items carry no TypeMeta, as typed lists from the apiserver
    # a selector pages over matching items only and gives no remainingItemCount
    page = api.list_node(limit=2, label_selector="pool=a")
    assert [n.metadata.name for n in page.items] == ["gpu-01", "gpu-03"] and page.metadata.remaining_item_count is None
    time.sleep(2.5)
    code, status = _error(lambda: api.list_node(limit=2, label_selector="pool=a", _continue=page.metadata._continue))
    assert code == 410 and status["reason"] == "Expired" and "too old to display a consistent list" in status["message"]
    code, status = _error(lambda: api.list_node(limit=2, _continue="bm90IGEgdG9rZW4="))
    assert code == 400 and "continue key is not valid" in status["message"]


@pytest.mark.parametrize(
    "selector,names",
    [
        ("pool=a", ["gpu-01", "gpu-03", "gpu-05"]),
        ("pool==a,rdma.lingjun.io/mode", ["gpu-03"]),
        ("pool!=a", ["gpu-00", "gpu-02", "gpu-04"]),
        ("rdma.lingjun.io/mode in (exclusive, shared)", ["gpu-00", "gpu-03"]),
        ("rdma.lingjun.io/mode notin (exclusive)", ["gpu-01", "gpu-02", "gpu-04", "gpu-05"]),
        ("!rdma.lingjun.io/mode,pool=b", ["gpu-02", "gpu-04"]),
    ],
)
def test_label_selectors(api: Any, selector: str, names: list[str]) -> None:
    _nodes(api, 6)
    assert _names(api.list_node(label_selector=selector).items) == names


@pytest.mark.parametrize(
    "call,message",
    [
        (lambda api: api.list_node(label_selector="pool in a"), "unable to parse requirement"),
        (lambda api: api.list_node(label_selector="pool=a b"), "found 'b', expected: ',' or 'end of string'"),
        (
            lambda api: api.list_node(label_selector="pool=2025-01-01T00:00:00Z"),
            'unable to parse requirement: values[0][pool]: Invalid value: "2025-01-01T00:00:00Z": a valid label must',
        ),
        (lambda api: api.list_node(field_selector="status.phase=Running"), "field label not supported: status.phase"),
        (
            lambda api: api.list_pod_for_all_namespaces(field_selector="status.hostIP=x"),
            "field label not supported: status.hostIP",
        ),
    ],
)
def test_bad_selectors_are_400(api: Any, call: Any, message: str) -> None:
    code, status = _error(lambda: call(api))
    assert code == 400 and message in status["message"], status


def test_spec_host_selects_by_node_name(api: Any) -> None:
    """Old v1 clients' spec.host is converted to spec.nodeName (pkg/apis/core/v1/conversion.go)."""
    assert api.list_pod_for_all_namespaces(field_selector="spec.host=no-such-node").items == []


def test_merge_patch_status_dry_run_and_cordon(api: Any, request: pytest.FixtureRequest) -> None:
    _nodes(api, 1)
    rv = api.read_node("gpu-00").metadata.resource_version
    node = api.patch_node(
        "gpu-00",
        {
            "metadata": {"labels": {"rdma.lingjun.io/mode": None, "x": "1"}},
            "status": {"allocatable": {"rdma/hca": "0"}},
        },
    )
    assert "rdma.lingjun.io/mode" not in node.metadata.labels and node.metadata.labels["x"] == "1"
    assert node.status.allocatable["rdma/hca"] == "1k"  # status only through /status
    assert int(node.metadata.resource_version) > int(rv)
    node = api.patch_node_status("gpu-00", {"status": {"allocatable": {"rdma/hca": "0"}}})
    assert node.status.allocatable["rdma/hca"] == "0"
    dry = api.patch_node("gpu-00", {"metadata": {"labels": {"x": "2"}}}, dry_run="All")
    assert dry.metadata.labels["x"] == "2" and api.read_node("gpu-00").metadata.labels["x"] == "1"
    assert api.patch_node("gpu-00", {"spec": {"unschedulable": True}}).spec.unschedulable is True
    code, status = _error(lambda: api.patch_node("gpu-00", {"metadata": {"labels": {"at": "2025-01-01T00:00:00Z"}}}))
    assert code == 422 and status["reason"] == "Invalid" and "a valid label must be" in status["message"]
    code, status = _error(lambda: api.patch_node("gpu-00", {"metadata": {"labels": {"x": "1"}}}, dry_run="Some"))
    assert code == 422 and status["reason"] == "Invalid", status
    unsupported = 'dryRun: Unsupported value: ["Some"]: supported values: "All"'
    assert status["message"] == f'PatchOptions.meta.k8s.io "" is invalid: {unsupported}'
    # a PUT with a stale resourceVersion conflicts
    stale = api.read_node("gpu-00")
    api.patch_node("gpu-00", {"metadata": {"labels": {"y": "1"}}})
    code, status = _error(lambda: api.replace_node("gpu-00", stale))
    assert code == 409 and "the object has been modified" in status["message"]
    if request.node.callspec.params["api"] == "emulator":  # it counts requests (bench/fleet.py reads them)
        assert _stats(request.getfixturevalue("kubeconfig"))["patch nodes"] >= 5


def _pod(api: Any, name: str, node: str, labels: dict[str, str], phase: str = "Running", ready: bool = True) -> None:
    api.create_namespaced_pod(
        "team-a",
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "labels": labels},
            "spec": {"nodeName": node, "containers": [{"name": "c", "image": "x"}]},
            "status": {"phase": phase},
        },
    )
    # status is the server's on create (Pending); the kubelet's part is written through /status
    assert api.read_namespaced_pod(name, "team-a").status.phase == "Pending"
    conditions = [{"type": "Ready", "status": "True" if ready else "False"}]
    api.patch_namespaced_pod_status(name, "team-a", {"status": {"phase": phase, "conditions": conditions}})


def _pdb(kubeconfig: Path, name: str, labels: dict[str, str], allowed: int, healthy: tuple[int, int]) -> None:
    from kubernetes import client, config

    policy = client.PolicyV1Api(config.new_client_from_config(str(kubeconfig)))
    policy.create_namespaced_pod_disruption_budget(
        "team-a",
        {
            "apiVersion": "policy/v1",
            "kind": "PodDisruptionBudget",
            "metadata": {"name": name},
            "spec": {"minAvailable": 1, "selector": {"matchLabels": labels}},
        },
    )
    policy.patch_namespaced_pod_disruption_budget_status(
        name,
        "team-a",
        {
            "status": {
                "observedGeneration": 1,
                "disruptionsAllowed": allowed,
                "currentHealthy": healthy[0],
                "desiredHealthy": healthy[1],
                "expectedPods": 2,
            }
        },
    )


def _evict(api: Any, name: str, **kw: Any) -> Any:
    body = {"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": name, "namespace": "team-a"}}
    return api.create_namespaced_pod_eviction(name, "team-a", body, **kw)


def test_eviction_honours_pod_disruption_budgets(kubeconfig: Path) -> None:
    api = _api(kubeconfig)
    _nodes(api, 1)
    _pod(api, "train-0", "gpu-00", {"app": "train"})
    _pod(api, "train-1", "gpu-00", {"app": "train"})
    _pod(api, "done", "gpu-00", {"app": "train"}, phase="Succeeded")
    _pdb(kubeconfig, "train-pdb", {"app": "train"}, allowed=1, healthy=(2, 1))
    # a finished pod is deleted without consulting the budget
    _evict(api, "done")
    # dry run: checked, nothing evicted, budget untouched
    _evict(api, "train-0", dry_run="All")
    assert api.read_namespaced_pod("train-0", "team-a").metadata.deletion_timestamp is None
    _evict(api, "train-0")
    pod = api.read_namespaced_pod("train-0", "team-a")
    assert pod.metadata.deletion_timestamp is not None  # terminating: the node's kubelet removes it a moment later
    code, status = _error(lambda: _evict(api, "train-1"))
    assert code == 429 and status["reason"] == "TooManyRequests"
    assert status["message"] == "Cannot evict pod as it would violate the pod's disruption budget."
    assert status["details"]["causes"] == [
        {
            "reason": "DisruptionBudget",
            "message": "The disruption budget train-pdb needs 1 healthy pods and has 2 currently",
        }
    ]
    time.sleep(1)
    names = [p.metadata.name for p in api.list_namespaced_pod("team-a", field_selector="spec.nodeName=gpu-00").items]
    assert names == ["train-1"]
    code, status = _error(
        lambda: api.create_namespaced_pod_eviction(
            "train-1", "team-a", {"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": "other"}}
        )
    )
    assert code == 400 and status["message"] == "name in URL does not match name in Eviction object"
    # two budgets over one pod: the eviction subresource refuses
    _pdb(kubeconfig, "second-pdb", {"app": "train"}, allowed=5, healthy=(2, 1))
    code, status = _error(lambda: _evict(api, "train-1"))
    assert code == 500 and "more than one PodDisruptionBudget" in status["message"]
