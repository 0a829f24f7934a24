"""The chart in a real cluster: upstream kube-apiserver, kube-controller-manager (the DaemonSet
controller) and kube-scheduler v1.37.2 built by `make kube`, Helm v4's own binary, and nodes that
run the kubelet's own managers (kubelet-managers). What the offline tests check with stand-ins
(the Helm engine, kubernetes-validate schemas, cel-python) is checked here by the real components:
the API server accepts every object, compiles and type-checks the admission policy and enforces it,
the DaemonSet controller and the scheduler place the plugin on the nodes whose labels say so, and
a rolling update keeps to maxUnavailable."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import CASES, CHART_DIR, example_jobs
from test_policy_cel import Policy, caps_pod, pod_of_job, rdma_pod
from test_tenant_policy import DRA, LABEL as TENANT_LABEL, TENANT, Tenant, claim, dra_objects, good_pod, issue_matrix

sys.path.insert(0, str(CHART_DIR.parents[1] / "scripts"))
pytest.register_assert_rewrite("kube_pytest")
from kube_pytest import PLUGIN_IMAGES, Kube, wait_for  # noqa: E402

pytest_plugins = ["kube_pytest"]

NS = "kube-system"
INSTALLS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "exclusive": {"mode": "exclusive"},
    "non-hostnetwork": CASES["non-hostnetwork"],
    "numa-pools": {"numaPools": True},
    "validation-required": {"validation": {"required": True}},
}
APP_VERSION = str(yaml.safe_load((CHART_DIR / "Chart.yaml").read_text())["appVersion"])
IMAGE = {"image": {"registry": "127.0.0.1:5000", "repository": "rdma/rdma-device-plugin", "tag": APP_VERSION}}


def install(kube: Kube, values: dict[str, Any], release: str = "rdma") -> None:
    """helm upgrade --install with these values (over a test image), as an operator runs it."""
    merged = copy.deepcopy(IMAGE)
    for k, v in values.items():
        merged[k] = v
    path = Path(kube.cluster.dir) / f"values-{release}.json"
    path.write_text(json.dumps(merged))
    kube.helm("upgrade", "--install", release, str(CHART_DIR), "-n", NS, "-f", str(path), "--timeout", "120s")


def uninstall(kube: Kube, release: str = "rdma") -> None:
    kube.helm("uninstall", release, "-n", NS, "--wait", "--timeout", "120s", check=False)


@pytest.mark.parametrize("case", sorted(INSTALLS))
def test_the_real_api_server_accepts_the_chart(kube: Kube, case: str) -> None:
    """helm upgrade --install succeeds, every object exists, and the API server type-checked the
    admission policies without a warning (the checks cel-python does not do)."""
    install(kube, INSTALLS[case])
    try:
        manifest = kube.helm("get", "manifest", "rdma", "-n", NS).stdout
        kinds = {line.split(":", 1)[1].strip() for line in manifest.splitlines() if line.startswith("kind:")}
        assert {"DaemonSet", "ConfigMap", "ServiceAccount", "ValidatingAdmissionPolicy"} <= kinds
        daemonsets = kube.get("daemonsets", "-n", NS, "-l", "app.kubernetes.io/instance=rdma")["items"]
        assert sorted(d["metadata"]["name"] for d in daemonsets) == [
            "rdma-rdma-device-plugin-exclusive",
            "rdma-rdma-device-plugin-shared",
        ]

        def type_checked() -> list[dict[str, Any]]:
            items = kube.get("validatingadmissionpolicies")["items"]
            mine = [p for p in items if p["metadata"]["name"].startswith("rdma-rdma-device-plugin")]
            return mine if mine and all("typeChecking" in p.get("status", {}) for p in mine) else []

        policies = wait_for(type_checked, timeout=60)
        assert policies, "the API server never type-checked the policies"
        for p in policies:
            warnings = p["status"]["typeChecking"].get("expressionWarnings", [])
            assert not warnings, f"{p['metadata']['name']}: {warnings}"
    finally:
        uninstall(kube)


# ------------------------------------------------------------------ the admission policy, server-side


def _matrix() -> dict[str, dict[str, Any]]:
    """The pods of the cel-python tests: the seed's Jobs, good and bad capability spellings, drops,
    init containers, requests only, privileged, and pods the policy must not look at."""
    jobs = example_jobs()
    m: dict[str, dict[str, Any]] = {f"seed-{name}": pod_of_job(job) for name, job in jobs.items()}
    m["ok"] = rdma_pod()
    m["no-ipc-lock"] = rdma_pod(caps=["SYS_RESOURCE"])
    m["no-security-context"] = rdma_pod(security_context=False)
    m["no-host-network"] = rdma_pod(host_network=False)
    m["host-network-unset"] = rdma_pod(host_network=None)
    m["neither"] = rdma_pod(host_network=False, security_context=False)
    # Extended resources must have limits: the API server refuses this as invalid before any
    # admission policy sees it (the cel-python tests evaluate it anyway: harmless, never reached).
    m["requests-only"] = rdma_pod(where="requests")
    for cap in ("ipc_lock", "ALL", "CAP_IPC_LOCK", "cap_ipc_lock", "CAP_ALL"):
        m[f"cap-{cap}"] = rdma_pod(caps=["SYS_RESOURCE", cap])
    m["privileged"] = caps_pod(None, None, privileged=True)
    m["add-all-drop-all"] = caps_pod(["ALL"], ["ALL"])
    m["add-ipc-drop-all"] = caps_pod(["IPC_LOCK"], ["ALL"])
    m["add-all-drop-ipc"] = caps_pod(["ALL"], ["IPC_LOCK"])
    init = rdma_pod()
    init["spec"]["containers"][0]["resources"] = {"limits": {"nvidia.com/gpu": 8}}
    init["spec"]["initContainers"] = [{"name": "warmup", "image": "img", "resources": {"limits": {"rdma/hca": 1}}}]
    m["init-container-without-ipc-lock"] = init
    two = rdma_pod()
    two["spec"]["containers"].append({"name": "worker-2", "image": "img", "resources": {"limits": {"rdma/hca": 1}}})
    m["second-container-without-ipc-lock"] = two
    m["no-rdma"] = {"apiVersion": "v1", "kind": "Pod", "spec": {"containers": [{"name": "web", "image": "nginx"}]}}
    m["gpu-only"] = rdma_pod(host_network=False, security_context=False, resource="nvidia.com/gpu")
    for name, pod in m.items():
        pod.setdefault("metadata", {})
        pod["metadata"]["name"] = "m-" + name.lower().replace("_", "-")
        pod["metadata"].pop("namespace", None)
    return m


INVALID = {"requests-only"}  # refused by the API server's validation of the object itself


def _server_verdict(kube: Kube, pod: dict[str, Any], namespace: str = "default") -> str | None:
    """None when the API server admits the object (dry run), else its error text."""
    r = kube.kubectl("create", "--dry-run=server", "-n", namespace, "-f", "-", input=json.dumps(pod), check=False)
    if r.returncode == 0:
        return None
    assert "denied request" in r.stderr or "is invalid" in r.stderr, r.stderr
    return r.stderr


def _agrees(got: str | None, policies: list[Any], obj: dict[str, Any], **kw: Any) -> bool:
    """The API server denies when any policy does, with the first message of one of the denying ones
    (it evaluates every binding and reports one denial: dispatcher.go deniedDecisions[0])."""
    firsts = [m[0] for m in (p.evaluate(obj, **kw) for p in policies) if m]
    return (got is not None) == bool(firsts) and (not firsts or any(f"denied request: {f}" in (got or "") for f in firsts))


def _tenant_namespace(kube: Kube, name: str) -> str:
    """A namespace that allows RDMA (the tenant label), created once per cluster."""
    if kube.kubectl("get", "namespace", name, check=False).returncode != 0:
        kube.kubectl("create", "namespace", name)
    kube.kubectl("label", "namespace", name, f"{TENANT_LABEL}=true", "--overwrite")
    return name


def test_the_metrics_certificate_survives_an_upgrade(kube: Kube) -> None:
    """metrics.auth: `helm install` makes the serving certificate and the RBAC the API server accepts;
    `helm upgrade` keeps the certificate (Helm lookup), as the chart's README promises."""
    values = {"metrics": {"enabled": True, "auth": {"readers": [{"kind": "Group", "name": "sre"}]}}}
    secret = "rdma-rdma-device-plugin-metrics-tls"
    install(kube, values)
    try:
        first = kube.get("secret", "-n", NS, secret)["data"]
        assert sorted(first) == ["ca.crt", "tls.crt", "tls.key"]
        install(kube, {**values, "logLevel": "debug"})
        assert kube.get("secret", "-n", NS, secret)["data"] == first
        binding = kube.get("clusterrolebinding", "rdma-rdma-device-plugin-metrics-reader")
        assert {"kind": "Group", "name": "sre", "apiGroup": "rbac.authorization.k8s.io"} in binding["subjects"]
        delegator = kube.get("clusterrolebinding", "rdma-rdma-device-plugin-metrics-auth-delegator")
        assert delegator["roleRef"]["name"] == "system:auth-delegator"
    finally:
        uninstall(kube)


@pytest.mark.parametrize("case", ["defaults", "non-hostnetwork"])
def test_the_admission_policy_decides_in_the_api_server_as_cel_python_does(kube: Kube, case: str) -> None:
    """Every pod of the matrix, dry-run created in the real API server: denied exactly when the
    cel-python evaluation of the same rendered policy has violations. The API server reports only
    the first failing validation (apiserver plugin/policy/validating/dispatcher.go: deniedDecisions[0]),
    so a pod with two problems shows them one at a time: its message is cel-python's first."""
    install(kube, INSTALLS[case])
    try:
        policy = Policy(INSTALLS[case])
        matrix = _matrix()
        probe = matrix["no-ipc-lock"]
        # The API server compiles and starts enforcing a new policy within a second or two.
        assert wait_for(lambda: _server_verdict(kube, probe) is not None, timeout=60), "the policy never took effect"
        checked = disagreements = 0
        report = []
        tenant = Tenant(INSTALLS[case])
        for name, pod in matrix.items():
            got = _server_verdict(kube, pod)
            if name in INVALID:
                ok = got is not None and "Limit must be set" in got
            else:
                ok = _agrees(got, [policy, tenant], pod)
            checked += 1
            if not ok:
                disagreements += 1
                report.append(f"{name}: cel-python {policy.evaluate(pod)!r} {tenant.evaluate(pod)!r}, API server {got!r}")
        assert disagreements == 0, "\n".join(report)
        assert checked == len(matrix) >= 20
    finally:
        uninstall(kube)


def test_the_tenant_policy_decides_in_the_api_server_as_cel_python_does(kube: Kube) -> None:
    """The issue's pods (a privileged rdma/hca pod, hostPID with a hostPath of /, NET_ADMIN, SYS_ADMIN, a
    privileged non-RDMA pod, a claim-only pod) in a namespace that allows RDMA, a privileged debug
    container added to a running RDMA pod, and claims of the chart's DeviceClasses in a namespace that
    does not: each denied by the real API server, with the message naming the field that cel-python's
    evaluation of the same policies gives first. The seed's Jobs are admitted."""
    values = {**DRA, "nodeSelector": {"rdma.test/no-such-node": "true"}}  # the policies, no plugin pods
    install(kube, values)
    try:
        ns = _tenant_namespace(kube, "rdma-tenant")
        objs = dra_objects(values)
        policies = [Policy(values, "-rdma-pods", objs), Tenant(values, objs)]
        probe = issue_matrix()["privileged-non-rdma"][0]
        assert wait_for(lambda: _server_verdict(kube, probe, ns) is not None, timeout=60), "the policy never took effect"
        report = []
        for name, (pod, field) in issue_matrix().items():
            if "debug" in name:
                continue
            pod["metadata"]["name"] = "t-" + name
            got = _server_verdict(kube, pod, ns)
            if not (got and f"denied request: {field}" in got and _agrees(got, policies, pod, namespace=ns, namespace_labels=TENANT)):
                report.append(f"{name}: API server {got!r}, cel-python {[p.evaluate(pod, namespace=ns, namespace_labels=TENANT) for p in policies]!r}")
        for name, job in example_jobs().items():
            pod = pod_of_job(job)
            pod["metadata"]["name"] = "t-" + name
            got = _server_verdict(kube, pod, ns)
            expected = _agrees(got, policies, pod, namespace=ns, namespace_labels=TENANT)
            if not expected or (name == "rdma-hostnetwork-test" and got is not None):
                report.append(f"{name}: API server {got!r}")
        # a debug container through the ephemeralcontainers subresource of a running RDMA pod
        pod = good_pod()
        pod["metadata"] = {"name": "t-debug-target"}
        kube.kubectl("create", "-n", ns, "-f", "-", input=json.dumps(pod))
        live = kube.get("pod", "t-debug-target", "-n", ns)
        debug, field = issue_matrix()["privileged-debug-container"]
        patch = {"spec": {"ephemeralContainers": debug["spec"]["ephemeralContainers"]}}
        r = kube.kubectl("patch", "pod", "t-debug-target", "-n", ns, "--subresource=ephemeralcontainers", "--type=strategic",
                         "-p", json.dumps(patch), "--dry-run=server", check=False)
        live["spec"]["ephemeralContainers"] = patch["spec"]["ephemeralContainers"]
        # (-rdma-pods matches pods, not the subresource)
        if r.returncode == 0 or f"denied request: {field}" not in r.stderr or not _agrees(
                r.stderr, policies[1:], live, operation="UPDATE", namespace=ns, namespace_labels=TENANT, sub_resource="ephemeralcontainers"):
            report.append(f"debug container: {r.returncode} {r.stderr!r}")
        # claims of the chart's classes outside a namespace that allows RDMA
        for kind, suffix in (("ResourceClaim", "-rdma-claims"), ("ResourceClaimTemplate", "-rdma-claim-templates")):
            obj = claim(kind, ["nic.rdma.lingjun.io"])
            policy = Policy(values, suffix, objs)
            got = _server_verdict(kube, obj, "default")
            if not (got and "DeviceClass 'nic.rdma.lingjun.io'" in got and _agrees(got, [policy], obj, namespace_labels={})):
                report.append(f"{kind} in default: API server {got!r}")
            if _server_verdict(kube, obj, ns) is not None:
                report.append(f"{kind} in {ns}: denied")
        assert not report, "\n".join(report)
    finally:
        kube.kubectl("delete", "pod", "t-debug-target", "-n", "rdma-tenant", "--ignore-not-found", "--wait=false", check=False)
        uninstall(kube)


# ------------------------------------------------------------------ the DaemonSet controller and the scheduler


def _plugin_pods(kube: Kube) -> dict[str, str]:
    """node -> DaemonSet name of the plugin pods bound to a node."""
    pods = kube.get("pods", "-n", NS, "-l", "app.kubernetes.io/component=device-plugin")["items"]
    out = {}
    for p in pods:
        if p["spec"].get("nodeName") and not p["metadata"].get("deletionTimestamp"):
            owner = p["metadata"]["ownerReferences"][0]["name"]
            out[p["spec"]["nodeName"]] = owner.rsplit("-", 1)[1]
    return out


def test_the_plugin_runs_only_where_the_node_labels_say(kube: Kube, kube_nodes: Any) -> None:
    """The real DaemonSet controller and scheduler with validation.required: a validated RDMA node
    without a mode label gets the default mode's plugin, one labelled exclusive the exclusive one; a
    node without RDMA, one not validated and one with an unknown mode get none. Relabelling moves it."""
    rdma = {"feature.node.kubernetes.io/pci-15b3.present": "true"}
    ok = {**rdma, "node-restriction.kubernetes.io/rdma-validated": "true"}
    nodes = {
        "n-shared": ok,
        "n-exclusive": {**ok, "node-restriction.kubernetes.io/rdma-mode": "exclusive"},
        "n-no-rdma": {"node-restriction.kubernetes.io/rdma-validated": "true"},
        "n-not-validated": {**rdma, "node-restriction.kubernetes.io/rdma-validated": "false"},
        "n-odd-mode": {**ok, "node-restriction.kubernetes.io/rdma-mode": "turbo"},
    }
    for name, labels in nodes.items():
        kube_nodes(name, labels=labels).start()
    install(kube, INSTALLS["validation-required"])
    try:
        want = {"n-shared": "shared", "n-exclusive": "exclusive"}
        assert wait_for(lambda: _plugin_pods(kube) == want, timeout=90), _plugin_pods(kube)
        kube.kubectl("label", "node", "n-shared", "node-restriction.kubernetes.io/rdma-mode=exclusive")
        kube.kubectl("label", "node", "n-not-validated", "node-restriction.kubernetes.io/rdma-validated=true", "--overwrite")
        want = {"n-shared": "exclusive", "n-exclusive": "exclusive", "n-not-validated": "shared"}
        assert wait_for(lambda: _plugin_pods(kube) == want, timeout=90), _plugin_pods(kube)
    finally:
        uninstall(kube)


def test_a_rolling_update_keeps_to_max_unavailable(kube: Kube, kube_nodes: Any) -> None:
    """Four nodes, maxUnavailable 1: an image whose plugin exits at once (crash-loops, never
    available) replaces one pod and the rollout stops there; the three others keep the old one."""
    for i in range(4):
        kube_nodes(f"n-roll-{i}", labels={"feature.node.kubernetes.io/pci-15b3.present": "true"},
                   images={"rdma-device-plugin-broken": {"entrypoint": ["/bin/false"], "path": []}}).start()
    values = {"updateStrategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 1}}, "minReadySeconds": 3}
    install(kube, values)
    try:
        # Available, not only Ready: the DaemonSet controller deletes old pods that are not yet
        # available (minReadySeconds) all at once, whatever maxUnavailable says.
        def ready() -> bool:
            ds = kube.get("daemonset", "-n", NS, "rdma-rdma-device-plugin-shared")["status"]
            return ds.get("numberAvailable") == 4 and ds.get("updatedNumberScheduled") == 4

        assert wait_for(ready, timeout=90)
        install(kube, {**values, "image": {**IMAGE["image"], "repository": "rdma/rdma-device-plugin-broken"}})

        def images() -> list[str]:
            pods = kube.get("pods", "-n", NS, "-l", "app.kubernetes.io/component=device-plugin")["items"]
            return sorted(p["spec"]["containers"][0]["image"].rsplit("/", 1)[1] for p in pods
                          if not p["metadata"].get("deletionTimestamp"))

        assert wait_for(lambda: images().count(f"rdma-device-plugin-broken:{APP_VERSION}") == 1, timeout=90), images()

        def crashing() -> bool:
            ds = kube.get("daemonset", "-n", NS, "rdma-rdma-device-plugin-shared")["status"]
            return ds.get("numberUnavailable") == 1 and ds.get("updatedNumberScheduled") == 1

        assert wait_for(crashing, timeout=60)
        # It stays there: the DaemonSet controller replaces no second pod while one is unavailable.
        assert not wait_for(lambda: images().count(f"rdma-device-plugin-broken:{APP_VERSION}") > 1, timeout=15)
        assert images().count(f"rdma-device-plugin:{APP_VERSION}") == 3
    finally:
        uninstall(kube)


def test_readiness_stops_a_plugin_that_never_registers_at_the_first_batch(kube: Kube, kube_nodes: Any) -> None:
    """The real plugin on three fixture nodes, ready only once registered with the node's real
    device manager (readinessProbe: healthcheck --ready, run in the container's mount namespace).
    A new image whose plugin starts but never registers (its device-plugin dir leads nowhere)
    replaces one pod, which never becomes Ready: with maxUnavailable 1 the rollout stops there and
    the other nodes keep advertising rdma/hca."""
    plugin = PLUGIN_IMAGES["rdma-device-plugin"]
    # The broken image: the same plugin, with a device-plugin dir where no kubelet listens.
    wrapper = ["/bin/sh", "-c", 'exec "$0" "$@" --device-plugin-dir /nonexistent-kubelet-dir', *plugin["entrypoint"]]
    images = {**PLUGIN_IMAGES, "rdma-device-plugin-noreg": {"entrypoint": wrapper, "path": plugin["path"]}}
    nodes = []
    for i in range(3):
        node = kube_nodes(f"n-ready-{i}", labels={"feature.node.kubernetes.io/pci-15b3.present": "true"}, images=images)
        subprocess.run([plugin["path"][0] + "/rdma-device-plugin", "fixture", str(node.root)], check=True, capture_output=True)
        node.start()
        nodes.append(node.name)
    values = {"updateStrategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 1}}, "minReadySeconds": 5}
    install(kube, values)
    try:
        def status() -> dict[str, Any]:
            return dict(kube.get("daemonset", "-n", NS, "rdma-rdma-device-plugin-shared").get("status", {}))

        assert wait_for(lambda: status().get("numberAvailable") == 3, timeout=180), status()
        install(kube, {**values, "image": {**IMAGE["image"], "repository": "rdma/rdma-device-plugin-noreg"}})

        def pods() -> list[dict[str, Any]]:
            items = kube.get("pods", "-n", NS, "-l", "app.kubernetes.io/component=device-plugin")["items"]
            return [p for p in items if not p["metadata"].get("deletionTimestamp")]

        def new_pods() -> list[dict[str, Any]]:
            return [p for p in pods() if "noreg" in p["spec"]["containers"][0]["image"]]

        assert wait_for(lambda: len(new_pods()) == 1 and new_pods()[0]["status"].get("phase") == "Running", timeout=120)
        # Running but never Ready, and no second pod is replaced while it is unavailable.
        assert not wait_for(lambda: any(c["ready"] for p in new_pods() for c in p["status"].get("containerStatuses", [])), 30)
        assert len(new_pods()) == 1 and status().get("updatedNumberScheduled") == 1
        ready = {n: kube.get("node", n)["status"]["allocatable"].get("rdma/hca") for n in nodes}
        # The node of the new pod lost its plugin (allocatable 0 while the kubelet keeps the stopped
        # endpoint); the two others still advertise theirs.
        assert list(ready.values()).count("1k") == 2, ready
    finally:
        uninstall(kube)
