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
    env = {}
    if fake:
        (base / "fake").mkdir()
        env = {
            "ANSIBLE_COLLECTIONS_PATH": f"{fleet.fake_collection(base)}:{ROOT / 'collections'}",
            "RDMA_FLEET_FAKE_CACHE": str(base / "fake"),
        }
    run = run_playbook(
        "-i", str(inventory), str(ROOT / "playbooks" / "validate.yml"), "-e", "rdma_validation_enforce=false", **env
    )
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
    """Issue 32: the controller's CPU per extra host is the slope between two sizes (what each host adds),
    not the mean (which spreads the once-per-run work over the hosts)."""
    load = (0.0, 0.0, 0.0)
    figures = [  # hosts, phase, wall, total CPU, RSS, load, module CPU, once-per-run CPU, its tasks
        fleet.Figure(500, "ping", 1, 300.0, 1, load, 250.0),
        fleet.Figure(2000, "ping", 1, 1200.0, 1, load, 1000.0),  # controller: 50 -> 200 s: 0.1 s per extra host
        fleet.Figure(500, "validate", 1, 560.0, 1, load, 400.0, 6.0, (("Write the fleet report", 3.0),)),
        fleet.Figure(2000, "validate", 1, 2240.0, 1, load, 1600.0, 21.0, (("Write the fleet report", 12.0),)),
    ]
    text = fleet.slopes(figures)
    assert text.startswith(
        "Controller CPU per extra host, 500 -> 2000 hosts (the slope): validate 0.320 s, ping 0.100 s"
    )
    assert "3.20x (goal <= 1.2x)" in text
    assert "| 2000 | 21.0 | Write the fleet report 12.0 s | 0.800 / 0.500 | +0.300 |" in text
    assert fleet.slopes(figures[:1] + figures[2:3]) == ""  # one size: no slope
    lines = [{"play": "p", "task": "Write the fleet report", "hosts": 1, "wall_s": 3.2, "cpu_s": 3.0},
             {"play": "p", "task": "Read the node", "hosts": 500, "wall_s": 90, "cpu_s": 80.0},
             {"play": "p", "task": "Label", "hosts": 1, "wall_s": 2.5, "cpu_s": 2.0}]  # fmt: skip
    (tmp_path / "t.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert fleet.task_cpu(tmp_path / "t.jsonl") == (5.0, (("Write the fleet report", 3.0), ("Label", 2.0)))


def test_the_fleet_bench_runs_against_a_real_api_server(tmp_path: Path) -> None:
    """--api real: validate labels and verify reads a real kube-apiserver v1.37.2; the bench's own checks
    (every node labelled as validated, exactly the gated hosts failing verify, one node list per poll,
    counted by the server's apiserver_request_total) raise SystemExit when they do not hold."""
    figures = fleet.bench(6, 6, ["validate", "verify"], False, tmp_path / "run", (), "real")
    assert [f.phase for f in figures] == ["validate", "verify (kube-apiserver v1.37.2)"]
    assert not (tmp_path / "run" / "cluster" / "state.json").exists(), "the bench's cluster was left running"
