"""Handover figure: how long the kubelet shows allocatable 0 while a new plugin instance takes over.

A DaemonSet rolling update (or a mode switch) runs the new pod next to the old one for a moment.
This bench does exactly that against the kubelet's own device manager, both versions `make kube`
builds (rdma_kubesim.real): v1.37 (``kubelet-managers``: endpoints kept by socket path, kubernetes
PR 135437) and v1.32 (``kubelet-dm-serve``: the 1.28-1.34 re-registration behaviour of kubernetes
issues 121994/127803, where the end of an older stream cuts the client registered last). Each
records capacity and allocatable every 2 ms (``record_start``/``record_stop``):

- plain: the new instance starts and registers while the old one runs; then the old one gets SIGTERM
  (the DaemonSet controller deletes the old pod once the new one is ready: 1 s after it registered);
- slow: the old instance is paused (SIGSTOP) from the moment the new one starts until 0.3 s after
  the new one registered (a CPU-throttled pod), then continues (SIGCONT) and gets SIGTERM.

Per handover the figure is the longest stretch with allocatable 0 from the new instance's start to
0.3 s after the old one exited.

- race (issue 30): two instances started 0-50 ms apart, one of them (or neither) stalled for 0-3 s
  early on, the one started first gets SIGTERM once the pair settled; each trial with a kubelet of
  its own (rdma_kubesim.handover, which the tests run a few times). Figures: the
  total time allocatable was below its count after first reaching it, the time from the SIGTERM
  until it was back at the count for good, and the trials that failed (not back within 1 s, or a
  pod not admitted at the end).

Run from the repository root:

    .venv/bin/python bench/bench_handover.py            # per version: 20 plain + 20 slow, 100 race trials
    .venv/bin/python bench/bench_handover.py --runs 5 --trials 10   # quicker
    .venv/bin/python bench/bench_handover.py --only race --versions 1.32
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

from report import load_average, pct

from rdma_kubesim.handover import Plan, Trial, race_trial
from rdma_kubesim.plugin import serve_command
from rdma_kubesim.real import RealKubelet, find_binary, longest_zero_window
from rdma_node import fixtures

RES = "rdma/hca"
PAUSE_SECONDS = 0.3
SETTLE_SECONDS = 0.3
READY_SECONDS = 1.0  # from the new instance's registration to the old pod's deletion
SLOW_TRIAL_MS = 100.0  # a race trial this long below the count keeps its logs
VERSIONS = {  # what each build of the kubelet's managers stands for (find_binary's versions)
    "1.37": "kubelet-managers v1.37: endpoints by socket path",
    "1.32": "device manager v1.32: an older stream's end cuts the client registered last",
}


class Instances:
    """Plugin processes on one fixture node and one device-plugin dir, as pods of one DaemonSet."""

    def __init__(self, tmp: str, node: fixtures.FixtureNode, dp: str) -> None:
        self.tmp, self.node, self.dp = tmp, node, dp
        self.count = 0

    def start(self) -> tuple[subprocess.Popen[bytes], str]:
        self.count += 1
        log = os.path.join(self.tmp, f"plugin{self.count}.log")
        cmd = serve_command(self.node, self.dp, "--health-file", os.path.join(self.tmp, f"health{self.count}.json"))
        with open(log, "wb") as fh:
            return subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT), log


def handover(kubelet: RealKubelet, instances: Instances, old: subprocess.Popen[bytes], slow: bool) -> tuple[float, Any]:
    """One handover from ``old`` to a new instance; (longest allocatable-0 window in ms, the new one)."""
    registrations = kubelet.registration_count(RES)
    kubelet.record_start()
    if slow:
        old.send_signal(signal.SIGSTOP)
    new, log = instances.start()
    try:
        if not kubelet.wait_registered(RES, count=registrations + 1, timeout=60):
            raise RuntimeError(f"the new instance did not register; see {log}")
        if slow:
            time.sleep(PAUSE_SECONDS)
    finally:
        if slow:
            old.send_signal(signal.SIGCONT)
    # The DaemonSet controller deletes the old pod once the new one is ready (its readiness probe).
    time.sleep(READY_SECONDS)
    old.terminate()
    old.wait(30)
    time.sleep(SETTLE_SECONDS)
    if not kubelet.wait_allocatable(RES, 1000, timeout=30):
        raise RuntimeError(f"allocatable did not come back after the handover; see {log}")
    record = kubelet.record_stop()
    return longest_zero_window(record["transitions"], RES, float(record["ms"])), new


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--runs", type=int, default=20, help="plain and slow handovers of each kind (default 20)")
    parser.add_argument("--trials", type=int, default=100, help="race trials (default 100)")
    parser.add_argument("--seed", type=int, default=30, help="of the race trials' faults (default 30)")
    parser.add_argument("--only", choices=["handover", "race"], help="one part only")
    parser.add_argument(
        "--versions",
        default=",".join(VERSIONS),
        help=f"of the kubelet's managers, comma-separated (default {','.join(VERSIONS)})",
    )
    args = parser.parse_args(argv)
    versions = [v for v in args.versions.split(",") if v]
    unknown = [v for v in versions if v not in VERSIONS]
    if unknown:
        parser.error(f"--versions: {', '.join(unknown)} unknown; choose from {', '.join(VERSIONS)}")
    binaries = {}
    for version in versions:
        binary, why = find_binary(version)
        if binary is None:
            print(f"skipped: {why}", file=sys.stderr)
            return 2
        binaries[version] = binary
    print(f"load average at start: {load_average()}", flush=True)
    for version, binary in binaries.items():
        if args.only != "race":
            plain_and_slow(binary, version, args.runs)
        if args.only != "handover":
            race(binary, version, args.trials, args.seed)
    print(f"\nload average at the end: {load_average()}")
    return 0


def race(binary: str, version: str, trials: int, seed: int) -> None:
    rng = random.Random(seed)
    tmp = tempfile.mkdtemp(prefix="rdpr-", dir="/tmp")
    node = fixtures.write_node(os.path.join(tmp, "node"), fixtures.lingjun_node(nics=4))
    done: list[Trial] = []
    try:
        for i in range(trials):
            trial = race_trial(binary, node, tmp, Plan.draw(rng), name=f"t{i}")
            done.append(trial)
            slow = trial.below_ms > SLOW_TRIAL_MS
            verdict = "ok" if trial.ok else "FAILED"
            verdict += f" (logs kept: {' '.join(trial.logs)})" if slow or not trial.ok else ""
            figures = f"below {trial.below_ms} ms, back {trial.back_ms} ms"
            print(f"v{version} race {i + 1}/{trials}: {trial.plan}: {figures}, {verdict}", file=sys.stderr, flush=True)
            if trial.ok and not slow:
                for log in trial.logs:
                    os.unlink(log)
    finally:
        if all(t.ok and t.below_ms <= SLOW_TRIAL_MS for t in done):
            shutil.rmtree(tmp, ignore_errors=True)
    below = [t.below_ms for t in done]
    back = [t.back_ms if t.back_ms is not None else float("inf") for t in done]
    print()
    print(f"### Handover race, {VERSIONS[version]}:")
    print("two instances 0-50 ms apart, stalls of 0-3 s, the first started exits (ms)")
    print()
    print("| what | runs | p50 | p99 | max | failed |")
    print("|---|---|---|---|---|---|")
    failed = sum(not t.ok for t in done)
    for what, values in (("below the count, total", below), ("SIGTERM -> back at the count", back)):
        figures = " | ".join(f"{v:.1f}" for v in (pct(values, 50), pct(values, 99), max(values)))
        print(f"| {what} | {len(done)} | {figures} | {failed} |")


def plain_and_slow(binary: str, version: str, runs: int) -> None:
    tmp = tempfile.mkdtemp(prefix="rdph-", dir="/tmp")
    node = fixtures.write_node(os.path.join(tmp, "node"), fixtures.lingjun_node(nics=4))
    dp = os.path.join(tmp, "dp")
    kubelet = RealKubelet(dp, binary=binary, klog=os.path.join(tmp, "kubelet.log")).start()
    instances = Instances(tmp, node, dp)
    current, _ = instances.start()
    figures: dict[str, list[float]] = {"plain": [], "slow": []}
    try:
        if not kubelet.wait_registered(RES, timeout=60):
            raise RuntimeError("the first instance did not register")
        for kind in ("plain", "slow"):
            for i in range(runs):
                gap, current = handover(kubelet, instances, current, slow=kind == "slow")
                figures[kind].append(gap)
                print(
                    f"v{version} {kind} {i + 1}/{runs}: longest allocatable 0 = {gap:.1f} ms",
                    file=sys.stderr,
                    flush=True,
                )
    finally:
        if current.poll() is None:
            current.terminate()
            current.wait(30)
        kubelet.close()
        shutil.rmtree(tmp, ignore_errors=True)
    print()
    print(f"### Handover: longest time the kubelet shows allocatable 0 ({VERSIONS[version]}, ms)")
    print()
    print("| what | runs | p50 | p99 | max |")
    print("|---|---|---|---|---|")
    for kind, values in figures.items():
        print(f"| {kind} | {len(values)} | {pct(values, 50):.1f} | {pct(values, 99):.1f} | {max(values):.1f} |")


if __name__ == "__main__":
    raise SystemExit(main())
