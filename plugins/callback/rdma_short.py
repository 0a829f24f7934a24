"""stdout callback of this repository: the default output without the noise of a run that went well.

- the implicit "Validating arguments against arg spec" tasks print nothing unless they fail;
- include tasks and "included: <file> for <hosts>" lines are not printed (the included tasks print);
- skipped tasks are hidden by ``display_skipped_hosts = false`` in ansible.cfg (a default option);
- the messages of tasks tagged ``result`` are printed again under RESULT, just before the
  PLAY RECAP, so the outcome of ``make demo`` is the first thing under the task log.
Failures, changes and warnings print exactly as the default callback prints them.
"""

from __future__ import annotations

DOCUMENTATION = """
    name: rdma_short
    type: stdout
    short_description: default output without arg-spec and include noise, results last
    description:
        - The default callback; successful argument-spec validations and include lines are not printed,
          and the msg of tasks tagged C(result) is repeated under RESULT before the PLAY RECAP.
    extends_documentation_fragment:
      - default_callback
      - result_format_callback
    requirements:
      - set as stdout_callback in ansible.cfg
"""

from ansible.playbook.task_include import TaskInclude
from ansible.plugins.callback.default import CallbackModule as DefaultCallback

ARG_SPEC_ACTIONS = {"validate_argument_spec", "ansible.builtin.validate_argument_spec"}


class CallbackModule(DefaultCallback):
    CALLBACK_VERSION = 2.0
    CALLBACK_TYPE = "stdout"
    CALLBACK_NAME = "rdma_short"

    def __init__(self):
        super().__init__()
        self._results = []

    def v2_runner_on_ok(self, result):
        if isinstance(result.task, TaskInclude) or (
            result.task.action in ARG_SPEC_ACTIONS and not result.result.get("changed")
        ):
            return  # an include's own tasks print their banners; a passed arg-spec check says nothing
        if "result" in (result.task.tags or []) and "msg" in result.result:
            self._results.append((result._host.get_name(), result.result["msg"]))
        super().v2_runner_on_ok(result)

    def v2_playbook_on_include(self, included_file):
        pass

    def v2_playbook_on_stats(self, stats):
        if self._results:
            self._display.banner("RESULT")
            for host, msg in self._results:
                lines = msg if isinstance(msg, list) else [msg]
                for line in lines:
                    self._display.display(f"{host}: {line}")
        super().v2_playbook_on_stats(stats)
