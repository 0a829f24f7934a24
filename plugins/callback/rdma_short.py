"""stdout callback of this repository: the default output without the noise of a run that went well.

- the implicit "Validating arguments against arg spec" tasks print nothing unless they fail;
- include tasks and "included: <file> for <hosts>" lines are not printed (the included tasks print);
- skipped tasks are hidden by ``display_skipped_hosts = false`` in ansible.cfg (a default option);
- the messages of tasks tagged ``result`` are printed once, under RESULT, just before the PLAY
  RECAP (their task shows only its ok line), so the outcome of ``make demo`` is the first thing
  under the task log; with -v they also print in place;
- a run that ends before its recap (Ctrl-C) says which processes of the local target are still
  running and the command that stops them (the inventory check reports the local targets' state
  files, ``rdma_local_state``: plugins/action/rdma_inventory_check.py).
Failures, changes and warnings print exactly as the default callback prints them.
"""

from __future__ import annotations

DOCUMENTATION = """
    name: rdma_short
    type: stdout
    short_description: default output without arg-spec and include noise, results last
    description:
        - The default callback; successful argument-spec validations and include lines are not printed,
          and the msg of tasks tagged C(result) is printed once, under RESULT before the PLAY RECAP.
        - A run that stops before its recap (Ctrl-C) names the local target's processes still running
          and the command that stops them.
    extends_documentation_fragment:
      - default_callback
      - result_format_callback
    requirements:
      - set as stdout_callback in ansible.cfg
"""

import atexit
import json
import os

from ansible import context
from ansible.playbook.task_include import TaskInclude
from ansible.plugins.callback.default import CallbackModule as DefaultCallback

ARG_SPEC_ACTIONS = {"validate_argument_spec", "ansible.builtin.validate_argument_spec"}
LOCAL_INVENTORY = "inventories/local"
NAMES = {"simulator": "kubelet simulator"}


def _tagged(result):
    return "result" in (result.task.tags or []) and "msg" in result.result


def still_running(state_files):
    """(name, pid, log) of every recorded local process that is alive, from rdma_local_plugin's state files."""
    alive = []
    for path in sorted(state_files):
        try:
            with open(path, encoding="utf-8") as fh:
                state = json.load(fh)
        except (OSError, ValueError):
            continue
        for name in ("simulator", "plugin"):
            pid = (state.get(name) or {}).get("pid")
            try:
                os.kill(int(pid), 0)
            except (TypeError, ValueError, OSError):
                continue
            alive.append((name, int(pid), (state.get(name) or {}).get("log", "")))
    return alive


class CallbackModule(DefaultCallback):
    CALLBACK_VERSION = 2.0
    CALLBACK_TYPE = "stdout"
    CALLBACK_NAME = "rdma_short"

    def __init__(self):
        super().__init__()
        self._results = []
        self._local_states = set()
        self._finished = False
        atexit.register(self._stopped_early)

    def v2_runner_on_ok(self, result):
        state = result.result.get("rdma_local_state")
        if state:
            self._local_states.update([state] if isinstance(state, str) else state)
        if isinstance(result.task, TaskInclude) or (
            result.task.action in ARG_SPEC_ACTIONS and not result.result.get("changed")
        ):
            return  # an include's own tasks print their banners; a passed arg-spec check says nothing
        if _tagged(result):
            self._results.append((result._host.get_name(), result.result["msg"]))
        super().v2_runner_on_ok(result)

    def _run_is_verbose(self, result, verbosity=0):
        if _tagged(result) and self._display.verbosity <= verbosity:
            return False  # printed once, under RESULT
        return super()._run_is_verbose(result, verbosity)

    def v2_playbook_on_include(self, included_file):
        pass

    def _stopped_early(self):
        """At exit without a recap (Ctrl-C, or a fatal error): the local processes that still run."""
        if self._finished:
            return
        alive = still_running(self._local_states)
        if not alive:
            return
        inventories = [str(i) for i in (context.CLIARGS.get("inventory") or [])]
        inventory = inventories[0] if inventories else LOCAL_INVENTORY
        stop = "make stop" if os.path.normpath(inventory) == LOCAL_INVENTORY else ""
        self._display.display(
            "The run stopped before its end; the local target still runs %s. Stop them with: %s"
            % (", ".join("the %s (pid %d, log %s)" % (NAMES.get(n, n), p, log) for n, p, log in alive),
               stop or "ansible-playbook playbooks/uninstall.yml -i %s" % inventory),
            stderr=True,
        )

    def v2_playbook_on_stats(self, stats):
        self._finished = True
        if self._results:
            self._display.banner("RESULT")
            for host, msg in self._results:
                lines = msg if isinstance(msg, list) else [msg]
                for line in lines:
                    self._display.display(f"{host}: {line}")
        super().v2_playbook_on_stats(stats)
