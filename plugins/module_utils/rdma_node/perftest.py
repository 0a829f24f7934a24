"""A bounded loopback bandwidth test of one RDMA port with perftest's ``ib_write_bw`` (standard library only).

The way Azure's node health checks run it (azurehpc-health-checks ``azure_ib_write_bw_*.nhc``): a
server and a client on the same host and device, ``-F --report_gbits -s 1048576 -q 2`` for a fixed
duration (``-D``), the result the ``BW average[Gb/sec]`` column (4th) of the report line. The
client meets the server over TCP on a port the kernel hands out; it starts once the server listens
(``/proc/net/tcp``/``tcp6`` show the port in LISTEN). Both processes are killed at the deadline.
Active: it loads the link for the duration, so it runs only when asked.
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
from dataclasses import dataclass

MESSAGE_SIZE = 1048576
TCP_LISTEN = "0A"


@dataclass(frozen=True)
class Result:
    gbps: float | None  # BW average, None when the test did not report one
    error: str  # "" when it ran; else what went wrong (with the tool's last words)
    command: tuple[str, ...]


def parse_report(output: str) -> float | None:
    """``BW average[Gb/sec]`` of perftest's report: the 4th column of the first line after the header."""
    lines = output.splitlines()
    for i, line in enumerate(lines):
        if "BW average" not in line:
            continue
        for row in lines[i + 1 :]:
            cols = row.split()
            if len(cols) >= 4 and cols[0].isdigit():
                try:
                    return float(cols[3])
                except ValueError:
                    return None
    return None


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def listening(port: int, procfs_root: str = "/proc") -> bool:
    """Does anything LISTEN on TCP ``port`` (IPv4 or IPv6), per ``/proc/net/tcp*``."""
    for table in ("tcp", "tcp6"):
        try:
            with open(os.path.join(procfs_root, "net", table), encoding="ascii") as fh:
                rows = fh.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if len(cols) > 3 and cols[3] == TCP_LISTEN and int(cols[1].rsplit(":", 1)[1], 16) == port:
                return True
    return False


def _last_words(output: str) -> str:
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    return lines[-1] if lines else "no output"


def run_loopback(
    command: str, nic: str, port: int, gid_index: int | None, seconds: int, timeout: float | None = None
) -> Result:
    """Run ``command`` (ib_write_bw) as server and client on ``nic`` port ``port``; ``gid_index``
    for RoCE (None for InfiniBand, which uses LIDs)."""
    tcp_port = free_port()
    args = [command, "-d", nic, "-i", str(port), "-F", "--report_gbits", "-D", str(seconds)]
    args += ["-s", str(MESSAGE_SIZE), "-q", "2", "-p", str(tcp_port)]
    if gid_index is not None:
        args += ["-x", str(gid_index)]
    client_args = [*args, "127.0.0.1"]
    deadline = time.monotonic() + (timeout if timeout is not None else seconds + 20)
    env = dict(os.environ, LC_ALL="C")
    try:
        server = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    except OSError as exc:
        return Result(None, f"cannot start {command}: {exc}", tuple(client_args))
    client: subprocess.Popen[str] | None = None
    try:
        while not listening(tcp_port):
            if server.poll() is not None:
                out = server.stdout.read() if server.stdout else ""
                return Result(None, f"the server exited ({server.returncode}): {_last_words(out)}", tuple(client_args))
            if time.monotonic() > deadline:
                return Result(None, "the server did not listen before the deadline", tuple(client_args))
            time.sleep(0.05)
        client = subprocess.Popen(client_args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        try:
            out, _ = client.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            return Result(
                None, f"no result within {int(timeout if timeout is not None else seconds + 20)} s", tuple(client_args)
            )
        if client.returncode != 0:
            return Result(None, f"{command} exited {client.returncode}: {_last_words(out)}", tuple(client_args))
        gbps = parse_report(out)
        if gbps is None:
            return Result(None, f"no BW average in the report: {_last_words(out)}", tuple(client_args))
        return Result(gbps, "", tuple(client_args))
    finally:
        for proc in (client, server):
            if proc is not None and proc.poll() is None:
                proc.kill()
            if proc is not None:
                proc.wait()
                if proc.stdout:
                    proc.stdout.close()
