"""Logs (issue 30): native gRPC-core lines go through the plugin's logger (JSON stays JSON), long
lists are summarised at INFO (the full list at debug), and a kubelet restart is INFO, not WARNING."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest
from conftest import serve_command

from rdma_kubesim import KubeletSimulator
from rdma_node import fixtures

RES = "rdma/hca"


def run_json(
    fx: fixtures.FixtureNode,
    dp_dir: Path,
    log: Path,
    level: str = "info",
    env: dict[str, str] | None = None,
) -> tuple[subprocess.Popen[str], Any]:
    cmd = serve_command(fx, dp_dir, None, "--log-format", "json", "--log-level", level)
    fh = open(log, "w", encoding="utf-8")  # noqa: SIM115 - closed by the caller
    proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, text=True, env={**os.environ, **(env or {})})
    return proc, fh


def relisted(log: Path) -> str:
    """The log after the line saying the set of RDMA devices changed."""
    return log.read_text(encoding="utf-8").split("RDMA devices changed")[-1] if log.exists() else ""


def records(log: Path) -> list[dict[str, Any]]:
    """Every line of the log as JSON: a line that is not fails the test."""
    lines = log.read_text(encoding="utf-8").splitlines()
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError:
            pytest.fail(f"not a JSON line in the JSON log: {line!r}")
    return out


@pytest.mark.timeout(60)
def test_grpc_core_lines_are_json_records_of_the_plugins_logger(
    sim: KubeletSimulator, node: fixtures.FixtureNode, dp_dir: Path, short_tmp: Path
) -> None:
    """gRPC core writes to fd 2 itself (abseil: ``W1203 10:51:07.514536 22580 log.cc:110] ...``);
    GRPC_VERBOSITY=debug makes it write a warning at start."""
    log = short_tmp / "json.log"
    proc, fh = run_json(node, dp_dir, log, env={"GRPC_VERBOSITY": "debug"})
    try:
        assert sim.wait_registered(RES, timeout=30)
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        fh.close()
    found = [r for r in records(log) if r["logger"] == "grpc.core"]
    assert found, log.read_text(encoding="utf-8")[-2000:]
    assert any(r["level"] == "warning" and r["source"].startswith("log.cc:") for r in found), found


@pytest.mark.timeout(120)
def test_lists_of_nics_are_summarised_at_info_and_whole_at_debug(
    sim: KubeletSimulator, dp_dir: Path, short_tmp: Path
) -> None:
    """8 NICs (the fixture writer stops at about ten): the start-up and re-list lines (devices
    changed, resource ready, port states, the Allocate answer) stay short at INFO, as they must at
    64 (the devices-changed line was 1.5 KB here, 11.7 KB there); the whole list is at debug."""
    fx = fixtures.write_node(str(short_tmp / "n8"), fixtures.lingjun_node(nics=8))
    for level in ("info", "debug"):
        log = short_tmp / f"{level}.log"
        proc, fh = run_json(fx, dp_dir, log, level=level)
        try:
            assert sim.wait_registered(RES, timeout=60, count=1 if level == "info" else 2)
            sim.allocate(RES, 1, pod=f"p-{level}")
            fx.remove_nic("mlx5_bond_7")  # a re-list: devices changed, RDMA devices changed on the node
            assert sim.wait_for(lambda path=log: "devices changed" in relisted(path))
        finally:
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=30) == 0
            fh.close()
        lines = log.read_text(encoding="utf-8").splitlines()
        info = [line for line, r in zip(lines, records(log), strict=True) if r["level"] != "debug"]
        if level == "info":
            assert max(len(line) for line in info) < 1000, max(info, key=len)[:300]
            said = {r["msg"] for r in records(log)}
            assert {"devices changed", "resource ready", "Allocate answer"} <= said
            assert "(+4 more)" in "".join(info)
        else:
            full = [r for r in records(log) if r["msg"] == "devices changed" and r["level"] == "debug"]
            assert full and len(full[0]["nics"]) == 8
        fx.add_nic(next(n for n in fixtures.lingjun_node(nics=8).nics if n.name == "mlx5_bond_7"))


@pytest.mark.timeout(120)
def test_a_kubelet_restart_is_info_not_warning(
    kubelet: Any, node: fixtures.FixtureNode, dp_dir: Path, short_tmp: Path
) -> None:
    log = short_tmp / "restart.log"
    proc, fh = run_json(node, dp_dir, log)
    try:
        assert kubelet.wait_registered(RES, timeout=30)
        for _ in range(3):
            kubelet.restart()
            assert kubelet.wait_registered(RES, timeout=30)
            assert kubelet.wait_allocatable(RES, 1000, timeout=30)
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        fh.close()
    said = records(log)
    assert any("kubelet restarted" in r["msg"] or "registering again" in r["msg"] for r in said), said
    loud = [r for r in said if r["level"] in ("warning", "error", "critical")]
    assert not loud, loud


def test_text_log_values_are_quoted_when_they_could_split_or_fake_a_pair() -> None:
    """Issue 39: ``k=v`` lines with a value holding spaces, quotes or ``=`` (an error text from a node,
    a path) read as other pairs. Such values are written as JSON strings; plain ones stay bare."""
    import logging
    import re

    from rdma_device_plugin.logs import TextFormatter

    extra = {
        "resource": "rdma/hca",
        "error": 'no such file: "x" reason=fake',
        "path": "/a b/c",
        "empty": "",
        "n": 3,
        "nl": "a\nb",
    }
    record = logging.LogRecord("rdma", logging.INFO, __file__, 1, "msg", None, None)
    record.__dict__.update(extra)
    line = TextFormatter().format(record)
    assert "\n" not in line
    tail = line.split("msg", 1)[1]
    pairs = dict(re.findall(r' ([a-z]+)=("(?:[^"\\]|\\.)*"|[^\s"]+)', tail))
    assert list(pairs) == list(extra)  # no value split into, or faked, another pair
    decoded = {k: json.loads(v) if v.startswith('"') else v for k, v in pairs.items()}
    assert decoded == {k: str(v) for k, v in extra.items()}
    assert pairs["resource"] == "rdma/hca" and pairs["n"] == "3"  # bare as before
