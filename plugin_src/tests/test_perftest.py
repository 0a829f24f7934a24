"""node.perftest and the ``perftest`` health check: the report parser on ib_write_bw's own output,
and the runner against a stand-in for ib_write_bw (there is no RDMA device on CI machines).

The stand-in takes perftest's arguments, meets its other half over TCP on ``-p`` like the real
tool (the server listens and waits, a client that finds no server exits 1 with perftest's
message), and prints perftest's report with the bandwidth its environment gives for the device.
It does not move data; the figures are the test's."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from rdma_device_plugin.node import fixtures, healthchecks, perftest, sysfs

# ib_write_bw -D 5 --report_gbits on a ConnectX-7 RoCE port (duration mode: no peak figure)
REAL_OUTPUT = """---------------------------------------------------------------------------------------
                    RDMA_Write BW Test
 Dual-port       : OFF          Device         : mlx5_bond_0
 Number of qps   : 2            Transport type : IB
 Connection type : RC           Using SRQ      : OFF
 PCIe relax order: ON
 ibv_wr* API     : ON
 TX depth        : 128
 CQ Moderation   : 1
 Mtu             : 4096[B]
 Link type       : Ethernet
 GID index       : 3
 Max inline data : 0[B]
 rdma_cm QPs     : OFF
 Data ex. method : Ethernet
---------------------------------------------------------------------------------------
 local address: LID 0000 QPN 0x01ac PSN 0xc76db1 RKey 0x23beb2 VAddr 0x007f26a2c8b000
 GID: 00:00:00:00:00:00:00:00:00:00:255:255:10:00:00:11
---------------------------------------------------------------------------------------
 #bytes     #iterations    BW peak[Gb/sec]    BW average[Gb/sec]   MsgRate[Mpps]
 1048576    112046           0.00               187.93             0.022403
---------------------------------------------------------------------------------------
"""

STAND_IN = r"""#!@PYTHON@
import os, socket, sys, time
args = sys.argv[1:]
opts, host, i = {}, None, 0
while i < len(args):
    if args[i] in ("-d", "-i", "-x", "-D", "-s", "-q", "-p"):
        opts[args[i]] = args[i + 1]; i += 2
    elif args[i].startswith("-"):
        i += 1
    else:
        host = args[i]; i += 1
port, dev = int(opts["-p"]), opts["-d"]
mode = os.environ.get("FAKE_PERFTEST_MODE", "ok")
bw = float(os.environ.get("FAKE_BW_" + dev, "190"))
report = (" #bytes     #iterations    BW peak[Gb/sec]    BW average[Gb/sec]   MsgRate[Mpps]\n"
          f" {opts['-s']}    112046           0.00               {bw:.2f}             0.022403\n")
if host is None:
    srv = socket.socket(); srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("0.0.0.0", port)); srv.listen(1)
    print("* Waiting for client to connect... *", flush=True)
    conn, _ = srv.accept(); conn.sendall(conn.recv(64)); conn.close()
    print(report, flush=True)
    sys.exit(0)
if mode == "client-fails":
    print(" Failed to modify QP 0x1ac to RTR\n Unable to Connect the HCA's through the link", flush=True)
    sys.exit(1)
try:
    sock = socket.create_connection((host, port), timeout=2)
except OSError:
    print(f"Couldn't connect to {host}:{port}", flush=True); sys.exit(1)
sock.sendall(b"qp"); sock.recv(64)
if mode == "hang":
    time.sleep(30)
time.sleep(float(opts["-D"]) * 0.1)
print(report, flush=True)
"""


@pytest.fixture
def stand_in(tmp_path: Path) -> str:
    path = tmp_path / "ib_write_bw"
    path.write_text(STAND_IN.replace("@PYTHON@", sys.executable))
    path.chmod(0o755)
    return str(path)


def test_parse_the_real_report() -> None:
    assert perftest.parse_report(REAL_OUTPUT) == 187.93
    assert perftest.parse_report("Couldn't connect to 127.0.0.1:18515") is None


def test_loopback_through_the_stand_in(stand_in: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_BW_mlx5_0", "191.5")
    got = perftest.run_loopback(stand_in, "mlx5_0", 1, 3, seconds=1)
    assert (got.gbps, got.error) == (191.5, "")
    assert got.command[:3] == (stand_in, "-d", "mlx5_0") and got.command[-3:] == ("-x", "3", "127.0.0.1")
    assert "-F" in got.command and "--report_gbits" in got.command and got.command[got.command.index("-D") + 1] == "1"


def test_loopback_failures(stand_in: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_PERFTEST_MODE", "client-fails")
    failed = perftest.run_loopback(stand_in, "mlx5_0", 1, None, seconds=1)
    assert failed.gbps is None
    assert failed.error == f"{stand_in} exited 1: Unable to Connect the HCA's through the link"
    assert "-x" not in failed.command  # InfiniBand: no GID index
    monkeypatch.setenv("FAKE_PERFTEST_MODE", "hang")
    hung = perftest.run_loopback(stand_in, "mlx5_0", 1, 3, seconds=1, timeout=3)
    assert hung.gbps is None and hung.error == "no result within 3 s"
    missing = perftest.run_loopback("/nonexistent/ib_write_bw", "mlx5_0", 1, 3, seconds=1)
    assert missing.error.startswith("cannot start /nonexistent/ib_write_bw:")


def test_perftest_check_per_port(short_tmp: Path, stand_in: str, monkeypatch: pytest.MonkeyPatch) -> None:
    node = fixtures.write_node(str(short_tmp / "n"), fixtures.lingjun_node(nics=2))
    monkeypatch.setenv("FAKE_BW_mlx5_bond_0", "190")
    monkeypatch.setenv("FAKE_BW_mlx5_bond_1", "120")
    want = healthchecks.Expectations(perftest=True, perftest_command=stand_in, perftest_seconds=1, counter_interval=0)
    nics = sysfs.read_nics(node.sysfs, node.dev)
    # real_node: the roots are taken as this host's own (the stand-in plays the devices)
    read = healthchecks.read(nics, node.sysfs, node.procfs, node.root, want, real_node=True)
    perf = {c.nic: c for c in healthchecks.check(read, want) if c.name == "perftest"}
    assert perf["mlx5_bond_0"].passed
    assert perf["mlx5_bond_0"].message() == ("mlx5_bond_0: port 1 loopback 190 Gb/s of 200 Gb/s (95.0 %, need 92.5 %)")
    assert not perf["mlx5_bond_1"].passed
    assert (
        perf["mlx5_bond_1"]
        .message()
        .startswith("mlx5_bond_1: port 1 loopback 120 Gb/s of 200 Gb/s (60.0 %, need 92.5 %). Fix: check the PCIe link")
    )
    # the GID index NCCL would use is the one the test uses (AF_INET6 here: the NICs have IPv6 addresses only)
    assert read.nics[0].perftest[1].command[read.nics[0].perftest[1].command.index("-x") + 1] == "3"


def test_not_installed(short_tmp: Path) -> None:
    node = fixtures.write_node(str(short_tmp / "n"), fixtures.lingjun_node(nics=1))
    want = healthchecks.Expectations(perftest=True, perftest_command="rdp-no-such-ib_write_bw", counter_interval=0)
    read = healthchecks.read(sysfs.read_nics(node.sysfs, node.dev), node.sysfs, node.procfs, node.root, want, True)
    perf = [c for c in healthchecks.check(read, want) if c.name == "perftest"]
    assert len(perf) == 1 and perf[0].skipped
    assert perf[0].message() == (
        "mlx5_bond_0: not checked: rdp-no-such-ib_write_bw (perftest) is not installed (apt/dnf install perftest)"
    )
    assert os.environ.get("FAKE_PERFTEST_MODE") is None
