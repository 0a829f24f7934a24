"""The node's network namespace, for a fixture node: the real kernel's netdevs and link events.

A fixture's sysfs tree names netdevs (bond0, eth0, ...) with an ifindex each. This creates a
network namespace holding veth links with those very names and indexes, so that a plugin run
inside it (``ip netns exec``) sees what a hostNetwork plugin sees on a node: ``if_nametoindex``
agrees with sysfs, and ``ip link set bond1 down`` sends a real RTM_NEWLINK. A port going DOWN
on a node is both at once (mlx5 derives a RoCE port's state from its netdev); :meth:`set_port`
does both in that order. Needs root and iproute2.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid

from ..node import fixtures, sysfs


def available() -> str | None:
    """Why network namespaces cannot be used here, or None."""
    if os.geteuid() != 0:
        return "needs root"
    if shutil.which("ip") is None:
        return "needs iproute2 (ip)"
    return None


class NodeNetns:
    """A netns with the fixture node's netdevs; commands go through one ``ip -batch`` process."""

    def __init__(self, node: fixtures.FixtureNode) -> None:
        self.node = node
        self.name = f"rdp-{uuid.uuid4().hex[:8]}"
        subprocess.run(["ip", "netns", "add", self.name], check=True, capture_output=True, text=True)
        try:
            self._ip("link", "set", "lo", "up")
            for nic in sysfs.read_nics(node.sysfs, node.dev):
                for n, netdev in enumerate(nic.netdevs):
                    index = sysfs.netdev_ifindex(node.sysfs, netdev) or 0
                    # veth (dummy is not built into every kernel); the peer's own link messages
                    # are noise the plugin must filter out, as a node's other netdevs are.
                    peer = f"p{index or n}-{nic.name[-4:]}"[:15]
                    self._ip(
                        "link", "add", netdev, "index", str(index), "type", "veth",
                        "peer", "name", peer, "index", str(index + 10000 if index else 0),
                    )  # fmt: skip
                    self._ip("link", "set", peer, "up")
                    self._ip("link", "set", netdev, "up")
        except BaseException:
            self.close()
            raise
        # One long-lived `ip -batch` for toggles: a link change costs a line on a pipe, not a process.
        self._batch = subprocess.Popen(
            ["ip", "-n", self.name, "-force", "-batch", "-"], stdin=subprocess.PIPE, text=True, bufsize=1
        )

    @property
    def exec_prefix(self) -> list[str]:
        """Prefix a command with this to run it inside the namespace."""
        return ["ip", "netns", "exec", self.name]

    def _ip(self, *args: str) -> None:
        subprocess.run(["ip", "-n", self.name, *args], check=True, capture_output=True, text=True)

    def set_link(self, netdev: str, up: bool) -> None:
        assert self._batch.stdin is not None
        self._batch.stdin.write(f"link set dev {netdev} {'up' if up else 'down'}\n")
        self._batch.stdin.flush()

    def set_port(self, nic: str, netdev: str, state: str) -> None:
        """A RoCE port changes state: sysfs says so first, then the link message goes out."""
        self.node.set_port_state(nic, state)
        self.set_link(netdev, state == "ACTIVE")

    def close(self) -> None:
        batch = getattr(self, "_batch", None)
        if batch is not None and batch.stdin is not None:
            batch.stdin.close()
            batch.wait(10)
        subprocess.run(["ip", "netns", "del", self.name], check=False, capture_output=True)

    def __enter__(self) -> NodeNetns:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
