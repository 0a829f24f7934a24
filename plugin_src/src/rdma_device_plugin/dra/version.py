"""The Kubernetes versions the DRA driver runs with: 1.37 and later, what the tests run (v1.37.2).

1.36 is not supported (docs/dra.md, Supported versions): early 1.36 schedulers panic on an
``allocationMode: All`` claim of counter-consuming devices (kubernetes#138882) and forget shared
allocations when they rebuild counters, so an exclusive view could be granted on a NIC in shared use
(#139034); a 1.36 kubelet has only the v1alpha1 health client, which this driver does not serve. The
chart's ``_validate.tpl`` and the collection's ``rdma_dra_preflight`` hold the same floor (a test
compares them).
"""

from __future__ import annotations

import re
from typing import Any

FLOOR = (1, 37)
TESTED = "v1.37.2"


def server_version(doc: dict[str, Any]) -> tuple[int, int]:
    """(major, minor) of an API server's ``/version``; a provider's ``"37+"`` counts as 37, and a
    ``gitVersion`` alone (``v1.37.2-gke.1``) as what it names."""
    major, minor = re.match(r"\d+", str(doc.get("major", ""))), re.match(r"\d+", str(doc.get("minor", "")))
    if major and minor:
        return int(major.group(0)), int(minor.group(0))
    git = re.match(r"v?(\d+)\.(\d+)", str(doc.get("gitVersion", "")))
    if git:
        return int(git.group(1)), int(git.group(2))
    raise ValueError(f"the API server's /version names no version: {doc}")


def refusal(doc: dict[str, Any]) -> str:
    """Why this driver does not run against the server of ``doc`` ('' when it does)."""
    version = server_version(doc)
    if version >= FLOOR:
        return ""
    floor = ".".join(map(str, FLOOR))
    shown = doc.get("gitVersion") or ".".join(map(str, version))
    return (
        f"the API server is Kubernetes {shown}; the DRA driver needs {floor} or later (tested on {TESTED}): "
        "1.36's scheduler and kubelet lack fixes it relies on (kubernetes#138882, #139034, the v1 health API; "
        f"docs/dra.md, Supported versions). Upgrade the control plane and the kubelets to {floor}, or serve "
        "this node by the device plugin: kubectl label node <node> "
        "node-restriction.kubernetes.io/rdma-driver=devicePlugin --overwrite "
        "(or the chart's driver=devicePlugin and dra.enabled=false)"
    )
