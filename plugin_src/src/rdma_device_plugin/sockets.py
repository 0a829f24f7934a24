"""Socket file names: one per plugin instance and server start, ordered by instance start.

``rdma-dp-<resource>.<instance>.<n>.sock``, e.g. ``rdma-dp-rdma_hca.00004a1b2c3d4e5f9a3c.0.sock``:

- ``<resource>``: the resource name with ``/`` and ``.`` replaced (:func:`base_name`), so a name
  never contains the ``.`` that separates the parts;
- ``<instance>``: this process's start on the node's monotonic clock (CLOCK_MONOTONIC is one clock
  for every container of a node) in 16 hex digits, then 4 random hex digits. Unique across PID
  namespaces (the plugin is PID 1 in every pod), and a later instance sorts after an earlier one;
- ``<n>``: the server start within the process (the socket is served anew after a kubelet restart).

Two instances on a node (a DaemonSet rolling update, the two DaemonSets of a mode switch) therefore
never share a path: kubelets with kubernetes PR 135437 track endpoints by socket path and refuse a
second registration of a path, and the 1.28-1.34 ones cut the client registered now when an older
stream ends. A name is used once, so grpc's unlink of its bound path never touches another file.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass

from .kubeletapi import MAX_SOCKET_PATH

PREFIX = "rdma-dp-"
SUFFIX = ".sock"
_INSTANCE_DIGITS = 20
_MAX_START_DIGITS = 6  # server starts within one process: a million kubelet restarts
# The longest name beyond the base: "." + instance + "." + n + ".sock".
MAX_SUFFIX_LENGTH = 1 + _INSTANCE_DIGITS + 1 + _MAX_START_DIGITS + len(SUFFIX)


def _new_instance() -> str:
    return f"{time.monotonic_ns():016x}{int.from_bytes(os.urandom(2), 'big'):04x}"


INSTANCE = _new_instance()  # this process


def base_name(resource: str) -> str:
    """rdma/hca -> rdma-dp-rdma_hca (two resources with one base would serve each other's sockets)."""
    return PREFIX + resource.replace("/", "_").replace(".", "-")


def socket_name(resource: str, start: int, instance: str = INSTANCE) -> str:
    return f"{base_name(resource)}.{instance}.{start}{SUFFIX}"


@dataclass(frozen=True, order=True)
class SocketName:
    """A parsed socket name: ordered by instance, then server start."""

    instance: str
    start: int
    base: str
    name: str


def parse(name: str) -> SocketName | None:
    """The parts of one of our socket names, or None for any other file."""
    if not name.startswith(PREFIX) or not name.endswith(SUFFIX):
        return None
    parts = name[: -len(SUFFIX)].split(".")
    if len(parts) != 3 or len(parts[1]) != _INSTANCE_DIGITS or not parts[2].isdigit():
        return None
    try:
        int(parts[1], 16)
    except ValueError:
        return None
    return SocketName(parts[1], int(parts[2]), parts[0], name)


def path_problem(device_plugin_dir: str, resource: str) -> str | None:
    """Why ``resource``'s socket paths would not fit a unix socket address in the dir, or None."""
    path = f"{device_plugin_dir.rstrip('/')}/{base_name(resource)}"
    longest = len(path.encode()) + MAX_SUFFIX_LENGTH
    if longest <= MAX_SOCKET_PATH:
        return None
    return (
        f"socket paths {path}.<instance>.<n>{SUFFIX} are up to {longest} bytes; unix sockets allow "
        f"{MAX_SOCKET_PATH}: shorten the resource name or the device-plugin dir"
    )


def instances(device_plugin_dir: str, resource: str) -> list[SocketName]:
    """Every socket of ``resource`` in the dir (any instance, live or stale), oldest first."""
    base = base_name(resource)
    try:
        entries = os.listdir(device_plugin_dir)
    except OSError:
        return []
    found = [p for p in map(parse, entries) if p is not None and p.base == base]
    return sorted(found)


def listening(path: str) -> bool:
    """True when a process listens on the unix socket at ``path`` (a stale file refuses at once)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.setblocking(False)
        try:
            sock.connect(path)
        except BlockingIOError:  # listening, backlog full (a paused process): alive
            return True
        except OSError:
            return False
    return True
