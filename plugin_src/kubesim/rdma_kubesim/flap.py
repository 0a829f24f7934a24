"""A flapping port and what the kubelet made of it (issue 30): the fault of the flap-damping test
(plugin_src/tests/test_damping.py, 10 s) and of bench/bench_flap.py (10 minutes), and the figures
both read from a kubelet's ``record_stop`` (:class:`~.real.RealKubelet`: every change of
allocatable, polled every 2 ms)."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from rdma_node import fixtures


def flapper(
    node: fixtures.FixtureNode, name: str, hz: float, seconds: float, stop: threading.Event | None = None
) -> threading.Thread:
    """A thread (not started) that writes the sysfs state of ``name``'s port 1 DOWN and ACTIVE in
    turn, ``hz`` full flaps a second, for ``seconds`` (or until ``stop`` is set); ACTIVE at the end."""

    def run() -> None:
        end = time.monotonic() + seconds
        state = "DOWN"
        while time.monotonic() < end and not (stop is not None and stop.is_set()):
            node.set_port_state(name, state)
            state = "ACTIVE" if state == "DOWN" else "DOWN"
            time.sleep(1 / hz / 2)
        node.set_port_state(name, "ACTIVE")

    return threading.Thread(target=run, daemon=True, name=f"flap-{name}")


def allocatable_values(transitions: Sequence[Mapping[str, Any]], resource: str) -> list[int]:
    """Allocatable of ``resource`` at each transition of a ``record_stop`` (0 while no kubelet runs)."""
    return [int(t.get("allocatable", {}).get(resource, 0)) if t.get("running", True) else 0 for t in transitions]


def zero_changes(transitions: Sequence[Mapping[str, Any]], resource: str) -> list[int]:
    """The value after each change of ``resource`` between 0 and not 0 (a node that stops or starts
    taking pods of it): what a flapping NIC toggles."""
    values = allocatable_values(transitions, resource)
    return [b for a, b in itertools.pairwise(values) if (a == 0) != (b == 0)]


def segments(
    transitions: Sequence[Mapping[str, Any]], resource: str, start_ms: float, end_ms: float
) -> list[tuple[float, float, int]]:
    """(from ms, to ms, allocatable) stretches of ``resource`` clipped to [start_ms, end_ms]."""
    values = allocatable_values(transitions, resource)
    out: list[tuple[float, float, int]] = []
    for i, (t, value) in enumerate(zip(transitions, values, strict=True)):
        begin = float(t["ms"])
        end = float(transitions[i + 1]["ms"]) if i + 1 < len(transitions) else end_ms
        lo, hi = max(begin, start_ms), min(end, end_ms)
        if hi > lo:
            out.append((lo, hi, value))
    return out
