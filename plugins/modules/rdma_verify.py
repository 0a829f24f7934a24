#!/usr/bin/python
# Copyright: rdma-device-plugin maintainers; Apache-2.0
"""Ansible module documentation of the lingjun.rdma.rdma_verify action (plugins/action/rdma_verify.py)."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: rdma_verify
short_description: Wait until every node of the inventory advertises the expected RDMA resource
description:
  - Runs on the controller (an action plugin). Polls the cluster with C(lingjun.rdma.rdma_cluster_nodes)
    (one paginated, label-selected node list and one DaemonSet list per poll) and computes a verdict per
    inventory host in Python - the expected numbers follow the node's current mode label (shared
    C(shared_devices); exclusive the node's NIC count from this run's validation facts, else the
    inventory's last validation report, else C(rdma_nic_count) / C(rdma_nic_validate_expected_nics)).
  - Polls until every node passes, or the rollout is done and the failures have not changed for
    I(settle) seconds, or a deadline that scales with the fleet passes
    (I(timeout) + I(timeout_per_wave) x the rollout waves of I(max_unavailable)); prints a progress line
    (C(812 of 2000 nodes advertise rdma/hca as expected; rollout ...)) whenever the count changes.
  - Writes every host's verdict ({ok, msg, final, mode, expected}) to a file C(<host>.json) in I(verdicts_dir);
    each node's own task then reads its file and fails with its own message. Never prints a Node object.
  - A cluster that cannot be reached (connection refused, TLS mismatch, no answer within I(request_timeout))
    fails the task at once with the message of the read, naming C(rdma_kubeconfig), the server and the fix.
version_added: "0.3.0"
author: rdma-device-plugin maintainers
options:
  hosts: {description: Inventory hosts of the nodes (the node group)., type: list, elements: str, required: true}
  kubeconfig: {description: C(rdma_kubeconfig)., type: str, default: ""}
  context: {description: C(rdma_kube_context)., type: str, default: ""}
  request_timeout: {description: Seconds one API request may take (C(rdma_kube_request_timeout)); not retried., type: float, default: 30}
  label_selector: {description: Label selector of the node list; empty lists every node., type: str, default: ""}
  page_size: {description: Items per page., type: int, default: 500}
  resource_name: {description: The extended resource., type: str, default: rdma/hca}
  mode_label_key: {description: The mode label., type: str, default: node-restriction.kubernetes.io/rdma-mode}
  validated_label_key: {description: The validated label (what validation.required selects on)., type: str, default: node-restriction.kubernetes.io/rdma-validated}
  default_mode: {description: Mode of nodes without the label., type: str, default: shared}
  shared_devices: {description: The shared shape., type: int, default: 1000}
  release: {description: Helm release (its DaemonSets are followed)., type: str, default: rdma}
  namespace: {description: Namespace of the release., type: str, default: kube-system}
  daemonsets: {description: Follow the release's DaemonSets (rollout progress and completeness)., type: bool, default: true}
  validation_required: {description: The chart keeps the plugin off nodes not labelled validated (said in messages)., type: bool, default: false}
  report_dir: {description: The inventory's validation report directory (NIC counts of nodes not validated in this run)., type: str, default: ""}
  verdicts_dir: {description: Controller directory for one verdict file per host (its old files are removed first)., type: str, required: true}
  max_unavailable: {description: The DaemonSet's maxUnavailable (number or percentage) the deadline scales with., type: raw, default: 1}
  timeout: {description: Seconds of the deadline before the rollout waves., type: float, default: 60}
  timeout_per_wave: {description: Seconds added per rollout wave., type: float, default: 30}
  poll_interval: {description: Seconds between two polls., type: float, default: 5}
  settle: {description: Seconds the failures must stay the same after the rollout finished before giving up early., type: float, default: 30}
"""

EXAMPLES = r"""
- name: Wait for every node of the inventory
  lingjun.rdma.rdma_verify:
    hosts: "{{ groups['rdma_nodes'] }}"
    kubeconfig: "{{ rdma_kubeconfig }}"
    verdicts_dir: out/prod/verify
"""

RETURN = r"""
failed_messages:
  description: The messages of the failed nodes (the first 50).
  returned: always
  type: list
  elements: str
failed_nodes:
  description: Inventory hosts whose node does not advertise what it should.
  returned: always
  type: list
  elements: str
polls:
  description: How many times the nodes were listed.
  returned: always
  type: int
rollout_problems:
  description: DaemonSets missing or not rolled out by the deadline.
  returned: always
  type: list
  elements: str
"""

from ansible.module_utils.basic import AnsibleModule


def main():
    AnsibleModule(argument_spec={}).fail_json(msg="rdma_verify runs on the controller through its action plugin")


if __name__ == "__main__":
    main()
