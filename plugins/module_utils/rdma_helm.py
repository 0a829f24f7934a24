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
}
