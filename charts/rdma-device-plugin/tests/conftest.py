"""Shared fixtures for the chart tests: the real Helm v4 engine (helm_python), rendered once per
values case and cached for the whole session."""

from __future__ import annotations

import copy
import json
import re
from functools import lru_cache
from pathlib import Path
from typing import Any

import helm_python
import pytest
import yaml
from helm_python import _native

CHART_DIR = Path(__file__).resolve().parent.parent
EXAMPLES_DIR = CHART_DIR / "examples"
RELEASE = "rdma"
NAMESPACE = "kube-system"

# The values matrix every render/validate/lint test runs over.
CASES: dict[str, dict[str, Any]] = {
    "defaults": {},
    "exclusive": {"mode": "exclusive"},
    "non-hostnetwork": {
        "nonHostNetwork": {"enabled": True, "checks": "warn", "env": {"NCCL_SOCKET_FAMILY": "AF_INET6"}}
    },
    "policy-off": {"admissionPolicy": {"enabled": False}},
    "policy-warn-audit": {"admissionPolicy": {"validationActions": ["Warn", "Audit"], "failurePolicy": "Ignore"}},
    "metrics": {"metrics": {"enabled": True, "port": 9500, "serviceMonitor": {"enabled": True, "labels": {"release": "prom"}}}},
    "service-monitor": {
        "metrics": {"enabled": True, "serviceMonitor": {"enabled": True, "kind": "ServiceMonitor"}},
        "resources": {"requests": {"cpu": "0.05", "memory": "64Mi"}, "limits": {"memory": 134217728}},
    },
    "cdi": {"cdi": {"enabled": True, "runtimeEnabled": True, "kind": "example.com/rdma", "hostDir": "/etc/cdi"}},
    "k3s": {"kubeletDir": "/var/lib/rancher/k3s/agent/kubelet/"},
    "microk8s": {"kubeletDir": "/var/snap/microk8s/common/var/lib/kubelet"},
    "extra-resources": {
        "resourceName": "rdma/hca_roce",
        "sharedDevices": 500,
        "selectors": {"vendors": ["15b3"], "deviceIDs": ["101d", "0x1021"], "drivers": ["mlx5_core"], "linkTypes": ["Ethernet"]},
        "extraResources": [
            {"name": "rdma/hca_ib", "sharedDevices": 100, "selectors": {"linkTypes": ["InfiniBand"]}},
            {"name": "example.com/bond0"},
        ],
        "charDevices": {"umad": True, "issm": True},
        "env": {"NCCL_IB_HCA": "mlx5"},
        "health": {"intervalSeconds": 2, "policy": "any"},
        "rediscoveryIntervalSeconds": 30,
    },
    "exclusive-switch-on-everything": {
        "mode": "exclusive",
        "nonHostNetwork": {"enabled": True},
        "metrics": {"enabled": True},
        "cdi": {"enabled": True, "runtimeEnabled": True},
        "privileged": True,
        "imagePullSecrets": [{"name": "regcred"}],
        "extraEnv": [{"name": "PYTHONUNBUFFERED", "value": "1"}],
        "nodeSelector": {"kubernetes.io/os": "linux"},
        "podAnnotations": {"example.com/a": "b"},
        "serviceAccount": {"create": False, "name": "existing"},
        "test": {"enabled": False},
        "logLevel": "debug",
        "logFormat": "json",
        "image": {"repository": "127.0.0.1:5000/rdma-device-plugin", "tag": "dev", "pullPolicy": "Always"},
    },
    "no-default-affinity": {"affinity": None, "fullnameOverride": "rdp"},
    "observability": {
        "metrics": {
            "enabled": True,
            "serviceMonitor": {"enabled": True},
            "prometheusRule": {"enabled": True, "labels": {"release": "prom"}},
            "dashboard": {"enabled": True},
        },
        "nfd": {"enabled": True},
    },
}


@pytest.fixture(scope="session")
def chart() -> helm_python.Chart:
    return helm_python.Chart.load(str(CHART_DIR))


_CHART: list[helm_python.Chart] = []


def _chart() -> helm_python.Chart:
    if not _CHART:
        _CHART.append(helm_python.Chart.load(str(CHART_DIR)))
    return _CHART[0]


# What Helm's .Capabilities holds on an install against a real 1.33 cluster with prometheus-operator:
# discovery lists every group/version AND every group/version/Kind (helm pkg/action GetVersionSet).
# Offline rendering (helm template, lint) only knows group/versions, never kinds.
CLUSTER_KUBE_VERSION = "v1.33.0"
VAP_KINDS = [
    "admissionregistration.k8s.io/v1/ValidatingAdmissionPolicy",
    "admissionregistration.k8s.io/v1/ValidatingAdmissionPolicyBinding",
    "admissionregistration.k8s.io/v1/ValidatingWebhookConfiguration",
]
MONITORING = ["monitoring.coreos.com/v1", "monitoring.coreos.com/v1/ServiceMonitor", "monitoring.coreos.com/v1/PodMonitor"]
CLUSTER_API_VERSIONS = (*VAP_KINDS, *MONITORING)


def render_raw(
    values: dict[str, Any] | None,
    kube_version: str | None = CLUSTER_KUBE_VERSION,
    api_versions: tuple[str, ...] | None = CLUSTER_API_VERSIONS,
    chart: helm_python.Chart | None = None,
    name: str = RELEASE,
    namespace: str = NAMESPACE,
) -> dict[str, str]:
    """Render as `helm template --kube-version --api-versions` does. Chart.render does not expose those
    two options, but the SDK's native helm_render takes them (its render options JSON); None leaves
    Helm's offline defaults."""
    opts: dict[str, Any] = {"name": name, "namespace": namespace}
    if kube_version is not None:
        opts["kube_version"] = kube_version
    if api_versions is not None:
        opts["api_versions"] = list(api_versions)
    chart = chart or _chart()
    out = _native.call_string("helm_render", chart._raw(), json.dumps(values or {}), json.dumps(opts))
    rendered: dict[str, str] = json.loads(out)
    return rendered


@lru_cache(maxsize=None)
def _render_cached(values_json: str) -> tuple[tuple[str, str], ...]:
    return tuple(sorted(render_raw(json.loads(values_json)).items()))


def render(values: dict[str, Any] | None = None) -> dict[str, str]:
    """Template path -> rendered text as installed on a 1.33 cluster (CLUSTER_*), cached per values."""
    return dict(_render_cached(json.dumps(values or {}, sort_keys=True)))


def parse(rendered: dict[str, str]) -> list[dict[str, Any]]:
    """Every object of a render (NOTES.txt excluded)."""
    return [doc for path, text in rendered.items() if not path.endswith("NOTES.txt") for doc in yaml.safe_load_all(text) if doc]


def manifests(values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Every rendered object (hooks included, NOTES.txt excluded), parsed; a fresh copy per call."""
    objs = []
    for path, text in render(values).items():
        if path.endswith("NOTES.txt"):
            continue
        for doc in yaml.safe_load_all(text):
            if doc:
                doc.setdefault("metadata", {}).setdefault("annotations", {})
                if not doc["metadata"]["annotations"]:
                    del doc["metadata"]["annotations"]
                objs.append(doc)
    return copy.deepcopy(objs)


def by_kind(objs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objs if o["kind"] == kind]


def one(objs: list[dict[str, Any]], kind: str, name_suffix: str = "") -> dict[str, Any]:
    found = [o for o in by_kind(objs, kind) if o["metadata"]["name"].endswith(name_suffix)]
    assert len(found) == 1, f"expected one {kind} *{name_suffix}, got {[o['metadata']['name'] for o in found]}"
    return found[0]


def daemonsets(values: dict[str, Any] | None = None) -> dict[str, dict[str, Any]]:
    """mode -> DaemonSet."""
    objs = manifests(values)
    return {mode: one(objs, "DaemonSet", f"-{mode}") for mode in ("shared", "exclusive")}


def kube_minor_versions() -> list[str]:
    """Every minor the chart's kubeVersion admits, from its lower bound to the newest bundled schema."""
    import kubernetes_validate.utils as kvu

    chart_yaml = yaml.safe_load((CHART_DIR / "Chart.yaml").read_text())
    m = re.match(r"^>=\s*1\.(\d+)", chart_yaml["kubeVersion"])
    assert m, chart_yaml["kubeVersion"]
    low = int(m.group(1))
    bundled = sorted({int(v.split(".")[1]) for v in kvu.all_versions()})
    return [f"1.{minor}.0" for minor in bundled if minor >= low]


def example_jobs() -> dict[str, dict[str, Any]]:
    return {p.stem: yaml.safe_load(p.read_text()) for p in sorted(EXAMPLES_DIR.glob("*.yaml"))}
