#!/usr/bin/python
# Copyright: rdma-device-plugin maintainers; Apache-2.0
"""Ansible module: before a deploy serves nodes by the DRA driver, what must hold in the cluster."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: rdma_dra_preflight
short_description: Refuse a DRA deploy the cluster cannot take, before anything changes
description:
  - Read-only, on the controller, before C(helm) runs with C(rdma_driver=dra) (roles/plugin_deploy). Fails with one
    message naming every problem, the variable and the next command, when
  - the API server is older than Kubernetes 1.37 (the DRA driver's floor, what is tested; docs/dra.md, Supported
    versions), or
  - an unfinished pod bound to a node the release serves by DRA (labelled I(driver_label_key)C(=dra), or unlabelled
    while I(driver) is dra) asks a numaPools C(<resource>-local) resource of I(resource_names), which has no DRA
    counterpart; each such pod is named (namespace/name, node, resource).
  - One C(GET /version), one paginated list of nodes and one of unfinished pods. Supports check mode.
version_added: "0.4.0"
author: rdma-device-plugin maintainers
extends_documentation_fragment: [lingjun.rdma.rdma_k8s]
options:
  driver: {description: Chart value C(driver) (C(rdma_driver)), the API of unlabelled nodes., type: str, default: dra}
  driver_label_key: {description: Chart value C(driverLabelKey)., type: str, default: node-restriction.kubernetes.io/rdma-driver}
  legacy_driver_label_keys:
    description: Keys of the driver label before chart 3.0.0; a node without I(driver_label_key) is judged by them (the deploy copies them later).
    type: list
    elements: str
    default: []
  resource_names: {description: The release's resource names (C(rdma_resource_name))., type: list, elements: str, required: true}
"""

EXAMPLES = r"""
- name: Refuse a DRA deploy the cluster cannot take
  lingjun.rdma.rdma_dra_preflight:
    driver: "{{ rdma_driver }}"
    resource_names: ["{{ rdma_resource_name }}"]
    kubeconfig: "{{ rdma_kubeconfig }}"
"""

RETURN = r"""
version: {description: The server's C(gitVersion)., returned: always, type: str}
dra_nodes: {description: The nodes the release serves by DRA., returned: always, type: list}
local_pods: {description: "The refused pods: [namespace/name, node, resource].", returned: always, type: list}
"""

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.lingjun.rdma.plugins.module_utils.rdma_dra import (
    dra_nodes,
    local_pods,
    local_pods_problem,
    version_problem,
)
from ansible_collections.lingjun.rdma.plugins.module_utils.rdma_fleet import DRIVER_LABEL
from ansible_collections.lingjun.rdma.plugins.module_utils.rdma_k8s import CONNECTION_ARGS, Cluster, K8sError


def main():
    module = AnsibleModule(
        argument_spec=dict(
            CONNECTION_ARGS,
            driver=dict(type="str", default="dra"),
            driver_label_key=dict(type="str", default=DRIVER_LABEL),
            legacy_driver_label_keys=dict(type="list", elements="str", default=[], no_log=False),
            resource_names=dict(type="list", elements="str", required=True),
        ),
        supports_check_mode=True,
    )
    p = module.params
    try:
        cluster = Cluster(p["kubeconfig"], p["context"], p["request_timeout"])
        version = cluster.call("GET", "/version")
        nodes = dra_nodes(
            cluster.list("/api/v1/nodes"), p["driver_label_key"], p["driver"], p["legacy_driver_label_keys"]
        )
        pods = cluster.list("/api/v1/pods", field_selector="status.phase!=Succeeded,status.phase!=Failed")
    except K8sError as err:
        module.fail_json(msg=str(err))
    found = local_pods(pods, nodes, p["resource_names"])
    problems = [m for m in (version_problem(version), local_pods_problem(found, p["driver_label_key"])) if m]
    result = dict(
        changed=False, version=version.get("gitVersion") or "", dra_nodes=nodes, local_pods=[list(f) for f in found]
    )
    if problems:
        module.fail_json(msg="Nothing was installed. " + " ".join(problems), **result)
    module.exit_json(**result)


if __name__ == "__main__":
    main()
