"""The DRA driver imports only what it needs (memory, issue 38: bench/RESULTS.md): none of the device
plugin's serving modules (its pools, its gRPC server, its published views), no pydantic (its config
is validated in a child process: config_view) and, without --metrics-address, no metrics at all. A
size on this machine would be noise; the imports are not."""

from __future__ import annotations

import json
import subprocess
import sys

PROBE = """
import json, sys
from rdma_device_plugin import cli
cli.build_parser()
{extra}
print(json.dumps(sorted(sys.modules)))
"""

DEVICE_PLUGIN = {
    "rdma_device_plugin.resources",
    "rdma_device_plugin.server",
    "rdma_device_plugin.published",
    "rdma_device_plugin.numa_pools",
    "rdma_device_plugin.port_counters",
    "rdma_device_plugin.metrics",
    "rdma_device_plugin.api.deviceplugin_pb2",
}


def _modules(extra: str) -> set[str]:
    out = subprocess.run(
        [sys.executable, "-c", PROBE.format(extra=extra)], capture_output=True, text=True, check=True, timeout=120
    )
    return set(json.loads(out.stdout))


def test_the_driver_loads_no_device_plugin_server_and_no_metrics() -> None:
    # with its config read as the driver reads it: validated in a child process (config_view)
    mods = _modules("from rdma_device_plugin.dra import driver; driver.ConfigCheck(None).result()")
    assert {"rdma_device_plugin.dra.publisher", "rdma_device_plugin.dra.stats", "grpc"} <= mods  # the right names
    assert not DEVICE_PLUGIN & mods
    unwanted = {"rdma_device_plugin.dra.metrics", "rdma_device_plugin.metricsauth", "pyverbs", "rdma_node.fixtures"}
    assert not unwanted & mods
    assert not {m for m in mods if m.split(".")[0] in ("prometheus_client", "rdma_kubesim", "kubernetes")}
    assert not {m for m in mods if m.split(".")[0] in ("pydantic", "pydantic_core")}
    assert "rdma_device_plugin.config" not in mods and "rdma_device_plugin.config_view" in mods


def test_the_drivers_metrics_load_prometheus_but_not_the_device_plugins_metrics() -> None:
    mods = _modules("from rdma_device_plugin.dra import driver, metrics")
    assert {"prometheus_client", "rdma_device_plugin.metricsserver"} <= mods
    assert not DEVICE_PLUGIN & mods
