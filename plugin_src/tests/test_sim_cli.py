"""The kubelet simulator as a process: status file, control socket, SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from rdma_kubesim import sim_cli

RES = "rdma/hca"


def _wait(predicate: Callable[[], bool], timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def _status(path: Path) -> dict[str, object]:
    try:
        return dict(json.loads(path.read_text(encoding="utf-8")))
    except (OSError, ValueError):
        return {}


def test_status_file_allocate_and_sigterm(short_tmp: Path, dp_dir: Path, start_plugin) -> None:  # type: ignore[no-untyped-def]
    status_file = short_tmp / "status.json"
    log = (short_tmp / "sim.log").open("w", encoding="utf-8")
    sim = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "rdma_kubesim.sim_cli",
            "--dir",
            str(dp_dir),
            "--status-file",
            str(status_file),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        assert _wait(lambda: (dp_dir / "kubelet.sock").exists() and status_file.exists())
        assert _status(status_file) == {
            "node": "lingjun-node-0",
            "registered": [],
            "registrations": {},
            "capacity": {},
            "allocatable": {},
        }
        plugin = start_plugin()
        assert _wait(lambda: _status(status_file).get("capacity") == {RES: "1k"}), plugin.output()
        assert _status(status_file)["allocatable"] == {RES: "1k"}
        assert _status(status_file)["registered"] == [RES]
        assert _status(status_file)["registrations"] == {RES: 1}

        control = sim_cli.default_control_socket(str(dp_dir))
        reply = sim_cli.call(control, {"op": "allocate", "resource": RES, "count": 1, "pod": "p"})
        assert reply["ok"], reply
        paths = [d["hostPath"] for d in reply["devices"]]
        assert "/dev/infiniband/rdma_cm" in paths and len(paths) == 5
        assert reply["env"]["RDMA_DEVICES"].startswith("mlx5_bond_")
        assert sim_cli.call(control, {"op": "allocate", "resource": "rdma/none"})["ok"] is False
        assert sim_cli.call(control, {"op": "nope"})["error"] == "unknown op 'nope'"

        cli = subprocess.run(
            [sys.executable, "-m", "rdma_kubesim.sim_cli", "status", "--control-socket", control],
            capture_output=True,
            text=True,
            check=True,
        )
        assert json.loads(cli.stdout)["status"]["capacity"] == {RES: "1k"}

        plugin.stop()
        assert _wait(lambda: _status(status_file).get("allocatable") == {RES: "0"})
    finally:
        sim.send_signal(signal.SIGTERM)
        rc = sim.wait(timeout=10)
        log.close()
    assert rc == 0
    assert not status_file.exists()
    assert not os.path.exists(sim_cli.default_control_socket(str(dp_dir)))
