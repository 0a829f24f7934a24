"""The GID index NCCL picks for a port, computed the way NCCL does (standard library only).

Pure logic over a :class:`.sysfs.Port` (its GID table as sysfs shows it). The node validation
reports it per NIC and flags drift within a node; the plugin can hand it to pods as
``NCCL_IB_GID_INDEX``. The algorithm is NCCL's own (``ncclIbGetGidIndex`` /
``ncclUpdateGidIndex`` in NVIDIA/nccl ``src/transport/net_ib/connect.cc``, formerly
``src/transport/net_ib.cc``), with NCCL's defaults:

- InfiniBand: index ``NCCL_IB_ROUTABLE_FLID_GID_INDEX`` (1) when that GID carries a routable
  FLID (bytes 4-5 non-zero), else 0;
- RoCE: starting at 0, each later entry replaces the pick when it is of the wanted address family
  (``NCCL_IB_ADDR_FAMILY``, default ``AF_INET``: an IPv4-mapped GID) and the pick is not, or when
  both are of that family, the entry is valid (configured, not link-local) and its RoCE version is
  the wanted one (``NCCL_IB_ROCE_VERSION_NUM``, default 2) while the pick's differs or the pick is
  not valid. ``NCCL_IB_ADDR_RANGE`` narrows the candidates to a prefix.

Empty table entries are all-zero GIDs whose type NCCL cannot read (version -1), as on a node.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping, Sequence

from .sysfs import ZERO_GID, Gid, Port

AF_INET = "AF_INET"
AF_INET6 = "AF_INET6"
ADDR_FAMILIES = (AF_INET, AF_INET6)
ROUTABLE_FLID_GID_INDEX = 1  # NCCL_IB_ROUTABLE_FLID_GID_INDEX default
ROCE_VERSION = 2  # NCCL_IB_ROCE_VERSION_NUM default
_VERSIONS = {"IB/RoCE v1": 1, "RoCE v1": 1, "RoCE v2": 2}


def _words(gid: str) -> tuple[int, int, int, int]:
    """The GID as NCCL's ``s6_addr32[0..3]``, each word in network byte order read as a number."""
    raw = ipaddress.IPv6Address(gid).packed
    return tuple(int.from_bytes(raw[i : i + 4], "big") for i in range(0, 16, 4))  # type: ignore[return-value]


def parses(gid: str) -> bool:
    """A GID text the table can hold (a garbled entry reads as empty)."""
    try:
        ipaddress.IPv6Address(gid)
    except ValueError:
        return False
    return True


def family(gid: str) -> str:
    """``AF_INET`` for an IPv4-mapped GID (unicast ``::ffff:a.b.c.d`` or multicast ``ff0e::ffff:...``)."""
    w = _words(gid)
    mapped = (w[0] | w[1]) == 0 and w[2] == 0x0000FFFF
    mapped_multicast = w[0] == 0xFF0E0000 and w[1] == 0 and w[2] == 0x0000FFFF
    return AF_INET if mapped or mapped_multicast else AF_INET6


def valid(gid: str) -> bool:
    """Configured (not all-zero, not the bare ``fe80::``) and not link-local, as NCCL's ``validGid``."""
    w = _words(gid)
    trailer = w[1] | w[2] | w[3]
    configured = not ((w[0] | trailer) == 0 or (w[0] == 0xFE800000 and trailer == 0))
    link_local = w[0] == 0xFE800000 and w[1] == 0
    return configured and not link_local


def version_of(gid_type: str) -> int:
    """The RoCE version of a ``gid_attrs/types`` text as NCCL reads it (``ncclIbRoceGetVersionNum``); -1 unknown."""
    return _VERSIONS.get(gid_type, -1)


def in_range(gid: str, want_family: str, cidr: str) -> bool:
    """``gid``'s address (the IPv4 one of a mapped GID for ``AF_INET``) is in ``cidr``, as NCCL matches it."""
    return _in_range(want_family, ipaddress.ip_network(cidr, strict=False), gid)


def _in_range(want_family: str, prefix: ipaddress.IPv4Network | ipaddress.IPv6Network | None, gid: str) -> bool:
    if prefix is None:
        return True
    raw = ipaddress.IPv6Address(gid).packed
    address: ipaddress.IPv4Address | ipaddress.IPv6Address
    address = ipaddress.IPv4Address(raw[12:]) if want_family == AF_INET else ipaddress.IPv6Address(raw)
    return address in prefix


def nccl_gid_index(
    port: Port,
    addr_family: str = AF_INET,
    roce_version: int = ROCE_VERSION,
    addr_range: str | None = None,
) -> int:
    """The GID index NCCL uses on ``port`` when ``NCCL_IB_GID_INDEX`` is not set.

    ``addr_family``/``roce_version``/``addr_range`` are NCCL_IB_ADDR_FAMILY,
    NCCL_IB_ROCE_VERSION_NUM and NCCL_IB_ADDR_RANGE (e.g. ``"10.0.0.0/8"``)."""
    if addr_family not in ADDR_FAMILIES:
        raise ValueError(f"addr_family must be one of {ADDR_FAMILIES}, not {addr_family!r}")
    by_index = {g.index: g for g in port.gids if parses(g.gid)}  # a garbled entry reads as empty
    if port.link_layer == "InfiniBand":
        routable = by_index.get(ROUTABLE_FLID_GID_INDEX)
        flid = b"\0\0" if routable is None else ipaddress.IPv6Address(routable.gid).packed[4:6]
        return ROUTABLE_FLID_GID_INDEX if port.gid_table_len > ROUTABLE_FLID_GID_INDEX and flid != b"\0\0" else 0
    prefix = ipaddress.ip_network(addr_range, strict=False) if addr_range else None
    table: Mapping[int, tuple[str, int]] = {
        i: (by_index[i].gid, version_of(by_index[i].type)) if i in by_index else (ZERO_GID, -1)
        for i in range(max(port.gid_table_len, 1))
    }
    pick = 0
    for candidate in range(1, len(table)):
        pick = _update(table, pick, candidate, addr_family, roce_version, prefix)
    return pick


def _update(
    table: Mapping[int, tuple[str, int]],
    pick: int,
    candidate: int,
    want_family: str,
    roce_version: int,
    prefix: ipaddress.IPv4Network | ipaddress.IPv6Network | None,
) -> int:
    """NCCL's ``ncclUpdateGidIndex``: the pick after looking at ``candidate``."""
    (gid, version), (cand, cand_version) = table[pick], table[candidate]
    cand_family, in_range = family(cand), _in_range(want_family, prefix, cand)
    if cand_family != family(gid) and cand_family == want_family and in_range:
        return candidate
    if cand_family != want_family or not valid(cand) or not in_range:
        return pick
    if (version != cand_version or not valid(gid)) and cand_version == roce_version:
        return candidate
    return pick


def usable(gid: Gid, want_family: str, version: int = ROCE_VERSION, cidr: str = "") -> bool:
    """A GID NCCL can connect from: a valid (configured, not link-local) address of ``want_family``
    with RoCE ``version``, in ``cidr`` when given."""
    return (
        parses(gid.gid)
        and family(gid.gid) == want_family
        and valid(gid.gid)
        and version_of(gid.type) == version
        and (not cidr or in_range(gid.gid, want_family, cidr))
    )


def auto_family(ports: list[Port], version: int = ROCE_VERSION) -> str:
    """The family the plugin's ``workloadEnv.addrFamily: auto`` gives hostNetwork pods (nccl_env.gid_family):
    AF_INET when every RoCE port has an IPv4 RoCE v2 GID (NCCL's own default works), else AF_INET6."""
    roce = [p for p in ports if p.link_layer == "Ethernet"]
    ipv4 = bool(roce) and all(any(usable(g, AF_INET, version) for g in p.gids) for p in roce)
    return AF_INET if ipv4 else AF_INET6


def address(gid: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """The address a GID carries: the IPv4 address of an IPv4-mapped GID, else the GID itself."""
    raw = ipaddress.IPv6Address(gid)
    return raw.ipv4_mapped or raw


def on_networks(gid: str, networks: Sequence[str]) -> bool:
    """The GID's address is in one of ``networks`` (CIDRs of either family)."""
    found = address(gid)
    return any(
        found in net
        for net in (ipaddress.ip_network(c, strict=False) for c in networks)
        if net.version == found.version
    )


def describe(port: Port, index: int) -> str:
    """``3 (RoCE v2 2408:4005:300::11)``: the index with what it carries."""
    gid = next((g for g in port.gids if g.index == index and parses(g.gid)), None)
    if gid is None:
        return f"{index} (empty)"
    shown = str(ipaddress.IPv6Address(gid.gid))
    if family(gid.gid) == AF_INET:
        shown = str(ipaddress.IPv4Address(ipaddress.IPv6Address(gid.gid).packed[12:]))
    return f"{index} ({gid.type or 'IB'} {shown})"
