"""The local default cleans up after itself and shares the machine: every process is recorded the
moment it starts, a failed start (the metrics port is taken) stops what it started and leaves no
simulator behind however often it is retried, stopping ends whatever is recorded, the metrics port
is a free one unless one is set (kept across runs), and a second kubelet simulator on one
directory refuses to start. Each test deploys into its own directory (real plugin, real simulator)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import yaml
from conftest import BIN, ROOT, ansible_env, processes, run_playbook


def _work(inventory: Path) -> str:
    return str(yaml.safe_load(inventory.read_text())["all"]["vars"]["rdma_local_dir"])


def test_a_failed_start_leaves_nothing_running(local: Path) -> None:
    with socket.socket() as taken:
        taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for _attempt in (1, 2, 3):  # retries must not pile up simulators
            result = run_playbook(
                "playbooks/deploy.yml", "-i", str(local),
                "-e", f"plugin_deploy_local_metrics_port={port}", "-e", f"rdma_metrics_port={port}",
            )  # fmt: skip
            out = " ".join(result.stdout.split())
            assert result.returncode != 0, out[-2000:]
            assert f"127.0.0.1:{port}" in out and "plugin_deploy_local_metrics_port" in out, out[-2000:]
            assert processes(_work(local)) == [], "a failed start left processes running"
            assert not Path(_work(local), "run", "local-plugin.json").exists()


def test_free_metrics_port_kept_across_runs_and_stopped(local: Path) -> None:
    first = run_playbook("playbooks/deploy.yml", "-i", str(local))
    assert first.returncode == 0, first.stdout[-3000:]
    state = json.loads(Path(_work(local), "run", "local-plugin.json").read_text())
    address = state["metrics_address"]
    assert address.startswith("127.0.0.1:") and address != "127.0.0.1:9410"
    assert f"metrics: http://{address}/metrics" in first.stdout
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as resp:
        assert b"rdma_dp_build_info" in resp.read()
    again = run_playbook("playbooks/deploy.yml", "-i", str(local))
    assert again.returncode == 0 and "changed=0" in again.stdout, again.stdout[-2000:]
    assert json.loads(Path(_work(local), "run", "local-plugin.json").read_text())["metrics_address"] == address
    assert len(processes(_work(local))) == 2  # the simulator and the plugin, once each
    stop = run_playbook("playbooks/uninstall.yml", "-i", str(local))
    assert stop.returncode == 0, stop.stdout[-2000:]
    assert processes(_work(local)) == []


def test_a_second_simulator_on_one_directory_refuses(tmp_path: Path) -> None:
    run = [str(BIN / "python"), "-m", "rdma_kubesim.sim_cli", "run", "--dir", str(tmp_path / "dp")]
    first = subprocess.Popen([*run, "--status-file", str(tmp_path / "a.json")])
    try:
        deadline = time.monotonic() + 30
        while not (tmp_path / "a.json").exists():
            assert time.monotonic() < deadline and first.poll() is None
            time.sleep(0.05)
        second = subprocess.run(
            [*run, "--status-file", str(tmp_path / "b.json")], capture_output=True, text=True, timeout=60
        )
        assert second.returncode == 2
        assert f"another kubelet simulator (pid {first.pid}) serves {tmp_path / 'dp'}" in second.stderr
    finally:
        first.terminate()
        first.wait(timeout=30)


def test_verify_shows_the_nccl_env_a_pod_gets(local: Path) -> None:
    """verify allocates one device and prints what the pod got: its NICs in NCCL's exact-match form
    and the UCX devices (issue 23: the env computed from exactly the allocated NICs)."""
    deploy = run_playbook("playbooks/deploy.yml", "-i", str(local))
    assert deploy.returncode == 0, deploy.stdout[-3000:]
    verify = run_playbook("playbooks/verify.yml", "-i", str(local))
    out = " ".join(verify.stdout.split())
    assert verify.returncode == 0, out[-3000:]
    nics = ",".join(f"mlx5_bond_{i}" for i in range(4))  # shared mode: every NIC of the fixture node
    assert f"NCCL_IB_HCA=={nics} " in out, out[-3000:]  # key=value, the value's "=" is NCCL's exact match
    assert "UCX_NET_DEVICES=mlx5_bond_0:1," in out, out[-3000:]


def test_an_interpreter_without_the_simulator_is_named_with_the_fix(tmp_path: Path) -> None:
    """The kubelet simulator is a development package (rdma_kubesim, not in the image): an interpreter
    without it (or without the plugin) is refused before anything starts, naming both and the fix."""
    bare = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True, timeout=120)
    config = tmp_path / "config.yaml"
    config.write_text("mode: shared\n")
    args = {
        "run_dir": str(tmp_path / "run"),
        "python": str(bare / "bin" / "python"),
        "config_path": str(config),
        **{k: str(tmp_path / k) for k in ("sysfs_root", "procfs_root", "dev_root", "device_plugin_dir")},
        "status_file": str(tmp_path / "status.json"),
    }
    run = subprocess.run(
        [
            str(BIN / "ansible"),
            "localhost",
            "-c",
            "local",
            "-m",
            "lingjun.rdma.rdma_local_plugin",
            "-a",
            json.dumps(args),
        ],
        cwd=ROOT,
        env={**ansible_env(), "ANSIBLE_STDOUT_CALLBACK": "json", "ANSIBLE_LOAD_CALLBACK_PLUGINS": "1"},
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    result = json.loads(run.stdout)["plays"][0]["tasks"][0]["hosts"]["localhost"]
    assert result.get("failed"), result
    assert result["msg"].startswith(f"python {bare / 'bin' / 'python'} lacks rdma_device_plugin rdma_kubesim: "), result
    assert "make setup" in result["msg"] and "rdma_local_python" in result["msg"]
    assert not (tmp_path / "run").exists()  # nothing started, nothing recorded
