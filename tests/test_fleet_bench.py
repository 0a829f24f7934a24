"""bench/fleet.py's --fake-facts stand-in gives every host exactly what rdma_node_info returns for
its fixture node: the fleet report of a fake run equals the one of a real run, host for host."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from conftest import ROOT, run_playbook

sys.path.insert(0, str(ROOT / "bench"))
import fleet


def _report(base: Path, fake: bool) -> dict[str, object]:
    inventory = fleet.write_inventory(base, 12, fleet.write_fixtures(base))
    env, books = {}, ROOT / "playbooks"
    if fake:
        (base / "fake").mkdir()
        env = {
            "ANSIBLE_COLLECTIONS_PATH": f"{fleet.fake_collection(base)}:{ROOT / 'collections'}",
            "RDMA_FLEET_FAKE_CACHE": str(base / "fake"),
        }
        books = fleet.fake_playbooks(base)
    run = run_playbook("-i", str(inventory), str(books / "validate.yml"), "-e", "rdma_validation_enforce=false", **env)
    assert run.returncode == 0, run.stdout + run.stderr
    if fake:  # the real module ran once per fixture node the 12 hosts use (healthy, port down, fw), not per host
        assert len(list((base / "fake").glob("*.json"))) == 3
    report: dict[str, object] = json.loads((base / "out" / "validation" / "rdma-validation.json").read_text())
    return report


def test_fake_facts_give_the_real_report(tmp_path: Path) -> None:
    # The same base path for both runs: the messages name the fixture roots.
    real = _report(tmp_path / "run", fake=False)
    (tmp_path / "run").rename(tmp_path / "real")
    fake = _report(tmp_path / "run", fake=True)
    assert fake["nodes"] == real["nodes"]
    assert fake["failed"] == real["failed"] and len(real["failed"]) == 2  # type: ignore[arg-type]


def test_the_restated_fleet_figure_is_read_from_two_fleet_sizes(tmp_path: Path) -> None:
    """Issue 40: the controller's CPU per extra host is the slope between two sizes (what each host adds),
    not the mean (which spreads the once-per-run work over the hosts), set against ping's in ms, the main
    process and the workers apart; a meta task's row counts every host it ran for."""
    load = (0.0, 0.0, 0.0)
    figures = [  # hosts, phase, wall, total CPU, RSS, load, module CPU, once-per-run CPU, its tasks, main CPU
        fleet.Figure(500, "ping", 1, 300.0, 1, load, 250.0, None, (), 20.0),
        fleet.Figure(2000, "ping", 1, 1200.0, 1, load, 1000.0, None, (), 80.0),  # controller: 0.1 s per extra host
        fleet.Figure(500, "validate", 1, 560.0, 1, load, 400.0, 6.0, (("Write the fleet report", 3.0),), 50.0),
        fleet.Figure(2000, "validate", 1, 2240.0, 1, load, 1600.0, 21.0, (("Write the fleet report", 12.0),), 170.0),
    ]
    text = fleet.slopes(figures)
    assert text.startswith(
        "validate: controller CPU per extra host, 500 -> 2000 hosts (the slope): 0.320 s, ping 0.100 s: +220.0 ms "
        "(goal <= +30 ms at the defaults, <= +20 ms with counter_interval=0). Main process: validate 80.0 ms, ping "
        "40.0 ms; workers: validate 240.0 ms, ping 60.0 ms. Once-per-run work per extra host: +10.0 ms (goal <= 3 ms)."
    ), text
    assert "| 2000 | 21.0 | Write the fleet report 12.0 s | 0.800 / 0.500 | +0.300 |" in text
    assert fleet.slopes(figures[:1] + figures[2:3]) == ""  # one size: no slope
    lines = [{"play": "p", "task": "Write the fleet report", "hosts": 1, "wall_s": 3.2, "cpu_s": 3.0},
             {"play": "p", "task": "Read the node", "hosts": 500, "wall_s": 90, "cpu_s": 80.0},
             {"play": "p", "task": "Nothing to read here (meta)", "hosts": 500, "wall_s": 1, "cpu_s": 1.0},
             {"play": "p", "task": "Label", "hosts": 1, "wall_s": 2.5, "cpu_s": 2.0},
             {"main_cpu_s": 42.5}]  # fmt: skip
    (tmp_path / "t.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert fleet.task_cpu(tmp_path / "t.jsonl") == (5.0, (("Write the fleet report", 3.0), ("Label", 2.0)), 42.5)


def test_the_fleet_bench_runs_against_a_real_api_server(tmp_path: Path) -> None:
    """--api real: site.yml end to end (helm installs the chart into a real kube-apiserver v1.37.2), then
    validate labels and verify reads the same server; the bench's own checks (the report lists every host,
    every node labelled as validated, exactly the gated hosts failing verify, the release's DaemonSets in the
    API, one node list per poll of verify alone, counted by the server's apiserver_request_total) raise
    SystemExit when they do not hold. One cluster for the three phases."""
    figures = fleet.bench(6, 6, ["site", "validate", "verify"], False, tmp_path / "run", (), "real")
    assert [f.phase for f in figures] == [
        "site (image stage off, helm install, kube-apiserver v1.37.2)",
        "validate",
        "verify (kube-apiserver v1.37.2)",
    ]
    log = (tmp_path / "run" / "site.log").read_text()
    assert "TASK [plugin_deploy : Install or upgrade the chart (helm upgrade --install)]" in log, log[-3000:]
    assert "SKIPPED image stage: plugin_image_enabled is false" in log, log[-3000:]
    site = figures[0]
    assert site.node_cpu_s and site.main_cpu_s and site.once_cpu_s, site  # accounted as the other phases
    assert not (tmp_path / "run" / "cluster" / "state.json").exists(), "the bench's cluster was left running"


META_PLAY = """
- name: A meta task on every host, then one task on one host
  hosts: all
  gather_facts: false
  tasks:
    - name: Nothing to do here
      ansible.builtin.meta: end_host
      when: inventory_hostname == 'nobody'
    - name: Once
      ansible.builtin.debug:
        msg: once
      run_once: true
"""


def test_the_bench_callback_counts_a_meta_task_once_for_every_host(tmp_path: Path) -> None:
    """Issue 40: ansible-core starts a meta task once per host, which made one row per host, each counted as
    once-per-run work (40 rows of the control host's end_host at 40 hosts)."""
    (tmp_path / "play.yml").write_text(META_PLAY)
    hosts = {f"h{i}": {"ansible_connection": "local", "ansible_python_interpreter": sys.executable} for i in range(3)}
    (tmp_path / "hosts.json").write_text(json.dumps({"all": {"hosts": hosts}}))
    rows = tmp_path / "tasks.jsonl"
    run = run_playbook(
        "-i", str(tmp_path / "hosts.json"), str(tmp_path / "play.yml"),
        RDMA_FLEET_TASKS=str(rows), ANSIBLE_CALLBACK_PLUGINS=str(fleet.TASK_CALLBACK),
        ANSIBLE_CALLBACKS_ENABLED="rdma_fleet_tasks",
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    got = [json.loads(line) for line in rows.read_text().splitlines()]
    assert [(r["task"], r["hosts"]) for r in got[:-1]] == [("Nothing to do here", 3), ("Once", 1)], got
    assert got[-1]["main_cpu_s"] > 0
    _, top, main = fleet.task_cpu(rows)
    assert [name for name, _ in top] == ["Once"] and main == got[-1]["main_cpu_s"]
