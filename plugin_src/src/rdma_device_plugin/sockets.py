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
stream ends. A name is used once, so grpc's unlink of its bound path never touches another file;
and every registration is of a name never registered before (:mod:`.registration`).

A newer instance that took over renames an older one's socket to ``<name>.retiring``: the older
instance (the listening socket stays bound to the file) sees its name gone, stops serving and
removes the ``.retiring`` file, which tells the newer one that the older one's streams are over.

Each instance also holds an exclusive ``flock`` on ``<dir>/rdma-device-plugin/instances/<instance>``
for its whole life (:class:`InstanceLock`): whether an instance is alive, whatever the kubelet did
to its sockets (a kubelet restart deletes them all for a moment; it keeps subdirectories), and
whether it died (the kernel releases the lock of a killed process).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import socket
import threading
import time
from dataclasses import dataclass

from .kubeletapi import MAX_SOCKET_PATH

# The mode of every socket the plugin serves, set right after the bind rather than left to the process
# umask (a container's is often 0022 or 0000): only root, i.e. the kubelet, may connect. The directory
# (the kubelet's device-plugins, 0750 root) already keeps others out during the bind.
SOCKET_MODE = 0o600

PREFIX = "rdma-dp-"
SUFFIX = ".sock"
RETIRING = ".retiring"  # appended by the newer instance that took over (see above)
INSTANCES_DIR = os.path.join("rdma-device-plugin", "instances")  # in the device-plugin dir
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
    retiring: bool = False  # renamed by a newer instance that took over

    @property
    def served_name(self) -> str:
        """The name the instance served it under."""
        return self.name[: -len(RETIRING)] if self.retiring else self.name


def parse(name: str) -> SocketName | None:
    """The parts of one of our socket names (served or retiring), or None for any other file."""
    retiring = name.endswith(SUFFIX + RETIRING)
    stem = name[: -len(RETIRING)] if retiring else name
    if not stem.startswith(PREFIX) or not stem.endswith(SUFFIX):
        return None
    parts = stem[: -len(SUFFIX)].split(".")
    if len(parts) != 3 or len(parts[1]) != _INSTANCE_DIGITS or not parts[2].isdigit():
        return None
    try:
        int(parts[1], 16)
    except ValueError:
        return None
    return SocketName(parts[1], int(parts[2]), parts[0], name, retiring)


def path_problem(device_plugin_dir: str, resource: str) -> str | None:
    """Why ``resource``'s socket paths would not fit a unix socket address in the dir, or None."""
    path = f"{device_plugin_dir.rstrip('/')}/{base_name(resource)}"
    longest = len(path.encode()) + MAX_SUFFIX_LENGTH  # a retiring name is renamed, never bound
    if longest <= MAX_SOCKET_PATH:
        return None
    return (
        f"socket paths {path}.<instance>.<n>{SUFFIX} are up to {longest} bytes; unix sockets allow "
        f"{MAX_SOCKET_PATH}: shorten the resource name or the device-plugin dir"
    )


def instances(device_plugin_dir: str, resource: str) -> list[SocketName]:
    """Every socket of ``resource`` in the dir (any instance, live, stale or retiring), oldest first."""
    base = base_name(resource)
    try:
        entries = os.listdir(device_plugin_dir)
    except OSError:
        return []
    found = [p for p in map(parse, entries) if p is not None and p.base == base]
    return sorted(found)


def file_id(path: str) -> tuple[int, int] | None:
    """(inode, ctime) of a file: one kubelet start, for kubelet.sock; None when it is missing."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_ino, st.st_ctime_ns)


class SocketPin:
    """A unix socket file opened ``O_PATH``: a connect through ``/proc/self/fd/<fd>`` (:meth:`take`)
    reaches the listener of that very inode, never one bound later at the same path (it is refused
    once that listener is gone). So a Register reaches the kubelet start we looked at: its dial
    happens later on the gRPC loop, and a kubelet starting meanwhile first deletes the plugin
    sockets (CleanupPluginDirectory), then binds a new kubelet.sock.

    The fd is closed once: by the call that took the target, when it is done, or by :meth:`abandon`
    when no call took it (cancelled before it started)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd: int | None = os.open(path, os.O_PATH | os.O_CLOEXEC)  # FileNotFoundError: none there
        self._via = f"/proc/self/fd/{self._fd}"
        st = os.fstat(self._fd)
        self.id = (st.st_ino, st.st_ctime_ns)  # as file_id(path) said of this inode
        self._taken = False
        self._lock = threading.Lock()  # take() runs on the gRPC loop, abandon() where a future ends

    def take(self) -> str | None:
        """The gRPC target to dial (the caller then calls :meth:`close`); None once abandoned."""
        with self._lock:
            if self._fd is None or self._taken:
                return None
            self._taken = True
            return f"unix://{self._via}"

    def named(self, text: str) -> str:
        """``text`` (an error of the call) with the socket's own path where it says /proc/self/fd/N."""
        return text.replace(self._via, self.path)

    def close(self) -> None:
        with self._lock:
            fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    def abandon(self) -> None:
        """Close unless a call took the target (it closes when done: its connect may be under way)."""
        with self._lock:
            if self._taken:
                return
            fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)


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


class InstanceLock:
    """This instance's lock file, held (``flock`` exclusive) from start to exit."""

    def __init__(self, device_plugin_dir: str, instance: str = INSTANCE) -> None:
        self.device_plugin_dir = device_plugin_dir
        self.dir = os.path.join(device_plugin_dir, INSTANCES_DIR)
        self.path = os.path.join(self.dir, instance)
        self._fd: int | None = None

    def acquire(self) -> None:
        """Raises OSError when the file cannot be made (the caller falls back to sockets alone)."""
        if self._fd is not None:
            os.close(self._fd)  # a lock file that lost its name: this one replaces it
            self._fd = None
        if not os.path.isdir(self.device_plugin_dir):  # the kubelet's to create, not ours
            raise FileNotFoundError(errno.ENOENT, "the device-plugin dir does not exist", self.device_plugin_dir)
        os.makedirs(self.dir, exist_ok=True)
        # Locked before it gets its name: a file of that name is never seen unlocked while we live.
        tmp = f"{self.path}.{os.getpid()}.tmp"
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.rename(tmp, self.path)
        except OSError:
            os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        self._fd = fd

    @property
    def held(self) -> bool:
        """Held, and still under its name (a device-plugin dir removed and re-created loses it)."""
        if self._fd is None:
            return False
        try:
            return os.stat(self.path).st_ino == os.fstat(self._fd).st_ino
        except OSError:
            return False

    def release(self) -> None:
        """At exit, first of all: another instance then sees this one as ending (:func:`alive`) by its
        sockets alone, and the lock goes with the process anyway."""
        fd, self._fd = self._fd, None
        if fd is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
            os.close(fd)
            for empty in (self.dir, os.path.dirname(self.dir)):  # the last instance leaves no trace
                with contextlib.suppress(OSError):
                    os.rmdir(empty)


def live_instances(device_plugin_dir: str, after: str) -> list[str]:
    """The instances newer than ``after`` that have a lock file (alive or not: ask :func:`alive`)."""
    try:
        names = os.listdir(os.path.join(device_plugin_dir, INSTANCES_DIR))
    except OSError:
        return []
    return [n for n in names if len(n) == _INSTANCE_DIGITS and n > after]


def alive(device_plugin_dir: str, instance: str) -> bool | None:
    """True while ``instance`` holds its lock, False once it died or exited (its stale lock file is
    removed), None when it has no lock file (an instance of a version without them, or one ending:
    the caller asks its sockets)."""
    path = os.path.join(device_plugin_dir, INSTANCES_DIR, instance)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return True
        return None
    finally:
        os.close(fd)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)  # the lock was free: its holder is gone
    return False
