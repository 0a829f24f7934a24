"""The collection's pure fleet logic (plugins/module_utils/rdma_fleet.py): quantities as node status
shows them, DaemonSet rollout waves and the deadline that scales with them, the verdict of one node
from its current mode label, and the validation report's rollup."""

from __future__ import annotations

import pytest
from ansible_collections.lingjun.rdma.plugins.module_utils import rdma_fleet as fleet


@pytest.mark.parametrize(
    "text,n", [("1k", 1000), ("4", 4), ("1Ki", 1024), ("0", 0), ("", None), (None, None), ("x", None)]
)
def test_quantities(text: str | None, n: int | None) -> None:
    assert fleet.parse_quantity(text) == n


def test_canonical_quantity() -> None:
    assert [fleet.format_quantity(n) for n in (1000, 1500, 4, 2000000)] == ["1k", "1500", "4", "2M"]


@pytest.mark.parametrize(
    "value,nodes,count,waves",
    [("10%", 2000, 200, 10), ("10%", 5, 1, 5), ("25%", 4, 1, 4), (1, 3, 1, 3), ("3", 10, 3, 4), ("100%", 7, 7, 1)],
)
def test_rollout_waves(value: object, nodes: int, count: int, waves: int) -> None:
    # percentages round up, as apps/v1 DaemonSet maxUnavailable does; never below one node
    assert fleet.max_unavailable_nodes(value, nodes) == count
    assert fleet.rollout_waves(nodes, value) == waves
    assert fleet.rollout_seconds(nodes, value, 60, 30) == 60 + 30 * waves


def test_a_ready_pod_not_yet_available_keeps_the_rollout_going_and_says_so() -> None:
    """Pods count as available only minReadySeconds after they turned Ready (apps/v1 DaemonSet):
    until then the rollout is not done, and its line says why."""
    status = {"observedGeneration": 1, "desiredNumberScheduled": 2, "updatedNumberScheduled": 2, "numberReady": 2}
    ds = fleet.daemonset_view({"metadata": {"name": "ds", "generation": 1}, "status": {**status, "numberAvailable": 1}})
    assert not fleet.rolled_out(ds)
    assert fleet.rollout_text([ds]) == "ds 2/2 updated, 2 ready (1 available)"
    ds = fleet.daemonset_view({"metadata": {"name": "ds", "generation": 1}, "status": {**status, "numberAvailable": 2}})
    assert fleet.rolled_out(ds) and fleet.rollout_text([ds]) == "ds 2/2 updated, 2 ready"


def test_bad_max_unavailable_is_refused() -> None:
    with pytest.raises(ValueError, match="neither a whole number nor a percentage"):
        fleet.max_unavailable_nodes("ten", 10)


CLUSTER = fleet.Cluster(validation_required=True, report="out/prod/validation/rdma-validation.json")


def _seen(mode: str | None, cap: str | None, alloc: str | None, validated: str | None = "true") -> dict[str, object]:
    return {"mode": mode, "capacity": cap, "allocatable": alloc, "validated": validated, "unschedulable": False}


def test_verdict_follows_the_current_mode_label() -> None:
    want = fleet.Want("gpu-a03", "gpu-a03", nics=4, nics_source="validated on 2025-06-01")
    ok = fleet.verdict(want, _seen("exclusive", "4", "4"), CLUSTER)
    assert ok.ok and ok.msg.startswith("node gpu-a03 (exclusive mode) advertises rdma/hca capacity 4")
    # the same node unlabelled is shared: 1k expected
    bad = fleet.verdict(want, _seen(None, "4", "4"), CLUSTER)
    assert not bad.ok and "(shared mode) shows capacity rdma/hca=4" in bad.msg and "expected 1k" in bad.msg


def test_verdict_messages_name_the_next_step() -> None:
    want = fleet.Want("gpu-a02", "gpu-a02")
    down = fleet.verdict(want, _seen("shared", "1k", "0"), CLUSTER)
    assert not down.ok and not down.final and "a NIC port left ACTIVE" in down.msg
    gated = fleet.verdict(want, _seen("shared", None, None, validated="false"), CLUSTER)
    assert (
        gated.final
        and "node-restriction.kubernetes.io/rdma-validated=false" in gated.msg
        and CLUSTER.report in gated.msg
    )
    unknown = fleet.verdict(fleet.Want("h", "gpu-x"), _seen("exclusive", "4", "4"), CLUSTER)
    assert unknown.final and "NIC count is unknown" in unknown.msg and "(inventory host h)" in unknown.msg
    missing = fleet.verdict(want, None, CLUSTER)
    assert missing.final and "is not in the cluster" in missing.msg and "rdma_k8s_node_name" in missing.msg
    odd = fleet.verdict(want, _seen("fast", "1k", "1k"), CLUSTER)
    assert odd.final and "neither shared nor exclusive" in odd.msg


def _entry(passed: bool, fw: list[str], gid: dict[str, int], failed: tuple[str, ...] = ()) -> dict[str, object]:
    checks = [{"name": n, "passed": False} for n in failed] + [{"name": "rdma_cm", "passed": True}]
    return {
        "validated": True,
        "passed": passed,
        "checks": checks,
        "summary": {"firmware": fw, "driver_version": "24.10-1.1.4", "nic_count": 4, "roce_v2_gid_index": gid},
    }


def test_rollup_counts_versions_and_drift() -> None:
    nodes = {
        "a": _entry(True, ["28.39.1002"], {"mlx5_bond_0": 3}),
        "b": _entry(True, ["28.39.1002"], {"mlx5_bond_0": 3}),
        "c": _entry(False, ["28.39.1002", "28.41.1000"], {"mlx5_bond_0": 5}, ("firmware_consistent", "port_state")),
        "d": {"validated": False, "passed": False, "checks": [], "summary": {}},
    }
    r = fleet.rollup(nodes)
    assert (r["total"], r["passed"], r["failed"], r["not_validated"]) == (4, 2, 1, 1)
    assert r["top_failing_checks"][0] == {"check": "firmware_consistent", "nodes": 1, "hosts": ["c"]}
    facets = {f["title"]: f for f in r["facets"]}
    assert facets["firmware"]["values"] == [("28.39.1002", 3), ("28.41.1000", 1)] and facets["firmware"]["odd"] == ["c"]
    assert facets["RoCE v2 GID index"]["odd"] == ["c"] and facets["driver (mlx5_core / OFED)"]["odd"] == []
    assert "kernel" not in facets  # not reported by the node read: no column
    md = fleet.rollup_markdown(r)
    assert "| RoCE v2 GID index | 3 (2), 5 (1) | DRIFT: c" in md and "['" not in md


def _node(fw: str = "28.39.1002", ofed: str = "24.10-1.1.4", kernel: str = "5.15.0-119-generic", gid: int = 3) -> dict:
    """A validated entry as the report holds it: NIC and node-health summary (gid_index per NIC)."""
    gids = {"mlx5_bond_0": gid, "mlx5_bond_1": gid}
    summary = {"firmware": [fw], "driver_version": ofed, "kernel": kernel, "nic_count": 4, "gid_index": gids}
    summary["roce_v2_gid_index"] = {"mlx5_bond_0": 9}  # the IPv6 read's: the health read's wins
    checks = [{"name": "port_state", "passed": True}]
    return {"validated": True, "passed": True, "checks": checks, "summary": summary}


def test_drift_names_the_odd_nodes_out_with_value_fleet_value_and_fix() -> None:
    nodes = {f"n{i}": _node() for i in range(4)}
    nodes["old"] = _node(fw="28.36.1010", ofed="5.8-1.0.1.1")
    nodes["gid"] = _node(gid=5)
    nodes["down"] = {"validated": False, "passed": False, "checks": [], "summary": {}}
    found = fleet.drift(nodes, "fail")
    assert sorted(found) == ["gid", "old"]
    assert [r["name"] for r in found["old"]] == ["drift_firmware", "drift_driver"]
    assert [r["name"] for r in found["gid"]] == ["drift_gid_index"]  # the health read's index, not the IPv6 one
    row = found["old"][0]
    assert row["passed"] is False and row["role"] == "fleet_drift" and row["nic"] is None
    assert row["message"].startswith(
        "firmware 28.36.1010 differs across the fleet: the fleet's most common is 28.39.1002 (5 of 6 nodes). "
        "Fix: flash the fleet's firmware"
    )
    warned = fleet.drift(nodes, "warn")
    assert all(r["passed"] and r["warning"] for rows in warned.values() for r in rows)
    assert fleet.drift(nodes, "ignore") == {}
    with pytest.raises(ValueError, match="drift mode 'off' is not one of warn, fail, ignore"):
        fleet.drift(nodes, "off")


def test_a_node_whose_ports_all_trained_low_drifts_on_port_rate() -> None:
    """Issue 32: the node's own rate check compares its ports with each other; a node whose ports all run at
    2X NDR passes it, and the fleet's most common rate is the reference."""
    nodes = {f"n{i}": _node() for i in range(3)}
    for entry in nodes.values():
        entry["summary"]["port_rates"] = ["400 Gb/sec (4X NDR)"]
    nodes["low"] = _node()
    nodes["low"]["summary"]["port_rates"] = ["200 Gb/sec (2X NDR)"]
    found = fleet.drift(nodes, "warn")
    assert sorted(found) == ["low"] and [r["name"] for r in found["low"]] == ["drift_port_rate"]
    assert found["low"][0]["message"].startswith(
        "port rate 200 Gb/sec (2X NDR) differs across the fleet: the fleet's most common is 400 Gb/sec (4X NDR) "
        "(3 of 4 nodes). Fix: check the cables/transceivers"
    )


def test_drift_on_a_tie_names_every_node_and_one_node_never_drifts() -> None:
    tie = fleet.drift({"a": _node(kernel="5.15"), "b": _node(kernel="6.8")}, "fail")
    message = tie["a"][0]["message"]
    assert sorted(tie) == ["a", "b"]
    assert "no single most common value across the fleet: 5.15 on 1 node(s), 6.8 on 1" in message
    assert fleet.drift({"a": _node(fw="28.36.1010")}, "fail") == {}


def test_report_drift_rows_are_judged_again_at_every_run() -> None:
    from ansible_collections.lingjun.rdma.plugins.modules import rdma_validation_report as report

    def fact(fw: str) -> dict:
        entry = _node(fw=fw)
        return {"validated": True, "checks": entry["checks"], "summary": entry["summary"]}

    hosts = ["a", "b", "c"]
    first = report.build({}, hosts, {"a": fact("28.39.1002"), "b": fact("28.39.1002"), "c": fact("28.36.1010")},
                         {}, "2026-12-01", drift_mode="fail")  # fmt: skip
    assert first.pop("drift") == {"c": first["nodes"]["c"]["checks"][-1:]}
    assert first["nodes"]["c"]["failed"] == ["drift_firmware"] and first["failed"] == ["c"]
    md = report.markdown(first)
    assert "| c | FAIL |" in md and "- **drift_firmware**: firmware 28.36.1010 differs" in md
    # c flashed, only c validated again (--limit): its drift row goes, a and b keep their entries
    second = report.build(first, ["c"], {"c": fact("28.39.1002")}, {}, "2026-12-02", drift_mode="fail")
    assert second.pop("drift") == {} and second["failed"] == [] and second["passed"] == 3
    warned = report.build({}, hosts, {"a": fact("1"), "b": fact("1"), "c": fact("2")}, {}, "2026-12-01")
    assert warned["nodes"]["c"]["passed"] and "(warning)" in report.markdown(warned)


class _HostVars:
    """A stand-in for ansible-core's HostVars: raw values, and a count of the templated reads."""

    def __init__(self, raw: dict[str, dict[str, object]]) -> None:
        self._raw, self.templated = raw, 0

    def raw_get(self, host: str) -> dict[str, object]:
        return self._raw[host]

    def __getitem__(self, host: str) -> dict[str, object]:
        self.templated += 1
        return {k: str(v).replace("{{ inventory_hostname }}", host) for k, v in self._raw[host].items()}


def test_the_default_node_name_is_the_host_without_templating() -> None:
    """Issue 32 (once-per-run work): rdma_node_facts' default rdma_k8s_node_name is the host's name; the report
    and the labels ask it of every host, and templating it merged the host's variables a second time."""
    from ansible_collections.lingjun.rdma.plugins.plugin_utils.rdma_hosts import Hosts

    hostvars = _HostVars({
        "a": {"rdma_k8s_node_name": "{{ inventory_hostname }}"},
        "b": {"rdma_k8s_node_name": "{{inventory_hostname}}"},
        "c": {"rdma_k8s_node_name": "{{ inventory_hostname }}.example"},
        "d": {},
    })  # fmt: skip
    hosts = Hosts({"hostvars": hostvars})
    assert [hosts.node_name(h) for h in "abcd"] == ["a", "b", "c.example", "d"]
    assert hostvars.templated == 1  # only the template that is more than the host's name


def test_labels_patch_a_node_only_when_more_than_the_time_changed() -> None:
    """Issue 40: validate.yml's validated-at annotation is a stamp: a run that changes no verdict sends no
    patch (one PATCH per node per run before), a changed label or a node without the stamp gets both."""
    from ansible_collections.lingjun.rdma.plugins.modules.rdma_node_labels import _changes

    stamp = fleet.VALIDATED_AT_ANNOTATION
    want = {"labels": {fleet.VALIDATED_LABEL: "true"}, "annotations": {stamp: "2026-12-07T10:00:00Z"}}
    old = {"labels": {fleet.VALIDATED_LABEL: "true"}, "annotations": {stamp: "2026-12-01T10:00:00Z"}}
    assert _changes({"metadata": old}, want, [stamp]) is None
    assert _changes({"metadata": old}, want) == {"metadata": {"annotations": want["annotations"]}}  # not a stamp
    failed = {**old, "labels": {fleet.VALIDATED_LABEL: "false"}}
    assert _changes({"metadata": failed}, want, [stamp]) == {"metadata": want}
    unstamped = {"labels": old["labels"]}
    assert _changes({"metadata": unstamped}, want, [stamp]) == {"metadata": {"annotations": want["annotations"]}}
