"""Test callback (tests/test_fleet_structure.py): what a playbook run costs each host, counted, not timed.

Enabled only by that test (``ANSIBLE_CALLBACK_PLUGINS``, ``ANSIBLE_CALLBACKS_ENABLED``). It wraps, in
Ansible's main process, the three places where per-host work happens (ansible-core 2.19,
plugins/strategy/__init__.py and vars/manager.py):

- ``StrategyBase._queue_task``: a worker process forked for (host, task);
- ``StrategyBase._execute_meta``: a meta task run for a host in the main process;
- ``VariableManager.get_vars`` with a host: one merge of that host's variables. Workers are forked from
  the main process after the wrap, so the merges an action plugin makes there (``hostvars.raw_get``)
  count too: every process appends ``<kind> <host> <task>`` lines to ``$RDMA_STRUCTURE_OUT``.

and records the JSON size of every task result per host (``result <host> <bytes>``).
"""

from __future__ import annotations

import json
import os

from ansible.plugins.callback import CallbackBase
from ansible.plugins.strategy import StrategyBase
from ansible.vars.manager import VariableManager


def _write(kind, host, detail=""):
    path = os.environ.get("RDMA_STRUCTURE_OUT")
    if path:
        with open(path, "a", encoding="utf-8") as fh:  # one short write: atomic between processes (O_APPEND)
            fh.write(f"{kind}\t{host}\t{detail}\n")


def _wrap():
    if getattr(StrategyBase, "_rdma_structure", False):
        return
    queue, meta, get_vars = StrategyBase._queue_task, StrategyBase._execute_meta, VariableManager.get_vars

    def queue_task(self, host, task, task_vars, play_context):
        _write("worker", host.get_name(), task.get_name())
        return queue(self, host, task, task_vars, play_context)

    def execute_meta(self, task, play_context, iterator, target_host):
        _write("meta", target_host.get_name(), task.get_name())
        return meta(self, task, play_context, iterator, target_host)

    def variables(self, *args, **kwargs):
        host = kwargs.get("host", args[1] if len(args) > 1 else None)
        if host is not None:
            task = kwargs.get("task")
            _write("merge", host.get_name(), task.get_name() if task is not None else "")
        return get_vars(self, *args, **kwargs)

    StrategyBase._queue_task = queue_task
    StrategyBase._execute_meta = execute_meta
    VariableManager.get_vars = variables
    StrategyBase._rdma_structure = True


class CallbackModule(CallbackBase):
    CALLBACK_VERSION = 2.0
    CALLBACK_TYPE = "aggregate"
    CALLBACK_NAME = "rdma_structure"
    CALLBACK_NEEDS_ENABLED = True

    def __init__(self):
        super().__init__()
        _wrap()

    def _result(self, result, *args, **kwargs):
        _write("result", result._host.get_name(), str(len(json.dumps(result._result, default=str))))

    v2_runner_on_ok = v2_runner_on_failed = v2_runner_on_skipped = v2_runner_on_unreachable = _result
