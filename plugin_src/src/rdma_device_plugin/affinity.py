"""GPU-NIC affinity as the plugin shows it: per NIC, the GPUs that share its PCIe switch, root port or
NUMA node (status, the ``rdma_dp_nic_info`` labels, NFD labels).

The PCIe tree is read by the one reader (:mod:`rdma_node.pcie`) and compared by :mod:`rdma_node.topology`,
the same code the node validation uses; :func:`read` is the only I/O here (once per re-list: the
NICs' PCI functions and the node's GPUs), the rest is pure.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from rdma_node import pcie, topology
from rdma_node.sysfs import Nic

LEVEL_NONE = "none"


@dataclass(frozen=True)
class NicAffinity:
    """The GPUs of one NIC per level, cumulative (``root_port`` includes ``switch``; ``numa`` all of the node)."""

    nic: str
    switch: tuple[str, ...] = ()
    root_port: tuple[str, ...] = ()
    numa: tuple[str, ...] = ()

    @property
    def closest(self) -> str:
        """The closest level at which the NIC has a GPU: switch, root_port, numa or none."""
        for level in topology.LEVELS:
            if getattr(self, level):
                return level
        return LEVEL_NONE

    def to_dict(self) -> dict[str, list[str]]:
        return {level: list(getattr(self, level)) for level in topology.LEVELS}


@dataclass(frozen=True)
class NodeAffinity:
    nics: Mapping[str, NicAffinity]  # by RDMA device name
    gpus: tuple[str, ...]  # every GPU of the node, by PCI address
    gpu_closest: Mapping[str, str]  # GPU -> the closest level at which it has a NIC (or none)

    @property
    def affine_nics(self) -> int:
        """NICs that share a PCIe switch with a GPU: GPUDirect RDMA stays inside the switch."""
        return sum(1 for a in self.nics.values() if a.switch)

    @property
    def weakest(self) -> str:
        """The farthest any GPU is from its closest NIC (none: a GPU with no NIC on its NUMA node)."""
        order = [*topology.LEVELS, LEVEL_NONE]
        return max(self.gpu_closest.values(), key=order.index, default=LEVEL_NONE)


def summarize(nics: Mapping[str, topology.Placement | None], gpus: Sequence[topology.Placement]) -> NodeAffinity:
    """Affinity of every NIC (None: its PCI function was not found) to ``gpus``."""
    found = {name: place for name, place in nics.items() if place is not None}
    per_nic = {
        name: NicAffinity(name, *(levels[level] for level in topology.LEVELS))
        for name, levels in topology.node_map(found, gpus).items()
    }
    for name in nics:
        per_nic.setdefault(name, NicAffinity(name))
    closest = {g.address: topology.closest_nics(g, found)[0] or LEVEL_NONE for g in gpus}
    return NodeAffinity(dict(sorted(per_nic.items())), tuple(sorted(g.address for g in gpus)), closest)


def read(sysfs_root: str, nics: Sequence[Nic]) -> NodeAffinity:
    """Read the NICs' and GPUs' places in the PCIe tree and summarize them."""
    places: dict[str, topology.Placement | None] = {}
    for nic in nics:
        function = pcie.read_function(sysfs_root, nic.pci_address) if nic.pci_address else None
        places[nic.name] = topology.placement(function) if function is not None else None
    return summarize(places, [topology.placement(g) for g in pcie.read_gpus(sysfs_root)])


def nfd_facts(node: NodeAffinity) -> dict[str, str]:
    """NFD labels (without prefix): how many NICs share a PCIe switch with a GPU, and the weakest
    GPU-NIC level of the node (``switch`` on a Lingjun node: every GPU has a NIC under its switch).
    Nothing on a node without GPUs."""
    if not node.gpus:
        return {}
    return {"rdma-gpu-affine-nics": str(node.affine_nics), "rdma-gpu-nic-affinity": node.weakest}


def metric_labels(affinity: NicAffinity | None) -> tuple[str, str, str]:
    """``switch_gpus``, ``root_port_gpus``, ``numa_gpus`` label values of ``rdma_dp_nic_info``."""
    if affinity is None:
        return "", "", ""
    return ",".join(affinity.switch), ",".join(affinity.root_port), ",".join(affinity.numa)
