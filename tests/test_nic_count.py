"""The exclusive shape's NIC count of a host (plugins/plugin_utils/rdma_hosts.nic_count, used by verify
and the mode switch): the validated count wins over rdma_nic_count, and an rdma_nic_count that says
otherwise is reported with the fix instead of silently losing."""

from __future__ import annotations

from typing import Any

from ansible_collections.lingjun.rdma.plugins.plugin_utils.rdma_hosts import Hosts, nic_count


class HostVars:
    """The two calls Hosts makes on ansible's HostVars (raw_get, and [] for templated values)."""

    def __init__(self, hosts: dict[str, dict[str, Any]]) -> None:
        self.hosts = hosts

    def raw_get(self, host: str) -> dict[str, Any]:
        return self.hosts[host]

    def __getitem__(self, host: str) -> dict[str, Any]:
        return self.hosts[host]


VALIDATED = {"validated": True, "summary": {"nic_count": 4}}


def _count(host_vars: dict[str, Any], report: dict[str, Any] | None = None) -> tuple[Any, str, str]:
    return nic_count(Hosts({"hostvars": HostVars({"gpu-1": host_vars})}), "gpu-1", report or {})


def test_validated_count_wins_and_a_disagreeing_rdma_nic_count_is_reported() -> None:
    nics, source, conflict = _count({"rdma_validation": VALIDATED, "rdma_nic_count": 8})
    assert (nics, source) == (4, "validated in this run")
    assert conflict.startswith("rdma_nic_count=8 for gpu-1, but its node has 4 NICs (validated in this run)")
    assert "Fix rdma_nic_count or remove it" in conflict


def test_the_report_counts_too() -> None:
    report = {"gpu-1": {**VALIDATED, "validated_on": "2025-06-01"}}
    nics, source, conflict = _count({"rdma_nic_count": "2"}, report)
    assert (nics, source) == (4, "validated on 2025-06-01") and "rdma_nic_count=2" in conflict


def test_agreeing_or_alone_is_no_conflict() -> None:
    assert _count({"rdma_validation": VALIDATED, "rdma_nic_count": 4}) == (4, "validated in this run", "")
    assert _count({"rdma_nic_count": 8}) == (8, "rdma_nic_count", "")
    assert _count({"rdma_nic_validate_expected_nics": 2}) == (2, "rdma_nic_validate_expected_nics", "")
    assert _count({}) == (None, "", "")
