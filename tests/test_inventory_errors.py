"""Bad input is refused before anything is read or changed, naming the variable and the fix:
typed -e values of every playbook are checked on the controller before any node is contacted
(the node of this inventory is unreachable: a check that ran after a read would show it), and the
cluster plays name rdma_kubeconfig when the kubeconfig is missing or broken."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from conftest import run_playbook

SWITCH = '{"rdma_switch_nodes": ["gpu-1"], "rdma_switch_to": "exclusive"}'


@pytest.fixture
def inventory(tmp_path: Path) -> Path:
    """One node that cannot be reached (ssh to a closed port) and the cluster target."""
    path = tmp_path / "prod" / "hosts.yml"
    path.parent.mkdir()
    nodes = {"gpu-1": {"ansible_host": "127.0.0.1", "ansible_port": 1, "ansible_connection": "ssh"}}
    path.write_text(yaml.safe_dump({"all": {"children": {"rdma_nodes": {"hosts": nodes}}}}))
    return path


def _out(result) -> str:  # type: ignore[no-untyped-def]
    return " ".join((result.stdout + result.stderr).split())


@pytest.mark.parametrize(
    "playbook,value,message",
    [
        ("validate.yml", "rdma_nic_validate_rate_gbps=200G", 'rdma_nic_validate_rate_gbps="200G" is not a number'),
        ("validate.yml", "rdma_validation_enforce=nope", 'rdma_validation_enforce="nope" is not a boolean'),
        ("validate.yml", "rdma_nic_validate_mtu=big", 'rdma_nic_validate_mtu="big" is not a whole number'),
        ("validate.yml", "rdma_nic_validate_pfc_priority=9", "rdma_nic_validate_pfc_priority must be a priority"),
        ("validate.yml", "rdma_nic_validate_mtu=9", "rdma_nic_validate_mtu must be a netdev MTU between 68 and 65535"),
        ("validate.yml", "rdma_nic_validate_roce_mtu=9000", "rdma_nic_validate_roce_mtu=9000 must be one of: 256, 512"),
        ("validate.yml", '{"rdma_nic_validate_skip_checks": ["mtu", "bogus"]}', "rdma_nic_validate_skip_checks="),
        ("validate.yml", "rdma_validation_drift=maybe", 'rdma_validation_drift="maybe" must be one of: warn, fail'),
        ("site.yml", "rdma_shared_devices=lots", 'rdma_shared_devices="lots" is not a whole number'),
        ("site.yml", "rdma_nic_validate_expected_nics=0", "rdma_nic_validate_expected_nics=0 must be positive"),
        ("verify.yml", "plugin_verify_timeout=soon", 'plugin_verify_timeout="soon" is not a whole number'),
    ],
)
def test_typed_values_are_checked_before_any_node_is_read(
    inventory: Path, playbook: str, value: str, message: str
) -> None:
    result = run_playbook(f"playbooks/{playbook}", "-i", str(inventory), "-e", value)
    out = _out(result)
    assert result.returncode == 2, out[-3000:]
    assert message in out and "(from -e)" in out, out[-3000:]
    assert "nothing was read or changed" in out
    # refused on the controller: the unreachable node was never contacted
    assert not re.search(r"gpu-1\s*: .*unreachable=1", result.stdout), result.stdout[-2000:]
    assert "['" not in out  # no Python list reprs in the message


@pytest.mark.parametrize(
    "playbook,extra",
    [
        ("switch-mode.yml", ["-e", SWITCH]),
        ("uninstall.yml", ["-e", "plugin_uninstall_release=false"]),
        ("verify.yml", []),
    ],
)
def test_cluster_plays_name_rdma_kubeconfig(inventory: Path, tmp_path: Path, playbook: str, extra: list[str]) -> None:
    # No kubeconfig anywhere (an empty home, no KUBECONFIG): the kubernetes client's own message is
    # "Invalid kube-config file. No configuration found."; the playbooks say which variable to set.
    home = tmp_path / "home"
    home.mkdir()
    result = run_playbook(f"playbooks/{playbook}", "-i", str(inventory), *extra, HOME=str(home), KUBECONFIG="")
    out = _out(result)
    assert result.returncode != 0, out[-3000:]
    assert "Fix: set rdma_kubeconfig to the kubeconfig of your cluster" in out, out[-3000:]
    missing = run_playbook(f"playbooks/{playbook}", "-i", str(inventory), *extra, "-e", "rdma_kubeconfig=/nonexistent")
    out = _out(missing)
    assert "the kubeconfig /nonexistent does not exist. Fix: set rdma_kubeconfig" in out, out[-3000:]
