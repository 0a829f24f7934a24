#!/usr/bin/python
# Copyright: rdma-device-plugin maintainers; Apache-2.0
"""Ansible module: set or remove labels and annotations of named nodes through the Kubernetes API."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: rdma_node_labels
short_description: Set or remove labels and annotations of many nodes (one list, a merge patch per change)
description:
  - Reads the nodes once (one paginated list) and sends a JSON merge patch to each named node whose
    labels or annotations differ from the wanted ones; null removes a key. Nodes that are not in the
    cluster are reported, not created.
  - In check mode each patch is sent with C(dryRun=All) (the API validates it, nothing is stored)
    and the result says what would change.
  - C(playbooks/validate.yml) uses it (through its action) to write the validated label
    (C(rdma_validated_label_key)) and C(rdma.lingjun.io/validated-at); C(playbooks/uninstall.yml) to remove
    them and the mode label; the cluster deploy to move the labels of their keys before chart 3.0.0
    (O(copy_labels) before the upgrade, O(drop_labels) after it).
version_added: "0.3.0"
author: rdma-device-plugin maintainers
extends_documentation_fragment: [lingjun.rdma.rdma_k8s]
options:
  nodes:
    description: Node name -> C({labels, annotations}), each a mapping of key to value (null removes the key).
    type: dict
    default: {}
  copy_labels:
    description: >-
      Old key -> new key: every node of the cluster that has the old label and not the new one gets the new
      one with the old one's value (a node that has the new key keeps its value).
    type: dict
    default: {}
  drop_labels:
    description: Label keys removed from every node of the cluster that has them.
    type: list
    elements: str
    default: []
  page_size:
    description: Items per page of the node list.
    type: int
    default: 500
  workers:
    description: Patches sent at the same time (the client's bound on concurrent requests).
    type: int
    default: 8
  stamps:
    description: >-
      Annotation keys that only stamp a change (C(rdma.lingjun.io/validated-at)): written when another
      wanted label or annotation of the node changes, or when the node lacks them; a node whose only
      difference is a stamp is not patched.
    type: list
    elements: str
    default: []
"""

EXAMPLES = r"""
- name: Mark two nodes validated
  lingjun.rdma.rdma_node_labels:
    nodes:
      gpu-1:
        labels: {node-restriction.kubernetes.io/rdma-validated: "true"}
        annotations: {rdma.lingjun.io/validated-at: "2025-06-01T10:00:00Z"}
      gpu-2: {labels: {node-restriction.kubernetes.io/rdma-validated: "false"}}

- name: Move every node's mode label to its new key
  lingjun.rdma.rdma_node_labels:
    copy_labels: {rdma.lingjun.io/mode: node-restriction.kubernetes.io/rdma-mode}
"""

RETURN = r"""
changed_nodes:
  description: Nodes patched (in check mode, that would be patched).
  returned: success
  type: list
  elements: str
missing:
  description: Named nodes that are not in the cluster.
  returned: success
  type: list
  elements: str
unchanged:
  description: How many named nodes already had the wanted labels and annotations.
  returned: success
  type: int
"""

from concurrent.futures import ThreadPoolExecutor

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.lingjun.rdma.plugins.module_utils.rdma_k8s import CONNECTION_ARGS, Cluster, K8sError


def _changes(node, want, stamps=()):
    """The merge patch that gives ``node`` the wanted labels and annotations, or None. An annotation in
    ``stamps`` differing is no change by itself: it goes with another change, or where it is missing."""
    meta = node.get("metadata") or {}
    patch = {}
    for field in ("labels", "annotations"):
        have = meta.get(field) or {}
        diff = dict((k, v) for k, v in (want.get(field) or {}).items() if have.get(k) != v and (v is not None or k in have))
        if diff:
            patch[field] = diff
    stamped = dict((k, v) for k, v in (patch.get("annotations") or {}).items() if k in stamps)
    have = meta.get("annotations") or {}
    if stamped and len(patch.get("labels") or {}) + len(patch["annotations"]) == len(stamped):
        if all(k in have for k in stamped):
            return None
    return {"metadata": patch} if patch else None


def _moved(node, copy, drop):
    """The labels ``node`` gets from copy_labels (old -> new where only the old is there) and drop_labels."""
    have = (node.get("metadata") or {}).get("labels") or {}
    labels = dict((new, have[old]) for old, new in copy.items() if old in have and new not in have)
    labels.update((key, None) for key in drop)
    return {"labels": labels}


def main():
    module = AnsibleModule(
        argument_spec=dict(
            CONNECTION_ARGS,
            nodes={"type": "dict", "default": {}},
            copy_labels={"type": "dict", "default": {}},
            drop_labels={"type": "list", "elements": "str", "default": []},
            page_size={"type": "int", "default": 500},
            workers={"type": "int", "default": 8},
            stamps={"type": "list", "elements": "str", "default": []},
        ),
        supports_check_mode=True,
    )
    p = module.params
    wanted = dict(p["nodes"])
    try:
        cluster = Cluster(p["kubeconfig"], p["context"], p["request_timeout"])
        existing = dict((n["metadata"]["name"], n) for n in cluster.list("/api/v1/nodes", page_size=p["page_size"]))
        if p["copy_labels"] or p["drop_labels"]:
            wanted = dict((name, _moved(node, p["copy_labels"], p["drop_labels"])) for name, node in existing.items())
        patches = {}
        for name in sorted(wanted):
            if name in existing:
                patch = _changes(existing[name], wanted[name] or {}, p["stamps"])
                if patch:
                    patches[name] = patch

        def send(name):
            cluster.merge_patch("/api/v1/nodes/%s" % name, patches[name], dry_run=module.check_mode)
            return name

        with ThreadPoolExecutor(max_workers=max(1, p["workers"])) as pool:
            done = list(pool.map(send, sorted(patches)))
    except K8sError as err:
        module.fail_json(msg=str(err))
    missing = sorted(n for n in wanted if n not in existing)
    module.exit_json(
        changed=bool(done) and not module.check_mode,
        changed_nodes=done,
        missing=missing,
        unchanged=len(wanted) - len(done) - len(missing),
        invocation={"module_args": {"nodes": len(wanted)}},
    )


if __name__ == "__main__":
    main()
