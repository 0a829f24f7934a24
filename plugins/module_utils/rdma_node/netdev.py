"""The one reader of netdevs and Linux bonds (standard library only, no root needed).

Netdev attributes come from ``/sys/class/net/<if>/`` (``net/core/net-sysfs.c``): ``mtu``,
``operstate`` (RFC 2863 words: ``up``, ``down``, ``lowerlayerdown``, ...), ``carrier`` (``1``/``0``;
reading it on an interface that is administratively down fails with EINVAL, so it is None then)
and ``carrier_changes`` (since Linux 3.15).

A bond is read from its sysfs (``bonding/mode`` ``"802.3ad 4"``, ``bonding/slaves``) and from
``/proc/net/bonding/<bond>`` in the format of ``drivers/net/bonding/bond_procfs.c``: a master
block (``Bonding Mode:``, ``MII Status:``, the ``802.3ad info`` and, for CAP_NET_ADMIN only, the
``Active Aggregator Info``) then one block per slave starting at ``Slave Interface:`` with ``MII
Status``, ``Link Failure Count`` and, in 802.3ad mode, ``Aggregator ID`` (``N/A`` when the slave
is in none) and ``Actor/Partner Churn State`` (``none``, ``monitoring`` or ``churned``; kernels
before 4.x print no churn lines). Each slave's LACP partner state (IEEE 802.1AX bits) comes from
``/sys/class/net/<slave>/bonding_slave/ad_partner_oper_port_state`` (``bond_sysfs_slave.c``; no
capability needed, unlike the partner MAC in procfs).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

from . import text
from .sysfs import read_text

# LACP port state bits (IEEE 802.1AX; include/net/bond_3ad.h LACP_STATE_*)
LACP_SYNCHRONIZATION = 0x08
LACP_COLLECTING = 0x10
LACP_DISTRIBUTING = 0x20
LACP_DEFAULTED = 0x40
LACP_IN_SERVICE = LACP_SYNCHRONIZATION | LACP_COLLECTING | LACP_DISTRIBUTING
# bond_mode_name() words and the short names of bonding/mode (bond_options.c)
MODE_NAMES = {
    "load balancing (round-robin)": "balance-rr",
    "fault-tolerance (active-backup)": "active-backup",
    "load balancing (xor)": "balance-xor",
    "fault-tolerance (broadcast)": "broadcast",
    "IEEE 802.3ad Dynamic link aggregation": "802.3ad",
    "transmit load balancing": "balance-tlb",
    "adaptive load balancing": "balance-alb",
}
MODES = tuple(MODE_NAMES.values())


def _int(value: str | None) -> int | None:
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


@dataclass(frozen=True)
class Netdev:
    name: str
    exists: bool
    mtu: int | None = None
    operstate: str = ""  # "" when absent
    carrier: bool | None = None  # None: unreadable (the kernel refuses while the netdev is down)
    carrier_changes: int | None = None
    pci: bool = False  # backed by a PCI function (has a device link), i.e. not a bond or VLAN
    master: str = ""  # the bond it is enslaved to

    @property
    def link_up(self) -> bool:
        return self.operstate == "up" and self.carrier is True


def read_netdev(sysfs_root: str, name: str) -> Netdev:
    base = os.path.join(sysfs_root, "class", "net", text.to_fs(name))
    if not os.path.isdir(base):
        return Netdev(name, exists=False)
    carrier = read_text(os.path.join(base, "carrier"))
    master = ""
    with contextlib.suppress(OSError):
        master = text.from_fs(os.path.basename(os.readlink(os.path.join(base, "master"))))
    return Netdev(
        name=name,
        exists=True,
        mtu=_int(read_text(os.path.join(base, "mtu"))),
        operstate=read_text(os.path.join(base, "operstate")) or "",
        carrier=None if carrier not in ("0", "1") else carrier == "1",
        carrier_changes=_int(read_text(os.path.join(base, "carrier_changes"))),
        pci=os.path.exists(os.path.join(base, "device")),
        master=master,
    )


def read_carrier_changes(sysfs_root: str, name: str) -> int | None:
    return _int(read_text(os.path.join(sysfs_root, "class", "net", text.to_fs(name), "carrier_changes")))


@dataclass(frozen=True)
class Slave:
    name: str
    mii_status: str  # "up", "down", "going down", "going back"
    link_failure_count: int | None
    aggregator_id: str  # "" when not 802.3ad, "N/A" when in no aggregator
    actor_churn: str  # "" when the kernel prints none
    partner_churn: str
    partner_state: int | None  # LACP partner port state bits (sysfs), None when unknown

    @property
    def partner_in_service(self) -> bool | None:
        """Partner in sync, collecting and distributing, not running on defaults (None: unknown)."""
        if self.partner_state is None:
            return None
        return (self.partner_state & LACP_IN_SERVICE) == LACP_IN_SERVICE and not self.partner_state & LACP_DEFAULTED


@dataclass(frozen=True)
class Bond:
    name: str
    mode: str  # "802.3ad", "active-backup", ... ("" when unknown)
    mii_status: str
    slaves: tuple[Slave, ...]
    sysfs_slaves: tuple[str, ...]  # bonding/slaves
    proc: bool  # /proc/net/bonding/<bond> was read

    def to_dict(self) -> dict[str, object]:
        return {
            "name": self.name,
            "mode": self.mode,
            "mii_status": self.mii_status,
            "slaves": [
                {
                    "name": s.name,
                    "mii_status": s.mii_status,
                    "link_failure_count": s.link_failure_count,
                    "aggregator_id": s.aggregator_id or None,
                    "actor_churn": s.actor_churn or None,
                    "partner_churn": s.partner_churn or None,
                    "partner_state": s.partner_state,
                }
                for s in self.slaves
            ],
        }


def parse_bonding(proc_text: str) -> tuple[dict[str, str], list[dict[str, str]]]:
    """``/proc/net/bonding/<bond>`` -> (master fields, one dict of fields per slave block).

    The master's fields before ``802.3ad info`` and each slave's own fields keep their first
    value; indented lines (``details ... lacp pdu``, active aggregator) are left out."""
    master: dict[str, str] = {}
    slaves: list[dict[str, str]] = []
    current = master
    for line in proc_text.splitlines():
        if not line.strip() or line.startswith((" ", "\t")):
            continue
        key, sep, value = line.partition(":")
        if not sep:
            continue
        key, value = key.strip(), value.strip()
        if key == "Slave Interface":
            current = {"Slave Interface": value}
            slaves.append(current)
            continue
        current.setdefault(key, value)
    return master, slaves


def read_bond(sysfs_root: str, procfs_root: str, name: str) -> Bond | None:
    """The bond ``name``, or None when it is no bond (no ``bonding/`` directory)."""
    base = os.path.join(sysfs_root, "class", "net", text.to_fs(name))
    bonding = os.path.join(base, "bonding")
    if not os.path.isdir(bonding):
        return None
    mode_words = (read_text(os.path.join(bonding, "mode")) or "").split()
    sysfs_slaves = tuple((read_text(os.path.join(bonding, "slaves")) or "").split())
    proc_text = read_text(os.path.join(procfs_root, "net", "bonding", text.to_fs(name)))
    master, blocks = parse_bonding(proc_text or "")
    mode = mode_words[0] if mode_words else MODE_NAMES.get(master.get("Bonding Mode", "").split(" (")[0], "")
    slaves = []
    names = [b["Slave Interface"] for b in blocks] or list(sysfs_slaves)
    fields = {b["Slave Interface"]: b for b in blocks}
    for slave in names:
        block = fields.get(slave, {})
        state = read_text(
            os.path.join(sysfs_root, "class", "net", text.to_fs(slave), "bonding_slave", "ad_partner_oper_port_state")
        )
        slaves.append(
            Slave(
                name=slave,
                mii_status=block.get("MII Status", ""),
                link_failure_count=_int(block.get("Link Failure Count")),
                aggregator_id=block.get("Aggregator ID", ""),
                actor_churn=block.get("Actor Churn State", ""),
                partner_churn=block.get("Partner Churn State", ""),
                partner_state=_int(state),
            )
        )
    return Bond(name, mode, master.get("MII Status", ""), tuple(slaves), sysfs_slaves, proc_text is not None)
