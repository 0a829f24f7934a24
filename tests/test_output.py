"""The repository's Ansible output (callback_plugins/rdma_short.py via ansible.cfg): argument
checks that pass and skipped tasks are not shown, a failing argument check is, and the messages
of tasks tagged `result` come once, under RESULT just before the recap."""

from __future__ import annotations

import sys
from pathlib import Path

from conftest import run_playbook

LOCAL = ("-i", "localhost,", "-c", "local", "-e", f"ansible_python_interpreter={sys.executable}")

PLAYBOOK = """
- name: Output check
  hosts: localhost
  gather_facts: false
  tasks:
    - name: A skipped task
      ansible.builtin.debug:
        msg: never
      when: false
    - name: Include a role with an argument spec
      ansible.builtin.include_role:
        name: plugin_uninstall
        tasks_from: main
      vars:
        rdma_deploy_target: "{{ target }}"
        rdma_local_dir: "{{ playbook_dir }}/local"
    - name: The outcome
      ansible.builtin.debug:
        msg: ["first line of the result", "second line"]
      tags: [result]
"""


def test_noise_hidden_result_last(tmp_path: Path) -> None:
    playbook = tmp_path / "output.yml"
    playbook.write_text(PLAYBOOK)
    out = run_playbook(str(playbook), *LOCAL, "-e", "target=local").stdout
    assert "Validating arguments against arg spec" not in out
    assert "A skipped task" not in out and "skipping:" not in out and "included:" not in out
    result = out.index("RESULT *")
    assert out.index("PLAY RECAP") > result
    assert "localhost: first line of the result\nlocalhost: second line" in out[result:]
    assert out.count("first line of the result") == 1, out  # once, under RESULT: not also in the task's output
    assert "TASK [The outcome]" in out  # the task itself still shows (its ok line)


def test_a_failing_argument_check_is_shown(tmp_path: Path) -> None:
    playbook = tmp_path / "output.yml"
    playbook.write_text(PLAYBOOK)
    result = run_playbook(str(playbook), *LOCAL, "-e", "target=elsewhere")
    assert result.returncode != 0
    assert "Validating arguments against arg spec" in result.stdout
    assert "rdma_deploy_target" in result.stdout
