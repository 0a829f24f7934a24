"""The image's runtime pins agree with the development pins (one version of each dependency)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _pins(path: Path) -> dict[str, str]:
    pins = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        if "==" in line and not line.startswith("#"):
            name, version = line.split("==", 1)
            pins[name.strip().lower().replace("_", "-")] = version.strip()
    return pins


def test_image_lock_matches_dev_requirements() -> None:
    lock = _pins(ROOT / "plugin_src" / "requirements.lock")
    dev = _pins(ROOT / "requirements-dev.txt")
    assert {"grpcio", "protobuf", "pyyaml", "pydantic", "prometheus-client"} <= set(lock)
    assert {name: dev.get(name) for name in lock} == lock
