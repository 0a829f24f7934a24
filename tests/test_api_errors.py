"""A Kubernetes API the controller cannot use fails at once with the server's address, what happened
and the fix naming rdma_kubeconfig (module_utils/rdma_k8s), through every cluster module and the
playbooks that call them. The servers are real sockets on 127.0.0.1 started here: a port that
refuses connections, a TLS server whose self-signed certificate the kubeconfig's CA did not sign,
and a server that accepts connections and never answers (which used to hang the play: urllib3's
three retries of a read without a timeout)."""

from __future__ import annotations

import base64
import datetime
import ipaddress
import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from conftest import BIN, ROOT, ansible_env, run_playbook
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

sys.path.insert(0, str(ROOT / "scripts"))
from kube_cluster import Cluster

pytest.register_assert_rewrite("kube_pytest")
from kube_pytest import wait_for  # noqa: E402

pytest_plugins = ["kube_pytest"]

# Far below the default (30 s), so that a test of a server that never answers is quick.
TIMEOUT = "3"
IMAGE = "rdma_plugin_image_repository=127.0.0.1:5000/rdma/rdma-device-plugin"


def _self_signed(tmp_path: Path, name: str) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 (its own CA) and its key, as PEM files."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = tmp_path / f"{name}.crt", tmp_path / f"{name}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return cert_path, key_path


def _kubeconfig(path: Path, port: int, ca: Path) -> Path:
    """A kubeconfig for https://127.0.0.1:<port> trusting ``ca``, with a token user."""
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [
                    {
                        "name": "c",
                        "cluster": {
                            "server": f"https://127.0.0.1:{port}",
                            "certificate-authority-data": base64.b64encode(ca.read_bytes()).decode(),
                        },
                    }
                ],
                "users": [{"name": "u", "user": {"token": "t"}}],
                "contexts": [{"name": "ctx", "context": {"cluster": "c", "user": "u"}}],
                "current-context": "ctx",
            }
        )
    )
    return path


class Servers:
    """The three broken API servers, each on its own port of 127.0.0.1."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp = tmp_path
        self.ca, _ = _self_signed(tmp_path, "kubeconfig-ca")  # what the kubeconfig trusts
        self.cert, self.key = _self_signed(tmp_path, "server")  # what the TLS server shows
        self._sockets: list[socket.socket] = []
        self._stop = threading.Event()
        self.ports: dict[str, int] = {}
        self.tls_handshakes = 0

        # refused: the port is bound (nobody else can take it) but nothing listens
        closed = self._socket()
        self.ports["refused"] = closed.getsockname()[1]

        # silent: accepts every connection and never reads or writes
        silent = self._socket()
        silent.listen(16)
        self.ports["silent"] = silent.getsockname()[1]
        threading.Thread(target=self._hold, args=(silent,), daemon=True).start()

        # tls: a real TLS server with a certificate the kubeconfig's CA did not sign
        tls = self._socket()
        tls.listen(16)
        self.ports["tls"] = tls.getsockname()[1]
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(self.cert, self.key)
        threading.Thread(target=self._serve_tls, args=(tls, context), daemon=True).start()

    def _socket(self) -> socket.socket:
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        self._sockets.append(s)
        return s

    def _hold(self, server: socket.socket) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                return
            self._sockets.append(conn)  # kept open, never answered

    def _serve_tls(self, server: socket.socket, context: ssl.SSLContext) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                return
            try:
                with context.wrap_socket(conn, server_side=True) as tls:
                    tls.recv(1)
            except (ssl.SSLError, OSError):
                self.tls_handshakes += 1  # the client refused the certificate

    def kubeconfig(self, kind: str) -> Path:
        return _kubeconfig(self.tmp / f"kubeconfig-{kind}", self.ports[kind], self.ca)

    def close(self) -> None:
        self._stop.set()
        for s in self._sockets:
            s.close()


@pytest.fixture
def servers(tmp_path: Path) -> Iterator[Servers]:
    s = Servers(tmp_path)
    try:
        yield s
    finally:
        s.close()


# What each failure says: its own words, then the fix with the variable to change.
EXPECTED = {
    "refused": [
        "cannot reach the Kubernetes API at https://127.0.0.1:{port}: connection refused",
        "Fix: start the cluster, or set rdma_kubeconfig",
    ],
    "tls": [
        "the Kubernetes API at https://127.0.0.1:{port} failed the TLS check: certificate verify failed",
        "Fix: set rdma_kubeconfig (and rdma_kube_context) to this cluster's own kubeconfig",
    ],
    "silent": [
        "the Kubernetes API at https://127.0.0.1:{port} did not answer within rdma_kube_request_timeout=3s",
        "or raise rdma_kube_request_timeout",
    ],
}


def _flat(text: str) -> str:
    return " ".join(text.split())


def _module(module: str, args: dict[str, object]) -> dict[str, object]:
    run = subprocess.run(
        [str(BIN / "ansible"), "localhost", "-c", "local", "-m", f"lingjun.rdma.{module}", "-a", json.dumps(args),
         "-e", f"ansible_python_interpreter={BIN / 'python'}"],
        cwd=ROOT, env={**ansible_env(), "ANSIBLE_STDOUT_CALLBACK": "json", "ANSIBLE_LOAD_CALLBACK_PLUGINS": "1"},
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    result: dict[str, object] = json.loads(run.stdout)["plays"][0]["tasks"][0]["hosts"]["localhost"]
    return result


@pytest.mark.parametrize("kind", ["refused", "tls", "silent"])
@pytest.mark.parametrize(
    "module,args",
    [
        ("rdma_cluster_info", {}),
        ("rdma_cluster_nodes", {"daemonset_namespace": "kube-system"}),
        ("rdma_node_labels", {"nodes": {"gpu-1": {"labels": {"a": "b"}}}}),
        ("rdma_mode_switch", {"node": "gpu-1", "to": "exclusive", "nics": 4}),
        ("rdma_dra_preflight", {"resource_names": ["rdma/hca"]}),
    ],
)
def test_every_cluster_module_names_the_server_and_the_fix(
    servers: Servers, kind: str, module: str, args: dict[str, object]
) -> None:
    kubeconfig = servers.kubeconfig(kind)
    result = _module(module, {**args, "kubeconfig": str(kubeconfig), "request_timeout": float(TIMEOUT)})
    msg = _flat(str(result.get("msg")))
    assert result.get("failed"), result
    for text in EXPECTED[kind]:
        assert text.format(port=servers.ports[kind]) in msg, msg
    assert f"rdma_kubeconfig={kubeconfig}" in msg, msg  # which kubeconfig was used
    assert "Traceback" not in msg and "HTTPSConnectionPool" not in msg, msg


def _inventory(tmp_path: Path, kubeconfig: Path) -> Path:
    """One node host (never contacted: the controller play fails first) and the cluster target."""
    path = tmp_path / "prod" / "hosts.yml"
    path.parent.mkdir(exist_ok=True)
    nodes = {"gpu-1": {"ansible_host": "127.0.0.1", "ansible_port": 1, "ansible_connection": "ssh"}}
    path.write_text(
        yaml.safe_dump(
            {"all": {"vars": {"rdma_kubeconfig": str(kubeconfig)}, "children": {"rdma_nodes": {"hosts": nodes}}}}
        )
    )
    return path


@pytest.mark.parametrize(
    "playbook,kind,extra",
    [
        ("verify.yml", "refused", []),
        ("verify.yml", "silent", []),
        ("uninstall.yml", "refused", ["-e", "plugin_deploy_helm_binary=true"]),  # before helm: nothing is removed
        ("uninstall.yml", "tls", ["-e", "plugin_uninstall_release=false"]),
        ("deploy.yml", "silent", ["-e", "plugin_deploy_helm_binary=true", "-e", IMAGE]),  # before helm, never run
    ],
)
def test_playbooks_pass_the_message_through(
    tmp_path: Path, servers: Servers, playbook: str, kind: str, extra: list[str]
) -> None:
    inventory = _inventory(tmp_path, servers.kubeconfig(kind))
    result = run_playbook(
        f"playbooks/{playbook}", "-i", str(inventory), "-e", f"rdma_kube_request_timeout={TIMEOUT}", *extra, timeout=300
    )
    out = _flat(result.stdout + result.stderr)
    assert result.returncode == 2, out[-3000:]
    for text in EXPECTED[kind]:
        assert text.format(port=servers.ports[kind]) in out, out[-3000:]
    assert "HTTPSConnectionPool" not in out and "reading the nodes failed" not in out, out[-3000:]
    assert "unreachable=1" not in out  # the node was never contacted


def test_one_request_timeout_default() -> None:
    """The role variable, the modules' option and its documentation say the same number."""
    from ansible_collections.lingjun.rdma.plugins.doc_fragments.rdma_k8s import ModuleDocFragment
    from ansible_collections.lingjun.rdma.plugins.module_utils.rdma_k8s import CONNECTION_ARGS, REQUEST_TIMEOUT

    defaults = yaml.safe_load((ROOT / "roles/rdma_node_facts/defaults/main.yml").read_text())
    spec = yaml.safe_load((ROOT / "roles/rdma_node_facts/meta/argument_specs.yml").read_text())
    option = spec["argument_specs"]["main"]["options"]["rdma_kube_request_timeout"]
    doc = yaml.safe_load(ModuleDocFragment.DOCUMENTATION)["options"]["request_timeout"]
    assert defaults["rdma_kube_request_timeout"] == option["default"] == doc["default"] == REQUEST_TIMEOUT
    assert CONNECTION_ARGS["request_timeout"]["default"] == REQUEST_TIMEOUT


def _api_ready(cluster: Cluster) -> bool:
    try:
        with urllib.request.urlopen(cluster.server() + "/readyz", context=cluster.ssl_context(), timeout=5) as r:
            return bool(r.status == 200)
    except OSError:
        return False


def test_real_kube_apiserver(kube_cluster: Cluster, tmp_path: Path) -> None:
    """The same three outcomes against kube-apiserver v1.37.2 (scripts/kube_cluster.py): its own kubeconfig
    answers within the timeout (no false failure); the kubeconfig with another CA fails the TLS check of
    the real server's certificate; the server stopped (SIGSTOP: the kernel still accepts connections into
    its listen backlog, nothing answers the TLS hello) fails within rdma_kube_request_timeout."""
    good = kube_cluster.kubeconfig
    server = kube_cluster.server()
    other_ca, _ = _self_signed(tmp_path, "other-ca")
    config = yaml.safe_load(good.read_text())
    config["clusters"][0]["cluster"]["certificate-authority"] = str(other_ca)
    foreign = tmp_path / "kubeconfig-other-ca"
    foreign.write_text(yaml.safe_dump(config))
    timeout = {"request_timeout": float(TIMEOUT)}

    info = _module("rdma_cluster_info", {"kubeconfig": str(good), **timeout})
    assert not info.get("failed") and info["version"] == "v1.37.2" and info["server"] == server, info
    nodes = _module("rdma_cluster_nodes", {"daemonset_namespace": "kube-system", "kubeconfig": str(good), **timeout})
    assert not nodes.get("failed"), nodes

    modules = (("rdma_cluster_info", {}), ("rdma_cluster_nodes", {"daemonset_namespace": "kube-system"}))
    tls_said = f"the Kubernetes API at {server} failed the TLS check: certificate verify failed"
    for module, args in modules:
        result = _module(module, {**args, "kubeconfig": str(foreign), **timeout})
        msg = _flat(str(result.get("msg")))
        assert result.get("failed") and tls_said in msg, msg
        assert f"rdma_kubeconfig={foreign}" in msg and "Traceback" not in msg, msg

    pid = int(kube_cluster.state()["processes"]["kube-apiserver"]["pid"])  # type: ignore[index]
    os.kill(pid, signal.SIGSTOP)
    try:
        for module, args in modules:
            result = _module(module, {**args, "kubeconfig": str(good), **timeout})
            msg = _flat(str(result.get("msg")))
            assert result.get("failed"), result
            assert f"the Kubernetes API at {server} did not answer within rdma_kube_request_timeout=3s" in msg, msg
    finally:
        os.kill(pid, signal.SIGCONT)
    assert wait_for(lambda: _api_ready(kube_cluster), timeout=120), "kube-apiserver did not come back after SIGCONT"
