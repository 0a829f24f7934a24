#!/usr/bin/python
# Copyright: rdma-device-plugin maintainers; Apache-2.0
"""Ansible module: can the controller reach the cluster of rdma_kubeconfig, and which Kubernetes is it."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: rdma_cluster_info
short_description: Check that the Kubernetes API of rdma_kubeconfig answers, and read its version
description:
  - One C(GET /version) through the same client, kubeconfig handling and errors as every cluster module of
    the collection. The deploy and the uninstall run it before C(helm) so that an unreachable cluster, a
    kubeconfig of another cluster (TLS) or a server that never answers fails at once, naming
    C(rdma_kubeconfig), the server and the fix, before anything is installed or removed.
  - Also the quickest check of a kubeconfig before a first deploy (docs/before-a-real-cluster.md).
    Read-only, supports check mode.
version_added: "0.3.0"
author: rdma-device-plugin maintainers
extends_documentation_fragment: [lingjun.rdma.rdma_k8s]
options: {}
"""

EXAMPLES = r"""
- name: Check the cluster before the deploy
  lingjun.rdma.rdma_cluster_info:
    kubeconfig: "{{ rdma_kubeconfig }}"
    context: "{{ rdma_kube_context }}"
    request_timeout: "{{ rdma_kube_request_timeout }}"
  register: cluster
"""

RETURN = r"""
server:
  description: The API server's address from the kubeconfig.
  returned: success
  type: str
  sample: https://10.0.0.1:6443
version:
  description: The server's C(gitVersion).
  returned: success
  type: str
  sample: v1.33.2
minor:
  description: The server's minor version as a number (C(33) for v1.33; a trailing C(+) is dropped).
  returned: success
  type: int
"""

import re

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.lingjun.rdma.plugins.module_utils.rdma_k8s import CONNECTION_ARGS, Cluster, K8sError


def main():
    module = AnsibleModule(argument_spec=dict(CONNECTION_ARGS), supports_check_mode=True)
    p = module.params
    try:
        cluster = Cluster(p["kubeconfig"], p["context"], p["request_timeout"])
        version = cluster.call("GET", "/version")
    except K8sError as err:
        module.fail_json(msg=str(err))
    minor = re.match(r"\d+", str(version.get("minor") or ""))
    module.exit_json(
        changed=False,
        server=cluster.server,
        version=version.get("gitVersion") or "",
        minor=int(minor.group(0)) if minor else 0,
    )


if __name__ == "__main__":
    main()
