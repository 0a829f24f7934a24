"""The one rule for whether a NIC is usable, and why not, and how a flapping NIC is held down
(pure logic).

A NIC is usable when it is present in sysfs, has ports, every port is ACTIVE (or ACTIVE_DEFER), and
its uverbs character device exists. The pools derive device health from it, the status file shows
its reason, and discovery logs its changes.

Flap damping (:class:`FlapDamping`) is route-flap damping (RFC 2439, as BGP routers damp routes)
applied to NICs: a NIC is Unhealthy the moment it is not usable; each time it goes from usable to
not usable (a flap) its penalty grows by 1, and the penalty halves every ``half_life`` seconds. At
a penalty of ``suppress`` (1.5 by default: a second flap within one half-life; one flap, a cable
reseated, never holds a NIC down) the NIC is *held down*: Unhealthy even while usable, until
the penalty has decayed below the reuse limit (0.75 of a flap, RFC 2439's 750 per 1000), i.e. for
``half_life * log2(penalty / 0.75)`` seconds after its last flap, at most ``max_hold`` (the penalty
is capped there). The hold-down therefore grows with the flap rate, and the kubelet sees a handful
of transitions from a NIC that flaps many times a second, not each flap.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from rdma_node.sysfs import ACTIVE_STATES


@dataclass(frozen=True)
class NicHealth:
    """What the health probe knows about one NIC."""

    present: bool
    ports: tuple[str, ...]  # port states; empty when gone
    uverbs: bool = True  # its uverbs character device exists

    @property
    def why(self) -> str:
        """Why the NIC is not usable ("" when it is)."""
        if not self.present:
            return "NIC gone from sysfs"
        if not self.ports:
            return "no ports"
        bad = [f"port {i} {state}" for i, state in enumerate(self.ports, 1) if state not in ACTIVE_STATES]
        if bad:
            return ", ".join(bad) + " (not ACTIVE)"
        if not self.uverbs:
            return "no uverbs character device"
        return ""

    @property
    def healthy(self) -> bool:
        return not self.why

    def describe(self) -> str:
        """The state as a person reads it in a log line: ``gone``, ``port 1 DOWN``, ``no ports``."""
        if not self.present:
            return "gone"
        return ", ".join(f"port {i} {state}" for i, state in enumerate(self.ports, 1)) or "no ports"


REUSE = 0.75  # RFC 2439: reuse limit 750 for a penalty of 1000 per flap (config.REUSE_PENALTY)
FORGET = 0.05  # a penalty decayed this far is no history any more


@dataclass(frozen=True)
class Hold:
    """A NIC held down: its flaps in this episode, and when it is usable again if it stays up
    (monotonic time)."""

    flaps: int
    until: float


@dataclass
class _Flaps:
    penalty: float
    at: float  # monotonic time of ``penalty``
    usable: bool
    flaps: int = 0
    held: bool = False


class FlapDamping:
    """RFC 2439 damping of NIC health (module doc); one per node, keyed by NIC identity."""

    def __init__(self, half_life: float, suppress: float, max_hold: float) -> None:
        self.half_life = half_life
        self.suppress = suppress
        self.ceiling = REUSE * 2 ** (max_hold / half_life)  # the penalty of the longest hold-down
        self._nics: dict[str, _Flaps] = {}

    def observe(self, usable: Mapping[str, bool], now: float) -> dict[str, Hold]:
        """Take one probe's verdict per NIC (usable or not); the NICs held down now. A NIC missing
        from ``usable`` is forgotten; the first verdict on a NIC is no flap."""
        for key in set(self._nics) - set(usable):
            del self._nics[key]
        held: dict[str, Hold] = {}
        for key, ok in usable.items():
            nic = self._nics.get(key)
            if nic is None:
                self._nics[key] = _Flaps(0.0, now, ok)
                continue
            nic.penalty *= 2 ** (-(now - nic.at) / self.half_life)
            nic.at = now
            if nic.usable and not ok:
                nic.penalty = min(nic.penalty + 1, self.ceiling)
                nic.flaps += 1
                nic.held = nic.held or nic.penalty >= self.suppress
            nic.usable = ok
            if nic.held and nic.penalty < REUSE:
                nic.held = False
            if not nic.held and nic.penalty < FORGET:
                nic.flaps = 0
            if nic.held:
                held[key] = Hold(nic.flaps, now + self.half_life * math.log2(nic.penalty / REUSE))
        return held
