"""The image's dependency locks: one version of each dependency (the development pins), every
requirement hash-pinned for pip --require-hashes, and the Dockerfile actually enforcing it. The
distributions: the plugin and the node package (its one home the collection's module_utils) build
from plain sdists and wheels, and the test kubelets (rdma_kubesim) stay out of the image."""

from __future__ import annotations

import re
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
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
    assert set(build) == {"setuptools", "flit-core"}  # the wheels' backends (plugin, node package), nothing floating
    assert _pins(ROOT / "requirements-dev.txt")["flit-core"] == build["flit-core"]  # the tests build with it too


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


def test_dockerfile_builds_the_node_package_from_its_own_context_and_leaves_the_simulator_out() -> None:
    dockerfile = (SRC / "Dockerfile").read_text(encoding="utf-8")
    assert "COPY --from=rdma-node pyproject.toml ./node/" in dockerfile
    assert "pip wheel --quiet --no-deps --no-build-isolation --wheel-dir /wheels ./node ." in dockerfile
    # without the context, the stand-in stage says which one to pass
    assert re.search(r"^FROM \S+ AS rdma-node\nRUN echo .*--build-context rdma-node=", dockerfile, flags=re.M)
    ignored = (SRC / ".dockerignore").read_text(encoding="utf-8").splitlines()
    assert "kubesim" in ignored and "tests" in ignored
    assert not (SRC / "src" / "rdma_device_plugin" / "node").exists()  # no link into the collection
    assert not list((SRC / "src").glob("rdma_kubesim*"))


def _wheel(source: Path, out: Path) -> Path:
    """``pip wheel`` of a source tree or sdist, with the backends of this venv (no index)."""
    before = set(out.glob("*.whl"))
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "--no-index",
         "--wheel-dir", str(out), str(source)],
        check=True, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    [built] = set(out.glob("*.whl")) - before
    return built


def _sdist(project: Path, out: Path) -> Path:
    """The project's sdist (its PEP 517 backend, as `python -m build --sdist` calls it), unpacked."""
    code = (
        "import sys, tomllib, importlib; "
        "backend = tomllib.load(open('pyproject.toml', 'rb'))['build-system']['build-backend']; "
        "print(importlib.import_module(backend).build_sdist(sys.argv[1]))"
    )
    name = subprocess.run(
        [sys.executable, "-c", code, str(out)], cwd=project, check=True, capture_output=True, text=True, timeout=600
    ).stdout.split()[-1]
    with tarfile.open(out / name) as tar:
        tar.extractall(out / "unpacked", filter="data")
    return out / "unpacked" / name.removesuffix(".tar.gz")


def test_the_plugin_and_the_node_package_install_from_plain_sdists_and_wheels(tmp_path: Path) -> None:
    """Issue 30: the node package was reached through a symlink into the collection (a wheel from
    plugin_src alone, or a copy of it, had no node package). Now each distribution builds from its
    own sdist, and the installed wheels serve: the plugin's wheel holds only rdma_device_plugin,
    the node package's holds exactly the collection's files, the simulator is in neither."""
    node_home = ROOT / "plugins" / "module_utils"
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    node_sdist = _sdist(node_home, tmp_path / "node")
    plugin_sdist = _sdist(SRC, tmp_path / "plugin")
    node_whl, plugin_whl = _wheel(node_sdist, wheels), _wheel(plugin_sdist, wheels)
    with zipfile.ZipFile(node_whl) as whl:
        files = {n for n in whl.namelist() if not n.endswith("/") and ".dist-info/" not in n}
        assert files == {f"rdma_node/{p.name}" for p in (node_home / "rdma_node").glob("*.py")}
        assert all(whl.read(f) == (node_home / f).read_bytes() for f in files)
    with zipfile.ZipFile(plugin_whl) as whl:
        tops = {n.split("/")[0] for n in whl.namelist() if ".dist-info/" not in n}
        assert tops == {"rdma_device_plugin"}, tops
        metadata = whl.read(next(n for n in whl.namelist() if n.endswith(".dist-info/METADATA"))).decode()
        assert "Requires-Dist: lingjun-rdma-node" in metadata
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", "--target", str(target),
         str(node_whl), str(plugin_whl)],
        check=True, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    # -S: no site-packages and no .pth (this venv's editable installs); the dependencies by path only
    probe = (
        "import importlib.util as u, rdma_device_plugin.supervisor as s, rdma_node.sysfs as n; "
        "print(s.__file__, n.__file__, u.find_spec('rdma_kubesim'))"
    )
    deps = sysconfig.get_paths()["purelib"]
    out = subprocess.run(
        [sys.executable, "-S", "-c", probe], env={"PYTHONPATH": f"{target}:{deps}"},
        check=True, capture_output=True, text=True, timeout=120,
    ).stdout.split()  # fmt: skip
    assert out == [str(target / "rdma_device_plugin" / "supervisor.py"), str(target / "rdma_node" / "sysfs.py"), "None"]


def test_the_node_package_carries_the_collections_version() -> None:
    """Its code is the collection's (plugins/module_utils): one version for both."""
    import tomllib

    import yaml

    node = tomllib.loads((ROOT / "plugins" / "module_utils" / "pyproject.toml").read_text(encoding="utf-8"))
    galaxy = yaml.safe_load((ROOT / "galaxy.yml").read_text(encoding="utf-8"))
    assert node["project"]["version"] == galaxy["version"]
    assert "plugins/module_utils/pyproject.toml" in galaxy["build_ignore"]  # not shipped in the collection
