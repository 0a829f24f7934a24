"""Issue 40: what playbooks/validate.yml costs each node host, counted rather than timed (a count cannot
flake on a loaded machine; bench/fleet.py times it). At 20 hosts: one worker task per node host, no meta
task run for a node host, at most two merges of its variables (its read, and its line in the inventory
check), and a verdict-sized result (the findings go to the report through a spool, not through hostvars).
The counts come from tests/callback_plugins/rdma_structure.py, which wraps ansible-core's task queue,
meta execution and variable merge."""

from __future__ import annotations

import json
import subprocess
from collections import Counter
from pathlib import Path

import yaml
from conftest import BIN, ROOT, run_playbook

HOSTS = [f"gpu-{i:02d}" for i in range(20)]
BAD = {"gpu-03", "gpu-11"}  # expect 8 NICs of the fixture's 4


def test_validate_costs_each_node_one_task_two_merges_and_a_verdict(tmp_path: Path) -> None:
    node = tmp_path / "node"
    subprocess.run([str(BIN / "rdma-device-plugin"), "fixture", str(node)], check=True, capture_output=True)
    inventory = tmp_path / "prod" / "hosts.yml"
    inventory.parent.mkdir()
    common = {
        "ansible_connection": "local",
        "ansible_python_interpreter": str(BIN / "python"),
        "rdma_sysfs_root": f"{node}/sys",
        "rdma_procfs_root": f"{node}/proc",
        "rdma_dev_root": f"{node}/dev",
        "rdma_output_dir": str(tmp_path / "out"),
        "rdma_validation_label": False,
    }
    hosts = {h: ({"rdma_nic_validate_expected_nics": 8} if h in BAD else {}) for h in HOSTS}
    inventory.write_text(yaml.safe_dump({"all": {"vars": common, "children": {"rdma_nodes": {"hosts": hosts}}}}))
    counts = tmp_path / "structure.tsv"
    run = run_playbook(
        "playbooks/validate.yml",
        "-i",
        str(inventory),
        ANSIBLE_CALLBACK_PLUGINS=str(ROOT / "tests" / "callback_plugins"),
        ANSIBLE_CALLBACKS_ENABLED="rdma_structure",
        RDMA_STRUCTURE_OUT=str(counts),
    )
    assert run.returncode == 2, run.stdout[-3000:] + run.stderr[-2000:]
    out = " ".join(run.stdout.split())
    assert "fatal: [localhost]" not in out, out[-3000:]
    for host in BAD:  # each bad node fails once, naming its finding
        assert out.count(f"fatal: [{host}]: FAILED!") == 1, out[-3000:]
    assert "1 RDMA validation check(s) failed: 4 compute RDMA device(s) match" in out and "expected 8" in out
    report = json.loads((tmp_path / "out" / "validation" / "rdma-validation.json").read_text())
    assert sorted(report["nodes"]) == HOSTS and sorted(report["failed"]) == sorted(BAD)

    rows = [line.split("\t") for line in counts.read_text().splitlines()]
    per = {kind: Counter(host for k, host, _ in rows if k == kind) for kind in ("worker", "meta", "merge")}
    sizes: dict[str, int] = {}
    for kind, host, detail in rows:
        if kind == "result":
            sizes[host] = max(sizes.get(host, 0), int(detail))
    shown = {h: [f"{k} {d}" for k, host, d in rows if host == h and k != "result"] for h in HOSTS[:2]}
    assert {h: per["worker"][h] for h in HOSTS} == dict.fromkeys(HOSTS, 1), shown
    assert {h: per["meta"][h] for h in HOSTS} == dict.fromkeys(HOSTS, 0), shown
    assert max(per["merge"][h] for h in HOSTS) <= 2, shown
    assert max(sizes[h] for h in HOSTS) <= 2048, sizes
