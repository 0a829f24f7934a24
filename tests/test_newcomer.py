"""A newcomer's walk-through, as the docs tell it: the runnable blocks of docs/getting-started.md (the
local default: demo, status, a port down and up, exclusive mode, the non-hostNetwork switch, stop,
the offline dry run), then the blocks of docs/before-a-real-cluster.md marked `walkthrough`, with the
inventory copy in a temporary directory, no kubeconfig (an empty HOME) and nodes that do not exist.
Each runs as written, from the repository root, with the shell's own PATH. A block marked `fails`
must fail and print its `# ->` line (its next step); no block may print a Python traceback."""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import ROOT, plain_env
from test_docs import FENCE

COPY = "inventories/my-cluster"


def walkthrough(doc: Path, marker: str) -> list[tuple[str, str]]:
    """(info, body) of the blocks whose info string has ``marker``, in document order."""
    return [(info, body) for _, info, body in FENCE.findall(doc.read_text()) if marker in info.split()]


@pytest.fixture
def sandbox(tmp_path: Path) -> Iterator[Path]:
    home = tmp_path / "home"
    home.mkdir()
    try:
        yield tmp_path
    finally:
        shutil.rmtree(ROOT / "out" / "my-cluster", ignore_errors=True)


def _run(body: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", "-euo", "pipefail", "-c", body], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800,
        check=False,
    )  # fmt: skip


def test_newcomer_walkthrough(sandbox: Path, local_default_lock: None) -> None:
    env = {**plain_env(), "HOME": str(sandbox / "home")}
    started = walkthrough(ROOT / "docs/getting-started.md", "runnable")
    steps = [("getting-started", info, body) for info, body in started]
    steps += [
        ("before-a-real-cluster", info, body.replace(COPY, str(sandbox / "my-cluster")))
        for info, body in walkthrough(ROOT / "docs/before-a-real-cluster.md", "walkthrough")
    ]
    assert len(steps) >= 10 and sum("fails" in info.split() for _, info, _ in steps) >= 3
    for i, (doc, info, body) in enumerate(steps):
        result = _run(body, env if doc == "before-a-real-cluster" else plain_env())
        out = " ".join((result.stdout + result.stderr).split())
        where = f"{doc} block {i}:\n{body}\n--- output\n{out[-3000:]}"
        assert "Traceback (most recent call last)" not in result.stdout + result.stderr, where
        if "fails" in info.split():
            assert result.returncode != 0, where
            for expected in re.findall(r"^# -> (.+)$", body, re.M):
                assert expected.strip() in out, where
        else:
            assert result.returncode == 0, where
