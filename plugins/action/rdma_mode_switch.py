# Copyright: rdma-device-plugin maintainers; Apache-2.0
"""Controller side of lingjun.rdma.rdma_mode_switch: the node's NIC count for the exclusive shape, found
in Python, then the module.

The count is, first found: ``nic_counts[node]`` (rdma_mode_switch_nic_counts), the validation facts of
this run of the inventory host whose node it is, the inventory's last validation report,
rdma_nic_count, rdma_nic_validate_expected_nics (plugin_utils/rdma_hosts.nic_count).
"""

from __future__ import annotations

from ansible.plugins.action import ActionBase
from ansible_collections.lingjun.rdma.plugins.plugin_utils.rdma_hosts import Hosts, nic_count, read_report, report_path


class ActionModule(ActionBase):
    _supports_check_mode = True

    def run(self, tmp=None, task_vars=None):
        result = super().run(tmp, task_vars)
        args = dict(self._task.args)
        hosts = list(args.pop("hosts", None) or [])
        counts = args.pop("nic_counts", None) or {}
        report_dir = args.pop("report_dir", "")
        node = args.get("node")
        if args.get("nics") is None:
            if node in counts:
                args["nics"], args["nics_source"] = int(counts[node]), "rdma_mode_switch_nic_counts"
            else:
                values = Hosts(task_vars)
                host = next((h for h in hosts if values.node_name(h) == node), None)
                if host is not None:
                    nics, source, conflict = nic_count(values, host, read_report(report_path(report_dir)) if report_dir else {})
                    if nics:
                        args["nics"], args["nics_source"] = nics, source
                    if conflict:
                        result.setdefault("warnings", []).append(conflict)
                for name in ("rdma_nic_count", "rdma_nic_validate_expected_nics"):
                    value = self._templar.template(task_vars.get(name)) if args.get("nics") is None else None
                    if value not in (None, ""):
                        args["nics"], args["nics_source"] = int(value), name
        ran = self._execute_module(module_name="lingjun.rdma.rdma_mode_switch", module_args=args, task_vars=task_vars)
        warnings = result.get("warnings", []) + list(ran.get("warnings") or [])
        result.update(ran)
        if warnings:
            result["warnings"] = warnings
        return result
