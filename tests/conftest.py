"""Shared helpers for the repository-level tests (automation, docs, example inventory)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


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


@pytest.fixture
def root() -> Path:
    return ROOT
