"""The image's dependency locks: one version of each dependency (the development pins), every
requirement hash-pinned for pip --require-hashes, and the Dockerfile actually enforcing it."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "plugin_src"
# pip's hash-checking requirement line: NAME==VERSION followed by one or more --hash=sha256:<64 hex>.
LOCK_LINE = re.compile(r"^([A-Za-z0-9_.-]+)==([^\s\\]+)((?:\s*\\\s*--hash=sha256:[0-9a-f]{64})+)\s*$")


def _pins(path: Path) -> dict[str, str]:
    pins = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        if "==" in line and not line.startswith("#"):
            name, version = line.split("==", 1)
            pins[name.strip().lower().replace("_", "-")] = version.split()[0]
    return pins


def _locked(path: Path) -> dict[str, str]:
    """name -> version of a hash lock; fails on any requirement without a hash."""
    text = re.sub(r"^#.*\n", "", path.read_text(encoding="utf-8"), flags=re.M)
    entries = [e for e in re.split(r"\n(?=\S)", text.strip()) if e]
    locked = {}
    for entry in entries:
        m = LOCK_LINE.match(entry.replace("\n", " "))
        assert m, f"{path.name}: not NAME==VERSION with --hash=sha256:...: {entry!r}"
        locked[m.group(1).lower().replace("_", "-")] = m.group(2)
    return locked


def test_image_lock_matches_dev_requirements() -> None:
    lock = _pins(SRC / "requirements.lock")
    dev = _pins(ROOT / "requirements-dev.txt")
    assert {"grpcio", "protobuf", "pyyaml", "pydantic", "prometheus-client"} <= set(lock)
    assert {name: dev.get(name) for name in lock} == lock


def test_locks_are_hash_pinned() -> None:
    assert _locked(SRC / "requirements.lock") == _pins(SRC / "requirements.lock")
    build = _locked(SRC / "requirements-build.lock")
    assert set(build) == {"setuptools"}  # the wheel build's backend, nothing floating


def test_dockerfile_installs_with_require_hashes_and_pins_the_base() -> None:
    dockerfile = (SRC / "Dockerfile").read_text(encoding="utf-8")
    pip_installs = re.findall(r"pip install [^\n]*", dockerfile)
    assert any("--require-hashes" in c and "-r requirements.lock" in c for c in pip_installs)
    assert any("--require-hashes" in c and "-r requirements-build.lock" in c for c in pip_installs)
    # no other dependency install may bypass the locks: the plugin's own wheel goes in without deps or index
    for cmd in pip_installs:
        assert "--require-hashes" in cmd or ("--no-deps" in cmd and "--no-index" in cmd), cmd
    # the wheel is built with the locked setuptools, not whatever build isolation downloads
    assert "--no-build-isolation" in dockerfile
    froms = re.findall(r"^FROM (\S+)", dockerfile, flags=re.M)
    assert froms and all(f == "${BASE_IMAGE}${BASE_IMAGE_DIGEST:+@}${BASE_IMAGE_DIGEST}" for f in froms), froms
    assert "/usr/share/rdma-device-plugin/sbom.txt" in dockerfile
    assert "org.opencontainers.image.base.digest" in dockerfile


def test_version_is_printed_on_stdout() -> None:
    """`--version` answers on stdout (scripts and the image check read it there), without a traceback."""
    import subprocess
    import sys

    from rdma_device_plugin import __version__

    result = subprocess.run(
        [sys.executable, "-m", "rdma_device_plugin", "--version"], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"rdma-device-plugin {__version__}\n"
    assert result.stderr == ""
