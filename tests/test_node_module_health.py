"""rdma_node_info's node-health checks for real (the module run by Ansible, AnsiballZ with the
rdma_node module_utils): the rows and summary it returns, what it records in the fact, its
option errors, and the issue's example (a bond member down used to pass all 29 checks)."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from conftest import node_info, node_info_run

from rdma_node import fixtures

ROW_KEYS = {"name", "nic", "netdev", "gpu", "passed", "skipped", "warning", "message", "role"}
SUMMARY_KEYS = {"health", "not_checked", "gpus", "gid_index", "gid_family", "mtu", "bonds", "pcie_degraded",
                "topology", "gpudirect", "kernel", "memlock"}  # fmt: skip


def _roots(node: fixtures.FixtureNode) -> list[str]:
    return [f"sysfs_root={node.sysfs}", f"procfs_root={node.procfs}", f"dev_root={node.dev}"]


def _run(node: fixtures.FixtureNode, **options: Any) -> subprocess.CompletedProcess[str]:
    """The module on the fixture node with JSON options; the raw run, failed or not."""
    return node_info_run(
        sys.executable, {"sysfs_root": node.sysfs, "procfs_root": node.procfs, "dev_root": node.dev, **options}
    )


def _result(run: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    result: dict[str, Any] = json.loads(run.stdout)["plays"][0]["tasks"][0]["hosts"]["localhost"]
    return result


def test_health_rows_and_summary_on_a_healthy_node(tmp_path: Path) -> None:
    node = fixtures.write_node(str(tmp_path / "n"), fixtures.lingjun_node(nics=4))
    result = node_info(sys.executable, *_roots(node), "details=true")
    rows = result["node"]["checks"]["rdma_node_health"]
    assert rows and all(set(r) == ROW_KEYS and r["role"] == "rdma_node_health" for r in rows)
    assert [r["message"] for r in rows if not r["passed"]] == []
    assert {r["name"] for r in rows if r["skipped"]} == {"roce_pfc"}  # link_flap: counter_interval 3 s by default
    gpu_rows = [r for r in rows if r["gpu"]]
    assert len(gpu_rows) == 16 and all(r["nic"] is None for r in gpu_rows)
    summary = result["node"]["summary"]["rdma_node_health"]
    assert set(summary) == SUMMARY_KEYS and summary["health"] == "passed" and summary["gpus"] == 8
    assert summary["kernel"] == "5.15.0-119-generic"  # the fleet report's kernel drift reads it
    assert summary["topology"]["mlx5_bond_0"]["switch"] == ["0000:18:00.0", "0000:19:00.0"]
    health = result["node"]["health"]
    assert health["dcb"].startswith("DCB netlink reads the node's own netdevs")
    assert health["nics"]["mlx5_bond_3"]["bond"]["slaves"][1]["name"] == "eth7"
    assert health["runtimes"][0]["unit_limit_memlock"] == "infinity"
    assert result["node"]["options"]["counter_max"] == {"excessive_buffer_overrun_errors": 0,
                                                         "local_link_integrity_errors": 0}  # fmt: skip


def test_a_bond_member_down_fails_and_is_recorded_when_asked(tmp_path: Path) -> None:
    spec = fixtures.with_nic_changes(fixtures.lingjun_node(nics=4), "mlx5_bond_1", members_down=("eth3",))
    node = fixtures.write_node(str(tmp_path / "n"), spec)
    plain = node_info(sys.executable, *_roots(node), "record_host=node-1")
    fact = plain["ansible_facts"]["rdma_validation"]
    assert fact["checks"] == [] and set(fact["passed_checks"]) == {"rdma_nic_validate"}  # health not recorded
    assert "health" not in fact["summary"]
    recorded = node_info(sys.executable, *_roots(node), "record_host=node-1", "health_record=true")
    fact = recorded["ansible_facts"]["rdma_validation"]
    failed = sorted((c["name"], c["nic"]) for c in fact["checks"] if not c["passed"])
    assert failed == [("bond", "mlx5_bond_1"), ("lacp", "mlx5_bond_1"), ("netdev_link", "mlx5_bond_1")]
    assert fact["summary"]["health"] == "failed" and fact["summary"]["nic_count"] == 4
    assert "mlx5_bond_1 (bond1): slave eth3 MII status down. Fix:" in "\n".join(c["message"] for c in fact["checks"])
    assert "node" in recorded and "checks" not in recorded["node"]  # the lean result, as before
    # Every row is either kept (failed, not checked) or counted (a plain pass), none lost:
    full = node_info(sys.executable, *_roots(node))["node"]["checks"]
    every = full["rdma_nic_validate"] + full["rdma_node_health"]
    kept = [(c["name"], c["nic"]) for c in every if not c["passed"] or c.get("skipped")]
    assert sorted((c["name"], c["nic"]) for c in fact["checks"]) == sorted(kept)
    assert {c["name"] for c in fact["checks"] if c["passed"]} == {"roce_pfc"}  # not checked
    counted = fact["passed_checks"]
    assert sum(n for per_role in counted.values() for n in per_role.values()) == len(every) - len(kept)
    assert counted["rdma_nic_validate"]["port_state"] == 4 and counted["rdma_node_health"]["gpu_pcie_link"] == 8


def test_options_shape_the_checks(tmp_path: Path) -> None:
    node = fixtures.write_node(str(tmp_path / "n"), replace(fixtures.lingjun_node(nics=2), runtime=""))
    run = _run(
        node,
        skip_checks=["gpu_pcie_link", "gpu_nic_numa"],
        fail_not_checked=True,
        counter_max={"symbol_error": "10"},
        mtu=4200,
        bond_mode="802.3ad",
        topology_expected={"mlx5_bond_0": ["0000:18:00.0", "0000:19:00.0"]},
    )
    assert run.returncode == 0, run.stdout + run.stderr
    rows = _result(run)["node"]["checks"]["rdma_node_health"]
    names = {r["name"] for r in rows}
    assert not names & {"gpu_pcie_link", "gpu_nic_numa"} and "topology" in names
    failed = sorted({r["name"] for r in rows if not r["passed"]})
    assert failed == ["memlock", "roce_pfc"]  # not checked becomes failed
    assert next(r for r in rows if r["name"] == "port_counters")["message"].startswith(
        "mlx5_bond_0: no error counter grew within "  # no previous run's values: within this read only
    )
    off = _result(_run(node, health=False))["node"]
    assert off["checks"]["rdma_node_health"] == [] and off["summary"]["rdma_node_health"] == {"health": "not checked"}


def test_bad_options_name_the_option(tmp_path: Path) -> None:
    node = fixtures.write_node(str(tmp_path / "n"), fixtures.lingjun_node(nics=1))
    for options, message in [
        ({"counter_max": {"symbol_error": "many"}}, "invalid options: counter_max.symbol_error must be a count"),
        ({"skip_checks": ["pcie"]}, "invalid options: skip_checks must be check names out of"),
        ({"topology_expected": {"mlx5_bond_0": "0000:18:00.0"}}, "topology_expected.mlx5_bond_0 must be a list"),
        ({"counter_interval": 120}, "counter_interval must be seconds from 0 (off) to 60, not 120.0"),
    ]:
        run = _run(node, **options)
        result = _result(run)
        assert result.get("failed") and message in result["msg"], (options, result.get("msg"))


def test_the_node_keeps_its_counter_samples_and_the_next_run_compares_with_them(tmp_path: Path) -> None:
    """Issue 40: a run does not wait for the counters to move when the node kept a sample of an earlier
    read (within counter_window): errors between the two runs are caught, where two reads within the
    second run alone (after the errors) would see none."""
    node = fixtures.write_node(str(tmp_path / "n"), fixtures.lingjun_node(nics=2))
    options = {"counter_interval": 1, "counter_baseline": None}
    first = _result(_run(node, **options))
    assert first["node"]["summary"]["rdma_node_health"]["health"] == "passed", first
    kept = json.loads(next(Path(node.root, "var", "tmp").glob("lingjun-rdma-counters-*.json")).read_text())
    assert len(kept["samples"]) == 2 and "symbol_error" in kept["names"]
    node.bump_counter("mlx5_bond_1", "symbol_error", by=5)
    second = _result(_run(node, **options))
    bad = [r["message"] for r in second["node"]["checks"]["rdma_node_health"] if not r["passed"]]
    assert len(bad) == 1, bad
    assert bad[0].startswith("mlx5_bond_1: error counters grew: port 1 symbol_error 0 -> 5 within "), bad
    # counter_window 0: no kept sample is used, the second read is taken within this run (after the errors)
    third = _result(_run(node, **options, counter_window=0))
    assert third["node"]["summary"]["rdma_node_health"]["health"] == "passed", third
