"""Kernel notifications that wake the supervisor loop instead of polling (issue 15).

- :class:`DirWatch`: inotify on the kubelet's device-plugin directory. The kubelet re-creates
  ``kubelet.sock`` when it restarts, after deleting every other non-directory entry but its
  checkpoint (1.32: manager.go ``CleanupPluginDirectory``, called by plugin/v1beta1/server.go
  ``Start`` before net.Listen; newer kubelets delete only sockets); NVIDIA's k8s-device-plugin
  watches the same directory with fsnotify for the same reason. It works on the hostPath mount
  with no privilege.
- :class:`LinkEvents`: rtnetlink link notifications (RTMGRP_LINK). A RoCE port's state follows
  its netdev (mlx5 ``mlx5_query_port_roce`` derives ACTIVE/DOWN from the netdev, the bond master in
  a LAG, at every query), so a link message for a selected NIC's netdev is the moment to re-read
  the port states. Only netdevs of the plugin's own network namespace are seen: the host's with
  ``hostNetwork``, none of the node's in a pod network. Unprivileged: NETLINK_ROUTE lets any
  process listen to its groups.

Both are hints: sysfs stays the truth, and the loop still polls (more slowly) in case a
notification is lost. The parsers are pure functions; the classes only own the descriptors.
"""

from __future__ import annotations

import ctypes
import errno
import os
import socket
import struct
from collections.abc import Callable, Container, Iterable
from dataclasses import dataclass

from rdma_node import sysfs, text

# <sys/inotify.h>
IN_MODIFY = 0x00000002
IN_ATTRIB = 0x00000004
IN_CLOSE_WRITE = 0x00000008
IN_MOVED_FROM = 0x00000040
IN_MOVED_TO = 0x00000080
IN_CREATE = 0x00000100
IN_DELETE = 0x00000200
IN_DELETE_SELF = 0x00000400
IN_MOVE_SELF = 0x00000800
IN_Q_OVERFLOW = 0x00004000
IN_IGNORED = 0x00008000
IN_ONLYDIR = 0x01000000
IN_NONBLOCK = os.O_NONBLOCK
IN_CLOEXEC = os.O_CLOEXEC
# Socket files appear (bind, rename into place), go (unlink) or are replaced; the directory itself
# can be deleted or moved away (then the watch ends with IN_IGNORED).
DIR_EVENTS = IN_CREATE | IN_DELETE | IN_MOVED_FROM | IN_MOVED_TO | IN_ATTRIB | IN_DELETE_SELF | IN_MOVE_SELF
# A file edited in place (the config outside Kubernetes); a ConfigMap volume swaps its ..data
# symlink with a rename, which DIR_EVENTS already sees.
FILE_EVENTS = DIR_EVENTS | IN_MODIFY | IN_CLOSE_WRITE
_INOTIFY_HEADER = struct.Struct("=iIII")  # wd, mask, cookie, len

# <linux/netlink.h>, <linux/rtnetlink.h>, <linux/if_link.h>
RTMGRP_LINK = 0x1
RTM_NEWLINK = 16
RTM_DELLINK = 17
IFLA_IFNAME = 3
_NLMSG_HEADER = struct.Struct("=IHHII")  # len, type, flags, seq, pid
_IFINFOMSG = struct.Struct("=BxHiII")  # family, pad, type, index, flags, change
_RTATTR = struct.Struct("=HH")  # len, type


def _align4(n: int) -> int:
    return (n + 3) & ~3


def parse_inotify(buf: bytes) -> list[tuple[int, int, str]]:
    """``inotify_event`` records -> (wd, mask, name); the name is "" for an event on the watched dir."""
    out = []
    offset = 0
    while offset + _INOTIFY_HEADER.size <= len(buf):
        wd, mask, _cookie, length = _INOTIFY_HEADER.unpack_from(buf, offset)
        offset += _INOTIFY_HEADER.size
        name = buf[offset : offset + length].split(b"\0", 1)[0]
        offset += length
        out.append((wd, mask, text.decode(name)))
    return out


def parse_link_messages(buf: bytes) -> list[tuple[int, int, str]]:
    """rtnetlink datagram -> (message type, ifindex, ifname) of every RTM_NEWLINK/RTM_DELLINK in it."""
    out = []
    offset = 0
    while offset + _NLMSG_HEADER.size <= len(buf):
        length, kind, _flags, _seq, _pid = _NLMSG_HEADER.unpack_from(buf, offset)
        if length < _NLMSG_HEADER.size or offset + length > len(buf):
            break  # truncated or malformed: what was parsed so far stands
        body = offset + _NLMSG_HEADER.size
        if kind in (RTM_NEWLINK, RTM_DELLINK) and length >= _NLMSG_HEADER.size + _IFINFOMSG.size:
            _family, _type, index, _iflags, _change = _IFINFOMSG.unpack_from(buf, body)
            name = ""
            attr = body + _IFINFOMSG.size
            end = offset + length
            while attr + _RTATTR.size <= end:
                alen, atype = _RTATTR.unpack_from(buf, attr)
                if alen < _RTATTR.size:
                    break
                if atype == IFLA_IFNAME:
                    name = text.decode(buf[attr + _RTATTR.size : attr + alen].split(b"\0", 1)[0])
                    break
                attr += _align4(alen)
            out.append((kind, index, name))
        offset += _align4(length)
    return out


class DirWatch:
    """inotify watch on one directory; :meth:`drain` says whether anything happened in it."""

    def __init__(
        self, path: str, mask: int = DIR_EVENTS, names: Iterable[str] | None = None, prefixes: Iterable[str] = ()
    ) -> None:
        # Only these entries matter (names, or names starting with a prefix; neither: all); other
        # files in the dir (a status file, a liveness file) must not wake the loop each time they
        # are written.
        self.names = frozenset(names) if names is not None else None
        self.prefixes = tuple(prefixes)
        libc = ctypes.CDLL(None, use_errno=True)
        fd: int = libc.inotify_init1(IN_NONBLOCK | IN_CLOEXEC)
        if fd < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"inotify_init1: {os.strerror(err)}")
        wd: int = libc.inotify_add_watch(fd, os.fsencode(path), mask | IN_ONLYDIR)
        if wd < 0:
            err = ctypes.get_errno()
            os.close(fd)
            hint = " (raise fs.inotify.max_user_watches)" if err == errno.ENOSPC else ""
            raise OSError(err, f"inotify_add_watch {path}: {os.strerror(err)}{hint}")
        self.fd = fd
        self._wd = wd
        self.alive = True  # False once the directory is gone: the caller opens a new watch

    def fileno(self) -> int:
        return self.fd

    def drain(self) -> bool:
        """Read every pending event; True when one concerns a watched name or the dir itself (an
        overflow counts: events were lost)."""
        seen = False
        while True:
            try:
                buf = os.read(self.fd, 64 * 1024)
            except BlockingIOError:
                return seen
            for wd, mask, name in parse_inotify(buf):
                if (mask & IN_IGNORED and wd == self._wd) or mask & (IN_DELETE_SELF | IN_MOVE_SELF):
                    self.alive = False
                if not name or self._matches(name) or mask & IN_Q_OVERFLOW:
                    seen = True

    def _matches(self, name: str) -> bool:
        if self.names is None and not self.prefixes:
            return True
        return (self.names is not None and name in self.names) or name.startswith(self.prefixes)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class LinkEvents:
    """rtnetlink link notifications of this network namespace, filtered by netdev name."""

    def __init__(self) -> None:
        sock = socket.socket(
            socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC, socket.NETLINK_ROUTE
        )
        try:
            sock.bind((0, RTMGRP_LINK))
        except OSError:
            sock.close()
            raise
        self._sock = sock

    def fileno(self) -> int:
        return self._sock.fileno()

    def drain(self, names: Container[str]) -> bool:
        """Read every pending message; True when one concerns a netdev in ``names`` or messages were
        lost (ENOBUFS: the kernel dropped some, so any netdev may have changed)."""
        hit = False
        while True:
            try:
                buf = self._sock.recv(64 * 1024)
            except BlockingIOError:
                return hit
            except OSError as exc:
                if exc.errno == errno.ENOBUFS:
                    hit = True
                    continue
                raise
            if not hit:
                hit = any(name in names for _kind, _index, name in parse_link_messages(buf))

    def close(self) -> None:
        self._sock.close()


def visible_ifindex(name: str) -> int | None:
    """The netdev's ifindex in this process's network namespace, or None when it is not here."""
    try:
        return socket.if_nametoindex(name)
    except OSError:
        return None


@dataclass(frozen=True)
class LinkCoverage:
    """Which netdevs' link messages matter, and whether they cover every selected port."""

    netdevs: frozenset[str]  # every netdev of the selected NICs (ports, bond masters and slaves)
    uncovered: tuple[str, ...]  # why some port's state has no link events ("" when all have)

    @property
    def complete(self) -> bool:
        return bool(self.netdevs) and not self.uncovered


def link_coverage(
    nics: Iterable[sysfs.Nic],
    sysfs_ifindex: Callable[[str], int | None],
    here: Callable[[str], int | None] = visible_ifindex,
) -> LinkCoverage:
    """A port is covered when it is RoCE (Ethernet link layer) and the netdev that carries it (the
    bond in a LAG) is in this network namespace: same ifindex in the sysfs tree and here."""
    netdevs: set[str] = set()
    uncovered: list[str] = []
    for nic in nics:
        netdevs.update(nic.netdevs)
        netdevs.update(nic.compute_netdevs)
        other = sorted({p.link_layer for p in nic.ports if p.link_layer != "Ethernet"})
        if other:
            uncovered.append(f"{nic.name} has {'/'.join(other)} ports (no netdev link events)")
            continue
        carrier = nic.compute_netdevs[0] if nic.compute_netdevs else ""
        if not carrier:
            uncovered.append(f"{nic.name} has no netdev")
            continue
        index = sysfs_ifindex(carrier)
        if index is None or index != here(carrier):
            uncovered.append(f"{nic.name}'s netdev {carrier} is not in this network namespace (hostNetwork off)")
    return LinkCoverage(frozenset(netdevs), tuple(uncovered))
