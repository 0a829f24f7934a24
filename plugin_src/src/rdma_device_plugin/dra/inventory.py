"""The node's NICs as the driver publishes them: the node inventory's NICs and health
(:class:`..inventory.NodeInventory`: the device plugin's pools read the same discovery, health rule
and env facts) with their PCIe root, their GPUs and NCCL's GID (:class:`.model.NicView`).

The only I/O is one PCIe read per NIC when the NIC set changes (its host bridge); GPUs per NIC come
from the inventory's affinity (the same :mod:`..affinity` the device plugin reports), the GID from
:mod:`..nccl_env` (the same choice the env hands pods).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from rdma_node import pcie
from rdma_node.sysfs import Nic

from .. import nccl_env
from ..inventory import NodeInventory, nic_identity
from .model import NicView, ResourceView

if TYPE_CHECKING:
    from ..config import PluginConfig  # a model or its config_view (the DRA driver): attribute reads only


class Inventory:
    """Keeps what a re-list learnt (a vanished NIC's last facts, each NIC's PCIe root) and builds
    the views at every health change."""

    def __init__(self, config: PluginConfig, sysfs_root: str) -> None:
        self.config = config
        self.sysfs_root = sysfs_root
        self.settings = nccl_env.EnvSettings.from_config(config)
        self._last: dict[str, Nic] = {}  # identity -> the NIC as last seen (a vanished one keeps its facts)
        self._roots: dict[str, str] = {}  # PCI address -> pcieRoot
        self._unhealthy_since: dict[str, str] = {}  # RDMA device name -> RFC 3339

    def resources(self) -> list[ResourceView]:
        policy = self.config.health.policy
        return [ResourceView(r.name, r.shared_devices, policy, r.numa_pools) for r in self.config.resources]

    def _pcie_root(self, address: str) -> str:
        if address not in self._roots:
            function = pcie.read_function(self.sysfs_root, address) if address else None
            self._roots[address] = function.path[0] if function is not None and function.path else ""
        return self._roots[address]

    def views(self, node: NodeInventory) -> list[NicView]:
        present: list[tuple[str, str, Nic]] = [
            (name, nic_identity(n), n) for name, s in node.resources.items() for n in s.present_nics()
        ]
        facts = [f for name, key, _ in present if (f := node.resources[name].facts.get(key)) is not None]
        family = nccl_env.gid_family(facts, self.settings) if facts else ""
        by_name = {f.name: f for f in facts}
        affinity = node.affinity
        out: list[NicView] = []
        for resource, states in node.resources.items():
            for key, h in sorted(states.health.items()):
                nic = next((n for r, k, n in present if r == resource and k == key), None)
                if nic is not None:
                    self._last[key] = nic
                nic = nic or self._last.get(key)
                if nic is None:
                    continue
                gid, index = "", None
                f = by_name.get(nic.name)
                picks = f.picks_for(family) if f is not None and family else ()
                if picks and picks[0].suitable:
                    index = picks[0].index
                    port = next((p for p in nic.ports if p.number == picks[0].port), None)
                    gid = next((g.gid for g in port.gids if g.index == index), "") if port else ""
                gpus = affinity.nics[nic.name].switch if nic.name in affinity.nics else ()
                out.append(
                    NicView(
                        nic,
                        h,
                        resource,
                        self._pcie_root(nic.pci_address),
                        gpus,
                        gid,
                        index if gid else None,
                        family if gid else "",
                    )
                )
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        names = {v.nic.name for v in out if not v.health.healthy}
        for name in list(self._unhealthy_since):
            if name not in names:
                del self._unhealthy_since[name]
        for name in names:
            self._unhealthy_since.setdefault(name, now)
        return out

    @property
    def unhealthy_since(self) -> dict[str, str]:
        return dict(self._unhealthy_since)
