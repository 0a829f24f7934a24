"""Controller side of the rdma_node_info module: its arguments from the role variables, the port
counters the previous run stored for the node, and validate.yml's whole per-node step.

A task without arguments (roles/rdma_nic_validate/tasks/read.yml, the role's own read) gets them from the
rdma_nic_validate / ipv6_compute_validate / rdma_node_facts variables (plugin_utils/rdma_node_read.py: in
Python, not a Jinja template that every host's worker would compile again). With
``rdma_validation_fail: false`` a failed read is returned as not failed (its ``msg`` kept).

``fleet: true`` (playbooks/validate.yml's node play, the one task a node host runs there) does the rest
of the node's part in this same worker, so that Ansible's main process handles one small result per node:

- the variables: the validation roles' defaults and vars under the host's own (the play imports no role);
- the control host, when it is not an RDMA node itself, is skipped (it is in the play so that the run
  goes on to the report when every node fails or is unreachable);
- the node's findings (its rdma_validation fact, or why it could not be read) go to the run's spool
  (plugin_utils/rdma_spool.py) for the report and the labels; the task result is the verdict only
  (a small ``rdma_validation`` fact: validated, passed, the failed checks' names, the NIC count);
- with ``rdma_validation_enforce`` (default) a node with findings fails here, listing every failed check;
  one that could not be read fails with the reason; an unreachable one stays unreachable (exit code 4).

With ``counter_baseline_dir`` (``<rdma_validation_report_dir>/counters``, under out/<inventory>/ by
default), this action reads ``<dir>/<inventory host>.json`` - what the module returned as
``counter_baseline_next`` at the previous run - into the module's ``counter_baseline``, runs the module,
and writes the new ``counter_baseline_next`` back (not in check mode, not after a failed read), leaving
it out of the task result. One small file per host, read and written in the host's own worker.
"""

from __future__ import annotations

import json
import os
import tempfile
from urllib.parse import quote

from ansible.errors import AnsibleConnectionFailure
from ansible.plugins.action import ActionBase
from ansible_collections.lingjun.rdma.plugins.filter.rdma_typed import rdma_bool
from ansible_collections.lingjun.rdma.plugins.plugin_utils import rdma_spool
from ansible_collections.lingjun.rdma.plugins.plugin_utils.rdma_action import execute_beside
from ansible_collections.lingjun.rdma.plugins.plugin_utils.rdma_hosts import INVENTORY_HOSTNAME
from ansible_collections.lingjun.rdma.plugins.plugin_utils.rdma_node_read import (
    RoleVariables,
    fails_on_read_error,
    read_args,
    role_args,
)

MODULE = "rdma_node_info"


def baseline_path(directory, host):
    """``<directory>/<host>.json``, the host name quoted so that it stays one file name."""
    return os.path.join(directory, quote(host, safe="") + ".json")


def load(path):
    """The stored values, or None when there are none (first run) or the file is not what this action wrote."""
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and isinstance(data.get("nics"), dict) else None


def store(path, data):
    """Replace the file atomically (a concurrent reader sees the old or the new values)."""
    directory = os.path.dirname(path)
    os.makedirs(directory, exist_ok=True)
    fd, partial = tempfile.mkstemp(prefix=".counters-", dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(data, fh, sort_keys=True)
        os.replace(partial, path)
    except BaseException:
        os.unlink(partial)
        raise


def verdict(host, findings):
    """The node's verdict from its findings: the small rdma_validation fact of the task result, and the
    failure message when it did not pass ("" when it did)."""
    if not findings.get("validated"):
        errors = findings.get("errors") or {}
        return {"node": host, "validated": False, "passed": False, "failed": []}, "not validated: " + (
            "; ".join(str(v) for v in errors.values()) or "no validation results"
        )
    failed = [c for c in findings.get("checks") or [] if not c.get("passed")]
    small = {
        "node": host,
        "validated": True,
        "passed": not failed,
        "failed": [c["name"] + (" " + c["nic"] if c.get("nic") else "") for c in failed],
        "summary": {"nic_count": (findings.get("summary") or {}).get("nic_count")},
    }
    if not failed:
        return small, ""
    return small, "%d RDMA validation check(s) failed: %s" % (len(failed), "; ".join(c["message"] for c in failed))


class ActionModule(ActionBase):
    _supports_check_mode = True

    def run(self, tmp=None, task_vars=None):
        result = super().run(tmp, task_vars)
        del tmp
        args = dict(self._task.args)
        if args.pop("fleet", False):
            return self._fleet(result, task_vars)
        args = args or role_args(self._templar, task_vars)
        result.update(self._read(args, task_vars))
        if result.get("failed") and not self._task.args and not fails_on_read_error(self._templar, task_vars):
            result["failed"] = False  # the role records the node as not validated
        return result

    def _read(self, args, task_vars):
        """The module's run, with the previous run's counters in and the next ones stored."""
        directory = args.pop("counter_baseline_dir", None)
        path = None
        if directory:
            path = baseline_path(directory, task_vars["inventory_hostname"])
            if args.get("counter_baseline") is None:
                args["counter_baseline"] = load(path)
        got = execute_beside(self, MODULE, args, task_vars)
        node = got.get("node")
        following = node.pop("counter_baseline_next", None) if isinstance(node, dict) else None
        # Not echoed back into every host's registered result (controller memory at fleet scale).
        got.get("invocation", {}).get("module_args", {}).pop("counter_baseline", None)
        # --check writes nothing: ansible_check_mode is the run's, whatever the read task's own check_mode: false
        if path and following is not None and not got.get("failed") and not task_vars.get("ansible_check_mode"):
            store(path, following)
        return got

    def _fleet(self, result, task_vars):
        values = RoleVariables(self._loader, self._templar, task_vars)
        host = task_vars["inventory_hostname"]
        control = values.value("rdma_control_host") if values.defined("rdma_control_host") else "localhost"
        if host == control and not self._is_node(host, values.value("rdma_nodes_pattern")):
            result.update(changed=False, skipped=True, skip_reason="the control host is not an RDMA node")
            return result
        raw = values.raw("rdma_k8s_node_name")  # the default, the host's own name, costs no template
        name = host if str(raw).replace(" ", "") == INVENTORY_HOSTNAME else str(values.value("rdma_k8s_node_name") or host)
        try:
            got = self._read(read_args(values.value, values.defined, fleet=True), task_vars)
        except AnsibleConnectionFailure as exc:  # listed as not validated; Ansible counts it unreachable
            rdma_spool.write(host, name, {"validated": False, "errors": {"read": "unreachable: %s" % exc}})
            raise
        facts = got.get("ansible_facts") or {}
        findings = facts.get("rdma_validation")
        if got.get("failed") or not isinstance(findings, dict):
            findings = {"validated": False, "errors": {"read": str(got.get("msg") or "the read returned no findings")}}
        rdma_spool.write(host, name, findings)
        small, failure = verdict(host, findings)
        result.update(changed=False, ansible_facts={"rdma_validation": small})
        enforce = rdma_bool(values.value("rdma_validation_enforce"), "rdma_validation_enforce")
        if failure and enforce:
            result.update(failed=True, msg=failure)
        else:
            result["msg"] = failure or "every RDMA validation check passed"
        return result

    def _is_node(self, host, pattern):
        """Whether the control host is one of the RDMA nodes (whatever --limit says)."""
        inventory = self._task.get_variable_manager()._inventory
        return host in [h.name for h in inventory.get_hosts(pattern, ignore_limits=True, ignore_restrictions=True)]
