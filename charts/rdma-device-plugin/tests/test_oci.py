"""The chart as an OCI artifact, round trip: the plugin_image role's publisher packages it with the
real Helm engine and pushes it with oras (Helm's media types) to a real registry (Debian's
docker-registry on 127.0.0.1, a free port, its own data dir); the real Helm engine pulls it back
from oci://127.0.0.1:PORT/charts/rdma-device-plugin:VERSION (the deploy role's resolver) and it
renders exactly as the chart directory does. Helm's own push of the same archive is the oracle for
the manifest's media types."""

from __future__ import annotations

import importlib
import json
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import helm_python
import pytest
import yaml
from conftest import CHART_DIR, render_raw

ROOT = CHART_DIR.parents[1]
VERSION = yaml.safe_load((CHART_DIR / "Chart.yaml").read_text(encoding="utf-8"))["version"]


def _load(name: str) -> ModuleType:
    """A module of the repository's lingjun.rdma collection, imported as Ansible imports it."""
    if str(ROOT / "collections") not in sys.path:
        sys.path.insert(0, str(ROOT / "collections"))
    return importlib.import_module(f"ansible_collections.lingjun.rdma.plugins.modules.{name}")


PUBLISH = _load("rdma_chart_publish")
PULL = _load("rdma_chart_pull")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def registry() -> Iterator[str]:
    binary = shutil.which("docker-registry")
    if binary is None:
        pytest.fail("docker-registry is missing: make system-deps (Debian package docker-registry)")
    tmp = Path(tempfile.mkdtemp(prefix="rdp-oci-", dir="/tmp"))
    address = f"127.0.0.1:{_free_port()}"
    config = {"version": 0.1, "log": {"level": "warn"}, "storage": {"filesystem": {"rootdirectory": str(tmp / "data")}},
              "http": {"addr": address}}
    (tmp / "config.yml").write_text(yaml.safe_dump(config), encoding="utf-8")
    log = open(tmp / "registry.log", "w", encoding="utf-8")  # noqa: SIM115 - closed below
    proc = subprocess.Popen([binary, "serve", str(tmp / "config.yml")], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"http://{address}/v2/", timeout=2):
                    break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"docker-registry did not start: {(tmp / 'registry.log').read_text()}")
                time.sleep(0.2)
        yield address
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        shutil.rmtree(tmp, ignore_errors=True)


def _publish(registry: str, chart: Path, workdir: Path, repository: str = "charts") -> dict[str, Any]:
    """What the module's main does, step by step: package, compare, push."""
    tgz, metadata = PUBLISH.package(str(chart), str(workdir))
    digest = PUBLISH.content_hash(tgz)
    target = f"{registry}/{repository}/{metadata['name']}:{metadata['version'].replace('+', '_')}"
    client = PUBLISH.client(registry, False, "", "")
    held = PUBLISH.published_hash(client, target)
    pushed = "" if held else PUBLISH.push(client, target, tgz, metadata, digest, str(workdir))
    return {"target": target, "held": held, "hash": digest, "digest": pushed, "client": client, "tgz": tgz}


def test_publish_pull_and_render_from_oci(registry: str, tmp_path: Path) -> None:
    first = _publish(registry, CHART_DIR, tmp_path)
    assert first["held"] == "" and first["digest"].startswith("sha256:")
    # the manifest as Helm writes it: config and layer media types, the OCI annotations from Chart.yaml
    manifest = first["client"].get_manifest(first["target"])
    assert manifest["config"]["mediaType"] == "application/vnd.cncf.helm.config.v1+json"
    assert [layer["mediaType"] for layer in manifest["layers"]] == ["application/vnd.cncf.helm.chart.content.v1.tar+gzip"]
    ann = manifest["annotations"]
    assert ann["org.opencontainers.image.title"] == "rdma-device-plugin" and ann["org.opencontainers.image.version"] == VERSION
    assert ann["org.opencontainers.image.source"].startswith("https://") and "artifacthub.io/changes" in ann
    # Helm's own push of the same archive: the same media types
    helm_python.push(first["tgz"], f"oci://{registry}/helm-pushed", plain_http=True)
    oracle = first["client"].get_manifest(f"{registry}/helm-pushed/rdma-device-plugin:{VERSION}")
    assert oracle["config"]["mediaType"] == manifest["config"]["mediaType"]
    assert [la["mediaType"] for la in oracle["layers"]] == [la["mediaType"] for la in manifest["layers"]]
    assert {k for k in oracle["annotations"] if k.startswith("org.opencontainers")} <= set(ann)

    # pulled back by the real Helm engine through the deploy role's resolver, and rendered
    ref = f"oci://{registry}/charts/rdma-device-plugin:{VERSION}"
    cache = tmp_path / "cache"
    chart_dir, pulled = PULL.pull(ref, str(cache), True)
    assert pulled and Path(chart_dir, "Chart.yaml").is_file()
    assert PULL.pull(ref, str(cache), True) == (chart_dir, False)  # cached: not pulled again
    assert not Path(chart_dir, "tests").exists() and Path(chart_dir, "files", "dashboards", "rdma-device-plugin.json").is_file()
    # a named serving certificate: the one the chart would make differs at every render
    metrics = {"enabled": True, "auth": {"tlsSecretName": "metrics-tls"}, "prometheusRule": {"enabled": True}, "dashboard": {"enabled": True}}
    values = {"metrics": metrics, "mode": "exclusive"}
    from_oci = render_raw(values, chart=helm_python.Chart.load(chart_dir))
    from_dir = render_raw(values)
    assert from_oci == from_dir
    assert "kind: PrometheusRule" in from_oci["rdma-device-plugin/templates/prometheusrule.yaml"]


def test_publishing_again_is_a_no_op_and_a_changed_chart_needs_a_new_version(registry: str, tmp_path: Path) -> None:
    first = _publish(registry, CHART_DIR, tmp_path / "a", repository="again")
    again = _publish(registry, CHART_DIR, tmp_path / "b", repository="again")
    # helm package stamps the time into the archive; the content hash does not change
    assert again["held"] == first["hash"] == again["hash"] and again["digest"] == ""
    changed = tmp_path / "chart"
    shutil.copytree(CHART_DIR, changed, ignore=shutil.ignore_patterns("tests", "__pycache__"))
    notes = changed / "templates" / "NOTES.txt"
    notes.write_text(notes.read_text(encoding="utf-8") + "\nchanged\n", encoding="utf-8")
    third = _publish(registry, changed, tmp_path / "c", repository="again")
    # the module refuses this (the same version with other content): see main()
    assert third["held"] == first["hash"] != third["hash"] and third["digest"] == ""


def test_resolver_keeps_a_directory_and_parses_references() -> None:
    assert PULL.parse("oci://127.0.0.1:5000/charts/rdma-device-plugin:1.0.0") == ("127.0.0.1:5000", "charts", "rdma-device-plugin", "1.0.0")
    assert PULL.parse("oci://registry.example.com/a/b/rdma-device-plugin") == ("registry.example.com", "a/b", "rdma-device-plugin", None)
    assert PULL.parse("charts/rdma-device-plugin") is None
    assert PULL.LOOPBACK.match("127.0.0.1:5000") and PULL.LOOPBACK.match("localhost") and not PULL.LOOPBACK.match("registry.corp:5000")
    assert json.loads(json.dumps(PUBLISH.manifest_annotations({"name": "x", "version": "1.0.0"}, "h")))[
        PUBLISH.CONTENT_HASH_ANNOTATION] == "h"
