"""The handover race of issue 30, one trial at a time, against the kubelet's own device manager.

Two plugin instances on one node (a DaemonSet rolling update, the two DaemonSets of a mode switch)
start ``delay`` apart; one of them (or neither) is stalled (SIGSTOP, a CPU-throttled or paused pod)
for a while early on, which shuffles the order in which their Register calls reach the kubelet;
once the stall is over and the pair has settled (one instance registered, the other stood down,
as their liveness files say), the one started first gets SIGTERM, as the DaemonSet controller
deletes the old pod. Which of the two the plugin takes for the newer (the order of their instance
names, :mod:`rdma_device_plugin.sockets`) can differ from the order they were started in when they
start milliseconds apart: then the instance that stays is the one that stood down, and must serve
again. Either way the outcome must be the same.

What a trial measures, from the kubelet's own record (every change of allocatable, 2 ms polling):
the total time the resource spent below its count after first reaching it, and how long after the
SIGTERM it took to be back at its count (and stay there). It then admits a pod: the
endpoint the kubelet holds must answer Allocate. The tests run a few trials, bench/bench_handover.py
a hundred; both through :func:`race_trial`. The timers here inject the faults; what is judged comes
from the kubelet's record.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rdma_node import fixtures

from .plugin import serve_command
from .real import RealKubelet

RES = "rdma/hca"
COUNT = 1000  # the default config's shared devices
SETTLE_SECONDS = 1.0  # watched after the older instance exited: anything below the count in it counts
WAIT_SECONDS = 60.0  # for a registration under load (a bound on waiting, never a figure)


@dataclass(frozen=True)
class Plan:
    """One trial's faults: the newer instance starts ``delay_ms`` after the older; ``stalled`` ("old",
    "new" or "") is stopped ``stall_at_ms`` after the newer one started, for ``stall_ms``."""

    delay_ms: float
    stalled: str
    stall_at_ms: float
    stall_ms: float

    @staticmethod
    def draw(rng: random.Random, max_delay_ms: float = 50.0, max_stall_ms: float = 3000.0) -> Plan:
        return Plan(
            round(rng.uniform(0, max_delay_ms), 1),
            rng.choice(("old", "new", "")),
            round(rng.uniform(0, 500), 1),
            round(rng.uniform(0, max_stall_ms), 1),
        )


@dataclass(frozen=True)
class Trial:
    plan: Plan
    below_ms: float  # total time below the count after first reaching it, to the end of the watch
    back_ms: float | None  # from SIGTERM to the first-started instance to the count for good (None: never)
    allocate_ok: bool  # a pod admitted at the end got its devices
    logs: tuple[str, str]  # the two instances' log files

    @property
    def ok(self) -> bool:
        return self.back_ms is not None and self.back_ms <= SETTLE_SECONDS * 1000 and self.allocate_ok


def below_count(transitions: Sequence[Mapping[str, Any]], resource: str, count: int, until_ms: float) -> float:
    """Milliseconds ``resource`` spent below ``count`` (absent, or no kubelet running, counts as
    below) in a ``record_stop``, from the first time it reached ``count`` to ``until_ms``."""
    total = 0.0
    reached = False
    below_since: float | None = None
    for t in transitions:
        at = t.get("allocatable", {}).get(resource, 0) if t.get("running", True) else 0
        if at >= count:
            reached = True
            if below_since is not None:
                total += float(t["ms"]) - below_since
                below_since = None
        elif reached and below_since is None:
            below_since = float(t["ms"])
    if below_since is not None:
        total += until_ms - below_since
    return total


def back_at_count(transitions: Sequence[Mapping[str, Any]], resource: str, count: int, since_ms: float) -> float | None:
    """Milliseconds from ``since_ms`` until ``resource`` was at ``count`` for the rest of the record
    (0 when it already was), or None when it ends below."""
    back: float | None = since_ms
    for t in transitions:
        at = t.get("allocatable", {}).get(resource, 0) if t.get("running", True) else 0
        if at >= count:
            if back is None:
                back = max(since_ms, float(t["ms"]))
        else:
            back = None
    return None if back is None else back - since_ms


def _health(health_file: str) -> dict[str, Any]:
    try:
        with open(health_file, encoding="utf-8") as fh:
            found: dict[str, Any] = json.load(fh)
            return found
    except (OSError, ValueError):
        return {}


def settled(first: Mapping[str, Any], second: Mapping[str, Any]) -> bool:
    """One instance registered, the other stood down (liveness files)."""
    return any(
        RES in a.get("registered", []) and RES in b.get("stood_down", []) for a, b in ((first, second), (second, first))
    )


def _wait(predicate: Any, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def race_trial(binary: str, node: fixtures.FixtureNode, tmp: str, plan: Plan, name: str = "t") -> Trial:
    """One trial in ``tmp`` (a short path: socket paths < 108 bytes), a fresh kubelet of its own."""
    dp = os.path.join(tmp, f"{name}.dp")
    kubelet = RealKubelet(dp, binary=binary, klog=os.path.join(tmp, f"{name}.klog")).start()
    procs: list[subprocess.Popen[bytes]] = []
    logs = (os.path.join(tmp, f"{name}.old.log"), os.path.join(tmp, f"{name}.new.log"))
    health = (os.path.join(tmp, f"{name}.old.health"), os.path.join(tmp, f"{name}.new.health"))

    def start(i: int) -> subprocess.Popen[bytes]:
        status = os.path.join(tmp, f"{name}.{i}.status.json")
        cmd = serve_command(node, dp, "--health-file", health[i], "--status-file", status)
        with open(logs[i], "wb") as fh:
            return subprocess.Popen(
                cmd, stdout=fh, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"}
            )

    stall_done = threading.Event()
    try:
        kubelet.record_start()
        t0 = time.monotonic()
        procs.append(start(0))
        time.sleep(plan.delay_ms / 1000)
        procs.append(start(1))
        victim = {"old": procs[0], "new": procs[1]}.get(plan.stalled)

        def stall() -> None:
            if victim is not None:
                victim.send_signal(signal.SIGSTOP)
                time.sleep(plan.stall_ms / 1000)
                victim.send_signal(signal.SIGCONT)
            stall_done.set()

        timer = threading.Timer(plan.stall_at_ms / 1000, stall)
        timer.start()
        stall_done.wait(WAIT_SECONDS)
        if not _wait(lambda: settled(_health(health[0]), _health(health[1])), WAIT_SECONDS):
            raise RuntimeError(f"the two instances did not settle (one registered, one stood down); see {logs}")
        signalled_ms = (time.monotonic() - t0) * 1000
        procs[0].terminate()
        procs[0].wait(WAIT_SECONDS)
        time.sleep(SETTLE_SECONDS)
        record = kubelet.record_stop()
        end_ms = float(record["ms"])
        transitions = record["transitions"]
        admitted = kubelet.admit(f"{name}-pod", {"main": {RES: 1}})
        return Trial(
            plan,
            round(below_count(transitions, RES, COUNT, end_ms), 1),
            None if (b := back_at_count(transitions, RES, COUNT, signalled_ms)) is None else round(b, 1),
            bool(admitted.get("ok")),
            logs,
        )
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proc.terminate()
                try:
                    proc.wait(WAIT_SECONDS)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        kubelet.close()
