"""helm test: prove RDMA works in this pod, step by step, one verdict line per device in RDMA_DEVICES.

First prints the env the plugin gave the pod for NCCL and UCX (``env NAME=value``, docs/nccl.md) and
what pinning memory may use here (``info memlock: ...``). Then, per device, through libibverbs
(pyverbs, in the plugin image), each step on the previous one:

  open      open the device
  port      an ACTIVE port; for RoCE (Ethernet link layer) a routable RoCE v2 GID bound to a netdev,
            the one at NCCL_IB_GID_INDEX when the plugin set it: what NCCL/perftest need to connect
  register  pin and register RDMA_CHECK_MR_MIB MiB: far above the default 64 KiB memlock, so it
            proves the IPC_LOCK capability (or a memlock limit that large) every RDMA pod needs
  loopback  with RDMA_CHECK_LOOPBACK=1 (where the NIC loops back): two RC queue pairs on the port
            connected to each other, an RDMA write of 4 KiB from one half of the region to the
            other, its completion and the bytes compared

A FAIL line names the step and why. Exit 0 only when every device passes.
"""

import ipaddress
import os
import resource
import socket
import sys
import time
from types import SimpleNamespace

PORT_ACTIVE = (4, 5)  # IBV_PORT_ACTIVE, IBV_PORT_ACTIVE_DEFER
LINK_ETHERNET = 2  # IBV_LINK_LAYER_ETHERNET
GID_ROCE_V2 = 2  # IBV_GID_TYPE_ROCE_V2 (ibv_gid_entry.gid_type)
CAP_IPC_LOCK = 14  # linux/capability.h
LOOPBACK_BYTES = 4096
COMPLETION_SECONDS = 5.0

ENV_SHOWN = ("RDMA_DEVICES", "NCCL_IB_", "NCCL_SOCKET_FAMILY", "UCX_NET_DEVICES")


class Failed(Exception):
    """A step failed: ``step`` names it, the message says why and what to do."""

    def __init__(self, step, why):
        Exception.__init__(self, "%s: %s" % (step, why))
        self.step = step


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


def _usable(entry, port):
    return (int(entry.port_num) == port and int(entry.gid_type) == GID_ROCE_V2
            and int(entry.ndev_ifindex) > 0 and _routable(str(entry.gid_str())))


def memlock():
    """(RLIMIT_MEMLOCK soft limit in bytes or None for unlimited, IPC_LOCK in the effective set)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    caps = 0
    try:
        with open("/proc/self/status") as fh:
            caps = next((int(line.split()[1], 16) for line in fh if line.startswith("CapEff:")), 0)
    except OSError:
        pass
    return (None if soft == resource.RLIM_INFINITY else soft), bool(caps >> CAP_IPC_LOCK & 1)


def _size(n):
    return "unlimited" if n is None else ("%d MiB" % (n >> 20) if n >= 1 << 20 else "%d KiB" % (n >> 10))


def check_port(name, ctx, gid_index=None):
    """The ``port`` step: (port, port attributes, the RoCE GID entry or None, what was found)."""
    ports = range(1, int(ctx.query_device().phys_port_cnt) + 1)
    active = [(p, ctx.query_port(p)) for p in ports]
    active = [(p, attr) for p, attr in active if int(attr.state) in PORT_ACTIVE]
    if not active:
        raise Failed("port", "no ACTIVE port")
    port, attr = active[0]
    if int(attr.link_layer) != LINK_ETHERNET:
        return port, attr, None, "port %d ACTIVE, InfiniBand" % port
    table = ctx.query_gid_table(1024)
    if gid_index is not None:
        entry = next((e for e in table if int(e.port_num) == port and int(e.gid_index) == gid_index), None)
        if entry is None or not _usable(entry, port):
            shown = "empty" if entry is None else str(entry.gid_str())
            raise Failed("port", "port %d: NCCL_IB_GID_INDEX %d is not a routable RoCE v2 GID on a netdev (%s)" % (
                port, gid_index, shown))
        return port, attr, entry, "port %d ACTIVE, NCCL_IB_GID_INDEX %d = RoCE v2 GID %s on %s" % (
            port, gid_index, entry.gid_str(), _netdev(int(entry.ndev_ifindex)))
    for entry in table:
        if _usable(entry, port):
            return port, attr, entry, "port %d ACTIVE, RoCE v2 GID %s on %s" % (
                port, entry.gid_str(), _netdev(int(entry.ndev_ifindex)))
    raise Failed("port", "port %d ACTIVE but no routable RoCE v2 GID on a netdev (check the compute network's IP)" % port)


def register(v, pd, size):
    """The ``register`` step: a memory region of ``size`` bytes, pinned by the kernel."""
    e = v.enums
    try:
        return v.MR(pd, size, e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE)
    except Exception as exc:  # PyverbsRDMAError: ENOMEM/EPERM when pinning is not allowed
        limit, ipc_lock = memlock()
        hint = ""
        if not ipc_lock and (limit is not None and limit < size):
            hint = ("; this container has no IPC_LOCK and a memlock limit of %s: add IPC_LOCK to "
                    "securityContext.capabilities.add (as root: a non-root user loses it at exec)" % _size(limit))
        raise Failed("register", "%s of pinned memory: %s%s" % (_size(size), exc, hint))


def _qp(v, pd, cq):
    e = v.enums
    cap = v.QPCap(max_send_wr=1, max_recv_wr=1, max_send_sge=1, max_recv_sge=1)
    return v.QP(pd, v.QPInitAttr(qp_type=e.IBV_QPT_RC, scq=cq, rcq=cq, cap=cap))


def _connect(v, ctx, qp, peer, port, attr, entry):
    """INIT, RTR (to the peer queue pair on the same port), RTS."""
    e = v.enums
    qa = v.QPAttr()
    qa.port_num = port
    qa.qp_access_flags = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE
    qa.path_mtu = attr.active_mtu
    qa.dest_qp_num = peer.qp_num
    qa.rq_psn = qa.sq_psn = 0
    qa.max_dest_rd_atomic = qa.max_rd_atomic = 1
    qa.min_rnr_timer, qa.timeout, qa.retry_cnt, qa.rnr_retry = 12, 14, 7, 7
    if entry is not None:  # RoCE: a GRH to the port's own RoCE v2 GID
        route = v.GlobalRoute(dgid=ctx.query_gid(port, int(entry.gid_index)), sgid_index=int(entry.gid_index))
        qa.ah_attr = v.AHAttr(gr=route, is_global=1, port_num=port)
    else:  # InfiniBand: the port's own LID
        qa.ah_attr = v.AHAttr(dlid=attr.lid, port_num=port)
    qp.to_rts(qa)


def loopback(v, ctx, pd, mr, port, attr, entry):
    """The ``loopback`` step: an RDMA write between two queue pairs connected to each other."""
    e = v.enums
    stage = "create the completion and queue pairs"
    try:
        cq = v.CQ(ctx, 4, None, None, 0)
        a, b = _qp(v, pd, cq), _qp(v, pd, cq)
        stage = "connect them to each other (INIT, RTR, RTS)"
        _connect(v, ctx, a, b, port, attr, entry)
        _connect(v, ctx, b, a, port, attr, entry)
        stage = "post an RDMA write of %d bytes" % LOOPBACK_BYTES
        payload = os.urandom(LOOPBACK_BYTES)
        mr.write(payload, LOOPBACK_BYTES, 0)
        wr = v.SendWR(opcode=e.IBV_WR_RDMA_WRITE, num_sge=1, sg=[v.SGE(mr.buf, LOOPBACK_BYTES, mr.lkey)],
                      send_flags=e.IBV_SEND_SIGNALED)
        wr.set_wr_rdma(mr.rkey, mr.buf + mr.length // 2)
        a.post_send(wr)
        stage = "wait for its completion"
        deadline = time.monotonic() + COMPLETION_SECONDS
        polled, wcs = 0, []
        while not polled and time.monotonic() < deadline:
            polled, wcs = cq.poll(1)
    except Exception as exc:
        raise Failed("loopback", "%s: %s (where the NIC does not loop back, set test.loopback=false)" % (stage, exc))
    if not polled:
        raise Failed("loopback", "no completion of the RDMA write within %.0f s (where the NIC does not loop back, "
                                 "set test.loopback=false)" % COMPLETION_SECONDS)
    if int(wcs[0].status) != int(e.IBV_WC_SUCCESS):
        raise Failed("loopback", "the RDMA write completed with status %d (ibv_wc_status)" % int(wcs[0].status))
    if mr.read(LOOPBACK_BYTES, mr.length // 2) != payload:
        raise Failed("loopback", "the RDMA write completed but the bytes differ")
    return "RDMA write of %d bytes over a loopback queue pair" % LOOPBACK_BYTES


def prove(name, v, gid_index=None, mib=16, with_loopback=True):
    """(ok, "OK|FAIL <device>: ...") for one device, each step on the previous one."""
    done = []
    try:
        try:
            ctx = v.Context(name=name)
        except Exception as exc:  # pyverbs raises PyverbsRDMAError when the device cannot be opened
            raise Failed("open", "cannot open it through libibverbs (%s: %s)" % (type(exc).__name__, exc))
        port, attr, entry, found = check_port(name, ctx, gid_index)
        done.append(found)
        if mib > 0:
            pd = v.PD(ctx)
            mr = register(v, pd, mib << 20)
            done.append("registered %d MiB" % mib)
            try:
                if with_loopback:
                    done.append(loopback(v, ctx, pd, mr, port, attr, entry))
            finally:
                mr.close()  # one device's pinned memory at a time (the container's memory limit)
        return True, "OK %s: %s" % (name, "; ".join(done))
    except Failed as exc:
        so_far = " (passed: %s)" % "; ".join(done) if done else ""
        return False, "FAIL %s: step %s%s" % (name, exc, so_far)
    except Exception as exc:
        return False, "FAIL %s: %s: %s" % (name, type(exc).__name__, exc)


def load_pyverbs():
    """The pyverbs classes the steps use, in one namespace (tests pass their own)."""
    import pyverbs.enums as enums
    from pyverbs.addr import AHAttr, GlobalRoute
    from pyverbs.cq import CQ
    from pyverbs.device import Context
    from pyverbs.mr import MR
    from pyverbs.pd import PD
    from pyverbs.qp import QP, QPAttr, QPCap, QPInitAttr
    from pyverbs.wr import SGE, SendWR

    return SimpleNamespace(Context=Context, PD=PD, MR=MR, CQ=CQ, QP=QP, QPAttr=QPAttr, QPCap=QPCap,
                           QPInitAttr=QPInitAttr, AHAttr=AHAttr, GlobalRoute=GlobalRoute, SGE=SGE, SendWR=SendWR,
                           enums=enums)


def main():
    for key in sorted(k for k in os.environ if k.startswith(ENV_SHOWN)):
        print("env %s=%s" % (key, os.environ[key]))
    limit, ipc_lock = memlock()
    print("info memlock: limit %s, IPC_LOCK %s" % (_size(limit), "in effect" if ipc_lock else "missing"))
    devices = [d for d in os.environ.get("RDMA_DEVICES", "").split(",") if d]
    index = os.environ.get("NCCL_IB_GID_INDEX", "")
    gid_index = int(index) if index.lstrip("-").isdigit() and int(index) >= 0 else None
    mib = int(os.environ.get("RDMA_CHECK_MR_MIB", "16") or 0)
    with_loopback = os.environ.get("RDMA_CHECK_LOOPBACK", "1") not in ("0", "false", "")
    if not devices:
        print("FAIL: step allocate: RDMA_DEVICES is not set: the plugin did not allocate this pod a device")
        return 1
    try:
        v = load_pyverbs()
    except ImportError as exc:
        print("FAIL: step import: pyverbs does not import (%s)" % exc)
        return 1
    results = [prove(name, v, gid_index, mib, with_loopback) for name in devices]
    for _, line in results:
        print(line)
    return 0 if all(ok for ok, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main())
