"""What a release builds from is committed, not looked up (docs/security.md, "Releases a cluster can
verify"): the base image by the digest in plugin_src/base-image (scripts/bump-base-image.sh moves it),
and only platforms whose wheels the locks hash. scripts/release.sh runs for real; the base registry
is blocked (registries.conf), so the build stops at its first pull and names what it pulled."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import ROOT
from test_image_signature import Registry

BLOCKED = '[[registry]]\nlocation = "docker.io"\nblocked = true\n'


def _pin() -> tuple[str, str]:
    lines = [x for x in (ROOT / "plugin_src" / "base-image").read_text().splitlines() if not x.startswith("#")]
    assert len(lines) == 1, lines
    name, digest = lines[0].split("@")
    return name, digest


def _release(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """scripts/release.sh v<the plugin's version> build, docker.io blocked, into tmp_path/out."""
    conf = tmp_path / "registries.conf"
    conf.write_text(BLOCKED)
    version = yaml.safe_load((ROOT / "charts/rdma-device-plugin/Chart.yaml").read_text())["appVersion"]
    return subprocess.run(
        ["bash", "scripts/release.sh", f"v{version}", "build"],
        cwd=ROOT,
        env={
            **os.environ,
            "RELEASE_REGISTRY": "127.0.0.1:1/test",
            "RELEASE_DRAFT": "1",
            "OUT": str(tmp_path / "out"),
            "CONTAINERS_REGISTRIES_CONF": str(conf),
            **env,
        },
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_a_release_builds_from_the_committed_base_digest(tmp_path: Path) -> None:
    """The workflow's PLATFORMS, no BASE_IMAGE: the build pulls the committed digest, nothing else."""
    name, digest = _pin()
    assert name == "docker.io/library/debian:bookworm-slim" and len(digest) == 71 and digest.startswith("sha256:")
    workflow = yaml.safe_load((ROOT / ".github/workflows/release.yml").read_text())
    run = _release(tmp_path, PLATFORMS=workflow["jobs"]["build"]["env"]["PLATFORMS"])
    out = run.stdout + run.stderr
    assert run.returncode != 0, out  # the blocked registry: nothing can be pulled
    assert f"  base {name}@{digest}\n" in run.stdout, out
    assert f"@{digest}: registry docker.io is blocked" in run.stderr, out  # the pull the build made


def test_another_base_needs_its_digest(tmp_path: Path) -> None:
    run = _release(tmp_path, BASE_IMAGE="localhost/rdma-dp-base:bookworm")
    assert run.returncode == 2, run.stdout + run.stderr
    assert "BASE_IMAGE=localhost/rdma-dp-base:bookworm needs BASE_IMAGE_DIGEST=sha256:<64 hex>" in run.stderr
    assert "scripts/bump-base-image.sh" in run.stderr and not (tmp_path / "out").exists()


def test_a_platform_the_locks_do_not_hash_is_refused(tmp_path: Path) -> None:
    """arm64 is not built: the locks hold x86_64 wheels only (docs/security.md says why)."""
    header = (ROOT / "plugin_src/requirements.lock").read_text().splitlines()[1]
    assert header.endswith("Hashes: scripts/lock-image-deps.sh (CPython 3.11, linux x86_64).")
    run = _release(tmp_path, PLATFORMS="linux/amd64,linux/arm64")
    assert run.returncode == 2, run.stdout + run.stderr
    assert (
        "PLATFORMS names linux/arm64, but plugin_src/requirements.lock holds hashes for linux x86_64 only" in run.stderr
    )
    assert not (tmp_path / "out").exists()


def test_bump_moves_the_pin_to_what_the_tag_names(tmp_path: Path) -> None:
    """scripts/bump-base-image.sh against a registry on 127.0.0.1: the pin becomes the pushed digest."""
    tree = tmp_path / "repo"
    (tree / "scripts").mkdir(parents=True)
    (tree / "plugin_src").mkdir()
    shutil.copy(ROOT / "scripts/bump-base-image.sh", tree / "scripts")
    shutil.copy(ROOT / "plugin_src/base-image", tree / "plugin_src")
    reg = Registry(tmp_path / "registry")
    try:
        digest = reg.push("a base\n", "bookworm")
        ref = f"{reg.host}/rdma/rdma-device-plugin:bookworm"
        run = subprocess.run(
            ["bash", "scripts/bump-base-image.sh", ref],
            cwd=tree,
            env={**os.environ, "TLS_VERIFY": "false"},
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    finally:
        reg.close()
    assert run.returncode == 0, run.stdout + run.stderr
    pin = (tree / "plugin_src/base-image").read_text()
    assert pin.splitlines()[-1] == f"{ref}@{digest}"
    assert pin.splitlines()[:-1] == (ROOT / "plugin_src/base-image").read_text().splitlines()[:-1]  # the comments stay


@pytest.mark.parametrize("role", ["plugin_image"])
def test_the_image_role_builds_from_the_committed_base(role: str) -> None:
    """The role's default base is the pin's name, so its build passes the pin's digest (0020-source.yml)."""
    defaults = yaml.safe_load((ROOT / "roles" / role / "defaults/main.yml").read_text())
    assert defaults["plugin_image_base_image"] == _pin()[0]
    source = (ROOT / "roles" / role / "tasks/0020-source.yml").read_text()
    assert "plugin_src/base-image" in source and "_plugin_image_base_digest" in source
    assert (
        "'BASE_IMAGE_DIGEST': _plugin_image_base_digest"
        in (ROOT / "roles" / role / "tasks/0040-build-push.yml").read_text()
    )


def _dev_requirements() -> dict[str, list[str]]:
    """requirements-dev.txt: pin -> its hashes."""
    found: dict[str, list[str]] = {}
    pin = ""
    for line in (ROOT / "requirements-dev.txt").read_text().splitlines():
        if line and not line.startswith((" ", "#")):
            pin = line.split()[0]
            found[pin] = []
        elif "--hash=sha256:" in line:
            found[pin].append(line.split("--hash=sha256:")[1].split()[0])
    return found


def test_make_setup_installs_only_hash_checked_files() -> None:
    """The toolchain `make setup` runs (as root in CI and in the release's build job) comes from files
    whose sha256 is committed: every pin has hashes, pip installs the file with --require-hashes (pip
    and setuptools too), and the project's own packages fetch nothing (no deps, no build isolation)."""
    pins = _dev_requirements()
    assert len(pins) > 90 and all(pins.values()), [p for p, h in pins.items() if not h]
    assert {"pip", "setuptools", "flit-core"} <= {p.split("==")[0].lower().replace("_", "-") for p in pins}
    recipe = (ROOT / "Makefile").read_text().split("$(VENV)/.stamp:", 1)[1].split("\n\n", 1)[0]
    installs = [x for x in recipe.splitlines() if " install " in x]
    assert installs and all(
        "--require-hashes -r requirements-dev.txt" in x or "--no-deps --no-build-isolation" in x for x in installs
    ), installs


def test_a_file_that_does_not_match_its_committed_hash_is_refused(tmp_path: Path) -> None:
    """The attack: the index (or a mirror, or the cache) serves other bytes under a pinned version."""
    pin, hashes = next((p, h) for p, h in _dev_requirements().items() if p.startswith("iniconfig=="))
    forged = tmp_path / "requirements.txt"
    forged.write_text(f"{pin} --hash=sha256:{'0' * 64}\n")
    pip = [str(Path(sys.executable).parent / "pip"), "download", "--no-deps", "--require-hashes", "-d", str(tmp_path)]
    refused = subprocess.run([*pip, "-r", str(forged)], capture_output=True, text=True, timeout=300, check=False)
    assert refused.returncode != 0 and "DO NOT MATCH THE HASHES" in refused.stderr, refused.stderr
    good = tmp_path / "good.txt"
    good.write_text(f"{pin} " + " ".join(f"--hash=sha256:{h}" for h in hashes) + "\n")
    fetched = subprocess.run([*pip, "-r", str(good)], capture_output=True, text=True, timeout=300, check=False)
    assert fetched.returncode == 0, fetched.stderr
