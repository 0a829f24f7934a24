# Copyright: rdma-device-plugin maintainers; Apache-2.0
"""Argument specs the chart modules share (documented by the doc fragments of the same names)."""

from __future__ import annotations

# rdma_registry_auth: modules that pull from or push to an OCI registry
REGISTRY_AUTH_ARGS = {
    "username": {"type": "str", "default": ""},
    "password": {"type": "str", "default": "", "no_log": True},
}

# rdma_release: modules that render the chart (rdma_chart_render, rdma_chart_values)
RELEASE_ARGS = {
    "chart_path": {"type": "path", "required": True},
    "values": {"type": "dict", "required": True},
    "release_name": {"type": "str", "default": "rdma"},
    "namespace": {"type": "str", "default": "kube-system"},
    "kube_version": {"type": "str", "default": ""},
}


def render(chart, values, release_name, namespace, kube_version=""):
    """The chart rendered offline by the Helm engine, as ``helm template --kube-version`` does: the
    SDK's Chart.render has no kube_version, its native helm_render takes it ('' keeps Helm's default)."""
    import json

    from helm_python import _native

    opts = {"name": release_name, "namespace": namespace}
    if kube_version:
        opts["kube_version"] = kube_version
    return json.loads(_native.call_string("helm_render", chart._raw(), json.dumps(values), json.dumps(opts)))
