"""Which of a node's selected RDMA devices are its compute NICs (standard library only, pure logic).

The node validation holds only the compute NICs to the RoCE/NCCL settings; the rest are listed:

- **VFs are never validated** (their PF is): an RDMA device whose PCI function has a ``physfn`` link
  is a virtual function (drivers/pci/iov.c, ``pci_iov_add_virtfn``). A VF's PCIe Link Status is
  reserved (RsvdZ) by the PCI-SIG SR-IOV specification, so the kernel shows ``Unknown``/0 for it
  (drivers/pci/pci-sysfs.c); a VF bound to a pod has its netdev in the pod's netns, so its GIDs name
  a netdev the host does not have. The PFs' VFs are counted (``virtfnN`` links).
- **Compute NICs** are the physical functions that match the selector :class:`Compute`:
  ``nics`` names them outright (a per-node override); otherwise a NIC is compute when one of its
  ports has a compute link layer (``link_types``; by default InfiniBand on a node that has an
  InfiniBand port, as on DGX-style nodes whose Ethernet ConnectX ports serve storage, else Ethernet)
  and, for an Ethernet NIC when ``networks`` is given, one of its RoCE v2 GIDs carries an address of
  a compute network.
- Every other PF is **storage/management**: listed with the reason, not held to RoCE settings.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass, field

from . import gids
from .sysfs import Nic

INFINIBAND = "InfiniBand"
ETHERNET = "Ethernet"


@dataclass(frozen=True)
class Compute:
    """The compute-NIC selector (the module's ``compute_*`` options; empty = the defaults above)."""

    nics: tuple[str, ...] = ()  # RDMA device names: exactly these are compute
    link_types: tuple[str, ...] = ()  # () = InfiniBand when the node has an InfiniBand port, else Ethernet
    networks: tuple[str, ...] = ()  # CIDRs of the compute network (RoCE: a RoCE v2 GID in one)

    def __post_init__(self) -> None:
        bad = [t for t in self.link_types if t not in (ETHERNET, INFINIBAND)]
        if bad:
            raise ValueError(f"compute_link_types must be Ethernet and/or InfiniBand, not {bad}")
        for cidr in self.networks:
            try:
                ipaddress.ip_network(cidr, strict=False)
            except ValueError:
                raise ValueError(
                    f"compute_networks: {cidr!r} is not a network (e.g. 10.0.0.0/16 or 2408:4005:300::/48)"
                ) from None


@dataclass
class Roles:
    """The node's selected RDMA devices by role."""

    compute: list[Nic]
    other: dict[str, str] = field(default_factory=dict)  # storage/management PF -> why it is not compute
    vf_devices: list[str] = field(default_factory=list)  # RDMA devices on VFs (not validated)
    missing: list[str] = field(default_factory=list)  # names in Compute.nics the node does not have
    link_types: tuple[str, ...] = ()  # the compute link layers used

    @property
    def vfs(self) -> int:
        """VFs enabled on the compute PFs (their ``virtfnN`` links)."""
        return sum(n.vfs for n in self.compute)


def _roce_v2_on(nic: Nic, networks: Sequence[str]) -> bool:
    return any(
        g.type == "RoCE v2" and gids.parses(g.gid) and gids.on_networks(g.gid, networks)
        for p in nic.ports
        for g in p.gids
    )


def _roce_v2_addresses(nic: Nic) -> str:
    found = {str(gids.address(g.gid)) for p in nic.ports for g in p.gids if g.type == "RoCE v2" and gids.valid(g.gid)}
    return ", ".join(sorted(found)) or "no address"


def classify(nics: Sequence[Nic], want: Compute) -> Roles:
    pfs = [n for n in nics if not n.is_vf]
    roles = Roles([], vf_devices=[n.name for n in nics if n.is_vf])
    if want.nics:
        names = set(want.nics)
        roles.compute = [n for n in pfs if n.name in names]
        roles.missing = sorted(names - {n.name for n in pfs})
        roles.other = {n.name: "not in compute_nics" for n in pfs if n.name not in names}
        roles.link_types = tuple(sorted({ll for n in roles.compute for ll in n.link_layers}))
        return roles
    has_ib = any(INFINIBAND in n.link_layers for n in pfs)
    roles.link_types = want.link_types or ((INFINIBAND,) if has_ib else (ETHERNET,))
    for nic in pfs:
        layers = set(nic.link_layers) & set(roles.link_types)
        if not layers:
            why = f"{'/'.join(nic.link_layers) or 'no link layer'}"
            if not want.link_types and has_ib:
                why += " on a node whose compute ports are InfiniBand"
            roles.other[nic.name] = why
        elif want.networks and layers == {ETHERNET} and not _roce_v2_on(nic, want.networks):
            roles.other[nic.name] = f"no RoCE v2 GID on the compute network ({_roce_v2_addresses(nic)})"
        else:
            roles.compute.append(nic)
    return roles
