"""What a production node does after admission, on a real one: the kubelet v1.37.2, containerd 2.x
and runc (scripts/real_node.py). `helm install` with the values `make node-up` writes, the plugin pod
under runc with the chart's securityContext, registration with the real kubelet, Ready through the
kubelet's prober, `rdma/hca: 1k` in the Node status, and RDMA pods whose containers get the device
nodes (real character devices, opened through the real device cgroup), the env, and CDI through
containerd. Tests run in file order and share the node; each leaves the chart as it found it."""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import NODE, ROOT, Pods, wait_allocatable
from kube_pytest import Kube, wait_for
from real_node import RealNode

CHART = str(ROOT / "charts" / "rdma-device-plugin")
sys.path.insert(0, str(ROOT / "plugins" / "module_utils"))
NS = "rdma-e2e"
CAP_IPC_LOCK = 1 << 14
# open() of a device node the device cgroup allows, with no driver behind it on this machine.
ALLOWED = ("ENXIO", "ENODEV")

# What an RDMA container sees: its /dev/infiniband (kind, numbers, whether open() gets past the device
# cgroup: ENXIO or ENODEV mean allowed but no driver (uverbs: char 231, no ib_uverbs; rdma_cm: misc 10,
# no rdma_ucm), EPERM refused), the env NCCL/UCX read, its capabilities and
# the device cgroup's list. Printed as one JSON line.
PROBE = r"""
import errno, json, os, stat, sys, time
out = {"devices": {}, "env": {k: v for k, v in os.environ.items() if k.startswith(("NCCL_", "UCX_", "RDMA_"))}}
d = "/dev/infiniband"
for name in sorted(os.listdir(d)) if os.path.isdir(d) else []:
    st = os.stat(os.path.join(d, name))
    try:
        os.close(os.open(os.path.join(d, name), os.O_RDWR))
        res = "opened"
    except OSError as e:
        res = errno.errorcode[e.errno]
    rdev = [os.major(st.st_rdev), os.minor(st.st_rdev)]
    out["devices"][name] = {"char": stat.S_ISCHR(st.st_mode), "rdev": rdev, "open": res}
status = dict(l.split(":", 1) for l in open("/proc/self/status") if ":" in l)
out["capeff"] = int(status["CapEff"].strip(), 16)
try:
    out["devices_list"] = open("/sys/fs/cgroup/devices/devices.list").read().split("\n")
except OSError as e:
    out["devices_list"] = str(e)
print(json.dumps(out), flush=True)
if len(sys.argv) > 1:
    time.sleep(float(sys.argv[1]))
"""


def _fixture_nics(node: RealNode) -> dict[str, tuple[int, int]]:
    """NIC name -> its uverbs device's (major, minor), from the fixture's sysfs (the one reader)."""
    sys_class = node.root / "sys" / "class" / "infiniband_verbs"
    out = {}
    for entry in sorted(sys_class.iterdir()):
        ibdev = (entry / "ibdev").read_text().strip()
        major, minor = (entry / "dev").read_text().strip().split(":")
        out[ibdev] = (int(major), int(minor))
    return out


def rdma_pod(name: str, image: str, *, n: str = "1", resource: str = "rdma/hca", sleep: float = 0) -> dict[str, Any]:
    """A pod as docs/nccl.md shows them: hostNetwork, capabilities drop ALL + add IPC_LOCK, rdma/hca."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NS},
        "spec": {
            # Placed by the scheduler (one node): the DRA extended-resource claim is the scheduler's.
            "hostNetwork": True,
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 1,
            "containers": [
                {
                    "name": "main",
                    "image": image,
                    "command": ["python3", "-c", PROBE, *([str(sleep)] if sleep else [])],
                    "securityContext": {"capabilities": {"drop": ["ALL"], "add": ["IPC_LOCK"]}},
                    "resources": {"limits": {resource: n}},
                }
            ],
        },
    }


# One shared NIC through the chart's DeviceClass.
NIC_CLASS = "nic.rdma.lingjun.io"
ONE_NIC = {
    "apiVersion": "resource.k8s.io/v1",
    "kind": "ResourceClaimTemplate",
    "metadata": {"name": "one-nic", "namespace": NS},
    "spec": {"spec": {"devices": {"requests": [{"name": "nic", "exactly": {"deviceClassName": NIC_CLASS}}]}}},
}


def _claim_pod(name: str, image: str, sleep: float = 0) -> dict[str, Any]:
    """rdma_pod with one claim of a shared NIC (the one-nic template) instead of rdma/hca."""
    pod = rdma_pod(name, image, sleep=sleep)
    pod["spec"]["containers"][0]["resources"] = {"claims": [{"name": "nic"}]}
    pod["spec"]["resourceClaims"] = [{"name": "nic", "resourceClaimTemplateName": "one-nic"}]
    return pod


def probe_of(pods: Pods, name: str) -> dict[str, Any]:
    return dict(json.loads(pods.logs(NS, name).strip().splitlines()[0]))


def helm(kube: Kube, node: RealNode, *sets: str, defaults: bool = False) -> None:
    """helm upgrade --install with make node-up's values; past the first install without the 30 s
    minReadySeconds (a DaemonSet field, so no pod rolls for it): each rollout here is one node's."""
    args = ["upgrade", "--install", "rdma", CHART, "-n", "kube-system", "-f", str(node.values_file)]
    if not defaults:
        args += ["--set", "minReadySeconds=0"]
    for s in sets:
        args += ["--set", s]
    kube.helm(*args, "--wait", "--timeout", "180s")


def plugin_pod(kube: Kube, mode: str = "shared") -> dict[str, Any]:
    sel = f"app.kubernetes.io/component=device-plugin,rdma.lingjun.io/mode={mode}"
    items = kube.get("pods", "-n", "kube-system", "-l", sel, "--field-selector", f"spec.nodeName={NODE}")["items"]
    running = [p for p in items if not p["metadata"].get("deletionTimestamp")]
    assert len(running) == 1, [p["metadata"]["name"] for p in items]
    return dict(running[0])


@pytest.fixture(scope="module", autouse=True)
def namespace(kube: Kube, real_node: RealNode) -> None:
    """The tenants' namespace: labelled as allowing RDMA (the chart's tenant policy, docs/security.md)."""
    kube.kubectl("create", "namespace", NS, check=False)
    kube.kubectl("label", "namespace", NS, "rdma.lingjun.io/tenant=true", "--overwrite")


def test_the_node_is_a_real_kubelet_on_containerd(kube: Kube, real_node: RealNode) -> None:
    """make node-up's Node: the pinned kubelet, containerd 2.x, Ready (CNI config present), the images it
    pulled from the local registry in its status."""
    node = kube.get("node", NODE)
    info = node["status"]["nodeInfo"]
    pin = real_node.bin.parent.name  # .cache/kubernetes/<k8s.io/kubernetes version>/bin
    assert info["kubeletVersion"] == pin
    assert info["containerRuntimeVersion"].startswith("containerd://2."), info
    assert {c["type"]: c["status"] for c in node["status"]["conditions"]}["Ready"] == "True"
    names = {n for i in node["status"].get("images", []) for n in i["names"]}
    images = dict(real_node.state()["images"])  # type: ignore[call-overload]
    for ref in images.values():
        assert any(ref.split("@")[0].split(":")[0] in n for n in names), (ref, names)
    # The chart's default affinity picks it by the Lingjun node-pool label the kubelet set on itself.
    assert node["metadata"]["labels"]["alibabacloud.com/lingjun-worker"] == "true"


def test_the_node_credentials_are_those_of_a_node(kube: Kube, real_node: RealNode) -> None:
    """system:node:<name> in system:nodes: the Node authorizer and NodeRestriction admit it to its own
    Node only, and never to a node-restriction.kubernetes.io/ label (what a kubelet cannot forge)."""
    kc = str(real_node.dir / "kubelet.kubeconfig")
    kubectl = str(real_node.bin / "kubectl")
    other = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "other-gpu-node"}}
    kube.kubectl("create", "-f", "-", input=json.dumps(other), check=False)
    try:

        def as_node(*args: str) -> Any:
            import subprocess

            return subprocess.run([kubectl, f"--kubeconfig={kc}", *args], capture_output=True, text=True, check=False)

        who = as_node("auth", "whoami", "-o", "json")
        assert who.returncode == 0, who.stderr
        user = json.loads(who.stdout)["status"]["userInfo"]
        assert user["username"] == f"system:node:{NODE}" and "system:nodes" in user["groups"]
        r = as_node("label", "node", "other-gpu-node", "rdma.lingjun.io/validated=true")
        assert r.returncode != 0 and "forbidden" in r.stderr.lower(), r.stderr
        r = as_node("label", "node", NODE, "node-restriction.kubernetes.io/rdma-validated=true")
        assert r.returncode != 0 and "node-restriction.kubernetes.io" in r.stderr, r.stderr
        assert as_node("get", "node", NODE, "-o", "name").returncode == 0
    finally:
        kube.kubectl("delete", "node", "other-gpu-node", "--ignore-not-found", check=False)


def test_helm_install_runs_the_plugin_under_the_charts_security_context(kube: Kube, real_node: RealNode) -> None:
    """Default values + make node-up's values: the plugin pod runs under runc as the chart says (no
    capability, read-only root, the seccomp profile of the runtime), registers with the real kubelet
    at /var/lib/kubelet/device-plugins, turns Ready through the kubelet's prober, and the Node shows
    rdma/hca: 1k."""
    helm(kube, real_node, defaults=True)
    pod = plugin_pod(kube)
    name = pod["metadata"]["name"]
    assert pod["spec"]["nodeName"] == NODE
    status = wait_allocatable(kube, "rdma/hca", "1k")
    assert status["capacity"]["rdma/hca"] == "1k"
    ready = {c["type"]: c["status"] for c in kube.get("pod", "-n", "kube-system", name)["status"]["conditions"]}
    assert ready["Ready"] == "True"
    inside = json.loads(
        Pods(kube, real_node).exec(
            "kube-system",
            name,
            "python3",
            "-c",
            "import json,os\n"
            "s=dict(l.split(':',1) for l in open('/proc/self/status') if ':' in l)\n"
            "try:\n open('/probe-write','w'); ro=False\nexcept OSError as e: ro=e.errno==30\n"
            "print(json.dumps({'capeff':int(s['CapEff'],16),'capbnd':int(s['CapBnd'],16),'seccomp':s['Seccomp'].strip(),"
            "'nnp':s['NoNewPrivs'].strip(),'ro':ro,'uid':os.getuid(),"
            "'socks':sorted(os.listdir('/var/lib/kubelet/device-plugins'))}))",
        )
    )
    assert inside["capeff"] == 0 and inside["capbnd"] == 0, inside  # drop: [ALL]
    assert inside["ro"] is True  # readOnlyRootFilesystem
    assert inside["seccomp"] == "2" and inside["nnp"] == "1"  # RuntimeDefault filter, no privilege escalation
    assert "kubelet.sock" in inside["socks"] and any(s.startswith("rdma-dp-") for s in inside["socks"])
    # The kubelet sees the same directory: its own fixed socket path, on the node.
    node_dir = real_node.fs / "var-lib-kubelet" / "device-plugins"
    assert stat.S_ISSOCK(os.stat(node_dir / "kubelet.sock").st_mode)


def test_an_rdma_pod_gets_its_devices_through_the_device_cgroup_and_the_env(
    kube: Kube, real_node: RealNode, pods: Pods
) -> None:
    """hostNetwork, drop ALL + IPC_LOCK, rdma/hca: 1 (shared mode): every NIC's uverbs device and
    rdma_cm exist in the container with the node's numbers, the device cgroup lets it open them
    (ENXIO: no driver on this machine, not EPERM), and NCCL_IB_HCA names every NIC."""
    nics = _fixture_nics(real_node)
    image = str(dict(real_node.state()["images"])["workload"])  # type: ignore[call-overload]
    pods.create(rdma_pod("shared-probe", image))
    pods.wait_phase(NS, "shared-probe", ("Succeeded", "Failed"))
    got = probe_of(pods, "shared-probe")
    uverbs = {k: v for k, v in got["devices"].items() if k.startswith("uverbs")}
    assert sorted(tuple(v["rdev"]) for v in uverbs.values()) == sorted(nics.values())
    assert got["devices"]["rdma_cm"]["char"] and got["devices"]["rdma_cm"]["open"] == "ENODEV"
    for name, dev in got["devices"].items():
        assert dev["char"] and dev["open"] in ALLOWED, (name, dev)
        assert f"c {dev['rdev'][0]}:{dev['rdev'][1]} rw" in " ".join(got["devices_list"]), (name, got["devices_list"])
    # Not given, so not in the device cgroup: umad and issm (charDevices off by default).
    assert not any(k.startswith(("umad", "issm")) for k in got["devices"])
    assert got["env"]["NCCL_IB_HCA"] == "=" + ",".join(sorted(nics))
    assert got["env"]["RDMA_DEVICES"].split(",") == sorted(nics)
    assert got["capeff"] == CAP_IPC_LOCK  # exactly IPC_LOCK: containerd's default NET_RAW is gone too
    pods.delete(NS, "shared-probe")


def test_cdi_devices_are_resolved_by_containerd(kube: Kube, real_node: RealNode, pods: Pods) -> None:
    """cdi.enabled: Allocate answers with CDI names only; containerd 2's CDI reads the plugin's spec in
    /var/run/cdi and injects the same device nodes and env."""
    helm(kube, real_node, "cdi.enabled=true", "cdi.runtimeEnabled=true")
    try:
        wait_allocatable(kube, "rdma/hca", "1k")
        specs = list((real_node.fs / "run-cdi").glob("*.json")) + list((real_node.fs / "run-cdi").glob("*.yaml"))
        assert specs, "the plugin wrote no CDI spec to the node's /var/run/cdi"
        spec = yaml.safe_load(specs[0].read_text())
        nics = _fixture_nics(real_node)
        image = str(dict(real_node.state()["images"])["workload"])  # type: ignore[call-overload]
        pods.create(rdma_pod("cdi-probe", image))
        pods.wait_phase(NS, "cdi-probe", ("Succeeded", "Failed"))
        got = probe_of(pods, "cdi-probe")
        uverbs = sorted(tuple(v["rdev"]) for k, v in got["devices"].items() if k.startswith("uverbs"))
        assert uverbs == sorted(nics.values()), (got, spec)
        assert all(d["open"] in ALLOWED for d in got["devices"].values())
        assert got["env"]["NCCL_IB_HCA"] == "=" + ",".join(sorted(nics))
        pods.delete(NS, "cdi-probe")
    finally:
        helm(kube, real_node)


def test_exclusive_mode_gives_a_pod_only_its_nic(kube: Kube, real_node: RealNode, pods: Pods) -> None:
    """Relabel the node exclusive: the exclusive DaemonSet's pod replaces the shared one, the Node shows
    one device per NIC, and rdma/hca: 1 gets exactly one NIC's uverbs device (and rdma_cm)."""
    nics = _fixture_nics(real_node)
    kube.kubectl("label", "node", NODE, "node-restriction.kubernetes.io/rdma-mode=exclusive", "--overwrite")
    try:
        wait_allocatable(kube, "rdma/hca", str(len(nics)), timeout=180)
        image = str(dict(real_node.state()["images"])["workload"])  # type: ignore[call-overload]
        pods.create(rdma_pod("excl-probe", image))
        pods.wait_phase(NS, "excl-probe", ("Succeeded", "Failed"))
        got = probe_of(pods, "excl-probe")
        uverbs = [tuple(v["rdev"]) for k, v in got["devices"].items() if k.startswith("uverbs")]
        assert len(uverbs) == 1 and uverbs[0] in nics.values(), got
        nic = next(n for n, rdev in nics.items() if rdev == uverbs[0])
        assert got["env"]["NCCL_IB_HCA"] == "=" + nic
        assert "rdma_cm" in got["devices"]
        pods.delete(NS, "excl-probe")
    finally:
        kube.kubectl("label", "node", NODE, "node-restriction.kubernetes.io/rdma-mode-")
        wait_allocatable(kube, "rdma/hca", "1k", timeout=180)


def test_a_kubelet_restart_keeps_pods_running_and_allocations_single(
    kube: Kube, real_node: RealNode, pods: Pods
) -> None:
    """The kubelet restarts while an RDMA pod runs: the container keeps running (same container ID, no
    restart), the plugin registers again, allocatable comes back, and the kubelet's checkpoint holds
    each device once (a second pod gets another one)."""
    image = str(dict(real_node.state()["images"])["workload"])  # type: ignore[call-overload]
    pods.create(rdma_pod("long-a", image, sleep=3600))
    before = pods.wait_ready(NS, "long-a")
    cid = before["status"]["containerStatuses"][0]["containerID"]
    real_node.restart_kubelet()
    real_node.wait_ready()
    wait_allocatable(kube, "rdma/hca", "1k", timeout=180)
    after = pods.wait_ready(NS, "long-a")
    st = after["status"]["containerStatuses"][0]
    assert st["containerID"] == cid and st["restartCount"] == 0, st
    pods.create(rdma_pod("long-b", image, sleep=3600))
    pods.wait_ready(NS, "long-b")
    checkpoint = json.loads(
        (real_node.fs / "var-lib-kubelet" / "device-plugins" / "kubelet_internal_checkpoint").read_text()
    )
    entries = checkpoint["Data"]["PodDeviceEntries"]
    ids = [i for e in entries if e["ResourceName"] == "rdma/hca" for ids in e["DeviceIDs"].values() for i in ids]
    assert len(ids) == 2 and len(set(ids)) == 2, entries
    for p in ("long-a", "long-b"):
        pods.delete(NS, p, wait=False)


def test_a_removed_plugin_leaves_the_resource_at_zero_and_verify_says_why(kube: Kube, real_node: RealNode) -> None:
    """helm uninstall: the real kubelet keeps rdma/hca in the Node status (allocatable 0 at once,
    capacity for its grace period, then 0), never removes the key; verify's verdict on that Node names
    a missing plugin, not a NIC port."""
    import rdma_fleet  # type: ignore[import-not-found]

    kube.helm("uninstall", "rdma", "-n", "kube-system", "--wait", "--timeout", "120s")
    try:
        status = wait_allocatable(kube, "rdma/hca", "0", timeout=120)
        assert "rdma/hca" in status["capacity"], status["capacity"]
        view = rdma_fleet.node_view(kube.get("node", NODE), "rdma/hca", "node-restriction.kubernetes.io/rdma-mode")
        v = rdma_fleet.verdict(rdma_fleet.Want(NODE, NODE), view, rdma_fleet.Cluster())
        assert not v.ok and "plugin" in v.msg and "kubectl -n kube-system get pods" in v.msg, v.msg
    finally:
        helm(kube, real_node)


def test_a_crash_looping_plugin_image_is_what_a_user_sees_and_verify_names_it(kube: Kube, real_node: RealNode) -> None:
    """A plugin image whose process exits at start (exit 3) rolled out by helm: the pod stays Running in
    phase with its container in CrashLoopBackOff, the kubelet's back-off between restarts and a
    restart count that climbs; the rollout does not complete (readiness); the Node keeps rdma/hca at
    allocatable 0 and verify's verdict says the plugin is not serving, naming the command to look."""
    import rdma_fleet  # type: ignore[import-not-found]

    plugin = str(dict(real_node.state()["images"])["plugin"])  # type: ignore[call-overload]
    name, _, _digest = plugin.partition("@")
    repo, _, tag = name.rpartition(":")
    crash = real_node.derived_image(
        name, f"{repo}:{tag}-crashloop", ["/bin/sh", "-c", "echo 'simulated start failure' >&2; exit 3", "--"]
    )
    kube.helm(
        "upgrade", "rdma", CHART, "-n", "kube-system", "-f", str(real_node.values_file),
        "--set", "minReadySeconds=0", "--set", f"image.tag={crash.rpartition(':')[2]}", "--set", "image.digest=",
    )  # fmt: skip
    try:

        def looping() -> dict[str, Any] | None:
            items = kube.get("pods", "-n", "kube-system", "-l", "app.kubernetes.io/component=device-plugin")["items"]
            for p in items:
                for st in p["status"].get("containerStatuses", []):
                    waiting = st.get("state", {}).get("waiting", {})
                    if (
                        crash.split("/")[-1] in st["image"]
                        and st["restartCount"] >= 2
                        and waiting.get("reason") == "CrashLoopBackOff"
                    ):
                        return dict(p)
            return None

        pod = wait_for(looping, timeout=180)
        assert pod, kube.get("pods", "-n", "kube-system", "-l", "app.kubernetes.io/component=device-plugin")
        st = pod["status"]["containerStatuses"][0]
        assert pod["status"]["phase"] == "Running" and not st["ready"]
        assert st["lastState"]["terminated"]["exitCode"] == 3
        assert "back-off" in st["state"]["waiting"]["message"]
        # The rollout never completes: the DaemonSet counts the pod unavailable (helm --wait would time out).
        ds = kube.get("daemonset", "-n", "kube-system", "rdma-rdma-device-plugin-shared")["status"]
        assert ds.get("numberAvailable", 0) == 0 and ds.get("numberUnavailable") == 1, ds
        status = wait_allocatable(kube, "rdma/hca", "0", timeout=120)
        view = rdma_fleet.node_view({"metadata": kube.get("node", NODE)["metadata"], "status": status}, "rdma/hca",
                                    "node-restriction.kubernetes.io/rdma-mode")  # fmt: skip
        v = rdma_fleet.verdict(rdma_fleet.Want(NODE, NODE), view, rdma_fleet.Cluster())
        assert not v.ok and "the plugin stopped" in v.msg, v.msg
    finally:
        helm(kube, real_node)
        wait_allocatable(kube, "rdma/hca", "1k", timeout=180)


def test_the_dra_driver_runs_as_a_pod_and_pods_get_nics_through_cdi(
    kube: Kube, real_node: RealNode, pods: Pods
) -> None:
    """driver: dra. The driver runs as a pod with the chart's ServiceAccount token (reaching the API
    server through the kubernetes Service), registers with the real kubelet's plugin watcher, publishes
    the node's slices; an rdma/hca: 1 pod (extendedResourceName) and a claim pod get their NICs through
    the driver's CDI specs, resolved by containerd."""
    nics = _fixture_nics(real_node)
    image = str(dict(real_node.state()["images"])["workload"])  # type: ignore[call-overload]
    helm(kube, real_node, "driver=dra")
    try:
        driver = wait_for(
            lambda: [
                p
                for p in kube.get("pods", "-n", "kube-system", "-l", "app.kubernetes.io/component=dra-driver")["items"]
                if p["spec"].get("nodeName") == NODE and p["status"].get("phase") == "Running"
            ],
            timeout=180,
        )
        assert driver, pods.describe("kube-system", "-l app.kubernetes.io/component=dra-driver")
        assert driver[0]["spec"]["serviceAccountName"] == "rdma-rdma-device-plugin"
        slices = wait_for(
            lambda: [
                s
                for s in kube.get("resourceslices")["items"]
                if s["spec"].get("nodeName") == NODE and s["spec"]["driver"] == "rdma.lingjun.io"
            ],
            timeout=120,
        )
        assert slices, "the driver published no ResourceSlice for the node"
        # Its config was validated by a child process that has exited (config_view): the driver's own
        # process never loaded pydantic (its memory budget, docs/dra.md).
        procs = _pod_processes(driver[0]["metadata"]["uid"])
        assert procs, "no process of the driver's pod found under /proc"
        for pid, argv in procs.items():
            assert "rdma_device_plugin.config_view" not in argv, (pid, argv)
            assert "pydantic_core" not in Path(f"/proc/{pid}/maps").read_text(), (pid, argv)
        # The device plugin's resource is gone from the node: DRA serves rdma/hca now.
        pods.create(rdma_pod("dra-ext", image))
        pods.wait_phase(NS, "dra-ext", ("Succeeded", "Failed"), timeout=240)
        got = probe_of(pods, "dra-ext")
        uverbs = sorted(tuple(v["rdev"]) for k, v in got["devices"].items() if k.startswith("uverbs"))
        assert uverbs == sorted(nics.values()), got
        assert all(d["open"] in ALLOWED for d in got["devices"].values()), got
        assert got["env"]["NCCL_IB_HCA"] == "=" + ",".join(sorted(nics))
        kube.apply(ONE_NIC)
        pods.create(_claim_pod("dra-claim", image))
        pods.wait_phase(NS, "dra-claim", ("Succeeded", "Failed"), timeout=240)
        got = probe_of(pods, "dra-claim")
        uverbs = [tuple(v["rdev"]) for k, v in got["devices"].items() if k.startswith("uverbs")]
        assert len(uverbs) == 1 and uverbs[0] in nics.values(), got
        for p in ("dra-ext", "dra-claim"):
            pods.delete(NS, p)
    finally:
        helm(kube, real_node)
        wait_allocatable(kube, "rdma/hca", "1k", timeout=180)


def _pod_processes(pod_uid: str) -> dict[int, str]:
    """The processes of a pod on this node (the kubelet's cgroup path holds pod<uid>), by pid: argv."""
    out = {}
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and f"pod{pod_uid}" in (d / "cgroup").read_text().replace("_", "-"):
                out[int(d.name)] = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
    return out


def _driver_pods(kube: Kube) -> list[dict[str, Any]]:
    items = kube.get("pods", "-n", "kube-system", "-l", "app.kubernetes.io/component=dra-driver")["items"]
    return [p for p in items if p["spec"].get("nodeName") == NODE and p["status"].get("phase") == "Running"]


def _slice_uids(kube: Kube) -> frozenset[str]:
    return frozenset(
        s["metadata"]["uid"]
        for s in kube.get("resourceslices", "--field-selector", f"spec.nodeName={NODE}")["items"]
        if s["spec"]["driver"] == "rdma.lingjun.io"
    )


def test_the_dra_driver_rolls_and_survives_a_kubelet_restart_without_a_failed_prepare(
    kube: Kube, real_node: RealNode, pods: Pods
) -> None:
    """driver: dra on the real kubelet. A rolling update (the chart's maxSurge: the new driver pod beside
    the old one, each with its own sockets) while claim pods keep arriving: every pod is prepared at the
    first attempt, the one running through it keeps running, the node's slices stay the same objects
    (the kubelet never wipes them). Then a kubelet restart: the kubelet deletes every slice of its node
    as it starts (pkg/kubelet/cm/dra/plugin: wipeResourceSlices), the driver writes them anew, the running
    pod keeps its container, and a new claim pod is prepared."""
    import threading

    nics = _fixture_nics(real_node)
    image = str(dict(real_node.state()["images"])["workload"])  # type: ignore[call-overload]
    helm(kube, real_node, "driver=dra")
    seen: dict[str, Any] = {"most drivers": 0, "slices": set()}
    stop = threading.Event()
    try:
        kube.apply(ONE_NIC)
        slices = wait_for(lambda: _slice_uids(kube), timeout=120)
        assert slices, "the driver published no ResourceSlice for the node"
        pods.create(_claim_pod("roll-long", image, sleep=3600))
        cid = pods.wait_ready(NS, "roll-long")["status"]["containerStatuses"][0]["containerID"]

        def watch() -> None:
            while not stop.is_set():
                seen["most drivers"] = max(seen["most drivers"], len(_driver_pods(kube)))
                seen["slices"].add(_slice_uids(kube))
                stop.wait(0.2)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        rollout = threading.Thread(target=helm, args=(kube, real_node, "driver=dra", "podAnnotations.rollout=two"))
        rollout.start()
        arrived = []
        while rollout.is_alive() or len(arrived) < 2:
            name = f"roll-{len(arrived)}"
            pods.create(_claim_pod(name, image))
            arrived.append(name)
            pods.wait_phase(NS, name, ("Succeeded", "Failed"), timeout=240)
        rollout.join()
        stop.set()
        watcher.join()
        assert seen["most drivers"] == 2, "the rolling update never ran the new driver pod beside the old one"
        assert seen["slices"] == {slices}, f"the node's slices changed or went during the rollout: {seen['slices']}"
        for name in arrived:
            got = probe_of(pods, name)
            uverbs = [tuple(v["rdev"]) for k, v in got["devices"].items() if k.startswith("uverbs")]
            assert len(uverbs) == 1 and uverbs[0] in nics.values(), (name, got)
        failed = kube.get("events", "-n", NS, "--field-selector", "reason=FailedPrepareDynamicResources")["items"]
        assert not failed, [e["message"] for e in failed]

        real_node.restart_kubelet()
        real_node.wait_ready()
        anew = wait_for(lambda: (u := _slice_uids(kube)) and not u & slices and u, timeout=120)
        assert anew, f"the slices were not written anew after the kubelet's start: {_slice_uids(kube)}"
        st = pods.wait_ready(NS, "roll-long")["status"]["containerStatuses"][0]
        assert st["containerID"] == cid and st["restartCount"] == 0, st
        pods.create(_claim_pod("roll-after", image))
        pods.wait_phase(NS, "roll-after", ("Succeeded", "Failed"), timeout=240)
        got = probe_of(pods, "roll-after")
        assert [k for k in got["devices"] if k.startswith("uverbs")], got
        failed = kube.get("events", "-n", NS, "--field-selector", "reason=FailedPrepareDynamicResources")["items"]
        assert not failed, [e["message"] for e in failed]
    finally:
        stop.set()
        for p in ("roll-long", "roll-after", *(f"roll-{i}" for i in range(10))):
            pods.delete(NS, p, wait=False)
        helm(kube, real_node)
        wait_allocatable(kube, "rdma/hca", "1k", timeout=180)


def test_a_node_reboot_fails_pods_admitted_before_the_plugin_and_their_job_replaces_them(
    kube: Kube, real_node: RealNode, pods: Pods
) -> None:
    """A node "reboot" (kubelet and containerd stopped, every container gone, /run emptied, both started
    again). The kubelet re-admits every pod of the node at once when it starts, before the plugin's
    container can run again and register: an RDMA pod fails admission for good (phase Failed,
    UnexpectedAdmissionError naming rdma/hca; the device manager has no healthy device yet), which a
    bare pod does not survive. Its Job replaces it, and the new pod is scheduled once the Node shows
    rdma/hca again and runs with its devices (docs/operations.md, "After a node reboot")."""
    image = str(dict(real_node.state()["images"])["workload"])  # type: ignore[call-overload]
    template = rdma_pod("unused", image, sleep=3600)
    job = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": "trainer", "namespace": NS},
        "spec": {"backoffLimit": 3, "template": {"metadata": {"labels": {"job": "trainer"}}, "spec": template["spec"]}},
    }
    kube.apply(job)

    def job_pods() -> list[dict[str, Any]]:
        return list(kube.get("pods", "-n", NS, "-l", "job=trainer")["items"])

    first = wait_for(lambda: [p for p in job_pods() if p["status"].get("phase") == "Running"], timeout=180)
    assert first, job_pods()
    first_name = first[0]["metadata"]["name"]
    try:
        real_node.reboot()
        real_node.wait_ready()
        wait_allocatable(kube, "rdma/hca", "1k", timeout=240)
        failed = pods.wait_phase(NS, first_name, ("Failed",), timeout=180)
        assert failed["status"]["reason"] == "UnexpectedAdmissionError", failed["status"]
        assert "rdma/hca" in failed["status"]["message"], failed["status"]
        again = wait_for(
            lambda: [
                p
                for p in job_pods()
                if p["metadata"]["name"] != first_name
                and p["status"].get("phase") == "Running"
                and all(c.get("ready") for c in p["status"].get("containerStatuses", []))
            ],
            timeout=240,
        )
        assert again, job_pods()
        got = probe_of(pods, again[0]["metadata"]["name"])
        assert got["devices"] and all(d["open"] in ALLOWED for d in got["devices"].values())
    finally:
        kube.kubectl("delete", "job", "-n", NS, "trainer", "--cascade=foreground", "--wait=false", check=False)


def test_zz_node_down_leaves_no_process_and_no_mount(kube: Kube, real_node: RealNode) -> None:
    """Last: make node-down's work. Nothing of the node runs, no mount of it is anywhere, its bridges and
    cgroups are gone (the session fixture's down() then finds nothing to do)."""
    kube.helm("uninstall", "rdma", "-n", "kube-system", "--wait", "--timeout", "120s", check=False)
    ns = real_node.state().get("holder_ns")
    assert real_node.down() == []
    bins = {str(real_node.bin / b) for b in ("kubelet", "containerd", "containerd-shim-runc-v2", "runc")}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            exe = os.readlink(f"/proc/{pid}/exe")
            mnt = os.readlink(f"/proc/{pid}/ns/mnt")
        except OSError:
            continue
        assert exe not in bins, f"pid {pid} still runs {exe}"
        assert mnt != ns, f"pid {pid} is still in the node's mount namespace"
    mounts = Path("/proc/self/mountinfo").read_text()
    assert str(real_node.dir) not in mounts
    links = os.listdir("/sys/class/net")
    assert "rdmacni0" not in links and "rdmanode0" not in links
    assert not any(Path("/sys/fs/cgroup", h, "kubepods").exists() for h in os.listdir("/sys/fs/cgroup"))
