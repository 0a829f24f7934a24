"""Bench callback (bench/fleet.py): the controller's CPU per task, for the once-per-run figure.

At each task start, and at the end, it lets multiprocessing reap the finished workers (their CPU, and
that of every process they waited for, then counts in this process's RUSAGE_CHILDREN) and records
this process's own CPU plus its reaped children's since the previous mark. So each task gets the CPU
of the main process while it ran plus that of its workers. A task that ran on one host (the
controller's plays: the inventory check, the report, the labels) is once-per-run work; the rest is
per-host work. Writes one JSON line per task to ``$RDMA_FLEET_TASKS``. Enabled only by bench/fleet.py
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
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


class CallbackModule(CallbackBase):
    CALLBACK_VERSION = 2.0
    CALLBACK_TYPE = "aggregate"
    CALLBACK_NAME = "rdma_fleet_tasks"
    CALLBACK_NEEDS_ENABLED = True

    def __init__(self):
        super().__init__()
        self._path = os.environ.get("RDMA_FLEET_TASKS")
        self._current = None
        self._hosts = set()
        self._mark = (time.monotonic(), _cpu())

    def _close(self):
        # the previous task's workers have delivered their results; wait for them to exit, then reap them
        deadline = time.monotonic() + REAP_SECONDS
        while multiprocessing.active_children() and time.monotonic() < deadline:
            time.sleep(0.01)
        now = (time.monotonic(), _cpu())
        if self._current is not None and self._path:
            play, task = self._current
            row = {
                "play": play,
                "task": task,
                "hosts": len(self._hosts),
                "wall_s": now[0] - self._mark[0],
                "cpu_s": now[1] - self._mark[1],
            }
            with open(self._path, "a", encoding="utf-8") as fh:
                fh.write(json.dumps(row) + "\n")
        self._mark = now
        self._hosts = set()

    def v2_playbook_on_task_start(self, task, is_conditional):
        self._close()
        self._current = (task.play.get_name() if task.play else "", task.get_name())

    def v2_playbook_on_handler_task_start(self, task):
        self.v2_playbook_on_task_start(task, False)

    def _seen(self, result, *args, **kwargs):
        self._hosts.add(result._host.get_name())

    v2_runner_on_ok = v2_runner_on_failed = v2_runner_on_skipped = v2_runner_on_unreachable = _seen

    def v2_playbook_on_stats(self, stats):
        self._close()
        self._current = None
