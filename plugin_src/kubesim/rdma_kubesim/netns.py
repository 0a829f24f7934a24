"""Network namespaces for tests and benchmarks: the real kernel's netdevs, addresses and link events.

:class:`Netns` is a bare namespace (``ip netns add``) with a helper to run ``ip`` inside it.
:class:`NodeNetns` stands in for a fixture node's own network namespace: it holds veth links with
the very names and ifindexes the fixture's sysfs tree gives its netdevs (bond0, eth0, ...), so a
plugin run inside it (``ip netns exec``) sees what a hostNetwork plugin sees on a node:
``if_nametoindex`` agrees with sysfs, and ``ip link set bond1 down`` sends a real RTM_NEWLINK. A
port going DOWN on a node is both at once (mlx5 derives a RoCE port's state from its netdev);
:meth:`NodeNetns.set_port` does both in that order. Needs root and iproute2.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid

from rdma_node import fixtures, sysfs


def available() -> str | None:
    """Why network namespaces cannot be used here, or None."""
    if os.geteuid() != 0:
        return "needs root"
    if shutil.which("ip") is None:
        return "needs iproute2 (ip)"
    return None


class Netns:
    """A fresh network namespace, deleted by :meth:`close`."""

    def __init__(self) -> None:
        self.name = f"rdp-{uuid.uuid4().hex[:8]}"
        subprocess.run(["ip", "netns", "add", self.name], check=True, capture_output=True, text=True)

    @property
    def exec_prefix(self) -> list[str]:
        """Prefix a command with this to run it inside the namespace."""
        return ["ip", "netns", "exec", self.name]

    def ip(self, *args: str) -> str:
        """``ip <args>`` inside the namespace; its output."""
        return subprocess.run(["ip", "-n", self.name, *args], check=True, capture_output=True, text=True).stdout

    def close(self) -> None:
        subprocess.run(["ip", "netns", "del", self.name], check=False, capture_output=True)

    def __enter__(self) -> Netns:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class NodeNetns(Netns):
    """A netns with the fixture node's netdevs; link toggles go through one ``ip -batch`` process."""

    def __init__(self, node: fixtures.FixtureNode) -> None:
        super().__init__()
        self.node = node
        try:
            self.ip("link", "set", "lo", "up")
            for nic in sysfs.read_nics(node.sysfs, node.dev):
                for n, netdev in enumerate(nic.netdevs):
                    index = sysfs.netdev_ifindex(node.sysfs, netdev) or 0
                    # veth (dummy is not built into every kernel); the peer's own link messages
                    # are noise the plugin must filter out, as a node's other netdevs are.
                    peer = f"p{index or n}-{nic.name[-4:]}"[:15]
                    self.ip(
                        "link", "add", netdev, "index", str(index), "type", "veth",
                        "peer", "name", peer, "index", str(index + 10000 if index else 0),
                    )  # fmt: skip
                    self.ip("link", "set", peer, "up")
                    self.ip("link", "set", netdev, "up")
        except BaseException:
            super().close()
            raise
        # One long-lived `ip -batch` for toggles: a link change costs a line on a pipe, not a process.
        self._batch = subprocess.Popen(
            ["ip", "-n", self.name, "-force", "-batch", "-"], stdin=subprocess.PIPE, text=True, bufsize=1
        )

    def set_link(self, netdev: str, up: bool) -> None:
        assert self._batch.stdin is not None
        self._batch.stdin.write(f"link set dev {netdev} {'up' if up else 'down'}\n")
        self._batch.stdin.flush()

    def set_port(self, nic: str, netdev: str, state: str) -> None:
        """A RoCE port changes state: sysfs says so first, then the link message goes out."""
        self.node.set_port_state(nic, state)
        self.set_link(netdev, state == "ACTIVE")

    def close(self) -> None:
        if self._batch.stdin is not None:
            self._batch.stdin.close()
        self._batch.wait(10)
        super().close()
