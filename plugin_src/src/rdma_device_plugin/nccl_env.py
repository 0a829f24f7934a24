"""The env NCCL and UCX read, computed from the NICs a container was allocated (``workloadEnv``).

Pure logic, no I/O. :func:`nic_facts` reads what one NIC offers from its sysfs view (a
:class:`~rdma_node.sysfs.Nic`, as every re-list gives it): its ports and, per address family, the GID
index NCCL itself would pick on each RoCE port (:func:`rdma_node.gids.nccl_gid_index`, NCCL's own
algorithm). :func:`workload_env` combines the facts of the allocated NICs into variables; the pools
call it once per NIC set at re-list (shared) or at the first Allocate of a set (exclusive), never per
call. Each variable's meaning, from NCCL's and UCX's own sources (docs/nccl.md cites them):

- ``NCCL_IB_HCA=<=dev>,<dev>``: the leading ``=`` is NCCL's exact-match form (``searchExact`` in
  ``src/transport/net_ib``): ``mlx5_bond_1`` then does not also select ``mlx5_bond_10``. A name
  without ``:<port>`` selects every port of the device.
- ``NCCL_IB_GID_INDEX=<i>``: NCCL uses GID ``i`` on every RoCE port and skips its own choice
  (``ncclIbGetGidIndex`` returns it at once; InfiniBand ignores it). Set where the index is known at
  Allocate: with hostNetwork pods, the GID of the node's own compute address, the same index on
  every allocated port. Left unset, and said why (:class:`Unset`), when the ports disagree or one
  has no suitable GID: a wrong index does not fail at start, it fails or stalls at connect.
- ``NCCL_IB_ADDR_FAMILY`` (``AF_INET``/``AF_INET6``), ``NCCL_IB_ROCE_VERSION_NUM`` (1/2) and
  ``NCCL_IB_ADDR_RANGE`` (``<addr>/<bits>``, only when configured): what NCCL's own choice looks for
  when the index is not set. Used where the index cannot be known at Allocate: a non-hostNetwork
  pod's own IPv6 address enters the GID table only once its network is set up, after Allocate.
  Also the fallback when a hostNetwork allocation leaves the index unset: NCCL then picks per port.
- ``UCX_NET_DEVICES=<dev>:<port>,...``: the UCX devices (``ucp_config_table`` ``NET_DEVICES``;
  UCX names an RDMA port ``<device>:<port>``) of every allocated port.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rdma_node import gids
from rdma_node.sysfs import Nic, Port

from .config_base import AF_INET, AF_INET6

if TYPE_CHECKING:
    from .config import PluginConfig  # a model or its config_view (the DRA driver): attribute reads only

NCCL_IB_HCA = "NCCL_IB_HCA"
NCCL_IB_GID_INDEX = "NCCL_IB_GID_INDEX"
NCCL_IB_ADDR_FAMILY = "NCCL_IB_ADDR_FAMILY"
NCCL_IB_ROCE_VERSION_NUM = "NCCL_IB_ROCE_VERSION_NUM"
NCCL_IB_ADDR_RANGE = "NCCL_IB_ADDR_RANGE"
UCX_NET_DEVICES = "UCX_NET_DEVICES"
VARIABLES = (
    NCCL_IB_HCA,
    NCCL_IB_GID_INDEX,
    NCCL_IB_ADDR_FAMILY,
    NCCL_IB_ROCE_VERSION_NUM,
    NCCL_IB_ADDR_RANGE,
    UCX_NET_DEVICES,
)
# Why a variable was left unset (the `reason` label of rdma_dp_env_unset).
GID_INDEX_DIFFERS = "gid_index_differs"
NO_SUITABLE_GID = "no_suitable_gid"


@dataclass(frozen=True)
class EnvSettings:
    """The ``workloadEnv`` section plus where pods run (nonHostNetwork)."""

    enabled: bool = True
    host_network: bool = True
    addr_family: str = "auto"
    addr_range: str = ""
    roce_version: int = gids.ROCE_VERSION
    ucx: bool = True

    @classmethod
    def from_config(cls, config: PluginConfig) -> EnvSettings:
        w = config.workload_env
        return cls(
            enabled=w.enabled,
            host_network=not config.non_host_network.enabled,
            addr_family=w.addr_family,
            addr_range=w.addr_range,
            roce_version=w.roce_version,
            ucx=w.ucx,
        )


@dataclass(frozen=True)
class PortGid:
    """NCCL's pick on one RoCE port for one address family."""

    port: int
    index: int
    suitable: bool  # a global GID of that family and RoCE version (not link-local, not empty)
    shown: str  # "3 (RoCE v2 2408:4005:300::11)"


@dataclass(frozen=True)
class NicFacts:
    """What one NIC offers the env: read once per re-list."""

    name: str
    ports: tuple[int, ...]
    picks: tuple[tuple[str, tuple[PortGid, ...]], ...]  # (family, RoCE ports' picks); () for InfiniBand
    ipv4: bool  # every RoCE port has a global IPv4 RoCE v2 GID (NCCL's default family works)

    def picks_for(self, family: str) -> tuple[PortGid, ...]:
        return dict(self.picks).get(family, ())


@dataclass(frozen=True)
class Unset:
    """A variable the plugin would set but leaves unset, and why."""

    variable: str
    reason: str  # GID_INDEX_DIFFERS | NO_SUITABLE_GID
    detail: str

    def message(self) -> str:
        return f"{self.variable} left unset: {self.detail}"


@dataclass(frozen=True)
class WorkloadEnv:
    env: dict[str, str]
    unset: tuple[Unset, ...] = ()
    family: str = ""  # the GID family chosen ("" without RoCE ports or when disabled)


def _pick(port: Port, family: str, settings: EnvSettings) -> PortGid:
    cidr = settings.addr_range if _range_family(settings.addr_range) in (None, family) else ""
    index = gids.nccl_gid_index(port, family, settings.roce_version, cidr or None)
    entry = next((g for g in port.gids if g.index == index), None)
    suitable = entry is not None and gids.usable(entry, family, settings.roce_version, cidr)
    return PortGid(port.number, index, suitable, gids.describe(port, index))


def _range_family(cidr: str) -> str | None:
    if not cidr:
        return None
    return AF_INET if ipaddress.ip_network(cidr, strict=False).version == 4 else AF_INET6


def nic_facts(nic: Nic, settings: EnvSettings) -> NicFacts:
    """The NIC's ports and NCCL's GID pick on each RoCE port, for both families."""
    roce = [p for p in nic.ports if p.link_layer == "Ethernet"]
    picks = tuple((family, tuple(_pick(p, family, settings) for p in roce)) for family in (AF_INET, AF_INET6))
    ipv4 = bool(roce) and all(any(gids.usable(g, AF_INET, settings.roce_version, "") for g in p.gids) for p in roce)
    return NicFacts(nic.name, tuple(p.number for p in nic.ports), picks if roce else (), ipv4)


def gid_family(facts: Sequence[NicFacts], settings: EnvSettings) -> str:
    """The GID family for these NICs: the configured one; else the family of ``addrRange``; else
    AF_INET6 for non-hostNetwork pods (their compute network is IPv6); else AF_INET where every RoCE
    NIC has an IPv4 RoCE v2 GID (NCCL's own default), AF_INET6 where one has not."""
    if settings.addr_family != "auto":
        return settings.addr_family
    given = _range_family(settings.addr_range)
    if given is not None:
        return given
    if not settings.host_network:
        return AF_INET6
    roce = [f for f in facts if f.picks]
    return AF_INET if roce and all(f.ipv4 for f in roce) else AF_INET6


def workload_env(facts: Sequence[NicFacts], settings: EnvSettings) -> WorkloadEnv:
    """The variables for a container given exactly these NICs (in this order)."""
    if not settings.enabled or not facts:
        return WorkloadEnv({})
    env = {NCCL_IB_HCA: "=" + ",".join(f.name for f in facts)}
    if settings.ucx:
        env[UCX_NET_DEVICES] = ",".join(f"{f.name}:{port}" for f in facts for port in f.ports)
    roce = [f for f in facts if f.picks]
    if not roce:
        return WorkloadEnv(env)  # InfiniBand: NCCL's GID choice needs nothing (routable FLID or 0)
    family = gid_family(facts, settings)
    unset: tuple[Unset, ...] = ()
    if settings.host_network:
        picks = [(f.name, p) for f in roce for p in f.picks_for(family)]
        unset = _gid_problems(picks, family, settings)
        if not unset:
            env[NCCL_IB_GID_INDEX] = str(picks[0][1].index)
            return WorkloadEnv(env, (), family)
    env[NCCL_IB_ADDR_FAMILY] = family
    env[NCCL_IB_ROCE_VERSION_NUM] = str(settings.roce_version)
    if settings.addr_range:
        env[NCCL_IB_ADDR_RANGE] = settings.addr_range
    return WorkloadEnv(env, unset, family)


def _gid_problems(picks: list[tuple[str, PortGid]], family: str, settings: EnvSettings) -> tuple[Unset, ...]:
    wanted = f"{family} RoCE v{settings.roce_version}" + (f" in {settings.addr_range}" if settings.addr_range else "")
    bad = [f"{name} port {p.port}" for name, p in picks if not p.suitable]
    if bad:
        detail = (
            f"no {wanted} GID on {', '.join(bad)} (NCCL would pick "
            + ", ".join(f"{name} port {p.port}: {p.shown}" for name, p in picks if not p.suitable)
            + "); give the netdev its compute address, or set workloadEnv.addrFamily"
        )
        return (Unset(NCCL_IB_GID_INDEX, NO_SUITABLE_GID, detail),)
    if len({p.index for _, p in picks}) > 1:
        detail = (
            f"the {wanted} GID has a different index per NIC ("
            + ", ".join(f"{name} port {p.port}: {p.shown}" for name, p in picks)
            + "); NCCL picks per port by NCCL_IB_ADDR_FAMILY instead"
        )
        return (Unset(NCCL_IB_GID_INDEX, GID_INDEX_DIFFERS, detail),)
    return ()
