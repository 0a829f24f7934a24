"""The local default, without a cluster or RDMA hardware.

Writes a fixture Lingjun node, starts the kubelet simulator, runs the real
``rdma-device-plugin serve`` process against both, then prints what
``kubectl get node -o yaml`` would show and what a pod asking for one device receives.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from typing import Any

import yaml

from .config import load_config
from .kubelet_sim import KubeletSimulator
from .node import fixtures


def run_demo(workdir: str, config_path: str | None = None, nics: int = 4, bond: bool = True) -> dict[str, Any]:
    """Run the plugin against a fixture node and the simulator; returns node status and one allocation."""
    node = fixtures.write_node(os.path.join(workdir, "node"), fixtures.lingjun_node(nics=nics, bond=bond))
    dp_dir = os.path.join(workdir, "device-plugins")
    config = load_config(config_path)
    sim = KubeletSimulator(dp_dir).start()
    cmd = [
        sys.executable,
        "-m",
        "rdma_device_plugin",
        "serve",
        "--sysfs-root",
        node.sysfs,
        "--dev-root",
        node.dev,
        "--procfs-root",
        node.procfs,
        "--device-plugin-dir",
        dp_dir,
        "--log-format",
        "json",
    ]
    if config_path:
        cmd += ["--config", config_path]
    log_path = os.path.join(workdir, "plugin.log")
    with open(log_path, "w", encoding="utf-8") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        resources = [r.name for r in config.resources]
        for name in resources:
            if not sim.wait_registered(name, timeout=20):
                raise RuntimeError(f"plugin did not register {name}; see {log_path}")
        status = sim.node_status()
        resource = resources[0]
        alloc = sim.allocate(resource, 1, pod="rdma-hostnetwork-test", container="rdma-test")
        return {
            "node": {"apiVersion": "v1", "kind": "Node", "metadata": {"name": sim.node_name}, "status": status},
            "pod": {
                "resource": resource,
                "deviceIDs": alloc.ids,
                "devices": [
                    {"containerPath": d.container_path, "hostPath": d.host_path, "permissions": d.permissions}
                    for d in alloc.response.devices
                ],
                "env": alloc.envs,
            },
        }
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
        sim.stop()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", help="plugin config file (default: built-in shared-mode defaults)")
    parser.add_argument("--nics", type=int, default=4)
    parser.add_argument("--no-bond", action="store_true")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="rdma-demo-") as tmp:
        result = run_demo(tmp, args.config, args.nics, not args.no_bond)
    print("# kubectl get node -o yaml (device-plugin part of status)")
    print(yaml.safe_dump(result["node"], sort_keys=False).rstrip())
    print("---")
    print(f"# what a container asking for {result['pod']['resource']}: 1 receives")
    print(yaml.safe_dump(result["pod"], sort_keys=False).rstrip())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
