"""Write kernel-shaped fixture nodes: sysfs, procfs and /dev trees, symlinks included.

There is no RDMA hardware on development and CI machines, so tests, molecule scenarios
and the local default point every reader at a tree written here. The layout follows the kernel
(see docs/design.md and rdma-sysfs.md): ``class/*`` entries are symlinks into
``devices/pci0000:00/...``, ``device`` and ``driver`` are symlinks, char devices are
found through ``ibdev`` files and their numbering deliberately does not follow the RDMA
device numbering. Standard library only.

A fixture root holds ``sys/``, ``proc/`` and ``dev/``.
"""

from __future__ import annotations

import ipaddress
import json
import os
import shutil
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

from .sysfs import PHYS_STATES, PORT_STATES

DEFAULT_MODULES = ("mlx5_core", "mlx5_ib", "ib_core", "ib_uverbs", "rdma_ucm")
_STATE_CODES = {v: k for k, v in PORT_STATES.items()}
_PHYS_CODES = {v: k for k, v in PHYS_STATES.items()}


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

    @property
    def ip_netdev(self) -> str:
        """The netdev that carries the IP addresses and owns the GIDs."""
        return self.bond or self.netdevs[0]


@dataclass(frozen=True)
class NodeSpec:
    nics: tuple[NicSpec, ...]
    modules: tuple[str, ...] = DEFAULT_MODULES
    driver_version: str = "24.10-1.1.4"
    netns_mode: str = "shared"  # shared | exclusive | "" (parameter absent)
    ipv6_disabled: tuple[str, ...] = ()  # netdevs with disable_ipv6=1 ("all" for every one)
    routes: bool = True  # a compute-network route per IPv6 prefix
    rdma_cm: bool = True

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> NodeSpec:
        """Build from plain data (JSON/YAML spec files used by molecule)."""
        node_keys = {f.name for f in fields(cls)}
        nic_keys = {f.name for f in fields(NicSpec)}
        unknown = sorted(set(data) - node_keys)
        if unknown:
            raise ValueError(f"unknown node spec key(s) {unknown}; allowed: {sorted(node_keys)}")
        kwargs: dict[str, Any] = {}
        for key, value in data.items():
            if key == "nics":
                nics = []
                for i, nic in enumerate(value):
                    bad = sorted(set(nic) - nic_keys)
                    if bad:
                        raise ValueError(f"nics[{i}]: unknown key(s) {bad}; allowed: {sorted(nic_keys)}")
                    nic_kwargs: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in nic.items()}
                    nics.append(NicSpec(**nic_kwargs))
                kwargs["nics"] = tuple(nics)
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
) -> NodeSpec:
    """A Lingjun-shaped GPU node: ``nics`` RDMA devices (bonded RoCE pairs by default)
    spread over ``numa_nodes`` NUMA nodes, each with a global IPv6 compute address.

    uverbs numbering is deliberately rotated against the RDMA device numbering, as on
    nodes where a device was unbound and rebound.
    """
    specs = []
    per_numa = max(1, -(-nics // max(1, numa_nodes)))
    for i in range(nics):
        bus = 0x1A + 0x20 * i
        numa = i // per_numa if numa_nodes > 0 else -1
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
            )
        )
    return NodeSpec(nics=tuple(specs))


# --------------------------------------------------------------------------- writing


class FixtureNode:
    """A fixture root on disk: ``sys/``, ``proc/`` and ``dev/``."""

    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(root)
        self._inet6_written: list[tuple[str, ipaddress.IPv6Interface]] = []

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

    def _pci_dir(self, bdf: str) -> str:
        # Root port per bus so paths look like the kernel's nested bridges.
        bus = bdf.split(":")[1]
        return os.path.join(self.sysfs, "devices", "pci0000:00", f"0000:00:{int(bus, 16) % 32:02x}.0", bdf)

    # -- NICs ---------------------------------------------------------------------

    def _pci_function(self, nic: NicSpec, bdf: str) -> str:
        pci = self._pci_dir(bdf)
        self._write(os.path.join(pci, "vendor"), f"0x{nic.vendor}")
        self._write(os.path.join(pci, "device"), f"0x{nic.device_id}")
        self._write(os.path.join(pci, "class"), "0x020000")
        self._write(os.path.join(pci, "numa_node"), str(nic.numa_node))
        if nic.driver:
            drv = os.path.join(self.sysfs, "bus", "pci", "drivers", nic.driver)
            os.makedirs(drv, exist_ok=True)
            self._symlink(os.path.join(pci, "driver"), drv)
            self._symlink(os.path.join(drv, bdf), pci)
        self._symlink(os.path.join(self.sysfs, "bus", "pci", "devices", bdf), pci)
        return pci

    def _netdev(self, ifname: str, pci: str | None, mac: str) -> str:
        if pci:
            ndir = os.path.join(pci, "net", ifname)
            self._symlink(os.path.join(ndir, "device"), pci)
        else:
            ndir = os.path.join(self.sysfs, "devices", "virtual", "net", ifname)
        self._write(os.path.join(ndir, "operstate"), "up")
        self._write(os.path.join(ndir, "address"), mac)
        self._write(os.path.join(ndir, "ifindex"), str(self._ifindex(ifname)))
        self._symlink(os.path.join(self.sysfs, "class", "net", ifname), ndir)
        return ndir

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

    def _gids(self, port_dir: str, nic: NicSpec, mac: str) -> None:
        entries: list[tuple[str, str]] = []
        if nic.link_layer == "Ethernet":
            ll = self._link_local_gid(mac)
            entries += [(ll, "IB/RoCE v1"), (ll, "RoCE v2")]
            for addr in nic.ipv6:
                gid = ipaddress.IPv6Interface(addr).ip.exploded
                entries.append((gid, "IB/RoCE v1"))
                if nic.roce_v2_ipv6_gid:
                    entries.append((gid, "RoCE v2"))
        else:
            guid = nic.node_guid or "b8ce:f603:00a1:2b3c"
            entries.append((f"fe80:0000:0000:0000:{guid}", "IB/RoCE v1"))
        for i in range(max(len(entries), 4)):
            gid, gtype = entries[i] if i < len(entries) else ("0000:" * 7 + "0000", "")
            self._write(os.path.join(port_dir, "gids", str(i)), gid)
            if nic.link_layer == "Ethernet":
                self._write(os.path.join(port_dir, "gid_attrs", "types", str(i)), gtype)
                self._write(os.path.join(port_dir, "gid_attrs", "ndevs", str(i)), nic.ip_netdev if gtype else "")

    def add_nic(self, nic: NicSpec) -> None:
        mac = self._mac(nic)
        bus = int(nic.pci_address.split(":")[1], 16)
        functions = [nic.pci_address]
        if nic.bond:  # second PF of the LAG pair
            functions.append(nic.pci_address[:-1] + "1")
        pci_dirs = [self._pci_function(nic, bdf) for bdf in functions]
        for i, ifname in enumerate(nic.netdevs):
            ndir = self._netdev(ifname, pci_dirs[min(i, len(pci_dirs) - 1)], mac)
            if nic.bond:
                bond_dir = self._netdev(nic.bond, None, mac)
                self._symlink(os.path.join(ndir, "master"), bond_dir)
                self._symlink(os.path.join(bond_dir, f"lower_{ifname}"), ndir)
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
            self._gids(pdir, nic, mac)
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
        self._write_ipv6_conf(spec)
        self._write_routes(spec)
        with open(os.path.join(self.root, "node-spec.json"), "w", encoding="utf-8") as fh:
            json.dump(spec.to_dict(), fh, indent=2)
        return self

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
    "FixtureNode",
    "NicSpec",
    "NodeSpec",
    "lingjun_node",
    "with_nic_changes",
    "write_node",
]
