"""Benchmarks of the RDMA device plugin: real ``serve`` processes, the kubelet simulator, fixture nodes.

Run from the repository root:

    .venv/bin/python bench/bench_plugin.py            # full run (~3 minutes)
    .venv/bin/python bench/bench_plugin.py --quick    # shorter windows and fewer samples
    .venv/bin/python bench/bench_plugin.py --write-results bench/RESULTS.md

Figures are printed (Markdown tables), never asserted. Latencies are measured by Python gRPC
clients in this process, so every RPC figure is shown next to a no-op RPC
(GetDevicePluginOptions) measured in the same run: the ratio is what the plugin adds.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import grpc
import yaml
from rdma_device_plugin.api import deviceplugin_pb2 as pb
from rdma_device_plugin.api import deviceplugin_pb2_grpc as pb_grpc
from rdma_device_plugin.config import PluginConfig, socket_name
from rdma_device_plugin.kubesim import KubeletSimulator
from rdma_device_plugin.node import fixtures

RES = "rdma/hca"
LOCAL_POOL = [("grpc.use_local_subchannel_pool", 1)]  # every client its own connection


# --------------------------------------------------------------------------- rig


def lingjun_spec(nics: int) -> fixtures.NodeSpec:
    """``nics`` plain RoCE NICs on valid PCI buses, spread over 2 NUMA nodes."""
    specs = [
        fixtures.NicSpec(
            name=f"mlx5_{i}",
            pci_address=f"0000:{0x10 + 0x0C * i:02x}:00.0",
            uverbs=i,
            netdevs=(f"eth{i}",),
            numa_node=(2 * i) // max(nics, 1),
        )
        for i in range(nics)
    ]
    return fixtures.NodeSpec(nics=tuple(specs))


class Rig:
    """A fixture node, the kubelet simulator and one real ``serve`` process."""

    def __init__(self, spec: fixtures.NodeSpec, config: dict[str, Any]) -> None:
        self.tmp = tempfile.mkdtemp(prefix="rdpb-", dir="/tmp")
        self.fx = fixtures.write_node(os.path.join(self.tmp, "node"), spec)
        self.dp = os.path.join(self.tmp, "dp")
        os.mkdir(self.dp)
        self.config = config
        cfg = os.path.join(self.tmp, "config.yaml")
        with open(cfg, "w", encoding="utf-8") as fh:
            yaml.safe_dump(config, fh)
        self.sim = KubeletSimulator(self.dp).start()
        self.log = open(os.path.join(self.tmp, "plugin.log"), "w", encoding="utf-8")  # noqa: SIM115
        cmd = [sys.executable, "-m", "rdma_device_plugin", "serve", "--config", cfg]
        cmd += ["--sysfs-root", self.fx.sysfs, "--dev-root", self.fx.dev, "--device-plugin-dir", self.dp]
        cmd += ["--health-file", os.path.join(self.tmp, "health.json")]  # the liveness file, as in the chart
        self.t_spawn = time.monotonic()
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        if not self.sim.wait_registered(RES, timeout=60):
            self.close()
            raise RuntimeError("plugin did not register")
        self.socket = os.path.join(self.dp, socket_name(RES))

    @property
    def pid(self) -> int:
        return self.proc.pid

    def channel(self) -> grpc.Channel:
        return grpc.insecure_channel(f"unix://{self.socket}", options=LOCAL_POOL)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.sim.stop()
        self.log.close()
        shutil.rmtree(self.tmp, ignore_errors=True)

    def __enter__(self) -> Rig:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --------------------------------------------------------------------------- stats


def pct(values: Sequence[float], p: float) -> float:
    """Nearest-rank percentile."""
    s = sorted(values)
    k = max(0, min(len(s) - 1, round(p / 100 * len(s) + 0.5) - 1))
    return s[k]


def ms(v: float) -> str:
    return f"{v * 1000:.2f}"


def dist_row(name: str, values: Sequence[float]) -> str:
    return (
        f"| {name} | {len(values)} | {ms(pct(values, 50))} | {ms(pct(values, 90))} | {ms(pct(values, 99))} "
        f"| {ms(max(values))} |"
    )


# --------------------------------------------------------------------------- RPC latency


def measure_rpc(rig: Rig, method: str, request: Callable[[], Any], concurrency: int, total_calls: int) -> list[float]:
    per_thread = max(1, total_calls // concurrency)
    latencies: list[float] = []
    lock = threading.Lock()
    barrier = threading.Barrier(concurrency)

    def worker() -> None:
        with rig.channel() as ch:
            call = getattr(pb_grpc.DevicePluginStub(ch), method)
            req = request()
            for _ in range(3):  # connect and warm up
                call(req, timeout=60)
            barrier.wait()
            mine = []
            for _ in range(per_thread):
                t = time.perf_counter()
                call(req, timeout=60)
                mine.append(time.perf_counter() - t)
        with lock:
            latencies.extend(mine)

    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return latencies


def bench_latency(out: list[str], quick: bool) -> None:
    total = 600 if quick else 3000
    spec = lingjun_spec(8)
    ids = [n.pci_address for n in spec.nics]
    with Rig(spec, {"mode": "exclusive"}) as rig:

        def noop() -> Any:
            return pb.Empty()

        def allocate() -> Any:
            req = pb.AllocateRequest()
            req.container_requests.add(devices_ids=ids[:2])
            return req

        def preferred() -> Any:
            req = pb.PreferredAllocationRequest()
            req.container_requests.add(available_deviceIDs=ids, must_include_deviceIDs=[], allocation_size=2)
            return req

        out += [
            "### RPC latency (exclusive mode, 8 NICs, ms; client = Python gRPC in the bench process)",
            "",
            "| callers | RPC | calls | p50 | p99 | p50 / no-op p50 | p99 / no-op p99 |",
            "|---|---|---|---|---|---|---|",
        ]
        for concurrency in (1, 8, 64):
            base = measure_rpc(rig, "GetDevicePluginOptions", noop, concurrency, total)
            b50, b99 = pct(base, 50), pct(base, 99)
            noop_name = "GetDevicePluginOptions (no-op)"
            out.append(f"| {concurrency} | {noop_name} | {len(base)} | {ms(b50)} | {ms(b99)} | 1.00 | 1.00 |")
            for name, req in (("Allocate", allocate), ("GetPreferredAllocation", preferred)):
                lat = measure_rpc(rig, name, req, concurrency, total)
                p50, p99 = pct(lat, 50), pct(lat, 99)
                out.append(
                    f"| {concurrency} | {name} | {len(lat)} | {ms(p50)} | {ms(p99)} "
                    f"| {p50 / b50:.2f} | {p99 / b99:.2f} |"
                )
        out.append("")


def bench_shared_latency(out: list[str], quick: bool) -> None:
    """Shared mode: Allocate of one of 1000 devices hands out every NIC's uverbs + rdma_cm."""
    total = 600 if quick else 3000
    with Rig(lingjun_spec(8), {}) as rig:

        def noop() -> Any:
            return pb.Empty()

        def allocate() -> Any:
            req = pb.AllocateRequest()
            req.container_requests.add(devices_ids=["hca-0"])
            return req

        out += [
            "### RPC latency (shared mode, 8 NICs, 1000 devices, ms)",
            "",
            "| callers | RPC | calls | p50 | p99 | p50 / no-op p50 | p99 / no-op p99 |",
            "|---|---|---|---|---|---|---|",
        ]
        for concurrency in (1, 8):
            base = measure_rpc(rig, "GetDevicePluginOptions", noop, concurrency, total)
            lat = measure_rpc(rig, "Allocate", allocate, concurrency, total)
            b50, b99, p50, p99 = pct(base, 50), pct(base, 99), pct(lat, 50), pct(lat, 99)
            noop_name = "GetDevicePluginOptions (no-op)"
            out.append(f"| {concurrency} | {noop_name} | {len(base)} | {ms(b50)} | {ms(b99)} | 1.00 | 1.00 |")
            out.append(
                f"| {concurrency} | Allocate | {len(lat)} | {ms(p50)} | {ms(p99)} | {p50 / b50:.2f} | {p99 / b99:.2f} |"
            )
        out.append("")


# --------------------------------------------------------------------------- snapshots


def bench_snapshots(out: list[str], quick: bool) -> None:
    out += [
        "### Snapshot size and time to first snapshot (shared mode)",
        "",
        "| NICs | shared devices | snapshot bytes | spawn -> first snapshot at kubelet (s) "
        "| Register -> first snapshot (ms) | ListAndWatch open -> first message (ms) |",
        "|---|---|---|---|---|---|",
    ]
    for nics in (1, 8, 16):
        for shared in (1000, 10000):
            with Rig(lingjun_spec(nics), {"resources": [{"name": RES, "sharedDevices": shared}]}) as rig:
                ep = rig.sim.endpoints[RES]
                first_snap = ep.snapshots[0][0]
                registered = next(t for t, r in rig.sim.registrations if r == RES)
                opens = []
                size = 0
                with rig.channel() as ch:
                    stub = pb_grpc.DevicePluginStub(ch)
                    for _ in range(3 if quick else 10):
                        t = time.perf_counter()
                        stream = stub.ListAndWatch(pb.Empty())
                        first = next(stream)
                        opens.append(time.perf_counter() - t)
                        size = len(first.SerializeToString())
                        stream.cancel()
                out.append(
                    f"| {nics} | {shared} | {size} | {first_snap - rig.t_spawn:.2f} "
                    f"| {ms(first_snap - registered)} | {ms(statistics.median(opens))} |"
                )
    with Rig(lingjun_spec(16), {"mode": "exclusive"}) as rig, rig.channel() as ch:
        stream = pb_grpc.DevicePluginStub(ch).ListAndWatch(pb.Empty())
        size = len(next(stream).SerializeToString())
        stream.cancel()
        out.append(f"| 16 | exclusive (16 devices, NUMA topology) | {size} | | | |")
    out.append("")


# --------------------------------------------------------------------------- idle cost


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat", encoding="ascii") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status", encoding="ascii") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def thread_cpu(pid: int) -> dict[int, float]:
    """Thread id -> CPU seconds (utime + stime) of every thread of ``pid``."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat", encoding="ascii") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[int(tid)] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return out


def bench_idle(out: list[str], quick: bool) -> None:
    """The default config (probe every health.intervalSeconds, 0.1 s), stream open: CPU per 10 s slice."""
    window, slice_s = (10.0, 5.0) if quick else (60.0, 10.0)
    interval = PluginConfig().health.interval_seconds
    with Rig(fixtures.lingjun_node(nics=4), {}) as rig:
        time.sleep(2.0)  # settle after start-up
        load = os.getloadavg()[0]
        cpu0, rss0, threads0 = cpu_seconds(rig.pid), rss_kib(rig.pid), thread_cpu(rig.pid)
        slices = []
        for _ in range(int(window / slice_s)):
            a = cpu_seconds(rig.pid)
            time.sleep(slice_s)
            slices.append(100 * (cpu_seconds(rig.pid) - a) / slice_s)
        cpu1, rss1, threads1 = cpu_seconds(rig.pid), rss_kib(rig.pid), thread_cpu(rig.pid)
        threads = len(threads1)
    used = cpu1 - cpu0
    busy = sorted((threads1[t] - threads0.get(t, 0.0) for t in threads1), reverse=True)
    probes = window / interval
    out += [
        f"### Idle cost (4 bonded NICs, default config: shared, probe every {interval} s, stream open, "
        f"{window:.0f} s window; load average {load:.2f} at start)",
        "",
        "| CPU seconds | CPU % of one core | % per slice: min / median / max | busiest threads (% each) "
        "| CPU per probe (ms) | VmRSS start (MiB) | VmRSS end (MiB) | threads |",
        "|---|---|---|---|---|---|---|---|",
        f"| {used:.2f} | {100 * used / window:.3f} | {min(slices):.2f} / {statistics.median(slices):.2f} / "
        f"{max(slices):.2f} ({len(slices)} x {slice_s:.0f} s) | "
        + ", ".join(f"{100 * b / window:.2f}" for b in busy[:3])
        + f" | {1000 * used / probes:.3f} | {rss0 / 1024:.1f} | {rss1 / 1024:.1f} | {threads} |",
        "",
        "CPU per probe charges all idle CPU (probe thread, socket watch loop at 10 Hz, the open "
        "stream's 1 s wake-ups) to the probes, so it is an upper bound. The busiest threads are the "
        "probe loop and the socket-watch loop (both wake 10 times a second). /proc tick resolution is "
        f"{1000 / os.sysconf('SC_CLK_TCK'):.0f} ms.",
        "",
    ]


# --------------------------------------------------------------------------- restart and flip latency


def bench_recovery(out: list[str], quick: bool) -> None:
    runs = 15 if quick else 50
    interval = PluginConfig().health.interval_seconds  # the default config
    with Rig(fixtures.lingjun_node(nics=4), {}) as rig:
        sim = rig.sim
        rereg: list[float] = []
        first_snap: list[float] = []
        rng = random.Random(1)
        for _ in range(runs):
            n = sum(1 for _, r in sim.registrations if r == RES)
            sim.restart()
            t0 = time.monotonic()  # kubelet.sock is serving again
            if not sim.wait_registered(RES, count=n + 1, timeout=30):
                raise RuntimeError("no re-registration")
            t_reg = max(t for t, r in sim.registrations if r == RES)
            rereg.append(max(0.0, t_reg - t0))
            first_snap.append(max(0.0, sim.endpoints[RES].snapshots[0][0] - t0))
            time.sleep(rng.uniform(0, 0.2))
        down: list[float] = []
        up: list[float] = []
        ep = sim.endpoints[RES]
        for i in range(runs):
            nic = f"mlx5_bond_{i % 4}"
            for state, want, sink in (("DOWN", 0, down), ("ACTIVE", 1000, up)):
                k = len(ep.snapshots)
                t0 = time.monotonic()
                rig.fx.set_port_state(nic, state)
                if not sim.wait_for(lambda k=k, want=want: any(s[2] == want for s in ep.snapshots[k:]), 10):
                    raise RuntimeError("flip lost")
                sink.append(next(s[0] for s in ep.snapshots[k:] if s[2] == want) - t0)
                time.sleep(rng.uniform(0, interval))  # decorrelate from the probe phase
    out += [
        f"### Recovery latency (4 bonded NICs, default config: probe interval {interval} s, socket watch 0.1 s; "
        f"seconds shown in ms; load average {os.getloadavg()[0]:.2f} at the end)",
        "",
        "| what | runs | p50 | p90 | p99 | max |",
        "|---|---|---|---|---|---|",
        dist_row("kubelet restart -> Register received", rereg),
        dist_row("kubelet restart -> first snapshot received", first_snap),
        dist_row("port DOWN written -> allocatable 0 at kubelet", down),
        dist_row("port ACTIVE written -> allocatable 1k at kubelet", up),
        "",
    ]


# --------------------------------------------------------------------------- main


def machine() -> list[str]:
    model = "unknown"
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            model = next((ln.split(":", 1)[1].strip() for ln in fh if ln.startswith("model name")), model)
    except OSError:
        pass
    return [
        f"- nproc: {os.cpu_count()}",
        f"- CPU: {model}",
        f"- Python: {platform.python_version()} ({platform.python_implementation()}), grpcio {grpc.__version__}",
        f"- kernel: {platform.release()}",
    ]


SECTIONS = {
    "shared-latency": bench_shared_latency,
    "latency": bench_latency,
    "snapshots": bench_snapshots,
    "idle": bench_idle,
    "recovery": bench_recovery,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="10 s idle window, fewer samples")
    parser.add_argument("--write-results", metavar="FILE", help="also write the Markdown report to FILE")
    parser.add_argument("--only", choices=sorted(SECTIONS), action="append", help="run only these sections")
    args = parser.parse_args(argv)
    started = time.monotonic()
    cmd = " ".join(["bench/bench_plugin.py", *(argv if argv is not None else sys.argv[1:])])
    out = ["## Machine", "", *machine(), "", f"Command: `.venv/bin/python {cmd}`", ""]
    for name, section in SECTIONS.items():
        if args.only and name not in args.only:
            continue
        section(out, args.quick)
        print(f"... {section.__name__} done after {time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)
    out.append(f"Total benchmark time: {time.monotonic() - started:.0f} s.")
    if args.write_results:
        with open(args.write_results, "w", encoding="utf-8") as fh:
            fh.write("\n".join(out) + "\n")
    print("\n".join(out), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
