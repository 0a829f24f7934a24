"""The fleet report gathered by the rdma_validation_report action (action_plugins/): each host's
stored fact, or why its read returned none, and no echo of every host's findings in the result
(controller memory at fleet scale, bench/fleet.py)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from conftest import BIN, run_playbook

PLAY = """
- name: Findings of three hosts, then the report
  hosts: all
  gather_facts: false
  tasks:
    - name: Read the node (node-ok reads a fixture node; node-bad fails the read)
      lingjun.rdma.rdma_node_info:
        sysfs_root: "{{ root }}/sys"
        procfs_root: "{{ root }}/proc"
        dev_root: "{{ root }}/dev"
        selectors: "{{ selectors }}"
        record_host: "{{ inventory_hostname }}"
      register: rdma_node_read
      failed_when: false
      when: inventory_hostname != 'node-none'

    - name: Write the report
      lingjun.rdma.rdma_validation_report:
        dest: "{{ dest }}"
        hosts: "{{ ansible_play_hosts_all }}"
        fact: rdma_validation
        read: rdma_node_read
      delegate_to: localhost
      run_once: true
"""


def test_report_takes_each_hosts_fact_and_read_without_echoing_them(tmp_path: Path) -> None:
    node = tmp_path / "node"
    subprocess.run([str(BIN / "rdma-device-plugin"), "fixture", str(node)], check=True, capture_output=True)
    (tmp_path / "play.yml").write_text(PLAY)
    inventory = {
        "all": {
            "vars": {
                "ansible_connection": "local",
                "ansible_python_interpreter": str(BIN / "python"),
                "root": str(node),
                "dest": str(tmp_path / "report"),
                "selectors": {"vendors": ["15b3"]},
            },
            "hosts": {"node-ok": {}, "node-bad": {"selectors": {"colours": ["red"]}}, "node-none": {}},
        }
    }
    (tmp_path / "inventory.json").write_text(json.dumps(inventory))
    run = run_playbook(
        "-i",
        str(tmp_path / "inventory.json"),
        str(tmp_path / "play.yml"),
        ANSIBLE_STDOUT_CALLBACK="json",
        ANSIBLE_LOAD_CALLBACK_PLUGINS="1",
    )
    assert run.returncode == 0, run.stdout + run.stderr
    report = json.loads((tmp_path / "report" / "rdma-validation.json").read_text())
    nodes = report["nodes"]
    ok = nodes["node-ok"]
    assert ok["validated"] and ok["passed"] and ok["checks"] == [], ok  # plain passes are counts, not rows
    assert ok["passed_checks"]["rdma_nic_validate"]["port_state"] == ok["summary"]["nic_count"] > 0, ok
    md = (tmp_path / "report" / "rdma-validation.md").read_text()
    row = next(line for line in md.splitlines() if line.startswith("| node-ok |"))
    passed = sum(ok["passed_checks"]["rdma_nic_validate"].values())
    assert row.split(" | ")[4:6] == [str(passed), "0"], row  # checks passed, checks failed
    assert report["not_validated"] == ["node-bad", "node-none"]
    assert nodes["node-bad"]["failed"][0].startswith("not validated: read: Unsupported parameters"), nodes["node-bad"]
    assert nodes["node-none"]["failed"][0].startswith("not validated (unreachable"), nodes["node-none"]
    # The module's result names the arguments' sizes, not every host's findings again.
    result = json.loads(run.stdout)["plays"][0]["tasks"][1]["hosts"]["node-ok"]
    assert result["invocation"]["module_args"]["hosts"] == 3, result["invocation"]
    assert "checks" not in json.dumps(result["invocation"]), result["invocation"]


def test_report_refuses_results_and_fact_together(tmp_path: Path) -> None:
    (tmp_path / "play.yml").write_text(
        "- hosts: localhost\n  gather_facts: false\n  tasks:\n"
        "    - lingjun.rdma.rdma_validation_report:\n"
        "        {dest: " + str(tmp_path) + ", hosts: [a], results: {a: null}, fact: f}\n"
    )
    run = run_playbook("-i", "localhost,", "-c", "local", str(tmp_path / "play.yml"))
    assert run.returncode != 0
    assert "give either results or fact" in run.stdout + run.stderr, run.stdout


def test_the_json_report_has_one_node_per_line() -> None:
    """Written by json's C encoder piece by piece (issue 32: once-per-run work at 2000 hosts), still JSON."""
    from ansible_collections.lingjun.rdma.plugins.modules import (
        rdma_validation_report as module,
    )  # conftest: on sys.path

    report = {"total": 2, "nodes": {"b": {"passed": True, "x": [1]}, "a": {"passed": False}}, "failed": ["a"]}
    text = module.dump(report)
    assert json.loads(text) == report
    assert '\n"a": {"passed": false},\n"b": {"passed": true, "x": [1]}\n' in text
    assert json.loads(module.dump({"nodes": {}, "total": 0})) == {"nodes": {}, "total": 0}
