"""The real ``rdma-device-plugin serve`` on a fixture node, as tests and benches start it."""

from __future__ import annotations

import sys

from rdma_node import fixtures


def serve_command(node: fixtures.FixtureNode, device_plugin_dir: str, *extra: str) -> list[str]:
    """``serve`` in this interpreter on ``node``'s sysfs, dev and proc roots, registering through
    ``device_plugin_dir``; ``extra`` appended (``--config``, ``--health-file`` ...)."""
    cmd = [sys.executable, "-m", "rdma_device_plugin", "serve", "--sysfs-root", node.sysfs, "--dev-root", node.dev]
    return [*cmd, "--procfs-root", node.procfs, "--device-plugin-dir", device_plugin_dir, *extra]
