"""Exclusive-mode latency: Allocate and GetPreferredAllocation against a real ``serve`` process.

Starts the kubelet simulator and ``rdma-device-plugin serve`` (mode: exclusive) on an
8-NIC, two-NUMA fixture node in a temp dir, then calls the plugin over its unix socket
N times per RPC (default 2000) and prints p50/p99/max, next to a no-op
GetDevicePluginOptions measured in the same run (the gRPC + unix socket floor).

    .venv/bin/python bench/bench_exclusive.py [--calls 2000]   (plugin logs at info, its default)
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import grpc
import yaml

from rdma_device_plugin import sockets
from rdma_device_plugin.api import deviceplugin_pb2 as pb
from rdma_device_plugin.api import deviceplugin_pb2_grpc as pb_grpc
from rdma_kubesim import KubeletSimulator
from rdma_node import fixtures

RES = "rdma/hca"


def _percentile(sorted_values: list[float], q: float) -> float:
    idx = min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))
    return sorted_values[idx]


def _time(fn: Callable[[], Any], calls: int) -> dict[str, float]:
    for _ in range(min(100, calls)):  # warm up the channel and the server's threads
        fn()
    samples = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    samples.sort()
    return {
        "p50": _percentile(samples, 0.50) * 1e3,
        "p99": _percentile(samples, 0.99) * 1e3,
        "max": samples[-1] * 1e3,
        "mean": statistics.fmean(samples) * 1e3,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--nics", type=int, default=8)
    args = parser.parse_args()

    tmp = tempfile.mkdtemp(prefix="rdp-bench-", dir="/tmp")
    proc: subprocess.Popen[bytes] | None = None
    sim: KubeletSimulator | None = None
    try:
        node = fixtures.write_node(os.path.join(tmp, "node"), fixtures.lingjun_node(nics=args.nics, numa_nodes=2))
        dp_dir = os.path.join(tmp, "dp")
        cfg = os.path.join(tmp, "config.yaml")
        with open(cfg, "w", encoding="utf-8") as fh:
            yaml.safe_dump({"version": "v1", "mode": "exclusive"}, fh)
        sim = KubeletSimulator(dp_dir).start()
        log = open(os.path.join(tmp, "plugin.log"), "wb")  # noqa: SIM115 - closed with the process
        proc = subprocess.Popen(
            [
                *(sys.executable, "-m", "rdma_device_plugin", "serve", "--config", cfg),
                *("--sysfs-root", node.sysfs, "--dev-root", node.dev, "--procfs-root", node.procfs),
                *("--device-plugin-dir", dp_dir, "--log-level", "info"),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        if not sim.wait_registered(RES, timeout=15):
            log.close()
            with open(log.name, encoding="utf-8") as fh:
                print("plugin did not register; log:", fh.read(), file=sys.stderr)
            return 1
        ids = sorted(sim.devices(RES))
        sock = sockets.instances(dp_dir, RES)[-1].name  # the plugin's socket: rdma-dp-rdma_hca.<instance>.0.sock
        with grpc.insecure_channel(f"unix://{os.path.join(dp_dir, sock)}") as channel:
            stub = pb_grpc.DevicePluginStub(channel)
            alloc = pb.AllocateRequest()
            alloc.container_requests.add(devices_ids=ids[:2])
            pref = pb.PreferredAllocationRequest()
            pref.container_requests.add(available_deviceIDs=ids, must_include_deviceIDs=[], allocation_size=2)
            results = {
                "GetDevicePluginOptions (no-op)": _time(lambda: stub.GetDevicePluginOptions(pb.Empty()), args.calls),
                f"Allocate (2 of {len(ids)} NICs)": _time(lambda: stub.Allocate(alloc), args.calls),
                f"GetPreferredAllocation (2 of {len(ids)})": _time(
                    lambda: stub.GetPreferredAllocation(pref), args.calls
                ),
            }
        print(f"exclusive mode, {len(ids)} NICs on 2 NUMA nodes, {args.calls} sequential calls each, unix socket")
        print(f"{'RPC':36} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8} {'mean ms':>8}")
        for name, r in results.items():
            print(f"{name:36} {r['p50']:8.3f} {r['p99']:8.3f} {r['max']:8.3f} {r['mean']:8.3f}")
        return 0
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=10)
        if sim is not None:
            sim.stop()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
