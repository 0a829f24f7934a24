"""Docs that run as written. Every fenced block of README.md and docs/*.md whose info string is
`sh runnable` is run, in document order, from the repository root against the local default
(with the shell's own PATH: the docs must say `.venv/bin/` themselves). Every other shell block
is checked for the things that drift: playbook paths, make targets, `.venv/bin/` in front of
ansible-playbook, `-n` on helm test, DaemonSet names and the node custom-columns line of the
chart as the real Helm engine renders it."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import yaml
from conftest import ROOT, plain_env

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(sh|bash|shell)([^\n]*)\n(.*?)^```", re.S | re.M)


def blocks(path: Path) -> list[tuple[bool, str]]:
    return [("runnable" in info.split(), body) for _, info, body in FENCE.findall(path.read_text())]


def commands(body: str) -> list[str]:
    """Logical lines (backslash continuations joined), comments dropped."""
    text = re.sub(r"\\\n\s*", " ", body)
    return [line.split("  #")[0].strip() for line in text.splitlines() if line.strip() and not line.startswith("#")]


# getting-started's blocks run in tests/test_newcomer.py, as the first part of the newcomer walk-through
RUNNABLE = [p for p in DOCS if any(r for r, _ in blocks(p)) and p.name != "getting-started.md"]


@pytest.mark.parametrize("doc", RUNNABLE, ids=[p.name for p in RUNNABLE])
def test_runnable_blocks_run_as_written(doc: Path, local_default_lock: None) -> None:
    for i, (runnable, body) in enumerate(blocks(doc)):
        if not runnable:
            continue
        result = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", body],
            cwd=ROOT,
            env=plain_env(),
            capture_output=True,
            text=True,
            timeout=1800,
            check=False,
        )
        assert result.returncode == 0, (
            f"{doc.name} block {i} failed (rc {result.returncode}):\n{body}\n--- stdout\n"
            f"{result.stdout[-3000:]}\n--- stderr\n{result.stderr[-3000:]}"
        )


def test_getting_started_is_runnable() -> None:
    assert sum(r for r, _ in blocks(ROOT / "docs/getting-started.md")) >= 5


def _rendered_chart() -> tuple[set[str], str]:
    import helm_python

    rendered = helm_python.Chart.load(str(ROOT / "charts/rdma-device-plugin")).render(
        {}, name="rdma", namespace="kube-system"
    )
    daemonsets = set()
    notes = ""
    for key, text in rendered.items():
        if key.endswith("NOTES.txt"):
            notes = text
            continue
        for doc in yaml.safe_load_all(text):
            if doc and doc.get("kind") == "DaemonSet":
                daemonsets.add(doc["metadata"]["name"])
    return daemonsets, notes


def test_every_shell_block_names_real_things() -> None:
    targets = set(re.findall(r"^([a-z-]+):", (ROOT / "Makefile").read_text(), re.M))
    daemonsets, notes = _rendered_chart()
    problems = []
    for doc in [*DOCS, ROOT / "CONTRIBUTING.md"]:
        for _, body in blocks(doc):
            for cmd in commands(body):
                where = f"{doc.name}: {cmd}"
                if re.search(r"(^|[\s;&|])ansible-playbook\b", cmd):
                    problems.append(f"{where}: use .venv/bin/ansible-playbook (the venv make setup creates)")
                for playbook in re.findall(r"\bplaybooks/[\w.-]+\.yml", cmd):
                    if not (ROOT / playbook).exists():
                        problems.append(f"{where}: {playbook} does not exist")
                for target in re.findall(r"^make ([a-z-]+)", cmd):
                    if target not in targets:
                        problems.append(f"{where}: no make target {target}")
                for ds in re.findall(r"\bds/([\w.<>-]+)", cmd):
                    if ds.replace("<release>", "rdma") not in daemonsets:
                        problems.append(f"{where}: no DaemonSet {ds} in the chart (it renders {sorted(daemonsets)})")
                if re.search(r"\bhelm test\b", cmd) and not re.search(r"\s(-n|--namespace)\s", cmd):
                    problems.append(f"{where}: helm test needs -n <namespace>")
                if "custom-columns" in cmd and cmd not in notes:
                    problems.append(f"{where}: not the custom-columns line of the chart's NOTES.txt")
    assert not problems, "\n".join(problems)
