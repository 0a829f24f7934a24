"""The two DaemonSets' node affinities partition the nodes: evaluate the rendered nodeAffinity (plus
nodeSelector) the way the scheduler does against sample node label sets."""

from __future__ import annotations

from typing import Any

import pytest
from conftest import CASES, daemonsets

MODE = "node-restriction.kubernetes.io/rdma-mode"
NFD = {"feature.node.kubernetes.io/pci-15b3.present": "true"}
LINGJUN = {"alibabacloud.com/lingjun-worker": "true"}


def _expr_matches(expr: dict[str, Any], labels: dict[str, str]) -> bool:
    key, op, values = expr["key"], expr["operator"], expr.get("values", [])
    if op == "In":
        return key in labels and labels[key] in values
    if op == "NotIn":
        return key not in labels or labels[key] not in values
    if op == "Exists":
        return key in labels
    if op == "DoesNotExist":
        return key not in labels
    if op in ("Gt", "Lt"):
        if key not in labels:
            return False
        return int(labels[key]) > int(values[0]) if op == "Gt" else int(labels[key]) < int(values[0])
    raise AssertionError(f"unknown operator {op}")


def schedulable(ds: dict[str, Any], labels: dict[str, str]) -> bool:
    pod = ds["spec"]["template"]["spec"]
    if any(labels.get(k) != v for k, v in (pod.get("nodeSelector") or {}).items()):
        return False
    required = ((pod.get("affinity") or {}).get("nodeAffinity") or {}).get("requiredDuringSchedulingIgnoredDuringExecution")
    if not required:
        return True
    return any(all(_expr_matches(e, labels) for e in term.get("matchExpressions", [])) for term in required["nodeSelectorTerms"])


def where(values: dict, labels: dict[str, str]) -> list[str]:
    return sorted(mode for mode, ds in daemonsets(values).items() if schedulable(ds, labels))


NODES = {
    "nfd-unlabelled": (NFD, None),
    "lingjun-unlabelled": (LINGJUN, None),
    "nfd-shared": ({**NFD, MODE: "shared"}, "shared"),
    "lingjun-shared": ({**LINGJUN, MODE: "shared"}, "shared"),
    "nfd-exclusive": ({**NFD, MODE: "exclusive"}, "exclusive"),
    "lingjun-exclusive": ({**LINGJUN, MODE: "exclusive"}, "exclusive"),
    "both-exclusive": ({**NFD, **LINGJUN, MODE: "exclusive"}, "exclusive"),
}


@pytest.mark.parametrize("default_mode", ["shared", "exclusive"])
@pytest.mark.parametrize("node", sorted(NODES))
def test_rdma_nodes_get_exactly_one_daemonset(default_mode: str, node: str) -> None:
    labels, labelled_mode = NODES[node]
    expected = labelled_mode or default_mode
    assert where({"mode": default_mode}, labels) == [expected]


@pytest.mark.parametrize("default_mode", ["shared", "exclusive"])
@pytest.mark.parametrize("labels", [{}, {MODE: "shared"}, {MODE: "exclusive"}, {"kubernetes.io/os": "linux"}, {"feature.node.kubernetes.io/pci-15b3.present": "false"}])
def test_non_rdma_nodes_get_none(default_mode: str, labels: dict[str, str]) -> None:
    assert where({"mode": default_mode}, labels) == []


def test_unknown_mode_value_gets_none() -> None:
    assert where({}, {**NFD, MODE: "exclusve"}) == []


def test_relabelling_moves_the_node() -> None:
    labels = dict(LINGJUN)
    assert where({}, labels) == ["shared"]
    labels[MODE] = "exclusive"
    assert where({}, labels) == ["exclusive"]
    labels[MODE] = "shared"
    assert where({}, labels) == ["shared"]


def test_without_default_affinity_only_the_mode_label_decides() -> None:
    values = CASES["no-default-affinity"]
    assert where(values, {}) == ["shared"]
    assert where(values, {MODE: "exclusive"}) == ["exclusive"]


def test_user_affinity_terms_keep_their_expressions_and_node_selector_applies() -> None:
    values = {
        "nodeSelector": {"kubernetes.io/os": "linux"},
        "affinity": {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [{"matchExpressions": [{"key": "pool", "operator": "In", "values": ["gpu"]}]}]
                },
                "preferredDuringSchedulingIgnoredDuringExecution": [
                    {"weight": 1, "preference": {"matchExpressions": [{"key": "zone", "operator": "Exists"}]}}
                ],
            }
        },
    }
    # Helm merges maps: the default terms are replaced by the user's list
    assert where(values, {"pool": "gpu", "kubernetes.io/os": "linux"}) == ["shared"]
    assert where(values, {"pool": "gpu", "kubernetes.io/os": "linux", MODE: "exclusive"}) == ["exclusive"]
    assert where(values, {"pool": "gpu"}) == []
    assert where(values, {**NFD, "kubernetes.io/os": "linux"}) == []
    for ds in daemonsets(values).values():
        na = ds["spec"]["template"]["spec"]["affinity"]["nodeAffinity"]
        assert na["preferredDuringSchedulingIgnoredDuringExecution"][0]["weight"] == 1


def test_custom_mode_label_key() -> None:
    values = {"modeLabelKey": "gpu.node-restriction.kubernetes.io/rdma-mode"}
    assert where(values, {**NFD, "gpu.node-restriction.kubernetes.io/rdma-mode": "exclusive"}) == ["exclusive"]
    assert where(values, {**NFD, MODE: "exclusive"}) == ["shared"]


# ------------------------------------------------------------------ validation.required (fleet playbooks)

VALIDATED = "node-restriction.kubernetes.io/rdma-validated"


@pytest.mark.parametrize("default_mode", ["shared", "exclusive"])
@pytest.mark.parametrize("node", sorted(NODES))
def test_validation_required_needs_the_validated_label(default_mode: str, node: str) -> None:
    """Every nodeSelectorTerm also requires node-restriction.kubernetes.io/rdma-validated=true: an unvalidated or failed node
    gets no plugin, a validated one the DaemonSet its mode label picks (the partition is unchanged)."""
    labels, labelled_mode = NODES[node]
    values = {"mode": default_mode, "validation": {"required": True}}
    expected = [labelled_mode or default_mode]
    assert where(values, {**labels, VALIDATED: "true"}) == expected
    assert where(values, labels) == []
    assert where(values, {**labels, VALIDATED: "false"}) == []
    # off (the default): the label does not matter
    assert where({"mode": default_mode}, {**labels, VALIDATED: "false"}) == expected


def test_validation_required_is_in_every_term() -> None:
    for ds in daemonsets({"validation": {"required": True}, "affinity": None}).values():
        terms = ds["spec"]["template"]["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
        assert terms and all({"key": VALIDATED, "operator": "In", "values": ["true"]} in t["matchExpressions"] for t in terms)
    for ds in daemonsets({}).values():
        assert VALIDATED not in str(ds["spec"]["template"]["spec"]["affinity"])
