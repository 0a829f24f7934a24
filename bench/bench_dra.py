#!/usr/bin/env python3
"""The DRA driver's figures against the real v1.37.2 components (nothing asserted; the tests are in
plugin_src/tests/test_dra_cluster.py):

- start -> slices: ``rdma-device-plugin dra`` spawned -> both ResourceSlices of a new generation in the
  API server (first start, then restarts of the driver, whose slices are there and get rewritten);
- prepare: NodePrepareResources for one claim, called over the driver's socket as the kubelet calls it,
  for claims the real scheduler allocated (a shared NIC each): fresh (claim read from the API, CDI spec
  and record written), again (idempotent: from the record), and NodeUnprepareResources;
- RSS of the driver (VmRSS, VmHWM) after those;
- API requests of the driver at rest (nothing changes on the node): counted by verb in the API
  server's audit log (user agent ``rdma-device-plugin-dra``) over ``--rest-seconds``.

    .venv/bin/python bench/bench_dra.py [--claims 200] [--starts 5] [--rest-seconds 330] \\
        [--write-results bench/RESULTS.md]
    .venv/bin/python bench/bench_dra.py --only-rest [--rest-seconds 330]   # the requests at rest alone, printed
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "plugin_src" / "tests"))

import dra_support as ds  # noqa: E402
import report  # noqa: E402

from rdma_device_plugin.api import dra_v1_pb2 as pb  # noqa: E402
from rdma_device_plugin.api import dra_v1_pb2_grpc as pb_grpc  # noqa: E402

PLUGIN_END = "<!-- bench_plugin.py output: end -->"


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def ms(values: list[float]) -> str:
    p50, p99, top = statistics.median(values) * 1000, pct(values, 0.99) * 1000, max(values) * 1000
    return f"{len(values)} | {p50:.2f} | {p99:.2f} | {top:.2f}"


def status_kb(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0


def pool_versions(api: ds.Api, node: str) -> frozenset[str]:
    """The resourceVersions of the pool's newest complete generation (empty while incomplete)."""
    slices = api.slices(node)
    if not slices:
        return frozenset()
    top = max(s["spec"]["pool"]["generation"] for s in slices)
    current = [s for s in slices if s["spec"]["pool"]["generation"] == top]
    if len(current) != current[0]["spec"]["pool"]["resourceSliceCount"]:
        return frozenset()
    return frozenset(s["metadata"]["resourceVersion"] for s in current)


def start_to_slices(api: ds.Api, node: ds.DraNode, starts: int) -> list[tuple[str, float]]:
    """Spawn -> the pool complete in the API, each start on a node without the driver's slices (the
    first start; the driver stopped and its slices deleted before each restart: a driver finding its
    slices there rewrites nothing), then kubelet start (which deletes every slice of its node) -> the
    pool complete again, the driver running."""
    out = []
    for i in range(starts):
        node.stop_driver()
        for s in api.slices(node.name):
            with ds.kubeapi.suppress_not_found():
                api.client.delete(f"{ds.SLICES}/{s['metadata']['name']}")
        ds.wait_for("no slices", lambda: not api.slices(node.name), every=0.01)
        t0 = time.monotonic()
        node.start_driver()
        ds.wait_for("slices written", lambda: pool_versions(api, node.name), every=0.01)
        out.append(("first start" if i == 0 else "restart, slices deleted", time.monotonic() - t0))

        def registered(n: int = i + 1) -> bool:
            return sum(1 for r in node.log_lines() if r.get("msg") == "registered with the kubelet") >= n

        ds.wait_for("the kubelet's registration", registered)
    for _ in range(starts):
        before = pool_versions(api, node.name)
        node.node.crash()
        t0 = time.monotonic()
        node.node.start()  # deletes the node's slices at its start

        def anew(b: frozenset[str] = before) -> bool:
            v = pool_versions(api, node.name)
            return bool(v) and not v & b

        ds.wait_for("slices written anew after the kubelet's start", anew, every=0.01)
        out.append(("kubelet restart", time.monotonic() - t0))
    return out


AUDIT_POLICY = """apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: [RequestReceived]
rules:
  - level: Metadata
    userGroups: ["system:masters"]
  - level: None
"""


def by_user_agent(event: dict[str, Any]) -> bool:
    """The driver's requests here (it runs on the admin kubeconfig): by its user agent."""
    return str(event.get("userAgent", "")).startswith(ds.kubeapi.USER_AGENT)


def at_rest(
    cluster: ds.kube_cluster.Cluster, seconds: float, whose: Callable[[dict[str, Any]], bool] = by_user_agent
) -> dict[str, int]:
    """The driver's requests (``whose``) by verb (and resource) while nothing changes, from the audit log."""
    log = cluster.dir / "logs" / "audit.log"
    start = log.stat().st_size
    time.sleep(seconds)
    seen: dict[str, str] = {}
    with log.open(encoding="utf-8") as fh:
        fh.seek(start)
        for line in fh:
            event = json.loads(line)
            if whose(event):
                ref = event.get("objectRef", {})
                cached = " (watch cache)" if "resourceVersion=0" in event.get("requestURI", "") else ""
                seen[event["auditID"]] = f"{event['verb']} {ref.get('resource', '')}{cached}"
    return dict(collections.Counter(seen.values()))


def rest_lines(counts: dict[str, int], seconds: float, whose: str = "user agent `rdma-device-plugin-dra`") -> list[str]:
    total = sum(counts.values())
    return [
        f"### API requests of the driver at rest ({seconds:.0f} s, one node)",
        "",
        f"Counted in the API server's audit log ({whose}), nothing changing on the node.",
        "",
        "| request | count | per minute |",
        "|---|---|---|",
        *(f"| {k} | {v} | {v * 60 / seconds:.2f} |" for k, v in sorted(counts.items())),
        f"| all | {total} | {total * 60 / seconds:.2f} |",
        "",
        f"At 2,000 such nodes: {total * 2000 / seconds:.1f} requests a second.",
    ]


def call(stub: pb_grpc.DRAPluginStub, kind: str, uid: str, name: str) -> float:
    claim = pb.Claim(namespace="default", uid=uid, name=name)
    t0 = time.perf_counter()
    if kind == "unprepare":
        answer = stub.NodeUnprepareResources(pb.NodeUnprepareResourcesRequest(claims=[claim]), timeout=30)
    else:
        answer = stub.NodePrepareResources(pb.NodePrepareResourcesRequest(claims=[claim]), timeout=30)
    took = time.perf_counter() - t0
    if answer.claims[uid].error:
        raise RuntimeError(f"{kind} {name}: {answer.claims[uid].error}")
    return took


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--claims", type=int, default=200, help="claims to prepare (50 per pod)")
    ap.add_argument("--starts", type=int, default=5)
    ap.add_argument("--rest-seconds", type=float, default=330.0, help="the window at rest (a watch lasts 300 s)")
    ap.add_argument("--only-rest", action="store_true", help="measure the requests at rest only, print them")
    ap.add_argument("--write-results", metavar="FILE")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="rdra-bench-", dir="/tmp"))
    (work / "audit.yaml").write_text(AUDIT_POLICY)
    cluster = ds.kube_cluster.Cluster(work / "cl", audit_policy=work / "audit.yaml")
    node = None
    load0 = os.getloadavg()
    try:
        print("[1/4] control plane and node", flush=True)
        cluster.up()
        api = ds.Api(cluster.kubeconfig)
        for obj in ds.chart_objects({"driver": "dra"}):
            if obj["kind"] == "DeviceClass":
                api.apply(obj)
        node = ds.DraNode(cluster, "b1", work / "b1", index=1)
        if args.only_rest:
            node.start_driver()
            ds.wait_for(
                "registered", lambda: any(r.get("msg") == "registered with the kubelet" for r in node.log_lines())
            )
            ds.wait_for("slices", lambda: pool_versions(api, node.name))
            print(f"at rest for {args.rest_seconds:.0f} s", flush=True)
            print("\n".join(rest_lines(at_rest(cluster, args.rest_seconds), args.rest_seconds)))
            return 0
        print(f"[2/4] start -> slices x{args.starts}", flush=True)
        starts = start_to_slices(api, node, args.starts)
        print(f"[3/4] {args.claims} claims allocated by the scheduler and prepared by the kubelet", flush=True)
        names: list[str] = []
        for p in range((args.claims + 49) // 50):
            batch = [f"b{p}-{i}" for i in range(min(50, args.claims - 50 * p))]
            for n in batch:
                api.create(ds.claim(n, [ds.request("nic", f"nic.{ds.DRIVER}")]))
            api.create(ds.pod(f"bench-{p}", node.name, batch))
            ds.wait_for(f"pod bench-{p} running", lambda p=p: ds.running(api, f"bench-{p}"), timeout=600)
            names += batch
        uids = {n: api.claim(n)["metadata"]["uid"] for n in names}
        print("[4/4] prepare / unprepare over the driver's socket", flush=True)
        sock = node.endpoint
        fresh, again, unprep = [], [], []
        with grpc.insecure_channel(f"unix://{sock}") as ch:
            stub = pb_grpc.DRAPluginStub(ch)
            for n in names:
                again.append(call(stub, "prepare", uids[n], n))  # prepared by the kubelet: from the record
                unprep.append(call(stub, "unprepare", uids[n], n))
                fresh.append(call(stub, "prepare", uids[n], n))
        assert node.proc is not None
        pid = node.proc.pid
        rss, hwm, threads = status_kb(pid, "VmRSS"), status_kb(pid, "VmHWM"), status_kb(pid, "Threads")
        first_log = [
            r.get("seconds_from_start") for r in node.log_lines() if r.get("msg") == "first ResourceSlices in the API"
        ]
        print(f"[5/5] at rest for {args.rest_seconds:.0f} s", flush=True)
        rest = at_rest(cluster, args.rest_seconds)
    finally:
        if node is not None:
            node.close()
        cluster.down()
        shutil.rmtree(work, ignore_errors=True)
    load1 = os.getloadavg()
    lines = [
        "## DRA driver (bench/bench_dra.py)",
        "",
        f"Command: `.venv/bin/python bench/bench_dra.py --claims {args.claims} --starts {args.starts} "
        f"--rest-seconds {args.rest_seconds:.0f}`; "
        f"load average {load0[0]:.2f} at start, {load1[0]:.2f} at the end (2 cores). Kubernetes v1.37.2 "
        "(etcd, kube-apiserver, -controller-manager, -scheduler) and kubelet-managers on one fixture node "
        "(4 bonded NICs), the driver as `rdma-device-plugin dra`.",
        "",
        "### Start -> ResourceSlices in the API server (s)",
        "",
        "| start | spawn (kubelet start) -> both slices in the API "
        "| inside the driver: set-up done (imports, config) -> first write |",
        "|---|---|---|",
        *(
            f"| {k} | {v:.2f} | {f'{first_log[i]:.2f}' if i < len(first_log) and first_log[i] is not None else ''} |"
            for i, (k, v) in enumerate(starts)
        ),
        "",
        "### NodePrepareResources / NodeUnprepareResources, one claim per call (ms)",
        "",
        "Beside the device plugin's Allocate (p50 0.53 ms, p99 0.77 ms above): a fresh prepare reads the",
        "claim from the API server and writes a CDI spec and a record; an idempotent one answers from the record.",
        "",
        "| call | calls | p50 | p99 | max |",
        "|---|---|---|---|---|",
        f"| prepare, fresh | {ms(fresh)} |",
        f"| prepare, again (idempotent) | {ms(again)} |",
        f"| unprepare | {ms(unprep)} |",
        "",
        "### Memory",
        "",
        f"VmRSS {rss / 1024:.1f} MiB, VmHWM {hwm / 1024:.1f} MiB, {threads} threads, after {len(names)} claims "
        "prepared, unprepared and prepared again.",
        "",
        *rest_lines(rest, args.rest_seconds),
    ]
    text = "\n".join(lines)
    print("\n" + text)
    if args.write_results:
        report.write_section(args.write_results, "bench_dra.py", text, after=PLUGIN_END)
    return 0


if __name__ == "__main__":
    sys.exit(main())
