#!/usr/bin/python
# Copyright: rdma-device-plugin maintainers; Apache-2.0
"""Ansible module documentation of the lingjun.rdma.rdma_dra_verify action (plugins/action/rdma_dra_verify.py)."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: rdma_dra_verify
short_description: Wait until every node of the inventory publishes its NICs through the DRA driver
description:
  - Runs on the controller (an action plugin). Polls the driver's ResourceSlices (one paginated list per poll)
    until every inventory host's node publishes a complete pool (every slice of its newest generation) with
    devices none of which is tainted, or I(timeout) passes.
  - With I(test_claim), on every node that passed, creates a pod asking I(resource_name) 1 (the DeviceClass with
    C(extendedResourceName) makes it a claim; the scheduler allocates it and the kubelet prepares it through the
    driver) and waits until it runs, then deletes it; the verdict names the devices it got.
  - Writes every host's verdict ({ok, msg, final}) to I(verdicts_dir)C(/<host>.json), as C(lingjun.rdma.rdma_verify)
    does, for the node play.
version_added: "0.4.0"
author: rdma-device-plugin maintainers
options:
  hosts: {description: Inventory hosts of the nodes., type: list, elements: str, required: true}
  kubeconfig: {description: C(rdma_kubeconfig)., type: str, default: ""}
  context: {description: C(rdma_kube_context)., type: str, default: ""}
  driver: {description: The DRA driver name (chart value C(dra.driverName))., type: str, default: rdma.lingjun.io}
  release: {description: Helm release (named in messages)., type: str, default: rdma}
  resource_name: {description: The extended resource the test pod asks., type: str, default: rdma/hca}
  test_claim: {description: Run the test pod on every node that passed., type: bool, default: false}
  test_image: {description: Image of the test pod (it runs C(sleep 300))., type: str, default: ""}
  test_namespace: {description: Namespace of the test pods., type: str, default: default}
  verdicts_dir: {description: Controller directory for one verdict file per host., type: str, required: true}
  max_unavailable: {description: The DaemonSets' maxUnavailable (number or percentage) the deadline scales with., type: raw, default: 1}
  timeout: {description: Seconds of the slices' deadline before the rollout waves., type: float, default: 60}
  timeout_per_wave: {description: Seconds added to it per rollout wave., type: float, default: 30}
  test_timeout: {description: Seconds to wait for the test pods., type: float, default: 600}
  poll_interval: {description: Seconds between two polls., type: float, default: 5}
"""

EXAMPLES = r"""
- name: Every node publishes its NICs through DRA, and a test claim allocates and prepares
  lingjun.rdma.rdma_dra_verify:
    hosts: "{{ groups['rdma_nodes'] }}"
    kubeconfig: "{{ rdma_kubeconfig }}"
    test_claim: true
    test_image: registry.example.com/rdma/rdma-device-plugin:0.1.0
    verdicts_dir: out/prod/verify
"""

RETURN = r"""
failed_nodes: {description: Inventory hosts whose node failed., returned: always, type: list}
failed_messages: {description: Their messages (the first 50)., returned: always, type: list}
passed: {description: Hosts that passed., returned: always, type: int}
"""
