#!/usr/bin/python
# Copyright: rdma-device-plugin maintainers; Apache-2.0
"""Ansible module: one paginated read of the nodes (and the release's DaemonSets), compact."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: rdma_cluster_nodes
short_description: Read what every node advertises, in one paginated list
description:
  - One paginated (C(limit)/C(continue)), label-selected list of the Node objects, and one of the
    release's DaemonSets; returns per node only what a verdict needs (mode label, capacity and
    allocatable of the resource, the validation label, cordon), never the Node objects.
  - The read of each poll of C(lingjun.rdma.rdma_verify); runs where the Kubernetes client is
    (the controller). Read-only, supports check mode.
version_added: "0.3.0"
author: rdma-device-plugin maintainers
extends_documentation_fragment: [lingjun.rdma.rdma_k8s]
options:
  label_selector:
    description: Label selector of the node list (e.g. C(node-role.kubernetes.io/gpu)); empty lists every node.
    type: str
    default: ""
  page_size:
    description: Items per page of the list.
    type: int
    default: 500
  resource_name:
    description: The extended resource.
    type: str
    default: rdma/hca
  mode_label_key:
    description: The node label that picks the mode.
    type: str
    default: node-restriction.kubernetes.io/rdma-mode
  validated_label_key:
    description: The node label validate sets (what validation.required selects on).
    type: str
    default: node-restriction.kubernetes.io/rdma-validated
  daemonset_namespace:
    description: Namespace of the release's DaemonSets; empty reads none.
    type: str
    default: ""
  daemonset_selector:
    description: Label selector of the release's DaemonSets.
    type: str
    default: ""
"""

EXAMPLES = r"""
- name: Read the nodes
  lingjun.rdma.rdma_cluster_nodes:
    kubeconfig: "{{ rdma_kubeconfig }}"
  register: seen
"""

RETURN = r"""
nodes:
  description: Node name -> {mode, capacity, allocatable, validated, unschedulable} (strings as the API shows them, null when absent).
  returned: success
  type: dict
daemonsets:
  description: The release's DaemonSets, each {name, generation, observed, desired, updated, ready, available}.
  returned: success
  type: list
  elements: dict
requests:
  description: API requests made (pages of the lists).
  returned: success
  type: int
"""

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.lingjun.rdma.plugins.module_utils.rdma_fleet import MODE_LABEL, VALIDATED_LABEL, daemonset_view, node_view
from ansible_collections.lingjun.rdma.plugins.module_utils.rdma_k8s import CONNECTION_ARGS, Cluster, K8sError


def main():
    module = AnsibleModule(
        argument_spec=dict(
            CONNECTION_ARGS,
            label_selector={"type": "str", "default": ""},
            page_size={"type": "int", "default": 500},
            resource_name={"type": "str", "default": "rdma/hca"},
            mode_label_key={"type": "str", "default": MODE_LABEL},
            validated_label_key={"type": "str", "default": VALIDATED_LABEL},
            daemonset_namespace={"type": "str", "default": ""},
            daemonset_selector={"type": "str", "default": ""},
        ),
        supports_check_mode=True,
    )
    p = module.params
    try:
        cluster = Cluster(p["kubeconfig"], p["context"], p["request_timeout"])
        nodes = cluster.list("/api/v1/nodes", label_selector=p["label_selector"], page_size=p["page_size"])
        daemonsets = []
        if p["daemonset_namespace"]:
            path = "/apis/apps/v1/namespaces/%s/daemonsets" % p["daemonset_namespace"]
            daemonsets = cluster.list(path, label_selector=p["daemonset_selector"], page_size=p["page_size"])
    except K8sError as err:
        module.fail_json(msg=str(err))
    module.exit_json(
        changed=False,
        nodes=dict(
            (n["metadata"]["name"], node_view(n, p["resource_name"], p["mode_label_key"], p["validated_label_key"])) for n in nodes
        ),
        daemonsets=sorted((daemonset_view(d) for d in daemonsets), key=lambda d: d["name"]),
        requests=cluster.requests,
    )


if __name__ == "__main__":
    main()
