"""The one reader of PCI functions from sysfs: identity, NUMA node, place in the PCIe tree, link state.

Standard library only (shipped to nodes as module_utils). Every attribute read here is world-
readable. The kernel writes them in ``drivers/pci/pci-sysfs.c``:

- ``vendor``/``device`` ``0x15b3``, ``class`` ``0x020000`` (``0x03xxxx`` display, ``0x0604xx`` bridge);
- ``current_link_speed``/``max_link_speed``: ``pci_speed_string()`` text, ``"16.0 GT/s PCIe"`` since
  Linux 5.x (``"8 GT/s"``, ``"Unknown speed"`` before, ``"Unknown"`` for a link that is down);
- ``current_link_width``/``max_link_width``: the lane count (``0`` while the link is down);
  present only on PCIe devices (the link attributes are hidden for conventional PCI).

A function's place in the tree is the directory chain under ``/sys/devices``: the host bridge
(``pci0000:15``), the root port directly below it, then any switch ports, then the function.
"""

from __future__ import annotations

import contextlib
import os
import re
from dataclasses import dataclass

from . import text
from .sysfs import MAX_NUMA_NODES, read_text

GPU_VENDOR = "10de"  # NVIDIA
_SPEED = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*GT/s")
_ADDRESS = re.compile(r"^[0-9a-f]{4,}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")


def parse_speed(value: str | None) -> float | None:
    """``"16.0 GT/s PCIe"`` / ``"8 GT/s"`` -> GT/s; ``"Unknown"`` or absent -> None."""
    match = _SPEED.match(value or "")
    return float(match.group(1)) if match else None


def _width(value: str | None) -> int | None:
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


@dataclass(frozen=True)
class Link:
    """A PCIe link as the function's own attributes show it (``None``: the kernel said Unknown)."""

    speed: float | None  # GT/s now
    width: int | None  # lanes now (0: link down)
    max_speed: float | None  # what the function can do
    max_width: int | None
    speed_text: str = ""  # the kernel's words, for messages
    port_max_speed: float | None = None  # what the port above it can do (None: a root-complex device)
    port_max_width: int | None = None

    @property
    def expected_speed(self) -> float | None:
        """The speed the link should train to: the lower of the function's and its port's maxima."""
        return _lower(self.max_speed, self.port_max_speed)

    @property
    def expected_width(self) -> int | None:
        low = _lower(self.max_width, self.port_max_width)
        return None if low is None else int(low)


def _lower(a: float | None, b: float | None) -> float | None:
    values = [v for v in (a, b) if v is not None]
    return min(values) if values else None


@dataclass(frozen=True)
class Function:
    """One PCI function."""

    address: str  # "0000:18:00.0"
    vendor: str  # "10de" (no 0x)
    device: str
    pci_class: str  # "030200" (no 0x)
    numa_node: int | None  # None when the kernel reports -1
    driver: str
    path: tuple[str, ...]  # host bridge first ("pci0000:15"), then bridges, the function last
    link: Link | None  # None: not a PCIe function (no link attributes)

    @property
    def is_gpu(self) -> bool:
        """An NVIDIA display/3D controller (class 0x03xxxx); NVSwitches (0x0680xx) are not GPUs."""
        return self.vendor == GPU_VENDOR and self.pci_class.startswith("03")

    def to_dict(self) -> dict[str, object]:
        link = self.link
        return {
            "address": self.address,
            "vendor": self.vendor,
            "device": self.device,
            "class": self.pci_class,
            "numa_node": self.numa_node,
            "driver": self.driver,
            "path": list(self.path),
            "link": None
            if link is None
            else {
                "speed": link.speed_text or None,
                "speed_gts": link.speed,
                "width": link.width,
                "max_speed_gts": link.max_speed,
                "max_width": link.max_width,
                "expected_speed_gts": link.expected_speed,
                "expected_width": link.expected_width,
            },
        }


def _hex(value: str | None) -> str:
    value = (value or "").lower()
    return value[2:] if value.startswith("0x") else value


def _numa(value: str | None) -> int | None:
    try:
        numa = int(value) if value is not None else -1
    except ValueError:
        return None
    return numa if 0 <= numa < MAX_NUMA_NODES else None


def _tree_path(real: str) -> tuple[str, ...]:
    """``/sys/devices/pci0000:15/0000:15:01.0/.../0000:18:00.0`` -> from the host bridge down."""
    parts = [text.from_fs(p) for p in real.split(os.sep) if p]
    for i, part in enumerate(parts):
        if part.startswith("pci") and ":" in part:
            return tuple(parts[i:])
    return tuple(parts[-1:])


def _read_link(directory: str) -> tuple[float | None, int | None, float | None, int | None, str]:
    speed_text = read_text(os.path.join(directory, "current_link_speed"))
    return (
        parse_speed(speed_text),
        _width(read_text(os.path.join(directory, "current_link_width"))),
        parse_speed(read_text(os.path.join(directory, "max_link_speed"))),
        _width(read_text(os.path.join(directory, "max_link_width"))),
        speed_text or "",
    )


def read_function(sysfs_root: str, address: str) -> Function | None:
    """``/sys/bus/pci/devices/<address>``, or None when there is no such function."""
    link = os.path.join(sysfs_root, "bus", "pci", "devices", text.to_fs(address))
    real = os.path.realpath(link)
    if not os.path.isdir(real):
        return None
    path = _tree_path(real)
    pcie: Link | None = None
    if os.path.exists(os.path.join(real, "current_link_width")):
        speed, width, max_speed, max_width, speed_text = _read_link(real)
        parent = os.path.dirname(real)
        port_speed = port_width = None
        if len(path) > 2 and _ADDRESS.match(path[-2]):  # the port above it (not the host bridge)
            _, _, port_speed, port_width, _ = _read_link(parent)
        pcie = Link(speed, width, max_speed, max_width, speed_text, port_speed, port_width)
    driver = ""
    with contextlib.suppress(OSError):
        driver = text.from_fs(os.path.basename(os.readlink(os.path.join(real, "driver"))))
    return Function(
        address=address,
        vendor=_hex(read_text(os.path.join(real, "vendor"))),
        device=_hex(read_text(os.path.join(real, "device"))),
        pci_class=_hex(read_text(os.path.join(real, "class"))),
        numa_node=_numa(read_text(os.path.join(real, "numa_node"))),
        driver=driver,
        path=path,
        link=pcie,
    )


def uplinks(sysfs_root: str, fn: Function) -> list[Function]:
    """The links between ``fn`` and its root port, each read at its lower end: a path runs host
    bridge, root port, then an (upstream port, downstream port) pair per PCIe switch, then the
    function, so every second step from the root port down is the lower end of a link (a switch's
    upstream port: its link to the root port or to the switch above; the link below a downstream
    port is the next device's own). The root port shows the same link as the device below it.
    Functions without link attributes are left out."""
    out = []
    for address in fn.path[2:-1:2]:
        if _ADDRESS.match(address):
            found = read_function(sysfs_root, address)
            if found is not None and found.link is not None:
                out.append(found)
    return out


def list_addresses(sysfs_root: str) -> list[str]:
    try:
        entries = os.listdir(os.path.join(sysfs_root, "bus", "pci", "devices"))
    except OSError:
        return []
    return sorted(text.from_fs(e) for e in entries)


def read_gpus(sysfs_root: str) -> list[Function]:
    """Every NVIDIA GPU (vendor 0x10de, class 0x03xxxx) of the node, by PCI address. Only the
    vendor and class of the other functions are read."""
    gpus = []
    devices = os.path.join(sysfs_root, "bus", "pci", "devices")
    for address in list_addresses(sysfs_root):
        base = os.path.join(devices, text.to_fs(address))
        if _hex(read_text(os.path.join(base, "vendor"))) != GPU_VENDOR:
            continue
        if not _hex(read_text(os.path.join(base, "class"))).startswith("03"):
            continue
        found = read_function(sysfs_root, address)
        if found is not None:
            gpus.append(found)
    return gpus
