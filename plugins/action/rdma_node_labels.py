# Copyright: rdma-device-plugin maintainers; Apache-2.0
"""Controller side of lingjun.rdma.rdma_node_labels: the wanted labels of every inventory node, gathered
in Python, then one run of the module (one node list, a merge patch per node that changes).

With ``validated_fact`` (playbooks/validate.yml) each host whose findings are in that fact gets
``<validated_label>=true`` (every check passed) or ``false`` (``validated_label``: the role's
rdma_validated_label_key), and the annotation
``rdma.lingjun.io/validated-at`` (RFC 3339, UTC, this run); a host without findings (unreachable,
not read) is left as it is. With ``remove_labels``/``remove_annotations`` (playbooks/uninstall.yml)
every host's node loses those keys. Without ``hosts`` nothing is done; without ``nodes`` given it
is the module's own interface.

With ``spool: true`` (playbooks/validate.yml) the hosts are those this run's node reads spooled
(plugin_utils/rdma_spool.py: node name and findings, no host's variables read) and ``failed`` lists the
hosts that did not pass (the report's, fleet drift included); an empty spool (the roles run on their
own) falls back to ``hosts`` and ``validated_fact``. ``rdma.lingjun.io/validated-at`` is then a
stamp: written with a change of the label, or where it is missing, so that a run that changes no verdict
sends no patch (the time alone is not a change).
"""

from __future__ import annotations

import datetime

from ansible.plugins.action import ActionBase
from ansible_collections.lingjun.rdma.plugins.module_utils.rdma_fleet import VALIDATED_AT_ANNOTATION, VALIDATED_LABEL
from ansible_collections.lingjun.rdma.plugins.plugin_utils import rdma_spool
from ansible_collections.lingjun.rdma.plugins.plugin_utils.rdma_hosts import Hosts

OWN_ARGS = ("hosts", "validated_fact", "validated_label", "remove_labels", "remove_annotations", "spool", "failed")


def passed(fact):
    """True/False for a host with findings, None for one that was not validated."""
    if not isinstance(fact, dict) or not fact.get("validated") or "checks" not in fact:
        return None
    return all(c.get("passed") for c in fact.get("checks") or [])


class ActionModule(ActionBase):
    _supports_check_mode = True

    def run(self, tmp=None, task_vars=None):
        result = super().run(tmp, task_vars)
        args = dict(self._task.args)
        own = dict((k, args.pop(k, None)) for k in OWN_ARGS)
        failed = set(own["failed"] or [])
        label = own["validated_label"] or VALIDATED_LABEL
        if own["spool"] and rdma_spool.hosts():
            return self._spooled(result, args, failed, label, task_vars)
        if own["hosts"] is not None:
            values = Hosts(task_vars)
            now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
            nodes, skipped, verdicts = {}, [], {}
            for host in own["hosts"]:
                name = values.node_name(host)
                want = {"labels": {}, "annotations": {}}
                if own["validated_fact"]:
                    ok = passed(values.get(host, own["validated_fact"], None))
                    ok = ok and host not in failed if ok is not None else None
                    if ok is None:
                        skipped.append(host)
                        continue
                    want["labels"][label] = "true" if ok else "false"
                    want["annotations"][VALIDATED_AT_ANNOTATION] = now
                    verdicts[name] = ok
                for key in own["remove_labels"] or []:
                    want["labels"][key] = None
                for key in own["remove_annotations"] or []:
                    want["annotations"][key] = None
                nodes[name] = want
            args["nodes"] = nodes
            result["not_labelled"] = skipped
            result["validated_true"] = sorted(n for n, ok in verdicts.items() if ok)
            result["validated_false"] = sorted(n for n, ok in verdicts.items() if not ok)
            if not nodes:  # nothing was validated (every node unreachable): no reason to need the cluster
                result.update(changed=False, changed_nodes=[], missing=[], unchanged=0)
                return result
        result.update(
            self._execute_module(module_name="lingjun.rdma.rdma_node_labels", module_args=args, task_vars=task_vars)
        )
        return result

    def _spooled(self, result, args, failed, label, task_vars):
        now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        nodes, skipped, verdicts = {}, [], {}
        for host in rdma_spool.hosts():
            entry = rdma_spool.read(host)
            if not (entry.get("result") or {}).get("validated"):
                skipped.append(host)
                continue
            name = entry.get("node_name") or host
            verdicts[name] = host not in failed
            nodes[name] = {
                "labels": {label: "true" if verdicts[name] else "false"},
                "annotations": {VALIDATED_AT_ANNOTATION: now},
            }
        result["not_labelled"] = skipped
        result["validated_true"] = sorted(n for n, ok in verdicts.items() if ok)
        result["validated_false"] = sorted(n for n, ok in verdicts.items() if not ok)
        if not nodes:  # nothing was validated (every node unreachable): no reason to need the cluster
            result.update(changed=False, changed_nodes=[], missing=[], unchanged=0)
            return result
        args.update(nodes=nodes, stamps=[VALIDATED_AT_ANNOTATION])
        result.update(
            self._execute_module(module_name="lingjun.rdma.rdma_node_labels", module_args=args, task_vars=task_vars)
        )
        return result
