"""Shared helpers for the repository-level tests (automation, docs, example inventory)."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
# The repository is the lingjun.rdma collection: its plugins import as ansible_collections.lingjun.rdma.*
sys.path.insert(0, str(ROOT / "collections"))


def ansible_env() -> dict[str, str]:
    """The environment the Makefile gives Ansible: the venv first on PATH, this ansible.cfg."""
    env = dict(os.environ)
    env["PATH"] = f"{BIN}:{env.get('PATH', '')}"
    env["ANSIBLE_CONFIG"] = str(ROOT / "ansible.cfg")
    env["ANSIBLE_NOCOLOR"] = "1"
    return env


def run_playbook(*args: str, timeout: int = 900, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / "ansible-playbook"), *args],
        cwd=ROOT,
        env={**ansible_env(), **env},
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def node_info_run(python: str, options: dict[str, Any], **env: str) -> subprocess.CompletedProcess[str]:
    """One ad-hoc ``rdma_node_info`` run on localhost with ``python`` as the node's interpreter (real
    AnsiballZ), ``options`` as JSON (dicts and lists too) over the real roots, ``env`` added to its
    environment; the raw run."""
    return subprocess.run(
        [
            str(BIN / "ansible"),
            "localhost",
            "-c",
            "local",
            "-m",
            "lingjun.rdma.rdma_node_info",
            "-a",
            json.dumps({"sysfs_root": "/sys", "procfs_root": "/proc", "dev_root": "/dev", **options}),
            "-e",
            f"ansible_python_interpreter={python}",
        ],
        cwd=ROOT,
        env={**ansible_env(), "ANSIBLE_STDOUT_CALLBACK": "json", "ANSIBLE_LOAD_CALLBACK_PLUGINS": "1", **env},
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )


def node_info(python: str, *args: str) -> dict[str, Any]:
    """:func:`node_info_run` with ``key=value`` options; the module's result, which must have succeeded."""
    run = node_info_run(python, dict(a.split("=", 1) for a in args))
    assert run.returncode == 0, run.stdout + run.stderr
    result: dict[str, Any] = json.loads(run.stdout)["plays"][0]["tasks"][0]["hosts"]["localhost"]
    assert "exception" not in result and "Traceback" not in run.stdout + run.stderr, result
    return result


@pytest.fixture
def root() -> Path:
    return ROOT


def processes(marker: str) -> list[int]:
    """Pids of the live processes whose command line mentions ``marker``."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (entry / "stat").read_text().rsplit(")", 1)[-1].split()[0]
        except OSError:
            continue
        if marker in cmdline and state != "Z" and "pytest" not in cmdline:
            pids.append(int(entry.name))
    return pids


@pytest.fixture
def local(tmp_path: Path) -> Iterator[Path]:
    """An inventory of the local target in its own short directory (unix socket paths < 108 bytes);
    whatever it started is stopped afterwards."""
    work = Path(os.environ.get("TMPDIR", "/tmp")) / f"rdp-loc-{os.getpid()}-{time.monotonic_ns() % 10**6}"
    node = {"ansible_connection": "local", "ansible_python_interpreter": sys.executable}
    vars_ = {
        "rdma_deploy_target": "local",
        "rdma_local_dir": str(work),
        "rdma_sysfs_root": f"{work}/node/sys",
        "rdma_procfs_root": f"{work}/node/proc",
        "rdma_dev_root": f"{work}/node/dev",
        "rdma_metrics_enabled": True,
    }
    inventory = tmp_path / "local-copy" / "hosts.yml"
    inventory.parent.mkdir()
    inventory.write_text(
        yaml.safe_dump({"all": {"vars": vars_, "children": {"rdma_nodes": {"hosts": {"node": node}}}}})
    )
    try:
        yield inventory
    finally:
        run_playbook("playbooks/uninstall.yml", "-i", str(inventory))
        for pid in processes(str(work)):
            os.kill(pid, 9)
        subprocess.run(["rm", "-rf", str(work)], check=False)


GLOBAL_LOCK = "/tmp/molecule.lock"  # the local default's fixed paths, shared with molecule and make demo


def plain_env() -> dict[str, str]:
    """The environment a reader has: no venv on PATH, no ANSIBLE_CONFIG from the Makefile."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ANSIBLE_", "MAKE", "MFLAGS", "VIRTUAL_ENV"))}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if Path(p) != BIN)
    env["ANSIBLE_NOCOLOR"] = "1"
    return env


@pytest.fixture
def local_default_lock() -> Iterator[None]:
    with open(GLOBAL_LOCK, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            subprocess.run(["make", "stop"], cwd=ROOT, env=plain_env(), capture_output=True, timeout=600, check=False)
            fcntl.flock(fh, fcntl.LOCK_UN)
