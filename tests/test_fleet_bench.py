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
