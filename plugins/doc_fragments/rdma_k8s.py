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
  request_timeout:
    description:
      - Seconds one API request may take, connecting and answering together (C(rdma_kube_request_timeout)).
        Requests are not retried, so a server that accepts and never answers fails within it.
      - Connection refused, a TLS mismatch and a timeout fail at once with the server address and the fix.
    type: float
    default: 30
requirements:
  - the kubernetes Python package on the host the module runs on (the controller)
"""
