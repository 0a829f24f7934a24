# Copyright: rdma-device-plugin maintainers; Apache-2.0
"""Controller side of lingjun.rdma.rdma_release_check: what one Helm release for the whole node group
needs from the inventory, checked in Python over every node host.

1. The chart's values come from the controller's variables (the play that installs the release runs
   there). A node host that resolves one of those variables differently (host_vars, group_vars of a
   node group the controller is not in) would be silently ignored: refused, naming hosts and values.
2. With the non-hostNetwork switch on, the nodes that failed the IPv6 compute-network validation (this
   run's findings, else the inventory's last report) would crash-loop the plugin: with validation
   gating (validation.required) they are only named (the chart keeps the plugin off them, as they are
   labelled validated=false); without it the deploy is refused, naming them and the report.
"""

from __future__ import annotations

import json

from ansible.plugins.action import ActionBase
from ansible_collections.lingjun.rdma.plugins.plugin_utils.rdma_hosts import Hosts, differing, read_report, report_path


def ipv6_failures(entry):
    """Names of the failed IPv6 checks of a validation entry/fact; ["ipv6"] when only the summary says so."""
    bad = sorted({c.get("name") for c in entry.get("checks") or []
                  if c.get("role") == "ipv6_compute_validate" and not c.get("passed")})
    if not bad and (entry.get("summary") or {}).get("ipv6") == "failed":
        bad = ["ipv6"]
    return bad


class ActionModule(ActionBase):
    _supports_check_mode = True

    def run(self, tmp=None, task_vars=None):
        result = super().run(tmp, task_vars)
        args = self._task.args
        hosts = list(args.get("hosts") or [])
        names = list(args.get("variables") or [])
        values = Hosts(task_vars)
        differ = []
        for name in names:
            mine = self._templar.template(task_vars.get(name)) if name in task_vars else None
            for value, who in sorted(differing(values, hosts, name, mine).items()):
                shown = ", ".join(who[:5]) + (" and %d more" % (len(who) - 5) if len(who) > 5 else "")
                differ.append("%s=%s on %s (the release gets %s)" % (name, value, shown, json.dumps(mine, default=str)))
        report = report_path(args.get("report_dir") or "")
        previous = read_report(report)
        ipv6_failed, unvalidated = [], []
        if args.get("non_host_network"):
            for host in hosts:
                fact = values.get(host, "rdma_validation", None)
                entry = fact if isinstance(fact, dict) and fact.get("validated") else previous.get(host)
                if not entry or not entry.get("validated"):
                    unvalidated.append(host)
                    continue
                bad = ipv6_failures(entry)
                if bad:
                    ipv6_failed.append("%s (%s)" % (host, ", ".join(bad)))
        gating = bool(args.get("validation_required"))
        result.update(changed=False, differ=differ, ipv6_failed=ipv6_failed, unvalidated=unvalidated, report=report)
        notes = []
        if differ:
            result.update(
                failed=True,
                msg="one Helm release deploys every node of the inventory with the controller's values, but these "
                "node hosts resolve other chart variables: %s. Fix: set these variables once for all nodes "
                "(group_vars/all.yml or -e), not per host or per node group; per-node differences belong in node "
                "labels (node-restriction.kubernetes.io/rdma-mode)." % "; ".join(differ),
            )
            return result
        if ipv6_failed and not gating:
            result.update(
                failed=True,
                msg="rdma_non_host_network=true, but these nodes failed the IPv6 compute-network validation: %s. "
                "Pods without hostNetwork would get no working RDMA there. Fix the nodes (IPv6 on the compute "
                "network, RDMA netns mode shared; see %s) and validate them again, or turn validation gating on "
                "(rdma_validation_required=true: the chart then keeps the plugin off nodes that failed)."
                % ("; ".join(ipv6_failed), report),
            )
            return result
        if ipv6_failed:
            notes.append(
                "rdma_non_host_network=true: validation gating keeps the plugin off the nodes that failed the IPv6 "
                "compute-network validation (labelled %s=false): %s; see %s"
                % ("node-restriction.kubernetes.io/rdma-validated", "; ".join(ipv6_failed), report)
            )
        if unvalidated:
            shown = ", ".join(unvalidated[:10]) + (" and %d more" % (len(unvalidated) - 10) if len(unvalidated) > 10 else "")
            notes.append(
                "rdma_non_host_network=true and no IPv6 validation results for %s (%s): %s" % (
                    shown, "not in this run nor in %s" % report,
                    "validation gating keeps the plugin off them until playbooks/validate.yml passes them"
                    if gating else "the plugin still checks at start (run playbooks/validate.yml)")
            )
        result["msg"] = " ".join(notes) if notes else "the chart variables agree on every node host"
        result["notes"] = notes
        return result
