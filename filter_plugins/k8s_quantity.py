"""Jinja filters for Kubernetes DecimalSI quantities, as node status shows extended resources.

``1000 | k8s_quantity`` -> ``"1k"``; ``"1k" | k8s_quantity_int`` -> ``1000`` (-1 when unreadable).
Used by plugin_verify and rdma_mode_switch to compare what a node advertises with what it should.
"""

from __future__ import annotations

_SUFFIXES = (("E", 10**18), ("P", 10**15), ("T", 10**12), ("G", 10**9), ("M", 10**6), ("k", 10**3))


def k8s_quantity(value):
    """Canonical form: the largest suffix that divides the number exactly."""
    n = int(value)
    for suffix, factor in _SUFFIXES:
        if n and n % factor == 0:
            return f"{n // factor}{suffix}"
    return str(n)


def k8s_quantity_int(value):
    text = str(value or "").strip()
    factors = dict(_SUFFIXES)
    try:
        if text[-1:] in factors:
            return int(text[:-1]) * factors[text[-1]]
        return int(text)
    except ValueError:
        return -1


class FilterModule:
    def filters(self):
        return {"k8s_quantity": k8s_quantity, "k8s_quantity_int": k8s_quantity_int}
