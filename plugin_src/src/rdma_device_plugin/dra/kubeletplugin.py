"""The plumbing of a kubelet plugin instance that may overlap with another one (a rolling update
with ``maxSurge``, the mode-label switch from one DaemonSet to the other), as upstream's
k8s.io/dynamic-resource-allocation ``kubeletplugin`` does with its ``RollingUpdate`` option
(kubelet >= 1.33 keeps every registration of a driver and uses the newest one while it lives):

- per-instance sockets: ``<kubelet-dir>/plugins_registry/<driver>-<uid>-reg.sock`` and
  ``<kubelet-dir>/plugins/<driver>/dra-<uid>.sock``, the uid being the pod's (downward API,
  ``POD_UID``; a random one outside a pod). A container restarted in its pod takes over its own
  sockets; another instance's are never touched;
- each socket bound in a private directory (mode 0700, a name starting with ``.``, which the
  kubelet's plugin watcher ignores), given mode 0600 there and only then renamed into place: its
  mode never depends on the process umask and nobody connects to it before;
- one holder at a time across the instances of the node of ``serialize.lock`` (an ``flock`` in the
  plugin dir, as upstream's). Upstream's helper holds it for a whole prepare or unprepare by default
  (``Serialize(true)``); the claims hold it only where a call decides on files (the records, the
  conflict check, the writes: :mod:`.claims`), so one call's API reads never queue another's, as a
  driver that locks itself may (``Serialize(false)``). Both agree on the files in a rolling update;
- which instance publishes the node's ResourceSlices: the newest live one (the instance locks of
  :mod:`..sockets`, ordered by start on the node's monotonic clock), so an old and a new version do
  not rewrite each other's slices while they overlap.

The driver's decisions meet this plumbing in two types only: :class:`PreparedDevice` (what a prepare
answers) and :class:`PrepareError` (a claim refused), as upstream's helper hands its driver
``kubeletplugin.Device`` and a per-claim error.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import tempfile
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import grpc

from .. import sockets
from ..kubeletapi import MAX_SOCKET_PATH

SOCKET_MODE = 0o600
UID_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9-]{0,62}$")
SERIALIZE_LOCK = "serialize.lock"
MIN_UID_CHARS = 8
REGISTERED = ".registered"  # beside an instance's lock file while the kubelet has it registered


class PrepareError(Exception):
    """A claim the driver cannot prepare: the kubelet gets the message as that claim's error (the
    driver's decisions raise it; the plumbing only reports it)."""


@dataclass(frozen=True)
class PreparedDevice:
    """One prepared device as the kubelet is told of it (upstream's ``kubeletplugin.Device``)."""

    requests: list[str]
    pool: str
    device: str
    cdi_device_ids: list[str]
    share_id: str | None = None


def instance_uid(given: str) -> str:
    """The pod's UID (``--instance-uid``, env ``POD_UID``) or, when empty, a random one. It names files:
    anything but letters, digits and ``-`` is refused."""
    uid = given or str(uuid.uuid4())
    if not UID_PATTERN.match(uid):
        raise ValueError(
            f"--instance-uid {given!r}: use the pod's UID (letters, digits, '-'; the chart sets POD_UID from "
            "metadata.uid) or leave it empty for a random one"
        )
    return uid


@dataclass(frozen=True)
class Paths:
    """Where this instance's sockets live (the kubelet's layout, ``--kubelet-dir``)."""

    registration: str  # <kubelet-dir>/plugins_registry/<driver>-<uid>-reg.sock
    endpoint: str  # <kubelet-dir>/plugins/<driver>/dra-<uid>.sock
    plugin_dir: str  # <kubelet-dir>/plugins/<driver>: the lock, the instances

    @classmethod
    def of(cls, kubelet_dir: str, driver: str, uid: str) -> Paths:
        """The uid in full when the paths fit a unix socket address (107 bytes), else its first
        characters, at least 8 (k3s' kubelet dir is 35 bytes long): unique enough among the few
        instances of one node."""
        plugin_dir = os.path.join(kubelet_dir, "plugins", driver)
        for n in range(len(uid), min(len(uid), MIN_UID_CHARS) - 1, -1):
            paths = cls(
                os.path.join(kubelet_dir, "plugins_registry", f"{driver}-{uid[:n]}-reg.sock"),
                os.path.join(plugin_dir, f"dra-{uid[:n]}.sock"),
                plugin_dir,
            )
            if max(len(paths.registration.encode()), len(paths.endpoint.encode())) <= MAX_SOCKET_PATH:
                return paths
        raise ValueError(
            f"--kubelet-dir {kubelet_dir} and driver {driver}: the socket {paths.registration} is longer than a "
            f"unix socket address allows ({MAX_SOCKET_PATH} bytes); use a shorter dra.driverName"
        )

    @property
    def lock(self) -> str:
        return os.path.join(self.plugin_dir, SERIALIZE_LOCK)


FileId = tuple[int, int]


def serve_at(server: grpc.Server, path: str) -> FileId:
    """Bind ``server`` to the unix socket ``path`` (mode 0600) and start it; the socket's identity,
    for :func:`remove_own`."""
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    private = tempfile.mkdtemp(prefix=".rdma-", dir=parent)  # 0700
    try:
        bound = os.path.join(private, "s")
        server.add_insecure_port("unix://" + bound)
        server.start()
        os.chmod(bound, SOCKET_MODE)
        os.rename(bound, path)  # atomic; replaces only a socket of this same uid (a restarted container)
    finally:
        shutil.rmtree(private, ignore_errors=True)
    st = os.stat(path)
    return st.st_dev, st.st_ino


def remove_own(path: str, ident: FileId | None) -> None:
    """Unlink ``path`` if it is still the socket this instance made (never another instance's)."""
    if ident is None:
        return
    with contextlib.suppress(FileNotFoundError):
        st = os.stat(path)
        if (st.st_dev, st.st_ino) == ident:
            os.unlink(path)


class SerializeLock:
    """One holder at a time among the threads of this process and the instances of the node."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._thread = threading.Lock()
        self._fd: int | None = None

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        with self._thread:
            if self._fd is None:
                os.makedirs(os.path.dirname(self.path), exist_ok=True)
                self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, SOCKET_MODE)
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)

    def close(self) -> None:
        with self._thread:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


class Instances:
    """This instance among the node's instances of the driver (``<plugin dir>/rdma-device-plugin/instances``)."""

    def __init__(self, plugin_dir: str, instance: str = sockets.INSTANCE) -> None:
        self.plugin_dir = plugin_dir
        self.instance = instance
        self._lock = sockets.InstanceLock(plugin_dir, instance)

    def start(self) -> None:
        os.makedirs(self.plugin_dir, exist_ok=True)
        self._lock.acquire()

    def _marker(self, instance: str) -> str:
        return os.path.join(self._lock.dir, instance + REGISTERED)

    def registered(self) -> None:
        """The kubelet registered this instance (an older one waiting to hand over may go)."""
        with contextlib.suppress(OSError), open(self._marker(self.instance), "w", encoding="utf-8"):
            pass

    def _newer(self) -> list[str]:
        return [i for i in sockets.live_instances(self.plugin_dir, self.instance) if sockets.alive(self.plugin_dir, i)]

    def newest(self) -> bool:
        """No newer instance of the driver is alive on this node."""
        return not self._newer()

    def newer_registered(self) -> bool:
        """A newer instance is alive and registered with the kubelet."""
        return any(os.path.exists(self._marker(i)) for i in self._newer())

    def stop(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._marker(self.instance))
        self._lock.release()
