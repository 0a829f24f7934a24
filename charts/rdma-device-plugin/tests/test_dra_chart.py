"""driver: devicePlugin | dra: the DRA driver's DaemonSets, DeviceClasses and RBAC, rendered by Helm's
engine, valid for the Kubernetes versions that serve them; the node partition by mode and API label.
(The classes' CEL is compiled and used by the real API server and scheduler in
plugin_src/tests/test_dra_cluster.py.)"""

from __future__ import annotations

from typing import Any

import helm_python
import kubernetes_validate
import pytest
from conftest import MONITORING, VAP_KINDS, by_kind, one, parse, render_raw
from test_affinity import LINGJUN, MODE, NFD, schedulable

DRIVER_LABEL = "rdma.lingjun.io/driver"
DRA_API = "resource.k8s.io/v1/DeviceClass"
API = (*VAP_KINDS, *MONITORING, DRA_API)


def objects(values: dict[str, Any], kube: str = "v1.37.0") -> list[dict[str, Any]]:
    return parse(render_raw(values, kube_version=kube, api_versions=API))


def where(values: dict[str, Any], labels: dict[str, str]) -> list[str]:
    return sorted(o["metadata"]["name"] for o in by_kind(objects(values), "DaemonSet") if schedulable(o, labels))


def test_without_dra_nothing_of_it_renders_and_the_plugin_ignores_the_driver_label() -> None:
    objs = objects({})
    assert not [o for o in objs if o["kind"] in ("DeviceClass", "ClusterRole", "ClusterRoleBinding")]
    assert sorted(o["metadata"]["name"] for o in by_kind(objs, "DaemonSet")) == [
        "rdma-rdma-device-plugin-exclusive",
        "rdma-rdma-device-plugin-shared",
    ]
    assert DRIVER_LABEL not in str(objs)  # no rollout of the device plugin's pods on upgrade


@pytest.mark.parametrize("default", ["devicePlugin", "dra"])
@pytest.mark.parametrize("mode_label", [None, "shared", "exclusive"])
@pytest.mark.parametrize("driver_label", [None, "devicePlugin", "dra"])
def test_every_rdma_node_gets_exactly_the_daemonset_of_its_mode_and_api(
    default: str, mode_label: str | None, driver_label: str | None
) -> None:
    values = {"driver": default} if default == "dra" else {"dra": {"enabled": True}}
    for base in (NFD, LINGJUN):
        labels = dict(base)
        if mode_label:
            labels[MODE] = mode_label
        if driver_label:
            labels[DRIVER_LABEL] = driver_label
        mode = mode_label or "shared"
        api = driver_label or default
        expected = f"rdma-rdma-device-plugin-{mode}" + ("-dra" if api == "dra" else "")
        assert where(values, labels) == [expected]
    assert where(values, {MODE: "shared"}) == []  # not an RDMA node
    assert where(values, {**NFD, DRIVER_LABEL: "csi"}) == []  # an unknown API: nothing


def test_the_dra_daemonset_talks_to_the_kubelet_and_the_api() -> None:
    values = {"driver": "dra", "kubeletDir": "/var/lib/rancher/k3s/agent/kubelet/", "dra": {"driverName": "rdma.example.com"}}
    ds = one(objects(values), "DaemonSet", "-exclusive-dra")
    pod = ds["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    args = c["args"]
    assert args[0] == "dra" and args[args.index("--driver-name") + 1] == "rdma.example.com"
    assert args[args.index("--kubelet-dir") + 1] == "/var/lib/rancher/k3s/agent/kubelet"
    assert {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}} in c["env"]
    assert pod["automountServiceAccountToken"] is True
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    paths = {v["name"]: v.get("hostPath", {}).get("path") for v in pod["volumes"]}
    # the sockets are registered by their node paths: mounted at the same path
    for name in ("plugins-registry", "plugin-dir"):
        assert mounts[name] == paths[name]
    assert paths["plugin-dir"] == "/var/lib/rancher/k3s/agent/kubelet/plugins/rdma.example.com"
    assert pod["volumes"][0] == {"name": "config", "configMap": {"name": "rdma-rdma-device-plugin-exclusive"}}
    assert c["securityContext"]["readOnlyRootFilesystem"] and c["securityContext"]["capabilities"]["drop"] == ["ALL"]
    assert "--health-file" in c["livenessProbe"]["exec"]["command"]


def test_device_classes_one_extended_class_per_resource() -> None:
    values = {"driver": "dra", "extraResources": [{"name": "rdma/hca_ib", "selectors": {"linkTypes": ["InfiniBand"]}}]}
    classes = {o["metadata"]["name"]: o["spec"] for o in by_kind(objects(values), "DeviceClass")}
    assert sorted(classes) == [
        "all-nics.rdma.lingjun.io",
        "nic-exclusive.rdma.lingjun.io",
        "nic.rdma.lingjun.io",
        "rdma-hca-ib.extended.rdma.lingjun.io",
        "rdma-hca.extended.rdma.lingjun.io",
    ]
    assert classes["rdma-hca-ib.extended.rdma.lingjun.io"]["extendedResourceName"] == "rdma/hca_ib"
    assert '.extendedResource == "rdma/hca_ib"' in classes["rdma-hca-ib.extended.rdma.lingjun.io"]["selectors"][0]["cel"]["expression"]
    assert '.sharing == "exclusive"' in classes["nic-exclusive.rdma.lingjun.io"]["selectors"][0]["cel"]["expression"]
    assert all("extendedResourceName" not in s for n, s in classes.items() if ".extended." not in n)


def test_numa_pools_get_a_device_class_per_numa_node() -> None:
    classes = {o["metadata"]["name"]: o["spec"] for o in by_kind(objects({"driver": "dra", "numaPools": True}), "DeviceClass")}
    numa = sorted(n for n in classes if "-numa" in n)
    assert numa == [f"rdma-hca-numa{i}.extended.rdma.lingjun.io" for i in range(8)]
    assert classes[numa[1]]["extendedResourceName"] == "rdma/hca-numa1"
    assert '.extendedResource == "rdma/hca-numa1"' in classes[numa[1]]["selectors"][0]["cel"]["expression"]
    assert not [n for n in classes if "-local" in n]  # no DRA counterpart (docs/dra.md)
    assert not [n for o in by_kind(objects({"driver": "dra"}), "DeviceClass") if "-numa" in (n := o["metadata"]["name"])]


def test_rbac_is_what_the_driver_calls() -> None:
    objs = objects({"driver": "dra"})
    rules = one(objs, "ClusterRole", "-dra")["rules"]
    assert rules == [
        {"apiGroups": ["resource.k8s.io"], "resources": ["resourceslices"], "verbs": ["get", "list", "watch", "create", "update", "delete"]},
        {"apiGroups": ["resource.k8s.io"], "resources": ["resourceclaims"], "verbs": ["get"]},
        {"apiGroups": [""], "resources": ["nodes", "pods"], "verbs": ["get"]},  # pods: one env per container
    ]
    binding = one(objs, "ClusterRoleBinding", "-dra")
    sa = one(objs, "ServiceAccount")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa["metadata"]["name"], "namespace": "kube-system"}]


@pytest.mark.parametrize("version", ["1.36.0", "1.37.0"])
def test_dra_manifests_valid_for_the_versions_that_serve_them(version: str) -> None:
    checked = 0
    for obj in objects({"driver": "dra"}, kube=f"v{version}"):
        if obj["kind"] in ("ServiceMonitor", "PrometheusRule"):
            continue
        kubernetes_validate.validate(obj, version, strict=True)
        checked += 1
    assert checked >= 10


def test_dra_on_a_cluster_without_it_is_refused_with_the_fix() -> None:
    with pytest.raises(helm_python.HelmError, match=r"driver=dra \(or dra.enabled\) needs resource.k8s.io/v1"):
        render_raw({"driver": "dra"}, kube_version="v1.33.0", api_versions=(*VAP_KINDS, *MONITORING))
    with pytest.raises(helm_python.HelmError, match=r"at '/driver': value must be one of 'devicePlugin', 'dra'"):
        render_raw({"driver": "nvidia"}, kube_version="v1.37.0", api_versions=API)
