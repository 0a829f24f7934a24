"""Which ResourceClaims each container of a pod uses (pure): what one container's env must name.

A container gets the CDI devices of every claim it uses, and a runtime merges their specs' env the
way containerd's CDI does (tags.cncf.io/container-device-interface ``ContainerEdits.Apply``: each
spec's env entries in turn, a variable set again replaced): with several claims of this driver in
one container (8 rails: 8 claims of one NIC each), each spec's ``NCCL_IB_HCA`` would name its own
NIC and the last one applied would win. So each claim's spec carries the env of *every* NIC of
this driver in the containers that use it: the same value in each spec, whichever is applied last.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def claims_by_container(pod: Mapping[str, Any]) -> dict[str, set[str]]:
    """Container name -> the names of the ResourceClaims it uses (in the pod's namespace): its
    ``resources.claims`` (a template's claim by the name in ``status.resourceClaimStatuses``) and the
    claim of its extended resources (``status.extendedResourceClaimStatus``, KEP-5004)."""
    spec, status = pod.get("spec") or {}, pod.get("status") or {}
    generated = {s.get("name"): s.get("resourceClaimName") for s in status.get("resourceClaimStatuses") or []}
    actual = {
        rc.get("name"): rc.get("resourceClaimName") or generated.get(rc.get("name"))
        for rc in spec.get("resourceClaims") or []
    }
    out: dict[str, set[str]] = {}
    for c in [*(spec.get("initContainers") or []), *(spec.get("containers") or [])]:
        refs = (c.get("resources") or {}).get("claims") or []
        out[str(c.get("name"))] = {str(actual[r.get("name")]) for r in refs if actual.get(r.get("name"))}
    extended = status.get("extendedResourceClaimStatus") or {}
    if extended.get("resourceClaimName"):
        for m in extended.get("requestMappings") or []:
            out.setdefault(str(m.get("containerName")), set()).add(str(extended["resourceClaimName"]))
    return out


def pods_of(claim: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(name, UID) of the pods a claim is reserved for (the scheduler reserves it before binding)."""
    return [
        (str(r.get("name")), str(r.get("uid")))
        for r in (claim.get("status") or {}).get("reservedFor") or []
        if r.get("resource") == "pods" and not r.get("apiGroup")
    ]
