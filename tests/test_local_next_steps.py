"""Every local dead end ends with the command that gets out of it: verify before anything is
deployed names the deploy; `make status` with nothing running names `make demo`; a playbook run
from another working directory finds its roles and collection (playbooks/roles and
playbooks/collections link back) and says how to get this checkout's ansible.cfg; and a run
interrupted with Ctrl-C names the local processes still running and the command that stops them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import yaml
from conftest import BIN, ROOT, ansible_env, processes, run_playbook


def _flat(text: str) -> str:
    return " ".join(text.split())


def _work(inventory: Path) -> str:
    return str(yaml.safe_load(inventory.read_text())["all"]["vars"]["rdma_local_dir"])


def test_verify_before_any_deploy_names_the_deploy(local: Path) -> None:
    result = run_playbook("playbooks/verify.yml", "-i", str(local))
    out = _flat(result.stdout)
    assert result.returncode == 2, out[-2000:]
    assert "Nothing to verify: the local plugin and kubelet simulator are not running" in out, out[-2000:]
    assert f"Start them with: ansible-playbook playbooks/deploy.yml -i {local}" in out, out[-2000:]
    assert "File not found" not in out


def test_status_with_nothing_running_names_make_demo(tmp_path: Path) -> None:
    state = tmp_path / "local-plugin.json"
    run = [str(BIN / "python"), str(ROOT / "scripts/local_status.py"), str(state), str(tmp_path / "dp"), "make demo"]
    never = subprocess.run(run, capture_output=True, text=True, timeout=60, check=False)
    assert never.returncode == 1
    assert never.stderr.strip() == (
        f"the local default is not running (no plugin is recorded in {state}). Start it with: make demo"
    )
    state.write_text(json.dumps({"plugin": {"pid": 2**22 + 1, "log": "x"}}))  # above pid_max: never alive
    stopped = subprocess.run(run, capture_output=True, text=True, timeout=60, check=False)
    assert stopped.returncode == 1 and "its plugin is recorded but not running" in stopped.stderr
    assert "Start it with: make demo" in stopped.stderr


def test_playbooks_run_from_another_directory(tmp_path: Path, local: Path) -> None:
    env = {k: v for k, v in ansible_env().items() if k != "ANSIBLE_CONFIG"}
    for cwd in (ROOT / "playbooks", tmp_path):
        result = subprocess.run(
            [str(BIN / "ansible-playbook"), str(ROOT / "playbooks/verify.yml"), "-i", str(local)],
            cwd=cwd, env=env, capture_output=True, text=True, timeout=600, check=False,
        )  # fmt: skip
        out = _flat(result.stdout + result.stderr)
        assert "was not found" not in out and "couldn't resolve module/action" not in out, out[-2000:]
        assert f"this checkout's ansible.cfg ({ROOT}/ansible.cfg) is not in effect" in out, out[-2000:]
        assert f"run from the repository root (cd {ROOT}) or export ANSIBLE_CONFIG={ROOT}/ansible.cfg" in out
        assert "Nothing to verify" in out, out[-2000:]  # the play itself ran


def test_ctrl_c_names_what_still_runs(tmp_path: Path, local: Path) -> None:
    deploy = run_playbook("playbooks/deploy.yml", "-i", str(local))
    assert deploy.returncode == 0, deploy.stdout[-3000:]
    running = processes(_work(local))
    assert len(running) == 2
    # A second run whose node interpreter announces itself and then blocks: the run is interrupted
    # in the middle (as a Ctrl-C in the terminal does: SIGINT to the whole process group).
    ready = tmp_path / "ready"
    blocker = tmp_path / "blocking-python"
    blocker.write_text(f"#!/bin/sh\ntouch {ready}\nexec sleep 600\n")
    blocker.chmod(0o755)
    run = subprocess.Popen(
        [str(BIN / "ansible-playbook"), "playbooks/site.yml", "-i", str(local),
         "-e", f"ansible_python_interpreter={blocker}"],
        cwd=ROOT, env=ansible_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 300
        while not ready.exists():
            assert run.poll() is None and time.monotonic() < deadline, run.stdout.read() if run.stdout else ""
            time.sleep(0.1)
        os.killpg(run.pid, signal.SIGINT)
        out, _ = run.communicate(timeout=120)
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
    flat = _flat(out)
    assert run.returncode != 0 and "PLAY RECAP" not in out, flat[-2000:]
    assert "The run stopped before its end; the local target still runs the kubelet simulator (pid" in flat, flat[
        -2000:
    ]
    assert all(f"pid {pid}" in flat for pid in running), (running, flat[-2000:])
    assert f"Stop them with: ansible-playbook playbooks/uninstall.yml -i {local}" in flat, flat[-2000:]
    assert sorted(processes(_work(local))) == sorted(running)  # Ctrl-C did not stop them: they still run
