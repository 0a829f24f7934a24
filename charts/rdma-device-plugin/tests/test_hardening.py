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
from conftest import CASES, CHART_DIR, by_kind, daemonsets, manifests, one, parse, render, render_raw

README = (CHART_DIR / "README.md").read_text()
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
    for needle in ("pod-security.kubernetes.io/enforce=privileged", "hostPath", "IPC_LOCK", "baseline", "hostNetwork"):
        assert needle in section, needle
    notes = render({})["rdma-device-plugin/templates/NOTES.txt"]
    assert "pod-security.kubernetes.io/enforce=privileged" in notes


# ------------------------------------------------------------------ upgrades

SELECTOR_KEYS = {"app.kubernetes.io/name", "app.kubernetes.io/instance", "app.kubernetes.io/component", "rdma.lingjun.io/mode"}


def test_selectors_use_only_fixed_chart_owned_labels() -> None:
    base = {m: ds["spec"]["selector"] for m, ds in daemonsets({}).items()}
    for mode, selector in base.items():
        assert set(selector["matchLabels"]) == SELECTOR_KEYS and selector["matchLabels"]["rdma.lingjun.io/mode"] == mode
    changed = {"modeLabelKey": "example.com/rdma-mode", "podLabels": {"team": "ml"}, "commonLabels": {"cost": "gpu"},
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
    "image": ({"image": {"tag": "0.2.0"}}, {"shared", "exclusive"}),
    "plugin config": ({"sharedDevices": 500}, {"shared", "exclusive"}),
    "mode": ({"mode": "exclusive"}, {"shared", "exclusive"}),
    "affinity": ({"affinity": None}, {"shared", "exclusive"}),
    "modeLabelKey": ({"modeLabelKey": "example.com/rdma-mode"}, {"shared", "exclusive"}),
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
    labelled = {**node, "rdma.lingjun.io/mode": "shared"}
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


def _run_check(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(CHECK_SCRIPT), *args], env=env, capture_output=True, text=True, timeout=120)


def test_check_script_fails_per_device_without_rdma() -> None:
    """With Debian's real pyverbs (rdma-core 44) and no RDMA hardware, every device gets its own FAIL line."""
    if not Path("/usr/lib/python3/dist-packages/pyverbs").is_dir():
        pytest.skip("python3-pyverbs is not installed (make system-deps)")
    env = {"PATH": "/usr/bin:/bin", "RDMA_DEVICES": "mlx5_bond_0,mlx5_bond_1", "PYTHONPATH": "/usr/lib/python3/dist-packages"}
    result = _run_check(env)
    assert result.returncode == 1, result
    lines = [line for line in result.stdout.splitlines() if not line.startswith("env ")]  # the env comes first
    assert [line.split()[:2] for line in lines] == [["FAIL", "mlx5_bond_0:"], ["FAIL", "mlx5_bond_1:"]], result.stdout
    result = _run_check({"PATH": "/usr/bin:/bin"})
    assert result.returncode == 1 and "RDMA_DEVICES is not set" in result.stdout + result.stderr


# The verdict logic against pyverbs-shaped devices: attribute names and enum values as in rdma-core
# (IBV_PORT_ACTIVE 4, IBV_LINK_LAYER_INFINIBAND 1 / ETHERNET 2, IBV_GID_TYPE_ROCE_V2 2 in GIDEntry).
def _load_check() -> Any:
    import importlib.util

    spec = importlib.util.spec_from_file_location("rdma_check", CHECK_SCRIPT)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _Obj:
    def __init__(self, **kw: Any) -> None:
        self.__dict__.update(kw)


class _Ctx:
    def __init__(self, ports: list[tuple[int, int]], gids: list[tuple[int, int, str, int]]) -> None:
        self.ports, self.gids = ports, gids

    def query_device(self) -> Any:
        return _Obj(phys_port_cnt=len(self.ports))

    def query_port(self, port: int) -> Any:
        state, link = self.ports[port - 1]
        return _Obj(state=state, link_layer=link)

    def query_gid_table(self, max_entries: int) -> list[Any]:
        return [
            _Obj(port_num=p, gid_index=n, gid_type=t, gid_str=lambda g=g: g, ndev_ifindex=i)
            for n, (p, t, g, i) in enumerate(self.gids)
        ][:max_entries]


@pytest.mark.parametrize(
    "ctx,ok,needle",
    [
        (_Ctx([(4, 2)], [(1, 2, "2408:4000::11", 7)]), True, "RoCE v2 GID 2408:4000::11"),
        (_Ctx([(4, 2)], [(1, 1, "fe80::1", 7)]), False, "no routable RoCE v2 GID"),
        (_Ctx([(4, 2)], [(1, 2, "fe80::1", 7)]), False, "no routable RoCE v2 GID"),
        (_Ctx([(4, 2)], [(1, 2, "2408:4000::11", 0)]), False, "no routable RoCE v2 GID"),
        (_Ctx([(1, 2)], [(1, 2, "2408:4000::11", 7)]), False, "no ACTIVE port"),
        (_Ctx([(4, 1)], []), True, "InfiniBand"),
        (_Ctx([(1, 1), (4, 1)], []), True, "port 2 ACTIVE"),
    ],
)
def test_check_verdicts(ctx: _Ctx, ok: bool, needle: str) -> None:
    check = _load_check()
    good, line = check.verdict("mlx5_bond_0", lambda name: ctx)
    assert good is ok and line.startswith(("OK" if ok else "FAIL") + " mlx5_bond_0: ") and needle in line, line


LINGJUN_GIDS = [(1, 1, "fe80::1", 7), (1, 2, "fe80::1", 7), (1, 1, "2408:4000::11", 7), (1, 2, "2408:4000::11", 7)]


@pytest.mark.parametrize(
    "index,ok,needle",
    [
        (3, True, "NCCL_IB_GID_INDEX 3 = RoCE v2 GID 2408:4000::11 on "),
        (2, False, "NCCL_IB_GID_INDEX 2 is not a routable RoCE v2 GID on a netdev (2408:4000::11)"),  # RoCE v1
        (1, False, "NCCL_IB_GID_INDEX 1 is not a routable RoCE v2 GID on a netdev (fe80::1)"),  # link-local
        (9, False, "NCCL_IB_GID_INDEX 9 is not a routable RoCE v2 GID on a netdev (empty)"),
    ],
)
def test_check_verdicts_with_the_plugins_gid_index(index: int, ok: bool, needle: str) -> None:
    """issue 23: with NCCL_IB_GID_INDEX set, the GID at that index is the one that must work."""
    good, line = _load_check().verdict("mlx5_bond_0", lambda name: _Ctx([(4, 2)], LINGJUN_GIDS), index)
    assert good is ok and needle in line, line


def test_check_prints_the_env_the_plugin_gave_the_pod() -> None:
    env = {
        "PATH": "/usr/bin:/bin",
        "RDMA_DEVICES": "mlx5_bond_0",
        "NCCL_IB_HCA": "=mlx5_bond_0",
        "NCCL_IB_GID_INDEX": "3",
        "UCX_NET_DEVICES": "mlx5_bond_0:1",
        "OTHER": "x",
    }
    lines = _run_check(env).stdout.splitlines()
    assert lines[:4] == [
        "env NCCL_IB_GID_INDEX=3",
        "env NCCL_IB_HCA==mlx5_bond_0",
        "env RDMA_DEVICES=mlx5_bond_0",
        "env UCX_NET_DEVICES=mlx5_bond_0:1",
    ]
    assert not any("OTHER" in line for line in lines)


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
    assert "rdma/hca: 1k" in shared and "Image: registry.example.com/rdma/rdma-device-plugin:0.1.0" in shared


# ------------------------------------------------------------------ conventions


def test_image_registry_and_global_image_registry() -> None:
    def image(values: dict[str, Any]) -> str:
        return str(daemonsets(values)["shared"]["spec"]["template"]["spec"]["containers"][0]["image"])

    # bitnami's common.images.image: global.imageRegistry overrides image.registry; the repository has no host
    assert image({}) == "registry.example.com/rdma/rdma-device-plugin:0.1.0"
    assert image({"global": {"imageRegistry": "mirror.corp:5000"}}) == "mirror.corp:5000/rdma/rdma-device-plugin:0.1.0"
    assert image({"image": {"repository": "rdma/plugin"}, "global": {"imageRegistry": "mirror.local"}}) == "mirror.local/rdma/plugin:0.1.0"
    assert image({"image": {"repository": "rdma/plugin", "registry": "own.local:5000"}, "global": {"imageRegistry": "mirror.local"}}) == "mirror.local/rdma/plugin:0.1.0"
    assert image({"image": {"repository": "rdma/plugin", "registry": ""}}) == "rdma/plugin:0.1.0"
    pod = one(manifests({"image": {"repository": "rdma/plugin", "registry": "own.local"}}), "Pod", "-test-allocation")
    assert pod["spec"]["containers"][0]["image"] == "own.local/rdma/plugin:0.1.0"
    # a repository that names its host (what the Ansible automation sets) is taken whole...
    for repo in ("127.0.0.1:5000/rdma-device-plugin", "localhost/rdma-device-plugin", "registry.corp/rdma/plugin"):
        assert image({"image": {"repository": repo}}) == f"{repo}:0.1.0"
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
        if obj["kind"] in ("ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"):
            assert "namespace" not in obj["metadata"]  # cluster-scoped
        else:
            assert obj["metadata"]["namespace"] == "rdma-system", obj["kind"]
    sm = one(manifests(values), "ServiceMonitor")
    assert sm["spec"]["namespaceSelector"] == {"matchNames": ["rdma-system"]}
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
