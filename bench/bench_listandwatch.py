"""ListAndWatch at 100k devices: a health change reaching many open streams, and what it costs Allocate.

The plugin serializes the ListAndWatch message once per change of the pool, in the supervisor's
thread, and every stream sends those bytes (issue 21: it built and serialized the whole response
per stream, on the loop that answers Allocate: 364 ms at 100k devices). This bench runs the real
``serve`` process (shared mode, ``sharedDevices: 100000``) against the kubelet simulator, opens
extra ListAndWatch streams (a kubelet keeps old clients open; debugging tools add more), flips a
port DOWN and ACTIVE, and measures:

- flip -> message at the last stream: from the sysfs write to the new message at every stream;
- Allocate latency while the flips happen, next to the same calls with nothing changing;
- the plugin's CPU time per flip (schedstat).

    .venv/bin/python bench/bench_listandwatch.py [--streams 10] [--flips 20]
    .venv/bin/python bench/bench_listandwatch.py --plugin-pythonpath /tmp/old/plugin_src/src   # another tree
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import grpc
import yaml
from report import load_average, pct

from rdma_device_plugin.api import deviceplugin_pb2 as pb
from rdma_device_plugin.api import deviceplugin_pb2_grpc as pb_grpc
from rdma_kubesim import KubeletSimulator
from rdma_node import fixtures

RES = "rdma/hca"
DEVICES = 100_000
LOCAL_POOL = [("grpc.use_local_subchannel_pool", 1), ("grpc.max_receive_message_length", 16 * 1024 * 1024)]


def cpu_seconds(pid: int) -> float:
    total = 0.0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat", encoding="ascii") as fh:
                total += int(fh.read().split()[0]) / 1e9
        except (OSError, ValueError, IndexError):
            continue
    return total


def plugin_socket(dp: str) -> str:
    names = sorted(n for n in os.listdir(dp) if n.startswith("rdma-dp-rdma_hca") and n.endswith(".sock"))
    return os.path.join(dp, names[-1])


class Watcher(threading.Thread):
    """One extra ListAndWatch client; keeps the arrival time of every message (bytes, not parsed)."""

    def __init__(self, path: str) -> None:
        super().__init__(daemon=True)
        self.channel = grpc.insecure_channel(f"unix://{path}", options=LOCAL_POOL)
        call = self.channel.unary_stream(
            "/v1beta1.DevicePlugin/ListAndWatch",
            request_serializer=pb.Empty.SerializeToString,
            response_deserializer=None,  # raw bytes: the bench must not be the bottleneck
        )
        self.stream = call(pb.Empty())
        self.arrivals: list[tuple[float, int]] = []

    def run(self) -> None:
        try:
            for data in self.stream:
                self.arrivals.append((time.monotonic(), len(data)))
        except grpc.RpcError:
            pass

    def close(self) -> None:
        self.stream.cancel()
        self.channel.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--streams", type=int, default=10, help="extra ListAndWatch streams (default 10)")
    parser.add_argument("--flips", type=int, default=20, help="port state changes (default 20)")
    parser.add_argument("--plugin-pythonpath", default="", help="run the plugin from this source tree")
    args = parser.parse_args(argv)
    print(f"load average at start: {load_average()}", flush=True)
    tmp = tempfile.mkdtemp(prefix="rdpl-", dir="/tmp")
    node = fixtures.write_node(os.path.join(tmp, "node"), fixtures.lingjun_node(nics=4))
    dp = os.path.join(tmp, "dp")
    os.mkdir(dp)
    cfg = os.path.join(tmp, "config.yaml")
    with open(cfg, "w", encoding="utf-8") as fh:
        yaml.safe_dump({"resources": [{"name": RES, "sharedDevices": DEVICES}], "health": {"intervalSeconds": 0.1}}, fh)
    sim = KubeletSimulator(dp).start()
    env = dict(os.environ)
    if args.plugin_pythonpath:
        env["PYTHONPATH"] = args.plugin_pythonpath
    cmd = [sys.executable, "-m", "rdma_device_plugin", "serve", "--config", cfg, "--sysfs-root", node.sysfs]
    cmd += ["--dev-root", node.dev, "--device-plugin-dir", dp, "--health-file", os.path.join(tmp, "health")]
    log = open(os.path.join(tmp, "plugin.log"), "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    watchers: list[Watcher] = []
    stop = threading.Event()
    latencies: list[tuple[float, float]] = []  # (sent, seconds)

    def allocator() -> None:
        with grpc.insecure_channel(f"unix://{plugin_socket(dp)}", options=LOCAL_POOL) as ch:
            stub = pb_grpc.DevicePluginStub(ch)
            req = pb.AllocateRequest()
            req.container_requests.add(devices_ids=["hca-0"])
            while not stop.is_set():
                t = time.monotonic()
                stub.Allocate(req, timeout=60)
                latencies.append((t, time.monotonic() - t))
                time.sleep(0.005)

    reach: list[float] = []
    cpu_per_flip: list[float] = []
    flip_windows: list[tuple[float, float]] = []
    try:
        if not sim.wait_registered(RES, timeout=120):
            raise RuntimeError("the plugin did not register")
        watchers = [Watcher(plugin_socket(dp)) for _ in range(args.streams)]
        for w in watchers:
            w.start()
        deadline = time.monotonic() + 60
        while any(not w.arrivals for w in watchers):
            if time.monotonic() > deadline:
                raise RuntimeError("a stream got no first message")
            time.sleep(0.05)
        size = watchers[0].arrivals[0][1]
        caller = threading.Thread(target=allocator, daemon=True)
        caller.start()
        time.sleep(3.0)  # Allocate with nothing changing
        idle_until = time.monotonic()
        for i in range(args.flips):
            counts = [len(w.arrivals) for w in watchers]
            cpu0 = cpu_seconds(proc.pid)
            t0 = time.monotonic()
            node.set_port_state("mlx5_bond_1", "DOWN" if i % 2 == 0 else "ACTIVE")
            while any(len(w.arrivals) == c for w, c in zip(watchers, counts, strict=True)):
                if time.monotonic() - t0 > 60:
                    raise RuntimeError("a flip did not reach every stream")
                time.sleep(0.002)
            last = max(w.arrivals[c][0] for w, c in zip(watchers, counts, strict=True))
            reach.append(last - t0)
            time.sleep(1.0)
            cpu_per_flip.append(cpu_seconds(proc.pid) - cpu0)
            flip_windows.append((t0, last))
        stop.set()
        caller.join(30)
    finally:
        stop.set()
        for w in watchers:
            w.close()
        proc.terminate()
        proc.wait(30)
        log.close()
        sim.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    idle = [s for t, s in latencies if t < idle_until]
    during = [s for t, s in latencies if any(a - 0.05 <= t <= b for a, b in flip_windows)]
    print()
    streams = f"{args.streams} extra streams + the kubelet's"
    print(f"### ListAndWatch at {DEVICES} devices ({streams}; message {size} bytes; ms)")
    print()
    print("| what | runs | p50 | p99 | max |")
    print("|---|---|---|---|---|")
    for name, values in (
        ("port flip -> new message at the last stream", reach),
        ("Allocate, nothing changing", idle),
        ("Allocate, during a flip", during),
        ("plugin CPU per flip", cpu_per_flip),
    ):
        if values:
            row = f"{1000 * pct(values, 50):.1f} | {1000 * pct(values, 99):.1f} | {1000 * max(values):.1f}"
            print(f"| {name} | {len(values)} | {row} |")
    print(f"\nload average at the end: {load_average()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
