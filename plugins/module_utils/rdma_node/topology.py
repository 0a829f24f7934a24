"""GPU-NIC affinity from the PCIe tree: which GPUs a NIC shares a PCIe switch, root port or NUMA node with.

Pure logic (no I/O, standard library only) over :class:`Placement`, which :func:`placement` builds
from a :class:`.pcie.Function`. The node validation reports the map and checks it; the plugin can
use :func:`affinity` to report each NIC's GPUs and to split pools per NUMA node.

Levels, closest first (the way NCCL ranks paths, ``src/graph/topo.h``: PIX/PXB, PHB, SYS):

- ``switch``: the lowest common ancestor of NIC and GPU is a PCIe switch port (a bridge below
  the root port), so peer-to-peer traffic (GPUDirect RDMA) stays inside the switch;
- ``root_port``: they share the root port (and so the host bridge), but not a switch;
- ``numa``: they are on the same NUMA node, through the CPU.

:func:`affinity` is cumulative: the ``root_port`` list holds the ``switch`` GPUs too, the ``numa``
list every GPU of the NIC's NUMA node.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from .pcie import Function

SWITCH = "switch"
ROOT_PORT = "root_port"
NUMA = "numa"
LEVELS = (SWITCH, ROOT_PORT, NUMA)


@dataclass(frozen=True)
class Placement:
    """Where a PCI function sits: its chain from the host bridge and its NUMA node."""

    address: str
    path: tuple[str, ...]  # host bridge, root port, switch ports..., the function itself
    numa_node: int | None

    @property
    def host_bridge(self) -> str:
        return self.path[0] if len(self.path) > 1 else ""

    @property
    def root_port(self) -> str:
        """The bridge right below the host bridge; "" for a function attached to the host bridge."""
        return self.path[1] if len(self.path) > 2 else ""


def placement(function: Function) -> Placement:
    return Placement(function.address, function.path, function.numa_node)


def shared_level(a: Placement, b: Placement) -> str | None:
    """The closest level ``a`` and ``b`` share, or None (different NUMA nodes or unknown)."""
    common = 0
    for x, y in zip(a.path[:-1], b.path[:-1], strict=False):  # ancestors only
        if x != y:
            break
        common += 1
    if common >= 3:  # host bridge, root port, and at least one switch port in common
        return SWITCH
    if common == 2:
        return ROOT_PORT
    if a.numa_node is not None and a.numa_node == b.numa_node:
        return NUMA
    return None


def affinity(nic: Placement, gpus: Iterable[Placement]) -> dict[str, tuple[str, ...]]:
    """The GPUs of ``nic`` per level (cumulative, each list sorted by PCI address)."""
    found: dict[str, list[str]] = {level: [] for level in LEVELS}
    for gpu in gpus:
        level = shared_level(nic, gpu)
        if level is None:
            continue
        for wider in LEVELS[LEVELS.index(level) :]:
            found[wider].append(gpu.address)
    return {level: tuple(sorted(addresses)) for level, addresses in found.items()}


def node_map(nics: Mapping[str, Placement], gpus: Sequence[Placement]) -> dict[str, dict[str, tuple[str, ...]]]:
    """:func:`affinity` of every NIC (by RDMA device name)."""
    return {name: affinity(place, gpus) for name, place in sorted(nics.items())}


def closest_nics(gpu: Placement, nics: Mapping[str, Placement]) -> tuple[str | None, tuple[str, ...]]:
    """The closest level at which ``gpu`` has a NIC, and those NICs (None, () when none)."""
    by_level: dict[str, list[str]] = {}
    for name, nic in nics.items():
        level = shared_level(gpu, nic)
        if level is not None:
            by_level.setdefault(level, []).append(name)
    for level in LEVELS:
        if level in by_level:
            return level, tuple(sorted(by_level[level]))
    return None, ()
