"""Bad values: values.schema.json (types, enums, ranges, unknown keys, resource names) and the one
collected `fail` of templates/_validate.tpl (combinations), asserted on their messages."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import helm_python
import jsonschema
import pytest
from conftest import CHART_DIR, NAMESPACE, RELEASE, render
from rdma_device_plugin.config import resource_name_problem

SCHEMA = json.loads((CHART_DIR / "values.schema.json").read_text())


def render_error(values: dict, chart: helm_python.Chart | None = None) -> str:
    with pytest.raises(helm_python.HelmError) as info:
        if chart is None:
            render(values)
        else:
            chart.render(values, name=RELEASE, namespace=NAMESPACE)
    return str(info.value)


def assert_problems(message: str, *needles: str) -> None:
    """The one collected fail of _validate.tpl: exactly len(needles) problems, one line each (each line
    says how to fix it), and every needle among them."""
    assert f"rdma-device-plugin: {len(needles)} problem(s) in the values" in message
    assert message.count("\n  - ") == len(needles)
    for needle in needles:
        assert needle in message


@pytest.mark.parametrize(
    "values,needle",
    [
        ({"mode": "both"}, "at '/mode': value must be one of 'shared', 'exclusive'"),
        ({"sharedDevices": 0}, "at '/sharedDevices': minimum"),
        ({"sharedDevices": 100001}, "at '/sharedDevices': maximum"),
        ({"sharedDevices": "1000"}, "at '/sharedDevices': got string, want integer"),
        ({"resourceName": "hca"}, "at '/resourceName'"),
        ({"resourceName": "kubernetes.io/hca"}, "at '/resourceName'"),
        ({"extraResources": [{"name": "rdma/ib", "shared": 1}]}, "additional properties 'shared' not allowed"),
        ({"bogus": True}, "additional properties 'bogus' not allowed"),
        ({"numaPools": "yes"}, "at '/numaPools': got string, want boolean"),
        ({"workloadEnv": {"addrFamily": "inet6"}}, "at '/workloadEnv/addrFamily': value must be one of"),
        ({"workloadEnv": {"addrRange": "10.0.0.1"}}, "at '/workloadEnv/addrRange'"),
        ({"workloadEnv": {"roceVersion": 3}}, "at '/workloadEnv/roceVersion': value must be one of"),
        ({"workloadEnv": {"gidIndex": 3}}, "additional properties 'gidIndex' not allowed"),
        ({"metrics": {"enabled": "yes"}}, "at '/metrics/enabled': got string, want boolean"),
        ({"metrics": {"port": 70000}}, "at '/metrics/port': maximum"),
        ({"metrics": {"auth": {"enabled": "off"}}}, "at '/metrics/auth/enabled': got string, want boolean"),
        ({"metrics": {"auth": {"tlsSecretName": "Metrics_TLS"}}}, "at '/metrics/auth/tlsSecretName'"),
        ({"metrics": {"auth": {"readers": [{"kind": "Robot", "name": "x"}]}}}, "at '/metrics/auth/readers/0/kind'"),
        ({"metrics": {"auth": {"readers": [{"kind": "ServiceAccount", "name": "prom"}]}}}, "at '/metrics/auth/readers/0': missing property 'namespace'"),
        ({"metrics": {"auth": {"readers": [{"kind": "Group"}]}}}, "at '/metrics/auth/readers/0': missing property 'name'"),
        ({"admissionPolicy": {"validationActions": ["Reject"]}}, "at '/admissionPolicy/validationActions/0'"),
        ({"admissionPolicy": {"validationActions": []}}, "at '/admissionPolicy/validationActions'"),
        ({"selectors": {"deviceIDs": [1021]}}, "at '/selectors/deviceIDs/0': got number, want string"),
        ({"selectors": {"linkTypes": ["RoCE"]}}, "at '/selectors/linkTypes/0'"),
        ({"nonHostNetwork": {"checks": "strict"}}, "at '/nonHostNetwork/checks'"),
        ({"env": {"1BAD": "x"}}, "invalid propertyName '1BAD'"),
        ({"kubeletDir": "var/lib/kubelet"}, "at '/kubeletDir'"),
        ({"health": {"intervalSeconds": 0}}, "at '/health/intervalSeconds'"),
    ],
)
def test_schema_rejects(values: dict, needle: str) -> None:
    message = render_error(values)
    assert "don't meet the specifications of the schema" in message
    assert needle in message


RESOURCE_NAMES = [
    "rdma/hca", "rdma/hca_ib", "example.com/Hca-1.x", "a/b", "kubernetes.io/hca", "rdma.kubernetes.io/hca",
    "requests.rdma/hca", "Rdma/hca", "rdma", "rdma/hca/x", "rdma/-hca", "rdma/hca-", "-rdma/hca",
    "rdma/" + "h" * 63, "rdma/" + "h" * 64, "r" * 253 + "/hca", "r" * 254 + "/hca", "rdma..x/hca",
]


@pytest.mark.parametrize("name", RESOURCE_NAMES)
def test_schema_resource_name_agrees_with_the_plugin(name: str) -> None:
    validator = jsonschema.Draft202012Validator(SCHEMA["properties"]["resourceName"])
    assert validator.is_valid(name) == (resource_name_problem(name) is None), resource_name_problem(name)


def test_schema_has_a_description_per_key() -> None:
    missing = []

    def walk(node: dict, path: str) -> None:
        for key, sub in node.get("properties", {}).items():
            if "description" not in sub:
                missing.append(f"{path}.{key}")
            walk(sub, f"{path}.{key}")
        if isinstance(node.get("items"), dict):
            walk(node["items"], path + "[]")

    walk(SCHEMA, "")
    assert missing == []
    assert SCHEMA["additionalProperties"] is False


def test_defaults_pass_the_schema(chart: helm_python.Chart) -> None:
    chart.validate_schema({})
    jsonschema.Draft202012Validator(SCHEMA).validate(chart.values)


def test_combinations_collected_into_one_fail() -> None:
    message = render_error(
        {
            "metrics": {"serviceMonitor": {"enabled": True}},
            "admissionPolicy": {"validationActions": ["Deny", "Warn"]},
            "extraResources": [{"name": "rdma/ib"}, {"name": "rdma/hca"}, {"name": "rdma/ib"}],
            "privileged": True,
            "securityContext": {"allowPrivilegeEscalation": False, "runAsNonRoot": True},
        }
    )
    assert_problems(
        message,
        "metrics.serviceMonitor.enabled=true needs metrics.enabled=true",
        "Deny and Warn together are rejected by Kubernetes",
        'extraResources[1]: resource name "rdma/hca" is already used by resourceName/sharedDevices',
        'extraResources[2]: resource name "rdma/ib" is already used by extraResources[0]',
        "privileged=true with securityContext.allowPrivilegeEscalation=false is rejected",
        "securityContext.runAsNonRoot=true cannot work",
    )


def test_steering_labels_a_kubelet_could_set_are_refused() -> None:
    """The node labels that pick where and how the plugin runs must be keys NodeRestriction keeps from
    the kubelets (tests/test_node_labels.py shows a kubelet refused them on the real API server)."""
    message = render_error(
        {
            "modeLabelKey": "rdma.lingjun.io/mode",
            "driverLabelKey": "example.com/driver",
            "validation": {"labelKey": "node-restriction.kubernetes.io.evil.com/validated"},
        }
    )
    assert_problems(
        message,
        "modeLabelKey=rdma.lingjun.io/mode: a kubelet can set this label on its own Node; use a key under "
        "node-restriction.kubernetes.io/ (the default node-restriction.kubernetes.io/rdma-mode)",
        "driverLabelKey=example.com/driver: a kubelet can set",
        "validation.labelKey=node-restriction.kubernetes.io.evil.com/validated: a kubelet can set",
    )


@pytest.mark.parametrize("auth", [{"readers": [{"kind": "Group", "name": "sre"}]}, {"tlsSecretName": "cm-metrics"}])
def test_metrics_auth_settings_need_auth_on(auth: dict) -> None:
    """Readers or a certificate with auth off would read as protected metrics that are not."""
    message = render_error({"metrics": {"enabled": True, "auth": {"enabled": False, **auth}}})
    assert_problems(message, "metrics.auth.enabled=false serves the metrics in plain HTTP to anyone; set metrics.auth.enabled=true")


def test_single_combination() -> None:
    message = render_error({"metrics": {"serviceMonitor": {"enabled": True}}})
    assert_problems(message, "set metrics.enabled=true or metrics.serviceMonitor.enabled=false")


def test_deny_and_warn_fine_when_policy_off() -> None:
    render({"admissionPolicy": {"enabled": False, "validationActions": ["Deny", "Warn"]}})


@pytest.fixture(scope="module")
def schemaless_chart(tmp_path_factory: pytest.TempPathFactory) -> helm_python.Chart:
    """The chart without values.schema.json, as with --skip-schema-validation: _validate.tpl alone."""
    dest = Path(tmp_path_factory.mktemp("chart")) / "rdma-device-plugin"
    shutil.copytree(CHART_DIR, dest, ignore=shutil.ignore_patterns("tests", "__pycache__"))
    (dest / "values.schema.json").unlink()
    return helm_python.Chart.load(str(dest))


def test_ranges_checked_without_the_schema(schemaless_chart: helm_python.Chart) -> None:
    message = render_error(
        {
            "mode": "both",
            "sharedDevices": 0,
            "extraResources": [{"name": "rdma/ib", "sharedDevices": 100001}, {"name": "example.kubernetes.io/x"}],
            "metrics": {"port": 70000},
            "kubeletDir": "var/lib/kubelet",
            "admissionPolicy": {"validationActions": ["Deny", "Deny"]},
        },
        schemaless_chart,
    )
    assert_problems(
        message,
        "mode=both: use shared or exclusive",
        "resourceName/sharedDevices: sharedDevices=0 is out of range; use a whole number from 1 to 100000",
        "extraResources[0]: sharedDevices=100001 is out of range",
        'extraResources[1]: resource name "example.kubernetes.io/x" uses the reserved kubernetes.io domain',
        "metrics.port=70000",
        'kubeletDir="var/lib/kubelet" must be an absolute path',
        "lists an action twice",
    )


def test_schemaless_chart_still_renders_good_values(schemaless_chart: helm_python.Chart) -> None:
    out = schemaless_chart.render({}, name=RELEASE, namespace=NAMESPACE)
    assert any(path.endswith("daemonset.yaml") for path in out)


# ------------------------------------------------------------------ rolling update of a fleet


def test_max_unavailable_defaults_to_a_fleet_percentage() -> None:
    from conftest import daemonsets

    for ds in daemonsets({}).values():
        assert ds["spec"]["updateStrategy"] == {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": "10%"}}
    for good in (1, 25, "5%", "100%", "0%"):
        values = {"updateStrategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": good, "maxSurge": 1}}}
        for ds in daemonsets(values).values():
            assert ds["spec"]["updateStrategy"]["rollingUpdate"]["maxUnavailable"] == good


@pytest.mark.parametrize(
    "bad,needle",
    [("10", "/updateStrategy/rollingUpdate/maxUnavailable"), ("101%", "/updateStrategy/rollingUpdate/maxUnavailable"),
     (-1, "/updateStrategy/rollingUpdate/maxUnavailable"), ("ten%", "/updateStrategy/rollingUpdate/maxUnavailable"),
     (1.5, "/updateStrategy/rollingUpdate/maxUnavailable")],
)
def test_max_unavailable_schema(bad: object, needle: str) -> None:
    message = render_error({"updateStrategy": {"rollingUpdate": {"maxUnavailable": bad}}})
    assert needle in message
    assert "additional properties 'maxUnavailabel' not allowed" in render_error(
        {"updateStrategy": {"rollingUpdate": {"maxUnavailabel": 1}}})


def test_max_unavailable_and_surge_both_zero(schemaless_chart: helm_python.Chart) -> None:
    values = {"updateStrategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0}}}
    for chart in (None, schemaless_chart):
        assert_problems(render_error(values, chart), "maxUnavailable is 0 and maxSurge is 0")


# ------------------------------------------------------------------ CDI needs the runtime's CDI


@pytest.mark.parametrize(
    "network",
    [{"hostNetwork": True}, {"nonHostNetwork": {"enabled": True}}],
    ids=["hostNetwork", "nonHostNetwork"],
)
@pytest.mark.parametrize("surge", [1, "10%"])
def test_surge_with_host_network_metrics_is_refused(network: dict, surge: object) -> None:
    """Issue 31: the surge pod binds <node IP>:<metrics.port> beside the running plugin, exits 2 (Address
    already in use) and the rollout never completes: refused, saying what to change."""
    values = {**network, "metrics": {"enabled": True},
              "updateStrategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": surge}}}
    assert_problems(
        render_error(values),
        f"updateStrategy.rollingUpdate.maxSurge={surge} with hostNetwork",
    )
    message = render_error(values)
    assert "set maxSurge: 0 and roll with maxUnavailable" in message and "<node IP>:9410" in message


def test_surge_without_the_port_clash_renders() -> None:
    """In the pod network every pod has its own IP; with hostNetwork but no metrics nothing binds a port
    (the plugin's sockets hand over between instances)."""
    surge = {"updateStrategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}}}
    for values in ({**surge, "metrics": {"enabled": True}}, {**surge, "hostNetwork": True}):
        render(values)
    render({"hostNetwork": True, "metrics": {"enabled": True}})  # maxSurge 0 (the default)


def test_cdi_needs_the_runtime_confirmed() -> None:
    message = render_error({"cdi": {"enabled": True}})
    assert_problems(message, "cdi.enabled=true makes the plugin answer Allocate with CDI device names only")
    for needle in ("enable_cdi = true", "DevicePluginCDIDevices", "cdi.runtimeEnabled=true", "cdi.enabled=false"):
        assert needle in message
    render({"cdi": {"enabled": True, "runtimeEnabled": True}})
    render({"cdi": {"runtimeEnabled": True}})  # a confirmation alone changes nothing


def test_cdi_needs_kubernetes_1_28() -> None:
    from conftest import MONITORING, VAP_KINDS, render_raw

    values = {"cdi": {"enabled": True, "runtimeEnabled": True}, "admissionPolicy": {"enabled": False}}
    with pytest.raises(helm_python.HelmError, match=r"cdi.enabled=true needs Kubernetes >= 1.28 .*v1.27.0"):
        render_raw(values, kube_version="v1.27.0", api_versions=tuple(MONITORING))
    render_raw(values, kube_version="v1.28.0", api_versions=(*MONITORING, *VAP_KINDS))
