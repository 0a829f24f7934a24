"""Controller side of the rdma_node_info module: its arguments from the role variables, and the port
counters the previous run stored for the node.

A task without arguments (roles/rdma_nic_validate/tasks/read.yml, the one node read of the role and of
playbooks/validate.yml) gets them from the rdma_nic_validate / ipv6_compute_validate / rdma_node_facts
variables (plugin_utils/rdma_node_read.py: in Python, not a Jinja template that every host's worker would
compile again). In the fleet path
(``__rdma_nic_validate_fleet``) and with ``rdma_validation_fail: false`` a failed read is returned as not
failed (its ``msg`` kept): the report lists the node as not validated, then the enforce play fails it.

With ``counter_baseline_dir`` (playbooks/validate.yml: ``<rdma_validation_report_dir>/counters``, under
out/<inventory>/ by default), this action reads ``<dir>/<inventory host>.json`` - what the module
returned as ``counter_baseline_next`` at the previous run - into the module's ``counter_baseline``,
runs the module, and writes the new ``counter_baseline_next`` back (not in check mode, not after a
failed read), leaving it out of the task result. One small file per host, read and written in the
host's own worker: no work once per run and nothing kept in the controller's memory.
Without ``counter_baseline_dir`` it runs the module as the default action would.
"""

from __future__ import annotations

import json
import os
import tempfile
from urllib.parse import quote

from ansible.plugins.action import ActionBase
from ansible_collections.lingjun.rdma.plugins.plugin_utils.rdma_action import execute_beside
from ansible_collections.lingjun.rdma.plugins.plugin_utils.rdma_node_read import fails_on_read_error, role_args

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


class ActionModule(ActionBase):
    _supports_check_mode = True

    def run(self, tmp=None, task_vars=None):
        result = super().run(tmp, task_vars)
        del tmp
        args = dict(self._task.args) or role_args(self._templar, task_vars)
        directory = args.pop("counter_baseline_dir", None)
        path = None
        if directory:
            path = baseline_path(directory, task_vars["inventory_hostname"])
            if args.get("counter_baseline") is None:
                args["counter_baseline"] = load(path)
        result.update(execute_beside(self, MODULE, args, task_vars))
        node = result.get("node")
        following = node.pop("counter_baseline_next", None) if isinstance(node, dict) else None
        # Not echoed back into every host's registered result (controller memory at fleet scale).
        result.get("invocation", {}).get("module_args", {}).pop("counter_baseline", None)
        # --check writes nothing: ansible_check_mode is the run's, whatever the read task's own check_mode: false
        if path and following is not None and not result.get("failed") and not task_vars.get("ansible_check_mode"):
            store(path, following)
        if result.get("failed") and not self._task.args and not fails_on_read_error(self._templar, task_vars):
            result["failed"] = False  # listed as not validated by the report, failed by the enforce play
        return result
