"""A real Prometheus (Debian's prometheus, 127.0.0.1, 1 s scrapes, its own data dir and port)
scrapes the real plugin serving a fixture node to the kubelet simulator: every dashboard panel's
query returns data, and a port put DOWN fires the matching alerts (short `for`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import manifests, one

from rdma_device_plugin.kubesim import KubeletSimulator
from rdma_device_plugin.node import fixtures

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "scripts"))
from prometheus_local import Prometheus, free_port  # noqa: E402

RES = "rdma/hca"
JOB = "rdma-rdma-device-plugin-metrics"
NODE = "fixture-node"
WAIT = 120.0  # generous: a loaded 2-core machine


def wait_for(check: Callable[[], Any], timeout: float = WAIT, every: float = 0.5) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got or time.monotonic() > deadline:
            return got
        time.sleep(every)


@pytest.fixture
def rig() -> Iterator[dict[str, Any]]:
    tmp = Path(tempfile.mkdtemp(prefix="rdp-pm-", dir="/tmp"))
    fx = fixtures.write_node(str(tmp / "node"), fixtures.lingjun_node(nics=4, bond=True))
    dp = tmp / "dp"
    dp.mkdir()
    sim = KubeletSimulator(str(dp)).start()
    port = free_port()
    log = open(tmp / "plugin.log", "w", encoding="utf-8")  # noqa: SIM115 - closed below
    cmd = [sys.executable, "-m", "rdma_device_plugin", "serve", "--sysfs-root", fx.sysfs, "--dev-root", fx.dev]
    cmd += ["--procfs-root", fx.procfs, "--device-plugin-dir", str(dp), "--health-file", str(tmp / "health.json")]
    cmd += ["--metrics-address", f"127.0.0.1:{port}"]
    plugin = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    values = {
        "metrics": {
            "enabled": True,
            "dashboard": {"enabled": True},
            "prometheusRule": {"enabled": True, "for": {"nicPortNotActive": "2s", "allocatableZero": "2s"}},
        }
    }
    objs = manifests(values)
    groups = one(objs, "PrometheusRule")["spec"]["groups"]
    dashboard = json.loads(one(objs, "ConfigMap", "-dashboard")["data"]["rdma-device-plugin.json"])
    prom = Prometheus(JOB, [f"127.0.0.1:{port}"], {"node": NODE, "namespace": "kube-system", "pod": "rdma-fixture"}, groups)
    try:
        yield {"fx": fx, "sim": sim, "prom": prom, "dashboard": dashboard, "log": tmp / "plugin.log"}
    finally:
        prom.stop()
        if plugin.poll() is None:
            plugin.terminate()
            try:
                plugin.wait(15)
            except subprocess.TimeoutExpired:
                plugin.kill()
                plugin.wait()
        sim.stop()
        log.close()
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)


def firing(prom: Prometheus, name: str, **labels: str) -> list[dict[str, Any]]:
    return [
        a
        for a in prom.alerts()
        if a["labels"]["alertname"] == name and a["state"] == "firing" and all(a["labels"].get(k) == v for k, v in labels.items())
    ]


def test_dashboard_queries_return_data_and_port_down_fires(rig: dict[str, Any]) -> None:
    prom: Prometheus = rig["prom"]
    sim: KubeletSimulator = rig["sim"]
    assert sim.wait_registered(RES, timeout=WAIT), rig["log"].read_text()
    prom.wait_ready(WAIT)
    assert wait_for(lambda: prom.query(f'up{{job="{JOB}"}} == 1')), prom.targets()
    for pod in ("a", "b"):
        sim.allocate(RES, 1, pod=pod)

    queries = [
        (p["title"], t["expr"].replace("$node", NODE))
        for p in rig["dashboard"]["panels"]
        if p["type"] != "row"
        for t in p["targets"]
    ]
    assert len(queries) >= 12
    empty = [(title, q) for title, q in queries if not wait_for(lambda q=q: prom.query(q))]
    assert not empty, f"panels without data: {empty}"
    node_var = rig["dashboard"]["templating"]["list"][1]["query"]["query"]
    assert node_var.startswith("label_values(rdma_dp_build_info")
    assert prom.query(f'rdma_dp_build_info{{job="{JOB}"}}')[0]["metric"]["node"] == NODE

    # healthy: nothing fires (the short for: has long passed by now)
    assert not firing(prom, "RdmaNicPortNotActive") and not firing(prom, "RdmaAllocatableZero")
    rig["fx"].set_port_state("mlx5_bond_1", "DOWN")
    assert wait_for(lambda: firing(prom, "RdmaNicPortNotActive", nic="mlx5_bond_1", port="1", node=NODE)), prom.alerts()
    alert = firing(prom, "RdmaNicPortNotActive", nic="mlx5_bond_1")[0]
    assert "mlx5_bond_1" in alert["annotations"]["summary"] and NODE in alert["annotations"]["summary"]
    # default health policy "all": one NIC down leaves the shared pool with nothing allocatable
    assert wait_for(lambda: firing(prom, "RdmaAllocatableZero", resource=RES, node=NODE)), prom.alerts()
    assert not firing(prom, "RdmaNicPortNotActive", nic="mlx5_bond_0")
