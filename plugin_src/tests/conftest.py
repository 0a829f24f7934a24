"""Shared fixtures: fixture nodes, the kubelet simulator, and a real ``serve`` process."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import yaml

from rdma_device_plugin.kubesim import KubeletSimulator
from rdma_device_plugin.node import fixtures


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A short temp dir: unix socket paths must stay under 108 bytes (pytest's tmp_path can exceed it)."""
    path = tempfile.mkdtemp(prefix="rdp-", dir="/tmp")
    yield Path(path)
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def node(short_tmp: Path) -> fixtures.FixtureNode:
    return fixtures.write_node(str(short_tmp / "node"), fixtures.lingjun_node(nics=4, bond=True))


@pytest.fixture
def dp_dir(short_tmp: Path) -> Path:
    d = short_tmp / "dp"
    d.mkdir()
    return d


@pytest.fixture
def sim(dp_dir: Path) -> Iterator[KubeletSimulator]:
    s = KubeletSimulator(str(dp_dir)).start()
    yield s
    s.stop()


class PluginProcess:
    """The real ``rdma-device-plugin serve`` running as a child process."""

    def __init__(self, proc: subprocess.Popen[str], log: Path) -> None:
        self.proc = proc
        self.log = log

    def output(self) -> str:
        return self.log.read_text(encoding="utf-8")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10.0) -> tuple[int, float]:
        start = time.monotonic()
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        rc = self.proc.wait(timeout=timeout)
        return rc, time.monotonic() - start


def serve_command(fx: fixtures.FixtureNode, dp_dir: Path, config: Path | None = None, *extra: str) -> list[str]:
    """The real ``rdma-device-plugin serve`` command line for a fixture node."""
    cmd = [sys.executable, "-m", "rdma_device_plugin", "serve", "--sysfs-root", fx.sysfs, "--dev-root", fx.dev]
    cmd += [
        "--procfs-root",
        fx.procfs,
        "--device-plugin-dir",
        str(dp_dir),
        "--health-file",
        str(dp_dir.parent / "health.json"),
    ]
    if config is not None:
        cmd += ["--config", str(config)]
    return cmd + list(extra)


@pytest.fixture
def start_plugin(short_tmp: Path, node: fixtures.FixtureNode, dp_dir: Path) -> Iterator[Callable[..., PluginProcess]]:
    procs: list[PluginProcess] = []

    def start(
        config: dict[str, object] | None = None,
        extra: list[str] | None = None,
        fixture: fixtures.FixtureNode | None = None,
        prefix: list[str] | None = None,
    ) -> PluginProcess:
        cfg = None
        if config is not None:
            cfg = short_tmp / f"config{len(procs)}.yaml"
            cfg.write_text(yaml.safe_dump(config), encoding="utf-8")
        cmd = (prefix or []) + serve_command(fixture or node, dp_dir, cfg, "--log-level", "debug", *(extra or []))
        log = short_tmp / f"plugin{len(procs)}.log"
        fh = open(log, "w", encoding="utf-8")  # noqa: SIM115 - closed with the process
        proc = subprocess.Popen(
            cmd, stdout=fh, stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"}
        )
        p = PluginProcess(proc, log)
        procs.append(p)
        return p

    yield start
    for p in procs:
        if p.proc.poll() is None:
            p.proc.kill()
            p.proc.wait()
