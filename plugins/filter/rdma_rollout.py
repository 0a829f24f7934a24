"""``nodes | lingjun.rdma.rdma_rollout_seconds(max_unavailable, base, per_wave)``: a deadline that scales
with the fleet (base + per_wave x the rollout waves of a DaemonSet over ``nodes`` nodes with
``max_unavailable``), the same arithmetic lingjun.rdma.rdma_verify waits with (module_utils/rdma_fleet)."""

from __future__ import annotations

from ansible.errors import AnsibleFilterError
from ansible_collections.lingjun.rdma.plugins.module_utils.rdma_fleet import rollout_seconds


def rdma_rollout_seconds(nodes, max_unavailable, base, per_wave):
    try:
        return rollout_seconds(int(nodes), max_unavailable, base, per_wave)
    except ValueError as exc:
        raise AnsibleFilterError(f"rdma_max_unavailable: {exc}; e.g. -e rdma_max_unavailable=10%") from None


class FilterModule:
    def filters(self):
        return {"rdma_rollout_seconds": rdma_rollout_seconds}
