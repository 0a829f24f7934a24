"""Render the values matrix with the real Helm engine; validate every object against the Kubernetes
schemas of every minor the chart supports; lint strictly; check the shape of what was rendered."""

from __future__ import annotations

import hashlib
import json
import tomllib

import helm_python
import kubernetes_validate
import pytest
import yaml
from conftest import CASES, CHART_DIR, MONITORING, NAMESPACE, RELEASE, VAP_KINDS, by_kind, daemonsets, kube_minor_versions, manifests, one, parse, render, render_raw

KUBE_VERSIONS = kube_minor_versions()
# prometheus-operator CRD: kubernetes-validate has no schema for it (only warns); checked by hand below.
CUSTOM_KINDS = {("monitoring.coreos.com/v1", k) for k in ("ServiceMonitor", "PodMonitor", "PrometheusRule")}


def test_kube_versions_cover_declared_range() -> None:
    # the floor is what the chart needs without the admission policy (gated on the API instead)
    assert KUBE_VERSIONS[0] == "1.25.0"
    assert "1.28.0" in KUBE_VERSIONS and "1.29.0" in KUBE_VERSIONS


def _render_for(case: str, version: str) -> list[dict]:
    """The case as installed on a cluster of that version: discovery lists the policy kinds from 1.30."""
    values = dict(CASES[case])
    minor = int(version.split(".")[1])
    api = (*MONITORING, *(VAP_KINDS if minor >= 30 else ["admissionregistration.k8s.io/v1/ValidatingWebhookConfiguration"]))
    if minor < 30:
        values["admissionPolicy"] = {**values.get("admissionPolicy", {}), "enabled": False}
    if minor < 28 and values.get("cdi", {}).get("enabled"):
        # the kubelet passes CDI devices from 1.28 on: the chart refuses cdi.enabled before
        with pytest.raises(helm_python.HelmError, match=r"cdi.enabled=true needs Kubernetes >= 1.28"):
            render_raw(values, kube_version=f"v{version}", api_versions=api)
        values["cdi"] = {**values["cdi"], "enabled": False}
    return parse(render_raw(values, kube_version=f"v{version}", api_versions=api))


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_manifest_valid_for_every_supported_kubernetes(case: str) -> None:
    checked = 0
    for version in KUBE_VERSIONS:
        objs = _render_for(case, version)
        assert objs
        for obj in objs:
            if (obj["apiVersion"], obj["kind"]) in CUSTOM_KINDS:
                continue
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                pytest.fail(f"{case}: {obj['kind']}/{obj['metadata']['name']} invalid for {version}: {exc.message} at {list(exc.path)}")
            checked += 1
    assert checked >= 6 * len(KUBE_VERSIONS)


@pytest.mark.parametrize("case", sorted(CASES))
def test_lint_strict_is_clean(case: str) -> None:
    values = CASES[case]
    # the oldest minor with the policy, the newest, and the chart's floor without the policy
    runs = [("1.30.0", values), (KUBE_VERSIONS[-1], values),
            (KUBE_VERSIONS[0], {**values, "admissionPolicy": {**values.get("admissionPolicy", {}), "enabled": False}})]
    for version, vals in runs:
        report = helm_python.lint(str(CHART_DIR), vals, strict=True, kube_version=f"v{version}")
        assert report["errors"] == [], report
        # severity 1 (info) is only "icon is recommended": the chart has no icon to point at
        assert [m for m in report["messages"] if m["severity"] >= 2] == [], report


def test_lint_reports_schema_violation() -> None:
    """The lint check above can fail: lint sees schema errors."""
    report = helm_python.lint(str(CHART_DIR), {"mode": "both"}, strict=True)
    assert any("mode" in e for e in report["errors"]) or any(m["severity"] >= 2 and "mode" in m["error"] for m in report["messages"])


def test_pod_monitor_by_default_scrapes_every_plugin_pod() -> None:
    """Issue 31: a ServiceMonitor's default discovery role (Endpoints) sees at most 1000 plugins; the
    default is a PodMonitor, whose targets get the job and node the alerts select."""
    objs = manifests(CASES["metrics"])
    assert not by_kind(objs, "ServiceMonitor")
    pm = one(objs, "PodMonitor")
    assert pm["metadata"]["labels"]["release"] == "prom"
    assert pm["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    (endpoint,) = pm["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] == "metrics" and endpoint["interval"] == "30s"
    assert {"sourceLabels": ["__meta_kubernetes_pod_node_name"], "targetLabel": "node"} in endpoint["relabelings"]
    assert {"targetLabel": "job", "replacement": f"{RELEASE}-rdma-device-plugin-metrics"} in endpoint["relabelings"]
    for ds in daemonsets(CASES["metrics"]).values():  # it selects the plugin pods of both modes, nothing else
        pod_labels = ds["spec"]["template"]["metadata"]["labels"]
        assert set(pm["spec"]["selector"]["matchLabels"].items()) <= set(pod_labels.items())
    assert pm["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] == "device-plugin"


def test_service_monitor_uses_endpoint_slices() -> None:
    objs = manifests(CASES["service-monitor"])
    assert not by_kind(objs, "PodMonitor")
    sm = one(objs, "ServiceMonitor")
    assert sm["spec"]["serviceDiscoveryRole"] == "EndpointSlice"
    assert all(r.get("targetLabel") != "job" for r in sm["spec"]["endpoints"][0]["relabelings"])  # the Service's name
    values = {"metrics": {"enabled": True, "serviceMonitor": {"enabled": True, "kind": "ServiceMonitor",
                                                              "serviceDiscoveryRole": "Endpoints"}}}
    assert one(manifests(values), "ServiceMonitor")["spec"]["serviceDiscoveryRole"] == "Endpoints"


def test_service_monitor_shape() -> None:
    objs = manifests(CASES["service-monitor"])
    sm = one(objs, "ServiceMonitor")
    svc = one(objs, "Service", "-metrics")
    assert sm["spec"]["endpoints"][0]["port"] == "metrics"
    assert set(sm["spec"]["selector"]["matchLabels"].items()) <= set(svc["metadata"]["labels"].items())
    assert sm["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    objs = manifests(CASES["metrics"])
    svc = one(objs, "Service", "-metrics")
    assert svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["ports"][0]["port"] == 9500
    # the Service selects the plugin pods of both modes
    for ds in daemonsets(CASES["metrics"]).values():
        pod_labels = ds["spec"]["template"]["metadata"]["labels"]
        assert set(svc["spec"]["selector"].items()) <= set(pod_labels.items())
        container = ds["spec"]["template"]["spec"]["containers"][0]
        assert container["ports"] == [{"name": "metrics", "containerPort": 9500, "protocol": "TCP"}]
        assert "[$(POD_IP)]:9500" in container["args"]


def test_metrics_off_renders_no_service_or_port() -> None:
    objs = manifests({})
    assert not by_kind(objs, "Service") and not by_kind(objs, "ServiceMonitor") and not by_kind(objs, "PodMonitor")
    for ds in daemonsets({}).values():
        container = ds["spec"]["template"]["spec"]["containers"][0]
        assert "ports" not in container and "--metrics-address" not in container["args"]


def test_two_daemonsets_two_configmaps_and_no_rbac() -> None:
    objs = manifests({})
    kinds = sorted(o["kind"] for o in objs)
    assert kinds.count("DaemonSet") == 2 and kinds.count("ConfigMap") == 2
    assert not [k for k in kinds if k in {"Role", "ClusterRole", "RoleBinding", "ClusterRoleBinding"}]
    sa = one(objs, "ServiceAccount")
    assert sa["automountServiceAccountToken"] is False
    for mode, ds in daemonsets({}).items():
        assert ds["metadata"]["name"] == f"rdma-rdma-device-plugin-{mode}"
        pod = ds["spec"]["template"]["spec"]
        assert pod["serviceAccountName"] == sa["metadata"]["name"]
        assert pod["automountServiceAccountToken"] is False
        assert "hostNetwork" not in pod and "dnsPolicy" not in pod  # only with nonHostNetwork.enabled
        assert pod["priorityClassName"] == "system-node-critical"
        assert pod["tolerations"] == [{"operator": "Exists"}]
        (cm_volume,) = [v for v in pod["volumes"] if v["name"] == "config"]
        assert cm_volume["configMap"]["name"] == f"rdma-rdma-device-plugin-{mode}"
        assert ds["spec"]["selector"]["matchLabels"]["rdma.lingjun.io/mode"] == mode


def _args(container: dict) -> dict[str, str]:
    args = container["args"]
    assert args[0] == "serve"
    return {args[i]: args[i + 1] for i in range(1, len(args), 2)}


@pytest.mark.parametrize(
    "case,host_dir",
    [
        # The kubelet serves kubelet.sock at /var/lib/kubelet/device-plugins whatever its --root-dir
        # (KubeletSocket is a constant): kubeletDir moves only the DRA driver's directories.
        ("defaults", "/var/lib/kubelet/device-plugins"),
        ("k3s", "/var/lib/kubelet/device-plugins"),
        ("microk8s", "/var/lib/kubelet/device-plugins"),
    ],
)
def test_kubelet_dir_and_mounts(case: str, host_dir: str) -> None:
    for ds in daemonsets(CASES[case]).values():
        pod = ds["spec"]["template"]["spec"]
        container = pod["containers"][0]
        volumes = {v["name"]: v for v in pod["volumes"]}
        mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
        assert volumes["device-plugins"]["hostPath"] == {"path": host_dir, "type": "Directory"}
        # inside the container the path is fixed and passed to the plugin
        assert mounts["/var/lib/kubelet/device-plugins"]["name"] == "device-plugins"
        assert not mounts["/var/lib/kubelet/device-plugins"].get("readOnly", False)
        args = _args(container)
        assert args["--device-plugin-dir"] == "/var/lib/kubelet/device-plugins"
        assert args["--config"] == "/etc/rdma-device-plugin/config.yaml"
        assert args["--sysfs-root"] == "/host/sys" and args["--dev-root"] == ""
        assert args["--procfs-root"] == "/proc"
        # every other mount is read-only: sysfs pieces, nothing else
        rw = sorted(p for p, m in mounts.items() if not m.get("readOnly"))
        assert rw == ["/var/lib/kubelet/device-plugins"]
        assert sorted(p for p in mounts if p.startswith("/host/sys/")) == [
            "/host/sys/bus", "/host/sys/class", "/host/sys/devices", "/host/sys/module"
        ]
        for name, vol in volumes.items():
            if name.startswith("sys-"):
                assert vol["hostPath"]["path"] == "/sys/" + name[4:]
        assert "dev" not in volumes and "/host/dev" not in mounts
        assert "--cdi-dir" not in args and "/var/run/cdi" not in mounts


def test_cdi_mount_only_when_enabled() -> None:
    for ds in daemonsets(CASES["cdi"]).values():
        pod = ds["spec"]["template"]["spec"]
        container = pod["containers"][0]
        mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert _args(container)["--cdi-dir"] == "/var/run/cdi"
        assert mounts["/var/run/cdi"]["name"] == "cdi" and not mounts["/var/run/cdi"].get("readOnly")
        assert volumes["cdi"]["hostPath"] == {"path": "/etc/cdi", "type": "DirectoryOrCreate"}


def test_least_privilege_security_context() -> None:
    for ds in daemonsets({}).values():
        sc = ds["spec"]["template"]["spec"]["containers"][0]["securityContext"]
        assert sc["privileged"] is False
        assert sc["allowPrivilegeEscalation"] is False
        assert sc["readOnlyRootFilesystem"] is True
        assert sc["capabilities"] == {"drop": ["ALL"]}
        assert sc["seccompProfile"] == {"type": "RuntimeDefault"}
        assert sc["runAsUser"] == 0  # to create the socket in the root-owned device-plugins dir


def test_privileged_only_when_asked_and_stays_valid() -> None:
    for ds in daemonsets(CASES["exclusive-switch-on-everything"]).values():
        sc = ds["spec"]["template"]["spec"]["containers"][0]["securityContext"]
        assert sc["privileged"] is True
        assert "allowPrivilegeEscalation" not in sc  # Kubernetes rejects it false next to privileged


def test_security_context_overrides_merge() -> None:
    values = {"securityContext": {"seccompProfile": {"type": "Localhost", "localhostProfile": "rdma.json"}}}
    for ds in daemonsets(values).values():
        sc = ds["spec"]["template"]["spec"]["containers"][0]["securityContext"]
        assert sc["seccompProfile"] == {"type": "Localhost", "localhostProfile": "rdma.json"}
        assert sc["capabilities"] == {"drop": ["ALL"]}


def test_everything_case_wiring() -> None:
    values = CASES["exclusive-switch-on-everything"]
    objs = manifests(values)
    assert not by_kind(objs, "ServiceAccount")
    assert not [o for o in by_kind(objs, "Pod")]  # test.enabled=false
    for ds in daemonsets(values).values():
        pod = ds["spec"]["template"]["spec"]
        container = pod["containers"][0]
        assert pod["serviceAccountName"] == "existing"
        assert pod["imagePullSecrets"] == [{"name": "regcred"}]
        assert pod["nodeSelector"] == {"kubernetes.io/os": "linux"}
        assert container["image"] == "127.0.0.1:5000/rdma-device-plugin:dev"
        assert container["imagePullPolicy"] == "Always"
        assert container["env"][1:] == [{"name": "PYTHONUNBUFFERED", "value": "1"}]  # after POD_IP (metrics)
        assert _args(container)["--log-level"] == "debug" and _args(container)["--log-format"] == "json"
        assert ds["spec"]["template"]["metadata"]["annotations"]["example.com/a"] == "b"


def test_image_tag_defaults_to_app_version() -> None:
    """One version: the chart's appVersion is the plugin package's (the image role tags the image with it)."""
    chart_yaml = yaml.safe_load((CHART_DIR / "Chart.yaml").read_text())
    pyproject = tomllib.loads((CHART_DIR.parents[1] / "plugin_src" / "pyproject.toml").read_text())
    assert chart_yaml["appVersion"] == pyproject["project"]["version"]
    assert chart_yaml["version"] != chart_yaml["appVersion"]  # the chart has its own version
    for ds in daemonsets({}).values():
        assert ds["spec"]["template"]["spec"]["containers"][0]["image"].endswith(f":{chart_yaml['appVersion']}")
    for mode in ("shared", "exclusive"):  # the config says which plugin it is written for
        cm = one(manifests({}), "ConfigMap", f"-{mode}")
        assert yaml.safe_load(cm["data"]["config.yaml"])["pluginVersion"] == chart_yaml["appVersion"]


@pytest.mark.parametrize("tag", ["0.1.0", "v0.1.9", "0.0.3"])
def test_an_image_older_than_the_config_is_refused(tag: str) -> None:
    """Issue 31: chart 1.1.0's config met the 0.1.0 image and it crash-looped on "workloadEnv: unknown key"."""
    with pytest.raises(helm_python.HelmError) as err:
        render_raw({"image": {"tag": tag}})
    assert f"image.tag={tag} is older than the plugin this chart is made for (appVersion 0.2.0" in str(err.value)
    assert "leave image.tag empty" in str(err.value)


@pytest.mark.parametrize("tag", ["0.2.0", "0.2.7", "v0.3.0", "1.0.0", "dev", "latest", "0.2.0-rc.1"])
def test_an_image_of_this_or_a_newer_version_or_any_name_renders(tag: str) -> None:
    """A tag that is not a version (dev, latest) is checked by the plugin itself at start (pluginVersion)."""
    for ds in daemonsets({"image": {"tag": tag}}).values():
        assert ds["spec"]["template"]["spec"]["containers"][0]["image"].endswith(f":{tag}")


def test_image_digest_pins_the_pull_and_keeps_the_tag_label() -> None:
    digest = "sha256:" + "ab" * 32
    values = {"image": {"repository": "127.0.0.1:5000/rdma-device-plugin", "tag": "0.2.0", "digest": digest}}
    for ds in daemonsets(values).values():
        assert ds["spec"]["template"]["spec"]["containers"][0]["image"] == f"127.0.0.1:5000/rdma-device-plugin@{digest}"
        assert ds["metadata"]["labels"]["app.kubernetes.io/version"] == "0.2.0"


# ------------------------------------------------------------------ helm test pod


@pytest.mark.parametrize("case,host_network", [("defaults", True), ("non-hostnetwork", False), ("extra-resources", True)])
def test_helm_test_pod(case: str, host_network: bool) -> None:
    values = CASES[case]
    pod = one(manifests(values), "Pod", "-test-allocation")
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    spec = pod["spec"]
    assert spec["hostNetwork"] is host_network
    assert spec["restartPolicy"] == "Never"
    # it ends (Pending included) and asks for what it uses (issue 31)
    assert spec["activeDeadlineSeconds"] == 120
    container = spec["containers"][0]
    resource = values.get("resourceName", "rdma/hca")
    assert container["resources"] == {"requests": {"cpu": "50m", "memory": "64Mi"}, "limits": {"memory": "128Mi", resource: 1}}
    assert {"name": "RDMA_CHECK_MR_MIB", "value": "16"} in container["env"]
    assert {"name": "RDMA_CHECK_LOOPBACK", "value": "1"} in container["env"]
    assert "IPC_LOCK" in container["securityContext"]["capabilities"]["add"]
    script = container["command"][-1]
    for needle in ("RDMA_DEVICES", "pyverbs.device", "query_gid_table", "pyverbs.mr", "post_send"):
        assert needle in script


# ------------------------------------------------------------------ checksum


def _checksums(values: dict) -> dict[str, str]:
    return {m: ds["spec"]["template"]["metadata"]["annotations"]["checksum/config"] for m, ds in daemonsets(values).items()}


def test_checksum_is_the_hash_of_the_mounted_config() -> None:
    objs = manifests({})
    for mode, checksum in _checksums({}).items():
        cm = one(objs, "ConfigMap", f"-{mode}")
        text = cm["data"]["config.yaml"]
        assert hashlib.sha256(text.rstrip("\n").encode()).hexdigest() == checksum


@pytest.mark.parametrize(
    "change",
    [
        {"sharedDevices": 999},
        {"nonHostNetwork": {"enabled": True}},
        {"selectors": {"drivers": ["mlx5_core"]}},
        {"health": {"policy": "any"}},
        {"cdi": {"enabled": True, "runtimeEnabled": True}},
        {"resourceName": "rdma/hca2"},
    ],
)
def test_checksum_changes_with_config(change: dict) -> None:
    base, changed = _checksums({}), _checksums(change)
    assert base["shared"] != changed["shared"] and base["exclusive"] != changed["exclusive"]


@pytest.mark.parametrize(
    "change",
    [
        {"image": {"tag": "0.2.0"}},
        {"logLevel": "debug"},
        {"resources": {"limits": {"memory": "1Gi"}}},
        {"metrics": {"enabled": True}},
        {"tolerations": []},
        {"admissionPolicy": {"enabled": False}},
        {"kubeletDir": "/var/lib/rancher/k3s/agent/kubelet"},
    ],
)
def test_checksum_stable_without_config_change(change: dict) -> None:
    assert _checksums(change) == _checksums({})


def test_shared_and_exclusive_checksums_differ() -> None:
    sums = _checksums({})
    assert sums["shared"] != sums["exclusive"]


def test_notes_mention_checks() -> None:
    notes = render({})["rdma-device-plugin/templates/NOTES.txt"]
    assert "kubectl get node <node-name> -o yaml" in notes
    assert "rdma/hca: 1k" in notes
    assert "node-restriction.kubernetes.io/rdma-mode=exclusive" in notes
    assert "hostNetwork: true" in notes
    notes_on = render(CASES["non-hostnetwork"])["rdma-device-plugin/templates/NOTES.txt"]
    assert "nonHostNetwork.enabled=true" in notes_on


def test_issm_warns_that_a_pod_becomes_the_subnet_manager() -> None:
    """Issue 39: charDevices.issm lets every RDMA pod act as the InfiniBand subnet manager: the values
    comment, the schema's description (what editors show) and NOTES say so; NOTES only when it is on."""
    notes = {on: render({"charDevices": {"issm": on}})["rdma-device-plugin/templates/NOTES.txt"] for on in (True, False)}
    assert "WARNING: charDevices.issm=true" in notes[True] and "subnet manager" in notes[True]
    assert "issm" not in notes[False]
    schema = json.loads((CHART_DIR / "values.schema.json").read_text())
    assert "subnet manager" in schema["properties"]["charDevices"]["properties"]["issm"]["description"]
    values = (CHART_DIR / "values.yaml").read_text()
    assert "WARNING: with issm a pod can set the IsSM bit" in values
    assert "issm lets a pod act as the IB subnet manager" in (CHART_DIR.parents[1] / "docs" / "configuration.md").read_text()
