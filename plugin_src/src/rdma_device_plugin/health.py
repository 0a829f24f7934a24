"""The one rule for whether a NIC is usable, and why not (pure logic).

A NIC is usable when it is present in sysfs, has ports, every port is ACTIVE (or ACTIVE_DEFER), and
its uverbs character device exists. The pools derive device health from it, the status file shows
its reason, and discovery logs its changes.
"""

from __future__ import annotations

from dataclasses import dataclass

from .node.sysfs import ACTIVE_STATES


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
