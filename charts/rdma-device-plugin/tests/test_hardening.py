"""Least privilege that holds (no host /dev, hostNetwork only when needed, metrics on the pod IP),
upgrades that do not break (immutable selectors, no chart-only restarts, two-render diffs), the helm
test pod, schema tightening, NOTES, and the bitnami/NVIDIA conventions users look for."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import helm_python
import pytest
import yaml
from conftest import CASES, CHART_DIR, MONITORING, VAP_KINDS, by_kind, daemonsets, manifests, one, parse, render, render_raw

README = (CHART_DIR / "README.md").read_text()
APP = yaml.safe_load((CHART_DIR / "Chart.yaml").read_text())["appVersion"]  # the default image tag
CHECK_SCRIPT = CHART_DIR / "files" / "rdma-check.py"


def _render_error(values: dict[str, Any]) -> str:
    with pytest.raises(helm_python.HelmError) as info:
        render(values)
    return str(info.value)


def _pod_spec(values: dict[str, Any], mode: str = "shared") -> dict[str, Any]:
    spec: dict[str, Any] = daemonsets(values)[mode]["spec"]["template"]["spec"]
    return spec


# ------------------------------------------------------------------ least privilege


@pytest.mark.parametrize("case", sorted(CASES))
def test_no_host_dev_mount(case: str) -> None:
    """A read-only bind of /dev is not recursive (/dev/shm, /dev/pts, /dev/mqueue stay writable) and
    never stops opening a device node for writing: the plugin reads char-device presence from sysfs."""
    for mode in ("shared", "exclusive"):
        spec = _pod_spec(CASES[case], mode)
        host_paths = [v["hostPath"]["path"] for v in spec["volumes"] if "hostPath" in v]
        assert not [p for p in host_paths if p == "/dev" or p.startswith("/dev/")], host_paths
        args = spec["containers"][0]["args"]
        assert args[args.index("--dev-root") + 1] == ""  # presence from sysfs, see cli.py


@pytest.mark.parametrize("case", sorted(CASES))
def test_host_mounts_are_only_what_the_plugin_uses(case: str) -> None:
    """Issue 39: every host path the device plugin mounts, and how: the kubelet's device-plugins dir
    (its socket, kubelet.sock), four read-only pieces of /sys, and only when their feature is on the
    CDI spec dir and the NFD features dir (written atomically: a temp file and a rename need the dir;
    the runtimes do not scan CDI subdirectories, so cdi.hostDir is the way to a dedicated one)."""
    values = CASES[case]
    for mode in ("shared", "exclusive"):
        spec = _pod_spec(values, mode)
        paths = {v["name"]: v["hostPath"]["path"] for v in spec["volumes"] if "hostPath" in v}
        mounts = {m["name"]: m for m in spec["containers"][0]["volumeMounts"]}
        # The kubelet's socket dir is /var/lib/kubelet/device-plugins whatever kubeletDir (its --root-dir) is.
        want = {"device-plugins": "/var/lib/kubelet/device-plugins", **{f"sys-{d}": f"/sys/{d}" for d in ("class", "devices", "bus", "module")}}
        if values.get("cdi", {}).get("enabled"):
            want["cdi"] = values["cdi"].get("hostDir", "/var/run/cdi")
        if values.get("nfd", {}).get("enabled"):
            want["nfd-features"] = "/etc/kubernetes/node-feature-discovery/features.d"
        assert paths == want, (case, mode)
        assert all(mounts[n].get("readOnly") is True for n in want if n.startswith("sys-"))
        assert all(not mounts[n].get("readOnly") for n in want if not n.startswith("sys-"))


@pytest.mark.parametrize("case,host_network", [("defaults", False), ("non-hostnetwork", True), ("metrics", False)])
def test_host_network_only_for_the_non_host_network_checks(case: str, host_network: bool) -> None:
    for mode in ("shared", "exclusive"):
        spec = _pod_spec(CASES[case], mode)
        assert spec.get("hostNetwork", False) is host_network
        assert spec.get("dnsPolicy") == ("ClusterFirstWithHostNet" if host_network else None)


@pytest.mark.parametrize("case", ["metrics", "exclusive-switch-on-everything"])
def test_metrics_bind_the_downward_api_pod_ip(case: str) -> None:
    for mode in ("shared", "exclusive"):
        container = _pod_spec(CASES[case], mode)["containers"][0]
        args = container["args"]
        address = args[args.index("--metrics-address") + 1]
        assert "0.0.0.0" not in address and re.fullmatch(r"\[\$\(POD_IP\)\]:\d+", address), address
        env = {e["name"]: e for e in container["env"]}
        assert env["POD_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
        # $(POD_IP) only expands when POD_IP is defined before any use
        assert [e["name"] for e in container["env"]].index("POD_IP") == 0


def test_pod_security_level_documented() -> None:
    assert "## Pod Security Admission" in README
    section = README.split("## Pod Security Admission", 1)[1].split("\n## ", 1)[0]
    for needle in ("kubectl label namespace <namespace> rdma.lingjun.io/tenant=true", "hostPath", "IPC_LOCK", "baseline",
                   "hostNetwork", "drops `ALL`", "docs/security.md"):
        assert needle in section, needle
    # issue 39: no longer "label RDMA namespaces privileged": the tenant label, and the policy behind it
    assert "enforce=privileged" not in section
    notes = render({})["rdma-device-plugin/templates/NOTES.txt"]
    assert "enforce=privileged" not in notes
    assert "kubectl label namespace <namespace> rdma.lingjun.io/tenant=true" in notes and "drop: [ALL], add: [IPC_LOCK]" in notes


# ------------------------------------------------------------------ upgrades

SELECTOR_KEYS = {"app.kubernetes.io/name", "app.kubernetes.io/instance", "app.kubernetes.io/component", "rdma.lingjun.io/mode"}


def test_selectors_use_only_fixed_chart_owned_labels() -> None:
    base = {m: ds["spec"]["selector"] for m, ds in daemonsets({}).items()}
    for mode, selector in base.items():
        assert set(selector["matchLabels"]) == SELECTOR_KEYS and selector["matchLabels"]["rdma.lingjun.io/mode"] == mode
    changed = {"modeLabelKey": "gpu.node-restriction.kubernetes.io/rdma-mode", "podLabels": {"team": "ml"}, "commonLabels": {"cost": "gpu"},
               "image": {"tag": "0.2.0"}, "mode": "exclusive"}
    assert {m: ds["spec"]["selector"] for m, ds in daemonsets(changed).items()} == base


def _chart_copy(tmp_path: Path, version: str) -> helm_python.Chart:
    dest = tmp_path / version / "rdma-device-plugin"
    shutil.copytree(CHART_DIR, dest, ignore=shutil.ignore_patterns("tests", "__pycache__"))
    chart_yaml = dest / "Chart.yaml"
    chart_yaml.write_text(re.sub(r"^version: .*$", f"version: {version}", chart_yaml.read_text(), flags=re.M))
    return helm_python.Chart.load(str(dest))


def _templates(objs: list[dict[str, Any]]) -> dict[str, Any]:
    return {o["metadata"]["name"]: o["spec"]["template"] for o in by_kind(objs, "DaemonSet")}


def test_chart_only_release_restarts_no_plugin_pod(tmp_path: Path) -> None:
    """A new chart version with the same values and appVersion leaves every pod template as it was, so
    `helm upgrade` rolls nothing; the chart version still labels the objects themselves."""
    old = parse(render_raw({}, chart=_chart_copy(tmp_path, "0.1.0")))
    new = parse(render_raw({}, chart=_chart_copy(tmp_path, "0.2.0")))
    assert _templates(old) == _templates(new)
    for template in _templates(new).values():
        assert "helm.sh/chart" not in template["metadata"]["labels"]
        assert "app.kubernetes.io/version" not in template["metadata"]["labels"]
    assert one(new, "DaemonSet", "-shared")["metadata"]["labels"]["helm.sh/chart"] == "rdma-device-plugin-0.2.0"


# What an upgrade with one changed value does to the running plugin pods: the DaemonSets whose pod
# template changes (each rolls node by node, updateStrategy maxUnavailable 1) and, for a change of node
# selection, every node whose DaemonSet changes at once. README "Upgrading" says the same, row by row.
UPGRADES: dict[str, tuple[dict[str, Any], set[str]]] = {
    "chart version only": ({}, set()),
    "image": ({"image": {"tag": "0.9.0"}}, {"shared", "exclusive"}),
    "plugin config": ({"sharedDevices": 500}, {"shared", "exclusive"}),
    "mode": ({"mode": "exclusive"}, {"shared", "exclusive"}),
    "affinity": ({"affinity": None}, {"shared", "exclusive"}),
    "modeLabelKey": ({"modeLabelKey": "gpu.node-restriction.kubernetes.io/rdma-mode"}, {"shared", "exclusive"}),
    "admission policy": ({"admissionPolicy": {"validationActions": ["Warn"]}}, set()),
    "metrics": ({"metrics": {"enabled": True}}, {"shared", "exclusive"}),
    "service monitor labels": ({"metrics": {"enabled": True, "serviceMonitor": {"enabled": True, "labels": {"a": "b"}}}}, {"shared", "exclusive"}),
    "helm test": ({"test": {"nodeSelector": {"a": "b"}}}, set()),
    "commonLabels": ({"commonLabels": {"cost": "gpu"}}, {"shared", "exclusive"}),
}


@pytest.mark.parametrize("change", sorted(UPGRADES))
def test_upgrade_rolls_only_what_changed(change: str) -> None:
    values, rolled = UPGRADES[change]
    before, after = daemonsets({}), daemonsets(values)
    assert {m for m in before if before[m]["spec"]["template"] != after[m]["spec"]["template"]} == rolled
    # the selectors never change, so no upgrade needs the DaemonSets deleted
    assert {m: d["spec"]["selector"] for m, d in before.items()} == {m: d["spec"]["selector"] for m, d in after.items()}


def test_service_monitor_labels_alone_roll_nothing() -> None:
    with_metrics = {"metrics": {"enabled": True, "serviceMonitor": {"enabled": True}}}
    relabelled = {"metrics": {"enabled": True, "serviceMonitor": {"enabled": True, "labels": {"release": "prom"}}}}
    assert _templates(manifests(with_metrics)) == _templates(manifests(relabelled))


def test_changing_mode_moves_every_unlabelled_node_at_once() -> None:
    """Documented, not avoided: unlabelled nodes follow `mode`, so changing it swaps the DaemonSet of
    every such node in one go (a DaemonSet deletes pods on nodes it no longer selects right away)."""
    from test_affinity import schedulable

    node = {"alibabacloud.com/lingjun-worker": "true"}
    before, after = daemonsets({}), daemonsets({"mode": "exclusive"})
    assert schedulable(before["shared"], node) and not schedulable(before["exclusive"], node)
    assert schedulable(after["exclusive"], node) and not schedulable(after["shared"], node)
    labelled = {**node, "node-restriction.kubernetes.io/rdma-mode": "shared"}
    assert schedulable(before["shared"], labelled) and schedulable(after["shared"], labelled)  # pinned nodes stay


def test_readme_upgrading_section_covers_every_kind_of_change() -> None:
    assert "## Upgrading" in README
    section = README.split("## Upgrading", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| ([^|]+?) \|", section, flags=re.M)
    assert set(UPGRADES) <= {r.strip() for r in rows}, rows
    assert "kubectl label node" in section and "--cascade=orphan" in section


# ------------------------------------------------------------------ helm test pod


@pytest.mark.parametrize("case", ["defaults", "non-hostnetwork"])
def test_helm_test_pod_lands_only_where_asked(case: str) -> None:
    pod = one(manifests(CASES[case]), "Pod", "-test-allocation")
    tolerations = pod["spec"]["tolerations"]
    assert tolerations == [{"key": "node-role.alibabacloud.com/lingjun", "operator": "Exists", "effect": "NoSchedule"}]
    assert "nodeSelector" not in pod["spec"]
    values = {**CASES[case], "test": {"nodeSelector": {"kubernetes.io/hostname": "gpu-7"}, "tolerations": []}}
    pod = one(manifests(values), "Pod", "-test-allocation")
    assert pod["spec"]["nodeSelector"] == {"kubernetes.io/hostname": "gpu-7"} and "tolerations" not in pod["spec"]


def test_helm_test_tolerations_cannot_tolerate_everything() -> None:
    for bad in ([{"operator": "Exists"}], [{"key": "node.kubernetes.io/unschedulable", "operator": "Exists"}]):
        message = _render_error({"test": {"tolerations": bad}})
        assert "test.tolerations" in message


def test_helm_test_pod_runs_the_verbs_check() -> None:
    pod = one(manifests({}), "Pod", "-test-allocation")
    container = pod["spec"]["containers"][0]
    assert container["command"][:2] == ["python3", "-c"]
    assert container["command"][2] == CHECK_SCRIPT.read_text()


# ------------------------------------------------------------------ schema


@pytest.mark.parametrize(
    "values,needle",
    [
        ({"securityContext": {"runAsUsr": 0}}, "/securityContext"),
        ({"securityContext": {"capabilities": {"ad": ["NET_ADMIN"]}}}, "/securityContext/capabilities"),
        ({"tolerations": [{"key": "a", "operator": "Exists", "efect": "NoSchedule"}]}, "/tolerations/0"),
        ({"affinity": {"nodeAfinity": {}}}, "/affinity"),
        ({"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerm": []}}}}, "/affinity/nodeAffinity"),
        ({"image": {"repository": "registry.example.com/rdma/rdma-device-plugin:0.1.0"}}, "/image/repository"),
        ({"image": {"repository": "registry.example.com/rdma/rdma-device-plugin@sha256:" + "a" * 64}}, "/image/repository"),
        ({"image": {"registry": "https://registry.example.com"}}, "/image/registry"),
        ({"fullnameOverride": "RDMA_plugin"}, "/fullnameOverride"),
        ({"nameOverride": "rdma."}, "/nameOverride"),
        ({"namespaceOverride": "Kube-System"}, "/namespaceOverride"),
        ({"podLabels": {"app.kubernetes.io/name": "x"}}, "invalid propertyName 'app.kubernetes.io/name'"),
        ({"podLabels": {"rdma.lingjun.io/mode": "exclusive"}}, "invalid propertyName 'rdma.lingjun.io/mode'"),
        ({"commonLabels": {"app.kubernetes.io/instance": "x"}}, "invalid propertyName 'app.kubernetes.io/instance'"),
        ({"extraVolumes": [{"name": "x", "hostpath": {"path": "/x"}}]}, "/extraVolumes/0"),
        ({"test": {"tolerations": [{"operator": "Exists", "efect": "NoSchedule"}]}}, "/test/tolerations/0"),
        # issue 31: resources are Kubernetes ResourceRequirements, quantities by Kubernetes' grammar
        ({"resources": {"limit": {"memory": "128Mi"}}}, "/resources"),
        ({"resources": {"limits": {"memory": "128MB"}}}, "/resources/limits/memory"),
        ({"resources": {"requests": {"memory": "1 Gi"}}}, "/resources/requests/memory"),
        ({"resources": {"requests": {"cpu": "-10m"}}}, "/resources/requests/cpu"),
        ({"resources": {"requests": {"cpu": -1}}}, "/resources/requests/cpu"),
        ({"resources": {"requests": {"cpu": "ten"}}}, "/resources/requests/cpu"),
        ({"resources": "64Mi"}, "/resources"),
        ({"test": {"resources": {"limits": {"memory": "128mb"}}}}, "/test/resources/limits/memory"),
        ({"minReadySeconds": -1}, "/minReadySeconds"),
        ({"test": {"activeDeadlineSeconds": 0}}, "/test/activeDeadlineSeconds"),
        ({"metrics": {"serviceMonitor": {"kind": "Probe"}}}, "/metrics/serviceMonitor/kind"),
        ({"metrics": {"serviceMonitor": {"serviceDiscoveryRole": "Pod"}}}, "/metrics/serviceMonitor/serviceDiscoveryRole"),
        ({"metrics": {"prometheusRule": {"portFlapping": {"window": "0m"}}}}, "/metrics/prometheusRule/portFlapping/window"),
        ({"metrics": {"prometheusRule": {"portErrors": {"perSecond": 0}}}}, "/metrics/prometheusRule/portErrors/perSecond"),
    ],
)
def test_schema_rejects(values: dict[str, Any], needle: str) -> None:
    message = _render_error(values)
    needle = needle if needle.startswith("invalid") else f"at '{needle}"
    assert "don't meet the specifications of the schema" in message and needle in message, message


@pytest.mark.parametrize(
    "values",
    [
        {"image": {"repository": "127.0.0.1:5000/rdma-device-plugin"}},
        {"image": {"repository": "rdma-device-plugin", "registry": "[fd00::1]:5000"}},
        {"securityContext": {"seccompProfile": {"type": "Localhost", "localhostProfile": "rdma.json"}, "runAsUser": 0}},
        {"tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule", "tolerationSeconds": None}]},
        {"fullnameOverride": "rdp-1", "nameOverride": "rdma"},
        {"podLabels": {"team": "ml", "app.kubernetes.io/part-of": "ml-platform"}},
        {"resources": {"requests": {"cpu": "0.05", "memory": "64Mi", "ephemeral-storage": "1Gi"}, "limits": {"memory": 134217728}}},
        {"resources": {"requests": {"cpu": 1, "memory": "1e9"}, "limits": {"cpu": "1500m", "memory": "2G"}}},
        {"resources": {}},
        {"test": {"resources": {"requests": {"cpu": "100m"}}}},
    ],
)
def test_schema_accepts(values: dict[str, Any]) -> None:
    render(values)


def test_schema_definitions_are_kubernetes_own() -> None:
    """securityContext/tolerations/affinity use the strict Kubernetes definitions, copied verbatim from
    kubernetes-validate's bundled schemas by scripts/sync-k8s-schema-defs.py (no drift)."""
    result = subprocess.run([sys.executable, str(CHART_DIR.parents[1] / "scripts" / "sync-k8s-schema-defs.py"), "--check"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_pod_labels_cannot_override_chart_labels_without_the_schema(tmp_path: Path) -> None:
    dest = tmp_path / "rdma-device-plugin"
    shutil.copytree(CHART_DIR, dest, ignore=shutil.ignore_patterns("tests", "__pycache__"))
    (dest / "values.schema.json").unlink()
    with pytest.raises(helm_python.HelmError) as info:
        render_raw({"podLabels": {"app.kubernetes.io/component": "x"}}, chart=helm_python.Chart.load(str(dest)))
    assert "podLabels" in str(info.value) and "app.kubernetes.io/component" in str(info.value)


# ------------------------------------------------------------------ NOTES


def test_notes_count_in_exclusive_mode_and_deployed_image() -> None:
    digest = "sha256:" + "cd" * 32
    values = {"mode": "exclusive", "image": {"repository": "rdma-device-plugin", "registry": "127.0.0.1:5000", "digest": digest}}
    notes = render(values)["rdma-device-plugin/templates/NOTES.txt"]
    image = daemonsets(values)["exclusive"]["spec"]["template"]["spec"]["containers"][0]["image"]
    assert f"Image: {image}" in notes and image == f"127.0.0.1:5000/rdma-device-plugin@{digest}"
    assert "1k" not in notes and "one per RDMA NIC" in notes
    shared = render({})["rdma-device-plugin/templates/NOTES.txt"]
    assert "rdma/hca: 1k" in shared and f"Image: registry.example.com/rdma/rdma-device-plugin:{APP}" in shared


# ------------------------------------------------------------------ conventions


def test_image_registry_and_global_image_registry() -> None:
    def image(values: dict[str, Any]) -> str:
        return str(daemonsets(values)["shared"]["spec"]["template"]["spec"]["containers"][0]["image"])

    # bitnami's common.images.image: global.imageRegistry overrides image.registry; the repository has no host
    assert image({}) == f"registry.example.com/rdma/rdma-device-plugin:{APP}"
    assert image({"global": {"imageRegistry": "mirror.corp:5000"}}) == f"mirror.corp:5000/rdma/rdma-device-plugin:{APP}"
    assert image({"image": {"repository": "rdma/plugin"}, "global": {"imageRegistry": "mirror.local"}}) == f"mirror.local/rdma/plugin:{APP}"
    assert image({"image": {"repository": "rdma/plugin", "registry": "own.local:5000"}, "global": {"imageRegistry": "mirror.local"}}) == f"mirror.local/rdma/plugin:{APP}"
    assert image({"image": {"repository": "rdma/plugin", "registry": ""}}) == f"rdma/plugin:{APP}"
    pod = one(manifests({"image": {"repository": "rdma/plugin", "registry": "own.local"}}), "Pod", "-test-allocation")
    assert pod["spec"]["containers"][0]["image"] == f"own.local/rdma/plugin:{APP}"
    # a repository that names its host (what the Ansible automation sets) is taken whole...
    for repo in ("127.0.0.1:5000/rdma-device-plugin", "localhost/rdma-device-plugin", "registry.corp/rdma/plugin"):
        assert image({"image": {"repository": repo}}) == f"{repo}:{APP}"
        # ...and cannot take a mirror: one clear error instead of "<mirror>/<host>/<path>"
        message = _render_error({"image": {"repository": repo}, "global": {"imageRegistry": "mirror.corp:5000"}})
        assert f"global.imageRegistry=mirror.corp:5000 cannot apply: image.repository={repo} starts with a registry host" in message
        assert "image.registry" in message


def test_common_labels_on_every_object() -> None:
    values = {"commonLabels": {"cost-center": "gpu"}, "metrics": {"enabled": True, "serviceMonitor": {"enabled": True}}}
    for obj in manifests(values):
        assert obj["metadata"]["labels"]["cost-center"] == "gpu", obj["kind"]
    for ds in daemonsets(values).values():
        assert ds["spec"]["template"]["metadata"]["labels"]["cost-center"] == "gpu"


def test_extra_volumes_and_mounts() -> None:
    values = {"extraVolumes": [{"name": "ca", "configMap": {"name": "ca-bundle"}}],
              "extraVolumeMounts": [{"name": "ca", "mountPath": "/etc/ssl/private-ca", "readOnly": True}]}
    spec = _pod_spec(values)
    assert {"name": "ca", "configMap": {"name": "ca-bundle"}} in spec["volumes"]
    assert {"name": "ca", "mountPath": "/etc/ssl/private-ca", "readOnly": True} in spec["containers"][0]["volumeMounts"]


def test_namespace_override() -> None:
    values = {"namespaceOverride": "rdma-system", "metrics": {"enabled": True, "serviceMonitor": {"enabled": True}}}
    for obj in manifests(values):
        if obj["kind"] in ("ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding", "ClusterRole", "ClusterRoleBinding"):
            assert "namespace" not in obj["metadata"]  # cluster-scoped
        else:
            assert obj["metadata"]["namespace"] == "rdma-system", obj["kind"]
    pm = one(manifests(values), "PodMonitor")
    assert pm["spec"]["namespaceSelector"] == {"matchNames": ["rdma-system"]}
    assert "-n rdma-system" in render(values)["rdma-device-plugin/templates/NOTES.txt"]



# ------------------------------------------------------------------ hostNetwork x nonHostNetwork x mode: README and NOTES true for each


def _combination_rows() -> list[dict[str, str]]:
    section = README.split("Every combination, for either `mode`", 1)[1].split("\n\n", 2)[1]
    lines = [line for line in section.splitlines() if line.startswith("|")]
    header = [c.strip().replace("`", "") for c in lines[0].strip("|").split("|")]
    return [dict(zip(header, (c.strip() for c in line.strip("|").split("|")))) for line in lines[2:]]


def test_readme_combination_table_has_every_row() -> None:
    rows = _combination_rows()
    assert sorted((r["hostNetwork"], r["nonHostNetwork.enabled"]) for r in rows) == [
        ("false", "false"), ("false", "true"), ("true", "false"), ("true", "true")]


@pytest.mark.parametrize("mode", ["shared", "exclusive"])
def test_readme_and_notes_true_for_every_combination(mode: str) -> None:
    """Each README row rendered: what it says of the plugin pods, RDMA pods and the NFD IPv6 label
    holds for the DaemonSets, the policy and NOTES of that combination."""
    for row in _combination_rows():
        host, nhn = row["hostNetwork"] == "true", row["nonHostNetwork.enabled"] == "true"
        values = {"mode": mode, "hostNetwork": host, "nonHostNetwork": {"enabled": nhn}}
        in_node_netns = row["plugin pods"] == "node's network namespace"
        assert in_node_netns or row["plugin pods"] == "pod network", row
        for ds in daemonsets(values).values():
            spec = ds["spec"]["template"]["spec"]
            assert spec.get("hostNetwork", False) is in_node_netns, row
        # the plugin writes the IPv6 label only when it sees the node's network namespace (nfd.py)
        assert (row["NFD rdma-ipv6-compute-ready"] == "written") is in_node_netns, row
        assert row["port changes noticed by"].startswith("link events" if in_node_netns else "polling"), row
        must_host = row["RDMA pods"] == "must use `hostNetwork: true`"
        assert must_host or row["RDMA pods"] == "may keep their own network namespace", row
        policy = one(manifests(values), "ValidatingAdmissionPolicy", "-rdma-pods")
        assert any("hostNetwork" in v["expression"] for v in policy["spec"]["validations"]) is must_host, row
        notes = render(values)["rdma-device-plugin/templates/NOTES.txt"]
        assert ("The plugin pods run in the node's network namespace (hostNetwork: true" in notes) is in_node_netns, row
        assert ("The plugin pods run in the pod network (hostNetwork: false)" in notes) is not in_node_netns, row
        assert ("the plugin pods (hostPath volumes, hostNetwork)" in notes) is in_node_netns, row
        assert ("RDMA works only for pods with hostNetwork: true" in notes) is must_host, row
        assert ("RDMA pods may keep their own network namespace" in notes) is not must_host, row
        assert f"default mode: {mode}" in notes


# ------------------------------------------------------------------ the metrics NetworkPolicy


PROMETHEUS = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]


def test_metrics_network_policy_admits_only_the_scrapers_on_the_metrics_port() -> None:
    """Issue 39: where NetworkPolicy applies (plugin pods in the pod network), only the listed peers
    reach the plugin pods, and only their metrics port; nothing of it by default."""
    import kubernetes_validate
    from conftest import kube_minor_versions

    assert not by_kind(manifests({"metrics": {"enabled": True}}), "NetworkPolicy")
    values = {"metrics": {"enabled": True, "port": 9500, "networkPolicy": {"enabled": True, "from": PROMETHEUS}}}
    objs = manifests(values)
    policy = one(objs, "NetworkPolicy", "-metrics")
    kubernetes_validate.validate(policy, kube_minor_versions()[-1], strict=True)
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    assert policy["spec"]["ingress"] == [{"from": PROMETHEUS, "ports": [{"port": 9500, "protocol": "TCP"}]}]
    selector = policy["spec"]["podSelector"]
    for ds in daemonsets(values).values():  # it selects the plugin pods of both modes
        labels = ds["spec"]["template"]["metadata"]["labels"]
        assert _selects(selector, labels), (selector, labels)
    test_pod = one(objs, "Pod", "-test-allocation")
    assert not _selects(selector, test_pod["metadata"].get("labels", {}))
    with_dra = _with_dra(values)  # the DRA driver's pods serve metrics on the same port: guarded too
    (policy,) = by_kind(with_dra, "NetworkPolicy")
    drivers = [d for d in by_kind(with_dra, "DaemonSet") if "dra" in d["metadata"]["name"]]
    assert drivers and all(_selects(policy["spec"]["podSelector"], d["spec"]["template"]["metadata"]["labels"]) for d in drivers)


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A LabelSelector's matchLabels and its In expressions (the kinds the chart writes)."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expr in selector.get("matchExpressions", []):
        assert expr["operator"] == "In", expr
        if labels.get(expr["key"]) not in expr["values"]:
            return False
    return True


@pytest.mark.parametrize(
    "values,needle",
    [
        ({"metrics": {"enabled": True, "networkPolicy": {"enabled": True}}}, "metrics.networkPolicy.from is empty"),
        ({"metrics": {"networkPolicy": {"enabled": True, "from": PROMETHEUS}}}, "needs metrics.enabled=true"),
        ({"hostNetwork": True, "metrics": {"enabled": True, "networkPolicy": {"enabled": True, "from": PROMETHEUS}}},
         "NetworkPolicy does not apply to host-network pods"),
        ({"nonHostNetwork": {"enabled": True}, "metrics": {"enabled": True, "networkPolicy": {"enabled": True, "from": PROMETHEUS}}},
         "NetworkPolicy does not apply to host-network pods"),
    ],
)
def test_metrics_network_policy_refused_where_it_cannot_work(values: dict[str, Any], needle: str) -> None:
    assert needle in _render_error(values)


# ------------------------------------------------------------------ metrics behind auth (issue 39)


AUTH_API = (*VAP_KINDS, *MONITORING, "resource.k8s.io/v1/DeviceClass")
TLS_DIR = "/etc/rdma-device-plugin-metrics-tls"
SERVER_NAME = "rdma-rdma-device-plugin-metrics.kube-system.svc"


def _with_dra(values: dict[str, Any]) -> list[dict[str, Any]]:
    """Both APIs rendered (the device plugin's DaemonSets and the DRA driver's) as on a v1.37 cluster."""
    return parse(render_raw({"driver": "dra", **values}, kube_version="v1.37.0", api_versions=AUTH_API))


def _pods(objs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {ds["metadata"]["name"]: ds["spec"]["template"]["spec"] for ds in by_kind(objs, "DaemonSet")}


def _flag(args: list[str], flag: str) -> str | None:
    return args[args.index(flag) + 1] if flag in args else None


def test_metrics_are_behind_auth_by_default() -> None:
    """With metrics on, every DaemonSet (both modes of the device plugin, the DRA driver) serves HTTPS
    and reviews tokens (flags the real CLI parses), mounts the serving certificate and a token; the
    chart's certificate names the metrics Service and is signed by its ca.crt; the reader ClusterRole
    reads /metrics only; the pods' account may create reviews (system:auth-delegator); the PodMonitor
    scrapes over HTTPS, verified, with the scraper's token."""
    import kubernetes_validate
    from cryptography import x509

    from rdma_device_plugin.cli import build_parser

    objs = _with_dra({"metrics": {"enabled": True, "serviceMonitor": {"enabled": True}}})
    pods = _pods(objs)
    assert len(pods) == 4, sorted(pods)  # shared, exclusive; each with its DRA driver
    for name, pod in pods.items():
        assert pod["automountServiceAccountToken"] is True, name
        args = pod["containers"][0]["args"]
        assert _flag(args, "--metrics-auth") == "kubernetes", name
        parsed = build_parser().parse_args(args)
        assert (parsed.metrics_tls_cert, parsed.metrics_tls_key) == (f"{TLS_DIR}/tls.crt", f"{TLS_DIR}/tls.key")
        mount = next(m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "metrics-tls")
        assert mount == {"name": "metrics-tls", "mountPath": TLS_DIR, "readOnly": True}
        volume = next(v for v in pod["volumes"] if v["name"] == "metrics-tls")
        assert volume["secret"]["secretName"] == "rdma-rdma-device-plugin-metrics-tls"
    secret = one(objs, "Secret", "-metrics-tls")
    assert secret["type"] == "kubernetes.io/tls"
    import base64

    cert = x509.load_pem_x509_certificate(base64.b64decode(secret["data"]["tls.crt"]))
    ca = x509.load_pem_x509_certificate(base64.b64decode(secret["data"]["ca.crt"]))
    assert cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(
        x509.DNSName
    ) == [SERVER_NAME]
    cert.verify_directly_issued_by(ca)
    assert one(objs, "ClusterRole", "-metrics-reader")["rules"] == [{"nonResourceURLs": ["/metrics"], "verbs": ["get"]}]
    delegator = one(objs, "ClusterRoleBinding", "-metrics-auth-delegator")
    assert delegator["roleRef"]["name"] == "system:auth-delegator"
    account = one(objs, "ServiceAccount", "-rdma-device-plugin")["metadata"]["name"]
    assert delegator["subjects"] == [{"kind": "ServiceAccount", "name": account, "namespace": "kube-system"}]
    scraper = {"kind": "ServiceAccount", "name": "rdma-rdma-device-plugin-metrics-scraper", "namespace": "kube-system"}
    assert one(objs, "ClusterRoleBinding", "-metrics-reader")["subjects"] == [scraper]
    token = one(objs, "Secret", "-metrics-scraper-token")
    assert token["type"] == "kubernetes.io/service-account-token"
    assert token["metadata"]["annotations"]["kubernetes.io/service-account.name"] == scraper["name"]
    endpoint = one(objs, "PodMonitor")["spec"]["podMetricsEndpoints"][0]
    assert endpoint["scheme"] == "https"
    assert endpoint["tlsConfig"] == {
        "ca": {"secret": {"name": "rdma-rdma-device-plugin-metrics-tls", "key": "ca.crt"}},
        "serverName": SERVER_NAME,
    }
    assert endpoint["authorization"] == {"type": "Bearer", "credentials": {"name": token["metadata"]["name"], "key": "token"}}
    for obj in objs:
        if obj["kind"] not in ("PodMonitor", "ServiceMonitor", "PrometheusRule"):
            kubernetes_validate.validate(obj, "1.37", strict=True)


def test_metrics_auth_off_is_plain_http_and_the_plugin_has_no_token() -> None:
    """metrics.auth.enabled=false (the documented risk) and metrics off: no auth flags, no certificate,
    no RBAC for metrics, and the device plugin's pods mount no token (the DRA driver needs its own)."""
    for metrics in ({"enabled": True, "serviceMonitor": {"enabled": True}, "auth": {"enabled": False}}, {}):
        objs = _with_dra({"metrics": metrics})
        for name, pod in _pods(objs).items():
            assert pod["automountServiceAccountToken"] is name.endswith("-dra"), name
            assert "--metrics-auth" not in pod["containers"][0]["args"]
            assert "metrics-tls" not in [v["name"] for v in pod["volumes"]]
        assert not [o["metadata"]["name"] for o in objs if "-metrics-" in o["metadata"]["name"]]
        for monitor in by_kind(objs, "PodMonitor"):
            assert "scheme" not in monitor["spec"]["podMetricsEndpoints"][0]


def test_metrics_auth_serves_your_certificate_and_binds_your_readers() -> None:
    """metrics.auth.tlsSecretName: no certificate of the chart's, the pods and the PodMonitor use yours;
    metrics.auth.readers: bound to the reader role as valid RBAC subjects."""
    import kubernetes_validate

    readers = [
        {"kind": "ServiceAccount", "name": "prometheus-k8s", "namespace": "monitoring"},
        {"kind": "User", "name": "alice"},
        {"kind": "Group", "name": "sre"},
    ]
    values = {"metrics": {"enabled": True, "auth": {"tlsSecretName": "cm-metrics", "readers": readers}}}
    objs = _with_dra({**values, "metrics": {**values["metrics"], "serviceMonitor": {"enabled": True}}})
    assert not [s["metadata"]["name"] for s in by_kind(objs, "Secret") if s["type"] == "kubernetes.io/tls"]
    for pod in _pods(objs).values():
        assert next(v for v in pod["volumes"] if v["name"] == "metrics-tls")["secret"]["secretName"] == "cm-metrics"
    endpoint = one(objs, "PodMonitor")["spec"]["podMetricsEndpoints"][0]
    assert endpoint["tlsConfig"]["ca"]["secret"]["name"] == "cm-metrics"
    binding = one(objs, "ClusterRoleBinding", "-metrics-reader")
    kubernetes_validate.validate(binding, "1.37", strict=True)
    group = "rbac.authorization.k8s.io"
    assert binding["subjects"][:3] == [
        readers[0],
        {"kind": "User", "name": "alice", "apiGroup": group},
        {"kind": "Group", "name": "sre", "apiGroup": group},
    ]
