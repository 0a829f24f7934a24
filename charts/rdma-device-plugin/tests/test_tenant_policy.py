"""The tenant policy (templates/tenant-policy.yaml, docs/security.md), evaluated with cel-python as the
API server does (test_real_cluster.py runs the same matrix server-side): in a namespace that allows
RDMA, every pod meets Pod Security Baseline with RDMA's exceptions only; RDMA pods and claims of the
chart's DeviceClasses are denied elsewhere."""

from __future__ import annotations

import copy
from typing import Any, Optional

import pytest
from conftest import CASES, NAMESPACE, example_jobs, manifests, parse, render_raw
from test_dra_chart import API as DRA_API_VERSIONS
from test_policy_cel import Policy, pod_of_job, rdma_pod

LABEL = "rdma.lingjun.io/tenant"
TENANT = {LABEL: "true"}
DRIVER = "rdma.lingjun.io"
DRA = {"dra": {"enabled": True}}


def dra_objects(values: dict[str, Any]) -> list[dict[str, Any]]:
    return parse(render_raw(values, kube_version="v1.37.0", api_versions=DRA_API_VERSIONS))


class Tenant:
    """The two tenant policies (-rdma-tenant in labelled namespaces, -rdma-tenant-outside elsewhere),
    whose bindings' namespaceSelectors split the namespaces between them."""

    def __init__(self, values: dict[str, Any], objs: Optional[list[dict[str, Any]]] = None) -> None:
        self.inside, self.outside = Policy(values, "-rdma-tenant", objs), Policy(values, "-rdma-tenant-outside", objs)
        self.policy, self.binding = self.inside.policy, self.inside.binding

    def evaluate(self, pod: dict[str, Any], **kw: Any) -> Optional[list[str]]:
        verdicts = [p.evaluate(pod, **kw) for p in (self.inside, self.outside)]
        assert None in verdicts, verdicts  # never both
        return next((v for v in verdicts if v is not None), None)


@pytest.fixture(scope="module")
def tenant() -> Tenant:
    return Tenant({})


@pytest.fixture(scope="module")
def tenant_on() -> Tenant:
    return Tenant(CASES["non-hostnetwork"])


def good_pod() -> dict[str, Any]:
    """An RDMA pod as the examples write it: hostNetwork, drop ALL, add IPC_LOCK."""
    pod = rdma_pod()
    pod["spec"]["containers"][0]["securityContext"] = {"capabilities": {"drop": ["ALL"], "add": ["IPC_LOCK"]}}
    return pod


def plain_pod(security_context: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    container: dict[str, Any] = {"name": "web", "image": "nginx",
                                 "securityContext": security_context or {"capabilities": {"drop": ["ALL"]}}}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "web"}, "spec": {"containers": [container]}}


def claim_pod() -> dict[str, Any]:
    """Gets its NICs only through a claim: no rdma/hca in its resources."""
    pod = good_pod()
    container = pod["spec"]["containers"][0]
    container["resources"] = {"limits": {"nvidia.com/gpu": 8}, "claims": [{"name": "nics"}]}
    pod["spec"]["resourceClaims"] = [{"name": "nics", "resourceClaimTemplateName": "rdma-nics"}]
    return pod


def debug_container(privileged: bool = True) -> dict[str, Any]:
    sc: dict[str, Any] = {"privileged": True} if privileged else {"capabilities": {"drop": ["ALL"]}}
    return {"name": "debugger", "image": "busybox", "targetContainerName": "train", "securityContext": sc}


def issue_matrix() -> dict[str, tuple[dict[str, Any], str]]:
    """The issue's pods, each admitted before: name -> (pod, the field its denial must name)."""
    m: dict[str, tuple[dict[str, Any], str]] = {}
    p = good_pod()
    p["spec"]["containers"][0]["securityContext"] = {"privileged": True}
    m["privileged-rdma"] = (p, "spec.containers['train'].securityContext.privileged")
    p = good_pod()
    p["spec"]["hostPID"] = True
    p["spec"]["volumes"] = [{"name": "root", "hostPath": {"path": "/"}}]
    p["spec"]["containers"][0]["volumeMounts"] = [{"name": "root", "mountPath": "/host"}]
    m["hostpid-hostpath-root"] = (p, "spec.hostPID")
    p = copy.deepcopy(p)
    del p["spec"]["hostPID"]
    m["hostpath-root"] = (p, "spec.volumes['root'].hostPath")
    for cap in ("NET_ADMIN", "SYS_ADMIN"):
        p = good_pod()
        p["spec"]["containers"][0]["securityContext"]["capabilities"]["add"] = ["IPC_LOCK", cap]
        m[cap.lower().replace("_", "-")] = (p, f"spec.containers['train'].securityContext.capabilities.add: {cap}")
    m["privileged-non-rdma"] = (plain_pod({"privileged": True}), "spec.containers['web'].securityContext.privileged")
    p = good_pod()
    p["spec"]["ephemeralContainers"] = [debug_container()]
    m["privileged-debug-container"] = (p, "spec.ephemeralContainers['debugger'].securityContext.privileged")
    p = claim_pod()
    p["spec"]["containers"][0]["securityContext"]["capabilities"]["add"] = ["IPC_LOCK", "NET_RAW"]
    m["claim-only-net-raw"] = (p, "spec.containers['train'].securityContext.capabilities.add: NET_RAW")
    p = good_pod()
    del p["spec"]["containers"][0]["securityContext"]["capabilities"]["drop"]
    m["rdma-without-drop-all"] = (p, "spec.containers['train'].securityContext.capabilities.drop without ALL")
    return m


def _first(messages: Optional[list[str]]) -> str:
    assert messages, messages
    return messages[0]


@pytest.mark.parametrize("name", sorted(issue_matrix()))
def test_the_issue_matrix_is_denied_naming_the_field(tenant: Tenant, name: str) -> None:
    pod, field = issue_matrix()[name]
    sub = "ephemeralcontainers" if "debug" in name else ""
    message = _first(tenant.evaluate(pod, operation="UPDATE" if sub else "CREATE", namespace_labels=TENANT, sub_resource=sub))
    assert message.startswith(field) and " is not allowed: " in message, message
    assert "docs/security.md" in message


def test_the_seed_jobs_and_the_chart_test_pod_are_admitted(tenant: Tenant, tenant_on: Tenant) -> None:
    jobs = example_jobs()
    for job in jobs.values():
        container = job["spec"]["template"]["spec"]["containers"][0]
        assert container["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["IPC_LOCK"]}
    assert tenant.evaluate(pod_of_job(jobs["rdma-hostnetwork-test"]), namespace_labels=TENANT) == []
    assert tenant.evaluate(pod_of_job(jobs["rdma-non-hostnetwork-test"]), namespace_labels=TENANT) == []
    assert tenant_on.evaluate(pod_of_job(jobs["rdma-non-hostnetwork-test"]), namespace_labels=TENANT) == []
    for case, policy in (("defaults", tenant), ("non-hostnetwork", tenant_on)):
        test_pod = next(o for o in manifests(CASES[case]) if o["kind"] == "Pod" and o["metadata"]["name"].endswith("-test-allocation"))
        assert policy.evaluate(test_pod, namespace=NAMESPACE) == []  # the release namespace, unlabelled
    assert tenant.evaluate(claim_pod(), namespace_labels=TENANT) == []  # a claim pod may use the host's network
    assert tenant.evaluate(plain_pod(), namespace_labels=TENANT) == []


def test_host_network_only_for_rdma_pods_and_only_while_the_switch_is_off(tenant: Tenant, tenant_on: Tenant) -> None:
    web = plain_pod()
    web["spec"]["hostNetwork"] = True
    assert "spec.hostNetwork: true is forbidden" in _first(tenant.evaluate(web, namespace_labels=TENANT))
    message = _first(tenant_on.evaluate(pod_of_job(example_jobs()["rdma-hostnetwork-test"]), namespace_labels=TENANT))
    assert message.startswith("spec.hostNetwork: true is forbidden") and "nonHostNetwork.enabled is true" in message
    # a hostNetwork pod's ports get hostPort = containerPort by defaulting: allowed where hostNetwork is
    pod = good_pod()
    pod["spec"]["containers"][0]["ports"] = [{"containerPort": 8080, "hostPort": 8080}]
    assert tenant.evaluate(pod, namespace_labels=TENANT) == []
    pod["spec"]["hostNetwork"] = False
    assert _first(tenant.evaluate(pod, namespace_labels=TENANT)).startswith("spec.containers['train'].ports[].hostPort: 8080 ")


def test_rdma_pods_only_in_namespaces_that_allow_rdma(tenant: Tenant) -> None:
    message = _first(tenant.evaluate(good_pod(), namespace="team-a", namespace_labels={}))
    assert "namespace 'team-a'" in message and f"kubectl label namespace team-a {LABEL}=true" in message
    assert _first(tenant.evaluate(good_pod(), namespace="team-a", namespace_labels={LABEL: "false"}))
    assert tenant.evaluate(good_pod(), namespace="team-a", namespace_labels=TENANT) == []
    # other namespaces' non-RDMA pods are Pod Security Admission's business, not this policy's
    assert tenant.evaluate(plain_pod({"privileged": True}), namespace="team-b") is None


def test_only_creates_and_debug_containers_are_evaluated(tenant: Tenant) -> None:
    bad = plain_pod({"privileged": True})
    assert tenant.evaluate(bad, operation="UPDATE", namespace_labels=TENANT, old=bad) is None  # fields immutable
    pod = good_pod()
    pod["spec"]["ephemeralContainers"] = [debug_container(privileged=False)]
    assert tenant.evaluate(pod, operation="UPDATE", namespace_labels=TENANT, sub_resource="ephemeralcontainers") == []


def test_the_plugin_pods_are_not_evaluated_in_their_own_namespace(tenant: Tenant) -> None:
    for ds in (o for o in manifests({}) if o["kind"] == "DaemonSet"):
        pod = {"apiVersion": "v1", "kind": "Pod", **copy.deepcopy(ds["spec"]["template"])}
        assert tenant.evaluate(pod, namespace=NAMESPACE) is None


@pytest.mark.parametrize(
    "where,fix,field",
    [
        ("pod", {"sysctls": [{"name": "kernel.msgmax", "value": "1"}]}, "spec.securityContext.sysctls: kernel.msgmax"),
        ("pod", {"seccompProfile": {"type": "Unconfined"}}, "spec.securityContext.seccompProfile.type: Unconfined"),
        ("container", {"seccompProfile": {"type": "Unconfined"}}, "spec.containers['web'].securityContext.seccompProfile.type: Unconfined"),
        ("container", {"appArmorProfile": {"type": "Unconfined"}}, "spec.containers['web'].securityContext.appArmorProfile.type: Unconfined"),
        ("pod", {"seLinuxOptions": {"type": "spc_t"}}, "spec.securityContext.seLinuxOptions"),
        ("container", {"seLinuxOptions": {"user": "system_u"}}, "spec.containers['web'].securityContext.seLinuxOptions"),
        ("container", {"procMount": "Unmasked"}, "spec.containers['web'].securityContext.procMount: Unmasked"),
        ("container", {"windowsOptions": {"hostProcess": True}}, "spec.containers['web'].securityContext.windowsOptions.hostProcess: true"),
        ("pod", {"hostIPC": True}, "spec.hostIPC: true"),
        ("annotation", {"container.apparmor.security.beta.kubernetes.io/web": "unconfined"},
         "metadata.annotations['container.apparmor.security.beta.kubernetes.io/web']: unconfined"),
    ],
)
def test_every_baseline_control(tenant: Tenant, where: str, fix: dict[str, Any], field: str) -> None:
    pod = plain_pod()
    if where == "pod":
        target = pod["spec"] if "hostIPC" in fix else pod["spec"].setdefault("securityContext", {})
        target.update(fix)
    elif where == "container":
        pod["spec"]["containers"][0]["securityContext"].update(fix)
    else:
        pod["metadata"]["annotations"] = fix
    assert _first(tenant.evaluate(pod, namespace_labels=TENANT)).startswith(field + " is not allowed")


@pytest.mark.parametrize(
    "fix",
    [{"seccompProfile": {"type": "RuntimeDefault"}}, {"appArmorProfile": {"type": "Localhost", "localhostProfile": "p"}},
     {"seLinuxOptions": {"type": "container_t", "level": "s0:c1"}}, {"procMount": "Default"}, {"capabilities": {"drop": ["all"], "add": ["ipc_lock"]}}],
)
def test_what_baseline_allows_is_admitted(tenant: Tenant, fix: dict[str, Any]) -> None:
    pod = plain_pod()
    pod["spec"]["containers"][0]["securityContext"].update(fix)
    pod["spec"]["securityContext"] = {"sysctls": [{"name": "net.ipv4.ip_local_port_range", "value": "1024 65000"}]}
    assert tenant.evaluate(pod, namespace_labels=TENANT) == []


def test_policy_shape(tenant: Tenant) -> None:
    for p in (tenant.inside, tenant.outside):
        assert p.binding["spec"]["matchResources"]["namespaceSelector"]["matchExpressions"][0]["key"] == LABEL
    (rule,) = tenant.policy["spec"]["matchConstraints"]["resourceRules"]
    assert rule["resources"] == ["pods", "pods/ephemeralcontainers"] and rule["operations"] == ["CREATE", "UPDATE"]
    assert tenant.binding["spec"]["validationActions"] == ["Deny"]
    assert all("\n" not in v.get("message", "") for v in tenant.policy["spec"]["validations"])
    assert not [o for o in manifests(CASES["policy-off"]) if "-rdma-tenant" in o["metadata"]["name"]]
    label = Tenant({"admissionPolicy": {"tenantNamespaceLabel": "example.com/rdma"}})
    assert label.evaluate(good_pod(), namespace_labels={"example.com/rdma": "true"}) == []
    assert label.evaluate(good_pod(), namespace_labels=TENANT)


# ------------------------------------------------------------------ claims of the chart's DeviceClasses


def claim(kind: str, classes: list[str], first_available: bool = False) -> dict[str, Any]:
    if first_available:
        requests = [{"name": "r", "firstAvailable": [{"name": f"s{i}", "deviceClassName": c} for i, c in enumerate(classes)]}]
    else:
        requests = [{"name": f"r{i}", "exactly": {"deviceClassName": c}} for i, c in enumerate(classes)]
    devices = {"requests": requests}
    spec = {"devices": devices} if kind == "ResourceClaim" else {"spec": {"devices": devices}}
    return {"apiVersion": "resource.k8s.io/v1", "kind": kind, "metadata": {"name": "nics"}, "spec": spec}


@pytest.mark.parametrize("kind,suffix", [("ResourceClaim", "-rdma-claims"), ("ResourceClaimTemplate", "-rdma-claim-templates")])
def test_claims_of_the_chart_classes_only_in_namespaces_that_allow_rdma(kind: str, suffix: str) -> None:
    policy = Policy(DRA, suffix, objs=dra_objects(DRA))
    for classes, first in (([f"nic.{DRIVER}"], False), (["gpu.nvidia.com", f"all-nics.{DRIVER}"], False),
                           (["gpu.nvidia.com", f"nic-exclusive.{DRIVER}"], True)):
        message = _first(policy.evaluate(claim(kind, classes, first), namespace="team-a", namespace_labels={}))
        assert f"{kind} asks for DeviceClass '{classes[-1]}'" in message and f"label namespace team-a {LABEL}=true" in message
        assert policy.evaluate(claim(kind, classes, first), namespace="team-a", namespace_labels=TENANT) == []
    # GPUs, and the extended-resource classes the scheduler claims for rdma/hca pods, are not this policy's
    for other in ("gpu.nvidia.com", f"rdma-hca.extended.{DRIVER}"):
        assert policy.evaluate(claim(kind, [other]), namespace="team-a", namespace_labels={}) == []


def test_claim_policies_render_only_with_dra() -> None:
    names = {o["metadata"]["name"] for o in manifests({}) if o["kind"] == "ValidatingAdmissionPolicy"}
    assert not any(n.endswith(("-rdma-claims", "-rdma-claim-templates")) for n in names)
    extended = [o["metadata"]["name"] for o in dra_objects(DRA) if o["kind"] == "DeviceClass" and ".extended." in o["metadata"]["name"]]
    assert extended == [f"rdma-hca.extended.{DRIVER}"]  # the name the claim test leaves out
