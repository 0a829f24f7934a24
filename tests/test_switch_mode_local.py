"""playbooks/switch-mode.yml needs a cluster: on the local default it says so and gives the local command."""

from __future__ import annotations

from conftest import run_playbook


def test_switch_mode_on_the_local_default_gives_the_local_command() -> None:
    result = run_playbook(
        "playbooks/switch-mode.yml", "-i", "inventories/local",
        "-e", '{"rdma_switch_nodes": ["lingjun-node-0"], "rdma_switch_to": "exclusive"}',
    )  # fmt: skip
    assert result.returncode != 0
    out = " ".join(result.stdout.split())
    assert "relabels Node objects of a Kubernetes cluster" in out
    assert ".venv/bin/ansible-playbook playbooks/site.yml -i inventories/local -e rdma_mode=exclusive" in out
