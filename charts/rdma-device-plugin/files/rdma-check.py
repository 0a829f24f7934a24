"""helm test: prove RDMA works in this pod, one verdict line per device in RDMA_DEVICES.

First prints the env the plugin gave the pod for NCCL and UCX (``env NAME=value``, docs/nccl.md).
Then opens every device the plugin handed out through libibverbs (pyverbs, in the plugin image),
needs a port in ACTIVE state and, for RoCE (Ethernet link layer), a routable RoCE v2 GID bound to a
netdev: what NCCL/perftest need to connect; with NCCL_IB_GID_INDEX set, the GID at that index must be
that GID. Exit 0 only when every device passes.
"""

import ipaddress
import os
import socket
import sys

PORT_ACTIVE = (4, 5)  # IBV_PORT_ACTIVE, IBV_PORT_ACTIVE_DEFER
LINK_ETHERNET = 2  # IBV_LINK_LAYER_ETHERNET
GID_ROCE_V2 = 2  # IBV_GID_TYPE_ROCE_V2 (ibv_gid_entry.gid_type)


def _routable(gid):
    """A GID other than the link-local fe80::/10 one every port has (IPv4-mapped ones count)."""
    try:
        return not ipaddress.IPv6Address(gid).is_link_local
    except ValueError:
        return False


def _netdev(ifindex):
    try:
        return socket.if_indextoname(ifindex)
    except OSError:
        return "ifindex %d" % ifindex


ENV_SHOWN = ("RDMA_DEVICES", "NCCL_IB_", "NCCL_SOCKET_FAMILY", "UCX_NET_DEVICES")


def _usable(entry, port):
    return (int(entry.port_num) == port and int(entry.gid_type) == GID_ROCE_V2
            and int(entry.ndev_ifindex) > 0 and _routable(str(entry.gid_str())))


def verdict(name, open_context, gid_index=None):
    """(ok, "OK|FAIL <device>: <why>") for one device; open_context(name) gives a pyverbs Context;
    gid_index: NCCL_IB_GID_INDEX, the GID NCCL will use on a RoCE port."""
    try:
        ctx = open_context(name)
        ports = range(1, int(ctx.query_device().phys_port_cnt) + 1)
        active = [(p, ctx.query_port(p)) for p in ports]
        active = [(p, attr) for p, attr in active if int(attr.state) in PORT_ACTIVE]
        if not active:
            return False, "FAIL %s: no ACTIVE port" % name
        port, attr = active[0]
        if int(attr.link_layer) != LINK_ETHERNET:
            return True, "OK %s: port %d ACTIVE, InfiniBand" % (name, port)
        table = ctx.query_gid_table(1024)
        if gid_index is not None:
            entry = next((e for e in table if int(e.port_num) == port and int(e.gid_index) == gid_index), None)
            if entry is None or not _usable(entry, port):
                shown = "empty" if entry is None else str(entry.gid_str())
                return False, "FAIL %s: port %d: NCCL_IB_GID_INDEX %d is not a routable RoCE v2 GID on a netdev (%s)" % (
                    name, port, gid_index, shown)
            return True, "OK %s: port %d ACTIVE, NCCL_IB_GID_INDEX %d = RoCE v2 GID %s on %s" % (
                name, port, gid_index, entry.gid_str(), _netdev(int(entry.ndev_ifindex)))
        for entry in table:
            if _usable(entry, port):
                return True, "OK %s: port %d ACTIVE, RoCE v2 GID %s on %s" % (
                    name, port, entry.gid_str(), _netdev(int(entry.ndev_ifindex)))
        return False, "FAIL %s: port %d ACTIVE but no routable RoCE v2 GID on a netdev (check the compute network's IP)" % (name, port)
    except Exception as exc:  # pyverbs raises PyverbsRDMAError when the device cannot be opened
        return False, "FAIL %s: cannot open it through libibverbs (%s: %s)" % (name, type(exc).__name__, exc)


def main():
    for key in sorted(k for k in os.environ if k.startswith(ENV_SHOWN)):
        print("env %s=%s" % (key, os.environ[key]))
    devices = [d for d in os.environ.get("RDMA_DEVICES", "").split(",") if d]
    index = os.environ.get("NCCL_IB_GID_INDEX", "")
    gid_index = int(index) if index.lstrip("-").isdigit() and int(index) >= 0 else None
    if not devices:
        print("FAIL: RDMA_DEVICES is not set: the plugin did not allocate this pod a device")
        return 1
    try:
        from pyverbs.device import Context
    except ImportError as exc:
        print("FAIL: pyverbs does not import (%s)" % exc)
        return 1
    results = [verdict(name, lambda n: Context(name=n), gid_index) for name in devices]
    for _, line in results:
        print(line)
    return 0 if all(ok for ok, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main())
