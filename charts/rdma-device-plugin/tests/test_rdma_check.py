"""The helm test's check (files/rdma-check.py): with Debian's real pyverbs and no RDMA device it fails
at the open step per device; its steps (port, pinned memory, loopback queue pair) against
pyverbs-shaped stand-ins, since this machine has no RDMA NIC and its kernel no rxe to loop back on.

The stand-ins take pyverbs' names, arguments and enum values as rdma-core 44 has them (the Context,
PD, MR, CQ, QP, QPAttr, AHAttr/GlobalRoute, SGE/SendWR classes; IBV_PORT_ACTIVE 4,
IBV_LINK_LAYER_ETHERNET 2, IBV_GID_TYPE_ROCE_V2 2, IBV_WR_RDMA_WRITE 0, IBV_WC_SUCCESS 0) and
move the bytes of an RDMA write only between queue pairs connected to each other on one port with a
GRH from that port's RoCE v2 GID: what a NIC does in loopback."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from conftest import CHART_DIR

CHECK_SCRIPT = CHART_DIR / "files" / "rdma-check.py"
PYVERBS = Path("/usr/lib/python3/dist-packages/pyverbs")


def _run_check(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(CHECK_SCRIPT), *args], env=env, capture_output=True, text=True, timeout=120)


def _load_check() -> Any:
    spec = importlib.util.spec_from_file_location("rdma_check", CHECK_SCRIPT)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


CHECK = _load_check()


def test_check_script_fails_at_the_open_step_without_rdma() -> None:
    """With Debian's real pyverbs (rdma-core 44) and no RDMA hardware, every device gets its own FAIL
    line naming the step."""
    if not PYVERBS.is_dir():
        pytest.skip("python3-pyverbs is not installed (make system-deps)")
    env = {"PATH": "/usr/bin:/bin", "RDMA_DEVICES": "mlx5_bond_0,mlx5_bond_1", "PYTHONPATH": str(PYVERBS.parent)}
    result = _run_check(env)
    assert result.returncode == 1, result
    lines = [line for line in result.stdout.splitlines() if not line.startswith(("env ", "info "))]
    assert [line.split()[:4] for line in lines] == [
        ["FAIL", "mlx5_bond_0:", "step", "open:"],
        ["FAIL", "mlx5_bond_1:", "step", "open:"],
    ], result.stdout
    assert "info memlock: limit " in result.stdout
    result = _run_check({"PATH": "/usr/bin:/bin"})
    assert result.returncode == 1 and "step allocate: RDMA_DEVICES is not set" in result.stdout + result.stderr


def test_check_prints_the_env_the_plugin_gave_the_pod() -> None:
    env = {
        "PATH": "/usr/bin:/bin",
        "RDMA_DEVICES": "mlx5_bond_0",
        "NCCL_IB_HCA": "=mlx5_bond_0",
        "NCCL_IB_GID_INDEX": "3",
        "UCX_NET_DEVICES": "mlx5_bond_0:1",
        "OTHER": "x",
    }
    lines = _run_check(env).stdout.splitlines()
    assert lines[:4] == [
        "env NCCL_IB_GID_INDEX=3",
        "env NCCL_IB_HCA==mlx5_bond_0",
        "env RDMA_DEVICES=mlx5_bond_0",
        "env UCX_NET_DEVICES=mlx5_bond_0:1",
    ]
    assert not any("OTHER" in line for line in lines)


# ------------------------------------------------------------------ pyverbs-shaped stand-ins

ENUMS = SimpleNamespace(
    IBV_ACCESS_LOCAL_WRITE=1, IBV_ACCESS_REMOTE_WRITE=2, IBV_QPT_RC=2, IBV_WR_RDMA_WRITE=0, IBV_SEND_SIGNALED=2,
    IBV_WC_SUCCESS=0,
)
WC_RETRY_EXC_ERR = 12  # IBV_WC_RETRY_EXC_ERR: what a write to nobody ends in


class _Obj:
    def __init__(self, **kw: Any) -> None:
        self.__dict__.update(kw)


class Node:
    """One device's hardware: ports (state, link layer), GID table, and the memory and queue pairs."""

    def __init__(self, ports: list[tuple[int, int]], gids: list[tuple[int, int, str, int]], pin_limit: int | None = None,
                 loops_back: bool = True) -> None:
        self.ports, self.gids, self.pin_limit, self.loops_back = ports, gids, pin_limit, loops_back
        self.mrs: list[FakeMR] = []
        self.qps: dict[int, FakeQP] = {}


class FakeContext:
    def __init__(self, node: Node) -> None:
        self.node = node

    def query_device(self) -> Any:
        return _Obj(phys_port_cnt=len(self.node.ports))

    def query_port(self, port: int) -> Any:
        state, link = self.node.ports[port - 1]
        return _Obj(state=state, link_layer=link, active_mtu=5, lid=7 + port)

    def query_gid_table(self, max_entries: int) -> list[Any]:
        return [
            _Obj(port_num=p, gid_index=n, gid_type=t, gid_str=lambda g=g: g, ndev_ifindex=i)
            for n, (p, t, g, i) in enumerate(self.node.gids)
        ][:max_entries]

    def query_gid(self, port: int, index: int) -> str:
        return self.node.gids[index][2]


class FakeMR:
    def __init__(self, pd: Any, length: int, access: int) -> None:
        node = pd.ctx.node
        if node.pin_limit is not None and length > node.pin_limit:
            raise OSError(12, "Failed to register a MR. Errno: 12, Cannot allocate memory")
        self.length, self.access, self.data = length, access, bytearray(length)
        self.buf, self.lkey, self.rkey = 0x10000 * (len(node.mrs) + 1), 11, 22
        self.closed = False
        node.mrs.append(self)

    def write(self, data: bytes, length: int, offset: int = 0) -> None:
        self.data[offset : offset + length] = data[:length]

    def read(self, length: int, offset: int) -> bytes:
        return bytes(self.data[offset : offset + length])

    def close(self) -> None:
        self.closed = True


class FakeCQ:
    def __init__(self, ctx: FakeContext, cqe: int, cq_context: Any, channel: Any, comp_vector: int) -> None:
        self.done: list[Any] = []

    def poll(self, num_entries: int = 1) -> tuple[int, list[Any]]:
        got, self.done = self.done[:num_entries], self.done[num_entries:]
        return len(got), got


class FakeQP:
    def __init__(self, pd: Any, init: Any) -> None:
        self.node, self.cq, self.attr = pd.ctx.node, init.scq, None
        assert init.qp_type == ENUMS.IBV_QPT_RC
        self.qp_num = 0x100 + len(self.node.qps)
        self.node.qps[self.qp_num] = self

    def to_rts(self, attr: Any) -> None:
        self.attr = _Obj(**vars(attr))

    def post_send(self, wr: Any) -> None:
        a = self.attr
        peer = self.node.qps.get(a.dest_qp_num)
        connected = peer is not None and peer is not self and peer.attr is not None and peer.attr.dest_qp_num == self.qp_num
        ah = a.ah_attr
        gid_ok = ah.gr is None or self.node.gids[ah.gr.sgid_index][1] == 2 and ah.gr.dgid == self.node.gids[ah.gr.sgid_index][2]
        if not (connected and gid_ok and self.node.loops_back and a.port_num == ah.port_num):
            self.cq.done.append(_Obj(status=WC_RETRY_EXC_ERR))
            return
        (sge,) = wr.sg
        src = next(m for m in self.node.mrs if m.buf <= sge.addr < m.buf + m.length and m.lkey == sge.lkey)
        dst = next(m for m in self.node.mrs if m.buf <= wr.remote_addr < m.buf + m.length and m.rkey == wr.rkey)
        data = src.read(sge.length, sge.addr - src.buf)
        dst.write(data, sge.length, wr.remote_addr - dst.buf)
        self.cq.done.append(_Obj(status=ENUMS.IBV_WC_SUCCESS))


class FakeQPAttr:
    def __init__(self) -> None:
        self.ah_attr: Any = None


class FakeSendWR:
    def __init__(self, opcode: int, num_sge: int, sg: list[Any], send_flags: int) -> None:
        assert opcode == ENUMS.IBV_WR_RDMA_WRITE and num_sge == len(sg) == 1
        self.sg, self.remote_addr, self.rkey = sg, None, None

    def set_wr_rdma(self, rkey: int, addr: int) -> None:
        self.rkey, self.remote_addr = rkey, addr


def verbs(node: Node) -> Any:
    return SimpleNamespace(
        Context=lambda name: FakeContext(node),
        PD=lambda ctx: _Obj(ctx=ctx),
        MR=FakeMR,
        CQ=FakeCQ,
        QP=FakeQP,
        QPAttr=FakeQPAttr,
        QPCap=lambda **kw: _Obj(**kw),
        QPInitAttr=lambda **kw: _Obj(**kw),
        AHAttr=lambda gr=None, is_global=0, port_num=1, dlid=0: _Obj(gr=gr, is_global=is_global, port_num=port_num, dlid=dlid),
        GlobalRoute=lambda dgid, sgid_index: _Obj(dgid=dgid, sgid_index=sgid_index),
        SGE=lambda addr, length, lkey: _Obj(addr=addr, length=length, lkey=lkey),
        SendWR=FakeSendWR,
        enums=ENUMS,
    )


LINGJUN_GIDS = [(1, 1, "fe80::1", 7), (1, 2, "fe80::1", 7), (1, 1, "2408:4000::11", 7), (1, 2, "2408:4000::11", 7)]


@pytest.mark.parametrize(
    "node,ok,needle",
    [
        (Node([(4, 2)], [(1, 2, "2408:4000::11", 7)]), True, "RoCE v2 GID 2408:4000::11"),
        (Node([(4, 2)], [(1, 1, "fe80::1", 7)]), False, "step port: port 1 ACTIVE but no routable RoCE v2 GID"),
        (Node([(4, 2)], [(1, 2, "fe80::1", 7)]), False, "no routable RoCE v2 GID"),
        (Node([(4, 2)], [(1, 2, "2408:4000::11", 0)]), False, "no routable RoCE v2 GID"),
        (Node([(1, 2)], [(1, 2, "2408:4000::11", 7)]), False, "step port: no ACTIVE port"),
        (Node([(4, 1)], []), True, "InfiniBand"),
        (Node([(1, 1), (4, 1)], []), True, "port 2 ACTIVE"),
    ],
)
def test_port_step(node: Node, ok: bool, needle: str) -> None:
    good, line = CHECK.prove("mlx5_bond_0", verbs(node), mib=0)
    assert good is ok and line.startswith(("OK" if ok else "FAIL") + " mlx5_bond_0: ") and needle in line, line


@pytest.mark.parametrize(
    "index,ok,needle",
    [
        (3, True, "NCCL_IB_GID_INDEX 3 = RoCE v2 GID 2408:4000::11 on "),
        (2, False, "NCCL_IB_GID_INDEX 2 is not a routable RoCE v2 GID on a netdev (2408:4000::11)"),  # RoCE v1
        (1, False, "NCCL_IB_GID_INDEX 1 is not a routable RoCE v2 GID on a netdev (fe80::1)"),  # link-local
        (9, False, "NCCL_IB_GID_INDEX 9 is not a routable RoCE v2 GID on a netdev (empty)"),
    ],
)
def test_port_step_with_the_plugins_gid_index(index: int, ok: bool, needle: str) -> None:
    """issue 23: with NCCL_IB_GID_INDEX set, the GID at that index is the one that must work."""
    good, line = CHECK.prove("mlx5_bond_0", verbs(Node([(4, 2)], LINGJUN_GIDS)), index, mib=0)
    assert good is ok and needle in line, line


@pytest.mark.parametrize("ports,gids", [([(4, 2)], LINGJUN_GIDS), ([(4, 1)], [])], ids=["roce", "infiniband"])
def test_every_step_passes_and_bytes_move(ports: list[tuple[int, int]], gids: list[tuple[int, int, str, int]]) -> None:
    node = Node(ports, gids)
    good, line = CHECK.prove("mlx5_bond_0", verbs(node), gid_index=3 if gids else None, mib=16)
    assert good, line
    assert "registered 16 MiB" in line and "RDMA write of 4096 bytes over a loopback queue pair" in line
    (mr,) = node.mrs
    assert mr.length == 16 << 20 and mr.closed  # one device's pinned memory at a time
    assert mr.read(4096, 0) == mr.read(4096, mr.length // 2) != bytes(4096)  # the write landed
    a, b = node.qps.values()
    assert a.attr.dest_qp_num == b.qp_num and b.attr.dest_qp_num == a.qp_num
    if gids:
        assert a.attr.ah_attr.gr.sgid_index == 3 and a.attr.ah_attr.is_global == 1
    else:
        assert a.attr.ah_attr.dlid == 8 and a.attr.ah_attr.gr is None  # the port's own LID


def test_register_step_names_ipc_lock(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pinning 16 MiB without IPC_LOCK under the default 64 KiB memlock fails: the line says what to add."""
    monkeypatch.setattr(CHECK, "memlock", lambda: (64 << 10, False))
    good, line = CHECK.prove("mlx5_bond_0", verbs(Node([(4, 1)], [], pin_limit=64 << 10)), mib=16)
    assert not good
    assert line.startswith("FAIL mlx5_bond_0: step register: 16 MiB of pinned memory: ")
    assert "no IPC_LOCK and a memlock limit of 64 KiB: add IPC_LOCK to securityContext.capabilities.add" in line
    assert "(passed: port 1 ACTIVE, InfiniBand)" in line


def test_loopback_step_fails_naming_what_failed() -> None:
    good, line = CHECK.prove("mlx5_bond_0", verbs(Node([(4, 2)], LINGJUN_GIDS, loops_back=False)), mib=1)
    assert not good and "step loopback: the RDMA write completed with status 12" in line, line
    assert "registered 1 MiB" in line  # the steps before it passed

    class NoRTR(FakeQP):
        def to_rts(self, attr: Any) -> None:
            raise OSError(22, "Failed to modify QP state to RTR. Errno: 22, Invalid argument")

    v = verbs(Node([(4, 2)], LINGJUN_GIDS))
    v.QP = NoRTR
    good, line = CHECK.prove("mlx5_bond_0", v, mib=1)
    assert not good and "step loopback: connect them to each other (INIT, RTR, RTS): " in line and "RTR" in line
    assert "test.loopback=false" in line


def test_loopback_off_skips_it() -> None:
    node = Node([(4, 2)], LINGJUN_GIDS, loops_back=False)
    good, line = CHECK.prove("mlx5_bond_0", verbs(node), mib=1, with_loopback=False)
    assert good and "loopback" not in line and not node.qps, line
