"""Write kernel-shaped fixture nodes: sysfs, procfs and /dev trees, symlinks included.

There is no RDMA hardware on development and CI machines, so tests, molecule scenarios
and the local default point every reader at a tree written here. The layout follows the kernel
(see docs/design.md and rdma-sysfs.md): ``class/*`` entries are symlinks into
``devices/pci0000:00/...``, ``device`` and ``driver`` are symlinks, char devices are
found through ``ibdev`` files and their numbering deliberately does not follow the RDMA
device numbering. Standard library only.

A fixture root holds ``sys/``, ``proc/`` and ``dev/``, and the few host files the node-health
checks read (``etc/systemd``, ``usr/lib/systemd``). Beside the RDMA NICs it holds what those
checks look at, each with a field that sets its fault: the PCIe tree (host bridge -> root port ->
switch upstream port -> downstream ports -> GPUs and NIC, link speed and width on every device),
NVIDIA GPUs, netdev MTU/operstate/carrier, Linux bonds (sysfs ``bonding/`` and
``/proc/net/bonding/<bond>``), MLNX_OFED's ``qos/trust`` and ``ecn/`` files, port counters, the
NVIDIA driver and peer-memory modules, and the container runtime's process limits and unit.
SR-IOV VFs are PCI functions beside their PF (``physfn`` and ``virtfnN`` links, drivers/pci/iov.c)
whose link status reads ``Unknown``/0 as on a node (a VF's Link Status is reserved by the SR-IOV
specification); a VF bound to mlx5_core on the host gets an RDMA device and a netdev, one in a pod's
netns an RDMA device whose GIDs name the pod's netdev (``net1``), which the host does not have.

The node shapes a validation must pass or fail as expected (:data:`SHAPES`): a Lingjun node (4 RoCE
LAG pairs, 8 GPUs), a DGX H100-style node (8 x ConnectX-7 InfiniBand + 2 Ethernet storage ports),
a ConnectX-6 Dx RoCE LAG in active-backup, PFs with host- and pod-bound VFs, GPUs all on NUMA node
0, IPv4-only RoCE, one extra IPv6 address on one NIC, and a Grace-style layout (every device under
a root port of its own, no PCIe switch).

Where the fixture still differs from a node: DCB (PFC) lives in the kernel, not in files, so it
is read only from a real node; counters do not move unless :meth:`FixtureNode.bump_counter` /
:meth:`FixtureNode.flap_netdev` move them.
"""

from __future__ import annotations

import ipaddress
import json
import os
import shutil
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, TypeVar

from .sysfs import PHYS_STATES, PORT_STATES

DEFAULT_MODULES = ("mlx5_core", "mlx5_ib", "ib_core", "ib_uverbs", "rdma_ucm")
_STATE_CODES = {v: k for k, v in PORT_STATES.items()}
_PHYS_CODES = {v: k for k, v in PHYS_STATES.items()}
GEN5 = "32.0 GT/s PCIe"
# bond_options.c: mode name -> (number, bond_mode_name() words)
BOND_MODES = {
    "balance-rr": (0, "load balancing (round-robin)"),
    "active-backup": (1, "fault-tolerance (active-backup)"),
    "balance-xor": (2, "load balancing (xor)"),
    "broadcast": (3, "fault-tolerance (broadcast)"),
    "802.3ad": (4, "IEEE 802.3ad Dynamic link aggregation"),
    "balance-tlb": (5, "transmit load balancing"),
    "balance-alb": (6, "adaptive load balancing"),
}
# The port counters mlx5 shows under ports/<n>/counters/ (the rest of NicSpec.counters go to hw_counters/)
PORT_COUNTERS = (
    "VL15_dropped",
    "excessive_buffer_overrun_errors",
    "link_downed",
    "link_error_recovery",
    "local_link_integrity_errors",
    "port_rcv_constraint_errors",
    "port_rcv_data",
    "port_rcv_errors",
    "port_rcv_packets",
    "port_rcv_remote_physical_errors",
    "port_rcv_switch_relay_errors",
    "port_xmit_constraint_errors",
    "port_xmit_data",
    "port_xmit_discards",
    "port_xmit_packets",
    "port_xmit_wait",
    "symbol_error",
)
HW_COUNTERS = (
    "duplicate_request",
    "implied_nak_seq_err",
    "local_ack_timeout_err",
    "np_cnp_sent",
    "np_ecn_marked_roce_packets",
    "out_of_buffer",
    "out_of_sequence",
    "packet_seq_err",
    "req_cqe_error",
    "rnr_nak_retry_err",
    "roce_slow_restart",
    "rp_cnp_handled",
    "rp_cnp_ignored",
)
LACP_IN_SYNC = 0x3D  # activity, aggregation, sync, collecting, distributing (slow rate)
LACP_DEFAULTED = 0x41  # activity, defaulted: no LACPDU from the partner
ROOT_PORT_ID = ("8086", "352a")
SWITCH_PORT_ID = ("1000", "c030")
GEN4 = "16.0 GT/s PCIe"
VF_DEVICE_ID = "101e"  # ConnectX Family mlx5Gen Virtual Function
POD_NETDEV = "net1"  # a VF's netdev inside a pod's netns (Multus' default name)


@dataclass(frozen=True)
class NicSpec:
    """One RDMA device. With ``bond`` set it is a RoCE LAG over two PCI functions."""

    name: str  # RDMA device name, e.g. mlx5_0 or mlx5_bond_0
    pci_address: str  # the function that carries the RDMA device
    uverbs: int  # index of its uverbs char device (need not match the name)
    netdevs: tuple[str, ...] = ("eth0",)  # the PCI functions' netdevs
    bond: str = ""  # bond master netdev, e.g. bond0 ("" = plain ports)
    vendor: str = "15b3"
    device_id: str = "1021"  # ConnectX-7
    driver: str = "mlx5_core"
    numa_node: int = 0
    link_layer: str = "Ethernet"
    ports: int = 1
    port_state: str = "ACTIVE"
    phys_state: str = "LinkUp"
    rate: str = "400 Gb/sec (4X NDR)"
    fw_ver: str = "28.39.1002"
    hca_type: str = "MT4129"
    node_guid: str = ""
    mac: str = ""
    ipv6: tuple[str, ...] = ()  # global addresses "2408:4000::11/64" on the IP netdev
    roce_v2_ipv6_gid: bool = True  # False: the IPv6 address has no RoCE v2 GID
    char_device: bool = True  # False: /dev/infiniband/uverbsN missing
    ipv4: tuple[str, ...] = ()  # addresses "10.0.0.11" carried by RoCE v1/v2 GIDs (IPv4-mapped)
    # PCIe: the bridges above the NIC (host bridge first; () = pci0000:00/0000:00:<bus % 32>.0)
    pcie_path: tuple[str, ...] = ()
    pcie_speed: str = GEN5  # current_link_speed ("Unknown" for a link that is down)
    pcie_width: int = 16
    pcie_max_speed: str = GEN5
    pcie_max_width: int = 16
    mtu: int = 4200  # every netdev of the NIC (and its bond)
    members_down: tuple[str, ...] = ()  # netdevs with no carrier (bond members: MII down too)
    bond_mode: str = "802.3ad"
    lacp_churned: tuple[str, ...] = ()  # bond members whose LACP partner sends nothing
    trust: str = "dscp"  # qos/trust (MLNX_OFED); "" = no such file (upstream mlx5)
    ecn: tuple[int, ...] = (0, 1, 2, 3, 4, 5, 6, 7)  # priorities with RoCE ECN on (np and rp)
    ecn_sysfs: bool = True  # False: no ecn/ directory (upstream mlx5)
    counters: Mapping[str, int] = field(default_factory=dict)  # port counters that are not 0
    ipv6_first: bool = False  # the IPv6 addresses were configured first: their GIDs precede the IPv4 ones
    vfs: int = 0  # SR-IOV VFs enabled on the (first) PF
    vf_rdma: tuple[str, ...] = ()  # RDMA devices of VFs 0, 1, ... bound to mlx5_core (idle: netdev down)
    vf_in_pod: tuple[str, ...] = ()  # those of vf_rdma whose netdev is in a pod's netns (in use)

    @property
    def ip_netdev(self) -> str:
        """The netdev that carries the IP addresses and owns the GIDs."""
        return self.bond or self.netdevs[0]


@dataclass(frozen=True)
class GpuSpec:
    """One NVIDIA GPU (an H800-class GH100 by default), idle: its link speed is down to Gen1."""

    address: str
    numa_node: int = 0
    pcie_path: tuple[str, ...] = ()  # as NicSpec.pcie_path
    device_id: str = "2324"
    pcie_speed: str = "2.5 GT/s PCIe"
    pcie_width: int = 16
    pcie_max_speed: str = GEN5
    pcie_max_width: int = 16


_Spec = TypeVar("_Spec", NicSpec, GpuSpec)


def _specs_from_dicts(spec: type[_Spec], key: str, items: Iterable[Mapping[str, Any]]) -> tuple[_Spec, ...]:
    """``nics``/``gpus`` of a spec file: each item's keys checked against the dataclass, lists as tuples."""
    allowed = {f.name for f in fields(spec)}
    specs = []
    for i, item in enumerate(items):
        bad = sorted(set(item) - allowed)
        if bad:
            raise ValueError(f"{key}[{i}]: unknown key(s) {bad}; allowed: {sorted(allowed)}")
        kwargs: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in item.items()}
        specs.append(spec(**kwargs))
    return tuple(specs)


@dataclass(frozen=True)
class NodeSpec:
    nics: tuple[NicSpec, ...]
    modules: tuple[str, ...] = DEFAULT_MODULES
    driver_version: str = "24.10-1.1.4"
    netns_mode: str = "shared"  # shared | exclusive | "" (parameter absent)
    ipv6_disabled: tuple[str, ...] = ()  # netdevs with disable_ipv6=1 ("all" for every one)
    routes: bool = True  # a compute-network route per IPv6 prefix
    rdma_cm: bool = True
    gpus: tuple[GpuSpec, ...] = ()
    kernel_release: str = "5.15.0-119-generic"  # /proc/sys/kernel/osrelease
    nvidia_driver: str = ""  # /sys/module/nvidia/version; "" = the NVIDIA driver is not loaded
    nvidia_open: bool = False  # the open kernel modules (DMA-BUF capable from R515)
    nvidia_peermem: bool = False  # nvidia_peermem loaded
    runtime: str = "containerd"  # containerd | dockerd | crio | "" (none installed)
    runtime_memlock: str = "unlimited"  # its Max locked memory ("unlimited" or bytes); "" = not running
    unit_memlock: str = "infinity"  # LimitMEMLOCK= of its drop-in; "" = no drop-in (systemd's default)
    pcie_bridge_width: Mapping[str, int] = field(default_factory=dict)  # bridge address -> current_link_width

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> NodeSpec:
        """Build from plain data (JSON/YAML spec files used by molecule)."""
        node_keys = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - node_keys)
        if unknown:
            raise ValueError(f"unknown node spec key(s) {unknown}; allowed: {sorted(node_keys)}")
        kwargs: dict[str, Any] = {}
        for key, value in data.items():
            if key == "nics":
                kwargs[key] = _specs_from_dicts(NicSpec, key, value)
            elif key == "gpus":
                kwargs[key] = _specs_from_dicts(GpuSpec, key, value)
            elif key == "pcie_bridge_width":
                kwargs[key] = dict(value)
            else:
                kwargs[key] = tuple(value) if isinstance(value, list) else value
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def lingjun_node(
    nics: int = 4,
    bond: bool = True,
    numa_nodes: int = 2,
    link_layer: str = "Ethernet",
    ipv6: bool = True,
    port_state: str = "ACTIVE",
    extra_non_mellanox: bool = False,
    gpus_per_nic: int = 2,
) -> NodeSpec:
    """A Lingjun-shaped GPU node: ``nics`` RDMA devices (bonded RoCE pairs by default)
    spread over ``numa_nodes`` NUMA nodes, each with a global IPv6 compute address, and
    ``gpus_per_nic`` NVIDIA GPUs under the same PCIe switch as each NIC (8 GPUs, 4 per NUMA
    node, by default): host bridge ``pci0000:<b>`` -> root port ``0000:<b>:01.0`` -> switch
    upstream port ``0000:<b+1>:00.0`` -> one downstream port per device on bus ``<b+2>`` ->
    GPUs on ``<b+3>``, ``<b+4>``, ... and the NIC last (``0000:1a:00.0`` for the first switch).

    uverbs numbering is deliberately rotated against the RDMA device numbering, as on
    nodes where a device was unbound and rebound.
    """
    specs = []
    gpus = []
    per_numa = max(1, -(-nics // max(1, numa_nodes)))
    for i in range(nics):
        bus = 0x1A + 0x20 * i
        numa = i // per_numa if numa_nodes > 0 else -1
        root = bus - 3 - gpus_per_nic  # the root bus of this NIC's switch
        ports = (f"pci0000:{root:02x}", f"0000:{root:02x}:01.0", f"0000:{root + 1:02x}:00.0")
        for k in range(gpus_per_nic):
            gpus.append(
                GpuSpec(
                    address=f"0000:{root + 3 + k:02x}:00.0",
                    numa_node=numa,
                    pcie_path=(*ports, f"0000:{root + 2:02x}:{k:02x}.0"),
                )
            )
        netdevs: tuple[str, ...]
        if bond:
            name, netdevs, master = f"mlx5_bond_{i}", (f"eth{2 * i}", f"eth{2 * i + 1}"), f"bond{i}"
        else:
            name, netdevs, master = f"mlx5_{i}", (f"eth{i}",), ""
        specs.append(
            NicSpec(
                name=name,
                pci_address=f"0000:{bus:02x}:00.0",
                uverbs=(i + 1) % nics,
                netdevs=netdevs,
                bond=master,
                numa_node=numa,
                link_layer=link_layer,
                port_state=port_state,
                phys_state="LinkUp" if port_state == "ACTIVE" else "Disabled",
                rate="400 Gb/sec (4X NDR)" if link_layer == "InfiniBand" else "200 Gb/sec (4X HDR)",
                ipv6=(f"2408:4005:300:{i:x}::11/64",) if ipv6 and link_layer == "Ethernet" else (),
                pcie_path=(*ports, f"0000:{root + 2:02x}:{gpus_per_nic:02x}.0"),
                mtu=4200 if link_layer == "Ethernet" else 4092,  # IPoIB datagram mode: 4096 - 4
            )
        )
    if extra_non_mellanox:
        specs.append(
            NicSpec(
                name="irdma0",
                pci_address="0000:f1:00.0",
                uverbs=nics,
                netdevs=("ens9f0",),
                vendor="8086",
                device_id="1592",
                driver="ice",
                numa_node=-1,
                rate="100 Gb/sec (4X EDR)",
                fw_ver="4.40",
                hca_type="",
                mtu=1500,
                trust="",
                ecn_sysfs=False,
            )
        )
    return NodeSpec(nics=tuple(specs), gpus=tuple(gpus), nvidia_driver="535.161.08", nvidia_peermem=True)


def dgx_h100_node() -> NodeSpec:
    """A DGX H100-style node: 8 x ConnectX-7 InfiniBand (NDR, one per GPU under its PCIe switch,
    IPoIB netdevs) for compute, and 2 ConnectX-7 Ethernet storage ports at MTU 1500 with trust pcp
    (the storage network's settings, not RoCE compute ones), each under a root port of its own."""
    base = lingjun_node(nics=8, bond=False, link_layer="InfiniBand", ipv6=False, gpus_per_nic=1)
    compute = tuple(
        replace(n, netdevs=(f"ibp{int(n.pci_address.split(':')[1], 16)}s0",), ipv4=(), rate="400 Gb/sec (4X NDR)")
        for n in base.nics
    )
    storage = tuple(
        NicSpec(
            name=f"mlx5_{8 + k}",
            pci_address=f"0000:{0xA0 + 0x10 * k:02x}:00.0",
            uverbs=8 + k,
            netdevs=(f"enp{0xA0 + 0x10 * k}s0np0",),
            numa_node=k,
            rate="200 Gb/sec (4X HDR)",
            ipv4=(f"192.168.100.{11 + k}",),
            pcie_path=(f"pci0000:{0x9D + 0x10 * k:02x}", f"0000:{0x9D + 0x10 * k:02x}:01.0"),
            mtu=1500,
            trust="pcp",
        )
        for k in range(2)
    )
    return replace(base, nics=compute + storage)


def roce_lag_active_backup_node(nics: int = 2) -> NodeSpec:
    """ConnectX-6 Dx (PCIe Gen4) RoCE LAG pairs in active-backup mode, IPv4 RoCE."""
    base = lingjun_node(nics=nics, ipv6=False)
    changed = tuple(
        replace(
            n,
            device_id="101d",
            hca_type="MT4125",
            fw_ver="22.39.1002",
            bond_mode="active-backup",
            rate="100 Gb/sec (4X EDR)",
            ipv4=(f"10.{i}.0.11",),
            pcie_speed=GEN4,
            pcie_max_speed=GEN4,
        )
        for i, n in enumerate(base.nics)
    )
    return replace(base, nics=changed)


def sriov_node() -> NodeSpec:
    """Two plain RoCE PFs with 8 VFs each: on each PF, VF 0 bound to mlx5_core on the host and idle
    (netdev down, port DOWN), VF 1 in a pod's netns (its GIDs on the pod's netdev)."""
    base = lingjun_node(nics=2, bond=False)
    vfs = (("mlx5_2", "mlx5_3"), ("mlx5_4", "mlx5_5"))
    changed = tuple(
        replace(n, ipv4=(f"10.{i}.0.11",), vfs=8, vf_rdma=vfs[i], vf_in_pod=vfs[i][1:]) for i, n in enumerate(base.nics)
    )
    return replace(base, nics=changed)


def numa0_gpus_node() -> NodeSpec:
    """The Lingjun node with every GPU on NUMA node 0 (the NICs on 0 and 1): each GPU still shares
    its PCIe switch with a NIC."""
    base = lingjun_node()
    return replace(base, gpus=tuple(replace(g, numa_node=0) for g in base.gpus))


def ipv4_roce_node(extra_ipv6: bool = False) -> NodeSpec:
    """4 RoCE LAG pairs with an IPv4 address each (no IPv6). ``extra_ipv6``: one NIC (mlx5_bond_1) also
    has an IPv6 address, configured first, which moves its IPv4 RoCE v2 GID from index 3 to 5."""
    base = lingjun_node(ipv6=False)
    nics = [replace(n, ipv4=(f"10.0.{i}.11",)) for i, n in enumerate(base.nics)]
    if extra_ipv6:
        nics[1] = replace(nics[1], ipv6=("2001:db8:1::11/64",), ipv6_first=True)
    return replace(base, nics=tuple(nics))


def grace_node() -> NodeSpec:
    """A Grace-style layout (GB200 compute tray): 2 NUMA nodes, each with 2 ConnectX-7 RoCE NICs and 2
    GPUs, every device under a root port of its own in a PCI domain of its own (no PCIe switch): GPUs
    and NICs meet at the NUMA level only."""
    nics, gpus = [], []
    for i in range(4):
        dom = 2 * i
        nics.append(
            NicSpec(
                name=f"mlx5_{i}",
                pci_address=f"{dom:04x}:01:00.0",
                uverbs=i,
                netdevs=(f"enP{dom}p1s0f0np0",),
                numa_node=i // 2,
                ipv4=(f"10.{i}.0.11",),
                pcie_path=(f"pci{dom:04x}:00", f"{dom:04x}:00:00.0"),
            )
        )
        gpus.append(
            GpuSpec(
                address=f"{dom + 1:04x}:01:00.0",
                numa_node=i // 2,
                device_id="2941",
                pcie_path=(f"pci{dom + 1:04x}:00", f"{dom + 1:04x}:00:00.0"),
            )
        )
    return NodeSpec(nics=tuple(nics), gpus=tuple(gpus), nvidia_driver="570.124.06", nvidia_peermem=True)


def many_nics_node(nics: int = 33) -> NodeSpec:
    """``nics`` ConnectX-7 RoCE NICs (``mlx5_0``...), each under a root port of its own host bridge
    (``pci0000:<b>``), half on each NUMA node, with an IPv6 compute address each; no GPUs. More NICs than
    a DRA counter set holds (32): what the DRA driver must still publish."""
    specs = []
    for i in range(nics):
        bus = 0x10 + 2 * i
        specs.append(
            NicSpec(
                name=f"mlx5_{i}",
                pci_address=f"0000:{bus + 1:02x}:00.0",
                uverbs=i,
                netdevs=(f"eth{i}",),
                numa_node=0 if i < -(-nics // 2) else 1,
                rate="200 Gb/sec (4X HDR)",
                ipv6=(f"2408:4005:301:{i:x}::11/64",),
                pcie_path=(f"pci0000:{bus:02x}", f"0000:{bus:02x}:01.0"),
            )
        )
    return NodeSpec(nics=tuple(specs))


# The node shapes a validation must get right, by name (the tests pair each with its expected verdict).
SHAPES: Mapping[str, Callable[[], NodeSpec]] = {
    "lingjun": lingjun_node,
    "dgx-h100": dgx_h100_node,
    "roce-lag-active-backup": roce_lag_active_backup_node,
    "sriov": sriov_node,
    "numa0-gpus": numa0_gpus_node,
    "ipv4-roce": ipv4_roce_node,
    "ipv4-roce-extra-ipv6": lambda: ipv4_roce_node(extra_ipv6=True),
    "grace": grace_node,
}


# --------------------------------------------------------------------------- writing


class FixtureNode:
    """A fixture root on disk: ``sys/``, ``proc/`` and ``dev/``."""

    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(root)
        self._inet6_written: list[tuple[str, ipaddress.IPv6Interface]] = []
        self._kernel = NodeSpec(nics=()).kernel_release

    @property
    def sysfs(self) -> str:
        return os.path.join(self.root, "sys")

    @property
    def procfs(self) -> str:
        return os.path.join(self.root, "proc")

    @property
    def dev(self) -> str:
        return os.path.join(self.root, "dev")

    # -- low level ----------------------------------------------------------------

    def _write(self, path: str, text: str) -> None:
        """Atomic replace, so a concurrent reader never sees a half-written attribute."""
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w", encoding="utf-8", errors="surrogateescape") as fh:  # raw bytes, as the kernel writes names
            fh.write(text + "\n")
        os.replace(tmp, path)

    @staticmethod
    def _rewrite(path: str, text: str) -> None:
        """Rewrite an existing attribute in place (same inode); a reader may see a torn value for an
        instant, which PortStateReader re-reads."""
        data = (text + "\n").encode()
        fd = os.open(path, os.O_WRONLY)
        try:
            os.pwrite(fd, data, 0)
            os.ftruncate(fd, len(data))
        finally:
            os.close(fd)

    def _symlink(self, link: str, target: str) -> None:
        """Relative symlink link -> target, as the kernel makes them."""
        os.makedirs(os.path.dirname(link), exist_ok=True)
        rel = os.path.relpath(target, os.path.dirname(link))
        if os.path.lexists(link):
            os.unlink(link)
        os.symlink(rel, link)

    def _pci_dir(self, bdf: str, path: tuple[str, ...], numa: int) -> str:
        """The function's directory under ``devices/``, writing the bridges above it on the way.
        ``path`` () puts it below a root port per bus of ``pci0000:00`` (the layout of older fixtures)."""
        if not path:
            bus = bdf.split(":")[1]
            path = ("pci0000:00", f"0000:00:{int(bus, 16) % 32:02x}.0")
        directory = os.path.join(self.sysfs, "devices", path[0])
        for depth, bridge in enumerate(path[1:]):
            directory = os.path.join(directory, bridge)
            if not os.path.exists(os.path.join(directory, "class")):
                ident = ROOT_PORT_ID if depth == 0 else SWITCH_PORT_ID
                self._pci_attrs(directory, ident[0], ident[1], "060400", numa, (GEN5, 16, GEN5, 16))
        return os.path.join(directory, bdf)

    def _pci_attrs(
        self, pci: str, vendor: str, device: str, klass: str, numa: int, link: tuple[str, int, str, int]
    ) -> None:
        """A PCI function's identity, NUMA node and PCIe link attributes (pci-sysfs.c)."""
        self._write(os.path.join(pci, "vendor"), f"0x{vendor}")
        self._write(os.path.join(pci, "device"), f"0x{device}")
        self._write(os.path.join(pci, "class"), f"0x{klass}")
        self._write(os.path.join(pci, "numa_node"), str(numa))
        for name, value in zip(
            ("current_link_speed", "current_link_width", "max_link_speed", "max_link_width"), link, strict=True
        ):
            self._write(os.path.join(pci, name), str(value))
        self._symlink(os.path.join(self.sysfs, "bus", "pci", "devices", os.path.basename(pci)), pci)

    def _bind(self, pci: str, driver: str) -> None:
        drv = os.path.join(self.sysfs, "bus", "pci", "drivers", driver)
        os.makedirs(drv, exist_ok=True)
        self._symlink(os.path.join(pci, "driver"), drv)
        self._symlink(os.path.join(drv, os.path.basename(pci)), pci)

    # -- NICs ---------------------------------------------------------------------

    def _pci_function(self, nic: NicSpec, bdf: str) -> str:
        pci = self._pci_dir(bdf, nic.pcie_path, nic.numa_node)
        link = (nic.pcie_speed, nic.pcie_width, nic.pcie_max_speed, nic.pcie_max_width)
        self._pci_attrs(pci, nic.vendor, nic.device_id, "020000", nic.numa_node, link)
        if nic.driver:
            self._bind(pci, nic.driver)
        return pci

    def add_gpu(self, gpu: GpuSpec) -> None:
        pci = self._pci_dir(gpu.address, gpu.pcie_path, gpu.numa_node)
        link = (gpu.pcie_speed, gpu.pcie_width, gpu.pcie_max_speed, gpu.pcie_max_width)
        self._pci_attrs(pci, "10de", gpu.device_id, "030200", gpu.numa_node, link)
        self._bind(pci, "nvidia")

    def _netdev(self, ifname: str, pci: str | None, mac: str, mtu: int = 1500, up: bool = True) -> str:
        if pci:
            ndir = os.path.join(pci, "net", ifname)
            self._symlink(os.path.join(ndir, "device"), pci)
        else:
            ndir = os.path.join(self.sysfs, "devices", "virtual", "net", ifname)
        self._write(os.path.join(ndir, "operstate"), "up" if up else "down")
        self._write(os.path.join(ndir, "carrier"), "1" if up else "0")
        self._write(os.path.join(ndir, "carrier_changes"), "2" if up else "3")
        self._write(os.path.join(ndir, "mtu"), str(mtu))
        self._write(os.path.join(ndir, "address"), mac)
        self._write(os.path.join(ndir, "ifindex"), str(self._ifindex(ifname)))
        self._symlink(os.path.join(self.sysfs, "class", "net", ifname), ndir)
        return ndir

    def _qos(self, ndir: str, nic: NicSpec) -> None:
        """MLNX_OFED's per-netdev QoS files: qos/trust and ecn/roce_{np,rp}/enable/<prio> (en_sysfs.c)."""
        if nic.trust:
            self._write(os.path.join(ndir, "qos", "trust"), nic.trust)
        if nic.ecn_sysfs:
            for point in ("roce_np", "roce_rp"):
                for prio in range(8):
                    self._write(os.path.join(ndir, "ecn", point, "enable", str(prio)), "1" if prio in nic.ecn else "0")

    def _bond(self, nic: NicSpec, bond_dir: str, mac: str) -> None:
        """The bond's sysfs (bonding/) and /proc/net/bonding/<bond> as bond_procfs.c prints it to a
        reader without CAP_NET_ADMIN, and each slave's bonding_slave/ (bond_sysfs_slave.c)."""
        number, words = BOND_MODES[nic.bond_mode]
        lacp = nic.bond_mode == "802.3ad"
        self._write(os.path.join(bond_dir, "bonding", "mode"), f"{nic.bond_mode} {number}")
        self._write(os.path.join(bond_dir, "bonding", "slaves"), " ".join(nic.netdevs))
        up = any(n not in nic.members_down for n in nic.netdevs)
        self._write(os.path.join(bond_dir, "bonding", "mii_status"), "up" if up else "down")
        lines = [f"Ethernet Channel Bonding Driver: v{self._kernel}", "", f"Bonding Mode: {words}"]
        if nic.bond_mode in ("balance-xor", "802.3ad"):
            lines.append("Transmit Hash Policy: layer3+4 (1)")
        if nic.bond_mode in ("active-backup", "balance-tlb", "balance-alb"):
            active = next((n for n in nic.netdevs if n not in nic.members_down), "None")
            lines += ["Primary Slave: None", f"Currently Active Slave: {active}"]
        lines += [
            f"MII Status: {'up' if up else 'down'}",
            "MII Polling Interval (ms): 100",
            "Up Delay (ms): 0",
            "Down Delay (ms): 0",
            "Peer Notification Delay (ms): 0",
        ]
        if lacp:
            lines += [
                "",
                "802.3ad info",
                "LACP active: on",
                "LACP rate: slow",
                "Min links: 0",
                "Aggregator selection policy (ad_select): stable",
            ]
        for ifname in nic.netdevs:
            down, churned = ifname in nic.members_down, ifname in nic.lacp_churned or ifname in nic.members_down
            lines += [
                "",
                f"Slave Interface: {ifname}",
                f"MII Status: {'down' if down else 'up'}",
                "Speed: Unknown" if down else "Speed: 200000 Mbps",
                "Duplex: Unknown" if down else "Duplex: full",
                f"Link Failure Count: {1 if down else 0}",
                f"Permanent HW addr: {mac}",
                "Slave queue ID: 0",
            ]
            slave_dir = os.path.join(self.sysfs, "class", "net", ifname, "bonding_slave")
            self._write(os.path.join(slave_dir, "mii_status"), "down" if down else "up")
            self._write(os.path.join(slave_dir, "link_failure_count"), "1" if down else "0")
            aggregator = "2" if churned else "1"  # a port without a partner gets an aggregator of its own
            if lacp:
                lines += [
                    f"Aggregator ID: {aggregator}",
                    "Actor Churn State: none",
                    f"Partner Churn State: {'churned' if churned else 'none'}",
                    "Actor Churned Count: 0",
                    f"Partner Churned Count: {1 if churned else 0}",
                ]
            self._write(os.path.join(slave_dir, "ad_aggregator_id"), aggregator if lacp else "N/A")
            partner = str(LACP_DEFAULTED if churned else LACP_IN_SYNC) if lacp else "N/A"
            self._write(os.path.join(slave_dir, "ad_actor_oper_port_state"), str(LACP_IN_SYNC) if lacp else "N/A")
            self._write(os.path.join(slave_dir, "ad_partner_oper_port_state"), partner)
        self._write(os.path.join(self.procfs, "net", "bonding", nic.bond), "\n".join(lines))

    def _counters(self, port_dir: str, nic: NicSpec) -> None:
        for name in PORT_COUNTERS:
            self._write(os.path.join(port_dir, "counters", name), str(nic.counters.get(name, 0)))
        for name in HW_COUNTERS:
            self._write(os.path.join(port_dir, "hw_counters", name), str(nic.counters.get(name, 0)))
        self._write(os.path.join(port_dir, "hw_counters", "lifespan"), "10")
        for name, value in nic.counters.items():
            if name not in PORT_COUNTERS and name not in HW_COUNTERS:
                self._write(os.path.join(port_dir, "hw_counters", name), str(value))

    def bump_counter(self, nic: str, counter: str, by: int = 1, port: int = 1) -> int:
        """Move a port counter on (in place, as the device does); its new value."""
        base = os.path.join(self.sysfs, "class", "infiniband", nic, "ports", str(port))
        path = os.path.join(base, "counters", counter)
        if not os.path.exists(path):
            path = os.path.join(base, "hw_counters", counter)
        value = int(Path(path).read_text(encoding="ascii")) + by
        self._rewrite(path, str(value))
        return value

    def flap_netdev(self, ifname: str, times: int = 1) -> int:
        """The netdev lost and regained its carrier ``times`` times: carrier_changes moves by 2 each."""
        path = os.path.join(self.sysfs, "class", "net", ifname, "carrier_changes")
        value = int(Path(path).read_text(encoding="ascii")) + 2 * times
        self._rewrite(path, str(value))
        return value

    def _ifindex(self, ifname: str) -> int:
        return 2 + sum(ord(c) for c in ifname) % 1000

    @staticmethod
    def _mac(nic: NicSpec) -> str:
        if nic.mac:
            return nic.mac
        bus = int(nic.pci_address.split(":")[1], 16)
        return f"b8:ce:f6:{bus:02x}:00:01"

    @staticmethod
    def _link_local_gid(mac: str) -> str:
        octets = [int(x, 16) for x in mac.split(":")]
        octets[0] ^= 0x02
        eui = [*octets[:3], 0xFF, 0xFE, *octets[3:]]
        return ipaddress.IPv6Address(bytes([0xFE, 0x80] + [0] * 6 + eui)).exploded

    def _gid_entries(self, nic: NicSpec, mac: str) -> list[tuple[str, str]]:
        """The port's GID table as the kernel fills it: the link-local GIDs, then one (v1, v2) pair per
        address in the order the addresses were configured (roce_gid_mgmt.c adds them as they come)."""
        if nic.link_layer != "Ethernet":
            guid = nic.node_guid or "b8ce:f603:00a1:2b3c"
            return [(f"fe80:0000:0000:0000:{guid}", "IB/RoCE v1")]
        ll = self._link_local_gid(mac)
        v4: list[tuple[str, str]] = []
        for address in nic.ipv4:
            gid = ipaddress.IPv6Address(b"\0" * 10 + b"\xff\xff" + ipaddress.IPv4Address(address).packed).exploded
            v4 += [(gid, "IB/RoCE v1"), (gid, "RoCE v2")]
        v6: list[tuple[str, str]] = []
        for cidr in nic.ipv6:
            gid = ipaddress.IPv6Interface(cidr).ip.exploded
            v6.append((gid, "IB/RoCE v1"))
            if nic.roce_v2_ipv6_gid:
                v6.append((gid, "RoCE v2"))
        return [(ll, "IB/RoCE v1"), (ll, "RoCE v2"), *(v6 + v4 if nic.ipv6_first else v4 + v6)]

    def _gids(self, port_dir: str, link_layer: str, entries: list[tuple[str, str]], ndev: str) -> None:
        for i in range(max(len(entries), 4)):
            gid, gtype = entries[i] if i < len(entries) else ("0000:" * 7 + "0000", "")
            self._write(os.path.join(port_dir, "gids", str(i)), gid)
            if link_layer == "Ethernet":
                self._write(os.path.join(port_dir, "gid_attrs", "types", str(i)), gtype)
                self._write(os.path.join(port_dir, "gid_attrs", "ndevs", str(i)), ndev if gtype else "")

    def add_nic(self, nic: NicSpec) -> None:
        mac = self._mac(nic)
        bus = int(nic.pci_address.split(":")[1], 16)
        functions = [nic.pci_address]
        if nic.bond:  # second PF of the LAG pair
            functions.append(nic.pci_address[:-1] + "1")
        pci_dirs = [self._pci_function(nic, bdf) for bdf in functions]
        bond_dir = ""
        if nic.bond:
            up = any(n not in nic.members_down for n in nic.netdevs)
            bond_dir = self._netdev(nic.bond, None, mac, nic.mtu, up=up)
        for i, ifname in enumerate(nic.netdevs):
            ndir = self._netdev(
                ifname, pci_dirs[min(i, len(pci_dirs) - 1)], mac, nic.mtu, ifname not in nic.members_down
            )
            if nic.link_layer == "Ethernet":
                self._qos(ndir, nic)
            if bond_dir:
                self._symlink(os.path.join(ndir, "master"), bond_dir)
                self._symlink(os.path.join(bond_dir, f"lower_{ifname}"), ndir)
        if bond_dir:
            self._bond(nic, bond_dir, mac)
        ib = os.path.join(pci_dirs[0], "infiniband", nic.name)
        self._symlink(os.path.join(ib, "device"), pci_dirs[0])
        self._write(os.path.join(ib, "node_guid"), nic.node_guid or f"b8ce:f603:00{bus:02x}:2b3c")
        self._write(os.path.join(ib, "node_type"), "1: CA")
        self._write(os.path.join(ib, "fw_ver"), nic.fw_ver)
        self._write(os.path.join(ib, "hca_type"), nic.hca_type)
        for port in range(1, nic.ports + 1):
            pdir = os.path.join(ib, "ports", str(port))
            self._write(os.path.join(pdir, "link_layer"), nic.link_layer)
            self._write(os.path.join(pdir, "rate"), nic.rate)
            self._write(os.path.join(pdir, "phys_state"), f"{_PHYS_CODES.get(nic.phys_state, 3)}: {nic.phys_state}")
            self._write(os.path.join(pdir, "state"), f"{_STATE_CODES.get(nic.port_state, 1)}: {nic.port_state}")
            self._gids(pdir, nic.link_layer, self._gid_entries(nic, mac), nic.ip_netdev)
            self._counters(pdir, nic)
        self._symlink(os.path.join(self.sysfs, "class", "infiniband", nic.name), ib)
        # Char devices: sysfs class entries with ibdev files, and nodes under dev/.
        self._char(pci_dirs[0], "infiniband_verbs", f"uverbs{nic.uverbs}", nic.name, None, 192 + nic.uverbs)
        for port in range(1, nic.ports + 1):
            idx = nic.uverbs * nic.ports + port - 1
            self._char(pci_dirs[0], "infiniband_mad", f"umad{idx}", nic.name, port, idx)
            self._char(pci_dirs[0], "infiniband_mad", f"issm{idx}", nic.name, port, 64 + idx)
        if not nic.char_device:
            os.unlink(os.path.join(self.dev, "infiniband", f"uverbs{nic.uverbs}"))
        # IPv6 on the IP netdev.
        for addr in nic.ipv6:
            self._add_inet6(nic.ip_netdev, addr)
        for k in range(nic.vfs):
            self._add_vf(nic, pci_dirs[0], k)

    @staticmethod
    def vf_address(pf: str, k: int) -> str:
        """VF k of the PF at ``pf``: functions 2, 3, ... after the two PFs (then the next device numbers)."""
        head, _, devfn = pf.rpartition(":")
        slot = int(devfn.split(".")[0], 16) * 8 + 2 + k
        return f"{head}:{slot // 8:02x}.{slot % 8}"

    def _add_vf(self, nic: NicSpec, pf_dir: str, k: int) -> None:
        """VF k beside its PF (drivers/pci/iov.c links), its link status reserved: Unknown/0; with an
        RDMA device when ``vf_rdma`` names one: idle on the host (netdev down, port DOWN) or in a pod
        (port ACTIVE, its GIDs on the pod's netdev)."""
        address = self.vf_address(nic.pci_address, k)
        vf_dir = os.path.join(os.path.dirname(pf_dir), address)
        link = ("Unknown", 0, nic.pcie_max_speed, nic.pcie_max_width)
        self._pci_attrs(vf_dir, nic.vendor, VF_DEVICE_ID, "020000", nic.numa_node, link)
        self._bind(vf_dir, nic.driver or "mlx5_core")
        self._symlink(os.path.join(vf_dir, "physfn"), pf_dir)
        self._symlink(os.path.join(pf_dir, f"virtfn{k}"), vf_dir)
        self._write(os.path.join(pf_dir, "sriov_totalvfs"), "16")
        self._write(os.path.join(pf_dir, "sriov_numvfs"), str(nic.vfs))
        if k >= len(nic.vf_rdma):
            return
        name = nic.vf_rdma[k]
        in_pod = name in nic.vf_in_pod
        bus = int(nic.pci_address.split(":")[1], 16)
        mac = f"02:ce:f6:{bus:02x}:{k:02x}:01"
        ndev = POD_NETDEV
        if not in_pod:
            ndev = f"{nic.netdevs[0]}v{k}"
            self._netdev(ndev, vf_dir, mac, 1500, up=False)
        vf = replace(nic, name=name, pci_address=address, netdevs=(ndev,), bond="", counters={})
        ib = os.path.join(vf_dir, "infiniband", name)
        self._symlink(os.path.join(ib, "device"), vf_dir)
        self._write(os.path.join(ib, "node_guid"), f"b8ce:f603:{bus:02x}{k:02x}:0001")
        self._write(os.path.join(ib, "fw_ver"), nic.fw_ver)
        self._write(os.path.join(ib, "hca_type"), nic.hca_type)
        state, phys = ("ACTIVE", "LinkUp") if in_pod else ("DOWN", "Disabled")
        pdir = os.path.join(ib, "ports", "1")
        self._write(os.path.join(pdir, "link_layer"), nic.link_layer)
        self._write(os.path.join(pdir, "rate"), nic.rate)
        self._write(os.path.join(pdir, "phys_state"), f"{_PHYS_CODES[phys]}: {phys}")
        self._write(os.path.join(pdir, "state"), f"{_STATE_CODES[state]}: {state}")
        pod_addresses = {"ipv4": (f"172.16.{bus}.{k + 10}",), "ipv6": (f"2408:4005:3ff:{bus:x}::{k + 10}/64",)}
        self._gids(
            pdir,
            nic.link_layer,
            self._gid_entries(replace(vf, **(pod_addresses if in_pod else {"ipv4": (), "ipv6": ()})), mac),
            ndev,
        )
        self._counters(pdir, vf)
        self._symlink(os.path.join(self.sysfs, "class", "infiniband", name), ib)
        index = 64 + len(os.listdir(os.path.join(self.sysfs, "class", "infiniband_verbs")))
        self._char(vf_dir, "infiniband_verbs", f"uverbs{index}", name, None, 192 + index)

    def _char(self, pci: str, klass: str, name: str, ibdev: str, port: int | None, minor: int) -> None:
        cdir = os.path.join(pci, klass, name)
        self._write(os.path.join(cdir, "ibdev"), ibdev)
        self._write(os.path.join(cdir, "dev"), f"231:{minor}")
        if port is not None:
            self._write(os.path.join(cdir, "port"), str(port))
        self._symlink(os.path.join(cdir, "device"), pci)
        self._symlink(os.path.join(self.sysfs, "class", klass, name), cdir)
        self._write(os.path.join(self.dev, "infiniband", name), "")

    def remove_nic(self, name: str) -> None:
        """Unbind: the RDMA device and its char devices vanish; the PCI function stays."""
        link = os.path.join(self.sysfs, "class", "infiniband", name)
        ib = os.path.realpath(link)
        # The kernel deactivates the device's kernfs nodes: a descriptor kept open on a port's
        # state then fails its reads (ENODEV). A plain file cannot fail a read; emptied, it reads
        # b"", which PortStateReader takes the same way (sysfs never serves an empty state).
        ports = os.path.join(ib, "ports")
        for entry in os.listdir(ports) if os.path.isdir(ports) else []:
            state = os.path.join(ports, entry, "state")
            if os.path.isfile(state):
                os.truncate(state, 0)
        os.unlink(link)
        shutil.rmtree(ib, ignore_errors=True)
        for klass in ("infiniband_verbs", "infiniband_mad"):
            kdir = os.path.join(self.sysfs, "class", klass)
            for entry in sorted(os.listdir(kdir)) if os.path.isdir(kdir) else []:
                cdir = os.path.join(kdir, entry)
                ibdev_file = os.path.join(cdir, "ibdev")
                if (
                    os.path.isfile(ibdev_file)
                    and Path(ibdev_file).read_text(encoding="utf-8", errors="surrogateescape").strip() == name
                ):
                    real = os.path.realpath(cdir)
                    os.unlink(cdir)
                    shutil.rmtree(real, ignore_errors=True)
                    devnode = os.path.join(self.dev, "infiniband", entry)
                    if os.path.lexists(devnode):
                        os.unlink(devnode)

    def set_port_state(self, name: str, state: str, port: int = 1) -> None:
        pdir = os.path.join(self.sysfs, "class", "infiniband", name, "ports", str(port))
        # In place, not replaced: a sysfs attribute keeps its inode and a reader that keeps it open
        # (PortStateReader) sees the new value at its next pread, as on a real node.
        self._rewrite(os.path.join(pdir, "state"), f"{_STATE_CODES[state]}: {state}")
        phys = "LinkUp" if state in ("ACTIVE", "ACTIVE_DEFER") else "Disabled"
        self._write(os.path.join(pdir, "phys_state"), f"{_PHYS_CODES[phys]}: {phys}")

    # -- node-wide ----------------------------------------------------------------

    def _add_inet6(self, ifname: str, cidr: str) -> None:
        iface = ipaddress.IPv6Interface(cidr)
        path = os.path.join(self.procfs, "net", "if_inet6")
        line = f"{iface.ip.packed.hex()} {self._ifindex(ifname):08x} {iface.network.prefixlen:02x} 00 80 {ifname:>8}"
        self._append_line(path, line)
        self._inet6_written.append((ifname, iface))

    def _append_line(self, path: str, line: str) -> None:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "a", encoding="utf-8", errors="surrogateescape") as fh:
            fh.write(line + "\n")

    def write(self, spec: NodeSpec) -> FixtureNode:
        """Write the whole node from scratch (an existing root is replaced)."""
        if os.path.exists(self.root):
            shutil.rmtree(self.root)
        os.makedirs(self.root)
        self._inet6_written = []
        self._kernel = spec.kernel_release
        for d in ("class/infiniband", "class/infiniband_verbs", "class/infiniband_mad", "class/net"):
            os.makedirs(os.path.join(self.sysfs, d), exist_ok=True)
        os.makedirs(os.path.join(self.dev, "infiniband"), exist_ok=True)
        for module in spec.modules:
            os.makedirs(os.path.join(self.sysfs, "module", module), exist_ok=True)
        if "mlx5_core" in spec.modules and spec.driver_version:
            self._write(os.path.join(self.sysfs, "module", "mlx5_core", "version"), spec.driver_version)
        if "ib_core" in spec.modules and spec.netns_mode:
            value = "Y" if spec.netns_mode == "shared" else "N"
            self._write(os.path.join(self.sysfs, "module", "ib_core", "parameters", "netns_mode"), value)
        if spec.rdma_cm:
            self._write(os.path.join(self.dev, "infiniband", "rdma_cm"), "")
            # rdma_ucm's misc device, as the kernel shows it in sysfs
            misc = os.path.join(self.sysfs, "devices", "virtual", "misc", "rdma_cm")
            self._write(os.path.join(misc, "dev"), "10:58")
            self._symlink(os.path.join(self.sysfs, "class", "misc", "rdma_cm"), misc)
        # Loopback line first, as on every node.
        self._append_line(
            os.path.join(self.procfs, "net", "if_inet6"),
            f"{'0' * 31}1 00000001 80 10 80       lo",
        )
        for nic in spec.nics:
            self.add_nic(nic)
        for gpu in spec.gpus:
            self.add_gpu(gpu)
        for bridge, width in spec.pcie_bridge_width.items():
            where = os.path.join(self.sysfs, "bus", "pci", "devices", bridge)
            if not os.path.isdir(where):
                raise KeyError(f"pcie_bridge_width: no PCI function {bridge} on the node")
            self._write(os.path.join(where, "current_link_width"), str(width))
        self._write_numa_nodes(spec)
        self._write_host(spec)
        self._write_ipv6_conf(spec)
        self._write_routes(spec)
        with open(os.path.join(self.root, "node-spec.json"), "w", encoding="utf-8") as fh:
            json.dump(spec.to_dict(), fh, indent=2)
        return self

    def _write_numa_nodes(self, spec: NodeSpec) -> None:
        """``devices/system/node``: node0 .. the highest NUMA node a device sits on (node0 alone when
        none has one), and ``online``/``possible`` in the kernel's list form (drivers/base/node.c)."""
        highest = max([0, *(n.numa_node for n in spec.nics), *(g.numa_node for g in spec.gpus)])
        base = os.path.join(self.sysfs, "devices", "system", "node")
        for node in range(highest + 1):
            os.makedirs(os.path.join(base, f"node{node}"), exist_ok=True)
        nodes = "0" if highest == 0 else f"0-{highest}"
        self._write(os.path.join(base, "online"), nodes)
        self._write(os.path.join(base, "possible"), nodes)

    def reboot(self) -> str:
        """A new boot ID (``/proc/sys/kernel/random/boot_id``), as after a reboot; returns it."""
        boot_id = str(uuid.uuid4())
        self._write(os.path.join(self.procfs, "sys", "kernel", "random", "boot_id"), boot_id)
        return boot_id

    def _write_host(self, spec: NodeSpec) -> None:
        """Kernel release and boot ID, NVIDIA driver and peer-memory modules, and the container runtime."""
        self._write(os.path.join(self.procfs, "sys", "kernel", "osrelease"), spec.kernel_release)
        self.reboot()
        if spec.nvidia_driver:
            self._write(os.path.join(self.sysfs, "module", "nvidia", "version"), spec.nvidia_driver)
            flavour = (
                "NVIDIA UNIX Open Kernel Module for x86_64" if spec.nvidia_open else "NVIDIA UNIX x86_64 Kernel Module"
            )
            banner = f"NVRM version: {flavour}  {spec.nvidia_driver}  Release Build  (dvs-builder@U16-I3-B03-4-3)"
            self._write(
                os.path.join(self.procfs, "driver", "nvidia", "version"), f"{banner}\nGCC version:  gcc version 11.4.0"
            )
        if spec.nvidia_peermem:
            os.makedirs(os.path.join(self.sysfs, "module", "nvidia_peermem"), exist_ok=True)
            os.makedirs(os.path.join(self.sysfs, "kernel", "mm", "memory_peers", "nv_mem"), exist_ok=True)
        if not spec.runtime:
            return
        unit = {"containerd": "containerd.service", "dockerd": "docker.service", "crio": "crio.service"}[spec.runtime]
        self._write(
            os.path.join(self.root, "usr", "lib", "systemd", "system", unit),
            "[Unit]\nDescription=container runtime\n\n[Service]\nExecStart=/usr/bin/"
            + spec.runtime
            + "\nDelegate=yes\nKillMode=process\nLimitNPROC=infinity\nLimitCORE=infinity\n\n"
            "[Install]\nWantedBy=multi-user.target",
        )
        if spec.unit_memlock:
            self._write(
                os.path.join(self.root, "etc", "systemd", "system", f"{unit}.d", "10-memlock.conf"),
                f"[Service]\nLimitMEMLOCK={spec.unit_memlock}",
            )
        if spec.runtime_memlock:
            pid = 1234
            self._write(os.path.join(self.procfs, str(pid), "comm"), spec.runtime)
            rows = [
                ("Max cpu time", "unlimited", "unlimited", "seconds"),
                ("Max open files", "1048576", "1048576", "files"),
                ("Max locked memory", spec.runtime_memlock, spec.runtime_memlock, "bytes"),
            ]
            table = [f"{'Limit':<25} {'Soft Limit':<20} {'Hard Limit':<20} {'Units':<10}"]
            table += [f"{name:<25} {soft:<20} {hard:<20} {unit_name:<10}" for name, soft, hard, unit_name in rows]
            self._write(os.path.join(self.procfs, str(pid), "limits"), "\n".join(table))

    def _write_ipv6_conf(self, spec: NodeSpec) -> None:
        conf = os.path.join(self.procfs, "sys", "net", "ipv6", "conf")
        disabled = set(spec.ipv6_disabled)
        ifnames = ["all", "default", "lo", *sorted(os.listdir(os.path.join(self.sysfs, "class", "net")))]
        for ifname in ifnames:
            flag = "1" if ifname in disabled or ("all" in disabled and ifname != "lo") else "0"
            self._write(os.path.join(conf, ifname, "disable_ipv6"), flag)

    def _write_routes(self, spec: NodeSpec) -> None:
        lines = []
        for ifname, iface in self._inet6_written:
            lines.append(self._route_line(ipaddress.IPv6Address("fe80::"), 64, ifname))
            if spec.routes:
                lines.append(self._route_line(iface.network.network_address, iface.network.prefixlen, ifname))
        lines.append(self._route_line(ipaddress.IPv6Address("::1"), 128, "lo"))
        path = os.path.join(self.procfs, "net", "ipv6_route")
        self._write(path, "\n".join(lines))

    @staticmethod
    def _route_line(dest: ipaddress.IPv6Address, plen: int, ifname: str) -> str:
        zero = "0" * 32
        return f"{dest.packed.hex()} {plen:02x} {zero} 00 {zero} 00000100 00000001 00000000 00000001 {ifname:>8}"


def write_node(root: str, spec: NodeSpec | None = None) -> FixtureNode:
    """Write ``spec`` (default: a 4-NIC bonded Lingjun node) under ``root``."""
    return FixtureNode(root).write(spec or lingjun_node())


def with_nic_changes(spec: NodeSpec, name: str, **changes: Any) -> NodeSpec:
    """Copy of ``spec`` with one NIC's fields changed (for broken-node fixtures)."""
    nics = tuple(replace(n, **changes) if n.name == name else n for n in spec.nics)
    if nics == spec.nics:
        raise KeyError(f"no NIC named {name} in the spec")
    return replace(spec, nics=nics)


__all__ = [
    "DEFAULT_MODULES",
    "SHAPES",
    "FixtureNode",
    "GpuSpec",
    "NicSpec",
    "NodeSpec",
    "dgx_h100_node",
    "grace_node",
    "ipv4_roce_node",
    "lingjun_node",
    "numa0_gpus_node",
    "roce_lag_active_backup_node",
    "sriov_node",
    "with_nic_changes",
    "write_node",
]
