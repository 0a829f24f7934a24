"""``healthcheck --ready`` (the chart's readinessProbe): a plugin that starts but never reaches the
kubelet is live and not ready, so a DaemonSet rollout of a bad image halts at its first batch; it
turns ready once registered with the kubelet's stream open, and not ready again when that ends."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from rdma_device_plugin.kubesim import KubeletSimulator
from rdma_device_plugin.supervision import check_ready

RES = "rdma/hca"
WAIT = 60.0


def _check(health: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "rdma_device_plugin", "healthcheck", "--health-file", str(health), *flags]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)


def _until(check, timeout: float = WAIT) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.2)
    return bool(check())


def test_never_registered_is_live_but_not_ready(start_plugin, dp_dir: Path, short_tmp: Path) -> None:  # type: ignore[no-untyped-def]
    health = short_tmp / "health.json"
    plugin = start_plugin()  # no kubelet.sock in dp_dir: it serves its socket and waits, never registered
    assert _until(lambda: health.exists() and _check(health).returncode == 0), plugin.output()
    for _ in range(3):  # not a moment: it stays not ready while nothing registers it
        ready = _check(health, "--ready")
        assert ready.returncode == 1, ready.stderr
        assert "not ready: resource rdma/hca is not registered with the kubelet" in ready.stderr
        time.sleep(0.5)

    sim = KubeletSimulator(str(dp_dir)).start()
    try:
        assert sim.wait_registered(RES, timeout=WAIT), plugin.output()
        assert _until(lambda: _check(health, "--ready").returncode == 0), _check(health, "--ready").stderr
    finally:
        sim.stop()  # the kubelet goes away: its stream ends, registering fails
    assert _until(lambda: _check(health, "--ready").returncode == 1), plugin.output()
    assert _check(health).returncode == 0  # still live: the liveness probe leaves it running


def test_ready_rules(tmp_path: Path) -> None:
    now = time.time()
    doc = {"loops": {"probe": {"last": now, "max_age": 10}}, "registered": ["rdma/hca"], "unregistered_since": {}}
    path = tmp_path / "health.json"
    path.write_text(json.dumps(doc), encoding="utf-8")
    assert check_ready(str(path), now) == []
    path.write_text(json.dumps({**doc, "registered": [], "unregistered_since": {"rdma/hca": now - 7}}))
    assert check_ready(str(path), now) == [
        "resource rdma/hca is not registered with the kubelet (its ListAndWatch stream open) since 7 s"
    ]
    path.write_text(json.dumps({**doc, "registered": []}))
    assert check_ready(str(path), now) == ["no resource is registered with the kubelet yet"]
    # a stood-down instance (a newer one on the node serves the resource) is not held back
    path.write_text(json.dumps({**doc, "registered": [], "stood_down": ["rdma/hca"]}))
    assert check_ready(str(path), now) == []
    # not live is not ready
    stale = {**doc, "loops": {"probe": {"last": now - 60, "max_age": 10}}}
    path.write_text(json.dumps(stale))
    assert check_ready(str(path), now)[0].startswith("loop probe has not completed")
