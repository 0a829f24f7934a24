"""Non-hostNetwork mode: the start checks and the env handed to RDMA pods.

With ``nonHostNetwork.enabled`` pods keep their own network namespace. RDMA then works
only if

1. the RDMA subsystem is in *shared* netns mode
   (``/sys/module/ib_core/parameters/netns_mode`` = ``Y``): every netns sees every RDMA
   device, so a pod's container can open the uverbs devices it was given; and
2. the netdev that owns each selected NIC's GIDs (for a RoCE LAG: the bond, e.g.
   ``bond0``) has IPv6 enabled, a global IPv6 address, a route for the compute network and
   a RoCE v2 GID carrying each address: pods address their peers over the IPv6 compute
   network, so the GID they use must carry an IPv6 address (an IPv4-mapped GID lives in
   the host netns only).

The checks themselves live in :mod:`rdma_node.ipv6checks`, shared with the Ansible role
``ipv6_compute_validate``; :func:`read_and_check` returns its failed checks as
:class:`Finding` (the same class), each naming what to fix. The daemon logs them and, with
``checks: enforce`` (default), exits with code 3 before serving anything.

Env for non-hostNetwork pods (:func:`default_env`; any key in ``env`` or ``nonHostNetwork.env``
of the config overrides it; ``RDMA_DEVICES`` is always set by the plugin):

- ``NCCL_SOCKET_FAMILY=AF_INET6``: NCCL's bootstrap/socket traffic uses IPv6, the
  compute network's family. A cluster whose pod network is IPv4-only sets
  ``nonHostNetwork.env: {NCCL_SOCKET_FAMILY: AF_INET}`` to override it.

The NICs and the GID (``NCCL_IB_HCA``, ``NCCL_IB_ADDR_FAMILY=AF_INET6``, ...) come from
:mod:`.nccl_env` (``workloadEnv``), for hostNetwork pods too.

See docs/non-host-network.md.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from rdma_node import ipv6checks
from rdma_node.ipv6checks import Check as Finding  # a failed check: name, nic ("" node-wide), netdev, problem, fix
from rdma_node.sysfs import Nic

__all__ = ["ChecksFailed", "Finding", "default_env", "gid_netdev", "read_and_check"]


class ChecksFailed(Exception):
    """Raised by the daemon when enforced non-hostNetwork checks fail (exit code 3)."""

    def __init__(self, findings: Sequence[Finding]) -> None:
        self.findings = list(findings)
        super().__init__("\n".join(f.message() for f in self.findings))


def gid_netdev(nic: Nic) -> str:
    """The netdev that owns the NIC's GIDs (a bond for RoCE LAG), else its first netdev, else ""."""
    return nic.compute_netdevs[0] if nic.compute_netdevs else ""


def default_env() -> dict[str, str]:
    """Env defaults for IPv6 RoCE workloads in their own netns (see the module docstring)."""
    return {"NCCL_SOCKET_FAMILY": "AF_INET6"}


def read_and_check(
    nics: Sequence[Nic], sysfs_root: str, procfs_root: str, gids: Mapping[str, Iterable[str]] | None = None
) -> list[Finding]:
    """The failed :mod:`rdma_node.ipv6checks` checks of the selected NICs (none selected: nothing to check).

    ``gids``: RoCE v2 GIDs per RDMA device from pyverbs when it is in use; default sysfs.
    """
    checks = ipv6checks.read_and_check(nics, sysfs_root, procfs_root, gids=gids, require_nics=False)
    return [c for c in checks if not c.passed]
