#!/usr/bin/python
# Copyright: rdma-device-plugin maintainers; Apache-2.0
"""Ansible module: switch one node between shared and exclusive RDMA mode, safely."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: rdma_mode_switch
short_description: Switch one Kubernetes node between shared and exclusive RDMA mode
description:
  - Cordons the node first (so that no new pod lands on it in between), then finds the unfinished
    pods on it that request or limit the RDMA resource. While there are any it refuses (restoring
    the node) unless I(drain), which evicts them through the Eviction API (policy/v1), so their
    PodDisruptionBudgets are honoured; a budget that blocks an eviction is named with the fix.
  - Then sets the mode label, waits until the node advertises the new shape (shared
    I(shared_devices), exclusive I(nics)), and uncordons it. Any failure after the cordon restores
    the label and the schedulability the node had.
  - A node that already has the label and shows the shape is left alone.
  - In check mode nothing is changed; evictions are tried with C(dryRun=All) so that a blocking
    budget shows, and the result says what the switch would do.
version_added: "0.3.0"
author: rdma-device-plugin maintainers
extends_documentation_fragment: [lingjun.rdma.rdma_k8s]
options:
  node: {description: Kubernetes node name., type: str, required: true}
  to: {description: The mode to switch to., type: str, required: true, choices: [shared, exclusive]}
  drain: {description: Evict the pods holding the resource (else refuse)., type: bool, default: false}
  nics: {description: The node's NIC count (the exclusive shape)., type: int}
  nics_source: {description: Where I(nics) comes from (said in messages)., type: str, default: ""}
  resource_name: {description: The extended resource., type: str, default: rdma/hca}
  shared_devices: {description: The shared shape., type: int, default: 1000}
  mode_label_key: {description: The mode label., type: str, default: node-restriction.kubernetes.io/rdma-mode}
  timeout: {description: Seconds to wait for the new shape., type: int, default: 120}
  poll_interval: {description: Seconds between two reads of the node., type: int, default: 2}
  drain_timeout: {description: Seconds to wait for the evicted pods to be gone., type: int, default: 120}
"""

EXAMPLES = r"""
- name: Switch gpu-1 to exclusive mode, evicting its RDMA pods
  lingjun.rdma.rdma_mode_switch:
    node: gpu-1
    to: exclusive
    nics: 4
    drain: true
"""

RETURN = r"""
msg:
  description: What was done (or, in check mode, would be done).
  returned: always
  type: str
evicted:
  description: The pods evicted (namespace/name).
  returned: success
  type: list
  elements: str
"""

import time

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.lingjun.rdma.plugins.module_utils.rdma_fleet import MODE_LABEL, format_quantity, parse_quantity
from ansible_collections.lingjun.rdma.plugins.module_utils.rdma_k8s import CONNECTION_ARGS, Cluster, K8sError


class Refused(Exception):
    pass


class Holding(Refused):
    """Pods hold the resource and draining was not asked for: nothing is changed."""


def holders(pods, resource):
    out = []
    for pod in pods:
        phase = (pod.get("status") or {}).get("phase") or "Unknown"
        if phase in ("Succeeded", "Failed"):
            continue
        spec = pod.get("spec") or {}
        for c in (spec.get("containers") or []) + (spec.get("initContainers") or []):
            r = c.get("resources") or {}
            if resource in (r.get("requests") or {}) or resource in (r.get("limits") or {}):
                meta = pod["metadata"]
                out.append({"namespace": meta.get("namespace"), "name": meta["name"], "phase": phase,
                            "uid": meta.get("uid"), "labels": meta.get("labels") or {}})
                break
    return out


def _matches(sel, labels):
    if not sel or (not sel.get("matchLabels") and not sel.get("matchExpressions")):
        return False
    if any(labels.get(k) != v for k, v in (sel.get("matchLabels") or {}).items()):
        return False
    for e in sel.get("matchExpressions") or []:
        value, values, op = labels.get(e.get("key")), e.get("values") or [], e.get("operator")
        if (op == "In" and value not in values) or (op == "NotIn" and value in values and value is not None):
            return False
        if (op == "Exists" and value is None) or (op == "DoesNotExist" and value is not None):
            return False
    return True


class Switch(object):
    def __init__(self, module):
        self.m = module
        self.p = module.params
        self.node = self.p["node"]
        self.res = self.p["resource_name"]
        self.cluster = Cluster(self.p["kubeconfig"], self.p["context"], self.p["request_timeout"])
        self.path = "/api/v1/nodes/%s" % self.node

    def read(self):
        try:
            return self.cluster.call("GET", self.path)
        except K8sError as err:
            if getattr(err, "status", 0) == 404:
                raise Refused("node %s is not in the cluster (kubectl get nodes); nothing was changed." % self.node)
            raise

    def shape(self, node):
        status = node.get("status") or {}
        return (status.get("capacity") or {}).get(self.res), (status.get("allocatable") or {}).get(self.res)

    def pods(self):
        items = self.cluster.list("/api/v1/pods", field_selector="spec.nodeName=%s" % self.node)
        return holders(items, self.res)

    def blocking_budgets(self, pod):
        pdbs = self.cluster.list("/apis/policy/v1/namespaces/%s/poddisruptionbudgets" % pod["namespace"])
        return ["%s/%s" % (pod["namespace"], b["metadata"]["name"]) for b in pdbs
                if _matches((b.get("spec") or {}).get("selector"), pod["labels"])]

    def evict(self, pod, dry_run):
        try:
            self.cluster.evict(pod["namespace"], pod["name"], dry_run=dry_run)
            return None
        except K8sError as err:
            status = getattr(err, "status", 0)
            if status == 404:
                return None  # already gone
            if status not in (429, 500):
                raise
            body = getattr(err, "body", {}) or {}
            causes = "; ".join(c.get("message", "") for c in (body.get("details") or {}).get("causes") or [])
            budgets = self.blocking_budgets(pod)
            named = ", ".join("PodDisruptionBudget %s" % b for b in budgets) or "a PodDisruptionBudget"
            return (
                "the eviction of %s/%s was refused by %s: %s%s. Fix: let the budget allow a disruption (wait until "
                "more of its pods are ready, scale the workload up, or relax it: kubectl -n %s edit pdb %s), or stop "
                "the pod yourself, then switch again"
                % (pod["namespace"], pod["name"], named, body.get("message") or str(err),
                   " (%s)" % causes if causes else "", pod["namespace"],
                   budgets[0].split("/", 1)[1] if budgets else "<name>")
            )

    def wait_gone(self, pods):
        deadline = time.monotonic() + self.p["drain_timeout"]
        left = list(pods)
        while left:
            still = []
            for pod in left:
                try:
                    got = self.cluster.call("GET", "/api/v1/namespaces/%s/pods/%s" % (pod["namespace"], pod["name"]))
                    if got["metadata"].get("uid") == pod["uid"]:
                        still.append(pod)
                except K8sError as err:
                    if getattr(err, "status", 0) != 404:
                        raise
            left = still
            if left and time.monotonic() > deadline:
                raise Refused("evicted pods still present after %ds: %s" % (
                    self.p["drain_timeout"], ", ".join("%s/%s" % (p["namespace"], p["name"]) for p in left)))
            if left:
                time.sleep(min(1.0, self.p["poll_interval"]))

    def run(self):
        p = self.p
        node = self.read()
        meta = node["metadata"]
        before = (meta.get("labels") or {}).get(p["mode_label_key"])
        cordoned = bool((node.get("spec") or {}).get("unschedulable"))
        if p["to"] == "exclusive" and not p["nics"]:
            raise Refused(
                "node %s: the NIC count for the exclusive shape is unknown; nothing was changed. Fix: validate the node "
                "(playbooks/validate.yml, whose report gives the count), or set rdma_nic_validate_expected_nics, "
                "rdma_nic_count for it, or rdma_mode_switch_nic_counts['%s']." % (self.node, self.node)
            )
        expected = p["shared_devices"] if p["to"] == "shared" else p["nics"]
        q = format_quantity(expected)
        cap, alloc = self.shape(node)
        if before == p["to"] and parse_quantity(cap) == expected and parse_quantity(alloc) == expected:
            return False, "node %s is already in %s mode and advertises %s: %s; nothing to do." % (
                self.node, p["to"], self.res, q), []
        frm = before or "(unlabelled)"
        if self.m.check_mode:
            found = self.pods()
            steps = [] if cordoned else ["cordon it"]
            if found and not p["drain"]:
                raise Holding(self.refusal(found))
            blocked = [b for b in (self.evict(pod, dry_run=True) for pod in found) if b]
            if found:
                steps.append("evict %s through the Eviction API" % ", ".join("%s/%s" % (x["namespace"], x["name"]) for x in found))
            if blocked:
                raise Refused("check mode: switching node %s would stop: %s. Nothing was changed." % (self.node, "; ".join(blocked)))
            steps += ["set %s=%s" % (p["mode_label_key"], p["to"]), "wait for %s=%s" % (self.res, q)]
            steps += [] if cordoned else ["uncordon it"]
            return False, "check mode: would switch node %s from %s to %s mode: %s. Nothing was changed." % (
                self.node, frm, p["to"], ", ".join(steps)), []
        # Cordon first: no pod can be scheduled between finding the holders and relabelling.
        if not cordoned:
            self.cluster.merge_patch(self.path, {"spec": {"unschedulable": True}})
        relabelled = False
        evicted = []
        try:
            found = self.pods()
            if found and not p["drain"]:
                raise Holding(self.refusal(found))
            for pod in found:
                problem = self.evict(pod, dry_run=False)
                if problem:
                    raise Refused(problem)
                evicted.append("%s/%s" % (pod["namespace"], pod["name"]))
            self.wait_gone(found)
            self.cluster.merge_patch(self.path, {"metadata": {"labels": {p["mode_label_key"]: p["to"]}}})
            relabelled = True
            deadline = time.monotonic() + p["timeout"]
            while True:
                cap, alloc = self.shape(self.read())
                if parse_quantity(cap) == expected and parse_quantity(alloc) == expected:
                    break
                if time.monotonic() > deadline:
                    raise Refused(
                        "the node still shows capacity %s, allocatable %s; expected %s for both within %ds (is the %s "
                        "DaemonSet's pod running on it? kubectl get pods -A -o wide --field-selector spec.nodeName=%s)"
                        % (cap or "(absent)", alloc or "(absent)", q, p["timeout"], p["to"], self.node)
                    )
                time.sleep(p["poll_interval"])
            if not cordoned:
                self.cluster.merge_patch(self.path, {"spec": {"unschedulable": None}})
        except (Refused, K8sError) as err:
            self.restore(before, cordoned, relabelled)
            if isinstance(err, Holding):
                raise Holding("%s. The node was left as it was%s." % (err, "" if cordoned else " (uncordoned again)"))
            raise Refused(
                "Switching node %s to %s mode failed: %s. The node was restored: label %s=%s, %s%s." % (
                    self.node, p["to"], err, p["mode_label_key"], before or "(absent)",
                    "cordoned" if cordoned else "schedulable",
                    "; evicted before the failure: %s" % ", ".join(evicted) if evicted else "")
            )
        return True, "node %s switched from %s to %s mode; it advertises %s: %s%s" % (
            self.node, frm, p["to"], self.res, q, " (evicted %s)" % ", ".join(evicted) if evicted else ""), evicted

    def refusal(self, found):
        return (
            "Refusing to switch node %s to %s mode: these pods on it hold %s and their device allocations would "
            "break: %s. Stop them first, or set rdma_switch_drain=true to evict them through the Eviction API "
            "(their PodDisruptionBudgets are honoured)"
            % (self.node, self.p["to"], self.res,
               ", ".join("%s/%s (%s)" % (x["namespace"], x["name"], x["phase"]) for x in found))
        )

    def restore(self, label, cordoned, relabelled):
        patch = {}
        if relabelled:
            patch["metadata"] = {"labels": {self.p["mode_label_key"]: label}}  # null removes it
        patch["spec"] = {"unschedulable": True if cordoned else None}
        try:
            self.cluster.merge_patch(self.path, patch)
        except K8sError as err:
            raise Refused("restoring the node failed too (%s); check it by hand: kubectl get node %s -o yaml" % (err, self.node))


def main():
    module = AnsibleModule(
        argument_spec=dict(
            CONNECTION_ARGS,
            node={"type": "str", "required": True},
            to={"type": "str", "required": True, "choices": ["shared", "exclusive"]},
            drain={"type": "bool", "default": False},
            nics={"type": "int"},
            nics_source={"type": "str", "default": ""},
            resource_name={"type": "str", "default": "rdma/hca"},
            shared_devices={"type": "int", "default": 1000},
            mode_label_key={"type": "str", "default": MODE_LABEL},
            timeout={"type": "int", "default": 120},
            poll_interval={"type": "int", "default": 2},
            drain_timeout={"type": "int", "default": 120},
        ),
        supports_check_mode=True,
    )
    try:
        changed, msg, evicted = Switch(module).run()
    except (Refused, K8sError) as err:
        module.fail_json(msg=str(err))
    module.exit_json(changed=changed, msg=msg, evicted=evicted)


if __name__ == "__main__":
    main()
