"""The DRA driver against the real v1.37.2 components: etcd, kube-apiserver, kube-controller-manager,
kube-scheduler (its DRA allocator decides every placement below) and, per node, kubelet-managers (the
kubelet's DRA manager with its plugin watcher: registration, NodePrepareResources, health stream).

The driver runs as a real process (``rdma-device-plugin dra``) on a fixture node, the DeviceClasses
are the chart's (rendered by Helm's engine), pods and claims go through the API like any user's.
One cluster per module (about 20 s to start); every test deletes what it created.
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import json
import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from dra_support import (
    DRIVER,
    SLICES,
    Api,
    DraNode,
    allocated_devices,
    chart_objects,
    claim,
    kube_bin,
    kube_cluster,
    nic_is,
    pod,
    request,
    running,
    slice_devices,
    unschedulable,
    wait_for,
)
from gpu_dra_stub import DRIVER as GPU_DRIVER
from gpu_dra_stub import GpuDraStub

from rdma_device_plugin.api import dra_v1_pb2, dra_v1_pb2_grpc, dra_v1beta1_pb2, dra_v1beta1_pb2_grpc
from rdma_device_plugin.config import load_config_data
from rdma_device_plugin.dra import kubeapi, model, version
from rdma_device_plugin.dra.kubeletplugin import Paths
from rdma_device_plugin.dra.model import PCI_BUS_ID, PCIE_ROOT
from rdma_device_plugin.health import NicHealth
from rdma_device_plugin.inventory import NodeInventory
from rdma_device_plugin.resources import ResourcePool
from rdma_node import fixtures, sysfs

# Each test waits for the real scheduler and kubelet with its own generous deadlines; the module's
# cluster and nodes start in the first test's setup.
pytestmark = pytest.mark.timeout(600)

NIC = f"nic.{DRIVER}"
EXCLUSIVE = f"nic-exclusive.{DRIVER}"
TEST_LABEL = "rdma.lingjun.io/dra-test"
NICS = ["mlx5_bond_0", "mlx5_bond_1", "mlx5_bond_2", "mlx5_bond_3"]
# Device names follow the PCI function (the fixture's 0000:1a:00.0, 0000:3a:00.0, ...), not mlx5_bond_N.
DEV = {n: f"0000-{0x1A + 0x20 * i:02x}-00-0" for i, n in enumerate(NICS)}
X = {n: d + "-x" for n, d in DEV.items()}  # the exclusive views


@pytest.fixture(scope="module")
def workdir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="rdra-", dir="/tmp"))  # short: unix socket paths below it
    yield d
    if not os.environ.get("KEEP_DRA_WORKDIR"):  # set it to read the logs after a failure
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def cluster(workdir: Path) -> Iterator[kube_cluster.Cluster]:
    c = kube_cluster.Cluster(workdir / "cl", bin=kube_bin()).up()
    try:
        yield c
    finally:
        c.down()


@pytest.fixture(scope="module")
def api(cluster: kube_cluster.Cluster) -> Api:
    a = Api(cluster.kubeconfig)
    for obj in chart_objects({"driver": "dra", "numaPools": True}):  # numaPools: its classes too
        if obj["kind"] == "DeviceClass":
            a.apply(obj)
    a.apply(
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "DeviceClass",
            "metadata": {"name": GPU_DRIVER},
            "spec": {"selectors": [{"cel": {"expression": f'device.driver == "{GPU_DRIVER}"'}}]},
        }
    )
    return a


def _node(cluster: kube_cluster.Cluster, api: Api, workdir: Path, name: str, index: int, mode: str) -> DraNode:
    n = DraNode(cluster, name, workdir / name, index=index, mode=mode).start_driver()
    wait_for(f"{name}'s ResourceSlices", lambda: complete(api.slices(name)))
    return n


@pytest.fixture(scope="module")
def shared(cluster: kube_cluster.Cluster, api: Api, workdir: Path) -> Iterator[DraNode]:
    n = _node(cluster, api, workdir, "n1", 1, "shared")
    try:
        yield n
    finally:
        n.close()


@pytest.fixture(scope="module")
def exclusive(cluster: kube_cluster.Cluster, api: Api, workdir: Path) -> Iterator[DraNode]:
    n = _node(cluster, api, workdir, "n2", 2, "exclusive")
    try:
        yield n
    finally:
        n.close()


class Objects:
    """What a test creates, deleted at its end: pods first (the kubelet unprepares their claims), then claims."""

    def __init__(self, api: Api) -> None:
        self.api = api
        self.pods: list[dict[str, Any]] = []
        self.claims: list[dict[str, Any]] = []

    def claim(self, name: str, *requests: dict[str, Any], constraints: list[dict[str, Any]] | None = None) -> str:
        obj = claim(name, list(requests), constraints)
        obj["metadata"]["labels"] = {TEST_LABEL: "true"}
        self.api.create(obj)
        self.claims.append(obj)
        return name

    def claims_alike(self, prefix: str, count: int, *requests: dict[str, Any]) -> tuple[str, ...]:
        """``count`` claims ``<prefix><i>`` with the same requests, created by a few callers at once."""
        with ThreadPoolExecutor(4) as pool:
            return tuple(pool.map(lambda i: self.claim(f"{prefix}{i}", *requests), range(count)))

    def pod(
        self,
        name: str,
        node: DraNode,
        claims: tuple[str, ...] = (),
        limits: dict[str, str] | None = None,
        grace: int | None = None,
    ) -> str:
        obj = pod(name, node.name, claims, limits, grace)
        self.api.create(obj)
        self.pods.append(obj)
        return name

    def delete_pod(self, name: str) -> None:
        obj = next(p for p in self.pods if p["metadata"]["name"] == name)
        self.api.delete(obj)
        wait_for(f"pod {name} gone", lambda: self.api.pod(name) is None)
        self.pods.remove(obj)

    def cleanup(self) -> None:
        for p in self.pods:
            self.api.delete(p)
        for p in self.pods:
            wait_for(f"pod {p['metadata']['name']} gone", lambda p=p: self.api.pod(p["metadata"]["name"]) is None)
        if self.claims:  # one call for all of them (a test may make a thousand)
            self.api.client.request(
                "DELETE",
                "/apis/resource.k8s.io/v1/namespaces/default/resourceclaims",
                query={"labelSelector": TEST_LABEL},
            )


@pytest.fixture
def objs(api: Api) -> Iterator[Objects]:
    o = Objects(api)
    try:
        yield o
    finally:
        o.cleanup()


def complete(slices: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
    """The pool's slices when all of its newest generation are there (what the allocator uses)."""
    if not slices:
        return None
    newest = max(s["spec"]["pool"]["generation"] for s in slices)
    current = [s for s in slices if s["spec"]["pool"]["generation"] == newest]
    return current if len(current) == current[0]["spec"]["pool"]["resourceSliceCount"] else None


def attr(device: dict[str, Any], name: str) -> Any:
    a = device["attributes"][name]
    return next(iter(a.values()))


# ------------------------------------------------------------------ slices


def test_slices_published_and_republished_after_a_kubelet_restart(api: Api, shared: DraNode, objs: Objects) -> None:
    before = wait_for("slices", lambda: complete(api.slices(shared.name)))
    devices = slice_devices(before)
    nics = [DEV[n] for n in NICS]
    assert set(devices) == {*nics, *(f"{n}-x" for n in nics), "all-hca"}
    d = devices[DEV["mlx5_bond_2"]]
    # What the fixture node's sysfs says about mlx5_bond_2: its PCI function, host bridge, NUMA node,
    # the two GPUs under its switch, its bond and the IPv6 RoCE v2 GID of its compute address.
    assert attr(d, "resource.kubernetes.io/pciBusID") == "0000:5a:00.0"
    assert attr(d, "resource.kubernetes.io/pcieRoot") == "pci0000:55"
    assert attr(d, "resource.kubernetes.io/numaNode") == 1
    assert attr(d, "switchGpus") == "0000:58:00.0,0000:59:00.0"
    assert (attr(d, "rdmaDevice"), attr(d, "netdev"), attr(d, "linkLayer")) == ("mlx5_bond_2", "bond2", "Ethernet")
    assert attr(d, "gid") == "2408:4005:0300:0002:0000:0000:0000:0011" and attr(d, "gidIndex") == 3
    assert d["allowMultipleAllocations"] and d["capacity"]["slots"]["value"] == "1k"
    assert "allowMultipleAllocations" not in devices[X["mlx5_bond_2"]]
    assert attr(devices["all-hca"], "extendedResource") == "rdma/hca"

    uids = {s["metadata"]["uid"] for s in before}
    shared.node.crash()
    shared.node.start()  # the kubelet's DRA manager deletes every slice of its node when it starts

    def republished() -> list[dict[str, Any]] | None:
        now = complete(api.slices(shared.name))
        return now if now and not uids & {s["metadata"]["uid"] for s in now} else None

    after = wait_for("the slices the kubelet's start deleted, published again", republished)
    assert slice_devices(after) == devices
    # ... and the kubelet registered the driver again: a new claim is allocated and prepared.
    objs.claim("after-restart", request("nic", NIC, nic_is("mlx5_bond_0")))
    objs.pod("after-restart", shared, ("after-restart",))
    wait_for("the pod running", lambda: running(api, "after-restart"))
    assert shared.got("after-restart")[0]["RDMA_DEVICES"] == "mlx5_bond_0"


def test_a_metadata_edit_rewrites_nothing_and_counters_are_written_first(api: Api, shared: DraNode) -> None:
    """The publisher compares content, not resourceVersion: an admin's label on a slice is kept and
    rewrites nothing. A change of content (a port going down) moves the pool to exactly one new
    generation, the counters slice written before the devices slice that consumes its counters."""
    before = wait_for("slices", lambda: complete(api.slices(shared.name)))
    generation = before[0]["spec"]["pool"]["generation"]
    devices = next(s for s in before if s["spec"].get("devices"))
    labels = {**devices["metadata"]["labels"], "example.com/touched": "yes"}
    api.client.update(
        f"{SLICES}/{devices['metadata']['name']}", {**devices, "metadata": {**devices["metadata"], "labels": labels}}
    )
    shared.fixture.set_port_state("mlx5_bond_0", "DOWN")  # after the label: the driver sees it first
    try:
        after = wait_for(
            "mlx5_bond_0 tainted",
            lambda: _taints(api, shared).get(DEV["mlx5_bond_0"]) and complete(api.slices(shared.name)),
        )
        assert {s["spec"]["pool"]["generation"] for s in after} == {generation + 1}  # none for the label
        by_kind = {s["metadata"]["labels"]["rdma.lingjun.io/slice"]: s for s in after}
        assert by_kind["devices"]["metadata"]["labels"]["example.com/touched"] == "yes"
        rv = {k: int(s["metadata"]["resourceVersion"]) for k, s in by_kind.items()}
        assert rv["counters"] < rv["devices"]
    finally:
        shared.fixture.set_port_state("mlx5_bond_0", "ACTIVE")
    wait_for("the taints gone", lambda: not any(_taints(api, shared).values()))


class _DeletesBeforeAnUpdate(kubeapi.Client):
    """The admin's client that, when armed, deletes the slice a PUT is about to update just before
    sending it: the kubelet's start wiping the node's slices while the publisher's write is in flight."""

    armed = False

    def request(
        self,
        method: str,
        path: str,
        body: dict[str, Any] | None = None,
        query: Any = None,
        content_type: str = "application/json",
    ) -> dict[str, Any]:
        if self.armed and method == "PUT" and not query:
            self.armed = False
            super().request("DELETE", path)
        return super().request(method, path, body, query, content_type)


def test_a_slice_deleted_under_a_write_is_rewritten_on_the_watch_event(api: Api, cluster: kube_cluster.Cluster) -> None:
    """Issue 38: 3 of 5 kubelet restarts took 1.05 s to the slices, the publisher's 1 s back-off after
    its update met a slice the kubelet had just deleted (404). Such a race is no failure: the watch's
    DELETED event wakes the next pass, which creates the slice. No periodic pass can do it here (the
    resync is an hour), and no failure is counted (a failure backs off)."""
    from rdma_device_plugin.dra.publisher import Publisher

    client = _DeletesBeforeAnUpdate(kubeapi.from_kubeconfig(str(cluster.kubeconfig)))
    pub = Publisher(client, DRIVER, "race-a", resync=3600.0)
    spec = _slice("race-a")["spec"]
    try:
        pub.set_specs({"devices": spec})
        pub.start()
        first = wait_for("the slice", lambda: pub.in_sync.is_set() and api.slices("race-a"))
        lists = pub.lists
        client.armed = True
        pub.set_specs({"devices": {**spec, "devices": [{"name": "d0"}]}})  # an update, the slice deleted under it
        now = wait_for("the slice written anew", lambda: pub.in_sync.is_set() and api.slices("race-a"))
        assert not client.armed  # the deletion happened under the update
        assert [s["spec"]["devices"] for s in now] == [[{"name": "d0"}]]
        assert now[0]["metadata"]["uid"] != first[0]["metadata"]["uid"]  # created again, not updated
        assert (pub.failures, pub.last_error) == (0, "")
        assert pub.lists == lists  # the pass after the race read the watch's copy, woken by its event
    finally:
        pub.stop()
        pub.delete_all()


# ------------------------------------------------------------------ sharing


@pytest.mark.timeout(1800)
def test_1000_shared_claims_on_one_nic_then_the_1001st_is_refused(api: Api, shared: DraNode, objs: Objects) -> None:
    """sharedDevices (1000) claims share mlx5_bond_3, 50 per pod; the real allocator refuses one more.

    One pod at a time: kube-scheduler v1.37.2 counts a pod's claims twice while it binds them (its
    in-flight allocations stay until PreBind ends, and the claims it already wrote are in its assume
    cache too: ``claimTracker.GatherAllocatedState`` adds both into ``AggregatedCapacity``), so a pod
    scheduled meanwhile near the budget is refused spuriously and parked until the next relevant event
    or the 5-minute flush. docs/dra.md says so to operators."""
    per_pod, pods = 50, 20
    for p in range(pods):
        names = objs.claims_alike(f"s{p}-", per_pod, request("nic", NIC, nic_is("mlx5_bond_3")))
        objs.pod(f"share-{p}", shared, names)
        wait_for(f"pod share-{p} running", lambda p=p: running(api, f"share-{p}"), timeout=300)
    consumed = 0
    for p in range(pods):
        for i in range(per_pod):
            result = api.claim(f"s{p}-{i}")["status"]["allocation"]["devices"]["results"]
            assert [r["device"] for r in result] == [DEV["mlx5_bond_3"]]
            consumed += int(result[0]["consumedCapacity"]["slots"])
    assert consumed == 1000
    assert len(shared.node.record("default", "share-7")["containers"]["c"]["cdi_devices"]) == per_pod  # type: ignore[index]

    objs.claim("s-1001", request("nic", NIC, nic_is("mlx5_bond_3")))
    objs.pod("share-1001", shared, ("s-1001",))
    message = wait_for("the 1001st claim refused", lambda: unschedulable(api, "share-1001"))
    assert "cannot allocate all claims" in message
    assert allocated_devices(api, "s-1001") == []
    # Refused for capacity alone: 50 shares freed, it gets its share.
    objs.delete_pod("share-0")
    wait_for("the 1001st claim allocated once shares were freed", lambda: running(api, "share-1001"), timeout=180)
    assert allocated_devices(api, "s-1001") == [DEV["mlx5_bond_3"]]


def test_an_exclusive_claim_never_shares_its_nic(api: Api, shared: DraNode, objs: Objects) -> None:
    objs.claim("x0", request("nic", EXCLUSIVE, nic_is("mlx5_bond_0")))
    objs.pod("x0", shared, ("x0",))
    wait_for("the exclusive claim's pod running", lambda: running(api, "x0"))
    assert allocated_devices(api, "x0") == [X["mlx5_bond_0"]]
    # While it holds mlx5_bond_0: no share of it, and no rdma/hca pod (whose set holds every NIC).
    objs.claim("s0", request("nic", NIC, nic_is("mlx5_bond_0")))
    objs.pod("s0", shared, ("s0",))
    objs.pod("hca", shared, limits={"rdma/hca": "1"})
    # A share of another NIC is fine, and then that NIC cannot go exclusive.
    objs.claim("s1", request("nic", NIC, nic_is("mlx5_bond_1")))
    objs.pod("s1", shared, ("s1",))
    wait_for("the share of mlx5_bond_1 running", lambda: running(api, "s1"))
    objs.claim("x1", request("nic", EXCLUSIVE, nic_is("mlx5_bond_1")))
    objs.pod("x1", shared, ("x1",))
    for name in ("s0", "hca", "x1"):
        assert "cannot allocate all claims" in wait_for(f"{name} refused", lambda n=name: unschedulable(api, n))
    assert allocated_devices(api, "s0") == allocated_devices(api, "x1") == []
    # The exclusive claim gone, the share and the rdma/hca pod get mlx5_bond_0 (x1 still cannot).
    objs.delete_pod("x0")
    objs.api.delete(claim("x0", []))
    wait_for("the share running", lambda: running(api, "s0"), timeout=180)
    wait_for("the rdma/hca pod running", lambda: running(api, "hca"), timeout=180)
    assert allocated_devices(api, "s0") == [DEV["mlx5_bond_0"]]
    assert unschedulable(api, "x1")


def test_an_all_claim_on_the_exclusive_class_allocates_and_the_scheduler_stays_up(
    api: Api, cluster: kube_cluster.Cluster, shared: DraNode, objs: Objects
) -> None:
    """kubernetes#138882 (why 1.36 is not supported, docs/dra.md): early 1.36 schedulers panic on an
    ``allocationMode: All`` claim of devices that consume counters, as every exclusive view does. The
    real v1.37.2 scheduler gives it every exclusive view of the node, and the same process goes on
    deciding: a share of a NIC is refused while the claim holds them all."""
    scheduler = cluster.state()["processes"]["kube-scheduler"]["pid"]  # type: ignore[index]
    every = request("nics", EXCLUSIVE)
    every["exactly"]["allocationMode"] = "All"
    objs.claim("all-x", every)
    objs.pod("all-x", shared, ("all-x",))
    wait_for("the All claim's pod running", lambda: running(api, "all-x"))
    assert sorted(allocated_devices(api, "all-x")) == sorted(X.values())
    assert sorted(shared.got("all-x")[0]["RDMA_DEVICES"].split(",")) == NICS
    objs.claim("after-all", request("nic", NIC, nic_is("mlx5_bond_0")))
    objs.pod("after-all", shared, ("after-all",))
    assert "cannot allocate all claims" in wait_for("the share refused", lambda: unschedulable(api, "after-all"))
    assert cluster.running()["kube-scheduler"]
    assert cluster.state()["processes"]["kube-scheduler"]["pid"] == scheduler  # type: ignore[index]


def test_a_nic_shared_in_an_earlier_cycle_is_not_granted_exclusively(api: Api, shared: DraNode, objs: Objects) -> None:
    """kubernetes#139034 (why 1.36 is not supported): early 1.36 schedulers forget shared allocations
    when they rebuild the counters, so an exclusive view could be granted on a NIC shared in an earlier
    scheduling cycle. On v1.37.2 the exclusive claim stays unallocated with the scheduler's reason, and
    the share holds: its allocation unchanged, its pod running with the NIC."""
    objs.claim("held", request("nic", NIC, nic_is("mlx5_bond_2")))
    objs.pod("held", shared, ("held",))
    wait_for("the share's pod running", lambda: running(api, "held"))
    held = api.claim("held")["status"]["allocation"]
    assert [r["device"] for r in held["devices"]["results"]] == [DEV["mlx5_bond_2"]]
    objs.claim("grab", request("nic", EXCLUSIVE, nic_is("mlx5_bond_2")))
    objs.pod("grab", shared, ("grab",))
    reason = wait_for("the exclusive claim refused", lambda: unschedulable(api, "grab"))
    assert "cannot allocate all claims" in reason
    # Another cycle after a claim event (a share of another NIC allocated): still refused.
    objs.claim("other", request("nic", NIC, nic_is("mlx5_bond_3")))
    objs.pod("other", shared, ("other",))
    wait_for("the other share's pod running", lambda: running(api, "other"))
    assert allocated_devices(api, "grab") == [] and unschedulable(api, "grab")
    assert api.claim("held")["status"]["allocation"] == held and running(api, "held")
    assert shared.got("held")[0]["RDMA_DEVICES"] == "mlx5_bond_2"


# ------------------------------------------------------------------ rdma/hca pods unchanged


def _device_plugin_env(node: DraNode, mode: str, nics: list[str]) -> dict[str, str]:
    """What the device plugin's own pool hands a container given these NICs (its Allocate answer)."""
    from rdma_node import sysfs

    config = load_config_data({"version": "v1", "mode": mode})
    pool = ResourcePool(config.resources[0], config)
    found = sysfs.read_nics(node.fixture.sysfs, node.fixture.dev)
    pool.set_nics(found)
    ids = (
        [d.id for d in pool.snapshot()[1]][:1] if mode == "shared" else [n.pci_address for n in found if n.name in nics]
    )
    return pool.allocate(ids).envs


def test_rdma_hca_pod_in_shared_mode_gets_every_nic(api: Api, shared: DraNode, objs: Objects) -> None:
    objs.pod("hca-shared", shared, limits={"rdma/hca": "1"})
    p = wait_for("the rdma/hca pod running", lambda: running(api, "hca-shared"))
    claim_name = p["status"]["extendedResourceClaimStatus"]["resourceClaimName"]
    assert allocated_devices(api, claim_name) == ["all-hca"]
    env, nodes = shared.got("hca-shared")
    assert env["RDMA_DEVICES"] == ",".join(NICS)
    assert env == _device_plugin_env(shared, "shared", NICS)  # exactly what the device plugin hands out
    assert sorted(nodes) == sorted([f"/dev/infiniband/uverbs{i}" for i in range(4)] + ["/dev/infiniband/rdma_cm"])


def test_rdma_hca_pod_in_exclusive_mode_gets_one_nic(api: Api, exclusive: DraNode, objs: Objects) -> None:
    objs.pod("hca-excl", exclusive, limits={"rdma/hca": "1"})
    objs.pod("hca-excl-2", exclusive, limits={"rdma/hca": "2"})
    one = wait_for("the rdma/hca: 1 pod running", lambda: running(api, "hca-excl"))
    two = wait_for("the rdma/hca: 2 pod running", lambda: running(api, "hca-excl-2"))
    got1 = allocated_devices(api, one["status"]["extendedResourceClaimStatus"]["resourceClaimName"])
    got2 = allocated_devices(api, two["status"]["extendedResourceClaimStatus"]["resourceClaimName"])
    assert len(got1) == 1 and len(got2) == 2 and all(d.endswith("-x") for d in got1 + got2)
    assert not set(got1) & set(got2)  # whole NICs: never the same one twice
    env, nodes = exclusive.got("hca-excl")
    nic = env["RDMA_DEVICES"]
    assert nic in NICS and got1 == [X[nic]]
    assert env == _device_plugin_env(exclusive, "exclusive", [nic])
    assert len([n for n in nodes if "uverbs" in n]) == 1
    assert len(exclusive.got("hca-excl-2")[0]["RDMA_DEVICES"].split(",")) == 2


# ------------------------------------------------------------------ alignment


@pytest.fixture
def gpus(api: Api, shared: DraNode) -> Iterator[GpuDraStub]:
    stub = GpuDraStub(api.client, shared.name, str(shared.kubelet_dir), shared.fixture.sysfs).start()
    wait_for("the GPU slice", lambda: api.slices(shared.name, GPU_DRIVER))
    try:
        yield stub
    finally:
        stub.stop()
        stub.publisher.delete_all()


def test_a_nic_aligned_with_a_gpu_by_pcie_root(api: Api, shared: DraNode, gpus: GpuDraStub, objs: Objects) -> None:
    """The GPU on mlx5_bond_2's switch (0000:58:00.0), and a shared NIC matching its pcieRoot: the
    allocator, which takes the first fitting NIC (mlx5_bond_0) without the constraint, must take mlx5_bond_2."""
    gpu = request("gpu", GPU_DRIVER, 'device.attributes["resource.kubernetes.io"].pciBusID == "0000:58:00.0"')
    match = [{"requests": ["gpu", "nic"], "matchAttribute": "resource.kubernetes.io/pcieRoot"}]
    objs.claim("aligned", gpu, request("nic", NIC), constraints=match)
    objs.claim("unaligned", request("nic", NIC))
    objs.pod("aligned", shared, ("aligned",))
    objs.pod("unaligned", shared, ("unaligned",))
    wait_for("the aligned pod running (prepared by both drivers)", lambda: running(api, "aligned"))
    wait_for("the unaligned pod running", lambda: running(api, "unaligned"))
    results = api.claim("aligned")["status"]["allocation"]["devices"]["results"]
    assert {r["request"]: (r["driver"], r["device"]) for r in results} == {
        "gpu": (GPU_DRIVER, "gpu-4"),
        "nic": (DRIVER, DEV["mlx5_bond_2"]),
    }
    assert allocated_devices(api, "unaligned") == [DEV["mlx5_bond_0"]]
    assert shared.got("aligned")[0]["RDMA_DEVICES"] == "mlx5_bond_2"
    assert [d.device for d in gpus.backend.prepared[api.claim("aligned")["metadata"]["uid"]]] == ["gpu-4"]


def test_nics_asked_by_numa_node_and_rate(api: Api, shared: DraNode, gpus: GpuDraStub, objs: Objects) -> None:
    numa1 = 'device.attributes["resource.kubernetes.io"].numaNode == 1'
    fast = f'device.attributes["{DRIVER}"].rateGbps >= 200'
    objs.claim("numa1", request("nic", NIC, numa1, fast))
    # two GPUs and a NIC on one NUMA node, the GPUs on NUMA node 0 (the first GPUs)
    same_numa = [{"requests": ["gpu", "nic"], "matchAttribute": "resource.kubernetes.io/numaNode"}]
    gpu0 = request("gpu", GPU_DRIVER, 'device.attributes["resource.kubernetes.io"].numaNode == 0')
    objs.claim("numa-gpu", gpu0, request("nic", EXCLUSIVE), constraints=same_numa)
    objs.pod("numa1", shared, ("numa1",))
    objs.pod("numa-gpu", shared, ("numa-gpu",))
    wait_for("both pods running", lambda: running(api, "numa1") and running(api, "numa-gpu"))
    assert allocated_devices(api, "numa1")[0] in (DEV["mlx5_bond_2"], DEV["mlx5_bond_3"])
    nic = [r for r in api.claim("numa-gpu")["status"]["allocation"]["devices"]["results"] if r["request"] == "nic"]
    assert nic[0]["device"] in (X["mlx5_bond_0"], X["mlx5_bond_1"])
    slow = f'device.attributes["{DRIVER}"].rateGbps >= 400'
    objs.claim("too-slow", request("nic", NIC, slow))
    objs.pod("too-slow", shared, ("too-slow",))
    assert "cannot allocate all claims" in wait_for("no 400G NIC", lambda: unschedulable(api, "too-slow"))


# ------------------------------------------------------------------ health


def _taints(api: Api, node: DraNode) -> dict[str, list[str]]:
    slices = complete(api.slices(node.name)) or []
    return {name: [t["value"] for t in d.get("taints", [])] for name, d in slice_devices(slices).items()}


def test_a_nic_going_down_stops_new_allocations(api: Api, shared: DraNode, objs: Objects) -> None:
    objs.claim("holder", request("nic", NIC, nic_is("mlx5_bond_1")))
    objs.pod("holder", shared, ("holder",))
    wait_for("the holder running", lambda: running(api, "holder"))
    shared.fixture.set_port_state("mlx5_bond_1", "DOWN")
    try:
        taints = wait_for("mlx5_bond_1 tainted", lambda: (t := _taints(api, shared)).get(DEV["mlx5_bond_1"]) and t)
        assert taints[DEV["mlx5_bond_1"]] == taints[X["mlx5_bond_1"]] == ["port-down"]
        assert taints["all-hca"] == ["port-down"]  # health.policy all: the set is unhealthy with one NIC down
        assert taints[DEV["mlx5_bond_0"]] == []
        objs.claim("late", request("nic", NIC, nic_is("mlx5_bond_1")))
        objs.pod("late", shared, ("late",))
        objs.claim("other", request("nic", NIC, nic_is("mlx5_bond_0")))
        objs.pod("other", shared, ("other",))
        objs.pod("hca-late", shared, limits={"rdma/hca": "1"})
        wait_for("a claim for another NIC allocated", lambda: running(api, "other"))
        for name in ("late", "hca-late"):
            assert "cannot allocate all claims" in wait_for(f"{name} refused", lambda n=name: unschedulable(api, n))

        # The pod that holds it keeps it, and hears of it through the kubelet's health stream.
        def unhealthy() -> list[Any] | None:
            st = (api.pod("holder") or {}).get("status", {}).get("containerStatuses", [{}])[0]
            found = [r for s in st.get("allocatedResourcesStatus", []) for r in s["resources"]]
            return found if found and all(r["health"] == "Unhealthy" for r in found) else None

        wait_for("the holder's allocatedResourcesStatus Unhealthy", unhealthy)
        assert running(api, "holder")
    finally:
        shared.fixture.set_port_state("mlx5_bond_1", "ACTIVE")
    wait_for("the taints gone", lambda: not any(_taints(api, shared).values()))
    wait_for(
        "the refused pods scheduled once the port is ACTIVE",
        lambda: running(api, "late") and running(api, "hca-late"),
        timeout=180,
    )


# ------------------------------------------------------------------ prepare / unprepare


def _prepare(node: DraNode, uid: str, name: str, beta: bool = False) -> Any:
    sock = node.endpoint
    pb, stub = (dra_v1beta1_pb2, dra_v1beta1_pb2_grpc) if beta else (dra_v1_pb2, dra_v1_pb2_grpc)
    with grpc.insecure_channel(f"unix://{sock}") as ch:
        req = pb.NodePrepareResourcesRequest(claims=[pb.Claim(namespace="default", uid=uid, name=name)])
        return stub.DRAPluginStub(ch).NodePrepareResources(req, timeout=30).claims[uid]


def _unprepare(node: DraNode, uid: str, name: str) -> Any:
    sock = node.endpoint
    with grpc.insecure_channel(f"unix://{sock}") as ch:
        req = dra_v1_pb2.NodeUnprepareResourcesRequest(
            claims=[dra_v1_pb2.Claim(namespace="default", uid=uid, name=name)]
        )
        return dra_v1_pb2_grpc.DRAPluginStub(ch).NodeUnprepareResources(req, timeout=30).claims[uid]


def _devices(answer: Any) -> list[tuple[str, ...]]:
    return [(d.pool_name, d.device_name, *d.request_names, *d.cdi_device_ids) for d in answer.devices]


def test_prepare_and_unprepare_are_idempotent(api: Api, exclusive: DraNode, objs: Objects) -> None:
    objs.claim("idem", request("nic", EXCLUSIVE, nic_is("mlx5_bond_0")))
    objs.pod("idem", exclusive, ("idem",), grace=0)
    wait_for("the pod running", lambda: running(api, "idem"))
    uid = api.claim("idem")["metadata"]["uid"]
    cdi = exclusive.cdi_dir / f"{DRIVER}-claim_{uid}.json"
    record = exclusive.state_dir / "claims" / f"{uid}.json"
    spec = json.loads(cdi.read_text())
    kubelet_got = exclusive.node.record("default", "idem")["containers"]["c"]["cdi_devices"]  # type: ignore[index]

    first = _prepare(exclusive, uid, "idem")
    assert not first.error and [d.cdi_device_ids[0] for d in first.devices] == kubelet_got
    assert _devices(_prepare(exclusive, uid, "idem", beta=True)) == _devices(first)  # v1beta1: the same
    # The driver restarted (an upgrade): the record answers, the CDI spec is untouched.
    mtime = cdi.stat().st_mtime_ns
    exclusive.stop_driver()
    exclusive.start_driver()
    wait_for("the driver serving again", exclusive.endpoint.exists)
    assert _devices(wait_for("prepare after the restart", lambda: _retry_prepare(exclusive, uid, "idem"))) == _devices(
        first
    )
    assert cdi.stat().st_mtime_ns == mtime and json.loads(cdi.read_text()) == spec

    assert not _unprepare(exclusive, uid, "idem").error
    assert not cdi.exists() and not record.exists()
    assert not _unprepare(exclusive, uid, "idem").error  # again: nothing to do, no error
    again = _prepare(exclusive, uid, "idem")  # prepared anew from the API: the same answer and spec
    assert _devices(again) == _devices(first) and json.loads(cdi.read_text()) == spec

    # Deleted at once (grace 0), right after the driver's restart: the kubelet unprepares the claim of
    # a pod already gone from the API (retried until the driver is registered again).
    objs.delete_pod("idem")
    wait_for("the kubelet's unprepare", lambda: not cdi.exists() and not record.exists())
    assert not [f for f in os.listdir(exclusive.cdi_dir) if uid in f]


def _retry_prepare(node: DraNode, uid: str, name: str) -> Any:
    try:
        return _prepare(node, uid, name)
    except grpc.RpcError:
        return None


def test_prepare_names_a_nic_that_is_down_or_vanished(api: Api, exclusive: DraNode, objs: Objects) -> None:
    objs.claim("down", request("nic", EXCLUSIVE, nic_is("mlx5_bond_2")))
    objs.claim("gone", request("nic", EXCLUSIVE, nic_is("mlx5_bond_3")))
    objs.pod("down", exclusive, ("down",))
    objs.pod("gone", exclusive, ("gone",))
    wait_for("both pods running", lambda: running(api, "down") and running(api, "gone"))
    down_uid, gone_uid = api.claim("down")["metadata"]["uid"], api.claim("gone")["metadata"]["uid"]
    # As if never prepared on this node (a new pod of the claim): prepare again after the NIC failed.
    assert not _unprepare(exclusive, down_uid, "down").error and not _unprepare(exclusive, gone_uid, "gone").error
    exclusive.fixture.set_port_state("mlx5_bond_2", "DOWN")
    exclusive.fixture.remove_nic("mlx5_bond_3")
    try:
        # .get: between two writes of a republish the newest generation is incomplete (no devices read)
        wait_for(
            "both NICs tainted",
            lambda: (t := _taints(api, exclusive)).get(X["mlx5_bond_2"]) and t.get(X["mlx5_bond_3"]),
        )
        assert _taints(api, exclusive)[X["mlx5_bond_3"]] == ["gone"]
        down = _prepare(exclusive, down_uid, "down")
        gone = _prepare(exclusive, gone_uid, "gone")
        assert f"NIC mlx5_bond_2 (device {X['mlx5_bond_2']}) is not usable: port 1 DOWN (not ACTIVE)" in down.error
        assert f"NIC mlx5_bond_3 (device {X['mlx5_bond_3']}) is not usable: NIC gone from sysfs" in gone.error
        assert not down.devices and not gone.devices
    finally:
        exclusive.fixture.set_port_state("mlx5_bond_2", "ACTIVE")


# ------------------------------------------------------------------ rolling update


def _said(node: DraNode, log: Path, msg: str) -> bool:
    return any(line.get("msg") == msg for line in node.log_lines(log))


def test_two_overlapping_instances_hand_over_without_a_failed_prepare(
    api: Api, cluster: kube_cluster.Cluster, workdir: Path, objs: Objects
) -> None:
    """A rolling update with maxSurge (a new instance beside the old one, the old one deleted once the
    new one is up), then a mode-label switch (the old DaemonSet's pod deleted as the other's starts),
    on a node of its own, against the kubelet's DRA plugin manager: every pod meanwhile is prepared at
    the first attempt, the node's slices are the same objects throughout (never wiped by the kubelet),
    and no instance removes another's sockets."""
    node = _node(cluster, api, workdir, "n3", 3, "shared")
    later: list[subprocess.Popen[bytes]] = []
    try:
        slice_uids = {s["metadata"]["uid"] for s in api.slices(node.name)}

        def same_slices() -> bool:
            return {s["metadata"]["uid"] for s in api.slices(node.name)} == slice_uids

        def pod_with_a_claim(name: str) -> None:
            objs.claim(name, request("nic", NIC))
            objs.pod(name, node, (name,))
            wait_for(f"pod {name} running", lambda: running(api, name))

        wait_for("instance a registered", lambda: _said(node, node.log, "registered with the kubelet"))
        pod_with_a_claim("ov-a")
        a_uid = node.uid
        # The rolling update: instance b (a new pod) beside a.
        b_log, c_log = node.root / "dra-b.log", node.root / "dra-c.log"
        b = node.spawn("pod-b", node.config, b_log, node.root / "b.health", "--handover-seconds", "20")
        later.append(b)
        wait_for("instance b registered", lambda: _said(node, b_log, "registered with the kubelet"))
        pod_with_a_claim("ov-ab")
        node.stop_driver()  # the DaemonSet deletes a once b is available
        a_paths, b_paths = (Paths.of(str(node.kubelet_dir), DRIVER, uid) for uid in (a_uid, "pod-b"))
        assert not os.path.exists(a_paths.registration) and not os.path.exists(a_paths.endpoint)
        assert os.path.exists(b_paths.registration) and os.path.exists(b_paths.endpoint)
        pod_with_a_claim("ov-b")
        a_claim = api.claim("ov-a")["metadata"]["uid"]
        objs.delete_pod("ov-a")  # unprepared by b
        wait_for("ov-a's CDI spec removed", lambda: not (node.cdi_dir / f"{DRIVER}-claim_{a_claim}.json").exists())
        assert same_slices()

        # The mode switch: relabelled, the shared DaemonSet's pod b is deleted as the exclusive one's c
        # starts; b serves until c is registered.
        exclusive_config = node.root / "dra-config-exclusive.yaml"
        exclusive_config.write_text(node.config.read_text().replace("mode: shared", "mode: exclusive"))
        b.send_signal(signal.SIGTERM)
        port = kube_cluster.free_port()
        c = node.spawn(
            "pod-c", exclusive_config, c_log, node.root / "c.health", "--metrics-address", f"127.0.0.1:{port}"
        )
        later.append(c)
        assert b.wait(timeout=60) == 0
        assert _said(node, b_log, "a newer instance is registered: handing over")
        assert _said(node, c_log, "registered with the kubelet")
        objs.pod("ov-c", node, limits={"rdma/hca": "1"})
        p = wait_for("the rdma/hca pod running on the exclusive-mode node", lambda: running(api, "ov-c"))
        devices = allocated_devices(api, p["status"]["extendedResourceClaimStatus"]["resourceClaimName"])
        assert len(devices) == 1 and devices[0].endswith("-x")
        assert same_slices()
        # c prepared ov-c: counted per NIC, ready, registered (its metrics)
        m = _scrape(port)
        nic = next(n for n, x in X.items() if x == devices[0])  # devices are named by PCI function
        assert m[f'rdma_dra_claims_prepared{{nic="{nic}"}}'] == 1
        assert m['rdma_dra_requests_total{operation="prepare",result="ok"}'] >= 1
        assert m['rdma_dra_requests_total{operation="prepare",result="error"}'] == 0
        assert m["rdma_dra_registered"] == 1 and m["rdma_dra_slices_in_sync"] == 1 and m["rdma_dra_superseded"] == 0
        # the health file is written once a second: ready within the readinessProbe's period
        wait_for("c ready", lambda: _healthcheck(node.root / "c.health", ready=True).returncode == 0, timeout=60)
        failed = api.get("/api/v1/namespaces/default/events", fieldSelector="reason=FailedPrepareDynamicResources")
        assert not [e for e in failed["items"] if e["involvedObject"]["name"].startswith("ov-")]
        for log in (node.log, b_log, c_log):
            assert not _said(node, log, "prepare failed")
    finally:
        objs.cleanup()
        for proc in later:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                proc.wait(timeout=60)
        node.close()


# ------------------------------------------------------------------ readiness, liveness, metrics


def _healthcheck(health: Path, ready: bool) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "rdma_device_plugin", "healthcheck", "--health-file", str(health)]
    return subprocess.run([*argv, *(["--ready"] if ready else [])], capture_output=True, text=True, timeout=60)


def _scrape(port: int) -> dict[str, float]:
    """``name{labels}`` -> value of the driver's metrics endpoint."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {k: float(v) for k, v in (line.rsplit(" ", 1) for line in text.splitlines() if line and line[0] != "#")}


def test_readiness_follows_the_registration_and_the_slices(
    api: Api, cluster: kube_cluster.Cluster, shared: DraNode, workdir: Path
) -> None:
    """Ready: registered with the kubelet and the node's slices of the newest content in the API (the
    chart's readinessProbe). A driver that can publish nothing (its user may not write slices) on a node
    whose kubelet never registers it stays live but not ready, says both reasons, and counts its publish
    failures in its metrics."""
    wait_for("the node's driver ready", lambda: _healthcheck(shared.root / "dra.health", ready=True).returncode == 0)

    req = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": {}}
    token = api.client.create("/api/v1/namespaces/default/serviceaccounts/default/token", req)["status"]["token"]
    root = workdir / "unready"
    root.mkdir()
    kubeconfig = root / "kubeconfig"
    kubeconfig.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [
                    {
                        "name": "c",
                        "cluster": {
                            "server": cluster.server(),
                            "certificate-authority": str(cluster.dir / "pki/ca.crt"),
                        },
                    }
                ],
                "users": [{"name": "u", "user": {"token": token}}],
                "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
                "current-context": "c",
            }
        )
    )
    port = kube_cluster.free_port()
    health, log = root / "dra.health", root / "dra.log"
    argv = [
        sys.executable, "-m", "rdma_device_plugin", "dra", "--config", str(shared.config), "--node-name", "no-kubelet",
        "--kubeconfig", str(kubeconfig), "--kubelet-dir", str(root / "kubelet"), "--cdi-dir", str(root / "cdi"),
        "--sysfs-root", shared.fixture.sysfs, "--dev-root", shared.fixture.dev, "--health-file", str(health),
        "--metrics-address", f"127.0.0.1:{port}", "--log-format", "json",
    ]  # fmt: skip
    with log.open("ab") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:

        def unready() -> str | None:
            r = _healthcheck(health, ready=True)
            return r.stderr if r.returncode == 1 and "403" in r.stderr else None

        why = wait_for("not ready, saying why", unready, timeout=60)
        assert "are not all in the API yet: 403" in why, why
        assert "not registered with the kubelet (NotifyRegistrationStatus received)" in why, why
        assert _healthcheck(health, ready=False).returncode == 0  # live: a restart would not help
        m = wait_for(
            "publish failures counted", lambda: (x := _scrape(port))["rdma_dra_publish_failures_total"] > 1 and x
        )
        assert m["rdma_dra_slices_in_sync"] == 0 and m["rdma_dra_registered"] == 0
        published = (
            m['rdma_dra_devices_published{health="Healthy"}'] + m['rdma_dra_devices_published{health="Unhealthy"}']
        )
        assert published == len(slice_devices(api.slices(shared.name)))  # the same fixture node's devices
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)


# ------------------------------------------------------------------ node-scoped writes

SA_NS = "kube-system"
POLICY_KINDS = (
    "ServiceAccount",
    "ClusterRole",
    "ClusterRoleBinding",
    "ValidatingAdmissionPolicy",
    "ValidatingAdmissionPolicyBinding",
)


def _slice(node: str, driver: str = DRIVER, name: str = "") -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": name or f"{node}-{driver}-probe"},
        "spec": {"driver": driver, "nodeName": node, "pool": {"name": node, "resourceSliceCount": 1}, "devices": []},
    }


def _token_client(api: Api, cluster: kube_cluster.Cluster, sa: str, bound: dict[str, Any]) -> kubeapi.Client:
    """The driver's own HTTPS client with a token of ``sa`` bound to ``bound`` (a Node, or a Pod on a node)."""
    ref = {
        "apiVersion": "v1",
        "kind": bound["kind"],
        "name": bound["metadata"]["name"],
        "uid": bound["metadata"]["uid"],
    }
    req = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": {"boundObjectRef": ref}}
    token = api.client.create(f"/api/v1/namespaces/{SA_NS}/serviceaccounts/{sa}/token", req)["status"]["token"]
    return kubeapi.Client(
        kubeapi.Credentials(server=cluster.server(), ca_file=str(cluster.dir / "pki/ca.crt"), token=token)
    )


def _refused(call: Any) -> str:
    try:
        call()
    except kubeapi.ApiError as exc:
        assert exc.code == 403, exc
        return str(exc)
    raise AssertionError("the write was accepted")


def test_a_nodes_token_writes_only_its_own_slices(api: Api, cluster: kube_cluster.Cluster) -> None:
    """The chart's ServiceAccount, RBAC and slice policy in the real API server: a token of the driver's
    ServiceAccount bound to node A (to the Node, or to a pod on it, as the kubelet's projected token is)
    publishes A's slices through the driver's Publisher, and is refused (403) on node B's slices and on
    another driver's slice of A; the admin is not affected."""
    from rdma_device_plugin.dra.publisher import Publisher

    chart = [
        o
        for o in chart_objects({"driver": "dra"})
        if o["kind"] in POLICY_KINDS and (o["kind"] == "ServiceAccount" or "-dra" in o["metadata"]["name"])
    ]
    assert sorted(o["kind"] for o in chart) == sorted(POLICY_KINDS)
    sa = next(o for o in chart if o["kind"] == "ServiceAccount")["metadata"]["name"]
    nodes = [api.apply({"apiVersion": "v1", "kind": "Node", "metadata": {"name": n}}) for n in ("vap-a", "vap-b")]
    theirs = [_slice("vap-b"), _slice("vap-a", GPU_DRIVER)]
    try:
        for obj in chart:
            api.apply(obj)
        b_pod = api.apply(
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": "vap-driver-b", "namespace": SA_NS},
                "spec": {
                    "serviceAccountName": sa,
                    "nodeName": "vap-b",
                    "terminationGracePeriodSeconds": 0,
                    "containers": [{"name": "c", "image": "registry.example.com/workload:1"}],
                },
            }
        )
        for obj in theirs:
            api.apply(obj)
        a = _token_client(api, cluster, sa, nodes[0])
        b = _token_client(api, cluster, sa, b_pod)
        # The policy is in force once the API server's informers have it (a dry run changes nothing).
        wait_for(
            "the slice policy in force",
            lambda: _denied_dry_run(a, "vap-b-rdma.lingjun.io-probe"),
            timeout=60,
        )

        # Its own node: the driver's Publisher creates, rewrites and deletes A's slices.
        pub = Publisher(a, DRIVER, "vap-a")
        spec = _slice("vap-a")["spec"]
        pub.set_specs({"devices": spec})
        assert pub.reconcile() and len(api.slices("vap-a")) == 1
        pub.set_specs({"devices": {**spec, "devices": [{"name": "d0"}]}})
        assert pub.reconcile() and api.slices("vap-a")[0]["spec"]["devices"] == [{"name": "d0"}]
        pub.delete_all()
        assert api.slices("vap-a") == []

        # Node B's slice: create, update, delete refused (spec.nodeName itself is immutable).
        b_slice = api.get(f"{SLICES}/vap-b-{DRIVER}-probe")
        who = f"system:serviceaccount:{SA_NS}:{sa} on node vap-a may write only that node's ResourceSlices"
        assert who in _refused(lambda: a.create(SLICES, _slice("vap-b", name="forged")))
        assert "not node vap-b's" in _refused(lambda: a.update(f"{SLICES}/{b_slice['metadata']['name']}", b_slice))
        assert "not node vap-b's" in _refused(lambda: a.delete(f"{SLICES}/{b_slice['metadata']['name']}"))
        # Another driver's slice on its own node (the GPU driver's): refused too.
        gpu = f"{SLICES}/vap-a-{GPU_DRIVER}-probe"
        assert f"not of {GPU_DRIVER}" in _refused(lambda: a.delete(gpu))
        assert f"not of {GPU_DRIVER}" in _refused(lambda: a.create(SLICES, _slice("vap-a", GPU_DRIVER, "gpu-forged")))
        # A token bound to a pod on node B (the kubelet's projected token): B's slices only.
        b.delete(f"{SLICES}/{b_slice['metadata']['name']}")
        assert "on node vap-b may write only" in _refused(lambda: b.create(SLICES, _slice("vap-a", name="forged")))
        # Nothing the refused calls tried is there; the admin is not matched by the policy.
        assert api.slices("vap-b") == [] and [s["metadata"]["name"] for s in api.slices("vap-a", GPU_DRIVER)] == [
            f"vap-a-{GPU_DRIVER}-probe"
        ]
    finally:
        for obj in [*theirs, *reversed(chart)]:
            api.delete(obj)
        api.delete({"kind": "Pod", "metadata": {"name": "vap-driver-b", "namespace": SA_NS}})
        for n in nodes:
            api.delete(n)


def _denied_dry_run(client: kubeapi.Client, name: str) -> bool:
    try:
        client.request("DELETE", f"{SLICES}/{name}", query={"dryRun": "All"})
    except kubeapi.ApiError as exc:
        return exc.code == 403
    return False


# ------------------------------------------------------------------ the last line of defence


def _device(api: Api, node: DraNode, nic: str, view: str) -> str:
    """The published device of ``nic`` (its RDMA device name) in ``view`` (shared | exclusive)."""
    devices = slice_devices(complete(api.slices(node.name)) or [])
    (name,) = [
        n
        for n, d in devices.items()
        if d["attributes"].get("rdmaDevice", {}).get("string") == nic and attr(d, "sharing") == view
    ]
    return name


def _write_allocation(api: Api, name: str, node: DraNode, *devices: str, pod_name: str = "") -> dict[str, Any]:
    """Allocate claim ``name`` as an admin would: ``devices`` written to its status directly, no
    scheduler (and none of its counters) involved; reserved for pod ``pod_name`` when given. A device
    of a shared view gets a share."""
    published = slice_devices(complete(api.slices(node.name)) or [])
    results = []
    for d in devices:
        r: dict[str, Any] = {"request": "nic", "driver": DRIVER, "pool": node.name, "device": d}
        if published[d].get("allowMultipleAllocations"):
            r["shareID"] = str(uuid.uuid4())
        results.append(r)
    obj = api.claim(name)
    on_node = [{"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node.name]}]}]
    obj["status"] = {
        "allocation": {"devices": {"results": results}, "nodeSelector": {"nodeSelectorTerms": on_node}}
        if devices
        else None
    }
    if pod_name:
        uid = (api.pod(pod_name) or {})["metadata"]["uid"]
        obj["status"]["reservedFor"] = [{"resource": "pods", "name": pod_name, "uid": uid}]
    return api.client.update(f"/apis/resource.k8s.io/v1/namespaces/default/resourceclaims/{name}/status", obj)


def _boot_id(node: DraNode) -> str:
    return Path(node.fixture.procfs, "sys/kernel/random/boot_id").read_text().strip()


def _events(api: Api, pod_name: str, reason: str) -> list[str]:
    found = api.get(
        "/api/v1/namespaces/default/events", fieldSelector=f"involvedObject.name={pod_name},reason={reason}"
    )
    return [str(e.get("message", "")) for e in found["items"]]


def test_prepare_refuses_a_nic_prepared_for_another_claim_in_a_conflicting_view(
    api: Api, exclusive: DraNode, objs: Objects
) -> None:
    """Allocations written around the scheduler (claims' status and pods' nodeName, as an admin
    would): mlx5_bond_1 exclusive to one claim and shared with another. The kubelet prepares the
    first; the second is refused naming both claims, and prepared once the first is gone."""
    whole, share = _device(api, exclusive, "mlx5_bond_1", "exclusive"), _device(api, exclusive, "mlx5_bond_1", "shared")
    for name, device in (("adm-x", whole), ("adm-s", share)):
        objs.claim(name, request("nic", NIC if device == share else EXCLUSIVE, nic_is("mlx5_bond_1")))
        obj = pod(name, exclusive.name, (name,), grace=0)
        obj["spec"]["nodeName"] = exclusive.name  # no scheduler: the pod is bound as written
        api.create(obj)
        objs.pods.append(obj)
        _write_allocation(api, name, exclusive, device, pod_name=name)
        if name == "adm-x":
            wait_for("the exclusive claim's pod running", lambda: running(api, "adm-x"))
    refused = lambda: [m for m in _events(api, "adm-s", "FailedPrepareDynamicResources") if "already prepared" in m]  # noqa: E731
    message = wait_for("the share refused", refused)[0]  # (before its reservation: "not allowed to use")
    x_uid = api.claim("adm-x")["metadata"]["uid"]
    assert "claim default/adm-s: NIC mlx5_bond_1 (0000:3a:00.0) is already prepared for claim default/adm-x" in message
    assert f"(UID {x_uid}) as its exclusive device {whole}; this claim's shared device {share} cannot" in message
    assert not running(api, "adm-s")
    s_uid = api.claim("adm-s")["metadata"]["uid"]
    assert not (exclusive.cdi_dir / f"{DRIVER}-claim_{s_uid}.json").exists()
    # Refused for the conflict alone: the exclusive holder gone (unprepared), the share is prepared.
    objs.delete_pod("adm-x")
    wait_for("the share's pod running once the NIC is free", lambda: running(api, "adm-s"), timeout=180)
    assert exclusive.got("adm-s")[0]["RDMA_DEVICES"] == "mlx5_bond_1"


def test_a_cached_answer_only_for_the_same_allocation(api: Api, exclusive: DraNode, objs: Objects) -> None:
    """Concurrent prepares of one claim write it once (the claim's lock runs them one at a time);
    deallocated and allocated again under the same UID, prepare answers the new allocation."""
    objs.claim("realloc", request("nic", EXCLUSIVE))
    first, second = (_device(api, exclusive, nic, "exclusive") for nic in ("mlx5_bond_0", "mlx5_bond_1"))
    _write_allocation(api, "realloc", exclusive, first)
    uid = api.claim("realloc")["metadata"]["uid"]
    cdi = exclusive.cdi_dir / f"{DRIVER}-claim_{uid}.json"
    try:
        # 16 prepares of the claim sent at once over one connection: one writes the spec, the others
        # get its answer.
        sock = exclusive.endpoint
        with grpc.insecure_channel(f"unix://{sock}") as ch:
            stub = dra_v1_pb2_grpc.DRAPluginStub(ch)
            req = dra_v1_pb2.NodeUnprepareResourcesRequest(claims=[dra_v1_pb2.Claim(uid=str(uuid.uuid4()))])
            stub.NodeUnprepareResources(req, timeout=30)  # connected: the 16 calls below start together
            start = threading.Barrier(16)

            def prepare(_: int) -> list[tuple[str, ...]]:
                one = dra_v1_pb2.Claim(namespace="default", uid=uid, name="realloc")
                start.wait()
                answer = stub.NodePrepareResources(dra_v1_pb2.NodePrepareResourcesRequest(claims=[one]), timeout=30)
                return _devices(answer.claims[uid])

            with ThreadPoolExecutor(16) as pool:
                answers = list(pool.map(prepare, range(16)))
        assert len(set(map(tuple, answers))) == 1 and answers[0][0][1] == first
        logged = [r for r in exclusive.log_lines() if r.get("msg") == "claim prepared" and r.get("uid") == uid]
        assert len(logged) == 1
        assert [d.device_name for d in _prepare(exclusive, uid, "realloc").devices] == [first]  # cached
        _write_allocation(api, "realloc", exclusive)
        _write_allocation(api, "realloc", exclusive, second)
        assert [d.device_name for d in _prepare(exclusive, uid, "realloc").devices] == [second]
        assert "RDMA_DEVICES=mlx5_bond_1" in json.loads(cdi.read_text())["containerEdits"]["env"]
    finally:
        _unprepare(exclusive, uid, "realloc")


def _waiting_in(thread: threading.Thread, function: str) -> bool:
    """``thread`` is (blocked) in ``function`` now."""
    frame = sys._current_frames().get(thread.ident or -1)
    return frame is not None and frame.f_code.co_name == function


def test_calls_for_one_claim_wait_for_each_other_and_not_for_other_claims(
    api: Api, cluster: kube_cluster.Cluster, objs: Objects, tmp_path: Path
) -> None:
    """The lock per claim, with the calls overlapping for real, and the node-wide serialize.lock held
    only where a call decides on files (issue 38: ten pods at once queued behind each other's API
    reads). A prepare of claim A held inside the driver (its read of the claim, from the real API
    server, waits for the test): a second call for A waits for it, a call for claim B does not, with
    the node's lock as the driver takes it."""
    from rdma_device_plugin.dra.claims import ClaimError, Claims
    from rdma_device_plugin.dra.kubeletplugin import SerializeLock

    objs.claim("lock-a", request("nic", NIC))
    objs.claim("lock-b", request("nic", NIC))
    uid = {n: api.claim(n)["metadata"]["uid"] for n in ("lock-a", "lock-b")}
    # B allocated (as an admin would) on another node: its prepare takes the node lock to look for a
    # record, then refuses the devices of another node.
    b = api.claim("lock-b")
    b["status"] = {
        "allocation": {"devices": {"results": [dict(request="nic", driver=DRIVER, pool="elsewhere", device="x")]}}
    }
    api.client.update("/apis/resource.k8s.io/v1/namespaces/default/resourceclaims/lock-b/status", b)
    node_lock = SerializeLock(str(tmp_path / "serialize.lock"))
    taken: list[str] = []

    @contextlib.contextmanager
    def held() -> Iterator[None]:
        with node_lock.held():
            taken.append(threading.current_thread().name)
            yield

    entered: list[str] = []  # the claims the driver read, in order; "released" when the test let A go
    release = threading.Event()

    class Held(kubeapi.Client):
        def get(self, path: str, query: Any = None) -> dict[str, Any]:
            name = path.rsplit("/", 1)[-1]
            entered.append(name)
            if entered == ["lock-a"]:  # the first call holds here until the test releases it
                assert release.wait(120)
            return super().get(path, query)

    claims = Claims(
        Held(kubeapi.from_kubeconfig(str(cluster.kubeconfig))),
        DRIVER,
        "nowhere",
        str(tmp_path / "state"),
        str(tmp_path / "cdi"),
        lambda: model.build(DRIVER, "nowhere", "shared", [], [], {}),
        NodeInventory(load_config_data({"version": "v1"}), str(tmp_path), str(tmp_path)),  # no NIC: never read
        node_lock=held,
    )
    taken.clear()  # the start's
    answers: dict[str, list[str]] = {}

    def prepare(name: str) -> None:
        try:
            claims.prepare("default", uid[name], name)
        except ClaimError as exc:  # not allocated: what a read of these claims answers
            answers.setdefault(name, []).append(str(exc))

    first = threading.Thread(target=prepare, args=("lock-a",), name="a1")
    first.start()
    wait_for("the first prepare of lock-a held in its read", lambda: entered == ["lock-a"])
    second = threading.Thread(target=prepare, args=("lock-a",), name="a2")
    second.start()
    # Either through to its read (no lock) or blocked in the claim's lock: then it cannot get through.
    wait_for("the second call in", lambda: entered.count("lock-a") == 2 or _waiting_in(second, "_serialized"))
    other = threading.Thread(target=prepare, args=("lock-b",), name="b")
    other.start()
    other.join(timeout=120)
    assert not other.is_alive()
    assert answers["lock-b"] == [f"claim default/lock-b: devices ['elsewhere/x'] of {DRIVER} are not on node nowhere"]
    # B went by, through the node lock, while A holds in its API read; A's second call waits.
    assert entered == ["lock-a", "lock-b"] and taken == ["b"] and second.is_alive()
    entered.append("released")
    release.set()
    first.join(timeout=120)
    second.join(timeout=120)
    assert entered == ["lock-a", "lock-b", "released", "lock-a"]
    assert answers["lock-a"] == ["claim default/lock-a is not allocated"] * 2


class _OldServer(ThreadingHTTPServer):
    """An API server's ``/version`` as a lower release answers it (the real server's document, its
    version fields changed), over TLS with the cluster's own serving certificate; nothing else served."""

    def __init__(self, cluster: kube_cluster.Cluster, doc: dict[str, Any]) -> None:
        self.doc, self.paths = doc, list[str]()
        super().__init__(("127.0.0.1", 0), _OldServerHandler)
        pki = cluster.dir / "pki"
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.load_cert_chain(pki / "apiserver.crt", pki / "apiserver.key")
        self.socket = ctx.wrap_socket(self.socket, server_side=True)


class _OldServerHandler(BaseHTTPRequestHandler):
    server: _OldServer

    def do_GET(self) -> None:
        self.server.paths.append(self.path)
        found = self.path == "/version"
        body = json.dumps(self.server.doc if found else {"kind": "Status", "code": 404}).encode()
        self.send_response(200 if found else 404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


def test_a_server_below_the_floor_is_refused_by_name(
    api: Api, cluster: kube_cluster.Cluster, exclusive: DraNode, workdir: Path
) -> None:
    """On a 1.36 API server the driver starts nothing (no socket, no slice), stays live and not Ready,
    and its log and readiness name the server's version, the floor and what to do; the real v1.37.2
    server is one it runs with (every other test here)."""
    real = api.get("/version")
    assert real["gitVersion"] == "v1.37.2" and version.refusal(real) == ""
    old = _OldServer(cluster, {**real, "minor": "36", "gitVersion": "v1.36.2"})
    threading.Thread(target=old.serve_forever, daemon=True).start()
    tmp_path = workdir / "old"  # short: the socket paths the driver checks at its start
    tmp_path.mkdir()
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(kube_cluster.kubeconfig(f"https://127.0.0.1:{old.server_address[1]}", cluster.dir / "pki"))
    log, health = tmp_path / "driver.log", tmp_path / "health"
    kubelet = tmp_path / "kubelet"
    proc = exclusive.spawn(
        str(uuid.uuid4()),
        exclusive.config,
        log,
        health,
        *("--kubeconfig", str(kubeconfig), "--kubelet-dir", str(kubelet), "--cdi-dir", str(tmp_path / "cdi")),
    )
    try:
        said = wait_for("the refusal logged", lambda: [r for r in exclusive.log_lines(log) if r["level"] == "error"])
        assert [r["msg"] for r in said] == ["not serving this node: the API server is not supported"]
        why = said[0]["error"]
        for part in ("Kubernetes v1.36.2", "needs 1.37 or later (tested on v1.37.2)", "kubernetes#138882", "#139034"):
            assert part in why
        assert "node-restriction.kubernetes.io/rdma-driver=devicePlugin" in why
        assert "docs/dra.md, Supported versions" in why
        wait_for("the health file", health.exists)
        ready = _healthcheck(health, ready=True)
        assert ready.returncode != 0 and why in ready.stderr
        assert _healthcheck(health, ready=False).returncode == 0  # live: no restart loop that hides why
        assert proc.poll() is None and old.paths and set(old.paths) == {"/version"}
        assert not (kubelet / "plugins_registry").exists() and not list(kubelet.rglob("*.sock"))
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0 and not health.exists()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=60)
        old.shutdown()
        old.server_close()


def test_claim_uid_and_name_never_reach_beyond_their_file_and_url(api: Api, exclusive: DraNode, objs: Objects) -> None:
    """Issue 39 item 5: a ``../`` UID names no file (the call fails, the target stays), and a name
    with ``?`` names no other claim (escaped in the URL, not cut there)."""
    victim = exclusive.kubelet_dir / "victim.json"  # <state-dir>/claims/../../../victim.json
    victim.write_text("{}")
    for uid in ("../../../victim", "../../../../var/lib/kubelet/victim"):
        answer = _unprepare(exclusive, uid, "x")
        assert f"claim UID {uid!r} is not a Kubernetes UID" in answer.error
        assert "is not a Kubernetes UID" in _prepare(exclusive, uid, "x").error
    assert victim.read_text() == "{}"

    objs.claim("plain", request("nic", EXCLUSIVE))
    _write_allocation(api, "plain", exclusive, _device(api, exclusive, "mlx5_bond_0", "exclusive"))
    uid = api.claim("plain")["metadata"]["uid"]
    answer = _prepare(exclusive, uid, "plain?pretty=1")  # unescaped, this would read claim "plain"
    assert "claim default/plain?pretty=1: reading it from the API server failed (404" in answer.error
    assert not answer.devices and not (exclusive.cdi_dir / f"{DRIVER}-claim_{uid}.json").exists()


def test_records_survive_a_restart_are_dropped_by_a_reboot_and_orphans_are_collected(
    api: Api, exclusive: DraNode, objs: Objects
) -> None:
    objs.claim("kept", request("nic", EXCLUSIVE))
    _write_allocation(api, "kept", exclusive, _device(api, exclusive, "mlx5_bond_0", "exclusive"))
    objs.claim("deleted", request("nic", EXCLUSIVE))
    _write_allocation(api, "deleted", exclusive, _device(api, exclusive, "mlx5_bond_1", "exclusive"))
    kept, deleted = api.claim("kept")["metadata"]["uid"], api.claim("deleted")["metadata"]["uid"]
    records = exclusive.state_dir / "claims"
    try:
        assert not _prepare(exclusive, kept, "kept").error and not _prepare(exclusive, deleted, "deleted").error
        exclusive.stop_driver()
        api.delete(claim("deleted", []))  # gone while the driver was down: the kubelet never unprepares it
        stray = exclusive.cdi_dir / f"{DRIVER}-claim_{uuid.uuid4()}.json"  # a spec without a record
        stray.write_text("{}")
        cut_short, in_flight = exclusive.cdi_dir / ".tmp-old.json", exclusive.cdi_dir / ".tmp-new.json"
        for tmp in (cut_short, in_flight):
            tmp.write_text("{")
        os.utime(cut_short, (time.time() - 120, time.time() - 120))  # a write cut short 2 minutes ago
        mtime = (exclusive.cdi_dir / f"{DRIVER}-claim_{kept}.json").stat().st_mtime_ns
        exclusive.start_driver()
        wait_for(
            "the deleted claim's record and spec, the stray spec and the old temp file collected",
            lambda: (
                not (records / f"{deleted}.json").exists()
                and not (exclusive.cdi_dir / f"{DRIVER}-claim_{deleted}.json").exists()
                and not stray.exists()
                and not cut_short.exists()
            ),
        )
        assert in_flight.exists()  # maybe the device plugin's spec being written: left alone
        in_flight.unlink()
        # The restart kept the live claim's record: the answer comes without writing the spec.
        assert (records / f"{kept}.json").exists()
        answer = wait_for("prepare after the restart", lambda: _retry_prepare(exclusive, kept, "kept"))
        assert not answer.error
        assert (exclusive.cdi_dir / f"{DRIVER}-claim_{kept}.json").stat().st_mtime_ns == mtime
        # A reboot (a new boot ID): nothing prepared before it holds.
        exclusive.stop_driver()
        exclusive.fixture.reboot()
        exclusive.start_driver()
        wait_for("the driver serving again", lambda: _retry_prepare(exclusive, kept, "kept") is not None)
        assert json.loads((records / f"{kept}.json").read_text())["boot"] == _boot_id(exclusive)
        assert (exclusive.cdi_dir / f"{DRIVER}-claim_{kept}.json").stat().st_mtime_ns != mtime
    finally:
        _unprepare(exclusive, kept, "kept")


def _claims_in_process(node: DraNode, client: kubeapi.Client, tmp_path: Path, node_lock: Any = None) -> Any:
    """The driver's Claims in the test process, over ``node``'s NICs (its config and fixture), with
    its state and CDI dirs under ``tmp_path``."""
    from rdma_device_plugin.config import load_config
    from rdma_device_plugin.dra.claims import Claims
    from rdma_device_plugin.dra.inventory import Inventory

    config = load_config(str(node.config))
    nics = NodeInventory(config, node.fixture.sysfs, node.fixture.dev)
    nics.full()
    inventory = Inventory(config, node.fixture.sysfs)
    published = model.build(
        DRIVER, node.name, config.mode, inventory.resources(), inventory.views(nics), inventory.unhealthy_since
    )
    state, cdi = str(tmp_path / "state"), str(tmp_path / "cdi")
    return Claims(client, DRIVER, node.name, state, cdi, lambda: published, nics, node_lock=node_lock)


def test_two_instances_share_the_records_on_disk(
    api: Api, cluster: kube_cluster.Cluster, exclusive: DraNode, objs: Objects, tmp_path: Path
) -> None:
    """A rolling update runs two instances of the driver on the node, over one records dir and one CDI
    dir, under one serialization lock; the kubelet may call either. What one prepares the other's
    collector never takes for an orphan (the real node's rollout lost a claim's CDI spec so: containerd
    "unresolvable CDI devices"), the other refuses a conflicting view of it by name, and unprepares it.
    Two Claims of the driver in this process, each with its own SerializeLock on the same file."""
    from rdma_device_plugin.dra.claims import ClaimError
    from rdma_device_plugin.dra.kubeletplugin import SerializeLock

    def instance() -> Any:
        client = kubeapi.Client(kubeapi.from_kubeconfig(str(cluster.kubeconfig)))
        return _claims_in_process(exclusive, client, tmp_path, SerializeLock(str(tmp_path / "serialize.lock")).held)

    old, new = instance(), instance()  # the new one started before the old one prepares
    objs.claim("two-a", request("nic", EXCLUSIVE))
    _write_allocation(api, "two-a", exclusive, _device(api, exclusive, "mlx5_bond_0", "exclusive"))
    objs.claim("two-b", request("nic", EXCLUSIVE))  # the same NIC: written as an admin could
    _write_allocation(api, "two-b", exclusive, _device(api, exclusive, "mlx5_bond_0", "exclusive"))
    a, b = (api.claim(n)["metadata"]["uid"] for n in ("two-a", "two-b"))
    spec = tmp_path / "cdi" / f"{DRIVER}-claim_{a}.json"
    old.prepare("default", a, "two-a")
    assert spec.exists()
    assert new.collect() == 0
    assert spec.exists(), "the new instance's collector removed a claim the old one prepared"
    assert set(new.prepared()) == {a}
    with pytest.raises(ClaimError, match=re.escape(f"already prepared for claim default/two-a (UID {a})")):
        new.prepare("default", b, "two-b")
    new.unprepare("default", a, "two-a")
    assert not spec.exists() and not (tmp_path / "state" / "claims" / f"{a}.json").exists()
    assert old.collect() == 0 and old.prepared() == {}  # the old one's view follows the disk
    new.prepare("default", b, "two-b")  # the NIC is free again
    assert old.collect() == 0 and set(old.prepared()) == {b}
    old.unprepare("default", b, "two-b")
    assert new.collect() == 0 and new.prepared() == {}


def test_the_orphan_collector_skips_fresh_claims_and_reads_the_watch_cache(
    api: Api, cluster: kube_cluster.Cluster, exclusive: DraNode, objs: Objects, tmp_path: Path
) -> None:
    """What a pass costs the API server (issue 38): a claim prepared since the previous pass is not
    asked about; the others are read from the API server's watch cache (resourceVersion "0"), and only
    one that is gone there is read again from etcd (a quorum read) before its record is dropped. The
    driver's own Claims in this process, on the exclusive node's NICs, its GETs recorded. An orphan in
    the way of a new claim's prepare is checked and dropped right then."""
    gets: list[tuple[str, dict[str, str]]] = []

    class Recording(kubeapi.Client):
        def get(self, path: str, query: Any = None) -> dict[str, Any]:
            gets.append((path.rsplit("/", 1)[-1], dict(query or {})))
            return super().get(path, query)

    claims = _claims_in_process(exclusive, Recording(kubeapi.from_kubeconfig(str(cluster.kubeconfig))), tmp_path)
    names = {"orph-old": "mlx5_bond_0", "orph-gone": "mlx5_bond_1", "orph-new": "mlx5_bond_2"}
    for name, nic in names.items():
        objs.claim(name, request("nic", EXCLUSIVE))
        _write_allocation(api, name, exclusive, _device(api, exclusive, nic, "exclusive"))
    uid = {n: api.claim(n)["metadata"]["uid"] for n in names}
    for name in ("orph-old", "orph-gone"):
        claims.prepare("default", uid[name], name)
    gets.clear()
    assert claims.collect() == 0 and gets == []  # prepared since the last pass: not asked about
    claims.prepare("default", uid["orph-new"], "orph-new")
    api.delete(claim("orph-gone", []))

    def gone_from_the_cache() -> bool:
        try:
            api.client.get(kubeapi.claim_path("default", "orph-gone"), {"resourceVersion": "0"})
        except kubeapi.ApiError as exc:
            return kubeapi.not_found(exc)
        return False

    wait_for("the deletion in the API server's watch cache", gone_from_the_cache)
    gets.clear()
    assert claims.collect() == 1
    cached = {"resourceVersion": "0"}
    assert sorted(gets, key=str) == sorted([("orph-gone", cached), ("orph-gone", {}), ("orph-old", cached)], key=str)
    assert set(claims.prepared()) == {uid["orph-old"], uid["orph-new"]}
    # The next pass asks about the claim prepared before the last one too, again from the cache only.
    gets.clear()
    assert claims.collect() == 0
    assert sorted(gets, key=str) == sorted([("orph-new", cached), ("orph-old", cached)], key=str)
    # An orphan in the way of a claim the scheduler allocated goes at that prepare (a quorum read of
    # the claim it held), not at the next pass: the new claim is not refused meanwhile.
    objs.claim("orph-next", request("nic", EXCLUSIVE))
    _write_allocation(api, "orph-next", exclusive, _device(api, exclusive, names["orph-old"], "exclusive"))
    uid["orph-next"] = api.claim("orph-next")["metadata"]["uid"]
    api.delete(claim("orph-old", []))
    gets.clear()
    claims.prepare("default", uid["orph-next"], "orph-next")
    assert gets == [("orph-next", {}), ("orph-old", {})]
    assert set(claims.prepared()) == {uid["orph-new"], uid["orph-next"]}
    for name in ("orph-new", "orph-next"):
        claims.unprepare("default", uid[name], name)


# ------------------------------------------------------------------ names that survive a reboot


def _reboot_with(node: DraNode, spec: fixtures.NodeSpec) -> None:
    """The node reboots into ``spec`` (a new boot ID): the driver stopped, the fixture rewritten."""
    node.stop_driver()
    node.fixture = fixtures.write_node(str(node.root / "fx"), spec)
    node.start_driver()


def test_device_names_and_alignment_do_not_move_when_the_kernel_renames_nics(
    api: Api, exclusive: DraNode, objs: Objects
) -> None:
    """A reboot gives mlx5_bond_0 and mlx5_bond_2 each other's names (probe order). The claim keeps
    its device, the device keeps its PCI function and pcieRoot, and prepare hands out that function."""
    spec = fixtures.lingjun_node(nics=4)
    _reboot_with(exclusive, spec)  # all four NICs (an earlier test removed one, a restart forgot it)
    wait_for("the four NICs published", lambda: len(slice_devices(complete(api.slices(exclusive.name)) or [])) == 9)
    objs.claim("stable", request("nic", EXCLUSIVE, nic_is("mlx5_bond_0")))
    objs.pod("stable", exclusive, ("stable",), grace=0)
    wait_for("the pod running", lambda: running(api, "stable"))
    (device,) = allocated_devices(api, "stable")
    uid = api.claim("stable")["metadata"]["uid"]
    before = slice_devices(complete(api.slices(exclusive.name)) or [])
    where = (attr(before[device], PCI_BUS_ID), attr(before[device], PCIE_ROOT))
    assert device == X["mlx5_bond_0"] and where == ("0000:1a:00.0", "pci0000:15")
    _, nodes_before = exclusive.got("stable")
    swap = {"mlx5_bond_0": "mlx5_bond_2", "mlx5_bond_2": "mlx5_bond_0"}
    renamed = replace(spec, nics=tuple(replace(n, name=swap.get(n.name, n.name)) for n in spec.nics))
    try:
        _reboot_with(exclusive, renamed)

        def republished() -> dict[str, dict[str, Any]] | None:
            now = slice_devices(complete(api.slices(exclusive.name)) or [])
            return now if now and attr(now[device], "rdmaDevice") == "mlx5_bond_2" else None

        after = wait_for("the slices of the renamed NICs", republished)
        assert set(after) == set(before)
        assert (attr(after[device], PCI_BUS_ID), attr(after[device], PCIE_ROOT)) == where
        assert {n: attr(d, PCI_BUS_ID) for n, d in after.items() if PCI_BUS_ID in d["attributes"]} == {
            n: attr(d, PCI_BUS_ID) for n, d in before.items() if PCI_BUS_ID in d["attributes"]
        }
        assert allocated_devices(api, "stable") == [device]
        # The kubelet prepares the claim again after a reboot: the same PCI function, by its new name.
        answer = wait_for("prepare after the reboot", lambda: _retry_prepare(exclusive, uid, "stable"))
        assert not answer.error and [d.device_name for d in answer.devices] == [device]
        env, nodes = exclusive.got("stable")
        assert env["RDMA_DEVICES"] == "mlx5_bond_2" and sorted(nodes) == sorted(nodes_before)
    finally:
        _reboot_with(exclusive, spec)

        def original() -> bool:  # the pool is incomplete for a moment while the new instance writes it
            now = slice_devices(complete(api.slices(exclusive.name)) or [])
            return device in now and attr(now[device], "rdmaDevice") == "mlx5_bond_0"

        wait_for("the slices of the original names", original)


def test_a_61_character_resource_name_makes_slices_the_api_accepts(api: Api, shared: DraNode) -> None:
    """all-<resource> of a 61-character short name would be 65 characters: cut to a valid name, the
    slices are accepted by the real API server's validation (the whole name, 63 characters, fits an
    attribute; a longer one is refused by the driver: test_dra_model)."""
    resource = "a/" + "r" * 61
    nics = sysfs.read_nics(shared.fixture.sysfs, shared.fixture.dev)
    views = [model.NicView(n, NicHealth(True, ("ACTIVE",)), resource) for n in nics]
    pub = model.build("long.example.com", "n-long", "shared", [model.ResourceView(resource, 10, "all")], views, {})
    (whole,) = [d["name"] for d in pub.devices["devices"] if "nicCount" in d["attributes"]]
    assert len(whole) == 63 and whole.startswith("all-rrr")
    created = []
    try:
        for spec in (pub.counters, pub.devices):
            body = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": {"generateName": "long-"}}
            created.append(api.client.create(SLICES, {**body, "spec": spec})["metadata"]["name"])
        got = slice_devices(api.get(SLICES, fieldSelector="spec.driver=long.example.com")["items"])
        assert whole in got and len(got) == 2 * len(nics) + 1
    finally:
        for name in created:
            api.client.delete(f"{SLICES}/{name}")


# ------------------------------------------------------------------ 33 NICs, 8 rails


@pytest.fixture(scope="module")
def many(cluster: kube_cluster.Cluster, api: Api, workdir: Path) -> Iterator[DraNode]:
    """A node with 33 NICs (mlx5_0 .. mlx5_16 on NUMA node 0, the rest on 1): more than one counter set
    holds. Shared mode with numaPools: rdma/hca-numa<N> served through DRA too."""
    numa_pools = {"resources": [{"name": "rdma/hca", "numaPools": True}]}
    spec = fixtures.many_nics_node(33)
    n = DraNode(cluster, "n3", workdir / "n3", index=3, spec=spec, config=numa_pools).start_driver()
    try:
        wait_for("n3's ResourceSlices", lambda: complete(api.slices("n3")))
        yield n
    finally:
        n.close()


def test_33_nics_are_published_and_allocated(api: Api, many: DraNode, objs: Objects) -> None:
    slices = wait_for("n3's slices", lambda: complete(api.slices(many.name)))
    assert sorted(s["metadata"]["labels"]["rdma.lingjun.io/slice"] for s in slices) == [
        "counters",
        "devices",
        "devices-1",
    ]
    devices = slice_devices(slices)
    assert len(devices) == 2 * 33 + 3  # two views per NIC, every NIC as a set, each NUMA node's NICs as a set
    # An rdma/hca pod (shared mode: the set of every NIC) gets all 33.
    objs.pod("hca-33", many, limits={"rdma/hca": "1"}, grace=0)
    wait_for("the rdma/hca pod running", lambda: running(api, "hca-33"))
    env, nodes = many.got("hca-33")
    assert sorted(env["RDMA_DEVICES"].split(",")) == sorted(f"mlx5_{i}" for i in range(33))
    assert len([n for n in nodes if "uverbs" in n]) == 33
    # mlx5_32's counter is in the second counter set: its exclusive view waits for the set's share.
    objs.claim("x-32", request("nic", EXCLUSIVE, nic_is("mlx5_32")))
    objs.pod("x-32", many, ("x-32",))
    assert "cannot allocate all claims" in wait_for("the exclusive claim refused", lambda: unschedulable(api, "x-32"))
    objs.delete_pod("hca-33")
    wait_for("the exclusive claim's pod running", lambda: running(api, "x-32"), timeout=180)
    assert allocated_devices(api, "x-32") == [_device(api, many, "mlx5_32", "exclusive")]


def test_an_8_rail_pod_gets_every_nic_in_one_env(api: Api, many: DraNode, objs: Objects) -> None:
    """8 claims of one NIC each in one container (as 8 GPU+NIC rails): the env names all 8 NICs,
    exactly as the device plugin's env for those 8 NICs, whichever claim's CDI spec is applied last."""
    rails = [f"mlx5_{i}" for i in range(8)]
    names = tuple(objs.claim(f"rail-{i}", request("nic", EXCLUSIVE, nic_is(n))) for i, n in enumerate(rails))
    objs.pod("rails", many, names)
    wait_for("the 8-rail pod running", lambda: running(api, "rails"))
    env, nodes = many.got("rails")
    assert sorted(env["RDMA_DEVICES"].split(",")) == sorted(rails)
    assert all(n in env["NCCL_IB_HCA"] for n in rails)
    assert env == _device_plugin_env(many, "exclusive", rails)
    assert len([n for n in nodes if "uverbs" in n]) == 8
    # Each claim's spec alone carries that env (what a runtime keeps whatever the order).
    for name in names:
        uid = api.claim(name)["metadata"]["uid"]
        spec = json.loads((many.cdi_dir / f"{DRIVER}-claim_{uid}.json").read_text())
        assert dict(kv.split("=", 1) for kv in spec["containerEdits"]["env"]) == env


def test_containers_with_different_nics_through_one_claim_are_refused(api: Api, many: DraNode, objs: Objects) -> None:
    objs.claim("both-a", request("nic", EXCLUSIVE, nic_is("mlx5_10")))
    objs.claim("both-b", request("nic", EXCLUSIVE, nic_is("mlx5_11")))
    obj = pod("two-sets", many.name, ("both-a", "both-b"), grace=0)
    first = obj["spec"]["containers"][0]
    obj["spec"]["containers"].append({**first, "name": "d", "resources": {"claims": [{"name": "c0"}]}})
    api.create(obj)
    objs.pods.append(obj)
    message = wait_for("the claim refused", lambda: _events(api, "two-sets", "FailedPrepareDynamicResources"))[0]
    assert "claim default/both-a is used by containers that hold different sets of rdma.lingjun.io NICs" in message
    assert "two-sets/c: mlx5_10, mlx5_11; two-sets/d: mlx5_10" in message


def test_numa_pools_through_dra(api: Api, many: DraNode, objs: Objects) -> None:
    """A device-plugin pod asking rdma/hca-numa1 (numaPools) runs on a DRA node with NUMA node 1's NICs."""
    objs.pod("numa1-pod", many, limits={"rdma/hca-numa1": "1"}, grace=0)
    p = wait_for("the rdma/hca-numa1 pod running", lambda: running(api, "numa1-pod"))
    claim_name = p["status"]["extendedResourceClaimStatus"]["resourceClaimName"]
    assert allocated_devices(api, claim_name) == ["all-hca-numa1"]
    env, _ = many.got("numa1-pod")
    assert sorted(env["RDMA_DEVICES"].split(",")) == sorted(f"mlx5_{i}" for i in range(17, 33))


# ------------------------------------------------------------------ metrics behind auth

METRICS_VALUES = {
    "metrics": {
        "enabled": True,
        "auth": {"readers": [{"kind": "ServiceAccount", "name": "metrics-reader", "namespace": SA_NS}]},
    }
}


def _token(api: Api, sa: str) -> str:
    req = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": {}}
    return str(api.client.create(f"/api/v1/namespaces/{SA_NS}/serviceaccounts/{sa}/token", req)["status"]["token"])


def _token_kubeconfig(path: Path, cluster: kube_cluster.Cluster, token: str) -> Path:
    doc = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "c",
                "cluster": {"server": cluster.server(), "certificate-authority": str(cluster.dir / "pki/ca.crt")},
            }
        ],
        "users": [{"name": "u", "user": {"token": token}}],
        "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
        "current-context": "c",
    }
    path.write_text(yaml.safe_dump(doc))
    return path


def _forged_token(sa: str) -> str:
    """A service-account token for ``sa`` as another cluster with the default issuer would sign it:
    the same claims, another key."""
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.hazmat.primitives.asymmetric.utils import decode_dss_signature

    def b64(data: bytes) -> str:
        return base64.urlsafe_b64encode(data).rstrip(b"=").decode()

    now = int(time.time())
    claims = {
        "iss": "https://kubernetes.default.svc",
        "aud": ["https://kubernetes.default.svc"],
        "sub": f"system:serviceaccount:{SA_NS}:{sa}",
        "iat": now,
        "nbf": now,
        "exp": now + 3600,
        "kubernetes.io": {"namespace": SA_NS, "serviceaccount": {"name": sa, "uid": str(uuid.uuid4())}},
    }
    signing = f"{b64(json.dumps({'alg': 'ES256', 'kid': 'other'}).encode())}.{b64(json.dumps(claims).encode())}"
    r, s = decode_dss_signature(
        ec.generate_private_key(ec.SECP256R1()).sign(signing.encode(), ec.ECDSA(hashes.SHA256()))
    )
    return f"{signing}.{b64(r.to_bytes(32, 'big') + s.to_bytes(32, 'big'))}"


def _get_metrics(port: int, ca: Path, server_name: str, token: str | None) -> tuple[int, str, dict[str, str]]:
    """(status, body, headers) of GET /metrics over HTTPS, the certificate verified as Prometheus does
    (the chart's CA, the Service's name)."""
    ctx = ssl.create_default_context(cafile=str(ca))
    conn = http.client.HTTPSConnection("127.0.0.1", port, timeout=30)
    conn.sock = ctx.wrap_socket(socket.create_connection(("127.0.0.1", port), timeout=30), server_hostname=server_name)
    try:
        conn.request("GET", "/metrics", headers={"Authorization": f"Bearer {token}"} if token is not None else {})
        resp = conn.getresponse()
        return resp.status, resp.read().decode(), dict(resp.getheaders())
    finally:
        conn.close()


@pytest.fixture(scope="module")
def metrics_rbac(api: Api) -> Iterator[dict[str, Any]]:
    """The chart's metrics-auth objects (rendered by Helm: reader ClusterRole, its binding to the
    ``metrics-reader`` ServiceAccount, system:auth-delegator for the plugin's ServiceAccount), that
    reader and a ``metrics-stranger`` without the role, and the chart's serving certificate."""
    objs = chart_objects(METRICS_VALUES)
    made = [o for o in objs if o["kind"] in POLICY_KINDS and "-metrics-" in o["metadata"]["name"]]
    assert sorted((o["kind"], o["metadata"]["name"]) for o in made) == [
        ("ClusterRole", "rdma-rdma-device-plugin-metrics-reader"),
        ("ClusterRoleBinding", "rdma-rdma-device-plugin-metrics-auth-delegator"),
        ("ClusterRoleBinding", "rdma-rdma-device-plugin-metrics-reader"),
    ]
    made += [o for o in objs if o["kind"] == "ServiceAccount"]
    for sa in ("metrics-reader", "metrics-stranger"):
        made.append({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": sa, "namespace": SA_NS}})
    for obj in made:
        api.apply(obj)
    secret = next(o for o in objs if o["kind"] == "Secret" and o["metadata"]["name"].endswith("-metrics-tls"))
    plugin_sa = next(o for o in objs if o["kind"] == "ServiceAccount")["metadata"]["name"]
    try:
        yield {
            "secret": secret,
            "plugin_sa": plugin_sa,
            "server_name": "rdma-rdma-device-plugin-metrics.kube-system.svc",
        }
    finally:
        for obj in made:
            if obj["metadata"]["name"] != plugin_sa:  # the chart's ServiceAccount: other tests apply it too
                api.delete(obj)


def _tls_files(root: Path, secret: dict[str, Any]) -> dict[str, Path]:
    out = {}
    for key in ("ca.crt", "tls.crt", "tls.key"):
        out[key] = root / key
        out[key].write_bytes(base64.b64decode(secret["data"][key]))
    return out


@pytest.mark.parametrize("server", ["serve", "dra"])
def test_scrapes_need_a_readers_token(
    api: Api, cluster: kube_cluster.Cluster, workdir: Path, metrics_rbac: dict[str, Any], server: str
) -> None:
    """The plugin (serve) and the DRA driver with the chart's metrics.auth flags, reviewing tokens with
    the chart's ServiceAccount (system:auth-delegator, nothing else): over HTTPS with the chart's
    certificate (verified with its CA and server name), no token and a garbage one are 401, a token
    signed by another cluster's key is 401, a ServiceAccount without the reader ClusterRole is 403, the
    bound reader gets the metrics; plain HTTP gets nothing."""
    root = workdir / f"metrics-auth-{server}"
    root.mkdir()
    tls = _tls_files(root, metrics_rbac["secret"])
    kubeconfig = _token_kubeconfig(root / "kubeconfig", cluster, _token(api, metrics_rbac["plugin_sa"]))
    port = kube_cluster.free_port()
    fx = fixtures.write_node(str(root / "fx"), fixtures.lingjun_node(nics=2))
    argv = [sys.executable, "-m", "rdma_device_plugin", server, "--sysfs-root", fx.sysfs, "--dev-root", fx.dev]
    argv += ["--kubeconfig", str(kubeconfig), "--metrics-address", f"127.0.0.1:{port}", "--metrics-auth", "kubernetes"]
    argv += ["--metrics-tls-cert", str(tls["tls.crt"]), "--metrics-tls-key", str(tls["tls.key"])]
    argv += ["--health-file", str(root / "health")]
    if server == "serve":
        argv += ["--procfs-root", fx.procfs, "--device-plugin-dir", str(root / "dp")]
        (root / "dp").mkdir()
        family = "rdma_dp_rediscoveries_total"
    else:
        config = root / "config.yaml"
        config.write_text(yaml.safe_dump({"version": "v1", "mode": "shared"}))
        argv += ["--config", str(config), "--node-name", "no-kubelet", "--kubelet-dir", str(root / "kubelet")]
        argv += ["--cdi-dir", str(root / "cdi")]
        family = "rdma_dra_build_info"
    log = root / "server.log"
    with log.open("ab") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def get(token: str | None) -> tuple[int, str, dict[str, str]]:
        return _get_metrics(port, tls["ca.crt"], metrics_rbac["server_name"], token)

    try:

        def up() -> tuple[int, str, dict[str, str]] | None:
            assert proc.poll() is None, log.read_text()
            try:
                return get(None)
            except OSError:
                return None

        status, body, headers = wait_for("the metrics port", up, timeout=60)
        assert status == 401 and headers.get("WWW-Authenticate", "").startswith("Bearer"), (status, body)
        assert get("not-a-token")[0] == 401
        assert get(_forged_token("metrics-reader"))[0] == 401
        status, body, _ = get(_token(api, "metrics-stranger"))
        assert status == 403 and "metrics-reader ClusterRole" in body, (status, body)
        assert family not in body
        status, body, _ = get(_token(api, "metrics-reader"))
        assert status == 200 and family in body, (status, body[:500])
        # the same port in plain HTTP: no metrics, whatever the token
        req = urllib.request.Request(f"http://127.0.0.1:{port}/metrics")
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                leaked = r.read().decode(errors="replace")
        except OSError:
            leaked = ""
        assert family not in leaked
        assert proc.poll() is None, log.read_text()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)


def test_review_verdicts_are_cached_per_token(
    api: Api, cluster: kube_cluster.Cluster, metrics_rbac: dict[str, Any]
) -> None:
    """The reviews a scrape costs the API server (docs/security.md's request rate): 2 per token, then
    none while the verdict is cached; a refused token is remembered too (DENIED_SECONDS)."""
    from rdma_device_plugin import metricsauth

    creds = kubeapi.Credentials(
        server=cluster.server(), ca_file=str(cluster.dir / "pki/ca.crt"), token=_token(api, metrics_rbac["plugin_sa"])
    )
    reviewer = metricsauth.Reviewer(kubeapi.Client(creds))
    reader, stranger = _token(api, "metrics-reader"), _token(api, "metrics-stranger")
    assert [reviewer.check(f"Bearer {reader}") for _ in range(5)] == [200] * 5
    assert reviewer.reviews == 2  # one TokenReview, one SubjectAccessReview
    assert [reviewer.check(f"Bearer {stranger}") for _ in range(5)] == [403] * 5
    assert reviewer.reviews == 4
    assert [reviewer.check("Bearer garbage") for _ in range(3)] == [401] * 3
    assert reviewer.reviews == 5  # a failed TokenReview: no SubjectAccessReview
