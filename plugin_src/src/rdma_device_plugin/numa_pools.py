"""Shared pools the Topology Manager can align (``resources[].numaPools``): which pools a resource
becomes, their device IDs and NUMA nodes, and which NICs each one hands out. Pure logic.

A shared pool's devices are virtual, so the kubelet's Topology Manager can only align what the
devices say about themselves (``Device.topology``, the kubelet's ``generateDeviceTopologyHints``).
With ``numaPools`` a resource ``rdma/hca`` is served as:

- ``rdma/hca``: as without the option, every selected NIC, no topology;
- ``rdma/hca-numa<N>`` for every NUMA node of the node (``devices/system/node/online``, the nodes
  the kubelet sees): ``sharedDevices`` devices carrying node N; a pod gets the NICs of node N. Asking
  for it pins the pod's other aligned resources (GPUs) to node N: under ``single-numa-node`` a pod
  asking 4 GPUs + ``rdma/hca-numa1`` gets 4 GPUs of node 1 or is refused;
- ``rdma/hca-local``: ``sharedDevices`` devices per NUMA node, each carrying its node, so the Topology
  Manager picks the node that fits the pod's GPUs and the device it allocates says which node that
  was; a pod gets the NICs of the node(s) of its devices. This is how a pod asks for "the NICs of my
  GPUs' NUMA node" without naming the node. Without a Topology Manager policy (``none``) the kubelet
  picks any device and the NICs may be on the other node.

A NUMA node without selected NICs keeps its pools with no devices (capacity 0), so the set of
resources does not change with hot-plug; a NIC the kernel gives no NUMA node (``numa_node`` -1)
is only in ``rdma/hca``. Exclusive mode keeps one device per NIC with its own NUMA node (the
config refuses ``numaPools`` there).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from rdma_node.sysfs import Nic

from .config import PluginConfig, ResourceConfig
from .config_base import local_resource_name, numa_resource_name
from .kubeletapi import MAX_MESSAGE_BYTES

WHOLE, NUMA, LOCAL = "whole", "numa", "local"
_WORST_HEALTH = len("Unhealthy")


@dataclass(frozen=True)
class PoolSpec:
    """One pool to serve: the resource it registers (name, sharedDevices, selectors) and its NUMA scope."""

    resource: ResourceConfig
    configured: str  # the config's resource name it comes from
    kind: str = WHOLE  # WHOLE | NUMA | LOCAL
    numa_nodes: tuple[int, ...] = ()  # NUMA: its one node; LOCAL: every node, one block of devices each

    @property
    def name(self) -> str:
        return self.resource.name

    @property
    def short(self) -> str:
        return self.name.split("/", 1)[1]

    def devices(self) -> tuple[tuple[str, int | None], ...]:
        """(device ID, NUMA node) of every device, in the order they are advertised. IDs are stable
        across restarts (the kubelet's checkpoint keeps them): ``hca-7``, ``hca-numa1-7``,
        ``hca-local-1-7``."""
        count = self.resource.shared_devices
        if self.kind == WHOLE:
            return tuple((f"{self.short}-{i}", None) for i in range(count))
        if self.kind == NUMA:
            node = self.numa_nodes[0]
            return tuple((f"{self.short}-{i}", node) for i in range(count))
        return tuple((f"{self.short}-{n}-{i}", n) for n in self.numa_nodes for i in range(count))

    def nics(self, selected: Iterable[Nic]) -> list[Nic]:
        """The selected NICs this pool may hand out (a per-NUMA pool: those of its node)."""
        if self.kind == WHOLE:
            return list(selected)
        return [n for n in selected if n.numa_node is not None and n.numa_node in self.numa_nodes]


def pool_specs(config: PluginConfig, numa_nodes: Sequence[int]) -> list[PoolSpec]:
    """Every pool the config makes on a node with these NUMA nodes, in config order. Without NUMA
    nodes (``devices/system/node/online`` unreadable) numaPools makes nothing: no pool could say
    where its NICs are."""
    out = []
    nodes = tuple(sorted(set(numa_nodes)))
    for r in config.resources:
        out.append(PoolSpec(r, r.name))
        if not (r.numa_pools and config.mode == "shared" and nodes):
            continue
        for n in nodes:
            numa = r.model_copy(update={"name": numa_resource_name(r.name, n), "numa_pools": False})
            out.append(PoolSpec(numa, r.name, NUMA, (n,)))
        local = r.model_copy(update={"name": local_resource_name(r.name), "numa_pools": False})
        out.append(PoolSpec(local, r.name, LOCAL, nodes))
    return out


def _varint_len(n: int) -> int:
    return max(1, (n.bit_length() + 6) // 7)


def _field(payload: int) -> int:
    """A length-delimited field with a one-byte tag: tag, length, payload."""
    return 1 + _varint_len(payload) + payload


def device_bytes(device_id: str, numa_node: int | None) -> int:
    """Wire size of one Device inside ListAndWatchResponse.devices, health "Unhealthy" (the longest)."""
    size = _field(len(device_id.encode())) + _field(_WORST_HEALTH)
    if numa_node is not None:
        node = 0 if numa_node == 0 else 1 + _varint_len(numa_node)  # NUMANode{ID}: proto3 omits 0
        size += _field(_field(node))  # topology: TopologyInfo{nodes: [NUMANode]}
    return _field(size)


def snapshot_problems(specs: Sequence[PoolSpec]) -> list[str]:
    """Pools whose worst-case ListAndWatch message exceeds the kubelet's 4 MiB limit on this node."""
    out = []
    for spec in specs:
        size = sum(device_bytes(i, n) for i, n in spec.devices())
        if size > MAX_MESSAGE_BYTES:
            out.append(
                f"resources[{spec.configured}]: numaPools makes {spec.name} with {len(spec.devices())} devices "
                f"({size} bytes per ListAndWatch message, over the kubelet's 4 MiB limit) on this node's "
                f"{len(spec.numa_nodes)} NUMA nodes: lower sharedDevices"
            )
    return out


def without_numa(specs: Sequence[PoolSpec], selected: Mapping[str, Sequence[Nic]]) -> list[str]:
    """Lines for NICs a configured resource selects that no per-NUMA pool can hold (no NUMA node)."""
    out = []
    for spec in specs:
        if spec.kind != LOCAL:
            continue
        lost = sorted(n.name for n in selected.get(spec.configured, ()) if n.numa_node is None)
        if lost:
            out.append(
                f"NIC(s) {', '.join(lost)} have no NUMA node (the kernel reports -1): served by "
                f"{spec.configured} only, not by its per-NUMA pools"
            )
    return out
