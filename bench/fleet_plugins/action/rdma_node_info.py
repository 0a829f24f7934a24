"""Bench stand-in for the rdma_node_info module (bench/fleet.py --fake-facts): controller memory at 5000 hosts.

The real action plugin (plugins/action/rdma_node_info.py, loaded from its file) with one change: per
distinct set of module arguments (one per fixture node) the real module runs once, on the first host
that asks; its result is kept in a file and every later host with the same arguments gets that result
with its own ``record_host`` (the only per-host argument) put back. So each host's findings are exactly
what rdma_node_info returned for its fixture node, without a module process per host; the arguments
taken from the role variables, the spool, the verdict and every other task of the play stay real.
Enabled only by bench/fleet.py's shadow of the lingjun.rdma collection (``fake_collection``: the
repository's collection with this file as plugins/action/rdma_node_info.py, first on
ANSIBLE_COLLECTIONS_PATH and the collections/ beside the playbooks it runs): an action plugin named
like a module replaces the module's action
(ansible-core lib/ansible/executor/task_executor.py, TaskExecutor._get_action_handler_with_module_context).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from pathlib import Path
from typing import Any

PLACEHOLDER = "@@rdma-fleet-record-host@@"
REAL = Path(os.path.realpath(__file__)).parents[3] / "plugins" / "action" / "rdma_node_info.py"
_spec = importlib.util.spec_from_file_location("rdma_node_info_real_action", REAL)
assert _spec is not None and _spec.loader is not None
_real = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_real)


class ActionModule(_real.ActionModule):  # type: ignore[misc,name-defined]  # ansible-core ships no type hints
    def _read(self, args: dict[str, Any], task_vars: Any) -> dict[str, Any]:
        host = args.pop("record_host", None)
        args.pop("counter_baseline_dir", None)  # the real action plugin's file per host: not kept here
        key = hashlib.sha256(json.dumps(args, sort_keys=True, default=str).encode()).hexdigest()
        cache = Path(os.environ["RDMA_FLEET_FAKE_CACHE"]) / f"{key}.json"
        try:
            text = cache.read_text()
        except FileNotFoundError:
            module_args = {**args, "record_host": PLACEHOLDER} if host is not None else args
            got = self._execute_module(
                module_name="lingjun.rdma.rdma_node_info", module_args=module_args, task_vars=task_vars
            )
            self._remove_tmp_path(self._connection._shell.tmpdir)
            got.get("node", {}).pop("counter_baseline_next", None)  # as the real action plugin does
            text = json.dumps(got, default=str)
            partial = cache.with_suffix(f".{os.getpid()}")
            partial.write_text(text)
            partial.replace(cache)  # forks that read it at the same time see all of it or nothing
        # The placeholder stands for the host name in the recorded fact and the invocation.
        result: dict[str, Any] = json.loads(text.replace(json.dumps(PLACEHOLDER), json.dumps(host)))
        return result
