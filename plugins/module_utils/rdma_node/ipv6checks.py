"""The IPv6 compute-network checks for RDMA pods without hostNetwork (standard library only).

The one implementation of these checks. Two consumers use it:

- the plugin's start checks (``rdma_device_plugin.netchecks``, ``nonHostNetwork.enabled``);
- the Ansible role ``ipv6_compute_validate``, through the ``rdma_node_info`` module, which
  ships this package to nodes as ``ansible.module_utils.rdma_node``.

:func:`check` is pure logic over data read through :mod:`.sysfs` / :mod:`.procfs` and
returns the outcome of every check that applies (passed or not) as :class:`Check`, each
with a stable name:

========================  =====  ==============================================================
name                      scope  passes when
========================  =====  ==============================================================
``netns_mode``            node   ib_core is loaded and its ``netns_mode`` is the wanted one
                                 (``shared``: a pod's own netns sees the RDMA devices)
``ipv6_compute_netdevs``  both   reported only when failing: no NIC is selected at all
                                 (``require_nics``), or a NIC has no netdev to carry IPv6
``ipv6_enabled``          NIC    ``disable_ipv6`` is 0 for the compute netdev and for ``all``
``ipv6_global_address``   NIC    the compute netdev has a global IPv6 address
``ipv6_route``            NIC    a route (not link-local, not host) leaves through the compute
                                 netdev (checked when an address exists)
``roce_v2_gid``           NIC    each global address is carried by a RoCE v2 GID of the NIC
                                 (Ethernet NICs, when an address exists, ``roce_v2_gid``)
========================  =====  ==============================================================

The compute netdevs of a NIC are :attr:`.sysfs.Nic.compute_netdevs` (the owners of its
GIDs: the bond of a RoCE LAG); every one of them is checked.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from . import procfs, sysfs
from .checks import Check

__all__ = [  # Check is re-exported: the plugin (netchecks) and tests use ipv6checks.Check
    "CHECK_NAMES",
    "Check",
    "NetdevIpv6",
    "check",
    "read_and_check",
    "read_netdev",
    "read_netdevs",
    "roce_v2_gids",
]

NETNS_MODE = "netns_mode"
COMPUTE_NETDEVS = "ipv6_compute_netdevs"
IPV6_ENABLED = "ipv6_enabled"
GLOBAL_ADDRESS = "ipv6_global_address"
ROUTE = "ipv6_route"
ROCE_V2_GID = "roce_v2_gid"
CHECK_NAMES = (NETNS_MODE, COMPUTE_NETDEVS, IPV6_ENABLED, GLOBAL_ADDRESS, ROUTE, ROCE_V2_GID)

NETNS_MODES = ("shared", "exclusive")


@dataclass(frozen=True)
class NetdevIpv6:
    """What procfs shows about one compute netdev."""

    disabled: bool | None  # disable_ipv6 of the netdev or all; None when unknown
    addresses: tuple[procfs.Inet6Address, ...] = ()  # usable global addresses only
    unusable: tuple[procfs.Inet6Address, ...] = ()  # global addresses that are tentative or dadfailed
    routes: tuple[procfs.Ipv6Route, ...] = ()  # routes through it (no link-local, no host routes)


def read_netdev(procfs_root: str, netdev: str) -> NetdevIpv6:
    found = procfs.global_addresses(procfs_root, netdev)
    return NetdevIpv6(
        disabled=procfs.ipv6_disabled(procfs_root, netdev),
        addresses=tuple(a for a in found if not a.unusable),
        unusable=tuple(a for a in found if a.unusable),
        routes=tuple(procfs.routes_via(procfs_root, netdev)),
    )


_UNUSABLE = {
    "tentative": "tentative (duplicate address detection has not finished: is the link up?)",
    "dadfailed": "dadfailed (another host on the compute network has this address)",
}


def roce_v2_gids(nic: sysfs.Nic, netdev: str) -> dict[str, int]:
    """The NIC's RoCE v2 GIDs that carry an IPv6 address on ``netdev``: GID -> first index."""
    found: dict[str, int] = {}
    for port in nic.ports:
        for gid in port.gids:
            if gid.type == "RoCE v2" and gid.is_ipv6 and gid.ndev in ("", netdev):
                found.setdefault(gid.gid, gid.index)
    return found


def _netns_mode(netns_mode: str | None, ib_core_loaded: bool, want: str) -> Check:
    persist = f'persist it with "options ib_core netns_mode={"1" if want == "shared" else "0"}" in /etc/modprobe.d/'
    if not ib_core_loaded:
        return Check(
            NETNS_MODE,
            "",
            "",
            False,
            "the ib_core module is not loaded, so the RDMA subsystem netns mode cannot be read",
            f"load the RDMA driver stack (modprobe ib_core), then rdma system set netns {want} and {persist}.",
        )
    if netns_mode is None:
        return Check(
            NETNS_MODE,
            "",
            "",
            False,
            "the RDMA subsystem netns mode is unknown (/sys/module/ib_core/parameters/netns_mode is missing), "
            f"non-hostNetwork pods need {want}",
            f"use a kernel with RDMA netns support (5.2+), then rdma system set netns {want} and {persist}.",
        )
    if netns_mode != want:
        return Check(
            NETNS_MODE,
            "",
            "",
            False,
            f"the RDMA subsystem netns mode is {netns_mode}, non-hostNetwork pods need {want}",
            f"rdma system set netns {want} and {persist} (then reload ib_core or reboot).",
        )
    return Check(NETNS_MODE, "", "", True, f"RDMA netns mode {netns_mode}")


def _netdev_checks(
    nic: sysfs.Nic, netdev: str, state: NetdevIpv6, nic_gids: set[str] | None, roce_v2_gid: bool
) -> list[Check]:
    out: list[Check] = []

    def add(name: str, passed: bool, detail: str, fix: str = "") -> None:
        out.append(Check(name, nic.name, netdev, passed, detail, "" if passed else fix))

    if state.disabled is None:
        ipv6 = f"IPv6 is in an unknown state (no net/ipv6/conf entry for {netdev} or all under /proc/sys)"
    else:
        ipv6 = f"IPv6 is disabled (disable_ipv6=1 on {netdev} or all)" if state.disabled else "IPv6 enabled"
    add(
        IPV6_ENABLED,
        state.disabled is False,
        ipv6,
        f"sysctl -w net.ipv6.conf.all.disable_ipv6=0 net.ipv6.conf.{netdev}.disable_ipv6=0, persist it in "
        "/etc/sysctl.d/, and check that the kernel was not booted with ipv6.disable=1.",
    )

    addrs = [a.address for a in state.addresses]
    if state.unusable:
        bad = ", ".join(f"{a.address} is {_UNUSABLE[a.unusable]}" for a in state.unusable)
        detail = f"global IPv6 address(es) on {netdev} that the kernel does not use: {bad}"
        fix = (
            f"bring {netdev} and its link up and wait for duplicate address detection; for a dadfailed "
            f"address give {netdev} a unique address, then re-add it (ip -6 addr del/add)."
        )
    elif addrs:
        detail, fix = "global IPv6 " + ", ".join(addrs), ""
    else:
        detail = f"no global IPv6 address on {netdev}"
        fix = (
            f"configure the compute network IPv6 address on {netdev} (the bond for a RoCE LAG) "
            "in the node network config."
        )
    add(GLOBAL_ADDRESS, bool(addrs) and not state.unusable, detail, fix)
    if not addrs:
        return out  # the route and the GID belong to an address

    routes = [f"{r.destination}/{r.prefix_len}" for r in state.routes]
    add(
        ROUTE,
        bool(routes),
        "IPv6 routes " + ", ".join(routes)
        if routes
        else f"no IPv6 route for the compute network leaves through {netdev}",
        f"add the compute network route (ip -6 route add <prefix> dev {netdev}) in the node network config.",
    )

    if roce_v2_gid and "Ethernet" in nic.link_layers:  # InfiniBand GIDs are not IP addresses
        carried = nic_gids if nic_gids is not None else set(roce_v2_gids(nic, netdev))
        missing = [a.address for a in state.addresses if a.gid not in carried]
        add(
            ROCE_V2_GID,
            not missing,
            "no RoCE v2 GID carries " + ", ".join(missing) if missing else "RoCE v2 GID for " + ", ".join(addrs),
            f"put the address on the netdev that owns the RDMA port ({netdev}), check that the port is up "
            "and RoCE v2 is enabled (cma_roce_mode), then re-add the address; verify with show_gids.",
        )
    return out


def check(
    nics: Sequence[sysfs.Nic],
    netns_mode: str | None,
    ib_core_loaded: bool,
    netdevs: Mapping[str, NetdevIpv6],
    gids: Mapping[str, Iterable[str]] | None = None,
    want_netns_mode: str = "shared",
    roce_v2_gid: bool = True,
    require_nics: bool = True,
    selection: str = "the NIC selectors",
) -> list[Check]:
    """Every IPv6 compute-network check of one node, node-wide first, then per NIC and netdev.

    ``netdevs``: compute netdev -> what procfs shows (a netdev missing from it reads as
    unknown); ``gids``: RDMA device -> its RoCE v2 GIDs (from pyverbs; NICs missing from it
    use the GIDs of their sysfs ports); ``want_netns_mode``: ``shared`` or ``exclusive``;
    ``roce_v2_gid``: check that a RoCE v2 GID carries each address; ``require_nics``: fail
    when ``nics`` is empty; ``selection``: how the NICs were selected, for that message.
    """
    if want_netns_mode not in NETNS_MODES:
        raise ValueError(f"want_netns_mode must be one of {NETNS_MODES}, not {want_netns_mode!r}")
    out = [_netns_mode(netns_mode, ib_core_loaded, want_netns_mode)]
    if not nics and require_nics:
        out.append(
            Check(
                COMPUTE_NETDEVS,
                "",
                "",
                False,
                f"no RDMA device matches {selection}, so there is no compute netdev to check",
                "bind the NICs to their driver or correct the NIC selectors.",
            )
        )
    for nic in nics:
        if not nic.compute_netdevs:
            out.append(
                Check(
                    COMPUTE_NETDEVS,
                    nic.name,
                    "",
                    False,
                    "has no netdev, so it cannot carry IPv6",
                    "bind its netdev or deselect the NIC.",
                )
            )
            continue
        nic_gids = {g.lower() for g in gids[nic.name]} if gids is not None and nic.name in gids else None
        for netdev in nic.compute_netdevs:
            state = netdevs.get(netdev, NetdevIpv6(disabled=None))
            out.extend(_netdev_checks(nic, netdev, state, nic_gids, roce_v2_gid))
    return out


def read_and_check(
    nics: Sequence[sysfs.Nic],
    sysfs_root: str,
    procfs_root: str,
    gids: Mapping[str, Iterable[str]] | None = None,
    want_netns_mode: str = "shared",
    roce_v2_gid: bool = True,
    require_nics: bool = True,
    selection: str = "the NIC selectors",
) -> list[Check]:
    """Read the inputs of :func:`check` from a node (through :mod:`.sysfs` / :mod:`.procfs`) and check."""
    return check(
        nics,
        netns_mode=sysfs.netns_mode(sysfs_root),
        ib_core_loaded=sysfs.loaded_modules(sysfs_root, ["ib_core"])["ib_core"],
        netdevs=read_netdevs(procfs_root, nics),
        gids=gids,
        want_netns_mode=want_netns_mode,
        roce_v2_gid=roce_v2_gid,
        require_nics=require_nics,
        selection=selection,
    )


def read_netdevs(procfs_root: str, nics: Iterable[sysfs.Nic]) -> dict[str, NetdevIpv6]:
    """:func:`read_netdev` for every compute netdev of ``nics``, in first-seen order."""
    out: dict[str, NetdevIpv6] = {}
    for nic in nics:
        for netdev in nic.compute_netdevs:
            if netdev not in out:
                out[netdev] = read_netdev(procfs_root, netdev)
    return out
