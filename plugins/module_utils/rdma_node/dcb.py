"""DCB (IEEE 802.1Qaz/Qbb) settings of a netdev through rtnetlink, standard library only.

One ``RTM_GETDCB`` request with ``DCB_CMD_IEEE_GET`` per netdev (what ``mlnx_qos`` and
``dcb(8)`` send), answered by ``dcbnl_ieee_fill()`` in ``net/dcb/dcbnl.c``. Layouts are
``include/uapi/linux/dcbnl.h``: the reply carries ``DCB_ATTR_IFNAME`` and a nested
``DCB_ATTR_IEEE`` holding ``DCB_ATTR_IEEE_PFC`` (``struct ieee_pfc``: ``pfc_cap``, ``pfc_en``
bitmap, ...) and ``DCB_ATTR_IEEE_APP_TABLE`` (``struct dcb_app`` entries: selector, priority,
protocol). A get needs no capability (``dcb_doit`` asks CAP_NET_ADMIN only of RTM_SETDCB). The
kernel resolves the name in the caller's network namespace and answers ``EOPNOTSUPP`` for a
netdev without DCB support (``dcbnl_ops``), ``ENODEV`` for an unknown one.

Trust: mlx5 (upstream and recent MLNX_OFED) is in DSCP trust exactly when its APP table holds
DSCP entries (selector 5), the rule ``mlnx_qos`` applies when ``qos/trust`` is absent.
"""

from __future__ import annotations

import errno
import os
import socket
import struct
from dataclasses import dataclass

NETLINK_ROUTE = 0
RTM_GETDCB = 78
NLMSG_ERROR = 2
NLMSG_DONE = 3
NLM_F_REQUEST = 0x01
DCB_CMD_IEEE_GET = 21
DCB_ATTR_IFNAME = 1
DCB_ATTR_IEEE = 13
DCB_ATTR_IEEE_PFC = 2
DCB_ATTR_IEEE_APP_TABLE = 3
DCB_ATTR_IEEE_APP = 1
DCB_ATTR_DCB_APP = 2
IEEE_8021QAZ_APP_SEL_DSCP = 5
NLA_TYPE_MASK = 0x3FFF  # drops NLA_F_NESTED / NLA_F_NET_BYTEORDER
_NLMSGHDR = struct.Struct("=IHHII")
_NLATTR = struct.Struct("=HH")
_DCBMSG = struct.Struct("=BBH")
_DCB_APP = struct.Struct("=BBH")


class DcbError(Exception):
    """The kernel refused the request (``errno`` set) or answered something unreadable."""

    def __init__(self, message: str, err: int = 0) -> None:
        super().__init__(message)
        self.errno = err


@dataclass(frozen=True)
class DcbIeee:
    """What DCB_CMD_IEEE_GET answered for one netdev."""

    pfc_cap: int | None  # None: the driver reports no PFC object
    pfc_enabled: tuple[int, ...]  # priorities with PFC on
    apps: tuple[tuple[int, int, int], ...]  # (selector, priority, protocol)

    @property
    def trust(self) -> str:
        """``dscp`` when DSCP APP entries exist, else ``pcp`` (mlx5's rule, see the module doc)."""
        return "dscp" if any(sel == IEEE_8021QAZ_APP_SEL_DSCP for sel, _, _ in self.apps) else "pcp"


def _align(n: int) -> int:
    return (n + 3) & ~3


def request(ifname: bytes, seq: int) -> bytes:
    """The RTM_GETDCB/DCB_CMD_IEEE_GET request for ``ifname`` (raw name bytes)."""
    name = ifname + b"\0"
    attr = _NLATTR.pack(_NLATTR.size + len(name), DCB_ATTR_IFNAME) + name
    attr += b"\0" * (_align(len(attr)) - len(attr))
    body = _DCBMSG.pack(socket.AF_UNSPEC, DCB_CMD_IEEE_GET, 0) + attr
    return _NLMSGHDR.pack(_NLMSGHDR.size + len(body), RTM_GETDCB, NLM_F_REQUEST, seq, 0) + body


def _attrs(data: bytes) -> list[tuple[int, bytes]]:
    out = []
    offset = 0
    while offset + _NLATTR.size <= len(data):
        length, kind = _NLATTR.unpack_from(data, offset)
        if length < _NLATTR.size or offset + length > len(data):
            raise DcbError(f"a netlink attribute of length {length} overruns the message")
        out.append((kind & NLA_TYPE_MASK, data[offset + _NLATTR.size : offset + length]))
        offset += _align(length)
    return out


def parse_reply(data: bytes, seq: int) -> DcbIeee | None:
    """The DCB_CMD_IEEE_GET answer in ``data`` (one or more netlink messages) for request ``seq``;
    None when ``data`` holds none (read on); raises :class:`DcbError` for a kernel error or bytes
    it cannot read."""
    try:
        return _parse_reply(data, seq)
    except struct.error as exc:
        raise DcbError(f"a truncated netlink message ({exc})") from None


def _parse_reply(data: bytes, seq: int) -> DcbIeee | None:
    offset = 0
    while offset + _NLMSGHDR.size <= len(data):
        length, kind, _flags, msg_seq, _pid = _NLMSGHDR.unpack_from(data, offset)
        if length < _NLMSGHDR.size or offset + length > len(data):
            raise DcbError(f"a netlink message of length {length} overruns the {len(data)} bytes read")
        payload = data[offset + _NLMSGHDR.size : offset + length]
        offset += _align(length)
        if msg_seq != seq:
            continue
        if kind == NLMSG_ERROR:
            (code,) = struct.unpack_from("=i", payload)
            if code == 0:  # an acknowledgement, not the answer
                continue
            raise DcbError(os.strerror(-code), -code)
        if kind == RTM_GETDCB:
            return _parse_ieee(payload[_DCBMSG.size :])
    return None


def _parse_ieee(payload: bytes) -> DcbIeee:
    ieee = next((value for kind, value in _attrs(payload) if kind == DCB_ATTR_IEEE), None)
    if ieee is None:
        raise DcbError("the DCB answer has no IEEE attribute")
    pfc_cap: int | None = None
    enabled: tuple[int, ...] = ()
    apps: list[tuple[int, int, int]] = []
    for kind, value in _attrs(ieee):
        if kind == DCB_ATTR_IEEE_PFC and len(value) >= 2:
            pfc_cap, bits = value[0], value[1]  # struct ieee_pfc: __u8 pfc_cap; __u8 pfc_en; ...
            enabled = tuple(p for p in range(8) if bits >> p & 1)
        elif kind == DCB_ATTR_IEEE_APP_TABLE:
            for app_kind, app in _attrs(value):
                if app_kind in (DCB_ATTR_IEEE_APP, DCB_ATTR_DCB_APP) and len(app) >= _DCB_APP.size:
                    apps.append(_DCB_APP.unpack_from(app))
    return DcbIeee(pfc_cap, enabled, tuple(apps))


class Client:
    """One rtnetlink socket for a node read; :meth:`ieee` per netdev."""

    def __init__(self, timeout: float = 1.0) -> None:
        self._sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC, NETLINK_ROUTE)
        self._sock.settimeout(timeout)
        self._sock.bind((0, 0))
        self._seq = 0

    def ieee(self, ifname: str) -> DcbIeee:
        """The DCB IEEE settings of ``ifname``; raises :class:`DcbError` (with errno) or OSError."""
        self._seq += 1
        self._sock.send(request(os.fsencode(ifname), self._seq))
        while True:  # bounded by the socket timeout
            found = parse_reply(self._sock.recv(65536), self._seq)
            if found is not None:
                return found

    def close(self) -> None:
        self._sock.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def explain(exc: BaseException) -> str:
    """Why DCB could not be read, for a "not checked" message."""
    err = getattr(exc, "errno", 0)
    if err == errno.EOPNOTSUPP:
        return "its driver has no DCB support (EOPNOTSUPP)"
    if err == errno.ENODEV:
        return "the kernel has no such netdev in this network namespace (ENODEV)"
    if isinstance(exc, TimeoutError):
        return "DCB netlink did not answer within the timeout"
    return f"DCB netlink failed ({exc})"
