# Copyright: rdma-device-plugin maintainers; Apache-2.0
"""The cluster options every lingjun.rdma module that talks to the Kubernetes API takes
(module_utils/rdma_k8s.CONNECTION_ARGS)."""

from __future__ import annotations


class ModuleDocFragment:
    DOCUMENTATION = r"""
options:
  kubeconfig:
    description: Kubeconfig of the cluster (C(rdma_kubeconfig)); empty means the client's default ($KUBECONFIG, ~/.kube/config, in-cluster).
    type: str
    default: ""
  context:
    description: Kubeconfig context (C(rdma_kube_context)); empty means the current one.
    type: str
    default: ""
requirements:
  - the kubernetes Python package on the host the module runs on (the controller)
"""
