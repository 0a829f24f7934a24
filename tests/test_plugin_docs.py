"""Every plugin of the collection is documented for ansible-doc as an operator reads it: the filters
have docs (no UNDOCUMENTED in the listing), and every module's and filter's rendered text has no raw
markup left (a C(...) or I(...) that did not parse shows as is, as rdma_verify's did)."""

from __future__ import annotations

import re
import subprocess

from conftest import BIN, ROOT, ansible_env

MARKUP = re.compile(r"(?<![A-Z])[BCIMOUVLR]\(")


def _doc(*args: str) -> str:
    run = subprocess.run(
        [str(BIN / "ansible-doc"), *args], cwd=ROOT, env={**ansible_env(), "ANSIBLE_NOCOLOR": "1", "NO_COLOR": "1"},
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    return run.stdout


def _listed(kind: str) -> list[str]:
    out = _doc("-t", kind, "-l", "lingjun.rdma")
    assert "UNDOCUMENTED" not in out, out
    return [line.split()[0] for line in out.splitlines() if line.startswith("lingjun.rdma.")]


def test_filters_are_documented_and_render_clean() -> None:
    filters = _listed("filter")
    assert {"lingjun.rdma.rdma_bool", "lingjun.rdma.rdma_int", "lingjun.rdma.k8s_quantity"} <= set(filters)
    text = _doc("-t", "filter", *filters)
    assert not MARKUP.search(text), MARKUP.search(text)


def test_modules_render_without_raw_markup() -> None:
    modules = _listed("module")
    assert "lingjun.rdma.rdma_verify" in modules and "lingjun.rdma.rdma_cluster_info" in modules
    text = _doc(*modules)
    bad = [line for line in text.splitlines() if MARKUP.search(line)]
    assert not bad, bad
