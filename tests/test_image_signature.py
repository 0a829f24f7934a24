"""The deploy role verifies the image's signature before it installs anything, and installs the digest
that verified; a chart from a registry is pulled by the digest it is pinned to (docs/security.md,
"Releases a cluster can verify"). Real components: images built with buildah and pushed to a
docker-registry on 127.0.0.1, signed in cosign's key-pair format by tools/imgsig (`make imgsig`), the
chart pushed there by the Helm v4 of `make kube`, and the release installed by that Helm into the
session's kube-apiserver v1.37.2 (scripts/kube_pytest.py)."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import ROOT, run_playbook

sys.path.insert(0, str(ROOT / "scripts"))
pytest.register_assert_rewrite("kube_pytest")
from kube_pytest import Kube  # noqa: E402

pytest_plugins = ["kube_pytest"]
pytestmark = pytest.mark.timeout(900)

IMGSIG = ROOT / ".cache" / "imgsig" / "bin" / "imgsig"
RELEASE = "sig"  # its own release name: the other tests' release "rdma" is not touched
REPO = "rdma/rdma-device-plugin"


def _run(*argv: str | Path) -> str:
    done = subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, f"{argv}: {done.stdout}{done.stderr}"
    return done.stdout.strip()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Registry:
    """A docker-registry on 127.0.0.1 with the test's images, pushed by buildah."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.host = f"127.0.0.1:{_free_port()}"
        (work / "data").mkdir(parents=True)
        (work / "config.yml").write_text(
            "version: 0.1\nlog:\n  level: warn\nstorage:\n  filesystem:\n"
            f"    rootdirectory: {work / 'data'}\nhttp:\n  addr: {self.host}\n"
        )
        exe = shutil.which("docker-registry")
        if not exe:
            pytest.fail("docker-registry is missing: run make system-deps (scripts/setup-system.sh) as root")
        self.proc = subprocess.Popen(
            [exe, "serve", str(work / "config.yml")],
            stdout=(work / "registry.log").open("wb"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", int(self.host.split(":")[1])), timeout=1).close()
                break
            except OSError:
                assert self.proc.poll() is None and time.monotonic() < deadline, (work / "registry.log").read_text()
                time.sleep(0.1)

    def push(self, content: str, tag: str) -> str:
        """A one-file image (its content makes its digest) pushed as REPO:tag; its digest."""
        bah = ["buildah", "--storage-driver", "vfs"]
        ctr = _run(*bah, "from", "scratch")
        try:
            (self.work / "file").write_text(content)
            _run(*bah, "copy", ctr, self.work / "file", "/content")
            _run(*bah, "commit", "--quiet", ctr, f"localhost/sigtest:{tag}")
        finally:
            _run(*bah, "rm", ctr)
        digestfile = self.work / "digest"
        _run(*bah, "push", "--quiet", "--tls-verify=false", "--digestfile", digestfile,
             f"localhost/sigtest:{tag}", f"docker://{self.host}/{REPO}:{tag}")  # fmt: skip
        _run(*bah, "rmi", f"localhost/sigtest:{tag}")
        return digestfile.read_text().strip()

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def signed() -> Iterator[dict[str, Any]]:
    """The registry, our key pair and another one, and the images: 'signed' (signed by our key),
    'unsigned', 'other' (signed by the other key), 'moved' (signed, then the tag pushed to another
    image); and the chart pushed by Helm with its digest."""
    if not IMGSIG.exists():
        pytest.fail(f"{IMGSIG} is missing: build it with make imgsig")
    work = Path(tempfile.mkdtemp(prefix="sig-", dir="/tmp"))
    reg = Registry(work / "registry")
    try:
        _run(IMGSIG, "generate-key-pair", work / "ours")
        _run(IMGSIG, "generate-key-pair", work / "other")
        digests = {tag: reg.push(f"image {tag}\n", tag) for tag in ("signed", "unsigned", "other", "moved")}
        _run(IMGSIG, "sign", "--key", work / "ours.key", f"{reg.host}/{REPO}:signed")
        _run(IMGSIG, "sign", "--key", work / "other.key", f"{reg.host}/{REPO}:other")
        _run(IMGSIG, "sign", "--key", work / "ours.key", f"{reg.host}/{REPO}:moved")
        moved_to = reg.push("image moved, after signing\n", "moved")
        yield {"work": work, "registry": reg, "digests": digests, "moved_to": moved_to}
    finally:
        reg.close()
        shutil.rmtree(work, ignore_errors=True)


def _deploy(
    kube: Kube, work: Path, tag: str, env: dict[str, str] | None = None, **vars: Any
) -> subprocess.CompletedProcess[str]:
    """playbooks/deploy.yml, cluster target, verifying with our key (one node host, never contacted)."""
    reg = work / "inventory.yml"
    group = {
        "rdma_kubeconfig": str(kube.cluster.kubeconfig),
        "rdma_output_dir": str(work / "out"),
        "rdma_release_name": RELEASE,
        "rdma_validation_required": False,
        "plugin_deploy_helm_binary": str(kube.bin / "helm"),
        "rdma_plugin_image_tag": tag,
        "plugin_deploy_image_verify_key": str(work / "ours.pub"),
        **vars,
    }
    nodes = {"gpu-1": {"ansible_host": "127.0.0.1", "ansible_port": 1, "ansible_connection": "ssh"}}
    reg.write_text(yaml.safe_dump({"all": {"vars": group, "children": {"rdma_nodes": {"hosts": nodes}}}}))
    return run_playbook("playbooks/deploy.yml", "-i", str(reg), **(env or {}))


def _revisions(kube: Kube) -> list[dict[str, Any]]:
    got = kube.helm("history", RELEASE, "-n", "kube-system", "-o", "json", check=False)
    return list(json.loads(got.stdout)) if got.returncode == 0 else []


@pytest.fixture(scope="module")
def deployed(signed: dict[str, Any], kube: Kube) -> Iterator[dict[str, Any]]:
    """The signed image deployed by its tag (the release installed once, for the refusals to leave alone)."""
    work, reg = signed["work"], signed["registry"]
    run = _deploy(kube, work, "signed", rdma_plugin_image_repository=f"{reg.host}/{REPO}")
    try:
        yield {**signed, "run": run}
    finally:
        kube.helm("uninstall", RELEASE, "-n", "kube-system", "--wait", "--timeout", "120s", check=False)


def _flat(run: subprocess.CompletedProcess[str]) -> str:
    return " ".join((run.stdout + run.stderr).split())


def test_a_signed_image_is_deployed_by_the_digest_that_verified(deployed: dict[str, Any], kube: Kube) -> None:
    assert deployed["run"].returncode == 0, _flat(deployed["run"])[-3000:]
    values = json.loads(kube.helm("get", "values", RELEASE, "-n", "kube-system", "-o", "json").stdout)
    assert values["image"]["digest"] == deployed["digests"]["signed"], values["image"]
    daemonsets = kube.get("daemonsets", "-n", "kube-system", "-l", f"app.kubernetes.io/instance={RELEASE}")["items"]
    images = {c["image"] for d in daemonsets for c in d["spec"]["template"]["spec"]["containers"]}
    assert images == {f"{deployed['registry'].host}/{REPO}@{deployed['digests']['signed']}"}


@pytest.mark.parametrize(
    "tag,why",
    [
        ("unsigned", "no signatures found"),
        ("other", "a signature does not verify with"),
        ("moved", "no signatures found"),  # the tag names the image pushed after signing
        # The image role's facts for a registry image it reused (its source-hash label matched, which
        # anyone with push access can set): the digest it hands over is verified like any other.
        ("reused", "no signatures found"),
    ],
)
def test_an_image_without_our_signature_is_refused_and_nothing_changes(
    deployed: dict[str, Any], kube: Kube, tag: str, why: str
) -> None:
    assert deployed["run"].returncode == 0, _flat(deployed["run"])[-3000:]
    before = _revisions(kube)
    reg, work = deployed["registry"], deployed["work"]
    repo = f"{reg.host}/{REPO}"
    if tag == "reused":
        digest = deployed["digests"]["unsigned"]
        ref = f"{repo}@{digest}"
        run = _deploy(kube, work, "", plugin_image_ref=f"{repo}:unsigned@{digest}", plugin_image_digest=digest)
    else:
        digest = deployed["moved_to"] if tag == "moved" else deployed["digests"][tag]
        ref = f"{repo}:{tag}"
        run = _deploy(kube, work, tag, rdma_plugin_image_repository=repo)
    out = _flat(run)
    assert run.returncode != 0, out[-3000:]
    assert f"The image {ref} has no signature that verifies with plugin_deploy_image_verify_key" in out, out[-3000:]
    assert why in out and digest in out, out[-3000:]
    assert f"check with: {IMGSIG.resolve()} verify --key {work / 'ours.pub'} {ref}" in out
    assert "Nothing was installed or rendered." in out
    assert _revisions(kube) == before  # no helm upgrade ran
    values = json.loads(kube.helm("get", "values", RELEASE, "-n", "kube-system", "-o", "json").stdout)
    assert values["image"]["digest"] == deployed["digests"]["signed"]


def test_a_verifier_that_cannot_run_stops_the_deploy(deployed: dict[str, Any], kube: Kube) -> None:
    before = _revisions(kube)
    reg, work = deployed["registry"], deployed["work"]
    run = _deploy(
        kube,
        work,
        "signed",
        rdma_plugin_image_repository=f"{reg.host}/{REPO}",
        plugin_deploy_image_verifier="/nonexistent/imgsig",
    )
    out = _flat(run)
    assert run.returncode != 0, out[-3000:]
    assert "The image verifier /nonexistent/imgsig cannot run (" in out and "build it with make imgsig" in out, out[
        -3000:
    ]
    assert "Nothing was installed or rendered." in out and _revisions(kube) == before


def _push_chart(helm: str, chart: Path, dest: Path, host: str) -> str:
    """helm package + helm push to oci://<host>/charts; the digest Helm prints."""
    _run(helm, "package", chart, "--destination", dest)
    pushed = subprocess.run(
        [helm, "push", *map(str, dest.glob("*.tgz")), f"oci://{host}/charts", "--plain-http"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return next(w for w in (pushed.stdout + pushed.stderr).split() if w.startswith("sha256:"))


def test_the_chart_is_pulled_by_its_pinned_digest(signed: dict[str, Any], kube: Kube, tmp_path: Path) -> None:
    """plugin_deploy_chart_path oci://... with plugin_deploy_chart_digest: the pinned chart renders; the
    same version published again with other content is refused naming the variable, nothing rendered."""
    reg = signed["registry"]
    helm = str(kube.bin / "helm")
    chart = tmp_path / "chart"
    shutil.copytree(ROOT / "charts" / "rdma-device-plugin", chart, ignore=shutil.ignore_patterns("tests"))
    digest = _push_chart(helm, chart, tmp_path / "pkg", reg.host)
    version = yaml.safe_load((chart / "Chart.yaml").read_text())["version"]
    ref = f"oci://{reg.host}/charts/rdma-device-plugin:{version}"
    common = {
        "plugin_deploy_render_only": True,
        "plugin_deploy_chart_path": ref,
        "plugin_deploy_manifests_dir": str(tmp_path / "manifests"),
        "rdma_plugin_image_repository": f"{reg.host}/{REPO}",
        "rdma_plugin_image_tag": "signed",
    }
    env = {"HOME": str(tmp_path)}  # the pulled charts' cache (~/.cache/rdma-device-plugin/charts) is the test's
    ok = _deploy(kube, signed["work"], "signed", env, **common, plugin_deploy_chart_digest=digest)
    assert ok.returncode == 0, _flat(ok)[-3000:]
    assert list((tmp_path / "manifests").rglob("*.yaml")), _flat(ok)[-3000:]

    # The same version again, other content: the registry's tag now names another digest.
    (chart / "templates" / "NOTES.txt").write_text((chart / "templates" / "NOTES.txt").read_text() + "\nrepublished\n")
    assert _push_chart(helm, chart, tmp_path / "pkg2", reg.host) != digest
    shutil.rmtree(tmp_path / "manifests")
    shutil.rmtree(tmp_path / ".cache", ignore_errors=True)
    bad = _deploy(kube, signed["work"], "signed", env, **common, plugin_deploy_chart_digest=digest)
    out = _flat(bad)
    assert bad.returncode != 0, out[-3000:]
    assert f"The chart {ref} in the registry is not the one plugin_deploy_chart_digest pins ({digest})" in out
    assert "digest mismatch" in out and "Nothing was rendered or installed." in out
    assert not (tmp_path / "manifests").exists()
