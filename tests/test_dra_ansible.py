"""The automation's DRA path (rdma_driver: dra): deploy renders the DRA driver, and verify judges every
node by its ResourceSlices and runs a test claim, against the real v1.37.2 control plane with one node
running the driver (kubelet-managers + ``rdma-device-plugin dra``) and one without it."""

from __future__ import annotations

import json
import re
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import ROOT, run_playbook

sys.path.insert(0, str(ROOT / "plugin_src" / "tests"))
import dra_support as ds
from ansible_collections.lingjun.rdma.plugins.module_utils import rdma_dra
from ansible_collections.lingjun.rdma.plugins.module_utils.rdma_dra import nic_count_problem, pools, verdict
from ansible_collections.lingjun.rdma.plugins.module_utils.rdma_fleet import DRIVER_LABEL

pytestmark = pytest.mark.timeout(900)


def _slice(
    node: str, gen: int, count: int, devices: list[dict[str, Any]] | None, counters: bool = False
) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "driver": "d",
        "nodeName": node,
        "pool": {"name": node, "generation": gen, "resourceSliceCount": count},
    }
    if counters:
        spec["sharedCounters"] = [{"name": "nics", "counters": {"a": {"value": "2"}}}]
    else:
        spec["devices"] = devices or []
    return {"spec": spec}


def test_verdicts_from_slices() -> None:
    down = {
        "name": "a-x",
        "taints": [{"key": "rdma.lingjun.io/unhealthy", "value": "port-down", "effect": "NoSchedule"}],
    }
    seen = pools(
        [
            _slice("ok", 2, 2, [{"name": "a"}, {"name": "a-x"}]),
            _slice("ok", 2, 2, None, counters=True),
            _slice("ok", 1, 2, [{"name": "old"}]),  # an older generation does not count
            _slice("half", 3, 2, [{"name": "a"}]),  # its counters slice is missing
            _slice("tainted", 1, 1, [{"name": "a"}, down]),
            _slice("empty", 1, 1, []),
        ]
    )
    assert seen["ok"].devices == ["a", "a-x"] and seen["ok"].complete
    v = {n: verdict(n, seen.get(n), "d", "rdma") for n in ("ok", "half", "tainted", "empty", "none")}
    assert v["ok"].ok and "2 devices of d published (generation 2, 2 slice(s)), none tainted" in v["ok"].msg
    assert not v["half"].ok and "incomplete (1 of 2 slices of generation 3)" in v["half"].msg
    assert not v["tainted"].ok and "a-x (rdma.lingjun.io/unhealthy=port-down:NoSchedule)" in v["tainted"].msg
    assert not v["empty"].ok and "publishes no device" in v["empty"].msg
    assert not v["none"].ok and "no ResourceSlice of driver d" in v["none"].msg


def test_nic_count_of_the_test_pod() -> None:
    nic = {"attributes": {"rdmaDevice": {"string": "mlx5_0"}, "resource": {"string": "rdma/hca"}}}
    devices = [
        {"name": f"n{i}", "attributes": {**nic["attributes"], "sharing": {"string": "shared"}}} for i in range(4)
    ]
    devices += [
        {"name": f"n{i}-x", "attributes": {**nic["attributes"], "sharing": {"string": "exclusive"}}} for i in range(4)
    ]
    devices.append({"name": "all-hca", "attributes": {"nicCount": {"int": 4}, "sharing": {"string": "set"}}})
    view = pools([_slice("a", 1, 1, devices)])["a"]
    assert view.published == {"rdma/hca": 4} and view.nics["all-hca"] == 4 and view.sets == {"all-hca"}
    assert nic_count_problem("a", view, "rdma/hca", ["all-hca"], 4, "rdma_nic_count") == ""
    assert nic_count_problem("a", view, "rdma/hca", ["n2-x"]) == ""  # exclusive mode: one NIC per unit
    assert nic_count_problem("a", view, "rdma/hca", ["n1-x", "n2-x"]) == (
        "the test pod got 2 NICs (n1-x, n2-x), 1 expected (one NIC per unit)"
    )
    assert nic_count_problem("a", view, "rdma/hca", ["all-hca"], 8, "validated on 2026-01-01") == (
        "node a publishes 4 NICs of rdma/hca, 8 expected (validated on 2026-01-01): a NIC is missing or not "
        "selected. Next: rdma-device-plugin discover on the node"
    )
    smaller = pools([_slice("a", 1, 1, [*devices[:3], devices[-1]])])["a"]  # the set counts 4, 3 published
    assert "the test pod got 4 NICs (all-hca), 3 expected (every NIC of the node)" in nic_count_problem(
        "a", smaller, "rdma/hca", ["all-hca"]
    )


@pytest.fixture(scope="module")
def cluster_with_nodes() -> Iterator[tuple[ds.kube_cluster.Cluster, Path]]:
    ds.kube_bin()
    work = Path(tempfile.mkdtemp(prefix="rdra-ans-", dir="/tmp"))
    cluster = ds.kube_cluster.Cluster(work / "cl").up()
    nodes: list[ds.DraNode] = []
    try:
        api = ds.Api(cluster.kubeconfig)
        for obj in ds.chart_objects({"driver": "dra"}):
            # The chart's admission policy too (Deny): the verify's test pod must pass it.
            if obj["kind"] in ("DeviceClass", "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"):
                api.apply(obj)
        nodes.append(ds.DraNode(cluster, "d1", work / "d1", index=1).start_driver())
        nodes.append(ds.DraNode(cluster, "d2", work / "d2", index=2))  # joined, no driver
        ds.wait_for("d1's slices", lambda: len(api.slices("d1")) == 2)
        yield cluster, work
    finally:
        for n in nodes:
            n.close()
        cluster.down()
        shutil.rmtree(work, ignore_errors=True)


def _inventory(work: Path, cluster: ds.kube_cluster.Cluster, **extra: Any) -> Path:
    inv = work / "inventory" / "hosts.yml"
    inv.parent.mkdir(parents=True, exist_ok=True)
    group_vars = {
        "ansible_connection": "local",
        "ansible_python_interpreter": "{{ ansible_playbook_python }}",
        "rdma_deploy_target": "cluster",
        "rdma_kubeconfig": str(cluster.kubeconfig),
        "rdma_driver": "dra",
        "rdma_output_dir": str(work / "out"),
        "plugin_verify_timeout": 20,
        "plugin_verify_timeout_per_wave": 0,
        "plugin_verify_poll_interval": 1,
        **extra,
    }
    hosts = {"d1": {"rdma_nic_count": 4}, "d2": {}}  # d1: the fixture's 4 NICs, what verify checks it publishes
    doc = {"all": {"vars": group_vars, "children": {"rdma_nodes": {"hosts": hosts}}}}
    inv.write_text(yaml.safe_dump(doc))
    return inv


def test_verify_judges_each_node_by_its_slices_and_a_test_claim(cluster_with_nodes: tuple[Any, Path]) -> None:
    cluster, work = cluster_with_nodes
    api = ds.Api(cluster.kubeconfig)
    # The chart's policy is in force: the test pod's former shape (no hostNetwork, no IPC_LOCK) is denied.
    # The old test pod's shape (no hostNetwork) in the release's namespace, where verify runs its pods now
    # (the tenant policy refuses RDMA pods in unlabelled namespaces: docs/security.md).
    denied = ds.pod("denied", "d1", limits={"rdma/hca": "1"})
    denied["metadata"]["namespace"] = "kube-system"
    # Everything else as the tenant policy wants it, so hostNetwork is its one fault: the API server
    # evaluates the policies in no set order, and the first denial is the message.
    denied["spec"]["containers"][0]["securityContext"] = {"capabilities": {"drop": ["ALL"], "add": ["IPC_LOCK"]}}
    with pytest.raises(ds.kubeapi.ApiError, match=r"requests RDMA .* without hostNetwork: true"):
        api.create(denied)
    inv = _inventory(
        work, cluster, plugin_verify_test_job=True, plugin_verify_test_job_image="registry.example.com/rdma/check:1"
    )
    run = run_playbook("-i", str(inv), "playbooks/verify.yml")
    out = run.stdout + run.stderr
    assert run.returncode != 0, out
    verdicts = {h: json.loads((work / "out" / "verify" / "verdicts" / f"{h}.json").read_text()) for h in ("d1", "d2")}
    assert verdicts["d1"]["ok"], verdicts["d1"]
    assert "test claim: rdma/hca 1 allocated d1/all-hca (4 NICs) and prepared (pod Running)" in verdicts["d1"]["msg"]
    assert not verdicts["d2"]["ok"] and "node d2: no ResourceSlice of driver rdma.lingjun.io" in verdicts["d2"]["msg"]
    recap = dict(re.findall(r"^(d[12])\s+: ok=\d+.*?failed=(\d+)", out, flags=re.M))
    assert recap == {"d1": "0", "d2": "1"}, out  # each node host with its own verdict
    left = api.get("/api/v1/namespaces/kube-system/pods", labelSelector="rdma.lingjun.io/dra-verify")["items"]
    assert not [p for p in left if not p["metadata"].get("deletionTimestamp")]  # the test pods are deleted


def test_deploy_renders_the_dra_driver(cluster_with_nodes: tuple[Any, Path]) -> None:
    cluster, work = cluster_with_nodes
    inv = _inventory(work, cluster, plugin_deploy_render_only=True)
    run = run_playbook("-i", str(inv), "playbooks/deploy.yml")
    assert run.returncode == 0, run.stdout + run.stderr
    docs = [
        d for f in sorted((work / "out" / "manifests").rglob("*.yaml")) for d in yaml.safe_load_all(f.read_text()) if d
    ]
    names = {(d["kind"], d["metadata"]["name"]) for d in docs}
    assert ("DaemonSet", "rdma-rdma-device-plugin-shared-dra") in names
    assert ("DeviceClass", "rdma-hca.extended.rdma.lingjun.io") in names
    assert ("ClusterRole", "rdma-rdma-device-plugin-dra") in names


def test_the_floor_is_one_for_the_driver_the_chart_and_the_deploy() -> None:
    from rdma_device_plugin.dra import version

    tpl = (ROOT / "charts" / "rdma-device-plugin" / "templates" / "_validate.tpl").read_text()
    floor = ".".join(map(str, version.FLOOR))
    assert f'semverCompare "<{floor}.0-0" .Capabilities.KubeVersion.Version' in tpl
    assert f"tested on {version.TESTED}" in tpl
    assert (rdma_dra.KUBE_FLOOR, rdma_dra.KUBE_TESTED) == (version.FLOOR, version.TESTED)


def test_which_nodes_dra_serves_and_which_pods_ask_local() -> None:
    def node(name: str, label: str | None = None) -> dict[str, Any]:
        return {"metadata": {"name": name, "labels": {} if label is None else {DRIVER_LABEL: label}}}

    def pod(name: str, node: str, phase: str = "Running", init: bool = False, part: str = "limits") -> dict[str, Any]:
        c = {"name": "c", "resources": {part: {"rdma/hca-local": "1"}}}
        spec = {"nodeName": node, "containers": [{"name": "main"}], **({"initContainers": [c]} if init else {})}
        if not init:
            spec["containers"].append(c)
        return {"metadata": {"namespace": "ml", "name": name}, "spec": spec, "status": {"phase": phase}}

    nodes = [node("a"), node("b", "dra"), node("c", "devicePlugin")]
    assert rdma_dra.dra_nodes(nodes, DRIVER_LABEL, "dra") == ["a", "b"]
    assert rdma_dra.dra_nodes(nodes, DRIVER_LABEL, "devicePlugin") == ["b"]  # dra.enabled alone
    # Before the deploy copies the labels of chart 2.x: the old key decides, the new one wins where both are.
    old = {"metadata": {"name": "d", "labels": {"rdma.lingjun.io/driver": "dra"}}}
    both = {"metadata": {"name": "e", "labels": {"rdma.lingjun.io/driver": "dra", DRIVER_LABEL: "devicePlugin"}}}
    assert rdma_dra.dra_nodes([old, both], DRIVER_LABEL, "devicePlugin", ["rdma.lingjun.io/driver"]) == ["d"]
    assert rdma_dra.dra_nodes([old], DRIVER_LABEL, "devicePlugin") == []
    pods = [
        pod("p1", "a"),
        pod("p2", "b", init=True, part="requests"),
        pod("p3", "c"),  # stays on the device plugin
        pod("p4", "a", phase="Succeeded"),
        {"metadata": {"namespace": "ml", "name": "p5"}, "spec": {"nodeName": "a", "containers": [{"name": "c"}]}},
    ]
    found = rdma_dra.local_pods(pods, ["a", "b"], ["rdma/hca"])
    assert found == [("ml/p1", "a", "rdma/hca-local"), ("ml/p2", "b", "rdma/hca-local")]
    assert rdma_dra.local_pods(pods, ["a", "b"], ["rdma/other"]) == []
    assert rdma_dra.local_pods_problem([], "k") == ""


def test_a_cluster_below_the_floor_is_refused_naming_the_variable(cluster_with_nodes: tuple[Any, Path]) -> None:
    """The real v1.37.2 server's /version passes; the same document as a 1.36 server (or a provider's
    "36+") answers it is refused, naming rdma_driver and the next command."""
    cluster, _ = cluster_with_nodes
    real = ds.Api(cluster.kubeconfig).get("/version")
    assert rdma_dra.version_problem(real) == ""
    for minor, git in (("36", "v1.36.2"), ("36+", "v1.36.2-eks-1")):
        problem = rdma_dra.version_problem({**real, "minor": minor, "gitVersion": git})
        assert problem.startswith(f"the cluster runs Kubernetes {git}; rdma_driver=dra needs 1.37 or later")
        assert "kubernetes#138882, #139034" in problem
        assert "Next: upgrade the control plane and the kubelets to 1.37 and run ansible-playbook" in problem
        assert problem.endswith("-e rdma_driver=devicePlugin")


def test_deploy_refuses_pods_asking_a_local_resource_on_nodes_dra_would_serve(
    cluster_with_nodes: tuple[Any, Path],
) -> None:
    """numaPools' <resource>-local has no DRA counterpart: before helm runs, the deploy lists the pods
    that ask it on the nodes DRA would serve, names them (namespace/name, node, resource) and installs
    nothing. A node kept on the device plugin by its label is not one of them."""
    cluster, work = cluster_with_nodes
    api = ds.Api(cluster.kubeconfig)
    created: list[dict[str, Any]] = []
    for node, labels in (("gpu-a", {}), ("gpu-b", {"node-restriction.kubernetes.io/rdma-driver": "devicePlugin"})):
        # Node objects without a kubelet: a pod bound to one stays Pending, as one waiting to be admitted.
        created.append(api.create({"apiVersion": "v1", "kind": "Node", "metadata": {"name": node, "labels": labels}}))
        p = ds.pod(f"train-{node}", node, limits={"rdma/hca-local": "1"}, grace=0)
        p["metadata"]["namespace"] = "kube-system"  # the release's namespace: the chart's policies admit it
        p["spec"]["hostNetwork"] = True
        p["spec"]["containers"][0]["securityContext"] = {"capabilities": {"drop": ["ALL"], "add": ["IPC_LOCK"]}}
        p["spec"]["nodeName"] = p["spec"].pop("nodeSelector")["kubernetes.io/hostname"]
        created.append(api.create(p))
    try:
        inv = _inventory(
            work,
            cluster,
            rdma_plugin_image_repository="127.0.0.1:5000/rdma/rdma-device-plugin",
            plugin_deploy_helm_binary=str(ds.kube_bin() / "helm"),
            rdma_validation_required=False,
        )
        run = run_playbook("-i", str(inv), "playbooks/deploy.yml")
        out = run.stdout + run.stderr
        assert run.returncode != 0, out
        assert "Nothing was installed. 1 pod(s) on nodes DRA would serve ask a numaPools -local resource" in out, out
        assert "kube-system/train-gpu-a on gpu-a (rdma/hca-local)" in out and "train-gpu-b" not in out
        assert "kubectl label node <node> node-restriction.kubernetes.io/rdma-driver=devicePlugin" in out
        secrets = api.get("/api/v1/namespaces/kube-system/secrets", labelSelector="owner=helm")["items"]
        assert not secrets  # helm never ran
        assert not api.get("/apis/apps/v1/namespaces/kube-system/daemonsets")["items"]
    finally:
        for obj in reversed(created):
            api.delete(obj)
