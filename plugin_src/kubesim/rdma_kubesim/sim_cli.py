"""The kubelet simulator as a long-running process (the local deploy target runs it in the background).

``run`` (the default) starts :class:`KubeletSimulator` on ``--dir``, writes the node status the
simulated kubelet would report (capacity and allocatable per resource) as JSON to
``--status-file`` whenever it changes, answers requests on a control socket, and exits on
SIGTERM/SIGINT (removing the status file). One simulator per directory, as one kubelet per
node: ``run`` holds a lock on ``<dir>.kubelet-sim.lock``, beside the dir (the kubelet empties the
dir at start), which names its pid, and exits with code 2, naming the running one, when another
simulator holds it. ``allocate`` and ``status`` are clients of the control socket: ``allocate``
admits one container asking for ``--count`` devices, the way the
kubelet's device manager does, and prints what the container receives.

    python -m rdma_kubesim.sim_cli --dir DIR --status-file FILE
    python -m rdma_kubesim.sim_cli allocate --control-socket DIR/kubelet-sim.ctl --resource rdma/hca
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import signal
import socket
import socketserver
import sys
import threading
from collections.abc import Sequence
from typing import Any

from .kubelet import AllocationFailed, KubeletSimulator

CONTROL_SOCKET = "kubelet-sim.ctl"
LOCK_SUFFIX = ".kubelet-sim.lock"  # beside the dir: the kubelet's start-up cleanup empties the dir itself


class AlreadyRunning(RuntimeError):
    """Another simulator serves the device-plugin dir."""


def hold_dir(device_plugin_dir: str) -> int:
    """Take the directory's lock (released when the process ends) and write this pid into it."""
    os.makedirs(device_plugin_dir, exist_ok=True)
    path = device_plugin_dir.rstrip("/") + LOCK_SUFFIX
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise AlreadyRunning(
            f"another kubelet simulator (pid {holder}) serves {device_plugin_dir}; stop it first (make stop)"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def default_control_socket(device_plugin_dir: str) -> str:
    return os.path.join(device_plugin_dir, CONTROL_SOCKET)


def status_document(sim: KubeletSimulator) -> dict[str, Any]:
    """What ``kubectl get node -o yaml`` shows of the device-plugin resources, plus the registrations.

    ``registered``: resources whose ListAndWatch stream is open; ``registrations``: how many times each
    resource registered (a restarted plugin registers again).
    """
    status = sim.node_status()
    with sim._cond:
        registered = sorted(r for r, ep in sim.endpoints.items() if ep.stream_open)
        registrations: dict[str, int] = {}
        for _, resource in sim.registrations:
            registrations[resource] = registrations.get(resource, 0) + 1
    return {"node": sim.node_name, "registered": registered, "registrations": registrations, **status}


def write_atomic(path: str, data: dict[str, Any]) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(data, fh, indent=2, sort_keys=True)
        fh.write("\n")
    os.replace(tmp, path)


def handle_request(sim: KubeletSimulator, request: dict[str, Any]) -> dict[str, Any]:
    """One control request: ``{"op": "status"}`` or ``{"op": "allocate", "resource": ..., ...}``."""
    op = request.get("op")
    if op == "status":
        return {"ok": True, "status": status_document(sim)}
    if op == "allocate":
        resource = str(request.get("resource", ""))
        pod = str(request.get("pod", "pod"))
        container = str(request.get("container", "main"))
        try:
            alloc = sim.allocate(resource, int(request.get("count", 1)), pod=pod, container=container)
        except AllocationFailed as exc:
            return {"ok": False, "error": str(exc)}
        result = {
            "ok": True,
            "pod": pod,
            "container": container,
            "resource": resource,
            "deviceIDs": alloc.ids,
            "devices": [
                {"containerPath": d.container_path, "hostPath": d.host_path, "permissions": d.permissions}
                for d in alloc.response.devices
            ],
            "mounts": [
                {"containerPath": m.container_path, "hostPath": m.host_path, "readOnly": m.read_only}
                for m in alloc.response.mounts
            ],
            "env": alloc.envs,
            "annotations": dict(alloc.response.annotations),
            "cdiDevices": [d.name for d in alloc.response.cdi_devices],
        }
        if request.get("release", True):
            sim.release(pod)
        return result
    return {"ok": False, "error": f"unknown op {op!r}"}


class _ControlServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True
    sim: KubeletSimulator


class _ControlHandler(socketserver.StreamRequestHandler):
    server: _ControlServer

    def handle(self) -> None:
        line = self.rfile.readline()
        try:
            request = json.loads(line or b"{}")
            reply = handle_request(self.server.sim, request if isinstance(request, dict) else {})
        except (ValueError, TypeError) as exc:
            reply = {"ok": False, "error": f"bad request: {exc}"}
        self.wfile.write(json.dumps(reply).encode() + b"\n")


def call(control_socket: str, request: dict[str, Any], timeout: float = 30.0) -> dict[str, Any]:
    """Send one request to a running simulator and return its reply."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        sock.connect(control_socket)
        sock.sendall(json.dumps(request).encode() + b"\n")
        data = b""
        while not data.endswith(b"\n"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    reply = json.loads(data or b"{}")
    return reply if isinstance(reply, dict) else {"ok": False, "error": "bad reply"}


def run(
    device_plugin_dir: str,
    status_file: str,
    node_name: str = "lingjun-node-0",
    control_socket: str | None = None,
    stop: threading.Event | None = None,
    interval: float = 0.1,
) -> int:
    """Run the simulator until ``stop`` is set (or SIGTERM/SIGINT when run as a process)."""
    stop = stop or threading.Event()
    control_socket = control_socket or default_control_socket(device_plugin_dir)
    lock = hold_dir(device_plugin_dir)
    sim = KubeletSimulator(device_plugin_dir, node_name=node_name).start()
    if os.path.lexists(control_socket):
        os.unlink(control_socket)
    server = _ControlServer(control_socket, _ControlHandler)
    server.sim = sim
    thread = threading.Thread(target=server.serve_forever, name="kubelet-sim-control", daemon=True)
    thread.start()
    last: dict[str, Any] | None = None
    try:
        while not stop.is_set():
            doc = status_document(sim)
            if doc != last:
                write_atomic(status_file, doc)
                last = doc
            stop.wait(interval)
    finally:
        server.shutdown()
        server.server_close()
        if os.path.lexists(control_socket):
            os.unlink(control_socket)
        sim.stop()
        if os.path.exists(status_file):
            os.unlink(status_file)
        os.close(lock)
    return 0


def _run_main(args: argparse.Namespace) -> int:
    stop = threading.Event()

    def _stop(_signum: int, _frame: object) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    try:
        return run(args.dir, args.status_file, args.node_name, args.control_socket, stop)
    except AlreadyRunning as exc:
        print(f"kubelet simulator: {exc}", file=sys.stderr)
        return 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m rdma_kubesim.sim_cli", description=__doc__)
    sub = parser.add_subparsers(dest="command")
    run_p = sub.add_parser("run", help="run the simulator (default)")
    run_p.add_argument("--dir", required=True, help="device-plugin dir (kubelet.sock is created here)")
    run_p.add_argument("--status-file", required=True, help="JSON file rewritten whenever the node status changes")
    run_p.add_argument("--node-name", default="lingjun-node-0")
    run_p.add_argument("--control-socket", default=None, help=f"default: <dir>/{CONTROL_SOCKET}")
    for name in ("allocate", "status"):
        p = sub.add_parser(name, help=f"{name} through a running simulator")
        p.add_argument("--control-socket", required=True)
        if name == "allocate":
            p.add_argument("--resource", default="rdma/hca")
            p.add_argument("--count", type=int, default=1)
            p.add_argument("--pod", default="rdma-hostnetwork-test")
            p.add_argument("--container", default="rdma-test")
            p.add_argument("--keep", action="store_true", help="keep the allocation (default: release it)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or (argv[0].startswith("-") and argv[0] not in ("-h", "--help")):
        argv = ["run", *argv]
    args = build_parser().parse_args(argv)
    if args.command == "run":
        return _run_main(args)
    if args.command == "status":
        request: dict[str, Any] = {"op": "status"}
    else:
        request = {
            "op": "allocate",
            "resource": args.resource,
            "count": args.count,
            "pod": args.pod,
            "container": args.container,
            "release": not args.keep,
        }
    reply = call(args.control_socket, request)
    print(json.dumps(reply, indent=2, sort_keys=True))
    return 0 if reply.get("ok") else 1


if __name__ == "__main__":
    raise SystemExit(main())
