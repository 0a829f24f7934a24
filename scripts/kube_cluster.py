#!/usr/bin/env python3
"""A local Kubernetes control plane from upstream code: etcd, kube-apiserver,
kube-controller-manager and kube-scheduler, built by scripts/kube-build.sh from the versions pinned in
kube/go.mod, on 127.0.0.1 with certificates made on the fly and a free port each.

    kube_cluster.py up   [--dir out/cluster] [--audit-policy FILE]
                                               start it, write DIR/kubeconfig, wait until the API answers
                                               (with an audit policy: the API server's audit log in DIR/logs/audit.log)
    kube_cluster.py down [--dir out/cluster]   stop every process `up` started (also after a failed up)
    kube_cluster.py status [--dir out/cluster]

Nodes join with kubelet-managers (kube/cmd/kubelet-managers, `join` below) or as a real node: the
kubelet, containerd and runc (scripts/real_node.py, make node-up).
Importable: tests use :class:`Cluster` (``Cluster(dir).up()`` / ``.down()``) the same way.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import ipaddress
import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STATE = "state.json"
COMPONENTS = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler")
SERVICE_CIDR = "10.96.0.0/24"


class ClusterError(RuntimeError):
    """A start or stop that failed; the message says what to do next."""


def kube_bin() -> Path:
    """The directory scripts/kube-build.sh builds into (KUBE_BIN overrides)."""
    if os.environ.get("KUBE_BIN"):
        return Path(os.environ["KUBE_BIN"])
    out = subprocess.run(
        [str(ROOT / "scripts" / "kube-build.sh"), "--print-bin"], capture_output=True, text=True, check=False
    )
    if out.returncode != 0:
        raise ClusterError(f"cannot locate the Kubernetes binaries: {out.stderr.strip()}")
    return Path(out.stdout.strip())


def build() -> Path:
    """Build the components (seconds when up to date); progress goes to stdout."""
    rc = subprocess.run([str(ROOT / "scripts" / "kube-build.sh")], check=False).returncode
    if rc != 0:
        raise ClusterError("building the Kubernetes components failed (above); retry with: scripts/kube-build.sh")
    return kube_bin()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ---------------------------------------------------------------- certificates


def _certs(d: Path) -> None:
    """CA, API server serving cert, admin client cert, service-account key: PEM files in d."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    d.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)

    def key() -> ec.EllipticCurvePrivateKey:
        return ec.generate_private_key(ec.SECP256R1())

    def write_key(k: ec.EllipticCurvePrivateKey, name: str) -> None:
        (d / name).write_bytes(
            k.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
        )
        (d / name).chmod(0o600)

    def name(cn: str, org: str | None = None) -> x509.Name:
        attrs = [x509.NameAttribute(NameOID.COMMON_NAME, cn)]
        if org:
            attrs.append(x509.NameAttribute(NameOID.ORGANIZATION_NAME, org))
        return x509.Name(attrs)

    ca_key = key()
    ca = (
        x509.CertificateBuilder()
        .subject_name(name("local-kubernetes-ca"))
        .issuer_name(name("local-kubernetes-ca"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=365))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(True, False, False, False, False, True, True, False, False), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    write_key(ca_key, "ca.key")
    (d / "ca.crt").write_bytes(ca.public_bytes(serialization.Encoding.PEM))

    def leaf(fname: str, cn: str, org: str | None, server: bool) -> None:
        k = key()
        b = (
            x509.CertificateBuilder()
            .subject_name(name(cn, org))
            .issuer_name(ca.subject)
            .public_key(k.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=365))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        )
        if server:
            sans: list[x509.GeneralName] = [
                x509.DNSName(n) for n in ("localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc")
            ]
            sans += [x509.IPAddress(ipaddress.ip_address(a)) for a in ("127.0.0.1", "10.96.0.1")]
            b = b.add_extension(x509.SubjectAlternativeName(sans), critical=False)
            b = b.add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        else:
            b = b.add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        cert = b.sign(ca_key, hashes.SHA256())
        write_key(k, fname + ".key")
        (d / (fname + ".crt")).write_bytes(cert.public_bytes(serialization.Encoding.PEM))

    leaf("apiserver", "kube-apiserver", None, server=True)
    leaf("admin", "kubernetes-admin", "system:masters", server=False)
    # The API server's client certificate towards kubelets (logs, exec, port-forward), as kubeadm's
    # apiserver-kubelet-client: a real node's kubelet authorizes it by webhook (SubjectAccessReview).
    leaf("apiserver-kubelet-client", "kube-apiserver-kubelet-client", "system:masters", server=False)
    write_key(key(), "sa.key")
    sa = serialization.load_pem_private_key((d / "sa.key").read_bytes(), password=None)
    (d / "sa.pub").write_bytes(
        sa.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )


def kubeconfig(server: str, pki: Path, cert: Path | None = None, key: Path | None = None) -> str:
    """A kubeconfig for the cluster's CA with a client certificate: the admin's unless ``cert``/``key``
    name another (a kubelet's system:node: credential, say)."""
    return json.dumps(
        {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {"name": "local", "cluster": {"server": server, "certificate-authority": str(pki / "ca.crt")}}
            ],
            "users": [
                {
                    "name": "admin",
                    "user": {
                        "client-certificate": str(cert or pki / "admin.crt"),
                        "client-key": str(key or pki / "admin.key"),
                    },
                }
            ],
            "contexts": [{"name": "local", "context": {"cluster": "local", "user": "admin"}}],
            "current-context": "local",
        },
        indent=2,
    )


# ---------------------------------------------------------------- processes


def _alive(pid: int, exe: str) -> bool:
    """The process exists and runs the binary we started (a PID can be reused)."""
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()
    except OSError:
        return False
    return Path(cmd).name == Path(exe).name


def _stop(procs: dict[str, dict[str, object]], timeout: float = 15.0, order: list[str] | None = None) -> list[str]:
    """SIGTERM in reverse start order, each once the one before it has exited (kube-apiserver's
    shutdown hooks write to etcd: with etcd stopped beside it, they retried for 10 s), SIGKILL after
    timeout; the names of those still alive."""
    order = order if order is not None else [n for n in reversed(COMPONENTS) if n in procs]
    deadline = time.monotonic() + timeout
    for n in order:
        pid, exe = int(procs[n]["pid"]), str(procs[n]["exe"])  # type: ignore[call-overload]
        if _alive(pid, exe):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGTERM)
        while _alive(pid, exe) and time.monotonic() < deadline:
            _reap(pid)
            time.sleep(0.05)
        if _alive(pid, exe):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
    time.sleep(0.1)
    for n in order:
        _reap(int(procs[n]["pid"]))  # type: ignore[call-overload]
    return [n for n in order if _alive(int(procs[n]["pid"]), str(procs[n]["exe"]))]  # type: ignore[call-overload]


def _reap(pid: int) -> None:
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)


@dataclass
class Cluster:
    """One local control plane in ``dir`` (state.json records what runs)."""

    dir: Path
    bin: Path | None = None
    feature_gates: dict[str, bool] = field(default_factory=dict)
    ready_timeout: float = 180.0
    # kube-controller-manager's --controllers (e.g. "*,-daemonset,-nodelifecycle" for a cluster whose
    # nodes have no kubelet and whose statuses a bench writes itself)
    controllers: str = "*"
    # An audit policy (audit.k8s.io/v1 Policy): the API server records the requests it selects in
    # logs/audit.log (JSON lines, written before the response in its default blocking mode).
    audit_policy: Path | None = None

    @property
    def kubeconfig(self) -> Path:
        return self.dir / "kubeconfig"

    @property
    def state_file(self) -> Path:
        return self.dir / STATE

    def state(self) -> dict[str, object]:
        try:
            return dict(json.loads(self.state_file.read_text()))
        except (OSError, ValueError):
            return {}

    def server(self) -> str:
        return str(self.state().get("server", ""))

    def running(self) -> dict[str, bool]:
        procs = self.state().get("processes", {})
        assert isinstance(procs, dict)
        return {n: _alive(int(p["pid"]), str(p["exe"])) for n, p in procs.items()}

    # ------------------------------------------------------------ up

    def up(self) -> Cluster:
        if any(self.running().values()):
            raise ClusterError(f"a cluster already runs from {self.dir} (stop it: make cluster-down)")
        bin_dir = self.bin or kube_bin()
        for c in (*COMPONENTS, "kubectl"):
            if not (bin_dir / c).exists():
                raise ClusterError(f"{bin_dir / c} is missing: build the components first (scripts/kube-build.sh)")
        self.dir.mkdir(parents=True, exist_ok=True)
        pki, logs, data = self.dir / "pki", self.dir / "logs", self.dir / "etcd"
        for d in (logs,):
            d.mkdir(exist_ok=True)
        subprocess.run(["rm", "-rf", str(data), str(pki)], check=True)
        _certs(pki)
        ports = {"etcd": free_port(), "etcd-peer": free_port(), "apiserver": free_port()}
        server = f"https://127.0.0.1:{ports['apiserver']}"
        self.kubeconfig.write_text(kubeconfig(server, pki))
        gates = ",".join(f"{k}={str(v).lower()}" for k, v in sorted(self.feature_gates.items()))
        kc = str(self.kubeconfig)
        etcd_url = f"http://127.0.0.1:{ports['etcd']}"
        peer_url = f"http://127.0.0.1:{ports['etcd-peer']}"
        argv = {
            "etcd": [
                "--name=local",
                f"--data-dir={data}",
                f"--listen-client-urls={etcd_url}",
                f"--advertise-client-urls={etcd_url}",
                f"--listen-peer-urls={peer_url}",
                f"--initial-advertise-peer-urls={peer_url}",
                f"--initial-cluster=local={peer_url}",
                "--unsafe-no-fsync",
                "--log-level=warn",
                "--quota-backend-bytes=4294967296",
            ],
            "kube-apiserver": [
                f"--etcd-servers={etcd_url}",
                "--bind-address=127.0.0.1",
                "--advertise-address=127.0.0.1",
                f"--secure-port={ports['apiserver']}",
                f"--cert-dir={pki}",
                f"--tls-cert-file={pki / 'apiserver.crt'}",
                f"--tls-private-key-file={pki / 'apiserver.key'}",
                f"--client-ca-file={pki / 'ca.crt'}",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                "--service-account-issuer=https://kubernetes.default.svc",
                f"--service-account-key-file={pki / 'sa.pub'}",
                f"--service-account-signing-key-file={pki / 'sa.key'}",
                "--authorization-mode=Node,RBAC",
                # As kubeadm: a kubelet's credentials may write only its own Node and its pods' objects.
                "--enable-admission-plugins=NodeRestriction",
                f"--kubelet-client-certificate={pki / 'apiserver-kubelet-client.crt'}",
                f"--kubelet-client-key={pki / 'apiserver-kubelet-client.key'}",
                "--kubelet-preferred-address-types=InternalIP,Hostname",
                "--allow-privileged=true",
                # No kubernetes Service endpoints: the API server listens on loopback, which they refuse.
                "--endpoint-reconciler-type=none",
                "--enable-priority-and-fairness=false",
                "--profiling=false",
                "--v=1",
            ],
            "kube-controller-manager": [
                f"--kubeconfig={kc}",
                f"--authentication-kubeconfig={kc}",
                f"--authorization-kubeconfig={kc}",
                "--leader-elect=false",
                "--secure-port=0",
                "--use-service-account-credentials=true",
                f"--service-account-private-key-file={pki / 'sa.key'}",
                f"--root-ca-file={pki / 'ca.crt'}",
                f"--cluster-signing-cert-file={pki / 'ca.crt'}",
                f"--cluster-signing-key-file={pki / 'ca.key'}",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                f"--controllers={self.controllers}",
                "--v=1",
            ],
            "kube-scheduler": [
                f"--kubeconfig={kc}",
                f"--authentication-kubeconfig={kc}",
                f"--authorization-kubeconfig={kc}",
                "--leader-elect=false",
                "--secure-port=0",
                "--v=1",
            ],
        }
        if self.audit_policy:
            argv["kube-apiserver"] += [
                f"--audit-policy-file={self.audit_policy.resolve()}",
                f"--audit-log-path={logs / 'audit.log'}",
            ]
        if gates:
            for c in ("kube-apiserver", "kube-controller-manager", "kube-scheduler"):
                argv[c].append(f"--feature-gates={gates}")
        procs: dict[str, dict[str, object]] = {}
        state: dict[str, object] = {
            "server": server,
            "kubeconfig": kc,
            "ports": ports,
            "processes": procs,
            "bin": str(bin_dir),
            "started": time.time(),
        }
        try:
            for c in COMPONENTS:
                exe = str(bin_dir / c)
                with (logs / f"{c}.log").open("ab") as log:
                    p = subprocess.Popen(
                        [exe, *argv[c]],
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        stdin=subprocess.DEVNULL,
                        start_new_session=True,
                        cwd=self.dir,
                    )
                procs[c] = {"pid": p.pid, "exe": exe, "log": str(logs / f"{c}.log")}
                self.state_file.write_text(json.dumps(state, indent=2))  # recorded the moment it starts
                if c == "etcd":
                    self._wait_tcp(ports["etcd"], "etcd", p)
                if c == "kube-apiserver":
                    self._wait_ready(server, pki, p)
            self._wait_namespace_default(bin_dir)
        except BaseException:
            _stop(procs)
            raise
        return self

    def _wait_tcp(self, port: int, what: str, p: subprocess.Popen[bytes]) -> None:
        deadline = time.monotonic() + self.ready_timeout
        while time.monotonic() < deadline:
            if p.poll() is not None:
                raise ClusterError(f"{what} exited (rc {p.returncode}); see {self.dir}/logs/{what}.log")
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                return
            except OSError:
                time.sleep(0.1)
        raise ClusterError(f"{what} did not listen on 127.0.0.1:{port} within {self.ready_timeout:.0f} s")

    def ssl_context(self) -> ssl.SSLContext:
        """TLS as the admin of this cluster (its CA, the admin client certificate)."""
        pki = self.dir / "pki"
        ctx = ssl.create_default_context(cafile=str(pki / "ca.crt"))
        ctx.load_cert_chain(str(pki / "admin.crt"), str(pki / "admin.key"))
        return ctx

    def _wait_ready(self, server: str, pki: Path, p: subprocess.Popen[bytes]) -> None:
        ctx = self.ssl_context()
        deadline = time.monotonic() + self.ready_timeout
        last = ""
        while time.monotonic() < deadline:
            if p.poll() is not None:
                raise ClusterError(f"kube-apiserver exited (rc {p.returncode}); see {self.dir}/logs/kube-apiserver.log")
            try:
                with urllib.request.urlopen(server + "/readyz", context=ctx, timeout=5) as r:
                    if r.status == 200:
                        return
            except OSError as e:
                last = str(e)
            time.sleep(0.2)
        raise ClusterError(f"the API server at {server} was not ready within {self.ready_timeout:.0f} s ({last})")

    def _wait_namespace_default(self, bin_dir: Path) -> None:
        """The API answers with its default namespace and service account machinery in place."""
        deadline = time.monotonic() + self.ready_timeout
        while time.monotonic() < deadline:
            r = self.kubectl("get", "serviceaccount", "default", "-n", "default", "-o", "name", bin_dir=bin_dir)
            if r.returncode == 0:
                return
            time.sleep(0.3)
        raise ClusterError(
            "the default service account never appeared: is kube-controller-manager running? "
            f"see {self.dir}/logs/kube-controller-manager.log"
        )

    def kubectl(
        self, *args: str, bin_dir: Path | None = None, input: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        b = bin_dir or Path(str(self.state().get("bin", ""))) or kube_bin()
        return subprocess.run(
            [str(b / "kubectl"), f"--kubeconfig={self.kubeconfig}", *args],
            capture_output=True,
            text=True,
            check=False,
            input=input,
            timeout=120,
        )

    # ------------------------------------------------------------ down

    def join(self, name: str, root: Path, *, index: int, **kw: object) -> dict[str, object]:
        """Start a node in the background (kubelet-managers -start -detach) recorded in state.json."""
        bin_dir = Path(str(self.state().get("bin", ""))) if self.state().get("bin") else kube_bin()
        root.mkdir(parents=True, exist_ok=True)
        start = root / "start.json"
        start.write_text(json.dumps(node_start_request(self, name, root, index=index, **kw)))  # type: ignore[arg-type]
        exe = str(bin_dir / "kubelet-managers")
        out = root / "kubelet.out"
        with out.open("wb") as log:
            p = subprocess.Popen(
                [exe, "-klog", str(root / "kubelet.log"), "-start", str(start), "-detach"],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        state = self.state()
        nodes = dict(state.get("nodes", {}))  # type: ignore[call-overload]
        nodes[name] = {"pid": p.pid, "exe": exe, "log": str(root / "kubelet.log"), "root": str(root)}
        state["nodes"] = nodes
        self.state_file.write_text(json.dumps(state, indent=2))
        deadline = time.monotonic() + self.ready_timeout
        while time.monotonic() < deadline:
            first = out.read_text(errors="replace").split("\n", 1)[0]
            if first.startswith("{"):
                reply = dict(json.loads(first))
                if not reply.get("ok"):
                    raise ClusterError(f"node {name} did not start: {reply.get('error')} (see {root / 'kubelet.log'})")
                return reply
            if p.poll() is not None:
                raise ClusterError(
                    f"node {name}: kubelet-managers exited (rc {p.returncode}): {out.read_text()[-2000:]}"
                )
            time.sleep(0.1)
        raise ClusterError(f"node {name} did not answer its start within {self.ready_timeout:.0f} s")

    def down(self) -> list[str]:
        """Stop every process recorded in state.json (nodes first); the names of those that would not stop."""
        state = self.state()
        nodes = state.get("nodes", {})
        assert isinstance(nodes, dict)
        left = [f"node {n}" for n in _stop(nodes, order=list(nodes))]
        procs = state.get("processes", {})
        assert isinstance(procs, dict)
        left += _stop(procs)
        if not left:
            with contextlib.suppress(FileNotFoundError):
                self.state_file.unlink()
        return left


# ---------------------------------------------------------------- nodes


class NodeError(RuntimeError):
    """kubelet-managers refused a request or exited."""


def node_start_request(
    cluster: Cluster,
    name: str,
    root: Path,
    *,
    index: int = 1,
    labels: dict[str, str] | None = None,
    images: dict[str, dict[str, list[str]]] | None = None,
    capacity: dict[str, str] | None = None,
    numa_nodes: int = 2,
    policy: str = "none",
    status_interval_ms: int = 1000,
) -> dict[str, object]:
    """The kubelet-managers start request of a node whose file system is ``root`` (see :class:`Node`)."""
    state = root / "var/lib/kubelet/managers"
    return {
        "op": "start",
        "dir": str(root / "var/lib/kubelet/device-plugins"),
        "numa_nodes": numa_nodes,
        "policy": policy,
        "join": {
            "kubeconfig": str(cluster.kubeconfig),
            "node": name,
            "labels": labels or {},
            "node_ip": f"127.0.{index}.1",
            "capacity": capacity or {},
            "status_interval_ms": status_interval_ms,
            "plugins_registry": str(root / "var/lib/kubelet/plugins_registry"),
            "state_dir": str(state),
            "host_root": str(root),
            "images": images or {},
            "record_dir": str(state / "pods"),
        },
    }


def image_runtime(command: str) -> dict[str, list[str]]:
    """An image whose containers run ``command`` with this checkout's venv first on PATH (so a wrapper
    can exec the plugin, and its exec probes find ``rdma-device-plugin``)."""
    return {"entrypoint": [command], "path": [str(ROOT / ".venv" / "bin")]}


def plugin_images() -> dict[str, dict[str, list[str]]]:
    """The plugin's image runs as this checkout's plugin (its venv) on a joined node."""
    return {"rdma-device-plugin": image_runtime(str(ROOT / ".venv" / "bin" / "rdma-device-plugin"))}


class Node:
    """A node joined to a :class:`Cluster`: one ``kubelet-managers`` process (kube/cmd/kubelet-managers)
    running the kubelet's device, Topology and DRA managers against the cluster's API server.

    ``root`` stands for the node's file system: hostPath volumes map below it, the device-plugin dir
    is ``root/var/lib/kubelet/device-plugins`` and the DRA registration dir
    ``root/var/lib/kubelet/plugins_registry`` (as on a kubelet with its default root dir); a fixture
    node written there (sys/, dev/) is what a plugin pod sees. ``images`` maps an image name (last
    path element, no tag) to how its containers run here: ``{"entrypoint": [...], "path": [...]}``.
    """

    def __init__(
        self,
        cluster: Cluster,
        name: str,
        root: Path,
        *,
        index: int = 1,
        labels: dict[str, str] | None = None,
        images: dict[str, dict[str, list[str]]] | None = None,
        capacity: dict[str, str] | None = None,
        numa_nodes: int = 2,
        policy: str = "none",
        status_interval_ms: int = 1000,
        bin_dir: Path | None = None,
    ) -> None:
        self.cluster, self.name, self.root = cluster, name, root
        self._start = node_start_request(
            cluster,
            name,
            root,
            index=index,
            labels=labels,
            images=images,
            capacity=capacity,
            numa_nodes=numa_nodes,
            policy=policy,
            status_interval_ms=status_interval_ms,
        )
        join = self._start["join"]
        assert isinstance(join, dict)
        self.node_ip = str(join["node_ip"])
        self.dp_dir = Path(str(self._start["dir"]))
        self.registry = Path(str(join["plugins_registry"]))
        self.state_dir = Path(str(join["state_dir"]))
        self.record_dir = Path(str(join["record_dir"]))
        self.klog = root / "kubelet.log"
        exe = (bin_dir or Path(str(cluster.state().get("bin", ""))) or kube_bin()) / "kubelet-managers"
        root.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            [str(exe), "-klog", str(self.klog)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def call(self, op: str, **fields: object) -> dict[str, object]:
        assert self.proc.stdin and self.proc.stdout
        self.proc.stdin.write(json.dumps({"op": op, **fields}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise NodeError(f"kubelet-managers of {self.name} exited (rc {self.proc.poll()}); see {self.klog}")
        return dict(json.loads(line))

    def must(self, op: str, **fields: object) -> dict[str, object]:
        r = self.call(op, **fields)
        if not r.get("ok"):
            raise NodeError(f"{self.name} {op}: {r.get('error')}")
        return r

    def start(self) -> Node:
        """Start (or restart after stop/crash) the kubelet; the first start registers the Node."""
        fields = {k: v for k, v in self._start.items() if k != "op"}
        self.must("start", **fields)
        return self

    def crash(self) -> None:
        self.must("crash")

    def record(self, namespace: str, pod: str) -> dict[str, object] | None:
        """What the pod's containers got (device run options, CDI devices), None before admission."""
        try:
            return dict(json.loads((self.record_dir / f"{namespace}_{pod}.json").read_text()))
        except (OSError, ValueError):
            return None

    def log(self, namespace: str, pod: str, container: str) -> str:
        try:
            return (self.record_dir / "logs" / f"{namespace}_{pod}_{container}.log").read_text(errors="replace")
        except OSError:
            return ""

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.call("quit")
                self.proc.wait(timeout=30)
            except (NodeError, OSError, ValueError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=["up", "down", "status", "join"])
    ap.add_argument("node", nargs="?", help="join: the node's name")
    ap.add_argument("--root", help="join: the node's file system (default DIR/nodes/NAME)")
    ap.add_argument("--index", type=int, default=1, help="join: the node's number (its IP is 127.0.INDEX.1)")
    ap.add_argument("--label", action="append", default=[], help="join: a node label KEY=VALUE (repeatable)")
    ap.add_argument("--fixture", action="store_true", help="join: write a fixture Lingjun node at ROOT first")
    ap.add_argument("--plugin", action="store_true", help="join: run the plugin's image as this checkout's plugin")
    ap.add_argument(
        "--image",
        action="append",
        default=[],
        metavar="NAME=COMMAND",
        help="join: run the containers of image NAME (last path element, no tag) as COMMAND, this checkout's "
        "venv first on PATH (repeatable; overrides --plugin for NAME)",
    )
    ap.add_argument("--audit-policy", help="up: the API server's audit policy file (log in DIR/logs/audit.log)")
    ap.add_argument(
        "--dir", default=str(ROOT / "out" / "cluster"), help="state, certificates, logs (default out/cluster)"
    )
    ap.add_argument("--no-build", action="store_true", help="do not run scripts/kube-build.sh first")
    args = ap.parse_args(argv)
    c = Cluster(Path(args.dir).resolve())
    try:
        if args.command == "up":
            t0 = time.monotonic()
            c.bin = kube_bin() if args.no_build else build()
            c.audit_policy = Path(args.audit_policy) if args.audit_policy else None
            c.up()
            rel = os.path.relpath(c.kubeconfig)
            print(f"cluster up in {time.monotonic() - t0:.1f} s: {c.server()} (Kubernetes {c.bin.parent.name})")
            print(f"  export KUBECONFIG={rel}")
            b = os.path.relpath(c.bin)
            print(f"  {b}/kubectl version   # kubectl and helm are in {b}/")
            print(f"  logs: {os.path.relpath(c.dir)}/logs/   stop: make cluster-down")
            return 0
        if args.command == "join":
            if not args.node:
                ap.error("join needs the node's name")
            root = Path(args.root or c.dir / "nodes" / args.node).resolve()
            if args.fixture and not (root / "sys").exists():
                fixture = [str(ROOT / ".venv" / "bin" / "rdma-device-plugin"), "fixture", str(root)]
                subprocess.run(fixture, check=True, capture_output=True)
            labels = dict(kv.split("=", 1) for kv in args.label)
            images = plugin_images() if args.plugin else {}
            for spec in args.image:
                name, _, command = spec.partition("=")
                if not name or not command:
                    ap.error(f"--image {spec!r}: expected NAME=COMMAND, e.g. rdma-device-plugin=/path/to/wrapper")
                images[name] = image_runtime(command)
            c.join(args.node, root, index=args.index, labels=labels, images=images)
            print(f"node {args.node} joined ({root}); it stops with make cluster-down")
            return 0
        if args.command == "down":
            if not c.state_file.exists():
                print(f"no cluster recorded in {c.dir}: nothing to stop")
                return 0
            left = c.down()
            if left:
                print(f"could not stop: {', '.join(left)} (see {c.state_file})", file=sys.stderr)
                return 1
            print("cluster stopped: no process of it is left")
            return 0
        run = c.running()
        if not run:
            print(f"no cluster recorded in {c.dir}: start one with make cluster-up")
            return 3
        for n, alive in run.items():
            print(f"{n}: {'running' if alive else 'not running'}")
        for n, p in dict(c.state().get("nodes", {})).items():  # type: ignore[call-overload]
            print(f"node {n}: {'running' if _alive(int(p['pid']), str(p['exe'])) else 'not running'}")
        print(f"server: {c.server()}  kubeconfig: {c.kubeconfig}")
        return 0 if all(run.values()) else 3
    except ClusterError as e:
        print(f"cluster {args.command}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
