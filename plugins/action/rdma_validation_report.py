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

With ``spool: true`` (playbooks/validate.yml) the results are those the node reads of this run wrote to
the spool (plugin_utils/rdma_spool.py, with each host's node name): this run's hosts are the spooled
ones, and no host's variables are read at all. An empty spool (the roles run on their own, which
record facts) falls back to ``fact`` and ``read``. The result also names ``drift_failed``: the hosts
of this run that passed their own checks but fail a fleet drift check (``drift: fail``), each with its
failure message, for the play that fails them.
"""

from __future__ import annotations

import json
import os
import tempfile

from ansible.errors import AnsibleActionFail
from ansible.plugins.action import ActionBase
from ansible_collections.lingjun.rdma.plugins.plugin_utils import rdma_spool
from ansible_collections.lingjun.rdma.plugins.plugin_utils.rdma_action import execute_beside
from ansible_collections.lingjun.rdma.plugins.plugin_utils.rdma_hosts import Hosts

MODULE = "rdma_validation_report"


def drift_failed(found):
    """Host -> failure message, for the hosts of this run that passed their own checks and fail a drift
    check (their own failures failed them in the node play already)."""
    out = {}
    for host, rows in sorted(found.items()):
        failing = [r for r in rows if not r.get("passed")]
        if not failing:
            continue
        own = rdma_spool.read(host).get("result") or {}  # drift is returned for this run's hosts only
        if own.get("validated") and not [c for c in own.get("checks") or [] if not c.get("passed")]:
            out[host] = "%d RDMA validation check(s) failed: %s" % (
                len(failing), "; ".join(r["message"] for r in failing)
            )
    return out


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
        if args.pop("spool", False) and rdma_spool.hosts():
            args["hosts"], args["node_names"], args["results_file"] = self._spooled(rdma_spool.hosts())
            result.update(execute_beside(self, MODULE, args, task_vars))
            result["drift_failed"] = drift_failed(result.get("drift") or {})
            return result
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
        result.setdefault("drift_failed", {})  # the roles' facts: their own plays fail their nodes
        return result

    def _spooled(self, hosts):
        """Stream this run's spooled results into a file beside the module: (hosts, node names, remote path)."""
        names = {}

        def entries():
            for host in hosts:
                entry = rdma_spool.read(host)
                if entry.get("node_name") not in (None, host):
                    names[host] = entry["node_name"]
                yield host, entry.get("result")

        return hosts, names, self._put(entries())

    def _put(self, entries):
        """Write {host: result} of ``entries`` (one host at a time) to a local file, put it beside the module
        and return its remote path."""
        fd, local = tempfile.mkstemp(prefix="rdma-validation-results-", suffix=".json")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                fh.write("{")
                for i, (host, found) in enumerate(entries):
                    fh.write(("," if i else "") + json.dumps(host) + ":")
                    json.dump(found, fh, default=str)
                fh.write("}")
            if self._connection._shell.tmpdir is None:
                self._make_tmp_path()
            remote = self._connection._shell.join_path(self._connection._shell.tmpdir, "results.json")
            self._transfer_file(local, remote)
            self._fixup_perms2((self._connection._shell.tmpdir, remote))
            return remote
        finally:
            os.unlink(local)

    def _results_file(self, values, candidates, fact, read):
        """Stream {host: result} of this run's hosts into a local file, one host at a time, and put it
        beside the module. This run's hosts are those whose ``read`` was registered (run, failed or
        unreachable); a host outside --limit has none. Returns (hosts, node names, remote path)."""
        hosts, names = [], {}

        def entries():
            for host in candidates:
                raw = values.raw(host)
                if read and read not in raw:
                    continue
                hosts.append(host)
                name = values.node_name(host)
                if name != host:
                    names[host] = name
                yield host, host_result(raw, fact, read)

        remote = self._put(entries())
        return hosts, names, remote
