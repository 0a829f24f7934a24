"""Flap figure (issue 30): one port of four flapping 20 times a second for ten minutes, against the
kubelet's own device manager, while pods keep arriving.

A fixture node with 4 bonded NICs (rdma_node.fixtures), shared mode (the default config: one pool of
1000 devices, `health.policy: all`, flap damping on), the real `serve` registered with
``kubelet-managers`` v1.37 (rdma_kubesim.real, built by `make kube`). One port (``mlx5_bond_1``)
has its sysfs state written DOWN and ACTIVE in turn, 20 full flaps a second
(rdma_kubesim.flap.flapper, the fault of plugin_src/tests/test_damping.py), for the whole run, while
a pod asking ``rdma/hca: 1`` is admitted every 2 s through the kubelet's own admission and Allocate.
Then the port stays ACTIVE and the bench waits for allocatable to come back (the hold-down's tail).

Printed, from the kubelet's record (every change of allocatable, polled every 2 ms): how often
allocatable changed (between 0 and not 0, and in all), the time at 0 and below the count; the pods
admitted and refused (with the refusal reasons); the plugin's ``rdma_dp_nic_held_down`` (scraped every
10 s) and its hold-down WARNINGs; the kubelet's checkpoint writes (its klog's "Checkpoint file
written", and the ListAndWatch updates it processed); the plugin's CPU (schedstat) and RSS; the load
average. Next to the issue's figure from before damping: 17 toggles in 10 s, 36 of 95 pods refused.

Run from the repository root:

    .venv/bin/python bench/bench_flap.py                     # 600 s of flapping (about 13 minutes)
    .venv/bin/python bench/bench_flap.py --seconds 30        # a quick run
    .venv/bin/python bench/bench_flap.py --seconds 60 --no-damping   # the behaviour before issue 30
"""

from __future__ import annotations

import argparse
import collections
import itertools
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Sequence
from typing import Any

import yaml
from bench_plugin import cpu_seconds, rss_kib, status_kib
from report import load_average

from rdma_kubesim.flap import flapper, segments
from rdma_kubesim.handover import back_at_count
from rdma_kubesim.plugin import serve_command
from rdma_kubesim.real import RealKubelet, find_binary
from rdma_node import fixtures

RES = "rdma/hca"
COUNT = 1000  # the default config's shared devices
NIC = "mlx5_bond_1"  # one of the fixture's four
SCRAPE_SECONDS = 10.0  # metrics and load average, as often as a Prometheus would
RECORD_LIMIT = 20000  # transitions record_stop keeps (kube/README.md)
# Issue 30, item 3, before flap damping: the same flap for 10 s (policy all, the kubelet's managers).
BEFORE = {"seconds": 10, "toggles": 17, "pods": 95, "refused": 36}
HELD = re.compile(r'^rdma_dp_nic_held_down\{nic="([^"]+)"\} (\S+)$', re.M)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        body: bytes = resp.read()
    return body.decode()


def metric_sum(text: str, name: str) -> float:
    """The sum of every sample of ``name`` (all label sets) in an exposition."""
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)$", text, re.M))


def klog_count(path: str, offset: int, needle: str) -> str:
    """How often ``needle`` is in the klog after ``offset``; "not logged" when the whole klog lacks it
    (the device manager logs its checkpoint writes at -v 4, kubelet-managers' default)."""
    with open(path, "rb") as fh:
        data = fh.read()
    if needle.encode() not in data:
        return "not logged (klog below -v 4)"
    return str(data[offset:].count(needle.encode()))


class Pods:
    """A pod asking ``rdma/hca: 1`` admitted every ``every`` seconds until stopped: admitted and
    refused, with the refusals' reasons."""

    def __init__(self, kubelet: RealKubelet, every: float) -> None:
        self.kubelet, self.every = kubelet, every
        self.admitted = 0
        self.reasons: collections.Counter[str] = collections.Counter()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True, name="pods")

    @property
    def refused(self) -> int:
        return sum(self.reasons.values())

    def _run(self) -> None:
        n = 0
        next_at = time.monotonic()
        while not self.stop.is_set():
            n += 1
            reply = self.kubelet.admit(f"flap-pod-{n}", {"main": {RES: 1}})
            if reply.get("ok"):
                self.admitted += 1
            else:
                why = f"{reply.get('reason', '')}: {reply.get('error', '')}".strip(": ")
                self.reasons[re.sub(r"pod flap-pod-\d+|\d+", "N", why)[:160]] += 1
            next_at += self.every
            self.stop.wait(max(0.0, next_at - time.monotonic()))


class Watch:
    """Every ``SCRAPE_SECONDS``: the plugin's ``rdma_dp_nic_held_down`` and the 1-minute load average."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.held: collections.Counter[str] = collections.Counter()  # NIC -> scrapes it was held down in
        self.scrapes = 0
        self.failed = 0
        self.loads: list[float] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True, name="watch")

    def _run(self) -> None:
        while not self.stop.wait(SCRAPE_SECONDS):
            self.loads.append(os.getloadavg()[0])
            try:
                text = scrape(self.port)
            except OSError:
                self.failed += 1
                continue
            self.scrapes += 1
            for nic, value in HELD.findall(text):
                if float(value) >= 1:
                    self.held[nic] += 1


def changes(values: Sequence[int]) -> tuple[int, int]:
    """(changes between 0 and not 0, changes of the value at all) along ``values``."""
    pairs = list(itertools.pairwise(values))
    return sum((a == 0) != (b == 0) for a, b in pairs), sum(a != b for a, b in pairs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--seconds", type=float, default=600.0, help="of flapping (default 600)")
    parser.add_argument("--hz", type=float, default=20.0, help="full flaps a second (default 20)")
    parser.add_argument("--pod-every", type=float, default=2.0, help="seconds between pods (default 2)")
    parser.add_argument("--policy", choices=["all", "any"], default="all", help="health.policy (default all)")
    parser.add_argument("--no-damping", action="store_true", help="health.flapDamping.enabled: false (before issue 30)")
    parser.add_argument(
        "--tail", type=float, default=150.0, help="seconds to wait for allocatable after the flap stops (default 150)"
    )
    parser.add_argument("--version", choices=["1.37", "1.32"], default="1.37", help="of the kubelet's managers")
    parser.add_argument("--keep", action="store_true", help="keep the logs (plugin, klog) and print where")
    args = parser.parse_args(argv)
    binary, why = find_binary(args.version)
    if binary is None:
        print(f"skipped: {why}", file=sys.stderr)
        return 2
    cmd = " ".join(["bench/bench_flap.py", *(argv if argv is not None else sys.argv[1:])])
    load_start = load_average()
    print(f"load average at start: {load_start}", file=sys.stderr, flush=True)
    tmp = tempfile.mkdtemp(prefix="rdpf-", dir="/tmp")
    node = fixtures.write_node(os.path.join(tmp, "node"), fixtures.lingjun_node(nics=4))
    dp, klog, log_path = os.path.join(tmp, "dp"), os.path.join(tmp, "kubelet.klog"), os.path.join(tmp, "plugin.log")
    config: dict[str, Any] = {"health": {"policy": args.policy}}
    if args.no_damping:
        config["health"]["flapDamping"] = {"enabled": False}
    cfg = os.path.join(tmp, "config.yaml")
    with open(cfg, "w", encoding="utf-8") as fh:
        yaml.safe_dump(config, fh)
    port = free_port()
    kubelet = RealKubelet(dp, binary=binary, klog=klog).start()
    extra = [
        "--config",
        cfg,
        "--health-file",
        os.path.join(tmp, "health.json"),
        "--metrics-address",
        f"127.0.0.1:{port}",
    ]
    log = open(log_path, "wb")  # noqa: SIM115 - closed with the process
    plugin = subprocess.Popen(serve_command(node, dp, *extra), stdout=log, stderr=subprocess.STDOUT)
    pods, watch = Pods(kubelet, args.pod_every), Watch(port)
    try:
        if not kubelet.wait_registered(RES, timeout=60) or not kubelet.wait_allocatable(RES, COUNT, timeout=60):
            raise RuntimeError(f"the plugin did not register at {COUNT}; see {log_path}")
        time.sleep(2.0)  # past start-up
        updates0 = int(kubelet.must("status").get("updates", {}).get(RES, 0))
        klog0 = os.path.getsize(klog)
        kubelet.record_start()
        t_record = time.monotonic()
        cpu0, rss0 = cpu_seconds(plugin.pid), rss_kib(plugin.pid)
        thread = flapper(node, NIC, hz=args.hz, seconds=args.seconds)
        t_flap = time.monotonic()
        thread.start()
        pods.thread.start()
        watch.thread.start()
        print(f"flapping {NIC} {args.hz:g} times a second for {args.seconds:g} s ...", file=sys.stderr, flush=True)
        thread.join()
        t_stable = time.monotonic()
        pods.stop.set()
        watch.stop.set()
        pods.thread.join(30)
        watch.thread.join(30)
        cpu1, rss1 = cpu_seconds(plugin.pid), rss_kib(plugin.pid)
        updates1 = int(kubelet.must("status").get("updates", {}).get(RES, 0))
        checkpoints = klog_count(klog, klog0, "Checkpoint file written")
        metrics = scrape(port)
        if args.tail > 0:
            kubelet.wait_allocatable(RES, COUNT, timeout=args.tail)
        time.sleep(0.5)
        record = kubelet.record_stop()
        hwm = status_kib(plugin.pid, "VmHWM")
        load_end = load_average()
    finally:
        pods.stop.set()
        watch.stop.set()
        if plugin.poll() is None:
            plugin.terminate()
            try:
                plugin.wait(30)
            except subprocess.TimeoutExpired:
                plugin.kill()
                plugin.wait()
        log.close()
        kubelet.close()
    with open(log_path, encoding="utf-8", errors="replace") as fh:
        plugin_log = fh.read()
    if args.keep:
        print(f"logs kept in {tmp}", file=sys.stderr)
    else:
        shutil.rmtree(tmp, ignore_errors=True)

    transitions = record["transitions"]
    flap_from, flap_to = (t_flap - t_record) * 1000, (t_stable - t_record) * 1000
    during = segments(transitions, RES, flap_from, flap_to)
    values = [v for _, _, v in during]
    zero_toggles, all_changes = changes(values)
    at_zero = sum(b - a for a, b, v in during if v == 0) / 1000
    below = sum(b - a for a, b, v in during if v < COUNT) / 1000
    window = t_stable - t_flap
    tail = segments(transitions, RES, flap_to, float(record["ms"]))
    tail_toggles, _ = changes([values[-1] if values else COUNT] + [v for _, _, v in tail])
    back = back_at_count(transitions, RES, COUNT, flap_to)
    pods_total = pods.admitted + pods.refused
    held_warnings = plugin_log.count("held down after")
    released = plugin_log.count("no longer held down")
    cpu = 100 * (cpu1 - cpu0) / window
    loads = watch.loads or [os.getloadavg()[0]]
    damping = "off" if args.no_damping else "on"
    damping_how = "off" if args.no_damping else "on (defaults: half-life 15 s, suppress 1.5, max hold-down 120 s)"

    out = [
        f"### Flap: {NIC} (one port of four) flapping {args.hz:g} times a second for {window:.0f} s "
        f"({os.path.basename(binary)} v{args.version}, shared mode, policy {args.policy}, flap damping {damping})",
        "",
        f"Command: `.venv/bin/python {cmd}`; flap damping {damping_how}; a pod asking `{RES}: 1` every "
        f"{args.pod_every:g} s through the kubelet's admission; load average at start {load_start}, at the end "
        f"{load_end}, 1-minute load every {SCRAPE_SECONDS:.0f} s min/median/max "
        f"{min(loads):.2f} / {sorted(loads)[len(loads) // 2]:.2f} / {max(loads):.2f}.",
        "",
        "| what | value |",
        "|---|---|",
        f"| allocatable changes between 0 and {COUNT} while flapping (toggles) | {zero_toggles} |",
        f"| allocatable changes of any size while flapping | {all_changes} |",
        f"| toggles per minute | {60 * zero_toggles / window:.2f} |",
        f"| time at allocatable 0 (s) | {at_zero:.1f} |",
        f"| time below {COUNT} (s) | {below:.1f} |",
        f"| share of the run at allocatable 0 (%) | {100 * at_zero / window:.1f} |",
        f"| pods admitted | {pods.admitted} |",
        f"| pods refused | {pods.refused} |",
        f"| pods refused (%) | {100 * pods.refused / max(pods_total, 1):.1f} |",
        f"| kubelet checkpoint writes while flapping (klog) | {checkpoints} |",
        f"| ListAndWatch updates the kubelet processed while flapping | {updates1 - updates0} |",
        f"| plugin: port state changes seen (rdma_dp_port_state_changes_total) | "
        f"{metric_sum(metrics, 'rdma_dp_port_state_changes_total'):.0f} |",
        f"| plugin: scrapes with rdma_dp_nic_held_down{{nic={NIC}}} 1 | {watch.held[NIC]} of {watch.scrapes} |",
        f"| plugin: other NICs held down (scrapes) | {sum(n for k, n in watch.held.items() if k != NIC)} |",
        f"| plugin: `held down after` WARNINGs / `no longer held down` | {held_warnings} / {released} |",
        f"| plugin: probe failures (rdma_dp_probe_failures_total) | "
        f"{metric_sum(metrics, 'rdma_dp_probe_failures_total'):.0f} |",
        f"| plugin CPU while flapping (% of one core, schedstat) | {cpu:.3f} |",
        f"| plugin VmRSS start / end / VmHWM (MiB) | {rss0 / 1024:.1f} / {rss1 / 1024:.1f} / {hwm / 1024:.1f} |",
        f"| flap stopped -> allocatable {COUNT} (s) | "
        f"{f'{back / 1000:.1f}' if back is not None else f'not within {args.tail:g}'} |",
        f"| toggles after the flap stopped | {tail_toggles} |",
        "",
    ]
    if pods.reasons:
        out += ["Refusals: " + "; ".join(f"{n} x `{why}`" for why, n in pods.reasons.most_common(3)), ""]
    if len(transitions) >= RECORD_LIMIT:
        out += [f"The kubelet's record stopped at {RECORD_LIMIT} transitions: later changes are not counted.", ""]
    if watch.failed:
        out += [f"{watch.failed} scrapes failed.", ""]
    b = BEFORE
    out += [
        f"Before flap damping (issue 30, item 3: the same flap for {b['seconds']} s, policy all): allocatable "
        f"{COUNT} <-> 0 {b['toggles']} times ({60 * b['toggles'] / b['seconds']:.0f} a minute, each a checkpoint "
        f"write), {b['refused']} of {b['pods']} pods refused ({100 * b['refused'] / b['pods']:.0f} %). This run: "
        f"{zero_toggles} toggles in {window:.0f} s ({60 * zero_toggles / window:.2f} a minute), {pods.refused} of "
        f"{pods_total} pods refused ({100 * pods.refused / max(pods_total, 1):.0f} %).",
    ]
    print("\n".join(out), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
