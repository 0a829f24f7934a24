"""Jinja filters for Kubernetes quantities, as node status shows extended resources.

``1000 | lingjun.rdma.k8s_quantity`` -> ``"1k"``; ``"1k" | lingjun.rdma.k8s_quantity_int`` -> ``1000``
(-1 when unreadable). The arithmetic is module_utils/rdma_fleet's, the one the verify and mode-switch
modules use.
"""

from __future__ import annotations

from ansible_collections.lingjun.rdma.plugins.module_utils.rdma_fleet import format_quantity, parse_quantity


def k8s_quantity(value):
    """Canonical form: the largest suffix that divides the number exactly."""
    return format_quantity(int(value))


def k8s_quantity_int(value):
    got = parse_quantity(value)
    return -1 if got is None else got


class FilterModule:
    def filters(self):
        return {"k8s_quantity": k8s_quantity, "k8s_quantity_int": k8s_quantity_int}
