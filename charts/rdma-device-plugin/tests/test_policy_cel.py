"""Evaluate the rendered ValidatingAdmissionPolicy with cel-python, the way the API server does:
matchConditions (all true, else the request is not validated), then variables in order, then each
validation (false = violation with its message). Inputs: the seed's two Jobs (examples/), the chart's
own pods, and hand-made bad pods."""

from __future__ import annotations

import copy
from typing import Any, Optional

import celpy
import pytest
from celpy import celtypes
import helm_python
from conftest import CASES, CLUSTER_API_VERSIONS, MONITORING, NAMESPACE, VAP_KINDS, by_kind, daemonsets, example_jobs, manifests, one, parse, render_raw

ENV = celpy.Environment()


class Policy:
    """One rendered policy (picked by name suffix: -rdma-pods, -rdma-workloads, -rdma-cronjobs) and its binding."""

    def __init__(self, values: dict[str, Any], suffix: str = "-rdma-pods", objs: Optional[list[dict[str, Any]]] = None) -> None:
        objs = manifests(values) if objs is None else objs
        self.policy = one(objs, "ValidatingAdmissionPolicy", suffix)
        self.binding = one(objs, "ValidatingAdmissionPolicyBinding", suffix)
        spec = self.policy["spec"]
        self.conditions = [(c["name"], self._compile(c["expression"])) for c in spec.get("matchConditions", [])]
        self.variables = [(v["name"], self._compile(v["expression"])) for v in spec.get("variables", [])]
        # As the API server does: messageExpression when it evaluates to a non-empty string, else message.
        self.validations = [
            (v["message"], self._compile(v["messageExpression"]) if "messageExpression" in v else None, self._compile(v["expression"]))
            for v in spec["validations"]
        ]

    def _selects(self, labels: dict[str, str]) -> bool:
        """The binding's matchResources.namespaceSelector (matchExpressions), as the API server applies it."""
        selector = self.binding["spec"].get("matchResources", {}).get("namespaceSelector", {})
        for e in selector.get("matchExpressions", []):
            found = labels.get(e["key"])
            ok = {"In": found in e.get("values", []), "NotIn": found not in e.get("values", []),
                  "Exists": found is not None, "DoesNotExist": found is None}[e["operator"]]
            if not ok:
                return False
        return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())

    @staticmethod
    def _compile(expression: str) -> Any:
        return ENV.program(ENV.compile(expression))

    @staticmethod
    def _run(program: Any, activation: dict[str, Any]) -> Any:
        result = program.evaluate(activation)
        if isinstance(result, celpy.CELEvalError):
            raise AssertionError(f"CEL error: {result}")
        return result

    def evaluate(self, pod: dict[str, Any], operation: str = "CREATE", namespace: str = "default",
                 old: Optional[dict[str, Any]] = None, namespace_labels: Optional[dict[str, str]] = None,
                 sub_resource: str = "") -> Optional[list[str]]:
        """None when the policy does not apply (a matchCondition is false), else the violation messages.
        The API server denies with the first of them only (test_real_cluster.py shows it).
        namespace_labels: the labels of the request's namespace (namespaceObject)."""
        if not self._selects(namespace_labels or {}):
            return None
        kind = pod.get("kind", "Pod")
        ns_object: dict[str, Any] = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}}
        if namespace_labels is not None:
            ns_object["metadata"]["labels"] = namespace_labels
        activation: dict[str, Any] = {
            "object": celpy.json_to_cel(pod),
            "oldObject": celpy.json_to_cel(old),
            "namespaceObject": celpy.json_to_cel(ns_object),
            "request": celpy.json_to_cel({"operation": operation, "namespace": namespace, "subResource": sub_resource,
                                          "kind": {"group": "", "version": "v1", "kind": kind}}),
        }
        for _name, program in self.conditions:
            if not self._run(program, activation):
                return None
        variables = celtypes.MapType({})
        activation["variables"] = variables
        for name, program in self.variables:
            variables[celtypes.StringType(name)] = self._run(program, activation)
        messages = []
        for message, message_program, program in self.validations:
            if self._run(program, activation):
                continue
            if message_program is not None:
                text = str(self._run(message_program, activation))
                assert text and "\n" not in text and len(text) <= 5000, text  # else the API server falls back
                message = text
            messages.append(message)
        return messages


@pytest.fixture(scope="module")
def switch_off() -> Policy:
    return Policy({})


@pytest.fixture(scope="module")
def switch_on() -> Policy:
    return Policy(CASES["non-hostnetwork"])


def pod_of_job(job: dict[str, Any]) -> dict[str, Any]:
    template = copy.deepcopy(job["spec"]["template"])
    return {"apiVersion": "v1", "kind": "Pod", "metadata": template.get("metadata", {"name": "x"}), "spec": template["spec"]}


def rdma_pod(host_network: Optional[bool] = True, caps: Optional[list[str]] = ("IPC_LOCK",), where: str = "limits",
             resource: str = "rdma/hca", security_context: bool = True) -> dict[str, Any]:
    container: dict[str, Any] = {"name": "train", "image": "img", "resources": {where: {resource: 1, "nvidia.com/gpu": 8}}}
    if security_context:
        container["securityContext"] = {"capabilities": {"add": list(caps)}} if caps is not None else {}
    spec: dict[str, Any] = {"containers": [container]}
    if host_network is not None:
        spec["hostNetwork"] = host_network
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "labels": {"app": "train"}}, "spec": spec}


def _hostnetwork_denied(messages: Optional[list[str]]) -> bool:
    return messages is not None and any("nonHostNetwork.enabled" in m and "hostNetwork: true" in m for m in messages)


def _ipc_lock_denied(messages: Optional[list[str]]) -> bool:
    return messages is not None and any("IPC_LOCK" in m for m in messages)


# ------------------------------------------------------------------ the seed's Jobs


def test_examples_are_the_seed_jobs() -> None:
    jobs = example_jobs()
    assert sorted(j["metadata"]["name"] for j in jobs.values()) == ["rdma-hostnetwork-test", "rdma-non-hostnetwork-test"]
    for job in jobs.values():
        container = job["spec"]["template"]["spec"]["containers"][0]
        assert container["resources"]["limits"] == {"nvidia.com/gpu": 8, "rdma/hca": 1}
        # the seed's SYS_RESOURCE is gone: IPC_LOCK lifts the memlock limit, and the tenant policy allows no other
        assert container["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["IPC_LOCK"]}


def test_seed_hostnetwork_job_allowed_either_way(switch_off: Policy, switch_on: Policy) -> None:
    pod = pod_of_job(example_jobs()["rdma-hostnetwork-test"])
    assert pod["spec"]["hostNetwork"] is True
    assert switch_off.evaluate(pod) == []
    assert switch_on.evaluate(pod) == []


def test_seed_non_hostnetwork_job_denied_when_switch_off(switch_off: Policy) -> None:
    pod = pod_of_job(example_jobs()["rdma-non-hostnetwork-test"])
    messages = switch_off.evaluate(pod)
    assert _hostnetwork_denied(messages)
    assert not _ipc_lock_denied(messages)


def test_seed_non_hostnetwork_job_allowed_when_switch_on(switch_on: Policy) -> None:
    pod = pod_of_job(example_jobs()["rdma-non-hostnetwork-test"])
    assert switch_on.evaluate(pod) == []
    # and the hostNetwork rule is not rendered at all
    assert not any("hostNetwork" in v["expression"] for v in switch_on.policy["spec"]["validations"])


# ------------------------------------------------------------------ bad and odd pods


@pytest.mark.parametrize("policy_name", ["switch_off", "switch_on"])
def test_no_ipc_lock_denied(policy_name: str, request: pytest.FixtureRequest) -> None:
    policy: Policy = request.getfixturevalue(policy_name)
    assert _ipc_lock_denied(policy.evaluate(rdma_pod(caps=["SYS_RESOURCE"])))
    assert _ipc_lock_denied(policy.evaluate(rdma_pod(caps=None)))  # securityContext without capabilities
    assert _ipc_lock_denied(policy.evaluate(rdma_pod(security_context=False)))  # no securityContext at all


def test_missing_host_network_field_is_not_host_network(switch_off: Policy) -> None:
    messages = switch_off.evaluate(rdma_pod(host_network=None))
    assert _hostnetwork_denied(messages) and not _ipc_lock_denied(messages)


def test_no_security_context_and_no_host_network_gives_both_messages(switch_off: Policy) -> None:
    messages = switch_off.evaluate(rdma_pod(host_network=False, security_context=False))
    assert messages is not None and len(messages) == 2
    assert _hostnetwork_denied(messages) and _ipc_lock_denied(messages)


def test_rdma_in_requests_only_is_caught(switch_off: Policy) -> None:
    assert _hostnetwork_denied(switch_off.evaluate(rdma_pod(host_network=False, where="requests")))
    assert _ipc_lock_denied(switch_off.evaluate(rdma_pod(where="requests", caps=[])))
    assert switch_off.evaluate(rdma_pod(where="requests")) == []


def test_init_container_requesting_rdma_needs_ipc_lock(switch_off: Policy) -> None:
    pod = rdma_pod()
    pod["spec"]["containers"][0]["resources"] = {"limits": {"nvidia.com/gpu": 8}}
    pod["spec"]["initContainers"] = [{"name": "warmup", "image": "img", "resources": {"limits": {"rdma/hca": 1}}}]
    assert _ipc_lock_denied(switch_off.evaluate(pod))
    pod["spec"]["initContainers"][0]["securityContext"] = {"capabilities": {"add": ["IPC_LOCK"]}}
    assert switch_off.evaluate(pod) == []
    pod["spec"]["hostNetwork"] = False
    assert _hostnetwork_denied(switch_off.evaluate(pod))


def test_only_the_requesting_container_needs_ipc_lock(switch_off: Policy) -> None:
    pod = rdma_pod()
    pod["spec"]["containers"].append({"name": "sidecar", "image": "img"})
    assert switch_off.evaluate(pod) == []


# containerd's CRI (internal/cri/opts WithCapabilities) adds every capability as "CAP_" + upper(name)
# and treats "ALL" case-insensitively; CRI-O adds CAP_ only when missing. So these work on both:
WORKING_SPELLINGS = ["IPC_LOCK", "ipc_lock", "Ipc_Lock", "ALL", "all"]


@pytest.mark.parametrize("cap", WORKING_SPELLINGS)
def test_capability_spellings_the_runtimes_grant(switch_off: Policy, cap: str) -> None:
    assert switch_off.evaluate(rdma_pod(caps=["SYS_RESOURCE", cap])) == []


@pytest.mark.parametrize("cap", ["CAP_IPC_LOCK", "cap_ipc_lock", "CAP_ALL"])
def test_cap_prefix_is_rejected_with_the_right_spelling(switch_off: Policy, cap: str) -> None:
    """containerd would start the container with CAP_CAP_IPC_LOCK (or fail): never admit it."""
    messages = switch_off.evaluate(rdma_pod(caps=[cap]))
    assert messages, cap
    text = " ".join(messages)
    assert f"'{cap}'" in text and "'train'" in text
    assert "without the CAP_ prefix" in text and "IPC_LOCK" in text


def test_cap_prefix_rejected_even_next_to_the_right_spelling(switch_off: Policy) -> None:
    messages = switch_off.evaluate(rdma_pod(caps=["IPC_LOCK", "CAP_SYS_RESOURCE"]))
    assert messages and any("'CAP_SYS_RESOURCE'" in m for m in messages)


def test_privileged_satisfies_ipc_lock(switch_off: Policy) -> None:
    pod = rdma_pod(caps=None)
    pod["spec"]["containers"][0]["securityContext"] = {"privileged": True}
    assert switch_off.evaluate(pod) == []


def test_messages_name_the_offending_container(switch_off: Policy) -> None:
    pod = rdma_pod()
    pod["spec"]["containers"].append({"name": "worker-2", "image": "img", "resources": {"limits": {"rdma/hca": 1}}})
    (message,) = switch_off.evaluate(pod) or [""]
    assert "'worker-2'" in message and "'train'" not in message and "IPC_LOCK" in message


@pytest.mark.parametrize("policy_name", ["switch_off", "switch_on"])
def test_non_rdma_pods_are_not_evaluated(policy_name: str, request: pytest.FixtureRequest) -> None:
    policy: Policy = request.getfixturevalue(policy_name)
    plain = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "web"}, "spec": {"containers": [{"name": "web", "image": "nginx"}]}}
    assert policy.evaluate(plain) is None
    gpu_only = rdma_pod(host_network=False, security_context=False, resource="nvidia.com/gpu")
    assert policy.evaluate(gpu_only) is None


def test_plugin_pods_are_never_evaluated(switch_off: Policy) -> None:
    for ds in daemonsets({}).values():
        pod = {"apiVersion": "v1", "kind": "Pod", **copy.deepcopy(ds["spec"]["template"])}
        assert switch_off.evaluate(pod, namespace=NAMESPACE) is None  # they request no RDMA


def test_plugin_labels_buy_no_exemption(switch_off: Policy) -> None:
    """Anyone who may create pods in the release namespace can copy the plugin's labels: a pod that
    requests RDMA is validated whatever its labels say."""
    for ds in daemonsets({}).values():
        pod = {"apiVersion": "v1", "kind": "Pod", **copy.deepcopy(ds["spec"]["template"])}
        pod["spec"]["hostNetwork"] = False
        pod["spec"]["containers"][0]["resources"] = {"limits": {"rdma/hca": 1}}
        messages = switch_off.evaluate(pod, namespace=NAMESPACE)
        assert _hostnetwork_denied(messages) and _ipc_lock_denied(messages)
    for condition in switch_off.policy["spec"]["matchConditions"]:
        assert "labels" not in condition["expression"] and "namespace" not in condition["expression"]


@pytest.mark.parametrize("case", ["defaults", "non-hostnetwork"])
def test_helm_test_pod_passes_the_policy(case: str) -> None:
    policy = Policy(CASES[case])
    pod = one(manifests(CASES[case]), "Pod", "-test-allocation")
    assert policy.evaluate(pod, namespace=NAMESPACE) == []


def test_update_of_a_pod_that_already_held_rdma_is_not_blocked(switch_off: Policy) -> None:
    bad = rdma_pod(host_network=False, caps=[])
    assert switch_off.evaluate(bad, operation="CREATE")
    # e.g. the Job controller removing its finalizer from a pod created before the policy
    updated = copy.deepcopy(bad)
    updated["metadata"]["finalizers"] = []
    assert switch_off.evaluate(updated, operation="UPDATE", old=bad) is None
    # an update that would newly add an RDMA request is validated
    before = rdma_pod(host_network=False, caps=[], resource="nvidia.com/gpu")
    assert _hostnetwork_denied(switch_off.evaluate(bad, operation="UPDATE", old=before))


def test_extra_resources_are_covered() -> None:
    policy = Policy(CASES["extra-resources"])
    for resource in ("rdma/hca_roce", "rdma/hca_ib", "example.com/bond0"):
        assert _hostnetwork_denied(policy.evaluate(rdma_pod(host_network=False, resource=resource)))
        assert policy.evaluate(rdma_pod(resource=resource)) == []
    assert policy.evaluate(rdma_pod(host_network=False, resource="rdma/hca")) is None  # not this release's resource


def test_binding_and_policy_shape(switch_off: Policy) -> None:
    spec = switch_off.policy["spec"]
    assert switch_off.binding["spec"] == {"policyName": switch_off.policy["metadata"]["name"], "validationActions": ["Deny"]}
    assert spec["failurePolicy"] == "Fail"
    (rule,) = spec["matchConstraints"]["resourceRules"]
    assert rule == {"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE", "UPDATE"], "resources": ["pods"]}
    assert all("\n" not in v["message"] for v in spec["validations"])  # Kubernetes rejects line breaks
    warn = Policy(CASES["policy-warn-audit"])
    assert warn.binding["spec"]["validationActions"] == ["Warn", "Audit"]
    assert warn.policy["spec"]["failurePolicy"] == "Ignore"


def test_policy_off_renders_nothing() -> None:
    objs = manifests(CASES["policy-off"])
    assert not by_kind(objs, "ValidatingAdmissionPolicy") and not by_kind(objs, "ValidatingAdmissionPolicyBinding")


# ------------------------------------------------------------------ workloads: Warn at apply time

# kind -> (apiVersion, path of the pod template in the object)
WORKLOADS = {
    "Deployment": ("apps/v1", ("spec", "template")),
    "StatefulSet": ("apps/v1", ("spec", "template")),
    "DaemonSet": ("apps/v1", ("spec", "template")),
    "ReplicaSet": ("apps/v1", ("spec", "template")),
    "Job": ("batch/v1", ("spec", "template")),
    "CronJob": ("batch/v1", ("spec", "jobTemplate", "spec", "template")),
    "ReplicationController": ("v1", ("spec", "template")),
}


def workload(kind: str, pod: dict[str, Any]) -> dict[str, Any]:
    api_version, path = WORKLOADS[kind]
    obj: dict[str, Any] = {"apiVersion": api_version, "kind": kind, "metadata": {"name": "w"}}
    node = obj
    for key in path[:-1]:
        node = node.setdefault(key, {})
    node[path[-1]] = {"metadata": pod["metadata"], "spec": pod["spec"]}
    return obj


def _workload_policy(kind: str, values: dict[str, Any] | None = None) -> Policy:
    return Policy(values or {}, "-rdma-cronjobs" if kind == "CronJob" else "-rdma-workloads")


@pytest.mark.parametrize("kind", sorted(WORKLOADS))
def test_bad_workload_templates_warn_at_apply_time(kind: str) -> None:
    policy = _workload_policy(kind)
    messages = policy.evaluate(workload(kind, rdma_pod(host_network=False, caps=["CAP_IPC_LOCK"])))
    assert messages is not None and _hostnetwork_denied(messages) and any("'CAP_IPC_LOCK'" in m for m in messages)
    assert policy.evaluate(workload(kind, rdma_pod())) == []
    plain = {"metadata": {}, "spec": {"containers": [{"name": "web", "image": "nginx"}]}}
    assert policy.evaluate(workload(kind, plain)) is None
    # the pod rule of the seed's Job holds for its template too
    job_pod = pod_of_job(example_jobs()["rdma-non-hostnetwork-test"])
    assert _hostnetwork_denied(policy.evaluate(workload(kind, job_pod)))


def test_workload_policies_only_warn_and_cover_every_controller() -> None:
    kinds = set()
    for suffix in ("-rdma-workloads", "-rdma-cronjobs"):
        policy = Policy({}, suffix)
        # Warn, as Pod Security Admission does for templates: the Deny stays on the pods themselves.
        assert policy.binding["spec"]["validationActions"] == ["Warn"]
        assert policy.policy["spec"]["failurePolicy"] == "Ignore"
        for rule in policy.policy["spec"]["matchConstraints"]["resourceRules"]:
            assert rule["operations"] == ["CREATE", "UPDATE"]
            kinds |= {(g, r) for g in rule["apiGroups"] for r in rule["resources"]}
    assert kinds == {("apps", "deployments"), ("apps", "statefulsets"), ("apps", "daemonsets"),
                     ("apps", "replicasets"), ("batch", "jobs"), ("batch", "cronjobs"), ("", "replicationcontrollers")}
    assert Policy({}).binding["spec"]["validationActions"] == ["Deny"]
    objs = manifests({"admissionPolicy": {"warnWorkloads": False}})
    names = [o["metadata"]["name"] for o in by_kind(objs, "ValidatingAdmissionPolicy")]
    assert names == ["rdma-rdma-device-plugin-rdma-pods", "rdma-rdma-device-plugin-rdma-pods-advice",
                     "rdma-rdma-device-plugin-rdma-tenant", "rdma-rdma-device-plugin-rdma-tenant-outside"]


def test_workload_warning_keeps_audit() -> None:
    policy = Policy({"admissionPolicy": {"validationActions": ["Deny", "Audit"]}}, "-rdma-workloads")
    assert policy.binding["spec"]["validationActions"] == ["Warn", "Audit"]


# ------------------------------------------------------------------ API availability gates


def _render_error(values: dict[str, Any], **kwargs: Any) -> str:
    with pytest.raises(helm_python.HelmError) as info:
        render_raw(values, **kwargs)
    return str(info.value)


def test_policy_needs_the_v1_api_and_says_so() -> None:
    # a 1.29 cluster: discovery lists admissionregistration.k8s.io/v1 kinds, but not the policy
    old_cluster = ("admissionregistration.k8s.io/v1/ValidatingWebhookConfiguration", *MONITORING)
    message = _render_error({}, kube_version="v1.29.0", api_versions=old_cluster)
    assert "admissionPolicy.enabled=true" in message
    assert "admissionregistration.k8s.io/v1/ValidatingAdmissionPolicy" in message
    assert "admissionPolicy.enabled=false" in message
    # the rest of the chart installs there once the policy is off
    objs = parse(render_raw({"admissionPolicy": {"enabled": False}}, kube_version="v1.29.0", api_versions=old_cluster))
    assert by_kind(objs, "DaemonSet") and not by_kind(objs, "ValidatingAdmissionPolicy")
    # and on 1.28 too (the chart's kubeVersion floor no longer blocks it)
    render_raw({"admissionPolicy": {"enabled": False}}, kube_version="v1.28.0", api_versions=old_cluster)


def test_policy_rendered_when_the_cluster_serves_it() -> None:
    objs = parse(render_raw({}, kube_version="v1.30.0", api_versions=tuple(VAP_KINDS)))
    assert len(by_kind(objs, "ValidatingAdmissionPolicy")) == 6  # pods, pods-advice, workloads, cronjobs, tenant(-outside)


def test_offline_render_falls_back_to_the_kube_version() -> None:
    """helm template/lint know no kinds (only group/versions): the policy then follows --kube-version."""
    assert by_kind(parse(render_raw({}, kube_version="v1.31.0", api_versions=None)), "ValidatingAdmissionPolicy")
    assert "admissionPolicy.enabled=true" in _render_error({}, kube_version="v1.29.0", api_versions=None)


def test_service_monitor_needs_prometheus_operator() -> None:
    values = CASES["metrics"]
    message = _render_error(values, api_versions=tuple(VAP_KINDS))
    assert "metrics.serviceMonitor.enabled=true" in message and "monitoring.coreos.com/v1" in message
    assert "--api-versions monitoring.coreos.com/v1" in message
    assert by_kind(parse(render_raw(values)), "PodMonitor")
    assert "(for its PodMonitor)" in message


# ------------------------------------------------------------------ capabilities as containerd applies them


def containerd_caps(add: list[str], drop: list[str], privileged: bool = False) -> set[str]:
    """containerd's CRI (internal/cri/opts WithCapabilities, container_create_linux.go), transcribed:
    privileged gets every capability and the capabilities field is not applied; else the default set,
    ALL in add (util.InStringSlice: case-insensitive) grants all, ALL in drop clears, then every named
    add as "CAP_" + upper(name), then every named drop the same way."""
    known = {"CAP_CHOWN", "CAP_IPC_LOCK", "CAP_SYS_RESOURCE", "CAP_NET_RAW", "CAP_SYS_ADMIN"}
    if privileged:
        return known
    caps = {"CAP_CHOWN", "CAP_NET_RAW"}  # part of containerd's default set; IPC_LOCK is not in it
    if any(a.upper() == "ALL" for a in add):
        caps = set(known)
    if any(d.upper() == "ALL" for d in drop):
        caps = set()
    caps |= {"CAP_" + a.upper() for a in add if a.upper() != "ALL"}
    caps -= {"CAP_" + d.upper() for d in drop if d.upper() != "ALL"}
    return caps


def caps_pod(add: Optional[list[str]], drop: Optional[list[str]], privileged: Optional[bool] = None) -> dict[str, Any]:
    pod = rdma_pod(caps=None)
    capabilities: dict[str, Any] = {}
    if add is not None:
        capabilities["add"] = add
    if drop is not None:
        capabilities["drop"] = drop
    sc: dict[str, Any] = {"capabilities": capabilities}
    if privileged is not None:
        sc["privileged"] = privileged
    pod["spec"]["containers"][0]["securityContext"] = sc
    return pod


@pytest.mark.parametrize(
    "add,drop",
    [(["ALL"], ["ALL"]), (["ALL"], ["IPC_LOCK"]), (["IPC_LOCK"], ["ipc_lock"]), (["all"], ["Ipc_Lock"]),
     (["IPC_LOCK", "ALL"], ["all", "IPC_LOCK"]), (["SYS_RESOURCE"], ["ALL"])],
)
def test_drops_that_take_ipc_lock_away_are_denied(switch_off: Policy, add: list[str], drop: list[str]) -> None:
    """The issue's cases: admitted before, yet the container ran without IPC_LOCK."""
    assert "CAP_IPC_LOCK" not in containerd_caps(add, drop)
    messages = switch_off.evaluate(caps_pod(add, drop))
    assert _ipc_lock_denied(messages), (add, drop, messages)
    assert messages and "do not drop it" in messages[0] and "'train'" in messages[0]


@pytest.mark.parametrize(
    "add,drop",
    [(["IPC_LOCK"], ["ALL"]), (["ALL", "IPC_LOCK"], ["ALL"]), (["all"], []), (["ipc_lock"], ["SYS_ADMIN"]), (["ALL"], None)],
)
def test_adds_that_survive_the_drops_are_admitted(switch_off: Policy, add: list[str], drop: Optional[list[str]]) -> None:
    assert "CAP_IPC_LOCK" in containerd_caps(add, drop or [])
    assert switch_off.evaluate(caps_pod(add, drop)) == []


def test_policy_agrees_with_containerd_on_every_combination(switch_off: Policy) -> None:
    """Every add/drop combination of a small vocabulary (spellings, ALL, another capability), plus
    privileged: admitted exactly when containerd would give the container IPC_LOCK."""
    import itertools

    vocab = ["IPC_LOCK", "ipc_lock", "ALL", "all", "SYS_RESOURCE"]
    lists = [list(c) for n in range(3) for c in itertools.combinations(vocab, n)]
    checked = 0
    for add, drop in itertools.product(lists, lists):
        for privileged in (None, True):
            granted = "CAP_IPC_LOCK" in containerd_caps(add, drop, privileged=bool(privileged))
            messages = switch_off.evaluate(caps_pod(add, drop, privileged))
            assert (messages == []) is granted, (add, drop, privileged, messages)
            checked += 1
    assert checked == 2 * len(lists) ** 2


@pytest.mark.parametrize("field", ["add", "drop"])
def test_cap_prefix_in_drop_is_refused_too(switch_off: Policy, field: str) -> None:
    """A drop of CAP_SYS_ADMIN removes nothing on containerd (CAP_CAP_SYS_ADMIN) but works on CRI-O."""
    caps = {"add": ["IPC_LOCK"], "drop": []}
    caps[field] = caps[field] + ["CAP_SYS_ADMIN"]
    messages = switch_off.evaluate(caps_pod(caps["add"], caps["drop"]))
    assert messages and any("'CAP_SYS_ADMIN'" in m and "without the CAP_ prefix" in m for m in messages)


# ------------------------------------------------------------------ rdma/hca: 0 is no request


@pytest.mark.parametrize("zero", [0, "0"])
def test_a_zero_request_is_no_request(switch_off: Policy, zero: Any) -> None:
    """Charts that render a switched-off toggle as `rdma/hca: 0`: the pod asks for no device."""
    pod = rdma_pod(host_network=False, security_context=False)
    pod["spec"]["containers"][0]["resources"] = {"limits": {"rdma/hca": zero, "nvidia.com/gpu": 8}}
    assert switch_off.evaluate(pod) is None
    pod["spec"]["containers"][0]["resources"]["requests"] = {"rdma/hca": zero}
    assert switch_off.evaluate(pod) is None
    for one_ in (1, "1", "1k"):
        pod["spec"]["containers"][0]["resources"] = {"limits": {"rdma/hca": one_}}
        assert _hostnetwork_denied(switch_off.evaluate(pod)), one_
    workload_policy = _workload_policy("Deployment")
    zero_pod = rdma_pod(host_network=False, security_context=False)
    zero_pod["spec"]["containers"][0]["resources"] = {"limits": {"rdma/hca": zero}}
    assert workload_policy.evaluate(workload("Deployment", zero_pod)) is None


# ------------------------------------------------------------------ non-root RDMA containers: Warn with the fix


@pytest.fixture(scope="module")
def advice() -> Policy:
    return Policy({}, "-rdma-pods-advice")


def _with_users(container: Optional[dict[str, Any]] = None, pod: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    p = rdma_pod()
    if container:
        p["spec"]["containers"][0]["securityContext"].update(container)
    if pod:
        p["spec"]["securityContext"] = pod
    return p


@pytest.mark.parametrize(
    "container,pod",
    [({"runAsUser": 1000}, None), (None, {"runAsUser": 1000}), ({"runAsNonRoot": True}, None),
     (None, {"runAsNonRoot": True}), ({"runAsUser": 1000}, {"runAsUser": 0})],
)
def test_non_root_rdma_containers_get_a_warning_with_the_fix(advice: Policy, switch_off: Policy,
                                                             container: Any, pod: Any) -> None:
    p = _with_users(container, pod)
    (message,) = advice.evaluate(p) or [""]
    assert "'train'" in message and "non-root" in message and "56374" in message
    assert "RLIMIT_MEMLOCK" in message and "runAsUser: 0" in message and "LimitMEMLOCK=infinity" in message
    assert switch_off.evaluate(p) == []  # advice only: the Deny policy admits it
    assert advice.binding["spec"]["validationActions"] == ["Warn"]
    assert advice.policy["spec"]["failurePolicy"] == "Ignore"


@pytest.mark.parametrize(
    "container,pod",
    [(None, None), ({"runAsUser": 0}, None), ({"runAsUser": 0}, {"runAsUser": 1000}),
     ({"runAsUser": 0}, {"runAsNonRoot": True}), ({"runAsNonRoot": False}, None)],
)
def test_root_or_unknown_user_gets_no_warning(advice: Policy, container: Any, pod: Any) -> None:
    assert advice.evaluate(_with_users(container, pod)) == []


def test_non_root_warning_reaches_workload_templates() -> None:
    for kind in ("Deployment", "Job", "CronJob", "ReplicationController"):
        policy = _workload_policy(kind)
        messages = policy.evaluate(workload(kind, _with_users({"runAsUser": 1000})))
        assert messages and any("non-root" in m for m in messages), kind
        assert policy.evaluate(workload(kind, _with_users({"runAsUser": 0}))) == []


def test_advice_keeps_audit() -> None:
    assert Policy({"admissionPolicy": {"validationActions": ["Deny", "Audit"]}}, "-rdma-pods-advice").binding["spec"][
        "validationActions"] == ["Warn", "Audit"]


@pytest.mark.parametrize("case", ["defaults", "non-hostnetwork", "extra-resources"])
def test_chart_test_pod_passes_every_policy_without_a_warning(case: str) -> None:
    pod = one(manifests(CASES[case]), "Pod", "-test-allocation")
    for suffix in ("-rdma-pods", "-rdma-pods-advice"):
        assert Policy(CASES[case], suffix).evaluate(pod, namespace=NAMESPACE) == [], suffix
    caps = pod["spec"]["containers"][0]["securityContext"]["capabilities"]
    assert "CAP_IPC_LOCK" in containerd_caps(caps.get("add", []), caps.get("drop", []))


# ------------------------------------------------------------------ RDMA training-job APIs, where served

CRD_KINDS = {
    "MPIJob": ("kubeflow.org/v2beta1", "-rdma-mpijobs"),
    "PyTorchJob": ("kubeflow.org/v1", "-rdma-pytorchjobs"),
    "JobSet": ("jobset.x-k8s.io/v1alpha2", "-rdma-jobsets"),
    "LeaderWorkerSet": ("leaderworkerset.x-k8s.io/v1", "-rdma-leaderworkersets"),
}
SERVED = (*CLUSTER_API_VERSIONS, *(f"{gv}/{kind}" for kind, (gv, _) in CRD_KINDS.items()), *(gv for gv, _ in CRD_KINDS.values()))


def crd_object(kind: str, good: dict[str, Any], bad: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """`good`/`bad` are pods; their metadata+spec become the object's pod templates, in the places
    the APIs keep them (kubeflow replica-spec maps, JobSet replicatedJobs, LWS leader/worker)."""
    def tpl(pod: dict[str, Any]) -> dict[str, Any]:
        return {"metadata": pod["metadata"], "spec": pod["spec"]}

    second = tpl(bad or good)
    if kind == "MPIJob":
        spec = {"mpiReplicaSpecs": {"Launcher": {"replicas": 1, "template": tpl(good)}, "Worker": {"replicas": 4, "template": second}}}
    elif kind == "PyTorchJob":
        spec = {"pytorchReplicaSpecs": {"Master": {"replicas": 1, "template": tpl(good)}, "Worker": {"replicas": 3, "template": second}}}
    elif kind == "JobSet":
        spec = {"replicatedJobs": [{"name": "a", "template": {"spec": {"template": tpl(good)}}},
                                   {"name": "b", "template": {"spec": {"template": second}}}]}
    else:
        spec = {"leaderWorkerTemplate": {"size": 4, "leaderTemplate": tpl(good), "workerTemplate": second}}
    gv, _ = CRD_KINDS[kind]
    return {"apiVersion": gv, "kind": kind, "metadata": {"name": "train"}, "spec": spec}


def test_training_job_policies_only_where_their_api_is_served() -> None:
    names = {o["metadata"]["name"] for o in by_kind(manifests({}), "ValidatingAdmissionPolicy")}
    assert not any(n.endswith(s) for n in names for _, s in CRD_KINDS.values())
    objs = parse(render_raw({}, api_versions=SERVED))
    for kind, (gv, suffix) in CRD_KINDS.items():
        policy = Policy({}, suffix, objs=objs)
        (rule,) = policy.policy["spec"]["matchConstraints"]["resourceRules"]
        group, version = gv.split("/")
        assert rule["apiGroups"] == [group] and rule["apiVersions"] == [version], kind
        assert rule["resources"] == [kind.lower() + "s"]
        assert policy.binding["spec"]["validationActions"] == ["Warn"]
    # an API whose group/version is served without the kind (another CRD of the group) does not count
    only_group = (*CLUSTER_API_VERSIONS, "kubeflow.org/v1", "kubeflow.org/v1/TFJob")
    names = {o["metadata"]["name"] for o in by_kind(parse(render_raw({}, api_versions=only_group)), "ValidatingAdmissionPolicy")}
    assert not any(n.endswith("-rdma-pytorchjobs") or n.endswith("-rdma-mpijobs") for n in names)


@pytest.mark.parametrize("kind", sorted(CRD_KINDS))
def test_training_job_templates_warn(kind: str) -> None:
    policy = Policy({}, CRD_KINDS[kind][1], objs=parse(render_raw({}, api_versions=SERVED)))
    good = rdma_pod()
    assert policy.evaluate(crd_object(kind, good)) == []
    # the bad template is the second one (the workers): the first is fine
    messages = policy.evaluate(crd_object(kind, good, rdma_pod(host_network=False, caps=["ALL"])))
    assert messages is not None and _hostnetwork_denied(messages) and not _ipc_lock_denied(messages)
    messages = policy.evaluate(crd_object(kind, good, caps_pod(["IPC_LOCK"], ["ipc_lock"])))
    assert _ipc_lock_denied(messages)
    messages = policy.evaluate(crd_object(kind, good, _with_users({"runAsUser": 1000})))
    assert messages and any("non-root" in m for m in messages)
    # a launcher without RDMA needs neither hostNetwork nor IPC_LOCK
    launcher = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "l"},
                "spec": {"containers": [{"name": "launcher", "image": "img"}]}}
    assert policy.evaluate(crd_object(kind, launcher, good)) == []
    assert policy.evaluate(crd_object(kind, launcher)) is None
