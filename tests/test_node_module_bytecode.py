"""Issue 40: the node keeps the compiled code of the rdma_node module_utils (rdma_node/_bytecode.py).

Through the real module (ansible, AnsiballZ, zipimport) on a fixture node, with HOME in the test's
directory: the first run writes the cache, the next one executes what it holds (proven by planting
code there), and a cache another user could have written, or a torn file, is passed by: the run
compiles the shipped source and its verdict is the same."""

from __future__ import annotations

import ast
import json
import marshal
import sys
from pathlib import Path
from types import CodeType
from typing import Any

import pytest
from conftest import ROOT, node_info_run

import rdma_node
from rdma_node import _bytecode, fixtures

PACKAGE = "ansible_collections.lingjun.rdma.plugins.module_utils.rdma_node"


def _run(home: Path, node: fixtures.FixtureNode) -> dict[str, Any]:
    args = {"sysfs_root": node.sysfs, "procfs_root": node.procfs, "dev_root": node.dev, "counter_interval": 0}
    run = node_info_run(sys.executable, args, HOME=str(home))
    assert run.returncode == 0, run.stdout + run.stderr
    result: dict[str, Any] = json.loads(run.stdout)["plays"][0]["tasks"][0]["hosts"]["localhost"]
    assert "exception" not in result, result
    return result


def _verdict(result: dict[str, Any]) -> list[tuple[str, bool]]:
    rows = [c for found in result["node"]["checks"].values() for c in found]
    return sorted((c["name"] + "/" + str(c["nic"]), c["passed"]) for c in rows)


def _planted(cache: Path, module: str, marker: Path) -> Path:
    """Replace the kept code of ``module`` with its source plus a line that writes ``marker``."""
    (kept,) = cache.glob(f"{PACKAGE}.{module}-*.pyc")
    source = (ROOT / "plugins" / "module_utils" / "rdma_node" / f"{module}.py").read_text()
    code = compile(source + f"\nopen({str(marker)!r}, 'w').close()\n", str(kept), "exec")
    kept.write_bytes(marshal.dumps(code))
    kept.chmod(0o600)
    return kept


@pytest.fixture
def node(tmp_path: Path) -> fixtures.FixtureNode:
    return fixtures.write_node(str(tmp_path / "node"), fixtures.lingjun_node(nics=4))


def test_the_second_run_executes_the_kept_code(tmp_path: Path, node: fixtures.FixtureNode) -> None:
    home, marker = tmp_path / "home", tmp_path / "ran-from-cache"
    first = _run(home, node)
    cache = home / ".cache" / "lingjun-rdma" / "bytecode"
    kept = sorted(p.name.split("-")[0].removeprefix(PACKAGE + ".") for p in cache.glob("*.pyc"))
    assert {"checks", "healthchecks", "sysfs", "compute", "nicchecks", "nodeinfo"} <= set(kept), kept
    assert "_bytecode" not in kept and "fixtures" not in kept  # the hook itself, and what a run never imports
    assert cache.stat().st_mode & 0o777 == 0o700
    assert {p.stat().st_mode & 0o777 for p in cache.glob("*.pyc")} == {0o600}

    _planted(cache, "checks", marker)
    second = _run(home, node)
    assert marker.exists(), "the second run compiled the source again instead of loading the kept code"
    assert _verdict(second) == _verdict(first) and len(_verdict(first)) > 20


@pytest.mark.parametrize("loosen", ["file writable by the group", "directory writable by others"])
def test_a_cache_others_could_write_is_passed_by(tmp_path: Path, node: fixtures.FixtureNode, loosen: str) -> None:
    home, marker = tmp_path / "home", tmp_path / "planted-code-ran"
    first = _run(home, node)
    cache = home / ".cache" / "lingjun-rdma" / "bytecode"
    kept = _planted(cache, "checks", marker)
    if loosen.startswith("file"):
        kept.chmod(0o660)
    else:
        cache.chmod(0o777)
    second = _run(home, node)
    assert not marker.exists(), f"code from a cache {loosen} was executed"
    assert _verdict(second) == _verdict(first)


def test_a_torn_cache_file_is_compiled_again_and_replaced(tmp_path: Path, node: fixtures.FixtureNode) -> None:
    home = tmp_path / "home"
    first = _run(home, node)
    cache = home / ".cache" / "lingjun-rdma" / "bytecode"
    (kept,) = cache.glob(f"{PACKAGE}.healthchecks-*.pyc")
    whole = kept.read_bytes()
    kept.write_bytes(whole[: len(whole) // 3])
    assert _verdict(_run(home, node)) == _verdict(first)
    again = marshal.loads(kept.read_bytes())  # written again, whole, from the same source
    assert isinstance(again, CodeType) and again.co_filename.endswith("rdma_node/healthchecks.py")


def test_outside_a_zip_nothing_changes() -> None:
    # The device plugin and this checkout import the package from files: Python's own __pycache__.
    assert not _bytecode.install(rdma_node)
    assert not any(isinstance(f, _bytecode._CachedFinder) for f in sys.path_importer_cache.values())


def test_the_module_file_is_a_thin_entry() -> None:
    """AnsiballZ ships the module file itself as source, compiled at every run: it holds the documentation,
    the argument spec and one call; the read is rdma_node.nodeinfo's, whose code the node keeps compiled."""
    tree = ast.parse((ROOT / "plugins" / "modules" / "rdma_node_info.py").read_text())
    defined = [n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef, ast.Lambda))]
    assert defined == ["main"], defined
    (main,) = (n for n in tree.body if isinstance(n, ast.FunctionDef))
    assert [ast.unparse(n).split("(")[0] for n in main.body] == ["module = AnsibleModule", "nodeinfo.run"]
