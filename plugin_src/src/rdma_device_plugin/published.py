"""What the supervisor publishes for the readers on other threads: immutable pictures, replaced whole.

The supervisor's thread owns discovery, health and the pools (:mod:`.supervisor`). The gRPC
handlers read each pool's :class:`~.resources.PoolView`; the status-file thread and the metrics
scrapes read a :class:`NodeView`, which the supervisor builds after a pass that changed something
and hands to the hooks (``Hooks.published``): one reference, so a reader sees one moment, whole.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from rdma_node.sysfs import Nic

from .affinity import NodeAffinity
from .health import Hold
from .resources import PoolView


@dataclass(frozen=True)
class RegistrationView:
    name: str
    state: str  # registration.State value
    kubelet_stream: bool  # the kubelet's ListAndWatch stream of the registered socket is open
    confirmed_at: float | None  # the kubelet's first Allocate/GetPreferredAllocation on it (unix time)
    unregistered_since: float | None  # unix time


@dataclass(frozen=True)
class NodeView:
    pools: tuple[PoolView, ...]
    port_states: Mapping[str, tuple[str, ...] | None]  # RDMA device name -> port states (None: gone)
    nics: tuple[Nic, ...]  # every RDMA NIC found at the last re-list
    affinity: NodeAffinity
    held: Mapping[str, Hold]  # NICs held down after flapping, by name
    registrations: tuple[RegistrationView, ...]
    probe_failing: bool
    # (nic, port) -> port state changes seen since the start (discovery counts them)
    state_changes: Mapping[tuple[str, int], int] = field(default_factory=lambda: MappingProxyType({}))

    @property
    def registered(self) -> frozenset[str]:
        return frozenset(r.name for r in self.registrations if r.state == "registered")

    @property
    def kubelet_streams(self) -> frozenset[str]:
        return frozenset(r.name for r in self.registrations if r.kubelet_stream)


EMPTY_AFFINITY = NodeAffinity({}, (), {})
