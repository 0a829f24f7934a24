#!/usr/bin/python
# Copyright: rdma-device-plugin maintainers; Apache-2.0
"""Ansible module documentation of the lingjun.rdma.rdma_release_check action."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: rdma_release_check
short_description: Check what one Helm release for the whole node group needs from the inventory
description:
  - Runs on the controller (an action plugin), in the play that installs the release.
  - Refuses node hosts that resolve one of I(variables) (the chart-value variables) differently from the
    controller (host_vars, group_vars of a node group), naming the hosts and the values.
  - With I(non_host_network), names the nodes that failed the IPv6 compute-network validation (this run's
    C(rdma_validation) facts, else the report in I(report_dir)) - refused unless I(validation_required)
    (the chart keeps the plugin off nodes labelled C(node-restriction.kubernetes.io/rdma-validated=false)) - and those without
    validation results.
version_added: "0.3.0"
author: rdma-device-plugin maintainers
options:
  hosts: {description: Inventory hosts of the nodes., type: list, elements: str, required: true}
  variables: {description: Variables the chart values are rendered from., type: list, elements: str, default: []}
  non_host_network: {description: The non-hostNetwork switch (C(rdma_non_host_network))., type: bool, default: false}
  validation_required: {description: Validation gating is on (C(rdma_validation_required))., type: bool, default: false}
  report_dir: {description: The inventory's validation report directory., type: str, default: ""}
"""

EXAMPLES = r"""
- name: Check the release's inputs
  lingjun.rdma.rdma_release_check:
    hosts: "{{ groups['rdma_nodes'] }}"
    variables: [rdma_mode, rdma_shared_devices]
"""

RETURN = r"""
differ:
  description: Variables that some node hosts resolve differently from the controller.
  returned: always
  type: list
  elements: str
ipv6_failed:
  description: Nodes that failed the IPv6 compute-network validation, with the failed checks.
  returned: always
  type: list
  elements: str
unvalidated:
  description: Nodes without IPv6 validation results (non-hostNetwork only).
  returned: always
  type: list
  elements: str
"""

from ansible.module_utils.basic import AnsibleModule


def main():
    AnsibleModule(argument_spec={}).fail_json(msg="rdma_release_check runs on the controller through its action plugin")


if __name__ == "__main__":
    main()
