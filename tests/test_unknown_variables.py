"""A misspelt variable is not silently unused: the first inventory check of a run names every
rdma_*/plugin_* variable of the inventory or -e that no role's argument spec declares, with the
closest declared name (the names are read from roles/*/meta/argument_specs.yml when it runs, so a
role's new variable is known at once), and refuses to run with rdma_unknown_variables=fail. The node
of this inventory is unreachable: a refusal that came after a read would show it."""

from __future__ import annotations

import re
from pathlib import Path

import yaml
from conftest import run_playbook


def _inventory(tmp_path: Path) -> Path:
    path = tmp_path / "prod" / "hosts.yml"
    (path.parent / "group_vars").mkdir(parents=True)
    # a declared variable of another role than the playbook's (plugin_deploy, not run by validate.yml)
    (path.parent / "group_vars" / "all.yml").write_text(
        "rdma_mdoe: exclusive\nrdma_kubeconfig: /nonexistent\nplugin_deploy_local_fixture_nics: 2\n"
    )
    nodes = {
        "gpu-1": {"ansible_host": "127.0.0.1", "ansible_port": 1, "ansible_connection": "ssh"},
        "gpu-2": {"ansible_host": "127.0.0.1", "ansible_port": 1, "ansible_connection": "ssh",
                  "rdma_nic_validate_expected_nic": 4},
    }  # fmt: skip
    path.write_text(yaml.safe_dump({"all": {"children": {"rdma_nodes": {"hosts": nodes}}}}))
    return path


def _out(result) -> str:  # type: ignore[no-untyped-def]
    return " ".join((result.stdout + result.stderr).split())


def test_typos_are_named_with_the_closest_variable(tmp_path: Path) -> None:
    result = run_playbook(
        "playbooks/validate.yml", "-i", str(_inventory(tmp_path)), "-e", "rdma_validation_label=false", timeout=600
    )
    out = _out(result)
    assert "rdma_mdoe (set for every host) is not a variable of any lingjun.rdma role" in out, out[-3000:]
    assert "Did you mean rdma_mode?" in out, out[-3000:]
    assert "rdma_nic_validate_expected_nic (set for host gpu-2)" in out, out[-3000:]
    assert "Did you mean rdma_nic_validate_expected_nics?" in out, out[-3000:]
    assert "rdma_unknown_variables=fail refuses to run" in out
    # a warning: the run goes on (and reaches the unreachable nodes)
    assert re.search(r"gpu-1\s*: .*unreachable=1", result.stdout), result.stdout[-2000:]
    # declared variables are not reported, whichever role or entry point declares them
    for name in ("rdma_kubeconfig", "rdma_validation_label", "plugin_deploy_local_fixture_nics"):
        assert f"{name} (" not in out, out[-3000:]


def test_fail_switch_refuses_before_any_node_is_read(tmp_path: Path) -> None:
    result = run_playbook(
        "playbooks/site.yml", "-i", str(_inventory(tmp_path)), "-e", "rdma_unknown_variables=fail",
        "-e", "plugin_verify_timout=30",
    )  # fmt: skip
    out = _out(result)
    assert result.returncode == 2, out[-3000:]
    assert "nothing was read or changed" in out
    assert "plugin_verify_timout (from -e) is not a variable of any lingjun.rdma role" in out, out[-3000:]
    assert "Did you mean plugin_verify_timeout? (rdma_unknown_variables=fail)" in out, out[-3000:]
    assert "Did you mean rdma_mode? (rdma_unknown_variables=fail)" in out, out[-3000:]
    assert not re.search(r"gpu-1\s*: .*unreachable=1", result.stdout), result.stdout[-2000:]
