"""The Topology Manager's view of device NUMA affinity (pure logic).

Mirrors kubernetes ``pkg/kubelet/cm/devicemanager/topology_hints.go``
(``generateDeviceTopologyHints``) and the ``single-numa-node`` policy
(``pkg/kubelet/cm/topologymanager/policy_single_numa_node.go``: only preferred hints with one
NUMA node are admissible), so NUMA packing can be asserted as the kubelet sees it.

Where it still differs: the hints of one resource are applied alone. The kubelet's Topology Manager
merges the hints of every resource of a container (GPUs and RDMA NICs together); tests of that
alignment run against the kubelet's own device manager (kubesim.real, tests/test_workload_env.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from itertools import combinations


@dataclass(frozen=True)
class Hint:
    numa_nodes: frozenset[int]
    preferred: bool


def device_hints(
    numa_of: Mapping[str, tuple[int, ...]],
    available: Iterable[str],
    reusable: Iterable[str],
    request: int,
) -> list[Hint] | None:
    """Hints for ``request`` devices; None = no preference (no device reports topology).

    ``numa_of``: every device of the resource -> the NUMA nodes of its TopologyInfo.
    """
    if not any(numa_of.values()):
        return None  # deviceHasTopologyAlignment false: the kubelet gives no hint
    nodes = sorted({n for ids in numa_of.values() for n in ids})
    available, reusable = list(available), list(reusable)
    hints: list[Hint] = []
    min_size = len(nodes)
    # bitmask.IterateBitMasks: every non-empty subset, smallest first.
    for size in range(1, len(nodes) + 1):
        for combo in combinations(nodes, size):
            mask = frozenset(combo)
            in_mask = sum(1 for ids in numa_of.values() if mask & set(ids))
            if in_mask >= request and size < min_size:
                min_size = size
            matching = 0
            ok = True
            for d in reusable:
                if not numa_of.get(d):
                    continue
                if not mask & set(numa_of[d]):
                    ok = False
                    break
                matching += 1
            if not ok:
                continue
            matching += sum(1 for d in available if mask & set(numa_of.get(d, ())))
            if matching >= request:
                hints.append(Hint(mask, False))
    return [Hint(h.numa_nodes, len(h.numa_nodes) == min_size) for h in hints]


def single_numa_node(hints: list[Hint] | None) -> frozenset[int] | None:
    """The affinity the single-numa-node policy admits with, or raises ValueError (admission error).

    None means "any" (no preference from the device manager)."""
    if hints is None:
        return None
    single = [h for h in hints if h.preferred and len(h.numa_nodes) == 1]
    if not single:
        raise ValueError("TopologyAffinityError: no single NUMA node can hold the request")
    return min(single, key=lambda h: min(h.numa_nodes)).numa_nodes
