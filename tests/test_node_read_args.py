"""The one node read (roles/rdma_nic_validate/tasks/read.yml) takes its module arguments from the role
variables in the rdma_node_info action plugin (plugin_utils/rdma_node_read.py), not from a Jinja template
on the task: ansible-core compiles a task's templates again in every host's worker, which was a third of
validate's controller CPU per host (bench/fleet.py). What the template did must still hold: typed
variables through the one boundary, null options left to the module, the fleet path's record_host, and a
failed read failing the role's own path only with rdma_validation_fail."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from ansible.errors import AnsibleFilterError
from ansible_collections.lingjun.rdma.plugins.plugin_utils.rdma_node_read import read_args
from conftest import ROOT, run_playbook

JINJA = re.compile(r"\{\{|\{%")


def role_defaults() -> dict[str, Any]:
    found: dict[str, Any] = {}
    for role in ("rdma_node_facts", "rdma_nic_validate"):
        found.update(yaml.safe_load((ROOT / "roles" / role / "defaults" / "main.yml").read_text()))
    return found


def args_of(fleet: bool = True, **variables: Any) -> dict[str, Any]:
    """read_args over the role defaults (their templates replaced by what they render to) and ``variables``."""
    values = {
        **role_defaults(),
        "rdma_validation_report_dir": "/out/validation",
        "inventory_hostname": "node-1",
        "rdma_sysfs_root": "/sys",
        "rdma_procfs_root": "/proc",
        "rdma_dev_root": "/dev",
        **variables,
    }
    values = {name: value for name, value in values.items() if value is not Ellipsis}  # ...: undefined
    return read_args(values.__getitem__, values.__contains__, fleet=fleet)


def test_the_read_task_compiles_no_template_in_the_hosts_workers() -> None:
    """Every Jinja template or bare expression on the read task is compiled again in each host's worker."""
    (task,) = yaml.safe_load((ROOT / "roles" / "rdma_nic_validate" / "tasks" / "read.yml").read_text())
    assert not JINJA.search(json.dumps(task)), task
    assert not {"when", "failed_when", "until"} & set(task), task
    assert task["lingjun.rdma.rdma_node_info"] == {} and "args" not in task, task
    # validate.yml's node task: the action's fleet switch only, nothing templated, no role imported
    plays = yaml.safe_load((ROOT / "playbooks" / "validate.yml").read_text())
    (nodes,) = [p for p in plays if p["name"] == "Read and check every RDMA node"]
    read = nodes["tasks"][-1]
    assert read["lingjun.rdma.rdma_node_info"] == {"fleet": True} and not JINJA.search(json.dumps(read)), read
    assert not [t for t in nodes["tasks"] if "ansible.builtin.import_role" in t or "ansible.builtin.meta" in t]


def test_the_defaults_give_the_module_every_default_check() -> None:
    args = args_of()
    assert args["record_host"] == "node-1" and args["health"] is True and args["fw_consistent"] is True
    assert args["counter_baseline_dir"] == "/out/validation/counters"
    assert args["nccl_addr_family"] == "auto" and args["ipc_lock"] is True and args["roce_mtu"] == 4096
    # null options are left to the module (not checked), never sent as None
    assert None not in args.values()
    assert not {
        "expected_nics",
        "min_fw_version",
        "rate_gbps",
        "nccl_gid_index",
        "ipv6_roce_v2_gid",
    } & set(args)


def test_command_line_strings_are_typed_and_the_role_path_records_no_host() -> None:
    args = args_of(
        rdma_nic_validate_expected_nics="8",
        rdma_nic_validate_mtu=" 9000",
        rdma_non_host_network="yes",
        rdma_nic_validate_counter_baseline="off",
        ipv6_compute_validate_roce_v2_gid="true",
        fleet=False,
    )
    assert (args["expected_nics"], args["mtu"], args["ipv6_roce_v2_gid"]) == (
        8,
        9000,
        True,
    )
    assert args["nccl_addr_family"] == "AF_INET6" and args["ipv6_record"] is True
    assert "counter_baseline_dir" not in args and "record_host" not in args


def test_nccl_gid_index_and_ipc_lock_follow_the_deployment() -> None:
    chart = args_of(
        plugin_deploy_extra_values={"env": {"NCCL_IB_GID_INDEX": 3}},
        rdma_admission_policy_enabled="no",
    )
    assert chart["nccl_gid_index"] == 3 and chart["ipc_lock"] is False
    pinned = args_of(
        rdma_nic_validate_nccl_gid_index="5",
        rdma_admission_policy_validation_actions=["Warn"],
    )
    assert pinned["nccl_gid_index"] == 5 and pinned["ipc_lock"] is False
    assert args_of(rdma_nic_validate_pods_ipc_lock="false", rdma_admission_policy_enabled=True)["ipc_lock"] is False


@pytest.mark.parametrize(
    ("name", "value"),
    [("rdma_nic_validate_mtu", "jumbo"), ("rdma_nic_validate_health", "maybe")],
)
def test_a_bad_typed_value_names_the_variable(name: str, value: str) -> None:
    with pytest.raises(AnsibleFilterError, match=rf"{name}='{value}' is not an? "):
        args_of(**{name: value})


PLAY = """
- name: The role's own read of a node whose module cannot run (no Python there)
  hosts: node-gone
  gather_facts: false
  roles:
    - lingjun.rdma.rdma_nic_validate
"""


@pytest.mark.parametrize("fail", [True, False])
def test_a_failed_read_fails_the_role_only_with_rdma_validation_fail(tmp_path: Path, fail: bool) -> None:
    (tmp_path / "play.yml").write_text(PLAY)
    missing = str(tmp_path / "no-python")  # the module run fails: a failed read, not a read with findings
    (tmp_path / "hosts.yml").write_text(
        yaml.safe_dump(
            {
                "all": {
                    "hosts": {
                        "node-gone": {
                            "ansible_connection": "local",
                            "ansible_python_interpreter": missing,
                        }
                    },
                    "vars": {
                        "rdma_sysfs_root": str(tmp_path / "gone" / "sys"),
                        "rdma_procfs_root": str(tmp_path / "gone" / "proc"),
                        "rdma_dev_root": str(tmp_path / "gone" / "dev"),
                        "rdma_output_dir": str(tmp_path / "out"),
                        "rdma_validation_fail": fail,
                    },
                }
            }
        )
    )
    run = run_playbook("-i", str(tmp_path / "hosts.yml"), str(tmp_path / "play.yml"))
    out = run.stdout + run.stderr
    (read,) = [chunk for chunk in out.split("TASK [") if re.match(r"[\w.]*rdma_nic_validate : Read the node", chunk)]
    read_failed = "fatal: [node-gone]" in read
    if fail:
        assert run.returncode == 2 and read_failed, out[-3000:]
    else:
        assert run.returncode == 0 and not read_failed, out[-3000:]
        assert re.search(r"node-gone\s*: ok=\d+ .*failed=0", out), out[-3000:]


@pytest.mark.parametrize("fail", [True, False])
def test_an_unreachable_node_stops_the_role_only_with_rdma_validation_fail(tmp_path: Path, fail: bool) -> None:
    """ignore_unreachable now comes from the role's import of the read (inherited), not from the read task."""
    (tmp_path / "play.yml").write_text(PLAY)
    refused = {"ansible_connection": "ssh", "ansible_host": "127.0.0.1", "ansible_port": 1}  # refused at once
    variables = {"rdma_output_dir": str(tmp_path / "out"), "rdma_validation_fail": fail}
    (tmp_path / "hosts.yml").write_text(yaml.safe_dump({"all": {"hosts": {"node-gone": refused}, "vars": variables}}))
    run = run_playbook("-i", str(tmp_path / "hosts.yml"), str(tmp_path / "play.yml"))
    out = run.stdout + run.stderr
    if fail:
        assert run.returncode == 4 and re.search(r"node-gone\s*: .*unreachable=1 ", out), out[-3000:]
    else:
        assert run.returncode == 0 and re.search(r"node-gone\s*: .*unreachable=0 .*ignored=1", out), out[-3000:]
