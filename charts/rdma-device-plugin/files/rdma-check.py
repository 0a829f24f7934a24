"""helm test: prove RDMA works in this pod, one verdict line per device in RDMA_DEVICES.

Opens every device the plugin handed out through libibverbs (pyverbs, in the plugin image), needs a
port in ACTIVE state and, for RoCE (Ethernet link layer), a routable RoCE v2 GID bound to a netdev:
what NCCL/perftest need to connect. Exit 0 only when every device passes.
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


def verdict(name, open_context):
    """(ok, "OK|FAIL <device>: <why>") for one device; open_context(name) gives a pyverbs Context."""
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
        for entry in ctx.query_gid_table(1024):
            gid = str(entry.gid_str())
            if (int(entry.port_num) == port and int(entry.gid_type) == GID_ROCE_V2
                    and int(entry.ndev_ifindex) > 0 and _routable(gid)):
                return True, "OK %s: port %d ACTIVE, RoCE v2 GID %s on %s" % (
                    name, port, gid, _netdev(int(entry.ndev_ifindex)))
        return False, "FAIL %s: port %d ACTIVE but no routable RoCE v2 GID on a netdev (check the compute network's IP)" % (name, port)
    except Exception as exc:  # pyverbs raises PyverbsRDMAError when the device cannot be opened
        return False, "FAIL %s: cannot open it through libibverbs (%s: %s)" % (name, type(exc).__name__, exc)


def main():
    devices = [d for d in os.environ.get("RDMA_DEVICES", "").split(",") if d]
    if not devices:
        print("FAIL: RDMA_DEVICES is not set: the plugin did not allocate this pod a device")
        return 1
    try:
        from pyverbs.device import Context
    except ImportError as exc:
        print("FAIL: pyverbs does not import (%s)" % exc)
        return 1
    results = [verdict(name, lambda n: Context(name=n)) for name in devices]
    for _, line in results:
        print(line)
    return 0 if all(ok for ok, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main())
