# Copyright: rdma-device-plugin maintainers; Apache-2.0
"""Controller side of lingjun.rdma.rdma_verify: poll the cluster until every node of the inventory
group advertises what it should, or a deadline that scales with the fleet passes.

Each poll is one run of the rdma_cluster_nodes module (one paginated, label-selected node list and
one DaemonSet list); the verdict of every node is computed here in Python (module_utils/rdma_fleet),
with the expected numbers from the node's current mode label (exclusive: its NIC count from this
run's validation facts, else the inventory's last report, else rdma_nic_count /
rdma_nic_validate_expected_nics). A progress line is printed (on stderr, so that a machine-readable
stdout callback stays parseable) at every poll that changes the count.
Every host's verdict ({ok, msg, final, mode, expected}) is written to ``verdicts_dir/<host>.json``
(the inventory's out/<inventory>/verify/), so that each node host's own task in the next play
reads its own small file and fails with its own message: a fact of the controller holding every
verdict would be templated again for every host (quadratic at fleet scale).
"""

from __future__ import annotations

import json
import os
import time

from ansible.errors import AnsibleActionFail
from ansible.plugins.action import ActionBase
from ansible.utils.display import Display
from ansible_collections.lingjun.rdma.plugins.module_utils.rdma_fleet import (
    MODE_LABEL,
    VALIDATED_LABEL,
    Cluster,
    Want,
    rolled_out,
    rollout_seconds,
    rollout_text,
    verdict,
)
from ansible_collections.lingjun.rdma.plugins.plugin_utils.rdma_hosts import Hosts, nic_count, read_report, report_path

display = Display()

MODULE_ARGS = ("kubeconfig", "context", "request_timeout", "label_selector", "page_size", "resource_name", "mode_label_key", "validated_label_key")


class ActionModule(ActionBase):
    _supports_check_mode = True

    def run(self, tmp=None, task_vars=None):
        result = super().run(tmp, task_vars)
        args = dict(self._task.args)
        hosts = list(args.pop("hosts", None) or [])
        if not hosts:
            raise AnsibleActionFail("rdma_verify: hosts (the inventory hosts of the nodes) is empty")
        base = float(args.pop("timeout", 60))
        per_wave = float(args.pop("timeout_per_wave", 30))
        interval = max(0.2, float(args.pop("poll_interval", 5)))
        settle = float(args.pop("settle", 30))
        max_unavailable = args.pop("max_unavailable", 1)
        report_dir = args.pop("report_dir", "")
        verdicts_dir = args.pop("verdicts_dir", "")
        if not verdicts_dir:
            raise AnsibleActionFail("rdma_verify: verdicts_dir (where each host's verdict is written) is empty")
        cluster = Cluster(
            resource=args.get("resource_name", "rdma/hca"),
            mode_label_key=args.get("mode_label_key", MODE_LABEL),
            validated_label_key=args.get("validated_label_key", VALIDATED_LABEL),
            default_mode=args.pop("default_mode", "shared"),
            shared_devices=args.pop("shared_devices", 1000),
            release=args.pop("release", "rdma"),
            namespace=args.pop("namespace", "kube-system"),
            validation_required=bool(args.pop("validation_required", False)),
            report=report_path(report_dir) if report_dir else "",
            selector=args.get("label_selector", ""),
        )
        module_args = dict((k, args[k]) for k in MODULE_ARGS if k in args)
        module_args["daemonset_namespace"] = cluster.namespace
        module_args["daemonset_selector"] = "app.kubernetes.io/instance=%s,app.kubernetes.io/component=device-plugin" % (
            cluster.release
        )
        check_daemonsets = bool(args.pop("daemonsets", True))

        values = Hosts(task_vars)
        report_nodes = read_report(cluster.report) if cluster.report else {}
        wants, conflicts = [], []
        for host in hosts:
            nics, source, conflict = nic_count(values, host, report_nodes)
            wants.append(Want(host, values.node_name(host), nics, source))
            if conflict:
                conflicts.append(conflict)
        if conflicts:
            result["warnings"] = conflicts[:20] + (["... and %d more hosts" % (len(conflicts) - 20)] if len(conflicts) > 20 else [])

        deadline_s = rollout_seconds(len(hosts), max_unavailable, base, per_wave)
        start = time.monotonic()
        polls = requests = 0
        last_shown = None
        stable_since, last_state = None, None
        while True:
            seen = self._execute_module(
                module_name="lingjun.rdma.rdma_cluster_nodes", module_args=module_args, task_vars=task_vars
            )
            polls += 1
            if seen.get("failed"):
                result.update(failed=True, msg=failure_text(seen), polls=polls)
                return result
            requests += int(seen.get("requests", 0))
            nodes = seen.get("nodes") or {}
            daemonsets = seen.get("daemonsets") or []
            verdicts = dict((w.host, verdict(w, nodes.get(w.node), cluster)) for w in wants)
            good = sum(1 for v in verdicts.values() if v.ok)
            pending = [h for h, v in verdicts.items() if not v.ok and not v.final]
            elapsed = time.monotonic() - start
            left = max(0.0, deadline_s - elapsed)
            rollout_done = not check_daemonsets or (daemonsets and all(rolled_out(d) for d in daemonsets))
            line = "%d of %d nodes advertise %s as expected" % (good, len(wants), cluster.resource)
            waiting = bool(pending) or not rollout_done
            if (line, waiting) != last_shown:  # on stderr: stdout stays what the stdout callback makes of it
                display.display(
                    "%s; %s%s" % (line, "rollout: " + rollout_text(daemonsets) if check_daemonsets else "",
                                  "; waiting up to %ds more" % left if waiting else ""),
                    stderr=True,
                )
                last_shown = (line, waiting)
            state = (tuple(sorted(pending)), tuple(sorted((h, verdicts[h].msg) for h in pending)))
            if state != last_state:
                stable_since, last_state = time.monotonic(), state
            settled = rollout_done and time.monotonic() - stable_since >= settle
            # Every node passing is not the end while pods are Ready but not yet available (the chart's
            # minReadySeconds): the DaemonSets must be rolled out too.
            if (not pending and rollout_done) or elapsed >= deadline_s or settled:
                break
            time.sleep(min(interval, max(0.0, deadline_s - elapsed)))

        failed = sorted(h for h, v in verdicts.items() if not v.ok)
        # Reported, not failed here: the verdicts must reach the node play whatever the rollout did.
        problems = []
        if check_daemonsets and not daemonsets:
            problems.append("no DaemonSet of release %s in namespace %s (deploy first)" % (cluster.release, cluster.namespace))
        elif check_daemonsets and not rollout_done:
            problems.append("the rollout did not finish within %ds: %s" % (deadline_s, rollout_text(daemonsets)))
        write_verdicts(verdicts_dir, verdicts)
        result.update(
            changed=False,
            verdicts_dir=verdicts_dir,
            failed_messages=[verdicts[h].msg for h in failed[:50]],
            passed=len(hosts) - len(failed),
            failed_nodes=failed,
            polls=polls,
            requests=requests,
            deadline=deadline_s,
            rollout=rollout_text(daemonsets),
            rollout_done=bool(rollout_done),
            rollout_problems=problems,
            msg="%d of %d nodes advertise %s as expected after %d poll(s) (%.0fs, deadline %ds)%s%s"
            % (len(hosts) - len(failed), len(hosts), cluster.resource, polls, time.monotonic() - start, deadline_s,
               "; failed: %s" % ", ".join(failed[:20]) + (" and %d more" % (len(failed) - 20) if len(failed) > 20 else "")
               if failed else "", "; " + "; ".join(problems) if problems else ""),
        )
        return result


def failure_text(seen):
    """The failed read's own message (module_utils/rdma_k8s names the fix); for a module that crashed,
    its last line of output too, never a bare "failed"."""
    msg = str(seen.get("msg") or "").strip()
    tail = [line for line in str(seen.get("exception") or seen.get("module_stderr") or "").splitlines() if line.strip()]
    if tail and tail[-1].strip() not in msg:
        msg = "%s%s" % (msg + ": " if msg else "", tail[-1].strip())
    return "reading the nodes (lingjun.rdma.rdma_cluster_nodes) failed: %s" % (msg or "no message")


def write_verdicts(directory, verdicts):
    """One small JSON file per host (the previous run's are removed first: no stale verdict)."""
    os.makedirs(directory, exist_ok=True)
    for name in os.listdir(directory):
        if name.endswith(".json"):
            os.unlink(os.path.join(directory, name))
    for host, v in verdicts.items():
        tmp = os.path.join(directory, ".%s.json.tmp" % host)
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(v.to_dict(), fh)
        os.replace(tmp, os.path.join(directory, "%s.json" % host))
