"""playbooks/validate.yml gives the node verdicts whatever happens to the labels and the nodes: with
the cluster target and no usable kubeconfig (validating before the cluster exists), the bad node
fails with its findings and the good one passes, then the controller fails once with the labelling
error and the one-variable switch (rdma_validation_label=false), which validates without a cluster;
and when every node is unreachable the report is still written, listing them. The nodes are local
connections reading a fixture node (rdma-device-plugin fixture), one expecting more NICs than it has."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
import yaml
from conftest import BIN, run_playbook


@pytest.fixture
def inventory(tmp_path: Path) -> Path:
    node = tmp_path / "node"
    subprocess.run([str(BIN / "rdma-device-plugin"), "fixture", str(node)], check=True, capture_output=True)
    path = tmp_path / "prod" / "hosts.yml"
    path.parent.mkdir()
    vars_ = {
        "ansible_connection": "local",
        "ansible_python_interpreter": str(BIN / "python"),
        "rdma_sysfs_root": f"{node}/sys",
        "rdma_procfs_root": f"{node}/proc",
        "rdma_dev_root": f"{node}/dev",
        "rdma_kubeconfig": str(tmp_path / "no-cluster-yet"),
        "rdma_output_dir": str(tmp_path / "out"),
    }
    hosts = {"gpu-good": {}, "gpu-bad": {"rdma_nic_validate_expected_nics": 8}}
    path.write_text(yaml.safe_dump({"all": {"vars": vars_, "children": {"rdma_nodes": {"hosts": hosts}}}}))
    return path


def _recap(stdout: str, host: str) -> dict[str, int]:
    line = re.search(rf"^{re.escape(host)}\s*:(.*)$", stdout, re.M)
    assert line, stdout[-2000:]
    return {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", line.group(1))}


def test_bad_nodes_fail_first_then_the_labelling(inventory: Path, tmp_path: Path) -> None:
    result = run_playbook("playbooks/validate.yml", "-i", str(inventory), timeout=600)
    out = " ".join(result.stdout.split())
    assert result.returncode == 2, out[-3000:]
    assert _recap(result.stdout, "gpu-bad")["failed"] == 1, result.stdout[-1500:]
    assert _recap(result.stdout, "gpu-good")["failed"] == 0, result.stdout[-1500:]
    assert _recap(result.stdout, "localhost")["failed"] == 1, result.stdout[-1500:]
    assert "expected 8" in out  # the bad node's own finding, in its own failure
    # the controller's failure comes after the nodes' and names the fix and the switch
    assert out.index("fatal: [gpu-bad]") < out.index(
        "The validation labels (node-restriction.kubernetes.io/rdma-validated) could"
    )
    assert f"the kubeconfig {tmp_path / 'no-cluster-yet'} does not exist" in out
    assert "-e rdma_validation_label=false" in out
    report = json.loads((tmp_path / "out" / "validation" / "rdma-validation.json").read_text())
    assert set(report["nodes"]) == {"gpu-good", "gpu-bad"}

    # the documented switch: validating before the cluster exists is one variable
    again = run_playbook("playbooks/validate.yml", "-i", str(inventory), "-e", "rdma_validation_label=false")
    assert again.returncode == 2, again.stdout[-3000:]
    assert _recap(again.stdout, "gpu-bad")["failed"] == 1 and _recap(again.stdout, "localhost")["failed"] == 0
    assert "could not be written" not in again.stdout


def test_report_written_when_every_node_is_unreachable(tmp_path: Path) -> None:
    path = tmp_path / "prod" / "hosts.yml"
    path.parent.mkdir()
    nodes = {
        n: {"ansible_host": "127.0.0.1", "ansible_port": 1, "ansible_connection": "ssh"} for n in ("gpu-1", "gpu-2")
    }
    path.write_text(
        yaml.safe_dump(
            {"all": {"vars": {"rdma_output_dir": str(tmp_path / "out")}, "children": {"rdma_nodes": {"hosts": nodes}}}}
        )
    )
    result = run_playbook("playbooks/validate.yml", "-i", str(path), timeout=600)
    assert result.returncode == 4, result.stdout[-3000:]  # unreachable
    report = json.loads((tmp_path / "out" / "validation" / "rdma-validation.json").read_text())
    assert report["not_validated"] == ["gpu-1", "gpu-2"], report
    assert all("unreachable" in n["failed"][0] for n in report["nodes"].values()), report
    # nothing was validated, so nothing needed the cluster (no kubeconfig here): no labelling error
    assert "could not be written" not in result.stdout, result.stdout[-2000:]
