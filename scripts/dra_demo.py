#!/usr/bin/env python3
"""make dra-demo: the DRA driver on the local default, end to end, with the real v1.37.2 components.

Starts the local control plane (scripts/kube_cluster.py), joins one node that runs the kubelet's
DRA manager (kubelet-managers) on a fixture Lingjun node (4 bonded NICs, 2 GPUs under each NIC's
PCIe switch), applies the chart's DeviceClasses, runs ``rdma-device-plugin dra`` and the tests'
stub GPU DRA driver there, then creates a pod asking ``rdma/hca: 1`` and a pod with a claim for a
GPU and a NIC on the same PCIe root, and prints what each got (allocated devices, the env and device
nodes of its CDI spec). Everything stops at the end; ``--keep`` leaves it running (Ctrl-C stops).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "plugin_src" / "tests"))

import dra_support as ds  # noqa: E402
from gpu_dra_stub import DRIVER as GPU_DRIVER  # noqa: E402
from gpu_dra_stub import GpuDraStub  # noqa: E402


def show(api: ds.Api, node: ds.DraNode, pod: str, claim: str) -> None:
    results = api.claim(claim)["status"]["allocation"]["devices"]["results"]
    env, nodes = node.got(pod)
    print(f"\npod {pod} (claim {claim}):")
    for r in results:
        print(f"  allocated {r['driver']}/{r['pool']}/{r['device']} for request {r['request']}")
    for k in sorted(env):
        print(f"  env {k}={env[k]}")
    for n in nodes:
        print(f"  device {n}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--keep", action="store_true", help="leave the cluster, node and drivers running until Ctrl-C")
    args = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="rdma-dra-demo-", dir="/tmp"))  # short: unix sockets below it
    cluster = ds.kube_cluster.Cluster(work / "cluster")
    node: ds.DraNode | None = None
    gpus: GpuDraStub | None = None
    try:
        print(f"[1/5] control plane v1.37.2 in {work}/cluster ...", flush=True)
        cluster.up()
        api = ds.Api(cluster.kubeconfig)
        for obj in ds.chart_objects({"driver": "dra"}):
            if obj["kind"] == "DeviceClass":
                api.apply(obj)
        gpu_class = {"cel": {"expression": f'device.driver == "{GPU_DRIVER}"'}}
        api.apply(
            {
                "apiVersion": "resource.k8s.io/v1",
                "kind": "DeviceClass",
                "metadata": {"name": GPU_DRIVER},
                "spec": {"selectors": [gpu_class]},
            }
        )
        print("[2/5] node demo-0 (kubelet DRA manager) on a fixture node, the RDMA DRA driver and a stub GPU driver")
        node = ds.DraNode(cluster, "demo-0", work / "n", index=1, mode="shared").start_driver()
        gpus = GpuDraStub(api.client, node.name, str(node.kubelet_dir), node.fixture.sysfs).start()
        ds.wait_for("the node's ResourceSlices", lambda: len(api.slices(node.name)) >= 2)
        devices = sorted(ds.slice_devices(api.slices(node.name)))
        print(f"      ResourceSlices of {ds.DRIVER}: {', '.join(devices)}")
        print("[3/5] pod hca: rdma/hca: 1 in its limits (served by the DeviceClass with extendedResourceName)")
        api.create(ds.pod("hca", node.name, limits={"rdma/hca": "1"}))
        print("[4/5] pod aligned: a claim for a GPU (0000:58:00.0) and a NIC on its PCIe root")
        gpu = ds.request("gpu", GPU_DRIVER, 'device.attributes["resource.kubernetes.io"].pciBusID == "0000:58:00.0"')
        nic = ds.request("nic", f"nic.{ds.DRIVER}")
        match = [{"requests": ["gpu", "nic"], "matchAttribute": "resource.kubernetes.io/pcieRoot"}]
        api.create(ds.claim("aligned", [gpu, nic], match))
        api.create(ds.pod("aligned", node.name, ["aligned"]))
        print("[5/5] waiting for the scheduler and the kubelet ...", flush=True)
        hca = ds.wait_for("pod hca running", lambda: ds.running(api, "hca"), timeout=300)
        ds.wait_for("pod aligned running", lambda: ds.running(api, "aligned"), timeout=300)
        show(api, node, "hca", hca["status"]["extendedResourceClaimStatus"]["resourceClaimName"])
        show(api, node, "aligned", "aligned")
        if args.keep:
            print(f"\nrunning: export KUBECONFIG={cluster.kubeconfig}; Ctrl-C stops everything")
            while True:
                time.sleep(3600)
        return 0
    except KeyboardInterrupt:
        return 0
    except (ds.kube_cluster.ClusterError, AssertionError) as exc:
        print(f"dra-demo: {exc}", file=sys.stderr)
        return 1
    finally:
        if gpus is not None:
            gpus.stop()
        if node is not None:
            node.close()
        cluster.down()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
