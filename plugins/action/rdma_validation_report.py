"""Controller side of the rdma_validation_report module: gather every host's results itself.

With ``fact`` (and ``read``) instead of ``results``, the hosts of this run are those of ``hosts``
whose ``read`` is registered (a host outside ``--limit`` has none and keeps its previous entry), the
node names come from each host's ``rdma_k8s_node_name``, and this action takes each host's findings
straight from the variable manager (``hostvars.raw_get``: the stored objects, not a templated
copy; ansible-core lib/ansible/vars/hostvars.py, HostVars.raw_get) and streams them into a
JSON file that the module reads (``results_file``). Passed as ``results``, they would exist
twice more in the worker forked from the controller: as the finalized copy of the template
over ``hostvars`` (ansible-core lib/ansible/_internal/_templating) and as the module's JSON
arguments; and the module would echo them back in ``invocation``. At 5000 hosts that made
the worker the largest process of the run (about 600 MB, see bench/RESULTS.md).
"""

from __future__ import annotations

import json
import os
import tempfile

from ansible.errors import AnsibleActionFail
from ansible.plugins.action import ActionBase
from ansible_collections.lingjun.rdma.plugins.plugin_utils.rdma_action import execute_beside
from ansible_collections.lingjun.rdma.plugins.plugin_utils.rdma_hosts import Hosts

MODULE = "rdma_validation_report"


def host_result(host_vars, fact, read):
    """The host's fact; or, when its read registered no facts (module failure, unreachable), why.
    A skipped read is no read: the module lists the host as not validated."""
    got = host_vars.get(read) if read else None
    if isinstance(got, dict) and "ansible_facts" not in got and not got.get("skipped"):
        reason = ("unreachable: " if got.get("unreachable") else "") + str(got.get("msg") or "unreachable")
        return {"validated": False, "errors": {"read": reason}}
    return host_vars.get(fact)


class ActionModule(ActionBase):
    _supports_check_mode = True

    def run(self, tmp=None, task_vars=None):
        result = super().run(tmp, task_vars)
        del tmp
        args = dict(self._task.args)
        fact, read = args.pop("fact", None), args.pop("read", None)
        if fact is not None:
            if "results" in args:
                raise AnsibleActionFail(f"{MODULE}: give either results or fact (with read), not both")
            hosts, names, args["results_file"] = self._results_file(
                Hosts(task_vars), list(args.get("hosts") or []), fact, read
            )
            args["hosts"] = hosts
            args["node_names"] = names
        elif read is not None:
            raise AnsibleActionFail(f"{MODULE}: read names the registered read beside fact; set fact too")
        result.update(execute_beside(self, MODULE, args, task_vars))
        return result

    def _results_file(self, values, candidates, fact, read):
        """Stream {host: result} of this run's hosts into a local file, one host at a time, and put it
        beside the module. This run's hosts are those whose ``read`` was registered (run, failed or
        unreachable); a host outside --limit has none. Returns (hosts, node names, remote path)."""
        hosts, names = [], {}
        fd, local = tempfile.mkstemp(prefix="rdma-validation-results-", suffix=".json")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                fh.write("{")
                for host in candidates:
                    raw = values.raw(host)
                    if read and read not in raw:
                        continue
                    fh.write(("," if hosts else "") + json.dumps(host) + ":")
                    json.dump(host_result(raw, fact, read), fh, default=str)
                    hosts.append(host)
                    name = values.node_name(host)
                    if name != host:
                        names[host] = name
                fh.write("}")
            if self._connection._shell.tmpdir is None:
                self._make_tmp_path()
            remote = self._connection._shell.join_path(self._connection._shell.tmpdir, "results.json")
            self._transfer_file(local, remote)
            self._fixup_perms2((self._connection._shell.tmpdir, remote))
            return hosts, names, remote
        finally:
            os.unlink(local)
