"""driver: devicePlugin | dra: the DRA driver's DaemonSets, DeviceClasses and RBAC, rendered by Helm's
engine, valid for the Kubernetes versions that serve them; the node partition by mode and API label.
(The classes' CEL is compiled and used by the real API server and scheduler in
plugin_src/tests/test_dra_cluster.py.)"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import helm_python
import kubernetes_validate
import pytest
import yaml
from conftest import CASES, MONITORING, VAP_KINDS, by_kind, one, parse, render_raw
from test_affinity import LINGJUN, MODE, NFD, schedulable

from rdma_device_plugin.cli import build_parser

DRIVER_LABEL = "node-restriction.kubernetes.io/rdma-driver"
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


@pytest.mark.parametrize("version", ["1.37.0"])
def test_dra_manifests_valid_for_the_versions_that_serve_them(version: str) -> None:
    checked = 0
    for obj in objects({"driver": "dra"}, kube=f"v{version}"):
        if obj["kind"] in ("ServiceMonitor", "PrometheusRule"):
            continue
        kubernetes_validate.validate(obj, version, strict=True)
        checked += 1
    assert checked >= 10


def test_dra_on_a_cluster_without_it_is_refused_with_the_fix() -> None:
    # 1.37 or later whose discovery lists resource.k8s.io/v1 without DeviceClass: the API named
    with pytest.raises(helm_python.HelmError, match=r"driver=dra \(or dra.enabled\) needs resource.k8s.io/v1"):
        render_raw({"driver": "dra"}, kube_version="v1.37.2", api_versions=("resource.k8s.io/v1/ResourceClaim", *VAP_KINDS))
    with pytest.raises(helm_python.HelmError, match=r"at '/driver': value must be one of 'devicePlugin', 'dra'"):
        render_raw({"driver": "nvidia"}, kube_version="v1.37.0", api_versions=API)


@pytest.mark.parametrize("kube", ["v1.36.2", "v1.33.0"])
@pytest.mark.parametrize("values", [{"driver": "dra"}, {"dra": {"enabled": True}}])
def test_dra_below_the_tested_floor_is_refused_by_name(kube: str, values: dict[str, Any]) -> None:
    """1.36 serves the DRA API (with the API in discovery, as helm install sees it) but is not what is
    tested: refused naming the cluster's version, the floor, the value that enables DRA and the fix."""
    with pytest.raises(helm_python.HelmError) as err:
        render_raw(values, kube_version=kube, api_versions=API)
    message = str(err.value)
    enabled = "driver=dra, dra.enabled=false" if "driver" in values else "driver=devicePlugin, dra.enabled=true"
    assert f"{enabled}: the DRA driver needs Kubernetes 1.37 or later (tested on v1.37.2), this cluster is {kube}" in message
    assert "kubernetes#138882, #139034" in message and "set driver=devicePlugin and dra.enabled=false" in message
    assert message.count("1.37 or later") == 1  # one fault, one line (not also "needs resource.k8s.io/v1")
    assert objects(values, kube="v1.37.0")  # the floor itself renders


def test_slice_writes_are_scoped_to_the_drivers_node_and_driver() -> None:
    """The policy's CEL is evaluated by the real API server in plugin_src/tests/test_dra_cluster.py
    (test_a_nodes_token_writes_only_its_own_slices); here: what it matches and who it binds."""
    objs = objects({"driver": "dra", "dra": {"driverName": "rdma.example.com"}})
    policy = one(objs, "ValidatingAdmissionPolicy", "-dra-slices")["spec"]
    binding = one(objs, "ValidatingAdmissionPolicyBinding", "-dra-slices")["spec"]
    assert binding == {"policyName": "rdma-rdma-device-plugin-dra-slices", "validationActions": ["Deny"]}
    assert policy["failurePolicy"] == "Fail"
    (rule,) = policy["matchConstraints"]["resourceRules"]
    assert rule["resources"] == ["resourceslices"] and rule["operations"] == ["CREATE", "UPDATE", "DELETE"]
    user = "system:serviceaccount:kube-system:rdma-rdma-device-plugin"
    assert policy["matchConditions"][0]["expression"] == f'request.userInfo.username == "{user}"'
    assert 'd == "rdma.example.com"' in policy["validations"][2]["expression"]
    assert not [o for o in objects({}) if o["kind"] == "ValidatingAdmissionPolicy" and "-dra-" in o["metadata"]["name"]]


@pytest.mark.parametrize("account", [{"create": False}, {"create": False, "name": "default"}, {"name": "default"}])
def test_dra_never_binds_its_role_to_the_namespaces_default_account(account: dict[str, Any]) -> None:
    with pytest.raises(helm_python.HelmError, match=r"would be bound to kube-system:default, which every pod"):
        render_raw({"driver": "dra", "serviceAccount": account}, kube_version="v1.37.0", api_versions=API)
    objs = objects({"driver": "dra", "serviceAccount": {"create": False, "name": "rdma-dra"}})
    assert one(objs, "ClusterRoleBinding", "-dra")["subjects"][0]["name"] == "rdma-dra"
    assert "system:serviceaccount:kube-system:rdma-dra" in str(one(objs, "ValidatingAdmissionPolicy", "-dra-slices"))
    render_raw({"serviceAccount": {"create": False}}, kube_version="v1.37.0", api_versions=API)  # no DRA: no role


@pytest.mark.parametrize(
    ("strategy", "expected"),
    [
        (None, {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": "10%", "maxUnavailable": 0}}),
        ({"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 3}}, {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 3, "maxUnavailable": 0}}),
        ({"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": "5%"}}, {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": "5%", "maxUnavailable": 0}}),
        ({"type": "OnDelete"}, {"type": "OnDelete"}),
    ],
)
def test_the_dra_driver_rolls_with_surge_and_hands_over(strategy: dict[str, Any] | None, expected: dict[str, Any]) -> None:
    """Per node the new driver pod starts beside the old one (its own sockets: POD_UID), and an old pod
    deleted first (the mode-label switch) serves on until the new one is registered."""
    values: dict[str, Any] = {"driver": "dra"}
    if strategy is not None:
        values["updateStrategy"] = strategy
    for mode in ("shared", "exclusive"):
        ds = one(objects(values), "DaemonSet", f"-{mode}-dra")
        assert ds["spec"]["updateStrategy"] == expected
        pod = ds["spec"]["template"]["spec"]
        (c,) = pod["containers"]
        assert {"name": "POD_UID", "valueFrom": {"fieldRef": {"fieldPath": "metadata.uid"}}} in c["env"]
        handover = float(c["args"][c["args"].index("--handover-seconds") + 1])
        assert 0 < handover < pod["terminationGracePeriodSeconds"]


@pytest.mark.parametrize("case", sorted(CASES))
def test_dra_probes_are_the_drivers_own_and_min_ready_seconds_hold_a_bad_rollout(case: str) -> None:
    """As the device plugin's (test_plugin_contract.py), for every values case: the args parse with the
    driver's own CLI; liveness and readiness run its `healthcheck` on the file it writes (readiness with
    --ready: registered with the kubelet and the node's slices of the newest content in the API,
    plugin_src/tests/test_dra_cluster.py::test_readiness_follows_the_registration_and_the_slices); the
    DaemonSet counts a pod available only after minReadySeconds."""
    values = {**CASES[case], "driver": "dra"}
    objs = objects(values)
    for mode in ("shared", "exclusive"):
        ds = one(objs, "DaemonSet", f"-{mode}-dra")
        assert ds["spec"]["minReadySeconds"] == values.get("minReadySeconds", 30)
        (c,) = ds["spec"]["template"]["spec"]["containers"]
        driver = build_parser().parse_args(c["args"])  # argparse exits on an unknown flag
        assert driver.command == "dra" and driver.health_file.startswith("/dev/shm/")
        live = build_parser().parse_args(c["livenessProbe"]["exec"]["command"][1:])
        ready = build_parser().parse_args(c["readinessProbe"]["exec"]["command"][1:])
        assert live.command == ready.command == "healthcheck"
        assert live.health_file == ready.health_file == driver.health_file
        assert ready.ready and not live.ready
        probe = c["readinessProbe"]
        assert probe["periodSeconds"] * probe["failureThreshold"] <= 30 and probe["successThreshold"] == 1


DRA_ALERTS = {"RdmaDraDriverDown", "RdmaDraNotRegistered", "RdmaDraSlicesNotPublished", "RdmaDraPrepareErrors"}
DRA_PROMTOOL = Path(__file__).parent / "promtool" / "dra"


def dra_rule_groups(extra: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    values = {"driver": "dra", "metrics": {"enabled": True, "prometheusRule": {"enabled": True}}, **(extra or {})}
    groups: list[dict[str, Any]] = one(objects(values), "PrometheusRule")["spec"]["groups"]
    return groups


def _promtool_dra(tmp_path: Path, groups: list[dict[str, Any]]) -> subprocess.CompletedProcess[str]:
    (tmp_path / "rules-dra.yaml").write_text(yaml.safe_dump({"groups": groups}), encoding="utf-8")
    promtool = shutil.which("promtool")
    assert promtool, "promtool is missing: install Debian's prometheus (make system-deps)"
    check = subprocess.run([promtool, "check", "rules", str(tmp_path / "rules-dra.yaml")], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    shutil.copy(DRA_PROMTOOL / "dra.test.yaml", tmp_path / "dra.test.yaml")
    return subprocess.run([promtool, "test", "rules", str(tmp_path / "dra.test.yaml")], capture_output=True, text=True, timeout=300)


def test_dra_alerts_fire_per_node_and_stay_quiet_through_a_rolling_update(tmp_path: Path) -> None:
    """The DRA driver's alerts with the real `promtool test rules` (promtool/dra/dra.test.yaml), as the
    device plugin's (test_observability.py); with their runbooks in docs/alerts.md."""
    groups = dra_rule_groups()
    assert [g["name"] for g in groups] == ["rdma-device-plugin", "rdma-dra-driver"]
    rules = groups[1]["rules"]
    assert {r["alert"] for r in rules} == DRA_ALERTS
    tested = {c["alertname"] for t in yaml.safe_load((DRA_PROMTOOL / "dra.test.yaml").read_text())["tests"] for c in t["alert_rule_test"]}
    assert tested == DRA_ALERTS
    runbooks = (Path(__file__).parents[3] / "docs" / "alerts.md").read_text(encoding="utf-8")
    for r in rules:
        assert 'job="rdma-rdma-device-plugin-dra-metrics"' in r["expr"] and "{{ $labels.node }}" in r["annotations"]["summary"]
        assert f"## {r['alert']}" in runbooks and r["annotations"]["runbook_url"].endswith(f"#{r['alert'].lower()}")
    result = _promtool_dra(tmp_path, groups)
    assert result.returncode == 0, result.stdout + result.stderr
    # a rule that looks at each instance instead of the node fires for the superseded old instance
    broken = yaml.safe_load(yaml.safe_dump(groups))
    rule = next(r for r in broken[1]["rules"] if r["alert"] == "RdmaDraSlicesNotPublished")
    rule["expr"] = 'rdma_dra_slices_in_sync{job="rdma-rdma-device-plugin-dra-metrics"} == 0'
    assert _promtool_dra(tmp_path, broken).returncode != 0
    assert [g["name"] for g in one(objects({"metrics": {"enabled": True, "prometheusRule": {"enabled": True}}}), "PrometheusRule")["spec"]["groups"]] == ["rdma-device-plugin"]


@pytest.mark.parametrize("kind", ["PodMonitor", "ServiceMonitor"])
def test_the_dra_driver_is_scraped_as_its_own_job(kind: str) -> None:
    values = {"driver": "dra", "metrics": {"enabled": True, "serviceMonitor": {"enabled": True, "kind": kind}}}
    objs = objects(values)
    ds = one(objs, "DaemonSet", "-shared-dra")
    (c,) = ds["spec"]["template"]["spec"]["containers"]
    assert c["args"][c["args"].index("--metrics-address") + 1] == "[$(POD_IP)]:9410"
    assert c["env"][0]["name"] == "POD_IP" and c["ports"] == [{"name": "metrics", "containerPort": 9410, "protocol": "TCP"}]
    monitor = one(objs, kind)["spec"]
    components = monitor["selector"]["matchExpressions"][0]["values"]
    if kind == "PodMonitor":
        assert components == ["device-plugin", "dra-driver"]
        relabel = monitor["podMetricsEndpoints"][0]["relabelings"][-1]
        assert relabel["regex"] == "dra-driver" and relabel["replacement"] == "rdma-rdma-device-plugin-dra-metrics"
    else:
        assert components == ["metrics", "dra-metrics"]
        service = one(objs, "Service", "-dra-metrics")
        assert service["spec"]["selector"]["app.kubernetes.io/component"] == "dra-driver"
        assert service["metadata"]["labels"]["app.kubernetes.io/component"] == "dra-metrics"
