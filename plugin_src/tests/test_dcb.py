"""node.dcb: the RTM_GETDCB/DCB_CMD_IEEE_GET request, the parser on replies laid out as
dcbnl_ieee_fill() writes them (include/uapi/linux/dcbnl.h), and this machine's kernel answering
for netdevs without DCB support (no root needed: a get asks no capability)."""

from __future__ import annotations

import errno
import socket
import struct

import pytest

from rdma_node import dcb

NLA_F_NESTED = 0x8000


def _attr(kind: int, payload: bytes) -> bytes:
    raw = struct.pack("=HH", 4 + len(payload), kind) + payload
    return raw + b"\0" * (-len(raw) % 4)


def _ieee_pfc(pfc_cap: int, pfc_en: int) -> bytes:
    # struct ieee_pfc { __u8 pfc_cap; __u8 pfc_en; __u8 mbc; __u16 delay; __u64 requests[8]; __u64 indications[8]; }
    return struct.pack("=BBBxH2x8Q8Q", pfc_cap, pfc_en, 0, 0, *([0] * 16))


def _message(seq: int, attrs: bytes) -> bytes:
    body = struct.pack("=BBH", socket.AF_UNSPEC, dcb.DCB_CMD_IEEE_GET, 0) + attrs
    return struct.pack("=IHHII", 16 + len(body), dcb.RTM_GETDCB, 0, seq, 1234) + body


def _reply(seq: int, ieee: bytes, ifname: bytes = b"eth0") -> bytes:
    attrs = _attr(dcb.DCB_ATTR_IFNAME, ifname + b"\0") + _attr(dcb.DCB_ATTR_IEEE | NLA_F_NESTED, ieee)
    return _message(seq, attrs + _attr(14, b"\x08"))  # DCB_ATTR_DCBX after the IEEE nest, as the kernel adds it


def _error(seq: int, code: int) -> bytes:
    request = dcb.request(b"eth0", seq)
    body = struct.pack("=i", -code) + request[:16]
    return struct.pack("=IHHII", 16 + len(body), dcb.NLMSG_ERROR, 0, seq, 1234) + body


def test_request_layout() -> None:
    raw = dcb.request(b"eth0", 7)
    length, kind, flags, seq, pid = struct.unpack_from("=IHHII", raw)
    assert (length, kind, flags, seq, pid) == (len(raw), 78, 1, 7, 0)
    assert raw[16:20] == bytes([socket.AF_UNSPEC, 21, 0, 0])  # struct dcbmsg: family, cmd IEEE_GET, pad
    assert raw[20:] == struct.pack("=HH", 9, 1) + b"eth0\0" + b"\0" * 3  # DCB_ATTR_IFNAME, NUL, aligned


def test_parse_pfc_and_app_table() -> None:
    apps = b"".join(
        _attr(dcb.DCB_ATTR_IEEE_APP, struct.pack("=BBH", sel, prio, proto))
        for sel, prio, proto in [(5, 3, 26), (5, 6, 48), (1, 3, 0x8915)]  # DSCP 26->3, DSCP 48->6, RoCE v1 ethertype
    )
    ets = _attr(1, bytes(59))  # DCB_ATTR_IEEE_ETS first: struct ieee_ets, 3 + 7 * 8 bytes
    ieee = ets + _attr(dcb.DCB_ATTR_IEEE_PFC, _ieee_pfc(8, 0b00001000)) + _attr(3 | NLA_F_NESTED, apps)
    got = dcb.parse_reply(_reply(9, ieee), 9)
    assert got is not None
    assert got.pfc_cap == 8 and got.pfc_enabled == (3,)
    assert got.apps == ((5, 3, 26), (5, 6, 48), (1, 3, 0x8915)) and got.trust == "dscp"


def test_pcp_trust_and_no_pfc_object() -> None:
    got = dcb.parse_reply(_reply(3, _attr(3 | NLA_F_NESTED, b"")), 3)
    assert got is not None and got.trust == "pcp" and got.pfc_cap is None and got.pfc_enabled == ()


def test_errors_and_other_messages() -> None:
    with pytest.raises(dcb.DcbError) as caught:
        dcb.parse_reply(_error(4, errno.EOPNOTSUPP), 4)
    assert caught.value.errno == errno.EOPNOTSUPP
    assert dcb.explain(caught.value) == "its driver has no DCB support (EOPNOTSUPP)"
    assert dcb.parse_reply(_error(4, 0), 4) is None  # an acknowledgement is not the answer
    assert dcb.parse_reply(_reply(5, b""), 6) is None  # another request's answer
    with pytest.raises(dcb.DcbError, match="no IEEE attribute"):
        dcb.parse_reply(_message(5, _attr(dcb.DCB_ATTR_IFNAME, b"eth0\0")), 5)
    with pytest.raises(dcb.DcbError, match="truncated"):
        dcb.parse_reply(struct.pack("=IHHII", 18, dcb.NLMSG_ERROR, 0, 4, 0) + b"\0\0", 4)  # 2 bytes of a 4-byte code
    with pytest.raises(dcb.DcbError, match="overruns"):
        dcb.parse_reply(_reply(5, _attr(2, _ieee_pfc(8, 8)))[:60], 5)


def test_this_kernel_answers_for_netdevs_without_dcb() -> None:
    with dcb.Client() as client:
        with pytest.raises(dcb.DcbError) as no_dcb:
            client.ieee("lo")
        assert no_dcb.value.errno == errno.EOPNOTSUPP
        with pytest.raises(dcb.DcbError) as missing:
            client.ieee("rdp-no-such0")
        assert missing.value.errno == errno.ENODEV
        assert dcb.explain(missing.value) == "the kernel has no such netdev in this network namespace (ENODEV)"
