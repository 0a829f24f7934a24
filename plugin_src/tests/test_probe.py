"""A health probe that fails is a failure (issue 30): counted, logged once per episode, the
heartbeat moves only on success, and after the bound the resources turn Unhealthy at the kubelet
and liveness fails. The real supervisor runs in this process (so that the probe can be made to
fail), with real gRPC to the kubelet simulator."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from rdma_device_plugin.config import load_config_text
from rdma_device_plugin.metrics import MetricsHooks
from rdma_device_plugin.supervision import check_health
from rdma_device_plugin.supervisor import Supervisor
from rdma_kubesim import KubeletSimulator
from rdma_node import fixtures, sysfs

RES = "rdma/hca"


@pytest.fixture
def running(node: fixtures.FixtureNode, dp_dir: Path, short_tmp: Path) -> Iterator[tuple[Supervisor, Any]]:
    sim = KubeletSimulator(str(dp_dir)).start()
    metrics = MetricsHooks(CollectorRegistry(auto_describe=True))
    config = load_config_text("health: {intervalSeconds: 0.1}", "test")
    sup = Supervisor(config, node.sysfs, node.dev, str(dp_dir), metrics, health_file=str(short_tmp / "health.json"))
    thread = threading.Thread(target=sup.run, daemon=True)
    thread.start()
    try:
        assert sim.wait_registered(RES, timeout=30)
        yield sup, sim
    finally:
        sup.stop_event.set()
        sup.wake()
        thread.join(30)
        sim.stop()


def failures(sup: Supervisor) -> float:
    registry = sup.hooks.registry  # type: ignore[attr-defined]
    return registry.get_sample_value("rdma_dp_probe_failures_total") or 0.0


def failing(sup: Supervisor) -> float | None:
    return sup.hooks.registry.get_sample_value("rdma_dp_probe_failing")  # type: ignore[attr-defined,no-any-return]


@pytest.mark.timeout(120)
def test_a_probe_that_keeps_failing_turns_the_resource_unhealthy_and_fails_liveness(
    running: tuple[Supervisor, Any],
    node: fixtures.FixtureNode,
    short_tmp: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    sup, sim = running
    caplog.set_level(logging.INFO, logger="rdma_device_plugin.supervisor")
    health = short_tmp / "health.json"
    assert sim.wait_for(lambda: check_health(str(health)) == [], timeout=30)
    assert failing(sup) == 0

    def broken(self: Any) -> Any:
        raise RuntimeError("injected: the port states cannot be read")

    monkeypatch.setattr(sysfs.PortStateReader, "read", broken)
    assert sim.wait_for(lambda: failures(sup) >= 20, timeout=30), failures(sup)
    assert failing(sup) == 1
    # The health file is rewritten every few seconds: read the heartbeat from a write made after the
    # probe started failing (an older write can hold a heartbeat from before the last success).
    failing_since = time.time()
    assert sim.wait_for(lambda: json.loads(health.read_text(encoding="utf-8"))["time"] > failing_since, timeout=30)
    before = json.loads(health.read_text(encoding="utf-8"))["loops"]["probe"]["last"]
    node.set_port_state("mlx5_bond_1", "DOWN")  # it cannot be seen: the resource must not look fine
    # After the bound (10 s): every device Unhealthy at the kubelet, and liveness fails.
    assert sim.wait_allocatable(RES, 0, timeout=sup.probe_bound() + 20)
    assert sim.wait_for(lambda: any("probe" in p for p in check_health(str(health))), timeout=30)
    assert json.loads(health.read_text(encoding="utf-8"))["loops"]["probe"]["last"] == before
    said = [r for r in caplog.records if r.getMessage().startswith("port probe failed")]
    assert len(said) == 1 and said[0].levelno == logging.ERROR, [r.getMessage() for r in said]
    assert any("every resource is Unhealthy" in r.getMessage() for r in caplog.records)
    status = sup.hooks.registry.get_sample_value("rdma_dp_devices", {"resource": RES, "health": "Healthy"})  # type: ignore[attr-defined]
    assert status == 0

    monkeypatch.undo()  # the probe works again: the port DOWN is seen, then ACTIVE again
    assert sim.wait_for(lambda: failing(sup) == 0, timeout=30)
    assert any(r.getMessage().startswith("port probe works again after") for r in caplog.records)
    assert sim.wait_for(lambda: check_health(str(health)) == [], timeout=30)
    assert sim.allocatable(RES) == 0  # mlx5_bond_1 is DOWN (policy all)
    node.set_port_state("mlx5_bond_1", "ACTIVE")
    assert sim.wait_allocatable(RES, 1000, timeout=30)
    time.sleep(0.3)
    assert failing(sup) == 0
