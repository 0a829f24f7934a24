#!/usr/bin/env python3
"""A real Kubernetes node joined to the local control plane (kube_cluster.py): the kubelet of
k8s.io/kubernetes at kube/go.mod's pin, containerd 2.x with its runc shim, runc (cgo, libseccomp) and
the CNI bridge, host-local and loopback plugins, pinned in kube/node/go.mod and built by
scripts/kube-build.sh. Pods run in containers under runc with their securityContext, mounts, device
cgroup, CDI devices and probes, exactly as on a production node.

    real_node.py up   [--dir out/cluster] [--name rdma-node-0] [--label K=V ...]
    real_node.py down [--dir out/cluster]
    real_node.py status [--dir out/cluster]

What the node is made of (all under DIR/node, nothing outside it but what `down` removes again):
  - its own mount namespace (a holder process made with unshare(1), --propagation private): the
    production paths /var/lib/kubelet, /var/lib/containerd, /run/containerd, /etc/cdi, /var/run/cdi,
    /etc/cni/net.d, /opt/cni/bin, /var/log/pods and /dev/infiniband are bind mounts of directories
    under DIR/node/fs there, so the chart's defaults (kubeletDir, cdi.hostDir) hold unchanged and the
    kubelet's fixed device-plugin socket (/var/lib/kubelet/device-plugins/kubelet.sock, whatever its
    --root-dir) is the node's own. The host's mount table is never touched; every mount goes when
    the namespace's last process ends.
  - a fixture Lingjun node (DIR/node/root: sysfs shaped like the kernel's, `rdma-device-plugin
    fixture`) whose uverbs, umad, issm and rdma_cm entries are real character devices (mknod with the
    major:minor numbers its sysfs names) at /dev/infiniband: a container given one can open it
    (ENXIO: no driver here) and one not given it cannot (EPERM: the device cgroup is real).
  - a bridge with the node's IP (the kubelet refuses a loopback node IP) and the CNI bridge of the pod
    network, both deleted by `down`.
  - one stand-in, for kube-proxy: no kube-proxy runs and the API server listens on 127.0.0.1 only, so
    one iptables DNAT rule (its own chain) takes the kubernetes Service (10.96.0.1:443) to it, with
    route_localnet on, as kube-proxy's iptables mode would; pods (the DRA driver) reach the API
    server through the Service with their own tokens. No other Service is served.
  - its own credentials: a client certificate of system:node:<name> in system:nodes, so the API
    server's Node authorizer and NodeRestriction judge it as they judge any kubelet.
  - a registry on 127.0.0.1 (docker-registry) holding the images the node runs, all built here:
    the upstream pause container (build/pause/linux/pause.c of k8s.io/kubernetes at the pin, static),
    the plugin image as the plugin_image role builds it, and a workload image (the local Debian base
    with python3 and pyverbs). containerd pulls them over plain HTTP (certs.d/hosts.toml).

Host settings it needs, made by `up` and documented here: cgroup v1 hybrid with the cgroupfs driver
(no systemd; the kubelet's failCgroupV1: false); containerd's restrict_oom_score_adj (this machine's
bounding set lacks CAP_SYS_RESOURCE, so runc cannot lower oom_score_adj); runc built with the seccomp
tag (else every pod fails "seccomp not supported").

`up` writes DIR/node-values.yaml, the Helm values that point the chart at this node (its fixture
sysfs, the local registry's image), so

    helm upgrade --install rdma charts/rdma-device-plugin -n kube-system -f out/cluster/node-values.yaml

deploys onto the real node. Importable: tests use :class:`RealNode`.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import ipaddress
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kube_cluster import ROOT, Cluster, ClusterError, free_port, kube_bin

NODE_DIR = "node"
STATE = "node.json"
NODE_BRIDGE = "rdmanode0"  # holds the node IP
CNI_BRIDGE = "rdmacni0"  # the pod network's bridge (CNI bridge plugin)
NODE_NET = ipaddress.ip_interface("10.231.0.1/24")
POD_SUBNET = "10.232.0.0/24"
PAUSE_TAG = "3.10.2"  # containerd 2.4's default sandbox image tag (registry.k8s.io/pause:3.10.2)
WORKLOAD_REPO = "rdma-workload"
BASE_IMAGE = "localhost/rdma-dp-base:bookworm"  # scripts/make-base-image.sh
# Production paths in the node's mount namespace -> directories under DIR/node/fs.
BINDS = {
    "/var/lib/kubelet": "var-lib-kubelet",
    "/var/lib/containerd": "var-lib-containerd",
    "/run/containerd": "run-containerd",
    "/etc/cdi": "etc-cdi",
    "/run/cdi": "run-cdi",
    "/etc/cni/net.d": "etc-cni-net.d",
    "/opt/cni/bin": "opt-cni-bin",
    "/var/log/pods": "var-log-pods",
    "/var/log/containers": "var-log-containers",
    "/dev/infiniband": "dev-infiniband",
}
# The node's tmpfs mounts: emptied by a reboot.
TMPFS = ("/run/netns",)
CGROUP_ROOT = Path("/sys/fs/cgroup")
# The kubernetes Service (the first address of kube_cluster's service range, in the API server's
# certificate): pods reach the API server through it, as kube-proxy's iptables mode programs it.
KUBERNETES_SERVICE = ("10.96.0.1", 443)
NAT_CHAIN = "RDMA-NODE-SERVICES"


class NodeError(ClusterError):
    """A node step that failed; the message names what to do next."""


def node_bin() -> Path:
    """The kubelet, containerd, runc and CNI plugins: beside the control plane's binaries."""
    return kube_bin()


def _run(argv: list[str], what: str, **kw: object) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(argv, capture_output=True, text=True, check=False, **kw)  # type: ignore[call-overload]
    if r.returncode != 0:
        raise NodeError(f"{what} failed (rc {r.returncode}): {' '.join(argv)}\n{r.stdout[-2000:]}{r.stderr[-2000:]}")
    return r  # type: ignore[no-any-return]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    with contextlib.suppress(OSError):
        if Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z":
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)
            return False
    return True


def _mnt_ns(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/mnt")
    except OSError:
        return None


def _pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def _kill_and_wait(pids: list[int], timeout: float = 15.0) -> list[int]:
    """SIGTERM, then SIGKILL after timeout; the pids still alive."""
    for p in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.05)
    for p in pids:
        if _alive(p):
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.05)
    return [p for p in pids if _alive(p)]


def _cgroup_dirs(name: str) -> list[Path]:
    """Every cgroup v1 directory called `name` directly under a hierarchy's root (kubepods)."""
    out: list[Path] = []
    if CGROUP_ROOT.is_dir():
        for h in CGROUP_ROOT.iterdir():
            if (h / name).is_dir():
                out.append(h / name)
    return out


def _cgroup_pids(d: Path) -> list[int]:
    pids: set[int] = set()
    for procs in d.rglob("cgroup.procs"):
        with contextlib.suppress(OSError, ValueError):
            pids.update(int(x) for x in procs.read_text().split())
    return sorted(pids)


def _rmdir_tree(d: Path) -> None:
    """rmdir a cgroup tree bottom-up (cgroup files cannot be unlinked, only their directories)."""
    for sub in sorted((p for p in d.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
        with contextlib.suppress(OSError):
            sub.rmdir()
    with contextlib.suppress(OSError):
        d.rmdir()


def _node_cert(pki: Path, out: Path, node: str) -> None:
    """The kubelet's client certificate: CN=system:node:<node>, O=system:nodes, signed by the cluster CA."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    ca_key = serialization.load_pem_private_key((pki / "ca.key").read_bytes(), password=None)
    ca = x509.load_pem_x509_certificate((pki / "ca.crt").read_bytes())
    k = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(
            x509.Name(
                [
                    x509.NameAttribute(NameOID.ORGANIZATION_NAME, "system:nodes"),
                    x509.NameAttribute(NameOID.COMMON_NAME, f"system:node:{node}"),
                ]
            )
        )
        .issuer_name(ca.subject)
        .public_key(k.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=30))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())  # type: ignore[arg-type]
    )
    out.mkdir(parents=True, exist_ok=True)
    (out / "kubelet-client.key").write_bytes(
        k.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    (out / "kubelet-client.key").chmod(0o600)
    (out / "kubelet-client.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))


class RealNode:
    """The real node of a :class:`kube_cluster.Cluster` (one per machine: the kubelet's device-plugin
    socket path is fixed). State in DIR/node/node.json; ``up()``/``down()`` as the CLI."""

    def __init__(
        self,
        cluster: Cluster,
        name: str = "rdma-node-0",
        labels: dict[str, str] | None = None,
        fixture_args: list[str] | None = None,
        kubelet_flags: list[str] | None = None,
    ) -> None:
        self.cluster = cluster
        self.name = name
        self.labels = dict(labels or {})
        self.fixture_args = list(fixture_args or [])
        # More kubelet flags (a bench's --vmodule for the DRA plugin client's per-call log lines).
        self.kubelet_flags = list(kubelet_flags or [])
        self.dir = cluster.dir / NODE_DIR
        self.fs = self.dir / "fs"
        self.root = self.dir / "root"  # the fixture node: root/sys, root/dev
        self.logs = self.dir / "logs"
        self.bin = node_bin()

    # ------------------------------------------------------------ state

    @property
    def state_file(self) -> Path:
        return self.dir / STATE

    def state(self) -> dict[str, object]:
        try:
            return dict(json.loads(self.state_file.read_text()))
        except (OSError, ValueError):
            return {}

    def _save(self, **kw: object) -> None:
        s = self.state()
        s.update(kw)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.state_file.write_text(json.dumps(s, indent=2))

    def _pid(self, what: str) -> int:
        return int(self.state().get(what, 0) or 0)  # type: ignore[call-overload]

    @property
    def registry(self) -> str:
        return str(self.state().get("registry", ""))

    @property
    def values_file(self) -> Path:
        return self.cluster.dir / "node-values.yaml"

    def image(self, repo: str, tag: str) -> str:
        return f"{self.registry}/{repo}:{tag}"

    # ------------------------------------------------------------ the mount namespace

    def nsenter(self) -> list[str]:
        """The prefix that runs a command in the node's mount namespace."""
        holder = self._pid("holder")
        if not holder or not _alive(holder):
            raise NodeError(f"the node's namespace holder is not running ({self.state_file}): run make node-up")
        return ["nsenter", "-t", str(holder), "-m", "--"]

    def in_node(self, *argv: str, what: str = "", check: bool = True) -> subprocess.CompletedProcess[str]:
        r = subprocess.run([*self.nsenter(), *argv], capture_output=True, text=True, check=False, timeout=120)
        if check and r.returncode != 0:
            raise NodeError(f"{what or argv[0]} in the node failed (rc {r.returncode}): {r.stderr.strip()[-2000:]}")
        return r

    def _start_holder(self) -> None:
        p = subprocess.Popen(
            ["unshare", "--mount", "--propagation", "private", "--", "sleep", "infinity"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        # unshare execs sleep in the new namespace: wait until it is not the host's any more.
        host = _mnt_ns(os.getpid())
        deadline = time.monotonic() + 10
        while _mnt_ns(p.pid) == host and time.monotonic() < deadline:
            time.sleep(0.01)
        if _mnt_ns(p.pid) in (None, host):
            raise NodeError("unshare --mount did not make a mount namespace (needs root and util-linux unshare)")
        self._save(holder=p.pid, holder_ns=_mnt_ns(p.pid))
        made: list[str] = list(self.state().get("made_dirs", []))  # type: ignore[call-overload]
        for target, src in BINDS.items():
            (self.fs / src).mkdir(parents=True, exist_ok=True)
            if not Path(target).exists():
                Path(target).mkdir(parents=True)  # an empty mount point on the host; `down` removes it
                made.append(target)
            self.in_node("mount", "--bind", str(self.fs / src), target, what=f"bind {target}")
        for target in TMPFS:
            if not Path(target).exists():
                Path(target).mkdir(parents=True)
                made.append(target)
            self.in_node("mount", "-t", "tmpfs", "-o", "mode=755", "tmpfs", target, what=f"tmpfs {target}")
        self._save(made_dirs=sorted(set(made)))

    # ------------------------------------------------------------ the fixture and its devices

    def _fixture(self) -> None:
        if not (self.root / "sys").is_dir():
            exe = str(ROOT / ".venv" / "bin" / "rdma-device-plugin")
            _run([exe, "fixture", str(self.root), *self.fixture_args], "writing the fixture node")
        self.make_devices()

    def make_devices(self) -> list[str]:
        """Real character devices at the node's /dev/infiniband for every char device the fixture's
        sysfs names (uverbs, umad, issm: class/infiniband_*/X/dev; rdma_cm: class/misc/rdma_cm/dev).
        Returns their names; stale ones (a NIC removed from the fixture) are removed."""
        sysfs = self.root / "sys"
        want: dict[str, tuple[int, int]] = {}
        for klass in ("infiniband_verbs", "infiniband_mad"):
            d = sysfs / "class" / klass
            for entry in sorted(d.iterdir()) if d.is_dir() else []:
                with contextlib.suppress(OSError, ValueError):
                    major, minor = (entry / "dev").read_text().strip().split(":")
                    want[entry.name] = (int(major), int(minor))
        with contextlib.suppress(OSError, ValueError):
            major, minor = (sysfs / "class" / "misc" / "rdma_cm" / "dev").read_text().strip().split(":")
            want["rdma_cm"] = (int(major), int(minor))
        dev = self.fs / BINDS["/dev/infiniband"]
        dev.mkdir(parents=True, exist_ok=True)
        for f in dev.iterdir():
            if f.name not in want:
                f.unlink()
        for name, (major, minor) in want.items():
            f = dev / name
            if f.exists() and not f.is_char_device():
                f.unlink()
            if not f.exists():
                os.mknod(f, 0o666 | 0o020000, os.makedev(major, minor))
        return sorted(want)

    # ------------------------------------------------------------ network

    def _network(self) -> None:
        ip = shutil.which("ip") or "ip"
        if subprocess.run([ip, "link", "show", NODE_BRIDGE], capture_output=True, check=False).returncode != 0:
            _run([ip, "link", "add", NODE_BRIDGE, "type", "bridge"], "making the node bridge")
        _run([ip, "addr", "replace", str(NODE_NET), "dev", NODE_BRIDGE], "the node IP")
        _run([ip, "link", "set", NODE_BRIDGE, "up"], "the node bridge up")
        forward = Path("/proc/sys/net/ipv4/ip_forward")
        if "ip_forward" not in self.state():
            self._save(ip_forward=forward.read_text().strip())  # put back by down()
        forward.write_text("1")  # the pod network's bridge routes through the host
        conf = self.fs / BINDS["/etc/cni/net.d"]
        conf.mkdir(parents=True, exist_ok=True)
        (conf / "10-rdma-node.conflist").write_text(
            json.dumps(
                {
                    "cniVersion": "1.0.0",
                    "name": "rdma-node",
                    "plugins": [
                        {
                            "type": "bridge",
                            "bridge": CNI_BRIDGE,
                            "isGateway": True,
                            "ipMasq": False,
                            "hairpinMode": True,
                            "ipam": {
                                "type": "host-local",
                                "ranges": [[{"subnet": POD_SUBNET}]],
                                "routes": [{"dst": "0.0.0.0/0"}],
                                "dataDir": str(self.fs / "cni-ipam"),
                            },
                        }
                    ],
                },
                indent=2,
            )
        )
        self._service_routes()
        cni = self.fs / BINDS["/opt/cni/bin"]
        cni.mkdir(parents=True, exist_ok=True)
        for plugin in ("bridge", "host-local", "loopback"):
            src = self.bin / "cni" / plugin
            if not src.exists():
                raise NodeError(f"{src} is missing: build the node's binaries with make kube")
            shutil.copy2(src, cni / plugin)

    def _service_routes(self) -> None:
        """No kube-proxy runs and the API server listens on 127.0.0.1: one DNAT of the kubernetes
        Service's ClusterIP:443 to it, for pods (PREROUTING) and hostNetwork pods (OUTPUT), in a chain
        of its own; route_localnet lets the pod network reach 127.0.0.1, as kube-proxy sets it."""
        port = self.cluster.server().rsplit(":", 1)[-1]
        ipt = ["iptables", "-w", "-t", "nat"]
        self._drop_service_routes()
        _run([*ipt, "-N", NAT_CHAIN], "iptables chain")
        ip, svc_port = KUBERNETES_SERVICE
        _run(
            [*ipt, "-A", NAT_CHAIN, "-d", ip, "-p", "tcp", "--dport", str(svc_port), "-j", "DNAT",
             "--to-destination", f"127.0.0.1:{port}"],
            "the kubernetes Service's DNAT",
        )  # fmt: skip
        for hook in ("PREROUTING", "OUTPUT"):
            _run([*ipt, "-I", hook, "-j", NAT_CHAIN], f"iptables {hook}")
        conf = Path("/proc/sys/net/ipv4/conf/all/route_localnet")
        self._save(route_localnet=conf.read_text().strip())
        conf.write_text("1")

    def _drop_service_routes(self) -> None:
        ipt = ["iptables", "-w", "-t", "nat"]
        for hook in ("PREROUTING", "OUTPUT"):
            while subprocess.run([*ipt, "-D", hook, "-j", NAT_CHAIN], capture_output=True, check=False).returncode == 0:
                pass
        subprocess.run([*ipt, "-F", NAT_CHAIN], capture_output=True, check=False)
        subprocess.run([*ipt, "-X", NAT_CHAIN], capture_output=True, check=False)
        old = self.state().get("route_localnet")
        if old is not None:
            Path("/proc/sys/net/ipv4/conf/all/route_localnet").write_text(str(old))

    # ------------------------------------------------------------ registry and images

    def _registry(self) -> None:
        exe = shutil.which("docker-registry")
        if not exe:
            raise NodeError("docker-registry is missing: run make system-deps (scripts/setup-system.sh) as root")
        port = free_port()
        d = self.dir / "registry"
        (d / "data").mkdir(parents=True, exist_ok=True)
        (d / "config.yml").write_text(
            "version: 0.1\nlog:\n  level: warn\nstorage:\n  filesystem:\n"
            f"    rootdirectory: {d / 'data'}\nhttp:\n  addr: 127.0.0.1:{port}\n"
        )
        self.logs.mkdir(parents=True, exist_ok=True)
        with (self.logs / "registry.log").open("ab") as log:
            p = subprocess.Popen(
                [exe, "serve", str(d / "config.yml")],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        self._save(registry_pid=p.pid, registry=f"127.0.0.1:{port}")
        self._wait_tcp(port, "the registry", p, self.logs / "registry.log")

    def _wait_tcp(self, port: int, what: str, p: subprocess.Popen[bytes], log: Path, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if p.poll() is not None:
                raise NodeError(f"{what} exited (rc {p.returncode}); see {log}")
            with contextlib.suppress(OSError):
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                return
            time.sleep(0.1)
        raise NodeError(f"{what} did not listen on 127.0.0.1:{port} within {timeout:.0f} s; see {log}")

    def _buildah(self, *args: str, what: str) -> str:
        return _run(["buildah", "--storage-driver", "vfs", *args], what).stdout.strip()

    def _push(self, local: str, ref: str) -> None:
        self._buildah("push", "--quiet", "--tls-verify=false", local, f"docker://{ref}", what=f"pushing {ref}")

    def pause_image(self) -> str:
        """The upstream pause container (k8s.io/kubernetes build/pause/linux/pause.c at the pin), static."""
        ref = self.image("pause", PAUSE_TAG)
        src = Path(
            _run(
                ["go", "list", "-m", "-f", "{{.Dir}}", "k8s.io/kubernetes"],
                "locating k8s.io/kubernetes",
                cwd=str(ROOT / "kube"),
                env={**os.environ, "GOFLAGS": "-mod=mod", "GOTOOLCHAIN": "local"},
            ).stdout.strip()
        )
        work = self.dir / "images" / "pause"
        work.mkdir(parents=True, exist_ok=True)
        _run(
            ["gcc", "-Os", "-static", "-Wall", "-Werror", f'-DVERSION="{PAUSE_TAG}"', "-o", str(work / "pause"),
             str(src / "build" / "pause" / "linux" / "pause.c")],
            "compiling pause.c (gcc, static glibc: Debian's libc6-dev)",
        )  # fmt: skip
        ctr = self._buildah("from", "scratch", what="buildah from scratch")
        try:
            self._buildah("copy", ctr, str(work / "pause"), "/pause", what="copying pause")
            self._buildah("config", "--entrypoint", '["/pause"]', "--user", "65535:65535", ctr, what="pause config")
            self._buildah("commit", "--quiet", ctr, f"localhost/pause:{PAUSE_TAG}", what="committing pause")
        finally:
            subprocess.run(["buildah", "--storage-driver", "vfs", "rm", ctr], capture_output=True, check=False)
        self._push(f"localhost/pause:{PAUSE_TAG}", ref)
        return ref

    def derived_image(self, source: str, ref: str, entrypoint: list[str]) -> str:
        """``source`` from the registry with another entrypoint, pushed as ``ref`` (a crash-looping
        plugin image for the tests, say)."""
        ctr = self._buildah(
            "from", "--quiet", "--tls-verify=false", f"docker://{source}", what=f"buildah from {source}"
        )
        try:
            self._buildah("config", "--entrypoint", json.dumps(entrypoint), ctr, what="entrypoint")
            self._buildah("commit", "--quiet", ctr, ref, what=f"committing {ref}")
        finally:
            subprocess.run(["buildah", "--storage-driver", "vfs", "rm", ctr], capture_output=True, check=False)
        self._push(ref, ref)
        return ref

    def base_image(self) -> None:
        env = {**os.environ, "STORAGE_DRIVER": "vfs"}
        _run([str(ROOT / "scripts" / "make-base-image.sh"), BASE_IMAGE], "making the base image", env=env)

    def workload_image(self) -> str:
        """The image the tests' RDMA pods run: the Debian base the plugin image is built on (python3,
        pyverbs from rdma-core), pushed to the node's registry."""
        ref = self.image(WORKLOAD_REPO, "bookworm")
        self._push(BASE_IMAGE, ref)
        return ref

    def plugin_image(self) -> str:
        """The plugin image, built and pushed by the plugin_image role (buildah, the local base by digest)."""
        digest = self._buildah("images", "--digests", "--format", "{{.Digest}}", BASE_IMAGE, what="base digest")
        out = self.dir / "images" / "plugin.json"
        play = self.dir / "images" / "plugin-image.yml"
        play.parent.mkdir(parents=True, exist_ok=True)
        play.write_text(
            json.dumps(
                [
                    {
                        "name": "Build and push the plugin image for the real node",
                        "hosts": "localhost",
                        "gather_facts": False,
                        "roles": [{"role": "plugin_image"}],
                        "post_tasks": [
                            {
                                "name": "Record the image",
                                "ansible.builtin.copy": {
                                    "dest": str(out),
                                    "mode": "0644",
                                    "content": "{{ {'ref': plugin_image_ref} | to_json }}",
                                },
                            }
                        ],
                    }
                ]
            )
        )
        extra = {
            "ansible_python_interpreter": str(ROOT / ".venv" / "bin" / "python"),
            "plugin_image_enabled": True,
            "plugin_image_builder": "buildah",
            "plugin_image_storage_driver": "vfs",
            "plugin_image_isolation": "chroot",
            "plugin_image_registry": self.registry,
            "plugin_image_tls_verify": False,
            "plugin_image_base_image": BASE_IMAGE,
            "plugin_image_build_args": {"BASE_IMAGE_DIGEST": digest.splitlines()[0]},
            "plugin_image_chart_publish": False,
            "plugin_image_build_ca_bundle": "/etc/ssl/certs/ca-certificates.crt",
        }
        env = {
            **os.environ,
            "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"),
            "ANSIBLE_ROLES_PATH": str(ROOT / "roles"),
            "PATH": f"{ROOT / '.venv' / 'bin'}:{os.environ.get('PATH', '')}",
        }
        _run(
            [str(ROOT / ".venv" / "bin" / "ansible-playbook"), "-i", "localhost,", "-c", "local", str(play),
             "-e", json.dumps(extra)],
            "building the plugin image (the plugin_image role)",
            env=env,
            cwd=str(ROOT),
            timeout=1800,
        )  # fmt: skip
        facts = json.loads(out.read_text())
        return str(facts["ref"])

    # ------------------------------------------------------------ containerd

    def _containerd_config(self) -> Path:
        certs = self.dir / "containerd" / "certs.d" / self.registry
        certs.mkdir(parents=True, exist_ok=True)
        (certs / "hosts.toml").write_text(
            f'server = "http://{self.registry}"\n\n[host."http://{self.registry}"]\n'
            '  capabilities = ["pull", "resolve"]\n'
        )
        cfg = self.dir / "containerd" / "config.toml"
        cfg.write_text(
            f"""version = 3
root = "/var/lib/containerd"
state = "/run/containerd"

[grpc]
  address = "/run/containerd/containerd.sock"

[plugins.'io.containerd.cri.v1.images']
  snapshotter = "overlayfs"
  [plugins.'io.containerd.cri.v1.images'.pinned_images]
    sandbox = "{self.image("pause", PAUSE_TAG)}"
  [plugins.'io.containerd.cri.v1.images'.registry]
    config_path = "{self.dir / "containerd" / "certs.d"}"

[plugins.'io.containerd.cri.v1.runtime']
  enable_cdi = true
  cdi_spec_dirs = ["/etc/cdi", "/var/run/cdi"]
  # CAP_SYS_RESOURCE is not in this machine's bounding set: runc cannot lower oom_score_adj.
  restrict_oom_score_adj = true
  [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
    runtime_type = "io.containerd.runc.v2"
    [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
      BinaryName = "{self.bin / "runc"}"
      SystemdCgroup = false
  [plugins.'io.containerd.cri.v1.runtime'.cni]
    bin_dirs = ["/opt/cni/bin"]
    conf_dir = "/etc/cni/net.d"
"""
        )
        return cfg

    def start_containerd(self) -> None:
        cfg = self._containerd_config()
        self.logs.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "PATH": f"{self.bin}:{os.environ.get('PATH', '')}"}
        with (self.logs / "containerd.log").open("ab") as log:
            p = subprocess.Popen(
                [*self.nsenter(), str(self.bin / "containerd"), "--config", str(cfg), "--log-level", "info"],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                env=env,
            )
        self._save(containerd=p.pid)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if p.poll() is not None:
                raise NodeError(f"containerd exited (rc {p.returncode}); see {self.logs / 'containerd.log'}")
            if self.ctr("version", check=False).returncode == 0:
                return
            time.sleep(0.2)
        raise NodeError(f"containerd did not answer within 60 s; see {self.logs / 'containerd.log'}")

    def ctr(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return self.in_node(
            str(self.bin / "ctr"), "--address", "/run/containerd/containerd.sock", "-n", "k8s.io", *args,
            what="ctr " + " ".join(args[:2]), check=check,
        )  # fmt: skip

    def pull(self, ref: str) -> None:
        """Pull into the node's containerd (the kubelet's k8s.io namespace): the Node lists it."""
        self.ctr("images", "pull", "--hosts-dir", str(self.dir / "containerd" / "certs.d"), ref)

    # ------------------------------------------------------------ kubelet

    def _kubelet_config(self) -> Path:
        pki = self.cluster.dir / "pki"
        _node_cert(pki, self.dir / "pki", self.name)
        kc = self.dir / "kubelet.kubeconfig"
        kc.write_text(
            json.dumps(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "clusters": [
                        {
                            "name": "local",
                            "cluster": {"server": self.cluster.server(), "certificate-authority": str(pki / "ca.crt")},
                        }
                    ],
                    "users": [
                        {
                            "name": f"system:node:{self.name}",
                            "user": {
                                "client-certificate": str(self.dir / "pki" / "kubelet-client.crt"),
                                "client-key": str(self.dir / "pki" / "kubelet-client.key"),
                            },
                        }
                    ],
                    "contexts": [{"name": "node", "context": {"cluster": "local", "user": f"system:node:{self.name}"}}],
                    "current-context": "node",
                },
                indent=2,
            )
        )
        cfg = self.dir / "kubelet-config.yaml"
        cfg.write_text(
            json.dumps(
                {
                    "apiVersion": "kubelet.config.k8s.io/v1beta1",
                    "kind": "KubeletConfiguration",
                    # cgroup v1 hybrid without systemd here; 1.35+ refuses v1 unless told.
                    "cgroupDriver": "cgroupfs",
                    "failCgroupV1": False,
                    "containerRuntimeEndpoint": "unix:///run/containerd/containerd.sock",
                    "address": str(NODE_NET.ip),
                    "port": free_port(),
                    "readOnlyPort": 0,
                    "healthzPort": 0,
                    "authentication": {
                        "anonymous": {"enabled": False},
                        "webhook": {"enabled": True},
                        "x509": {"clientCAFile": str(pki / "ca.crt")},
                    },
                    "authorization": {"mode": "Webhook"},
                    "failSwapOn": False,
                    "podLogsDir": "/var/log/pods",
                    "nodeStatusUpdateFrequency": "2s",
                    "nodeStatusReportFrequency": "10s",
                    "syncFrequency": "10s",
                    "fileCheckFrequency": "2s",
                    "imageMinimumGCAge": "2m",
                    # This disk is shared with the build caches: do not evict or GC on its fill level.
                    "evictionHard": {"memory.available": "100Mi", "nodefs.available": "1%", "imagefs.available": "1%"},
                    "imageGCHighThresholdPercent": 100,
                    "imageGCLowThresholdPercent": 99,
                    "serializeImagePulls": False,
                    "cpuManagerPolicy": "none",
                    "topologyManagerPolicy": "none",
                    "maxPods": 110,
                    "rotateCertificates": False,
                    "serverTLSBootstrap": False,
                    "resolvConf": "/etc/resolv.conf",
                },
                indent=2,
            )
        )
        return cfg

    def start_kubelet(self) -> None:
        cfg = self.dir / "kubelet-config.yaml"
        if not cfg.exists():
            cfg = self._kubelet_config()
        labels = ",".join(f"{k}={v}" for k, v in sorted(self.labels.items()))
        argv = [
            str(self.bin / "kubelet"),
            f"--config={cfg}",
            f"--kubeconfig={self.dir / 'kubelet.kubeconfig'}",
            f"--hostname-override={self.name}",
            f"--node-ip={NODE_NET.ip}",
            "--root-dir=/var/lib/kubelet",
            f"--cert-dir={self.dir / 'pki'}",
            "--v=2",
            *self.kubelet_flags,
        ]
        if labels:
            argv.append(f"--node-labels={labels}")
        self.logs.mkdir(parents=True, exist_ok=True)
        with (self.logs / "kubelet.log").open("ab") as log:
            p = subprocess.Popen(
                [*self.nsenter(), *argv],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        self._save(kubelet=p.pid)

    def stop_kubelet(self) -> None:
        pid = self._pid("kubelet")
        if pid and _alive(pid):
            _kill_and_wait([pid])

    def restart_kubelet(self) -> None:
        self.stop_kubelet()
        self.start_kubelet()

    def wait_ready(self, timeout: float = 180.0) -> dict[str, object]:
        """The Node object once its Ready condition is True."""
        deadline = time.monotonic() + timeout
        last = ""
        while time.monotonic() < deadline:
            pid = self._pid("kubelet")
            if pid and not _alive(pid):
                raise NodeError(f"the kubelet exited; the end of {self.logs / 'kubelet.log'}:\n{self._tail('kubelet')}")
            r = self.cluster.kubectl("get", "node", self.name, "-o", "json")
            if r.returncode == 0:
                node = json.loads(r.stdout)
                for c in node.get("status", {}).get("conditions", []):
                    if c.get("type") == "Ready":
                        last = f"{c.get('status')}: {c.get('reason')}: {c.get('message')}"
                        if c.get("status") == "True":
                            return dict(node)
            time.sleep(0.5)
        raise NodeError(f"node {self.name} not Ready within {timeout:.0f} s ({last}); see {self.logs / 'kubelet.log'}")

    def _tail(self, what: str, n: int = 30) -> str:
        with contextlib.suppress(OSError):
            return "\n".join((self.logs / f"{what}.log").read_text(errors="replace").splitlines()[-n:])
        return ""

    # ------------------------------------------------------------ up, reboot, down

    def check_built(self) -> None:
        need = [self.bin / b for b in ("kubelet", "containerd", "containerd-shim-runc-v2", "ctr", "runc")]
        need += [self.bin / "cni" / p for p in ("bridge", "host-local", "loopback")]
        missing = [str(p) for p in need if not p.exists()]
        if missing:
            raise NodeError(f"missing: {', '.join(missing)}: build them with make kube")
        if not self.cluster.server() or not all(self.cluster.running().values()):
            raise NodeError(f"no control plane runs from {self.cluster.dir}: start it with make cluster-up")
        for tool in ("unshare", "nsenter", "buildah", "gcc"):
            if not shutil.which(tool):
                raise NodeError(f"{tool} is missing: run make system-deps")

    def up(self, *, plugin_image: bool = True) -> dict[str, object]:
        """Start the node; returns what it runs (images, node name, versions)."""
        if self._pid("holder") and _alive(self._pid("holder")):
            raise NodeError(f"a node already runs from {self.dir} (stop it: make node-down)")
        self.check_built()
        t0 = time.monotonic()
        self.dir.mkdir(parents=True, exist_ok=True)
        self._save(name=self.name, started=time.time())
        images: dict[str, str] = {}

        def step(what: str, fn: object) -> object:
            t = time.monotonic()
            print(f"node-up: {what} ...", flush=True)
            out = fn()  # type: ignore[operator]
            print(f"node-up: {what}: {time.monotonic() - t:.1f} s", flush=True)
            return out

        try:
            step("the fixture node and its character devices", self._fixture)
            step("a registry on 127.0.0.1", self._registry)
            step("the base image (scripts/make-base-image.sh, cached)", self.base_image)
            images["pause"] = str(step("the pause image (pause.c of the pinned kubernetes)", self.pause_image))
            images["workload"] = str(step("the workload image", self.workload_image))
            if plugin_image:
                images["plugin"] = str(step("the plugin image (the plugin_image role)", self.plugin_image))
            self._save(images=images)
            step("the mount namespace", self._start_holder)
            step("the node IP, the CNI config, the kubernetes Service", self._network)
            step("containerd", self.start_containerd)
            step("pulling the images into containerd", lambda: [self.pull(ref) for ref in images.values()])
            step("the kubelet", self.start_kubelet)
            node = dict(step("the Node Ready", self.wait_ready))  # type: ignore[call-overload]
        except BaseException:
            self.down()
            raise
        self.write_values()
        info = node.get("status", {}).get("nodeInfo", {})  # type: ignore[union-attr]
        return {"node": self.name, "seconds": round(time.monotonic() - t0, 1), "nodeInfo": info, "images": images}

    def write_values(self) -> Path:
        """The Helm values that point the chart at this node: its fixture sysfs, the registry's plugin image."""
        images = dict(self.state().get("images", {}))  # type: ignore[call-overload]
        values: dict[str, object] = {"sysfsHostPath": str(self.root / "sys")}
        plugin = str(images.get("plugin", ""))
        if plugin:
            # REGISTRY/REPOSITORY:TAG@sha256:... as the plugin_image role publishes it
            name, _, digest = plugin.partition("@")
            repo, _, tag = name.rpartition(":")
            registry, _, repository = repo.partition("/")
            values["image"] = {"registry": registry, "repository": repository, "tag": tag, "digest": digest}
        self.values_file.write_text(
            "# Written by make node-up (scripts/real_node.py): the chart on the real node of out/cluster.\n"
            + json.dumps(values, indent=2)
            + "\n"
        )
        return self.values_file

    def kill_containers(self) -> list[int]:
        """Every process of the node's pods (the kubepods cgroups) and the shims; the pids left."""
        pids: set[int] = set()
        for d in _cgroup_dirs("kubepods"):
            pids.update(_cgroup_pids(d))
        ns = self.state().get("holder_ns")
        shim = str(self.bin / "containerd-shim-runc-v2")
        for p in _pids():
            if p == os.getpid():
                continue
            if ns and _mnt_ns(p) == ns and p != self._pid("holder"):
                pids.add(p)
                continue
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/{p}/exe") == shim:
                    pids.add(p)
        return _kill_and_wait(sorted(pids), timeout=5.0)

    def reboot(self) -> None:
        """Stop the kubelet, containerd and every container; empty what a reboot empties (/run/cdi,
        /run/netns, containerd's state, /dev/shm of the pods), then start containerd and the kubelet."""
        self.stop_kubelet()
        pid = self._pid("containerd")
        if pid and _alive(pid):
            _kill_and_wait([pid])
        self.kill_containers()
        for target in ("/run/cdi", "/run/containerd"):
            d = self.fs / BINDS[target]
            self.in_node("sh", "-c", f"umount -R {target}/* 2>/dev/null; true", check=False)
            for child in d.iterdir() if d.is_dir() else []:
                if child.is_dir() and not child.is_symlink():
                    shutil.rmtree(child, ignore_errors=True)
                else:
                    child.unlink(missing_ok=True)
        self.in_node("sh", "-c", "umount -R /run/netns/* 2>/dev/null; rm -rf /run/netns/*", check=False)
        for d in _cgroup_dirs("kubepods"):
            _rmdir_tree(d)
        self.make_devices()
        self.start_containerd()
        self.start_kubelet()

    def down(self) -> list[str]:
        """Stop everything `up` started and remove what it made outside DIR/node; what would not stop."""
        state = self.state()
        left: list[str] = []
        self.stop_kubelet()
        pid = self._pid("containerd")
        if pid and _alive(pid):
            _kill_and_wait([pid])
        if self._pid("holder") and _alive(self._pid("holder")):
            left += [f"pid {p}" for p in self.kill_containers()]
            left += [f"holder {p}" for p in _kill_and_wait([self._pid("holder")])]
        rp = self._pid("registry_pid")
        if rp and _alive(rp):
            left += [f"registry {p}" for p in _kill_and_wait([rp])]
        for d in _cgroup_dirs("kubepods"):
            _rmdir_tree(d)
        for br in (CNI_BRIDGE, NODE_BRIDGE):
            subprocess.run(["ip", "link", "del", br], capture_output=True, check=False)
        self._drop_service_routes()
        if state.get("ip_forward") is not None:
            Path("/proc/sys/net/ipv4/ip_forward").write_text(str(state["ip_forward"]))
        for target in sorted(state.get("made_dirs", []), key=len, reverse=True):  # type: ignore[call-overload]
            with contextlib.suppress(OSError):
                Path(target).rmdir()
        if not left:
            with contextlib.suppress(FileNotFoundError):
                self.state_file.unlink()
        return left


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=["up", "down", "status"])
    ap.add_argument("--dir", default=str(ROOT / "out" / "cluster"), help="the cluster's directory (make cluster-up)")
    ap.add_argument("--name", default="rdma-node-0", help="the Node's name")
    ap.add_argument("--label", action="append", default=[], help="a node label KEY=VALUE (repeatable)")
    ap.add_argument("--no-plugin-image", action="store_true", help="do not build the plugin image (faster)")
    args = ap.parse_args(argv)
    cluster = Cluster(Path(args.dir).resolve())
    labels = dict(kv.split("=", 1) for kv in args.label)
    node = RealNode(cluster, args.name, labels)
    try:
        if args.command == "up":
            info = node.up(plugin_image=not args.no_plugin_image)
            ni = dict(info["nodeInfo"])  # type: ignore[call-overload]
            print(
                f"node {args.name} Ready in {info['seconds']} s: kubelet {ni.get('kubeletVersion')}, "
                f"{ni.get('containerRuntimeVersion')}"
            )
            for what, ref in dict(info["images"]).items():  # type: ignore[call-overload]
                print(f"  image {what}: {ref}")
            print(f"  helm values: {os.path.relpath(node.values_file)}")
            print(f"  logs: {os.path.relpath(node.logs)}/   stop: make node-down")
            return 0
        if args.command == "down":
            if not node.state_file.exists():
                print(f"no node recorded in {node.dir}: nothing to stop")
                return 0
            left = node.down()
            if left:
                print(f"could not stop: {', '.join(left)} (see {node.state_file})", file=sys.stderr)
                return 1
            print("node stopped: no process and no mount of it is left")
            return 0
        s = node.state()
        if not s:
            print(f"no node recorded in {node.dir}: start one with make node-up")
            return 3
        ok = True
        for what in ("holder", "containerd", "kubelet", "registry_pid"):
            pid = int(s.get(what, 0) or 0)  # type: ignore[call-overload]
            alive = bool(pid) and _alive(pid)
            ok &= alive
            print(f"{what.replace('_pid', '')}: {'running' if alive else 'not running'}")
        return 0 if ok else 3
    except ClusterError as e:
        print(f"node {args.command}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
