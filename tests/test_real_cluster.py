"""The local control plane of upstream Kubernetes (`make cluster-up` / `make cluster-down`) and the
whole path a user relies on, end to end on the real components: `helm install` -> the DaemonSet
controller and the scheduler place the plugin on a node -> the node (kubelet-managers: the kubelet's
own device and Topology managers) runs the plugin from the rendered ConfigMap -> the Node
advertises rdma/hca -> a pod asking for rdma/hca: 1 is scheduled by the real scheduler and admitted
with the devices and env of the fixture node's NICs."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
from kube_cluster import Cluster, ClusterError, kube_bin  # noqa: E402

pytest.register_assert_rewrite("kube_pytest")
from kube_pytest import PLUGIN_IMAGES, Kube, wait_for  # noqa: E402

pytest_plugins = ["kube_pytest"]

PY = str(ROOT / ".venv" / "bin" / "python")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}").exists() and "zombie" not in Path(f"/proc/{pid}/status").read_text().lower()


def test_cluster_up_serves_v1_37_and_down_leaves_no_process() -> None:
    d = Path(tempfile.mkdtemp(prefix="kc-cli-", dir="/tmp"))
    cli = [PY, str(ROOT / "scripts" / "kube_cluster.py")]
    try:
        up = subprocess.run([*cli, "up", "--no-build", "--dir", str(d)], capture_output=True, text=True, timeout=300)
        assert up.returncode == 0, up.stdout + up.stderr
        assert f"export KUBECONFIG={os.path.relpath(d / 'kubeconfig')}" in up.stdout
        state = json.loads((d / "state.json").read_text())
        pids = {n: p["pid"] for n, p in state["processes"].items()}
        assert sorted(pids) == ["etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler"]
        assert all(_alive(p) for p in pids.values())
        version = subprocess.run(
            [str(kube_bin() / "kubectl"), "version", "-o", "json"],
            env={**os.environ, "KUBECONFIG": str(d / "kubeconfig")},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert json.loads(version.stdout)["serverVersion"]["gitVersion"] == "v1.37.2", version.stderr
        again = subprocess.run([*cli, "up", "--no-build", "--dir", str(d)], capture_output=True, text=True, timeout=60)
        assert again.returncode == 1 and "make cluster-down" in again.stderr
        down = subprocess.run([*cli, "down", "--dir", str(d)], capture_output=True, text=True, timeout=120)
        assert down.returncode == 0 and "no process of it is left" in down.stdout, down.stdout + down.stderr
        assert not any(_alive(p) for p in pids.values())
        status = subprocess.run([*cli, "status", "--dir", str(d)], capture_output=True, text=True, timeout=60)
        assert status.returncode == 3 and "make cluster-up" in status.stdout
    finally:
        Cluster(d).down()
        subprocess.run(["rm", "-rf", str(d)], check=False)


def test_a_failed_start_leaves_no_process() -> None:
    """kube-apiserver refuses an unknown feature gate and exits: etcd, already started, is stopped."""
    d = Path(tempfile.mkdtemp(prefix="kc-bad-", dir="/tmp"))
    c = Cluster(d, bin=kube_bin(), feature_gates={"NoSuchGateForTheTest": True}, ready_timeout=120)
    try:
        with pytest.raises(ClusterError, match="kube-apiserver exited"):
            c.up()
        state = json.loads((d / "state.json").read_text())
        assert "etcd" in state["processes"]
        assert not any(_alive(p["pid"]) for p in state["processes"].values())
    finally:
        c.down()
        subprocess.run(["rm", "-rf", str(d)], check=False)


def _fixture_nics(root: Path) -> list[str]:
    out = subprocess.run(
        [
            str(ROOT / ".venv" / "bin" / "rdma-device-plugin"),
            "discover",
            "--sysfs-root",
            str(root / "sys"),
            "--dev-root",
            str(root / "dev"),
            "-o",
            "json",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    data = json.loads(out.stdout)
    nics = data["nics"] if isinstance(data, dict) else data
    return sorted(n["name"] for n in nics)


def test_helm_install_to_an_admitted_rdma_pod(kube: Kube, kube_nodes: Any) -> None:
    node = kube_nodes("gpu-e2e", labels={"feature.node.kubernetes.io/pci-15b3.present": "true"}, images=PLUGIN_IMAGES)
    subprocess.run(
        [str(ROOT / ".venv" / "bin" / "rdma-device-plugin"), "fixture", str(node.root)], check=True, capture_output=True
    )
    nics = _fixture_nics(node.root)
    assert len(nics) == 4
    node.start()
    values = Path(node.root) / "values.json"
    chart = yaml.safe_load((ROOT / "charts" / "rdma-device-plugin" / "Chart.yaml").read_text())
    values.write_text(json.dumps({"image": {"registry": "127.0.0.1:5000", "tag": chart["appVersion"]}}))
    kube.helm(
        "upgrade",
        "--install",
        "rdma",
        str(ROOT / "charts" / "rdma-device-plugin"),
        "-n",
        "kube-system",
        "-f",
        str(values),
    )
    try:

        def advertised() -> str:
            n = kube.get("node", "gpu-e2e")
            return str(n["status"].get("allocatable", {}).get("rdma/hca", ""))

        assert wait_for(lambda: advertised() == "1k", timeout=120), (advertised(), _plugin_log(kube, node))
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "nccl-test", "namespace": "default"},
            "spec": {
                "hostNetwork": True,
                "restartPolicy": "Never",
                "containers": [
                    {
                        "name": "main",
                        "image": "busybox",
                        "securityContext": {"capabilities": {"drop": ["ALL"], "add": ["IPC_LOCK"]}},
                        "resources": {"limits": {"rdma/hca": "1"}},
                    }
                ],
            },
        }
        # RDMA pods run only in namespaces that allow RDMA (the chart's tenant policy, docs/security.md)
        kube.kubectl("label", "namespace", "default", "rdma.lingjun.io/tenant=true", "--overwrite")
        kube.apply(pod)
        record = wait_for(lambda: node.record("default", "nccl-test"), timeout=60)
        assert record, kube.get("pod", "nccl-test", "-n", "default")["status"]
        assert kube.get("pod", "nccl-test", "-n", "default")["spec"]["nodeName"] == "gpu-e2e"
        got = record["containers"]["main"]
        hosts = sorted(d["host"] for d in got["devices"])
        assert hosts == sorted([*(f"/dev/infiniband/uverbs{i}" for i in range(4)), "/dev/infiniband/rdma_cm"])
        assert got["envs"]["RDMA_DEVICES"].split(",") == nics
        assert got["envs"]["NCCL_IB_HCA"] == "=" + ",".join(nics)
        assert wait_for(lambda: kube.get("pod", "nccl-test", "-n", "default")["status"].get("phase") == "Running")
        assert wait_for(lambda: kube.get("node", "gpu-e2e")["status"]["allocatable"]["rdma/hca"] == "1k")
    finally:
        kube.kubectl("delete", "pod", "nccl-test", "-n", "default", "--ignore-not-found", "--wait=false", check=False)
        kube.helm("uninstall", "rdma", "-n", "kube-system", "--wait", "--timeout", "120s", check=False)


def _plugin_log(kube: Kube, node: Any) -> str:
    pods = kube.get("pods", "-n", "kube-system", "-l", "app.kubernetes.io/component=device-plugin")["items"]
    return "\n".join(node.log("kube-system", p["metadata"]["name"], "rdma-device-plugin")[-3000:] for p in pods)


def _pod_on(node: str, name: str, container: dict[str, Any]) -> dict[str, Any]:
    """A pod of one container, for the scheduler to bind to this node."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {"nodeSelector": {"kubernetes.io/hostname": node}, "containers": [{"name": "main", **container}]},
    }


def _container(kube: Kube, pod: str) -> dict[str, Any]:
    """The status of the pod's (first) container, empty before there is one."""
    status = kube.get("pod", pod, "-n", "default").get("status", {})
    return dict((status.get("containerStatuses") or [{}])[0])


def test_a_restarted_container_without_a_readiness_probe_is_ready_again(kube: Kube, kube_nodes: Any) -> None:
    """The kubelet's prober reports success for a container without a readiness probe, so a
    container that exited and was restarted is ready again once it runs (a DaemonSet whose plugin
    crashed once must count it ready again: plugin_verify follows numberReady)."""
    node = kube_nodes("n-restart", images={"job": {"entrypoint": ["/bin/sh"], "path": []}}).start()
    marker = node.root / "started-once"
    # The first run leaves a marker and exits 1; the restart finds it and keeps running.
    script = 'if [ -e "$0" ]; then exec sleep 3600; fi; touch "$0"; exit 1'
    kube.apply(
        _pod_on(
            "n-restart",
            "restarts-once",
            {"image": "127.0.0.1:5000/job:1", "command": ["/bin/sh", "-c", script, str(marker)]},
        )
    )
    try:

        def restarted_and_ready() -> bool:
            c = _container(kube, "restarts-once")
            return bool(c.get("restartCount", 0) >= 1 and "running" in c.get("state", {}) and c.get("ready"))

        assert wait_for(restarted_and_ready, timeout=120), kube.get("pod", "restarts-once", "-n", "default")["status"]
        assert marker.exists()
    finally:
        kube.kubectl(
            "delete", "pod", "restarts-once", "-n", "default", "--ignore-not-found", "--wait=false", check=False
        )


def test_a_missing_command_waits_in_create_container_error_until_it_appears(kube: Kube, kube_nodes: Any) -> None:
    """A container whose command does not exist (yet) is not created: Waiting with
    CreateContainerError, retried, never running or ready, no restart counted, whether or not the
    node runs it in a mount namespace of its own (as root); it starts once the command appears."""
    root = Path(tempfile.mkdtemp(prefix="kn-img-", dir="/tmp"))
    command = root / "late"
    try:
        kube_nodes("n-late", images={"late": {"entrypoint": [str(command)], "path": []}}).start()
        kube.apply(_pod_on("n-late", "late", {"image": "127.0.0.1:5000/late:1"}))

        def waiting() -> dict[str, Any]:
            return dict(_container(kube, "late").get("state", {}).get("waiting", {}))

        assert wait_for(lambda: waiting().get("reason") == "CreateContainerError"), _container(kube, "late")
        assert "not found" in waiting()["message"] and str(command) in waiting()["message"]
        assert _container(kube, "late")["restartCount"] == 0 and not _container(kube, "late")["ready"]
        command.write_text("#!/bin/sh\nexec sleep 3600\n")
        command.chmod(0o755)

        def running() -> bool:
            c = _container(kube, "late")
            return bool("running" in c.get("state", {}) and c.get("ready"))

        assert wait_for(running, timeout=60), _container(kube, "late")
        assert _container(kube, "late")["restartCount"] == 0
    finally:
        kube.kubectl("delete", "pod", "late", "-n", "default", "--ignore-not-found", "--wait=false", check=False)
        shutil.rmtree(root, ignore_errors=True)
