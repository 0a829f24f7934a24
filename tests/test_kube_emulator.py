"""The Kubernetes API emulator (scripts/kube-emulator.py) answers what the plays send as the apiserver
does: pagination from one snapshot (410 when the token is too old), set-based label selectors and
the apiserver's field-selector whitelist, server-owned status, merge and JSON patches, dryRun,
cordon, label validation, and the Eviction subresource with PodDisruptionBudgets
(pkg/registry/core/pod/storage/eviction.go). Each test talks to a real emulator process through
the real kubernetes client."""

from __future__ import annotations

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
def test_label_selectors(kubeconfig: Path, selector: str, names: list[str]) -> None:
    api = _api(kubeconfig)
    _nodes(api, 6)
    assert [n.metadata.name for n in api.list_node(label_selector=selector).items] == names


@pytest.mark.parametrize(
    "call,message",
    [
        (lambda api: api.list_node(label_selector="pool in a"), "unable to parse requirement"),
        (lambda api: api.list_node(label_selector="pool=a b"), "unable to parse requirement"),
        (lambda api: api.list_node(label_selector="pool=2025-01-01T00:00:00Z"), "invalid label value"),
        (lambda api: api.list_node(field_selector="status.phase=Running"), "field label not supported: status.phase"),
        (lambda api: api.list_pod_for_all_namespaces(field_selector="spec.host=x"), "field label not supported"),
    ],
)
def test_bad_selectors_are_400(kubeconfig: Path, call: Any, message: str) -> None:
    code, status = _error(lambda: call(_api(kubeconfig)))
    assert code == 400 and message in status["message"], status


def test_merge_patch_status_dry_run_and_cordon(kubeconfig: Path) -> None:
    api = _api(kubeconfig)
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
    assert code == 400
    # a PUT with a stale resourceVersion conflicts
    stale = api.read_node("gpu-00")
    api.patch_node("gpu-00", {"metadata": {"labels": {"y": "1"}}})
    code, status = _error(lambda: api.replace_node("gpu-00", stale))
    assert code == 409 and "the object has been modified" in status["message"]
    assert _stats(kubeconfig)["patch nodes"] >= 5


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
