"""The node labels that steer the plugin, on the real kube-apiserver v1.37.2 with NodeRestriction
(scripts/kube_cluster.py enables it, as kubeadm does): a kubelet's own credential cannot set them on
its own Node, which is why they live under node-restriction.kubernetes.io/ (docs/security.md); the
old rdma.lingjun.io/ keys it could set. The cluster deploy moves a running release from the old
keys to the new ones without a node leaving a DaemonSet on the way."""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import ROOT, run_playbook

sys.path.insert(0, str(ROOT / "scripts"))
pytest.register_assert_rewrite("kube_pytest")
from kube_cluster import kubeconfig  # noqa: E402
from kube_pytest import Kube, wait_for  # noqa: E402
from real_node import _node_cert  # noqa: E402

pytest_plugins = ["kube_pytest"]

CHART = ROOT / "charts" / "rdma-device-plugin"
VALUES = yaml.safe_load((CHART / "values.yaml").read_text())
# The chart's keys, from its values (the one place they are spelled for the chart).
KEYS = {
    "mode": VALUES["modeLabelKey"],
    "driver": VALUES["driverLabelKey"],
    "validated": VALUES["validation"]["labelKey"],
}
LEGACY = {"mode": "rdma.lingjun.io/mode", "driver": "rdma.lingjun.io/driver", "validated": "rdma.lingjun.io/validated"}
# main before the keys moved (chart 3.0.0 unreleased, the 2.x keys): the release an upgrade starts from.
OLD_CHART = ROOT / "tests" / "data" / "rdma-device-plugin-3.0.0-pre.eb24925.tgz"
NS = "kube-system"
RDMA = {"feature.node.kubernetes.io/pci-15b3.present": "true"}


def test_the_roles_pass_the_charts_keys() -> None:
    """The roles' defaults are the chart's (the deploy passes them as values), and their legacy keys
    are the old ones this file's migration test starts from."""
    defaults = yaml.safe_load((ROOT / "roles/rdma_node_facts/defaults/main.yml").read_text())
    assert {k: defaults[f"rdma_{k}_label_key"] for k in KEYS} == KEYS
    assert sorted(defaults["rdma_legacy_label_keys"]) == sorted(LEGACY.values())
    template = (ROOT / "roles/plugin_deploy/templates/values.yaml.j2").read_text()
    for value, var in (("modeLabelKey", "mode"), ("driverLabelKey", "driver"), ("labelKey", "validated")):
        assert f"{value}: {{{{ rdma_{var}_label_key | to_json }}}}" in template


def _as_kubelet(kube: Kube, tmp_path: Path, node: str) -> Callable[..., subprocess.CompletedProcess[str]]:
    """kubectl with the credential a kubelet of ``node`` holds: a client certificate of
    system:node:<node> in system:nodes, signed by the cluster's CA."""
    pki = Path(kube.cluster.dir) / "pki"
    _node_cert(pki, tmp_path, node)
    kc = tmp_path / "kubelet.kubeconfig"
    cert, key = tmp_path / "kubelet-client.crt", tmp_path / "kubelet-client.key"
    kc.write_text(kubeconfig(kube.cluster.server(), pki, cert, key))

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(kube.bin / "kubectl"), f"--kubeconfig={kc}", *args],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )

    return run


def test_a_kubelet_cannot_label_its_own_node_validated(kube: Kube, tmp_path: Path) -> None:
    """The forge attempt: a kubelet credential setting each steering label on its own Node is refused
    (403, the message names the label); the same credential setting the old keys is admitted, which
    is why they moved."""
    node = "forge-node"
    kube.kubectl(
        "create", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "Node", "metadata": {"name": node}})
    )
    try:
        kubelet = _as_kubelet(kube, tmp_path, node)
        who = json.loads(kubelet("auth", "whoami", "-o", "json").stdout)["status"]["userInfo"]
        assert who["username"] == f"system:node:{node}" and "system:nodes" in who["groups"]
        for what, key in KEYS.items():
            assert key.startswith("node-restriction.kubernetes.io/"), key
            value = {"mode": "exclusive", "driver": "dra", "validated": "true"}[what]
            r = kubelet("label", "node", node, f"{key}={value}", "-v=6")
            assert r.returncode != 0, r.stdout
            assert "403 Forbidden" in r.stderr and "is not allowed to modify labels" in r.stderr and key in r.stderr, (
                r.stderr
            )
        labels = kube.get("node", node)["metadata"].get("labels", {})
        assert not set(KEYS.values()) & set(labels), labels
        # The old keys: a kubelet sets them on its own Node at will.
        r = kubelet("label", "node", node, *(f"{k}=true" for k in LEGACY.values()))
        assert r.returncode == 0, r.stderr
        labels = kube.get("node", node)["metadata"]["labels"]
        assert all(labels[k] == "true" for k in LEGACY.values()), labels
        # The chart refuses to select on a key a kubelet could set.
        render = kube.helm(
            "template", "x", str(CHART), "--set", f"validation.labelKey={LEGACY['validated']}", check=False
        )
        assert render.returncode != 0
        assert (
            f"validation.labelKey={LEGACY['validated']}: a kubelet can set this label on its own Node" in render.stderr
        )
    finally:
        kube.kubectl("delete", "node", node, "--ignore-not-found", check=False)


def _old_chart(tmp_path: Path) -> Path:
    """The chart as main had it before the keys moved (eb24925, packaged by `helm package --version
    3.0.0-pre.eb24925`: a committed file, so that a shallow clone runs this test too)."""
    with tarfile.open(OLD_CHART) as tar:
        tar.extractall(tmp_path / "old", filter="data")
    chart = tmp_path / "old" / "rdma-device-plugin"
    assert yaml.safe_load((chart / "values.yaml").read_text())["modeLabelKey"] == LEGACY["mode"]
    return chart


def _placed(kube: Kube) -> dict[str, str]:
    """node -> mode of the DaemonSet whose plugin pod is bound there."""
    pods = kube.get("pods", "-n", NS, "-l", "app.kubernetes.io/component=device-plugin")["items"]
    return {
        p["spec"]["nodeName"]: p["metadata"]["ownerReferences"][0]["name"].rsplit("-", 1)[1]
        for p in pods
        if p["spec"].get("nodeName") and not p["metadata"].get("deletionTimestamp")
    }


def test_the_deploy_moves_a_running_release_to_the_new_keys(
    kube: Kube, kube_nodes: Callable[..., Any], tmp_path: Path
) -> None:
    """A release of the old chart with validation.required selects its nodes by the old labels;
    playbooks/deploy.yml (an admin's credential) copies them to the new keys, upgrades, then removes the
    old ones. Every node keeps its plugin and its mode through it (the DaemonSets' desired counts, watched
    for the whole run, never drop), a node whose new label already says false keeps that verdict, and
    no old key is left."""
    nodes = {
        "mig-shared": {**RDMA, LEGACY["validated"]: "true"},
        "mig-exclusive": {**RDMA, LEGACY["validated"]: "true", LEGACY["mode"]: "exclusive"},
        "mig-failed": {**RDMA, LEGACY["validated"]: "false"},
        # validate (new collection) ran before the deploy and found it failing: the new key wins
        "mig-revalidated": {**RDMA, LEGACY["validated"]: "true", KEYS["validated"]: "false"},
    }
    for name, labels in nodes.items():
        kube_nodes(name, labels=labels).start()
    values = tmp_path / "old-values.json"
    values.write_text(json.dumps({"image": {"registry": "127.0.0.1:5000"}, "validation": {"required": True}}))
    kube.helm("upgrade", "--install", "rdma", str(_old_chart(tmp_path)), "-n", NS, "-f", str(values))
    watch = None
    try:
        before = {"mig-shared": "shared", "mig-exclusive": "exclusive", "mig-revalidated": "shared"}
        assert wait_for(lambda: _placed(kube) == before, timeout=90), _placed(kube)
        inventory = tmp_path / "inventory.yml"
        hosts = {n: {"ansible_connection": "local", "ansible_python_interpreter": sys.executable} for n in nodes}
        inventory.write_text(
            yaml.safe_dump(
                {
                    "all": {
                        "children": {"rdma_nodes": {"hosts": hosts}},
                        "vars": {
                            "rdma_kubeconfig": str(kube.cluster.kubeconfig),
                            "rdma_plugin_image_repository": "127.0.0.1:5000/rdma/rdma-device-plugin",
                            "rdma_output_dir": str(tmp_path / "out"),
                            "plugin_image_enabled": False,
                            "plugin_deploy_helm_binary": str(kube.bin / "helm"),
                        },
                    }
                }
            )
        )
        watch = subprocess.Popen(
            [
                str(kube.bin / "kubectl"),
                f"--kubeconfig={kube.cluster.kubeconfig}",
                "-n",
                NS,
                "get",
                "daemonsets",
                "-l",
                "app.kubernetes.io/instance=rdma",
                "--watch",
                "-o",
                "jsonpath={.metadata.name} {.status.desiredNumberScheduled}{'\\n'}",
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        run = run_playbook("playbooks/deploy.yml", "-i", str(inventory))
        assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
        after = {"mig-shared": "shared", "mig-exclusive": "exclusive"}
        assert wait_for(lambda: _placed(kube) == after, timeout=90), _placed(kube)
    finally:
        if watch:
            watch.terminate()
        kube.helm("uninstall", "rdma", "-n", NS, "--wait", "--timeout", "120s", check=False)
    out = watch.communicate(timeout=30)[0]
    seen = [line.split() for line in out.splitlines() if line.strip()]
    assert len(seen) >= 2, out
    # The nodes that keep their plugin (mig-revalidated loses it: its new label says false) are
    # selected by every DaemonSet the cluster had on the way.
    for name, *desired in seen:
        mode = name.rsplit("-", 1)[1]
        assert int((desired or ["0"])[0]) >= sum(1 for m in after.values() if m == mode), (name, desired, out)
    for name in nodes:
        labels = kube.get("node", name)["metadata"]["labels"]
        assert not set(LEGACY.values()) & set(labels), labels
    new = {n: {k: v for k, v in kube.get("node", n)["metadata"]["labels"].items() if k in KEYS.values()} for n in nodes}
    assert new == {
        "mig-shared": {KEYS["validated"]: "true"},
        "mig-exclusive": {KEYS["validated"]: "true", KEYS["mode"]: "exclusive"},
        "mig-failed": {KEYS["validated"]: "false"},
        "mig-revalidated": {KEYS["validated"]: "false"},
    }
