"""bench/bench_dra_node.py reads the prepare and unprepare times from the real kubelet's own log lines
(``--vmodule=dra_plugin=4``) and the slice events it watched: the readers pair each call with its own
answer and find the kubelet's wipe among the events. The lines are the v1.37.2 kubelet's, as it wrote
them on the real node (tests/node)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT

sys.path.insert(0, str(ROOT / "bench"))
import bench_dra_node as bench

POD = "8c104545-30c0-40ed-8a4b-d262c8eb6f37"  # the driver's pod: in every line's endpoint
ENDPOINT = f'driverName="rdma.lingjun.io" endpoint="/var/lib/kubelet/plugins/rdma.lingjun.io/dra-{POD}.sock"'
A, B = "329853d9-0a2d-4a54-9ef7-7fee8ec0346a", "11111111-2222-4333-8444-555555555555"


def calling(stamp: str, op: str, uid: str, name: str) -> str:
    line = 97 if op == "NodePrepareResources" else 129
    call = op if op == "NodePrepareResources" else "NodeUnprepareResource"
    return (
        f'I1207 {stamp}   23299 dra_plugin.go:{line}] "Calling {call} rpc" logger="dra-plugin" {ENDPOINT} '
        f'request="claims:{{namespace:\\"rdma-bench\\"  uid:\\"{uid}\\"  name:\\"{name}\\"}}"'
    )


def done(stamp: str, op: str, uid: str) -> str:
    line = 116 if op == "NodePrepareResources" else 148
    return (
        f'I1207 {stamp}   23299 dra_plugin.go:{line}] "Done calling {op} rpc" logger="dra-plugin" {ENDPOINT} '
        f'response="claims:{{key:\\"{uid}\\"  value:{{}}}}" err=null'
    )


def test_each_call_is_paired_with_its_own_answer_not_the_endpoints_pod(tmp_path: Path) -> None:
    log = tmp_path / "kubelet.log"
    log.write_text(
        "\n".join(
            [
                'I1207 16:02:30.000000   23299 kubelet.go:1] "unrelated" x="y"',
                calling("16:02:36.262172", "NodePrepareResources", A, "p2-nic-8nn7k"),
                calling("16:02:36.270000", "NodePrepareResources", B, "p3-nic-abcde"),  # two calls in flight
                done("16:02:36.277330", "NodePrepareResources", A),
                done("16:02:36.300000", "NodePrepareResources", B),
                calling("16:02:39.557181", "NodeUnprepareResources", A, "p2-nic-8nn7k"),
                done("16:02:39.572254", "NodeUnprepareResources", A),
            ]
        )
        + "\n"
    )
    lines = bench.kubelet_lines(log, 0, *bench.RPC_LINES)
    assert len(lines) == 6
    prepare, unprepare = bench.split_calls(lines)
    assert prepare == pytest.approx([0.015158, 0.030000], abs=1e-6)
    assert unprepare == pytest.approx([0.015073], abs=1e-6)
    # From a later offset only what was written after it is read.
    assert bench.kubelet_lines(log, log.stat().st_size, *bench.RPC_LINES) == []


def slice_(name: str, rv: str, generation: int, count: int = 2) -> dict[str, object]:
    return {
        "metadata": {"name": name, "resourceVersion": rv},
        "spec": {"pool": {"generation": generation, "resourceSliceCount": count}},
    }


def test_the_wipe_and_the_rewrite_are_read_from_the_events_as_they_came() -> None:
    """The rewrite can land before the bench looks: the wipe is the first event after the kubelet's
    start that left none of the old slices, the rewrite the first that completed a new generation."""
    old = {"a": slice_("a", "10", 1), "b": slice_("b", "11", 1)}
    watch = bench.SliceWatch.__new__(bench.SliceWatch)
    watch.cond = bench.threading.Condition()
    watch.history = [
        (99.0, dict(old)),
        (100.40, {"b": old["b"]}),  # the kubelet's DeleteCollection, one slice at a time
        (100.41, {}),
        (100.45, {"a": slice_("a", "20", 2)}),  # half of the new generation: not complete
        (100.46, {"a": slice_("a", "20", 2), "b": slice_("b", "21", 2)}),
    ]
    before = frozenset({"10", "11"})
    assert watch.first(100.0, lambda cur: not before & bench.rvs(cur)) == 100.41
    assert watch.first(100.0, lambda cur: bench.complete(cur, before)) == 100.46
    assert not bench.complete(dict(old), before)  # the old generation is not "anew"
    assert bench.complete(dict(old))


def test_a_process_start_is_read_to_the_clock_tick() -> None:
    """The start of a process spawned now lies between the moments before and after the spawn, to one
    clock tick (starttime counts whole ticks). /proc/stat's btime, which the bench used first, is cut
    to whole seconds: it put every start up to 1 s early (0.70 s on the machine that found it)."""
    tick = 1 / os.sysconf("SC_CLK_TCK")
    before = time.time()
    proc = subprocess.Popen(["sleep", "5"])
    after = time.time()
    try:
        start = bench.process_start(proc.pid)
    finally:
        proc.kill()
        proc.wait()
    assert before - tick - 0.002 <= start <= after + 0.002, (before, start, after)
