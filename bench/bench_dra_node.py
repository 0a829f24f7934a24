#!/usr/bin/env python3
"""The DRA driver's figures on the real node: the kubelet, containerd and runc of scripts/real_node.py
(the pinned modules), the v1.37.2 control plane, the driver deployed by the chart (`driver=dra`) and
running as its pod, with its own ServiceAccount token, under the chart's securityContext. Nothing is
asserted here (the tests are tests/node/test_real_node.py and plugin_src/tests/test_dra_cluster.py);
bench/bench_dra.py gives the same figures on the kubelet-managers stand-in.

- start -> slices, as the node sees a driver arrive: the driver's pod removed from the node (its node
  label dropped) and the node's slices deleted, the label set again; from the moment the driver's
  process starts (its start time in /proc) to both slices of a new generation in the API server (a
  watch stamps each event as it arrives), and to the kubelet's registration of the driver.
- start -> ready, as a rolling update sees it: the driver's pod deleted and replaced by the DaemonSet
  (its slices stay); from the new process's start to the pod Ready (registered, slices current).
- kubelet restart: the kubelet stopped and started; it deletes every slice of its node as it starts
  (pkg/kubelet/cm/dra/plugin/dra_plugin_manager.go, ``wipeResourceSlices``), the driver writes them
  anew. From the kubelet's start to the wipe, and to both slices written anew.
- prepare / unprepare as the kubelet's DRA manager calls them: pods with one claim each (a shared NIC,
  through a ResourceClaimTemplate), created in batches and deleted again; each call's time is read
  from the kubelet's own log (``--vmodule=dra_plugin=4``: "Calling NodePrepareResources rpc" and
  "Done calling ...", microsecond stamps), the consumer's view of the call (the kubelet's
  dra_grpc_operations_duration_seconds histogram starts at 0.1 s, too coarse for this).
- the driver's memory (VmRSS, VmHWM, threads of its process) after those;
- the driver's API requests at rest, from the API server's audit log (its ServiceAccount's user).

    .venv/bin/python bench/bench_dra_node.py [--pods 100] [--batch 10] [--starts 5] [--rest-seconds 330] \\
        [--write-results bench/RESULTS.md]

Needs what make node-up needs (make setup system-deps kube; root). Takes about 10 minutes and the
rest window; one real node per machine: do not run it beside make test-node.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "plugin_src" / "tests"))

import bench_dra  # noqa: E402
import dra_support as ds  # noqa: E402
import report  # noqa: E402
from kube_cluster import Cluster  # noqa: E402
from real_node import RealNode  # noqa: E402

NODE = "rdma-node-0"
LABELS = {"alibabacloud.com/lingjun-worker": "true"}
NS = "rdma-bench"
CHART = ROOT / "charts" / "rdma-device-plugin"
RELEASE = "rdma"
SA_USER = "system:serviceaccount:kube-system:rdma-rdma-device-plugin"
NIC_CLASS = f"nic.{ds.DRIVER}"  # the chart's DeviceClass of a shared NIC
DRIVER_SELECTOR = "app.kubernetes.io/component=dra-driver"

AUDIT_POLICY = f"""apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: [RequestReceived]
rules:
  - level: Metadata
    users: ["{SA_USER}"]
  - level: None
"""

# klog's text header: I1207 16:10:11.123456   12345 dra_plugin.go:97] "msg" ...
KLOG = re.compile(r"^[IWE](\d{2})(\d{2}) (\d{2}):(\d{2}):(\d{2})\.(\d{6})\s+\d+ (\S+)\] \"([^\"]*)\"(.*)$")
UID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


# ------------------------------------------------------------------ figures


def row(start: str, figure: str, values: Sequence[float]) -> str:
    return f"| {start} | {figure} | " + " | ".join(f"{v:.2f}" for v in values) + " |"


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def ms(values: list[float]) -> str:
    if not values:
        return "0 | | | "
    p50, p99, top = statistics.median(values) * 1000, pct(values, 0.99) * 1000, max(values) * 1000
    return f"{len(values)} | {p50:.2f} | {p99:.2f} | {top:.2f}"


# ------------------------------------------------------------------ the node's processes


def boot_time() -> float:
    """The wall-clock time of the boot: /proc/stat's ``btime`` is cut to whole seconds (up to 1 s early;
    it made every start figure of this bench 0.7 s long here). The wall clock read between two reads
    of CLOCK_BOOTTIME, the closest pair of a few: a preemption between the reads cannot skew it."""
    best = (float("inf"), 0.0)
    for _ in range(5):
        b1 = time.clock_gettime(time.CLOCK_BOOTTIME)
        wall = time.time()
        b2 = time.clock_gettime(time.CLOCK_BOOTTIME)
        best = min(best, (b2 - b1, wall - (b1 + b2) / 2))
    return best[1]


def _stat(pid: int) -> list[str]:
    """/proc/<pid>/stat's fields after the command name (which may hold spaces): state is [0]."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def process_start(pid: int) -> float:
    """The wall-clock time a process started: its starttime in /proc (clock ticks of CLOCK_BOOTTIME
    since the boot, 1/CLK_TCK resolution). For a container's process that is runc create's fork of
    its init, which execs the entrypoint at runc start: an upper bound for the figures from it."""
    return boot_time() + int(_stat(pid)[19]) / os.sysconf("SC_CLK_TCK")


def driver_pids() -> list[int]:
    """The DRA driver's processes (`rdma-device-plugin dra ... --driver-name ...` in its container)."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            argv = (d / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"dra" in argv and b"--driver-name" in argv:
            out.append(int(d.name))
    return out


def pod_uid(pid: int) -> str:
    """The pod UID of a containerized process (the kubelet's cgroupfs path: .../pod<uid>/<container>)."""
    m = re.search(r"/pod([0-9a-f-]{36})/", Path(f"/proc/{pid}/cgroup").read_text().replace("_", "-"))
    if not m:
        raise RuntimeError(f"process {pid} is in no pod's cgroup")
    return m.group(1)


def status_kb(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0


def cpu_seconds(pid: int) -> float:
    """User + system CPU time a process has used (/proc/<pid>/stat utime and stime, in clock ticks)."""
    fields = _stat(pid)
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# ------------------------------------------------------------------ the node's slices, watched


class SliceWatch:
    """The node's ResourceSlices of the driver as the API server's watch reports them, each event
    stamped (time.time()) as it arrives; waiters are woken by the event that satisfies them."""

    def __init__(self, api: ds.Api, node: str) -> None:
        self.api = api
        self.query = {"fieldSelector": f"spec.nodeName={node},spec.driver={ds.DRIVER}"}
        self.current: dict[str, dict[str, Any]] = {}
        self.changed = time.time()
        self.history: list[tuple[float, dict[str, dict[str, Any]]]] = []  # (time, the slices after an event)
        self.cond = threading.Condition()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="slice-watch", daemon=True)

    def start(self) -> SliceWatch:
        self.thread.start()
        self.wait("the first list", lambda cur: True)
        return self

    def _list(self) -> str:
        listing = self.api.get(ds.SLICES, **self.query)
        with self.cond:
            self.current = {s["metadata"]["name"]: s for s in listing["items"]}
            self.changed = time.time()
            self.cond.notify_all()
        return str(listing["metadata"]["resourceVersion"])

    def _run(self) -> None:
        rv = self._list()
        while not self.stop.is_set():
            try:
                for ev in self.api.client.watch(ds.SLICES, {**self.query, "resourceVersion": rv}, self.stop):
                    t, kind, obj = time.time(), ev["type"], ev["object"]
                    if kind == "ERROR":  # 410 Gone: list again
                        rv = self._list()
                        break
                    rv = obj["metadata"]["resourceVersion"]
                    if kind == "BOOKMARK":
                        continue
                    with self.cond:
                        if kind == "DELETED":
                            self.current.pop(obj["metadata"]["name"], None)
                        else:
                            self.current[obj["metadata"]["name"]] = obj
                        self.changed = t
                        self.history.append((t, dict(self.current)))
                        self.cond.notify_all()
            except OSError:
                if not self.stop.is_set():
                    rv = self._list()

    def wait(self, what: str, pred: Callable[[dict[str, dict[str, Any]]], bool], timeout: float = 120.0) -> float:
        """The time of the event after which ``pred`` holds (at once if it holds now)."""
        deadline = time.monotonic() + timeout
        with self.cond:
            while not pred(self.current):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"{what}: not within {timeout:.0f} s; slices {sorted(self.current)}")
                self.cond.wait(left)
            return self.changed

    def first(self, since: float, pred: Callable[[dict[str, dict[str, Any]]], bool]) -> float:
        """The time of the first event at or after ``since`` after which ``pred`` held."""
        with self.cond:
            return next(t for t, cur in self.history if t >= since and pred(cur))

    def versions(self) -> frozenset[str]:
        with self.cond:
            return frozenset(s["metadata"]["resourceVersion"] for s in self.current.values())

    def close(self) -> None:
        self.stop.set()
        self.api.client.close_watches()


def rvs(cur: dict[str, dict[str, Any]]) -> set[str]:
    return {s["metadata"]["resourceVersion"] for s in cur.values()}


def complete(cur: dict[str, dict[str, Any]], not_in: frozenset[str] = frozenset()) -> bool:
    """The pool's newest generation complete (every slice it counts), none of ``not_in``'s versions."""
    if not cur:
        return False
    top = max(s["spec"]["pool"]["generation"] for s in cur.values())
    gen = [s for s in cur.values() if s["spec"]["pool"]["generation"] == top]
    fresh = not rvs({s["metadata"]["name"]: s for s in gen}) & not_in
    return fresh and len(gen) == gen[0]["spec"]["pool"]["resourceSliceCount"]


# ------------------------------------------------------------------ the kubelet's log


def klog_time(m: re.Match[str], year: int) -> float:
    mon, day, hh, mm, ss, us = (int(m.group(i)) for i in range(1, 7))
    return datetime(year, mon, day, hh, mm, ss, us).astimezone().timestamp()


def kubelet_lines(log: Path, start: int, *needles: str) -> list[tuple[float, str, str]]:
    """(time, message, rest) of the kubelet's log lines after byte ``start`` whose message is one of
    ``needles``; klog stamps in local time without a year."""
    year = datetime.now().year
    out = []
    with log.open("rb") as fh:
        fh.seek(start)
        for raw in fh:
            line = raw.decode(errors="replace").rstrip("\n")
            m = KLOG.match(line)
            if m and m.group(8) in needles:
                out.append((klog_time(m, year), m.group(8), m.group(9)))
    return out


RPC_LINES = (
    "Calling NodePrepareResources rpc",
    "Done calling NodePrepareResources rpc",
    "Calling NodeUnprepareResource rpc",
    "Done calling NodeUnprepareResources rpc",
)


def rpc_durations(lines: list[tuple[float, str, str]]) -> list[float]:
    """Per claim UID: its "Done calling" minus its "Calling" (one claim per call here). The UID is the
    request's or the response's: every line's endpoint names the driver's pod UID too."""
    begun: dict[str, float] = {}
    took = []
    for t, msg, rest in lines:
        uid = UID.search(rest.split("request=", 1)[-1].split("response=", 1)[-1])
        if not uid:
            continue
        if msg.startswith("Calling"):
            begun[uid.group(0)] = t
        elif uid.group(0) in begun:
            took.append(t - begun.pop(uid.group(0)))
    return took


def split_calls(lines: list[tuple[float, str, str]]) -> tuple[list[float], list[float]]:
    """(NodePrepareResources, NodeUnprepareResources) call times of the kubelet's log lines."""
    unprepare = [x for x in lines if "Unprepare" in x[1]]
    return rpc_durations([x for x in lines if x not in unprepare]), rpc_durations(unprepare)


# ------------------------------------------------------------------ the bench


class Bench:
    def __init__(self, work: Path, sets: Sequence[str] = ()) -> None:
        self.sets = list(sets)
        (work / "audit.yaml").write_text(AUDIT_POLICY)
        self.cluster = Cluster(work / "cl", audit_policy=work / "audit.yaml")
        self.node = RealNode(self.cluster, NODE, LABELS, kubelet_flags=["--vmodule=dra_plugin=4"])
        self.api: ds.Api | None = None
        self.watch: SliceWatch | None = None

    def kubectl(self, *args: str, input: str | None = None) -> str:
        r = self.cluster.kubectl(*args, input=input)
        if r.returncode != 0:
            raise RuntimeError(f"kubectl {' '.join(args)}: {r.stderr.strip()}")
        return str(r.stdout)

    def helm(self, *sets: str) -> None:
        argv = [str(self.node.bin / "helm"), "--kubeconfig", str(self.cluster.kubeconfig), "upgrade", "--install"]
        argv += [RELEASE, str(CHART), "-n", "kube-system", "-f", str(self.node.values_file)]
        for s in ("driver=dra", "minReadySeconds=0", "logFormat=json", *self.sets, *sets):  # json: the phases
            argv += ["--set", s]
        subprocess.run([*argv, "--wait", "--timeout", "300s"], check=True, capture_output=True, text=True)

    def up(self) -> None:
        self.cluster.up()
        self.node.up()
        self.api = ds.Api(self.cluster.kubeconfig)
        self.kubectl("create", "namespace", NS)
        self.kubectl("label", "namespace", NS, "rdma.lingjun.io/tenant=true")
        self.helm()
        self.watch = SliceWatch(self.api, NODE).start()
        self.watch.wait("the driver's slices", complete, timeout=180)

    def driver_pod(self) -> dict[str, Any] | None:
        items = json.loads(self.kubectl("get", "pods", "-n", "kube-system", "-l", DRIVER_SELECTOR, "-o", "json"))
        live = [p for p in items["items"] if not p["metadata"].get("deletionTimestamp")]
        return live[0] if live else None

    def new_driver_pid(self, old: set[int], timeout: float = 180.0) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            new = [p for p in driver_pids() if p not in old]
            if new:
                return min(new)
            time.sleep(0.005)
        raise TimeoutError("no new driver process")

    def registered(self, uid: str, start: int, timeout: float = 120.0) -> float:
        """When the kubelet connected to the driver of pod ``uid`` (its log: "Connection changed" to the
        pod's per-instance socket, connected=true)."""
        log = self.node.logs / "kubelet.log"

        def seen() -> float | None:
            for t, _msg, rest in kubelet_lines(log, start, "Connection changed"):
                if f"dra-{uid}.sock" in rest and "connected=true" in rest:
                    return t
            return None

        return ds.wait_for(f"the kubelet connected to the driver of pod {uid}", seen, timeout=timeout, every=0.05)

    def log_size(self) -> int:
        return (self.node.logs / "kubelet.log").stat().st_size

    def ready(self) -> bool:
        pod = self.driver_pod()
        conds = {c["type"]: c["status"] for c in (pod or {}).get("status", {}).get("conditions", [])}
        return conds.get("Ready") == "True"

    def driver_log(self) -> list[tuple[float, dict[str, Any]]]:
        """The driver pod's JSON log records with their time (the driver stamps milliseconds, UTC)."""
        pod = self.driver_pod()
        assert pod is not None
        out = []
        for line in self.kubectl("logs", "-n", "kube-system", pod["metadata"]["name"]).splitlines():
            with contextlib.suppress(ValueError, KeyError):
                rec = json.loads(line)
                stamp = datetime.strptime(rec["ts"], "%Y-%m-%dT%H:%M:%S.%fZ")
                out.append((stamp.replace(tzinfo=UTC).timestamp(), dict(rec)))
        return out

    def phases(self, t0: float) -> tuple[float, float]:
        """From the process start: the driver's first log line ("starting the DRA driver": the interpreter,
        the imports, the config and the driver built) and its own "first ResourceSlices in the API"."""
        lines = self.driver_log()
        first = next(t for t, rec in lines if rec["msg"] == "starting the DRA driver")
        written = next(t for t, rec in lines if rec["msg"] == "first ResourceSlices in the API")
        return first - t0, written - t0

    def arrivals(self, n: int) -> list[tuple[float, float, float, float]]:
        """The driver arriving on a node without its slices: process start -> (both slices written, the
        kubelet connected to it, the driver's first log line, its own "first slices" line)."""
        assert self.watch is not None and self.api is not None
        out = []
        for _ in range(n):
            self.kubectl("label", "node", NODE, "alibabacloud.com/lingjun-worker-")
            ds.wait_for("the driver gone", lambda: not driver_pids() and self.driver_pod() is None, timeout=120)
            for s in self.api.slices(NODE):
                with ds.kubeapi.suppress_not_found():
                    self.api.client.delete(f"{ds.SLICES}/{s['metadata']['name']}")
            self.watch.wait("no slices", lambda cur: not cur)
            mark = self.log_size()
            self.kubectl("label", "node", NODE, "alibabacloud.com/lingjun-worker=true")
            pid = self.new_driver_pid(set())
            t0 = process_start(pid)
            written = self.watch.wait("slices written", complete) - t0
            connected = self.registered(pod_uid(pid), mark) - t0
            ds.wait_for("the driver Ready", self.ready, timeout=120, every=0.1)
            out.append((written, connected, *self.phases(t0)))
        return out

    def replacements(self, n: int) -> list[tuple[float, float]]:
        """The driver's pod replaced (its slices stay): process start -> (the kubelet connected to it,
        the new pod Ready)."""
        out = []
        for _ in range(n):
            pod = self.driver_pod()
            assert pod is not None
            old = set(driver_pids())
            mark = self.log_size()
            self.kubectl("delete", "pod", "-n", "kube-system", pod["metadata"]["name"], "--wait=false")
            pid = self.new_driver_pid(old)
            t0 = process_start(pid)
            connected = self.registered(pod_uid(pid), mark) - t0
            ds.wait_for("the new pod Ready", lambda p=pid: self.ready() and set(driver_pids()) == {p}, every=0.02)
            out.append((connected, time.time() - t0))
        return out

    def kubelet_restarts(self, n: int) -> list[tuple[float, float]]:
        """(kubelet start -> its wipe of the node's slices, kubelet start -> both written anew)."""
        assert self.watch is not None
        out = []
        for _ in range(n):
            before = self.watch.versions()
            self.node.stop_kubelet()
            t0 = time.time()
            self.node.start_kubelet()
            anew = self.watch.wait("slices anew", lambda cur, b=before: complete(cur, b))
            # From the events: the first after which none of the old slices was left (the wipe).
            wiped = self.watch.first(t0, lambda cur, b=before: not b & rvs(cur))
            out.append((wiped - t0, anew - t0))
            self.node.wait_ready()
            ds.wait_for("the driver Ready", self.ready, timeout=120, every=0.1)
        return out

    def pods(self) -> list[dict[str, Any]]:
        return list(json.loads(self.kubectl("get", "pods", "-n", NS, "-o", "json"))["items"])

    def ready_pods(self) -> int:
        return sum(
            1
            for p in self.pods()
            if any(c["type"] == "Ready" and c["status"] == "True" for c in p.get("status", {}).get("conditions", []))
        )

    def prepares(self, pods: int, batch: int) -> tuple[list[float], list[float], dict[str, list[float]]]:
        """The kubelet's prepare and unprepare calls (its log), and from each "claim prepared" line of
        the driver: its part of the prepare ("seconds"), its thread's CPU in it ("cpu_seconds") and the
        time in its API reads ("api_seconds"), in seconds."""
        template = {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaimTemplate",
            "metadata": {"name": "one-nic", "namespace": NS},
            "spec": {
                "spec": {"devices": {"requests": [{"name": "nic", "exactly": {"deviceClassName": f"nic.{ds.DRIVER}"}}]}}
            },
        }
        self.kubectl("apply", "-f", "-", input=json.dumps(template))
        image = str(dict(self.node.state()["images"])["pause"])  # type: ignore[call-overload]
        log = self.node.logs / "kubelet.log"
        start = log.stat().st_size
        done = 0
        while done < pods:
            names = [f"p{done + i}" for i in range(min(batch, pods - done))]
            manifests = [pod_manifest(n, image) for n in names]
            self.kubectl(
                "create", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": manifests})
            )
            want = len(names)
            ds.wait_for(f"{want} pods Ready", lambda w=want: self.ready_pods() == w, timeout=900, every=1)
            self.kubectl("delete", "pods", "-n", NS, "--all", "--wait=false")
            ds.wait_for("the pods gone", lambda: not self.pods(), timeout=900, every=1)
            done += len(names)

        def all_unprepared() -> list[tuple[float, str, str]] | None:
            # The kubelet may delete a pod's object before it unprepares its claims.
            got = kubelet_lines(log, start, *RPC_LINES)
            return got if sum(1 for x in got if x[1] == RPC_LINES[3]) >= pods else None

        lines = ds.wait_for("every claim unprepared", all_unprepared, timeout=300, every=1)
        prep, unprep = split_calls(lines)
        records = [
            rec
            for _, rec in self.driver_log()
            if rec["msg"] == "claim prepared" and str(rec.get("claim", "")).startswith(f"{NS}/")
        ]
        parts = {k: [float(rec[k]) for rec in records if k in rec] for k in ("seconds", "cpu_seconds", "api_seconds")}
        return prep, unprep, parts

    def at_rest(self, seconds: float) -> dict[str, int]:
        return bench_dra.at_rest(self.cluster, seconds, lambda e: e.get("user", {}).get("username") == SA_USER)

    def down(self) -> None:
        if self.watch is not None:
            self.watch.close()
        left = self.node.down()
        self.cluster.down()
        if left:
            print(f"the node left: {left}", file=sys.stderr)


def pod_manifest(name: str, image: str) -> dict[str, Any]:
    """A claim pod the chart's admission policy admits (hostNetwork, IPC_LOCK only), doing nothing."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NS},
        "spec": {
            "hostNetwork": True,
            "terminationGracePeriodSeconds": 0,
            "resourceClaims": [{"name": "nic", "resourceClaimTemplateName": "one-nic"}],
            "containers": [
                {
                    "name": "main",
                    "image": image,
                    "securityContext": {"capabilities": {"drop": ["ALL"], "add": ["IPC_LOCK"]}},
                    "resources": {"claims": [{"name": "nic"}]},
                }
            ],
        },
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pods", type=int, default=100, help="pods with one claim each")
    ap.add_argument("--batch", type=int, default=10, help="pods created at once (then deleted) until --pods")
    ap.add_argument("--starts", type=int, default=5)
    ap.add_argument("--rest-seconds", type=float, default=330.0, help="the window at rest (a watch lasts 300 s)")
    ap.add_argument("--write-results", metavar="FILE")
    ap.add_argument("--keep", action="store_true", help="leave the cluster and node up (in the printed dir)")
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a chart value (helm --set), e.g. resources.requests.cpu=250m",
    )
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="rdra-node-bench-", dir="/tmp"))
    bench = Bench(work, args.set)
    load0 = os.getloadavg()
    try:
        print("[1/6] control plane, real node, the chart with driver=dra", flush=True)
        bench.up()
        print(f"[2/6] the driver arriving on the node x{args.starts}", flush=True)
        arrivals = bench.arrivals(args.starts)
        print(f"[3/6] the driver's pod replaced x{args.starts}", flush=True)
        replaced = bench.replacements(args.starts)
        print(f"[4/6] kubelet restarts x{args.starts}", flush=True)
        restarts = bench.kubelet_restarts(args.starts)
        print(f"[5/6] {args.pods} claim pods prepared and unprepared by the kubelet", flush=True)
        pid = driver_pids()[0]
        cpu0 = cpu_seconds(pid)
        prep, unprep, parts = bench.prepares(args.pods, args.batch)
        cpu = cpu_seconds(pid) - cpu0
        rss, hwm, threads = status_kb(pid, "VmRSS"), status_kb(pid, "VmHWM"), status_kb(pid, "Threads")
        anon, files = status_kb(pid, "RssAnon"), status_kb(pid, "RssFile")
        print(f"[6/6] at rest for {args.rest_seconds:.0f} s", flush=True)
        rest = bench.at_rest(args.rest_seconds)
    finally:
        if args.keep:
            print(f"left up: {work}")
        else:
            bench.down()
            shutil.rmtree(work, ignore_errors=True)
    load1 = os.getloadavg()
    (arr_w, arr_c, arr_log, arr_own), (rep_c, rep_r) = (
        list(zip(*arrivals, strict=True)),
        list(zip(*replaced, strict=True)),
    )
    lines = [
        "## DRA driver on the real node (bench/bench_dra_node.py)",
        "",
        (
            f"Command: `.venv/bin/python bench/bench_dra_node.py --pods {args.pods} --batch {args.batch} "
            f"--starts {args.starts} --rest-seconds {args.rest_seconds:.0f}"
            + "".join(f" --set {v}" for v in args.set)
            + f"`; load average {load0[0]:.2f} at start, {load1[0]:.2f} at the "
            f"end ({os.cpu_count()} cores). Kubernetes v1.37.2: the control plane and a real node (kubelet, "
            "containerd, runc of scripts/real_node.py) with the fixture Lingjun node (4 bonded NICs); the chart "
            "with `driver=dra`, the driver in its pod with its ServiceAccount token."
        ),
        "",
        "### Start -> ResourceSlices in the API server (s)",
        "",
        "| start | figure | " + " | ".join(str(i + 1) for i in range(args.starts)) + " |",
        "|---|---|" + "---|" * args.starts,
        row("the driver arrives (node label set, no slices)", "process start -> both slices in the API", arr_w),
        row("the driver arrives", "process start -> its first log line (interpreter, imports, config, built)", arr_log),
        row("the driver arrives", "process start -> its own 'first ResourceSlices' line", arr_own),
        row("the driver arrives", "process start -> the kubelet connected to it", arr_c),
        row("the driver's pod replaced (slices stay)", "process start -> the kubelet connected to it", rep_c),
        row("the driver's pod replaced", "process start -> pod Ready (readiness probe every 5 s)", rep_r),
        row("kubelet restart", "kubelet start -> its wipe of the node's slices", [w for w, _ in restarts]),
        row("kubelet restart", "kubelet start -> both slices written anew", [a for _, a in restarts]),
        row("kubelet restart", "the wipe -> both written anew (the driver's part)", [a - w for w, a in restarts]),
        "",
        "### NodePrepareResources / NodeUnprepareResources as the kubelet calls them (ms)",
        "",
        f"One claim per pod and call, {args.batch} pods created at once; the kubelet's own log",
        "(`--vmodule=dra_plugin=4`) stamps the call and its answer. A prepare reads the claim and its pod",
        "from the API server and writes a CDI spec and a record.",
        "",
        "| call | calls | p50 | p99 | max |",
        "|---|---|---|---|---|",
        f"| NodePrepareResources | {ms(prep)} |",
        f"| the driver's part of it (its log: the claim's read, the pod's, the spec and record written) "
        f"| {ms(parts['seconds'])} |",
        f"| in that part: its API reads (the claim's, the pod's; sent to answered and decoded) "
        f"| {ms(parts['api_seconds'])} |",
        f"| in that part: the CPU time of the driver's thread (the rest is waiting) | {ms(parts['cpu_seconds'])} |",
        f"| NodeUnprepareResources | {ms(unprep)} |",
        "",
        (
            f"The driver's CPU time over those {len(prep)} pods: {cpu:.2f} s, "
            f"{cpu / max(1, len(prep)) * 1000:.1f} ms a pod (its prepare and unprepare, and its loops "
            "meanwhile). The calls of one batch share one Python interpreter (the GIL), and the node's "
            f"{os.cpu_count()} cores with the control plane, the kubelet, containerd and runc starting those pods."
        ),
        "",
        "### Memory",
        "",
        (
            f"VmRSS {rss / 1024:.1f} MiB (RssAnon {anon / 1024:.1f}, RssFile {files / 1024:.1f}: shared libraries' "
            f"pages), VmHWM {hwm / 1024:.1f} MiB, {threads} threads: the driver's process in its container, after "
            f"{len(prep)} claims prepared and unprepared."
        ),
        "",
        *bench_dra.rest_lines(rest, args.rest_seconds, f"user `{SA_USER}`"),
    ]
    text = "\n".join(lines)
    print("\n" + text)
    if args.write_results:
        report.write_section(args.write_results, "bench_dra_node.py", text, after="<!-- bench_dra.py output: end -->")
    return 0


if __name__ == "__main__":
    sys.exit(main())
