"""The one reader of a node's IPv6 state from procfs (standard library only).

Used by the plugin's non-hostNetwork checks and by the Ansible IPv6 validation role.
"""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass

from .sysfs import read_text  # the one decoding policy (.text) for procfs too
from .text import to_fs

SCOPE_GLOBAL = 0x00
SCOPE_LINK = 0x20
SCOPE_HOST = 0x10
# ifa_flags (include/uapi/linux/if_addr.h); /proc/net/if_inet6 prints them as (u8)
# (net/ipv6/addrconf.c: if6_seq_show), which keeps these two.
IFA_F_DADFAILED = 0x08
IFA_F_TENTATIVE = 0x40


@dataclass(frozen=True)
class Inet6Address:
    address: str  # compressed, e.g. "2408:4000::1"
    ifindex: int
    prefix_len: int
    scope: int
    flags: int
    ifname: str

    @property
    def is_global(self) -> bool:
        return self.scope == SCOPE_GLOBAL

    @property
    def unusable(self) -> str:
        """Why the kernel does not use the address yet ("" when it does): DAD failed or pending."""
        if self.flags & IFA_F_DADFAILED:
            return "dadfailed"
        if self.flags & IFA_F_TENTATIVE:
            return "tentative"
        return ""

    @property
    def gid(self) -> str:
        """The address written the way sysfs writes a GID (8 groups of 4 hex digits)."""
        exploded = ipaddress.IPv6Address(self.address).exploded
        return exploded.lower()


@dataclass(frozen=True)
class Ipv6Route:
    destination: str
    prefix_len: int
    next_hop: str
    ifname: str


def _hex_to_ipv6(value: str) -> str:
    return str(ipaddress.IPv6Address(bytes.fromhex(value)))


def read_if_inet6(procfs_root: str = "/proc") -> list[Inet6Address]:
    """Parse /proc/net/if_inet6; malformed lines are skipped."""
    text = read_text(os.path.join(procfs_root, "net", "if_inet6")) or ""
    result = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) != 6 or len(parts[0]) != 32:
            continue
        try:
            result.append(
                Inet6Address(
                    address=_hex_to_ipv6(parts[0]),
                    ifindex=int(parts[1], 16),
                    prefix_len=int(parts[2], 16),
                    scope=int(parts[3], 16),
                    flags=int(parts[4], 16),
                    ifname=parts[5],
                )
            )
        except ValueError:
            continue
    return result


def read_ipv6_routes(procfs_root: str = "/proc") -> list[Ipv6Route]:
    """Parse /proc/net/ipv6_route (dest, dest plen, src, src plen, next hop, metric, refcnt, use, flags, ifname)."""
    text = read_text(os.path.join(procfs_root, "net", "ipv6_route")) or ""
    result = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) != 10:
            continue
        try:
            result.append(
                Ipv6Route(
                    destination=_hex_to_ipv6(parts[0]),
                    prefix_len=int(parts[1], 16),
                    next_hop=_hex_to_ipv6(parts[4]),
                    ifname=parts[9],
                )
            )
        except ValueError:
            continue
    return result


def ipv6_disabled(procfs_root: str, ifname: str) -> bool | None:
    """True/False from conf/<if>/disable_ipv6 (or conf/all); None when neither exists."""
    conf = os.path.join(procfs_root, "sys", "net", "ipv6", "conf")
    all_value = read_text(os.path.join(conf, "all", "disable_ipv6"))
    if_value = read_text(os.path.join(conf, to_fs(ifname), "disable_ipv6"))
    if all_value is None and if_value is None:
        return None
    return all_value == "1" or if_value == "1"


def global_addresses(procfs_root: str, ifname: str) -> list[Inet6Address]:
    """Every global address on ifname, usable or not (see :attr:`Inet6Address.unusable`)."""
    return [a for a in read_if_inet6(procfs_root) if a.ifname == ifname and a.is_global]


def routes_via(procfs_root: str, ifname: str) -> list[Ipv6Route]:
    """Routes that leave through ifname, excluding link-local and host routes."""
    return [
        r
        for r in read_ipv6_routes(procfs_root)
        if r.ifname == ifname
        and not r.destination.startswith("fe80:")
        and not r.destination.startswith("ff00:")
        and r.prefix_len < 128
    ]
