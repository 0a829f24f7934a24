# Copyright: rdma-device-plugin maintainers; Apache-2.0
"""The registry login every lingjun.rdma module that talks to an OCI registry takes
(module_utils/rdma_helm.REGISTRY_AUTH_ARGS)."""

from __future__ import annotations


class ModuleDocFragment:
    DOCUMENTATION = r"""
options:
  username:
    description: Registry user; empty means anonymous (no login).
    type: str
    default: ""
  password:
    description: Registry password or token (never logged).
    type: str
    default: ""
"""
