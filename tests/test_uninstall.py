"""playbooks/uninstall.yml on a cluster inventory: removes the mode and validation labels (and the
validated-at annotation) of every inventory node and the plugin's CDI specs (and the Helm release),
supports --check, and changes nothing when helm cannot remove the release. The cluster is a real one
(kube-apiserver v1.37.2 of `make kube`, scripts/kube_pytest.py): its nodes join it (kubelet-managers)
with the labels validate and switch-mode give them, the release is installed by the Helm v4 built
beside it; the Ansible side of each node is a local connection with its own CDI directory."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import ROOT, run_playbook

sys.path.insert(0, str(ROOT / "scripts"))
pytest.register_assert_rewrite("kube_pytest")
from kube_pytest import Kube  # noqa: E402

pytest_plugins = ["kube_pytest"]

LABEL = "node-restriction.kubernetes.io/rdma-mode"
VALIDATED = "node-restriction.kubernetes.io/rdma-validated"
VALIDATED_AT = "rdma.lingjun.io/validated-at"
NODES = ("gpu-1", "gpu-2")


@pytest.fixture
def cluster(kube: Kube, kube_nodes: Callable[..., Any]) -> Path:
    """The nodes joined, labelled exclusive and validated (with the validated-at annotation)."""
    for name in NODES:
        kube_nodes(name, labels={LABEL: "exclusive", VALIDATED: "true"}).start()
        kube.kubectl("annotate", "node", name, f"{VALIDATED_AT}=2025-06-01T10:00:00Z", "--overwrite")
    return Path(kube.cluster.kubeconfig)


def _labels(kube: Kube) -> dict[str, dict[str, str]]:
    """Each node's labels and annotations, in one mapping."""
    nodes = {n: kube.get("node", n)["metadata"] for n in NODES}
    return {n: {**m.get("labels", {}), **m.get("annotations", {})} for n, m in nodes.items()}


@pytest.fixture
def inventory(tmp_path: Path, cluster: Path) -> Path:
    hosts = {}
    for name in NODES:
        cdi = tmp_path / name / "cdi"
        cdi.mkdir(parents=True)
        (cdi / "rdma.lingjun.io-hca.json").write_text("{}")
        (cdi / "nvidia.com-gpu.json").write_text("{}")  # another vendor's spec stays
        hosts[name] = {
            "ansible_connection": "local",
            "ansible_python_interpreter": sys.executable,
            "rdma_cdi_dir": str(cdi),
        }
    inv = tmp_path / "inventory.yml"
    inv.write_text(
        yaml.safe_dump(
            {"all": {"children": {"rdma_nodes": {"hosts": hosts}}, "vars": {"rdma_kubeconfig": str(cluster)}}}
        )
    )
    return inv


def _cdi(tmp_path: Path) -> list[str]:
    return sorted(str(p.relative_to(tmp_path)) for p in tmp_path.glob("*/cdi/*.json"))


def test_without_helm_nothing_is_removed(tmp_path: Path, inventory: Path, kube: Kube) -> None:
    result = run_playbook(
        "playbooks/uninstall.yml", "-i", str(inventory), "-e", "plugin_deploy_helm_binary=/nonexistent/helm"
    )
    assert result.returncode != 0
    assert "Install Helm 3.8 or later" in result.stdout and "Nothing was removed" in result.stdout
    assert all(labels[LABEL] == "exclusive" for labels in _labels(kube).values())
    assert len(_cdi(tmp_path)) == 4


def test_check_then_uninstall(tmp_path: Path, inventory: Path, kube: Kube) -> None:
    before = _cdi(tmp_path)
    check = run_playbook(
        "playbooks/uninstall.yml", "-i", str(inventory), "--check", "-e", "plugin_uninstall_release=no"
    )
    assert check.returncode == 0, check.stdout[-3000:]
    out = " ".join(check.stdout.split())
    assert f"--check: would remove the labels {LABEL} and {VALIDATED}" in out
    assert "from 2 node(s) (gpu-1, gpu-2)" in out
    assert "gpu-1: --check: would remove 1 CDI spec(s)" in out
    assert all(labels[LABEL] == "exclusive" and labels[VALIDATED] == "true" for labels in _labels(kube).values())
    assert _cdi(tmp_path) == before

    real = run_playbook("playbooks/uninstall.yml", "-i", str(inventory), "-e", "plugin_uninstall_release=no")
    assert real.returncode == 0, real.stdout[-3000:]
    for labels in _labels(kube).values():
        assert not {LABEL, VALIDATED, VALIDATED_AT} & set(labels) and labels["kubernetes.io/hostname"]
    assert _cdi(tmp_path) == ["gpu-1/cdi/nvidia.com-gpu.json", "gpu-2/cdi/nvidia.com-gpu.json"]

    again = run_playbook("playbooks/uninstall.yml", "-i", str(inventory), "-e", "plugin_uninstall_release=no")
    assert again.returncode == 0 and "changed=0" in again.stdout  # idempotent


def test_uninstall_removes_the_helm_release(tmp_path: Path, inventory: Path, kube: Kube) -> None:
    """The release installed by the real Helm (v4) is uninstalled by it: --check leaves it, the run
    removes it (its DaemonSets are gone), a second run finds nothing to do."""
    values = tmp_path / "values.json"
    values.write_text('{"image": {"registry": "127.0.0.1:5000"}}')
    kube.helm(
        "upgrade", "--install", "rdma", str(ROOT / "charts/rdma-device-plugin"), "-n", "kube-system", "-f", str(values)
    )
    helm = ["-e", f"plugin_deploy_helm_binary={kube.bin / 'helm'}"]
    try:
        check = run_playbook("playbooks/uninstall.yml", "-i", str(inventory), "--check", *helm)
        assert check.returncode == 0, check.stdout[-3000:]
        assert "--check: would remove release rdma," in " ".join(check.stdout.split())
        assert kube.helm("history", "rdma", "-n", "kube-system", check=False).returncode == 0

        real = run_playbook("playbooks/uninstall.yml", "-i", str(inventory), *helm)
        assert real.returncode == 0, real.stdout[-3000:]
        gone = kube.helm("history", "rdma", "-n", "kube-system", check=False)
        assert gone.returncode != 0 and "not found" in gone.stderr
        daemonsets = kube.get("daemonsets", "-n", "kube-system", "-l", "app.kubernetes.io/instance=rdma")["items"]
        assert daemonsets == []
        assert all(not {LABEL, VALIDATED} & set(labels) for labels in _labels(kube).values())

        again = run_playbook("playbooks/uninstall.yml", "-i", str(inventory), *helm)
        assert again.returncode == 0 and "changed=0" in again.stdout, again.stdout[-3000:]
    finally:
        kube.helm("uninstall", "rdma", "-n", "kube-system", "--wait", "--timeout", "120s", check=False)
