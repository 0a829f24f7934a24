"""Bench callback (bench/fleet.py): the controller's CPU per task, for the once-per-run figure, and the
main process's CPU apart from its workers'.

At each task start, and at the end, it lets multiprocessing reap the finished workers (their CPU, and
that of every process they waited for, then counts in this process's RUSAGE_CHILDREN) and adds this
process's own CPU plus its reaped children's since the previous mark to the task that was running. So
each task gets the CPU of the main process while it ran plus that of its workers. Rows are kept per
task, not per task start: a meta task starts once per host (ansible-core's _execute_meta sends a task
start for each), so its row counts every host it ran for (its starts, where no result names them). A
task that ran on one host (the controller's plays: the inventory check, the report, the labels) is
once-per-run work; the rest is per-host work. Writes one JSON line per task to ``$RDMA_FLEET_TASKS``
at the end, then one line ``{"main_cpu_s": ...}``: the main process's own CPU over the whole run
(RUSAGE_SELF), which the bench subtracts from the controller's to give the workers'. Enabled only by
bench/fleet.py
(``ANSIBLE_CALLBACK_PLUGINS``, ``ANSIBLE_CALLBACKS_ENABLED``).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import resource
import time

from ansible.plugins.callback import CallbackBase

REAP_SECONDS = 5.0  # how long a task start waits for the previous task's workers to exit


def _cpu():
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    main = own.ru_utime + own.ru_stime
    return main + kids.ru_utime + kids.ru_stime, main


class CallbackModule(CallbackBase):
    CALLBACK_VERSION = 2.0
    CALLBACK_TYPE = "aggregate"
    CALLBACK_NAME = "rdma_fleet_tasks"
    CALLBACK_NEEDS_ENABLED = True

    def __init__(self):
        super().__init__()
        self._path = os.environ.get("RDMA_FLEET_TASKS")
        self._rows = {}  # task uuid -> row (in the order the tasks first started)
        self._current = None
        self._mark = (time.monotonic(), _cpu())

    def _close(self):
        # the previous task's workers have delivered their results; wait for them to exit, then reap them
        deadline = time.monotonic() + REAP_SECONDS
        while multiprocessing.active_children() and time.monotonic() < deadline:
            time.sleep(0.01)
        now = (time.monotonic(), _cpu())
        if self._current is not None:
            row = self._rows[self._current]
            row["wall_s"] += now[0] - self._mark[0]
            row["cpu_s"] += now[1][0] - self._mark[1][0]
            row["main_cpu_s"] += now[1][1] - self._mark[1][1]
        self._mark = now

    def v2_playbook_on_task_start(self, task, is_conditional):
        self._close()
        self._current = task._uuid
        if task._uuid not in self._rows:
            play = task.play.get_name() if task.play else ""
            row = {"play": play, "task": task.get_name(), "hosts": set(), "starts": 0, "wall_s": 0.0, "cpu_s": 0.0}
            self._rows[task._uuid] = dict(row, main_cpu_s=0.0)
        self._rows[task._uuid]["starts"] += 1

    def v2_playbook_on_handler_task_start(self, task):
        self.v2_playbook_on_task_start(task, False)

    def _seen(self, result, *args, **kwargs):
        if result._task._uuid in self._rows:
            self._rows[result._task._uuid]["hosts"].add(result._host.get_name())

    v2_runner_on_ok = v2_runner_on_failed = v2_runner_on_skipped = v2_runner_on_unreachable = _seen

    def v2_playbook_on_stats(self, stats):
        self._close()
        self._current = None
        if not self._path:
            return
        with open(self._path, "a", encoding="utf-8") as fh:
            for row in self._rows.values():
                # a meta task that reports no result still started once per host
                fh.write(json.dumps(dict(row, hosts=max(len(row["hosts"]), row["starts"]))) + "\n")
            fh.write(json.dumps({"main_cpu_s": _cpu()[1]}) + "\n")
