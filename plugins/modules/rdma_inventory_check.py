#!/usr/bin/python
# Copyright: rdma-device-plugin maintainers; Apache-2.0
"""Ansible module documentation of the lingjun.rdma.rdma_inventory_check action."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: rdma_inventory_check
short_description: Check every host's typed values against the roles' argument specs, once, before any node is read
description:
  - Runs on the controller (an action plugin). For every host of I(hosts), the values the inventory and
    C(-e) give the options of the I(roles)' C(meta/argument_specs.yml) (entry point C(main)) and of
    I(options) are checked once per distinct set of values - types (C(-e rdma_nic_validate_rate_gbps=200G)
    is not a number), choices, list elements, mapping keys, absolute node roots, positive expectations.
  - Fails once, listing every problem with the variable, the value, where it comes from (C(-e) or the hosts)
    and the fix. Roles already checked in this run (the fact C(rdma_inventory_checked)) are skipped.
version_added: "0.3.0"
author: rdma-device-plugin maintainers
options:
  hosts: {description: Inventory hosts to check (the node group; empty checks the controller's own values)., type: list, elements: str, default: []}
  roles: {description: Roles whose C(main) argument spec applies., type: list, elements: str, default: []}
  options: {description: Further options (argument spec format) the playbook itself takes., type: dict, default: {}}
  agree:
    description: Variables every node host must resolve as the controller does (the controller plays use its values).
    type: list
    elements: str
    default: []
"""

EXAMPLES = r"""
- name: Check the inventory before any node is read
  lingjun.rdma.rdma_inventory_check:
    hosts: "{{ groups['rdma_nodes'] }}"
    roles: [rdma_node_facts, rdma_nic_validate]
    options:
      rdma_validation_enforce: {type: bool}
"""

RETURN = r"""
problems:
  description: Every problem found (also in C(msg)).
  returned: failure
  type: list
  elements: str
"""

from ansible.module_utils.basic import AnsibleModule


def main():
    AnsibleModule(argument_spec={}).fail_json(msg="rdma_inventory_check runs on the controller through its action plugin")


if __name__ == "__main__":
    main()
