"""playbooks/uninstall.yml on a cluster inventory: removes the mode and validation labels (and the
validated-at annotation) of every inventory node and the plugin's CDI specs (and the release),
supports --check, and changes nothing when helm cannot remove the release. The cluster is the
repository's Kubernetes API emulator (scripts/kube-emulator.py) on a free port; the nodes are local
connections with their own CDI directories."""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from conftest import ROOT, run_playbook

LABEL = "rdma.lingjun.io/mode"
VALIDATED = "rdma.lingjun.io/validated"
VALIDATED_AT = "rdma.lingjun.io/validated-at"
NODES = ("gpu-1", "gpu-2")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Path]:
    kubeconfig = tmp_path / "kubeconfig"
    emulator = [sys.executable, str(ROOT / "scripts/kube-emulator.py")]
    subprocess.run(
        [*emulator, "start", "--port", str(_free_port()), "--kubeconfig", str(kubeconfig)], check=True, timeout=120
    )
    try:
        from kubernetes import client, config

        api = client.CoreV1Api(config.new_client_from_config(str(kubeconfig)))
        for name in NODES:
            labels = {"kubernetes.io/hostname": name, LABEL: "exclusive", VALIDATED: "true"}
            meta = client.V1ObjectMeta(name=name, labels=labels, annotations={VALIDATED_AT: "2025-06-01T10:00:00Z"})
            api.create_node(client.V1Node(api_version="v1", kind="Node", metadata=meta))
        yield kubeconfig
    finally:
        subprocess.run([*emulator, "stop", "--kubeconfig", str(kubeconfig)], check=False, timeout=120)


def _labels(kubeconfig: Path) -> dict[str, dict[str, str]]:
    """Each node's labels and annotations, in one mapping."""
    from kubernetes import client, config

    api = client.CoreV1Api(config.new_client_from_config(str(kubeconfig)))
    nodes = {n: api.read_node(n).metadata for n in NODES}
    return {n: {**(m.labels or {}), **(m.annotations or {})} for n, m in nodes.items()}


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


def test_without_helm_nothing_is_removed(tmp_path: Path, inventory: Path, cluster: Path) -> None:
    result = run_playbook(
        "playbooks/uninstall.yml", "-i", str(inventory), "-e", "plugin_deploy_helm_binary=/nonexistent/helm"
    )
    assert result.returncode != 0
    assert "Install Helm 3.8 or later" in result.stdout and "Nothing was removed" in result.stdout
    assert all(labels[LABEL] == "exclusive" for labels in _labels(cluster).values())
    assert len(_cdi(tmp_path)) == 4


def test_check_then_uninstall(tmp_path: Path, inventory: Path, cluster: Path) -> None:
    before = _cdi(tmp_path)
    check = run_playbook(
        "playbooks/uninstall.yml", "-i", str(inventory), "--check", "-e", "plugin_uninstall_release=no"
    )
    assert check.returncode == 0, check.stdout[-3000:]
    out = " ".join(check.stdout.split())
    assert "--check: would remove the labels rdma.lingjun.io/mode and rdma.lingjun.io/validated" in out
    assert "from 2 node(s) (gpu-1, gpu-2)" in out
    assert "gpu-1: --check: would remove 1 CDI spec(s)" in out
    assert all(labels[LABEL] == "exclusive" and labels[VALIDATED] == "true" for labels in _labels(cluster).values())
    assert _cdi(tmp_path) == before

    real = run_playbook("playbooks/uninstall.yml", "-i", str(inventory), "-e", "plugin_uninstall_release=no")
    assert real.returncode == 0, real.stdout[-3000:]
    for labels in _labels(cluster).values():
        assert not {LABEL, VALIDATED, VALIDATED_AT} & set(labels) and labels["kubernetes.io/hostname"]
    assert _cdi(tmp_path) == ["gpu-1/cdi/nvidia.com-gpu.json", "gpu-2/cdi/nvidia.com-gpu.json"]

    again = run_playbook("playbooks/uninstall.yml", "-i", str(inventory), "-e", "plugin_uninstall_release=no")
    assert again.returncode == 0 and "changed=0" in again.stdout  # idempotent
