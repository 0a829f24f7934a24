"""Non-hostNetwork mode: the start checks and the env handed to RDMA pods.

With ``nonHostNetwork.enabled`` pods keep their own network namespace. RDMA then works
only if

1. the RDMA subsystem is in *shared* netns mode
   (``/sys/module/ib_core/parameters/netns_mode`` = ``Y``): every netns sees every RDMA
   device, so a pod's container can open the uverbs devices it was given; and
2. the netdev that owns each selected NIC's GIDs (for a RoCE LAG: the bond, e.g.
   ``bond0``) has a global IPv6 address with a matching RoCE v2 GID: pods address
   their peers over the IPv6 compute network, so the GID they use must carry an IPv6
   address (an IPv4-mapped GID lives in the host netns only).

:func:`check` is pure logic over data read through ``node.sysfs`` / ``node.procfs`` and
returns one :class:`Finding` per problem, each naming what to fix. The daemon logs them
and, with ``checks: enforce`` (default), exits with code 3 before serving anything.

Env for non-hostNetwork pods (:func:`default_env`, computed per allocation; any key in
``env`` or ``nonHostNetwork.env`` of the config overrides it; ``RDMA_DEVICES`` is always
set by the plugin):

- ``NCCL_IB_HCA==<dev>,<dev>``: exactly the RDMA devices this container was allocated
  (the leading ``=`` makes NCCL match names exactly, so ``mlx5_bond_1`` does not also
  match ``mlx5_bond_10``); NCCL would otherwise try every device it can see, and in
  shared netns mode it sees all of the node's.
- ``NCCL_IB_ADDR_FAMILY=AF_INET6``: NCCL (2.21+) picks the RoCE GID whose address is
  IPv6, the only kind usable from a pod's own netns on this network.
- ``NCCL_SOCKET_FAMILY=AF_INET6``: NCCL's bootstrap/socket traffic uses IPv6, the
  compute network's family. A cluster whose pod network is IPv4-only sets
  ``nonHostNetwork.env: {NCCL_SOCKET_FAMILY: AF_INET}`` to override it.

See docs/non-host-network.md.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from .node.sysfs import Nic

NODE = "(node)"


@dataclass(frozen=True)
class Finding:
    nic: str  # RDMA device name, or "(node)" for node-wide problems
    netdev: str  # netdev checked, "" when none applies
    problem: str
    fix: str

    def message(self) -> str:
        where = self.nic if not self.netdev else f"{self.nic} (netdev {self.netdev})"
        return f"{where}: {self.problem}; fix: {self.fix}"


class ChecksFailed(Exception):
    """Raised by the daemon when enforced non-hostNetwork checks fail (exit code 3)."""

    def __init__(self, findings: Sequence[Finding]) -> None:
        self.findings = list(findings)
        super().__init__("\n".join(f.message() for f in self.findings))


def gid_netdev(nic: Nic) -> str:
    """The netdev that owns the NIC's GIDs (a bond for RoCE LAG), else its first netdev, else ""."""
    return nic.compute_netdevs[0] if nic.compute_netdevs else ""


def check(
    nics: Iterable[Nic],
    netns_mode: str | None,
    ib_core_loaded: bool,
    global_addresses: Mapping[str, Sequence[str]],
    ipv6_disabled: Mapping[str, bool | None],
    gids: Mapping[str, Iterable[str]] | None = None,
) -> list[Finding]:
    """Everything that stops RDMA from working in pods with their own netns.

    ``global_addresses``: netdev -> its global IPv6 addresses (exploded, lower case);
    ``ipv6_disabled``: netdev -> disable_ipv6 (None = unknown); ``gids``: RDMA device ->
    its RoCE v2 GIDs (NICs missing from it: from the NIC's sysfs ports).
    """
    findings: list[Finding] = []
    if not ib_core_loaded:
        findings.append(
            Finding(NODE, "", "the ib_core module is not loaded", "load the RDMA driver stack (modprobe ib_core)")
        )
    elif netns_mode is None:
        findings.append(
            Finding(
                NODE,
                "",
                "cannot tell the RDMA netns mode: /sys/module/ib_core/parameters/netns_mode is missing",
                "use a kernel with RDMA netns support (5.2+) in shared mode, or set nonHostNetwork.checks: warn",
            )
        )
    elif netns_mode != "shared":
        findings.append(
            Finding(
                NODE,
                "",
                "the RDMA subsystem is in exclusive netns mode (netns_mode=N): pods in their own netns see no RDMA",
                "run 'rdma system set netns shared' (persist with 'options ib_core netns_mode=1' in /etc/modprobe.d)",
            )
        )
    for nic in nics:
        netdev = gid_netdev(nic)
        if not netdev:
            findings.append(
                Finding(nic.name, "", "has no netdev, so it cannot carry IPv6", "bind its netdev or deselect the NIC")
            )
            continue
        if ipv6_disabled.get(netdev):
            findings.append(
                Finding(
                    nic.name,
                    netdev,
                    "IPv6 is disabled",
                    f"set net.ipv6.conf.{netdev}.disable_ipv6=0 (and net.ipv6.conf.all.disable_ipv6=0)",
                )
            )
        addrs = [a.lower() for a in global_addresses.get(netdev, ())]
        if not addrs:
            findings.append(
                Finding(
                    nic.name,
                    netdev,
                    "has no global IPv6 address (non-hostNetwork RDMA needs an IPv6 compute network)",
                    f"configure the node's IPv6 compute address on {netdev}",
                )
            )
            continue
        if "Ethernet" not in nic.link_layers:
            continue  # InfiniBand GIDs are not IP addresses
        if gids is not None and nic.name in gids:
            nic_gids = {g.lower() for g in gids[nic.name]}
        else:
            nic_gids = {g.gid for p in nic.ports for g in p.gids if g.type == "RoCE v2"}
        if not nic_gids.intersection(addrs):
            findings.append(
                Finding(
                    nic.name,
                    netdev,
                    f"no RoCE v2 GID carries its IPv6 address {addrs[0]}",
                    "check the RoCE mode (cma_roce_mode 2) and that the address is on the netdev that owns the GIDs",
                )
            )
    return findings


def default_env(rdma_devices: Sequence[str]) -> dict[str, str]:
    """Env defaults for IPv6 RoCE workloads in their own netns (see the module docstring)."""
    env = {"NCCL_IB_ADDR_FAMILY": "AF_INET6", "NCCL_SOCKET_FAMILY": "AF_INET6"}
    if rdma_devices:
        env["NCCL_IB_HCA"] = "=" + ",".join(rdma_devices)
    return env


def read_and_check(
    nics: Sequence[Nic], sysfs_root: str, procfs_root: str, gids: Mapping[str, Iterable[str]] | None = None
) -> list[Finding]:
    """Gather the inputs of :func:`check` from a node (through node.sysfs / node.procfs).

    ``gids``: RoCE v2 GIDs per RDMA device from pyverbs when it is in use; default sysfs.
    """
    from .node import procfs, sysfs

    netdevs = {gid_netdev(n) for n in nics} - {""}
    return check(
        nics,
        netns_mode=sysfs.netns_mode(sysfs_root),
        ib_core_loaded=sysfs.loaded_modules(sysfs_root, ["ib_core"])["ib_core"],
        global_addresses={d: [a.gid for a in procfs.global_addresses(procfs_root, d)] for d in netdevs},
        ipv6_disabled={d: procfs.ipv6_disabled(procfs_root, d) for d in netdevs},
        gids=gids,
    )
