"""The one reader of a node's RDMA NICs from sysfs (and char devices from /dev).

Everything that looks at a node -- the plugin, the Ansible validation roles (through
``module_utils``), the local default -- reads it through this module, so it must stay
standard-library only. Every function takes the roots as parameters so tests and
molecule can point them at fixture trees laid out exactly like the kernel's,
symlinks included.
"""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field

from . import text

LOG = logging.getLogger(__name__)

NODE_DEV_DIR = "/dev/infiniband"
RDMA_CM = "rdma_cm"

# ib_core port states as the kernel prints them ("4: ACTIVE").
PORT_STATES = {
    0: "NOP",
    1: "DOWN",
    2: "INIT",
    3: "ARMED",
    4: "ACTIVE",
    5: "ACTIVE_DEFER",
}
PHYS_STATES = {
    1: "Sleep",
    2: "Polling",
    3: "Disabled",
    4: "PortConfigurationTraining",
    5: "LinkUp",
    6: "LinkErrorRecovery",
    7: "Phy Test",
}
ACTIVE_STATES = frozenset({"ACTIVE", "ACTIVE_DEFER"})
ZERO_GID = "0000:0000:0000:0000:0000:0000:0000:0000"
MAX_NUMA_NODES = 1024


class SysfsError(Exception):
    """A sysfs entry exists but cannot be understood."""


@dataclass(frozen=True)
class Gid:
    index: int
    gid: str
    type: str  # "RoCE v2", "IB/RoCE v1", "" when the kernel has no gid_attrs
    ndev: str  # netdev that owns the GID, "" when none

    @property
    def is_ipv6(self) -> bool:
        """True for a GID that carries a real IPv6 address (not IPv4-mapped, not link-local)."""
        return not self.gid.startswith("0000:0000:0000:0000:0000:ffff:") and not self.gid.startswith("fe80:")


@dataclass(frozen=True)
class Port:
    number: int
    state: str  # "ACTIVE", "DOWN", ...
    phys_state: str  # "LinkUp", "Disabled", ...
    link_layer: str  # "Ethernet" | "InfiniBand"
    rate: str  # "400 Gb/sec (4X NDR)"
    gids: tuple[Gid, ...] = ()  # the non-empty entries of the GID table
    gid_table_len: int = 0  # entries under gids/, empty ones included (ibv_port_attr.gid_tbl_len)

    @property
    def active(self) -> bool:
        return self.state in ACTIVE_STATES

    @property
    def rate_gbps(self) -> float | None:
        try:
            return float(self.rate.split()[0])
        except (IndexError, ValueError):
            return None


@dataclass(frozen=True)
class CharDevice:
    name: str  # "uverbs0"
    node_path: str  # path on the node, always under /dev/infiniband
    present: bool  # found under the dev root (fixtures may hold plain files)
    port: int | None = None  # umad/issm belong to a port


@dataclass(frozen=True)
class Nic:
    """One RDMA device (``/sys/class/infiniband/<name>``) and the PCI function behind it."""

    name: str
    pci_address: str
    vendor: str  # "15b3" (no 0x)
    device_id: str  # "1021"
    driver: str  # "mlx5_core", "" when unbound
    numa_node: int | None  # None when the kernel reports -1
    netdevs: tuple[str, ...]
    node_guid: str
    fw_ver: str
    hca_type: str
    ports: tuple[Port, ...]
    uverbs: CharDevice | None
    umad: tuple[CharDevice, ...] = ()
    issm: tuple[CharDevice, ...] = ()
    problems: tuple[str, ...] = field(default=(), compare=False)
    # SR-IOV (drivers/pci/iov.c, pci_iov_add_virtfn: a VF's "physfn" link, the PF's "virtfnN" links)
    physfn: str = ""  # PCI address of the physical function when this device is on a VF, else ""
    vfs: int = 0  # VFs enabled on this device's PCI function (its virtfnN links)

    @property
    def is_vf(self) -> bool:
        return bool(self.physfn)

    @property
    def link_layers(self) -> tuple[str, ...]:
        return tuple(sorted({p.link_layer for p in self.ports}))

    @property
    def compute_netdevs(self) -> tuple[str, ...]:
        """Netdevs that carry the NIC's IP traffic: the owners of its GIDs (RoCE v2 owners
        first; the bond for a RoCE LAG), else its first netdev (InfiniBand has no owners)."""
        owners: list[str] = []
        for roce_v2_pass in (True, False):
            for port in self.ports:
                for gid in port.gids:
                    if gid.ndev and gid.ndev not in owners and (gid.type == "RoCE v2") == roce_v2_pass:
                        owners.append(gid.ndev)
        if not owners and self.netdevs:
            owners.append(self.netdevs[0])
        return tuple(owners)

    def char_devices(self, umad: bool = False, issm: bool = False) -> list[CharDevice]:
        """The char devices a container using this NIC gets: its uverbs (when present under the
        dev root), plus its umad/issm devices when asked for."""
        chars = [self.uverbs] if self.uverbs is not None and self.uverbs.present else []
        if umad:
            chars.extend(c for c in self.umad if c.present)
        if issm:
            chars.extend(c for c in self.issm if c.present)
        return chars

    @property
    def all_ports_active(self) -> bool:
        return bool(self.ports) and all(p.active for p in self.ports)

    def to_dict(self) -> dict[str, object]:
        """Plain data for JSON output and Ansible facts."""
        return {
            "name": self.name,
            "pci_address": self.pci_address,
            "vendor": self.vendor,
            "device_id": self.device_id,
            "driver": self.driver,
            "numa_node": self.numa_node,
            "netdevs": list(self.netdevs),
            "node_guid": self.node_guid,
            "fw_ver": self.fw_ver,
            "hca_type": self.hca_type,
            "ports": [
                {
                    "number": p.number,
                    "state": p.state,
                    "phys_state": p.phys_state,
                    "link_layer": p.link_layer,
                    "rate": p.rate,
                    "gids": [{"index": g.index, "gid": g.gid, "type": g.type, "ndev": g.ndev} for g in p.gids],
                }
                for p in self.ports
            ],
            "uverbs": _chardev_dict(self.uverbs),
            "umad": [_chardev_dict(c) for c in self.umad],
            "issm": [_chardev_dict(c) for c in self.issm],
            "problems": list(self.problems),
            "physfn": self.physfn or None,
            "vfs": self.vfs,
        }


def _chardev_dict(dev: CharDevice | None) -> dict[str, object] | None:
    if dev is None:
        return None
    return {"name": dev.name, "path": dev.node_path, "present": dev.present, "port": dev.port}


# --------------------------------------------------------------------------- helpers


def read_text(path: str) -> str | None:
    """Stripped contents of a sysfs/procfs file decoded by the one policy (:mod:`.text`), or None
    when absent or unreadable."""
    try:
        with open(path, "rb") as fh:
            return text.decode(fh.read()).strip()
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:  # EACCES, EIO (sysfs returns EIO for some attributes), ELOOP
        LOG.warning("cannot read %s: %s", text.from_fs(path), exc)
        return None


def _listdir(path: str) -> list[str]:
    """Entry names, decoded like file contents (:func:`.text.from_fs`)."""
    try:
        return sorted(text.from_fs(e) for e in os.listdir(path))
    except OSError:
        return []


def _path(base: str, *names: str) -> str:
    """``base`` joined with decoded names turned back into the path components they came from."""
    return os.path.join(base, *(text.to_fs(n) for n in names))


def _link_name(path: str) -> str:
    """Basename of a symlink's target (driver -> .../drivers/mlx5_core), "" when absent."""
    try:
        return text.from_fs(os.path.basename(os.readlink(path)))
    except OSError:
        return ""


def _coded(value: str | None, names: dict[int, str]) -> str:
    """Parse "4: ACTIVE" (or a bare "4") -> "ACTIVE".

    The code is authoritative: a missing or non-numeric code, an unknown code, or a name
    that contradicts the code (": ACTIVE", "1: ACTIVE") is garbage -> "UNKNOWN", so a
    garbled attribute can never read as an active port.
    """
    if not value:
        return "UNKNOWN"
    code, _, name = value.partition(":")
    code, name = code.strip(), name.strip()
    if not (code.isascii() and code.isdigit()):
        return "UNKNOWN"
    known = names.get(int(code))
    if known is None or (name and name != known):
        return "UNKNOWN"
    return known


def _hex_id(value: str | None) -> str:
    if not value:
        return ""
    value = value.lower()
    return value[2:] if value.startswith("0x") else value


def _int_or_none(value: str | None) -> int | None:
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


# --------------------------------------------------------------------------- char devices


def _present(dev_root: str, sysfs_entry: str, name: str) -> bool:
    """Does the char device node exist? With a dev root, look at ``<dev_root>/infiniband/<name>``.
    With an empty dev root, ask sysfs: devtmpfs creates the /dev node together with the sysfs
    entry's ``dev`` attribute (major:minor), so no host /dev has to be mounted to know it."""
    if dev_root:
        return os.path.exists(_path(dev_root, "infiniband", name))
    return os.path.isfile(os.path.join(sysfs_entry, "dev"))


def _char_devices(sysfs_root: str, dev_root: str, klass: str, prefix: str) -> dict[str, list[CharDevice]]:
    """Map ibdev -> char devices of one class, found through their ``ibdev`` file.

    Never assume uverbsN belongs to mlx5_N: the numbering differs once a NIC is
    unbound or a bond is formed. ``dev_root`` "" takes presence from sysfs (see ``_present``).
    """
    found: dict[str, list[CharDevice]] = {}
    class_dir = os.path.join(sysfs_root, "class", klass)
    for entry in _listdir(class_dir):
        if not entry.startswith(prefix) or not entry[len(prefix) :].isdigit():
            continue
        ibdev = read_text(_path(class_dir, entry, "ibdev"))
        if not ibdev:
            LOG.warning("%s/%s has no readable ibdev file; skipped", klass, entry)
            continue
        port = _int_or_none(read_text(_path(class_dir, entry, "port")))
        present = _present(dev_root, _path(class_dir, entry), entry)
        found.setdefault(ibdev, []).append(CharDevice(entry, f"{NODE_DEV_DIR}/{entry}", present, port))
    return found


def rdma_cm(dev_root: str, sysfs_root: str = "/sys") -> CharDevice:
    """The node-wide connection-manager device (a misc device of rdma_ucm: /sys/class/misc/rdma_cm)."""
    present = _present(dev_root, os.path.join(sysfs_root, "class", "misc", RDMA_CM), RDMA_CM)
    return CharDevice(RDMA_CM, f"{NODE_DEV_DIR}/{RDMA_CM}", present)


# --------------------------------------------------------------------------- ports


def _read_gids(port_dir: str) -> tuple[tuple[Gid, ...], int]:
    """The non-empty GIDs of a port and the length of its GID table."""
    gids = []
    table_len = 0
    for entry in _listdir(os.path.join(port_dir, "gids")):
        if not entry.isdigit():
            continue
        table_len = max(table_len, int(entry) + 1)
        gid = read_text(os.path.join(port_dir, "gids", entry))
        if not gid or gid == ZERO_GID:
            continue
        gtype = read_text(os.path.join(port_dir, "gid_attrs", "types", entry)) or ""
        ndev = read_text(os.path.join(port_dir, "gid_attrs", "ndevs", entry)) or ""
        gids.append(Gid(int(entry), gid.lower(), gtype, ndev))
    gids.sort(key=lambda g: g.index)
    return tuple(gids), table_len


def _read_ports(ibdev_dir: str) -> tuple[list[Port], list[str]]:
    ports, problems = [], []
    ports_dir = os.path.join(ibdev_dir, "ports")
    for entry in _listdir(ports_dir):
        if not entry.isdigit():
            continue
        pdir = os.path.join(ports_dir, entry)
        raw_state = read_text(os.path.join(pdir, "state"))
        state = _coded(raw_state, PORT_STATES)
        if state == "UNKNOWN":
            problems.append(f"port {entry}: unreadable state {raw_state!r}")
        gids, table_len = _read_gids(pdir)
        ports.append(
            Port(
                number=int(entry),
                state=state,
                phys_state=_coded(read_text(os.path.join(pdir, "phys_state")), PHYS_STATES),
                link_layer=read_text(os.path.join(pdir, "link_layer")) or "",
                rate=read_text(os.path.join(pdir, "rate")) or "",
                gids=gids,
                gid_table_len=table_len,
            )
        )
    ports.sort(key=lambda p: p.number)
    if not ports:
        problems.append("no ports under ports/")
    return ports, problems


# --------------------------------------------------------------------------- netdevs


def _netdevs(sysfs_root: str, pci_dir: str, ports: list[Port]) -> tuple[str, ...]:
    """Netdevs of the PCI function, their bond masters, and the GID owners (RoCE LAG)."""
    names: list[str] = []

    def add(name: str) -> None:
        if name and name not in names:
            names.append(name)

    for ifname in _listdir(os.path.join(pci_dir, "net")):
        add(ifname)
        master = _link_name(_path(sysfs_root, "class", "net", ifname, "master"))
        add(master)
        if master:  # the other slaves of a RoCE LAG bond
            for entry in _listdir(_path(sysfs_root, "class", "net", master)):
                if entry.startswith("lower_"):
                    add(entry.removeprefix("lower_"))
    for port in ports:
        for gid in port.gids:
            add(gid.ndev)
    return tuple(names)


# --------------------------------------------------------------------------- NICs


def netdev_ifindex(sysfs_root: str, name: str) -> int | None:
    """``/sys/class/net/<name>/ifindex``: with the index in the current netns it tells whether the
    sysfs tree and this process share a network namespace (link events then cover the netdev)."""
    return _int_or_none(read_text(_path(sysfs_root, "class", "net", name, "ifindex")))


def list_rdma_devices(sysfs_root: str = "/sys") -> list[str]:
    return _listdir(os.path.join(sysfs_root, "class", "infiniband"))


def read_nic(
    sysfs_root: str,
    name: str,
    dev_root: str = "/dev",
    uverbs: dict[str, list[CharDevice]] | None = None,
    umad: dict[str, list[CharDevice]] | None = None,
    issm: dict[str, list[CharDevice]] | None = None,
) -> Nic:
    """Read one RDMA device. Raises SysfsError when it cannot be identified at all."""
    ibdev_dir = _path(sysfs_root, "class", "infiniband", name)
    if not os.path.isdir(ibdev_dir):
        raise SysfsError(f"{text.from_fs(ibdev_dir)} is missing or a dangling symlink")
    pci_link = os.path.join(ibdev_dir, "device")
    pci_dir = os.path.realpath(pci_link)
    if not os.path.isdir(pci_dir):
        raise SysfsError(f"{text.from_fs(pci_link)} does not point at a PCI function")
    pci_address = text.from_fs(os.path.basename(pci_dir))
    vendor = _hex_id(read_text(os.path.join(pci_dir, "vendor")))
    if not vendor:
        raise SysfsError(f"{text.from_fs(pci_dir)}/vendor is missing or empty")
    ports, problems = _read_ports(ibdev_dir)
    numa = _int_or_none(read_text(os.path.join(pci_dir, "numa_node")))
    if numa is not None and numa >= MAX_NUMA_NODES:  # the kernel's MAX_NUMNODES is at most 1 << 10
        problems.append(f"numa_node {numa} is out of range; reporting no NUMA affinity")
        numa = None
    if uverbs is None:
        uverbs = _char_devices(sysfs_root, dev_root, "infiniband_verbs", "uverbs")
    if umad is None:
        umad = _char_devices(sysfs_root, dev_root, "infiniband_mad", "umad")
    if issm is None:
        issm = _char_devices(sysfs_root, dev_root, "infiniband_mad", "issm")
    verbs = uverbs.get(name, [])
    if not verbs:
        problems.append("no uverbs char device names it in its ibdev file")
    entries = _listdir(pci_dir)
    return Nic(
        name=name,
        pci_address=pci_address,
        vendor=vendor,
        device_id=_hex_id(read_text(os.path.join(pci_dir, "device"))),
        driver=_link_name(os.path.join(pci_dir, "driver")),
        numa_node=numa if numa is not None and numa >= 0 else None,
        netdevs=_netdevs(sysfs_root, pci_dir, ports),
        node_guid=read_text(os.path.join(ibdev_dir, "node_guid")) or "",
        fw_ver=read_text(os.path.join(ibdev_dir, "fw_ver")) or "",
        hca_type=read_text(os.path.join(ibdev_dir, "hca_type")) or "",
        ports=tuple(ports),
        uverbs=verbs[0] if verbs else None,
        umad=tuple(umad.get(name, [])),
        issm=tuple(issm.get(name, [])),
        problems=tuple(problems),
        physfn=_link_name(os.path.join(pci_dir, "physfn")),
        vfs=sum(1 for e in entries if e.startswith("virtfn") and e[6:].isdigit()),
    )


def read_nics(
    sysfs_root: str = "/sys", dev_root: str = "/dev", on_skip: Callable[[str, str], None] | None = None
) -> list[Nic]:
    """Every RDMA device on the node, sorted by name. Unidentifiable ones are skipped and passed
    to ``on_skip(name, reason)`` (the serving loop logs each once), else logged."""
    uverbs = _char_devices(sysfs_root, dev_root, "infiniband_verbs", "uverbs")
    umad = _char_devices(sysfs_root, dev_root, "infiniband_mad", "umad")
    issm = _char_devices(sysfs_root, dev_root, "infiniband_mad", "issm")
    nics = []
    for name in list_rdma_devices(sysfs_root):
        try:
            nics.append(read_nic(sysfs_root, name, dev_root, uverbs, umad, issm))
        except SysfsError as exc:
            if on_skip is not None:
                on_skip(name, str(exc))
            else:
                LOG.warning("RDMA device %s skipped: %s", name, exc)
    return nics


def read_port_states(sysfs_root: str, names: list[str]) -> dict[str, tuple[str, ...] | None]:
    """Cheap health probe: port states per NIC, None for a NIC that is gone."""
    result: dict[str, tuple[str, ...] | None] = {}
    for name in names:
        ports_dir = _path(sysfs_root, "class", "infiniband", name, "ports")
        entries = [e for e in _listdir(ports_dir) if e.isdigit()]
        if not entries:
            result[name] = None
            continue
        result[name] = tuple(
            _coded(read_text(os.path.join(ports_dir, e, "state")), PORT_STATES) for e in sorted(entries, key=int)
        )
    return result


class PortStateReader:
    """The fast health probe: the ``state`` attribute of every port of the given NICs, through
    descriptors opened once and re-read with ``pread`` at offset 0.

    sysfs builds an attribute's text afresh at every read from offset 0 (kernfs_fop_read_iter ->
    seq_read_iter -> sysfs_kf_seq_show in fs/kernfs/file.c and fs/sysfs/file.c), so one syscall per
    port sees the current state, with no path walk. When the RDMA device goes away the kernel
    deactivates the kernfs node and further reads fail (-ENODEV): :meth:`read` then returns None and
    the caller re-lists the NICs, which opens a new reader. Only root-readable sysfs, no new privilege.
    """

    def __init__(self, sysfs_root: str, names: list[str]) -> None:
        self._fds: list[tuple[str, int]] = []  # (NIC, fd) in NIC then port order
        self._shape: dict[str, int] = {}  # NIC -> number of ports
        self.failed = ""  # why opening failed (the caller re-lists); "" when every port opened
        self._raw: list[bytes] = []  # the bytes behind ``_states``
        self._states: dict[str, tuple[str, ...] | None] | None = None
        for name in names:
            ports_dir = _path(sysfs_root, "class", "infiniband", name, "ports")
            if not os.path.isdir(ports_dir):  # removed since it was listed: nothing to read would
                self.failed = f"{name} is gone"  # never fail, so the NIC would look present
                continue
            entries = sorted((e for e in _listdir(ports_dir) if e.isdigit()), key=int)
            self._shape[name] = len(entries)
            for entry in entries:
                path = os.path.join(ports_dir, entry, "state")
                try:
                    self._fds.append((name, os.open(path, os.O_RDONLY | os.O_CLOEXEC)))
                except OSError as exc:
                    self.failed = f"cannot open {text.from_fs(path)}: {exc}"

    def read(self) -> dict[str, tuple[str, ...] | None] | None:
        """Port states per NIC (None for a NIC with no ports), or None when a read failed.

        The very same dict as last time when no attribute's bytes changed: the idle probe then
        costs one ``pread`` per port and one comparison (issue 15), no parsing."""
        if self.failed:
            return None
        raw = []
        for name, fd in self._fds:
            try:
                data = os.pread(fd, 64, 0)
                if not data:  # never from a live attribute; a fixture's removed NIC (see remove_nic)
                    data = os.pread(fd, 64, 0)  # or a file caught mid-rewrite: once more
                    if not data:
                        raise OSError(errno.ENODEV, "the attribute reads empty")
            except OSError as exc:
                self.failed = f"cannot read a port state of {name}: {exc}"
                return None
            raw.append(data)
        if raw == self._raw and self._states is not None:
            return self._states
        states: dict[str, list[str]] = {name: [] for name in self._shape}
        for (name, fd), data in zip(self._fds, raw, strict=True):
            state = _coded(text.decode(data).strip(), PORT_STATES)
            if state == "UNKNOWN":  # a torn read of a file rewritten in place: read once more
                try:
                    state = _coded(text.decode(os.pread(fd, 64, 0)).strip(), PORT_STATES)
                except OSError as exc:
                    self.failed = f"cannot read a port state of {name}: {exc}"
                    return None
            states[name].append(state)
        self._raw = raw
        self._states = {name: tuple(found) if found else None for name, found in states.items()}
        return self._states

    def close(self) -> None:
        fds, self._fds = self._fds, []
        for _, fd in fds:
            os.close(fd)


def loaded_modules(sysfs_root: str, names: list[str]) -> dict[str, bool]:
    return {m: os.path.isdir(os.path.join(sysfs_root, "module", m)) for m in names}


def module_version(sysfs_root: str, module: str) -> str | None:
    return read_text(os.path.join(sysfs_root, "module", module, "version"))


def netns_mode(sysfs_root: str) -> str | None:
    """ "shared", "exclusive", or None when ib_core does not expose the parameter."""
    value = read_text(os.path.join(sysfs_root, "module", "ib_core", "parameters", "netns_mode"))
    if value is None:
        return None
    return "shared" if value in ("Y", "1") else "exclusive" if value in ("N", "0") else None


def parse_node_list(value: str) -> tuple[int, ...]:
    """The kernel's node list format (``bitmap_print_to_pagebuf``'s list form): ``0-1``, ``0,2-3``, ``0``.
    Raises ValueError for anything else."""
    nodes: set[int] = set()
    for part in value.strip().split(","):
        lo, sep, hi = part.partition("-")
        first, last = int(lo), int(hi) if sep else int(lo)
        if first < 0 or last < first or last >= MAX_NUMA_NODES:
            raise ValueError(f"{part!r} is not a NUMA node range")
        nodes.update(range(first, last + 1))
    return tuple(sorted(nodes))


def numa_nodes(sysfs_root: str) -> tuple[int, ...]:
    """The node's online NUMA nodes (``devices/system/node/online``, the list the kubelet's Topology
    Manager sees through cadvisor); () when absent or unreadable."""
    value = read_text(os.path.join(sysfs_root, "devices", "system", "node", "online"))
    if not value:
        return ()
    try:
        return parse_node_list(value)
    except ValueError:
        LOG.warning("cannot parse %s/devices/system/node/online: %r", sysfs_root, value)
        return ()
