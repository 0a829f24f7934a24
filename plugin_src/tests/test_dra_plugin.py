"""The DRA driver's kubelet-plugin plumbing (:mod:`rdma_device_plugin.dra.kubeletplugin`): per-instance
sockets with their own mode, never removing another instance's, the node-wide prepare serialization,
and which instance publishes. Real gRPC over unix sockets; the kubelet's side is in test_dra_cluster.py
(test_two_overlapping_instances_hand_over_without_a_failed_prepare)."""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from rdma_device_plugin.api import dra_v1_pb2 as pb
from rdma_device_plugin.api import dra_v1_pb2_grpc as pb_grpc
from rdma_device_plugin.api import pluginregistration_v1_pb2 as reg_pb
from rdma_device_plugin.api import pluginregistration_v1_pb2_grpc as reg_grpc
from rdma_device_plugin.dra.claims import PreparedDevice
from rdma_device_plugin.dra.kubeletplugin import Instances, Paths, instance_uid
from rdma_device_plugin.dra.service import HealthFeed, KubeletService

DRIVER = "rdma.example.com"


class Backend:
    """Prepare blocks until released, so a test can look at the lock while one is in flight."""

    def __init__(self) -> None:
        self.inside = threading.Event()
        self.release = threading.Event()

    def prepare(self, namespace: str, uid: str, name: str) -> list[PreparedDevice]:
        self.inside.set()
        assert self.release.wait(60)
        return [PreparedDevice(["nic"], "node", "mlx5-bond-0", [f"{DRIVER}/claim={uid}"])]

    def unprepare(self, namespace: str, uid: str, name: str) -> None:
        pass


@pytest.fixture
def kubelet_dir(tmp_path: Path) -> Iterator[Path]:
    d = Path(os.path.join("/tmp", f"rdp-{os.getpid()}-{tmp_path.name[-8:]}"))  # short: unix socket paths
    d.mkdir()
    yield d
    import shutil

    shutil.rmtree(d, ignore_errors=True)


def service(kubelet_dir: Path, uid: str, backend: Backend | None = None) -> KubeletService:
    return KubeletService(DRIVER, Paths.of(str(kubelet_dir), DRIVER, uid), backend or Backend(), HealthFeed())


def test_sockets_per_instance_with_their_own_mode_whatever_the_umask(kubelet_dir: Path) -> None:
    old = os.umask(0)  # the worst umask: a socket bound under it would be connectable by anyone
    try:
        svc = service(kubelet_dir, "pod-a")
        svc.start()
    finally:
        os.umask(old)
    try:
        paths = svc.paths
        assert paths.registration == f"{kubelet_dir}/plugins_registry/{DRIVER}-pod-a-reg.sock"
        assert paths.endpoint == f"{kubelet_dir}/plugins/{DRIVER}/dra-pod-a.sock"
        for p in (paths.registration, paths.endpoint):
            st = os.stat(p)
            assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600, (p, oct(st.st_mode))
        # nothing left of the private bind dirs, and the kubelet's GetInfo names this instance's endpoint
        assert sorted(os.listdir(kubelet_dir / "plugins_registry")) == [f"{DRIVER}-pod-a-reg.sock"]
        with grpc.insecure_channel(f"unix://{paths.registration}") as ch:
            info = reg_grpc.RegistrationStub(ch).GetInfo(reg_pb.InfoRequest(), timeout=10)
        assert (info.name, info.endpoint) == (DRIVER, paths.endpoint)
    finally:
        svc.stop()
    assert not os.path.exists(paths.registration) and not os.path.exists(paths.endpoint)


def test_an_instance_never_removes_a_socket_it_did_not_make(kubelet_dir: Path) -> None:
    old, new = service(kubelet_dir, "pod-old"), service(kubelet_dir, "pod-new")
    old.start()
    new.start()
    new_files = [new.paths.registration, new.paths.endpoint]
    # The old one ends while the new one serves: the new one's sockets stay and answer.
    old.stop()
    assert all(os.path.exists(p) for p in new_files)
    with grpc.insecure_channel(f"unix://{new.paths.registration}") as ch:
        assert reg_grpc.RegistrationStub(ch).GetInfo(reg_pb.InfoRequest(), timeout=10).endpoint == new.paths.endpoint
    # A socket of its own path that another hand replaced is not its own any more: left in place.
    os.unlink(new.paths.endpoint)
    Path(new.paths.endpoint).write_text("someone else's")
    new.stop()
    assert Path(new.paths.endpoint).read_text() == "someone else's"
    assert not os.path.exists(new.paths.registration)
    # The same pod's container restarted: it takes over its own stale socket.
    again = service(kubelet_dir, "pod-new")
    again.start()
    try:
        assert stat.S_ISSOCK(os.stat(again.paths.endpoint).st_mode)
    finally:
        again.stop()


def test_prepares_are_serialized_across_the_instances_of_a_node(kubelet_dir: Path) -> None:
    backend = Backend()
    a, b = service(kubelet_dir, "pod-a", backend), service(kubelet_dir, "pod-b")
    a.start()
    b.start()
    lock = Path(a.paths.lock)
    assert lock == kubelet_dir / "plugins" / DRIVER / "serialize.lock"
    try:
        with grpc.insecure_channel(f"unix://{a.paths.endpoint}") as ch:
            req = pb.NodePrepareResourcesRequest(claims=[pb.Claim(namespace="default", uid="u1", name="c1")])
            call = pb_grpc.DRAPluginStub(ch).NodePrepareResources.future(req, timeout=60)
            assert backend.inside.wait(30)
            # While instance a prepares, the node's lock is held: instance b (or any process) waits.
            fd = os.open(lock, os.O_RDWR)
            try:
                with pytest.raises(OSError) as held:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                assert held.value.errno in (errno.EWOULDBLOCK, errno.EAGAIN)
                backend.release.set()
                answer = call.result()
                assert answer.claims["u1"].devices[0].device_name == "mlx5-bond-0"
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # free once the prepare answered
            finally:
                os.close(fd)
    finally:
        backend.release.set()
        a.stop()
        b.stop()


def test_the_newest_live_instance_publishes(kubelet_dir: Path) -> None:
    plugin_dir = str(kubelet_dir / "plugins" / DRIVER)
    old, new = Instances(plugin_dir, "0" * 20), Instances(plugin_dir, "1" * 20)
    old.start()
    assert old.newest()
    new.start()
    assert new.newest() and not old.newest()
    new.stop()  # the new one rolled back or died: the old one publishes again
    assert old.newest()
    old.stop()


@pytest.mark.parametrize("bad", ["../../etc", "a/b", "-x", "x" * 64, "a b"])
def test_an_instance_uid_that_is_not_a_name_is_refused(bad: str) -> None:
    with pytest.raises(ValueError, match=r"--instance-uid .*use the pod's UID"):
        instance_uid(bad)
    assert len(instance_uid("")) == 36 and instance_uid("0f1e2d3c-aaaa-bbbb-cccc-0123456789ab")


def test_a_long_kubelet_dir_shortens_the_uid_in_the_socket_names() -> None:
    """A unix socket address holds 107 bytes: k3s' kubelet dir with a pod UID in full does not fit."""
    uid = "0f1e2d3c-aaaa-bbbb-cccc-0123456789ab"
    plain = Paths.of("/var/lib/kubelet", "rdma.lingjun.io", uid)
    assert plain.registration == f"/var/lib/kubelet/plugins_registry/rdma.lingjun.io-{uid}-reg.sock"
    k3s = Paths.of("/var/lib/rancher/k3s/agent/kubelet", "rdma.lingjun.io", uid)
    assert len(k3s.registration) <= 107 and len(k3s.endpoint) <= 107
    short = k3s.registration.rsplit("rdma.lingjun.io-", 1)[1][: -len("-reg.sock")]
    assert uid.startswith(short) and len(short) >= 8 and k3s.endpoint.endswith(f"/dra-{short}.sock")
    with pytest.raises(ValueError, match="longer than a unix socket address allows"):
        Paths.of("/" + "k" * 90, "rdma.lingjun.io", uid)
