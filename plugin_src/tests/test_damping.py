"""Flap damping of NIC health (issue 30): route-flap damping (RFC 2439) applied to NICs. Unhealthy
at once, Healthy again only after a hold-down that grows with the flap rate; the kubelet sees a
handful of transitions from a port that flaps 20 times a second."""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import pytest

from rdma_device_plugin.config import HealthConfig
from rdma_device_plugin.health import REUSE, FlapDamping
from rdma_kubesim.flap import flapper, zero_changes

RES = "rdma/hca"


def test_one_flap_is_not_held_and_flaps_in_quick_succession_are() -> None:
    damping = FlapDamping(half_life=10, suppress=2, max_hold=60)
    assert damping.observe({"a": True}, 0) == {}  # first sight: no flap
    assert damping.observe({"a": False}, 1) == {}  # one flap: Unhealthy only while down (the pool's rule)
    assert damping.observe({"a": True}, 2) == {}
    held = damping.observe({"a": False}, 3)  # a second flap 2 s later: penalty 1.87, below 2: not yet
    assert held == {}
    assert damping.observe({"a": True}, 3.5) == {}
    held = damping.observe({"a": False}, 4)  # a third: penalty > 2
    assert set(held) == {"a"} and held["a"].flaps == 3
    # the hold lasts until the penalty decays to the reuse limit: half_life * log2(penalty / 0.75)
    penalty = ((1 * 2 ** (-2 / 10)) + 1) * 2 ** (-1 / 10) + 1
    assert held["a"].until == pytest.approx(4 + 10 * math.log2(penalty / REUSE))
    assert set(damping.observe({"a": True}, 5)) == {"a"}  # up again, still held
    assert damping.observe({"a": True}, held["a"].until + 0.01) == {}  # released


def test_the_hold_down_grows_with_the_flap_rate_and_is_capped() -> None:
    default = HealthConfig().flap_damping

    def hold_after(flaps: int, every: float) -> float:
        damping = FlapDamping(default.half_life_seconds, default.suppress_penalty, default.max_hold_down_seconds)
        damping.observe({"a": True}, 0)
        t = 0.0
        held: dict[str, Any] = {}
        for _ in range(flaps):
            t += every / 2
            held = damping.observe({"a": False}, t)
            t += every / 2
            held = damping.observe({"a": True}, t)
        return held["a"].until - t if held else 0.0

    assert hold_after(1, 0.1) == 0  # a cable reseated: Healthy as soon as it is up
    assert hold_after(2, 1) > 0  # a second flap within a half-life: held
    assert 0 < hold_after(3, 0.1) < hold_after(10, 0.1) < hold_after(200, 0.05) <= 120 + 1e-6
    assert 100 < hold_after(200, 0.05) <= 120  # 20 flaps a second for 10 s: close to the cap
    assert hold_after(10, 30) == 0  # one flap every 30 s never adds up to a hold-down (half-life 15 s)


def test_a_nic_gone_from_the_verdicts_is_forgotten() -> None:
    damping = FlapDamping(half_life=10, suppress=1, max_hold=60)
    damping.observe({"a": True}, 0)
    assert set(damping.observe({"a": False}, 1)) == {"a"}
    assert damping.observe({}, 2) == {}
    assert damping.observe({"a": True}, 3) == {}  # back as a new NIC: no history


@pytest.mark.timeout(180)
def test_a_port_flapping_20_times_a_second_reaches_the_kubelet_a_few_times(  # type: ignore[no-untyped-def]
    kubelet, start_plugin, node, dp_dir: Path
) -> None:
    """One port of four flaps 20 times a second for 10 s (policy all): the kubelet sees the pool go
    Unhealthy at once, at most one more time (the first flap alone is not held), and come back once
    the port stayed up for the hold-down (here at most 5 s): not a toggle per flap."""
    config = {
        "health": {"intervalSeconds": 0.1, "flapDamping": {"halfLifeSeconds": 2, "maxHoldDownSeconds": 5}},
        "rediscoveryIntervalSeconds": 60,
    }
    plugin = start_plugin(config)
    assert kubelet.wait_registered(RES, timeout=30), plugin.output()
    kubelet.record_start()
    thread = flapper(node, "mlx5_bond_1", hz=20, seconds=10)
    started = time.monotonic()
    thread.start()
    thread.join(60)
    stable = time.monotonic()
    assert kubelet.wait_allocatable(RES, 1000, timeout=30), plugin.output()[-3000:]
    back = time.monotonic()
    time.sleep(1)
    transitions = kubelet.record_stop()["transitions"]
    changes = zero_changes(transitions, RES)
    assert changes[-1] == 1000 and changes.count(0) <= 2, transitions  # the first flap, then held after the second
    assert back - stable >= 1.0, "Healthy again at once: no hold-down"  # it waited for the flaps to decay
    assert back - started < 10 + 5 + 5
    out = plugin.output()
    assert "mlx5_bond_1 held down after" in out and "mlx5_bond_1 no longer held down" in out
    assert out.count("held down after") == 1
