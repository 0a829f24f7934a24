"""The real ``serve`` process against the kubelet simulator over real unix sockets."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from conftest import plugin_socket, serve_command

from rdma_device_plugin import sockets
from rdma_device_plugin.api import deviceplugin_pb2 as pb
from rdma_device_plugin.api import deviceplugin_pb2_grpc as pb_grpc
from rdma_kubesim import CHECKPOINT, AllocationFailed, KubeletSimulator
from rdma_node import fixtures

RES = "rdma/hca"


def test_registers_and_advertises_1k(sim: KubeletSimulator, start_plugin, dp_dir: Path) -> None:  # type: ignore[no-untyped-def]
    plugin = start_plugin()
    assert sim.wait_registered(RES), plugin.output()
    assert sim.node_status() == {"capacity": {RES: "1k"}, "allocatable": {RES: "1k"}}
    ep = sim.endpoints[RES]
    parsed = sockets.parse(ep.socket)  # rdma-dp-rdma_hca.<instance>.<start>.sock, a file of the dir
    assert parsed is not None and parsed.base == "rdma-dp-rdma_hca" and parsed.start == 0 and "/" not in ep.socket
    assert not ep.options.pre_start_required and not ep.options.get_preferred_allocation_available
    assert (dp_dir / ep.socket).is_socket()
    assert not sim.rejections


def test_allocate_over_grpc(sim: KubeletSimulator, start_plugin) -> None:  # type: ignore[no-untyped-def]
    start_plugin()
    assert sim.wait_registered(RES)
    alloc = sim.allocate(RES, 1, pod="p1")
    assert alloc.device_paths == [f"/dev/infiniband/uverbs{i}" for i in (1, 2, 3, 0)] + ["/dev/infiniband/rdma_cm"]
    assert alloc.envs["RDMA_DEVICES"] == "mlx5_bond_0,mlx5_bond_1,mlx5_bond_2,mlx5_bond_3"
    second = sim.allocate(RES, 1, pod="p2")
    assert second.ids != alloc.ids  # the simulator never hands out an allocated device twice


def test_unknown_device_id_is_rejected(sim: KubeletSimulator, start_plugin, dp_dir: Path) -> None:  # type: ignore[no-untyped-def]
    start_plugin()
    assert sim.wait_registered(RES)
    with grpc.insecure_channel(f"unix://{plugin_socket(dp_dir)}") as ch:
        req = pb.AllocateRequest()
        req.container_requests.add(devices_ids=["hca-5000"])
        with pytest.raises(grpc.RpcError) as err:
            pb_grpc.DevicePluginStub(ch).Allocate(req, timeout=5)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "hca-5000" in (err.value.details() or "")


def test_health_flip_reaches_kubelet_within_a_second(
    sim: KubeletSimulator, start_plugin, node: fixtures.FixtureNode
) -> None:  # type: ignore[no-untyped-def]
    start_plugin()
    assert sim.wait_registered(RES)
    t0 = time.monotonic()
    node.set_port_state("mlx5_bond_2", "DOWN")
    assert sim.wait_for(lambda: sim.allocatable(RES) == 0, timeout=60)
    # The bound is the plugin's (a probe every 0.1 s, the update pushed at once), read from when the
    # kubelet took the update in: not from when this thread got the CPU back to look.
    took_in = next(t for t, _, healthy in sim.endpoints[RES].snapshots if healthy == 0)
    assert took_in - t0 < 1.5
    assert sim.capacity(RES) == 1000
    with pytest.raises(AllocationFailed, match="no healthy devices present"):
        sim.allocate(RES, 1)
    node.set_port_state("mlx5_bond_2", "ACTIVE")
    assert sim.wait_for(lambda: sim.allocatable(RES) == 1000, timeout=60)


def test_hot_plug_remove_and_add(sim: KubeletSimulator, start_plugin, node: fixtures.FixtureNode) -> None:  # type: ignore[no-untyped-def]
    start_plugin({"version": "v1", "health": {"policy": "any"}})
    assert sim.wait_registered(RES)
    node.remove_nic("mlx5_bond_3")
    time.sleep(1.0)
    alloc = sim.allocate(RES, 1, pod="a")
    assert "mlx5_bond_3" not in alloc.envs["RDMA_DEVICES"]
    assert "/dev/infiniband/uverbs0" not in alloc.device_paths
    spec = fixtures.NicSpec(
        name="mlx5_bond_9", pci_address="0000:9a:00.0", uverbs=9, netdevs=("eth18", "eth19"), bond="bond9"
    )
    node.add_nic(spec)
    deadline = time.monotonic() + 5
    for attempt in range(1000):  # a new pod each time: the kubelet never calls Allocate twice for one container
        assert time.monotonic() < deadline
        alloc = sim.allocate(RES, 1, pod=f"b{attempt}")
        if "mlx5_bond_9" in alloc.envs["RDMA_DEVICES"]:
            break
        time.sleep(0.2)
    assert "/dev/infiniband/uverbs9" in alloc.device_paths


def test_kubelet_restart_reregisters_within_2s(sim: KubeletSimulator, start_plugin, dp_dir: Path) -> None:  # type: ignore[no-untyped-def]
    start_plugin()
    assert sim.wait_registered(RES)
    sim.allocate(RES, 1, pod="keep")
    checkpoint = (dp_dir / CHECKPOINT).read_text(encoding="utf-8")
    for _ in range(3):
        sim.restart()
        assert sim.wait_registered(RES, timeout=60)
        # The bound is the plugin's reaction, from the new kubelet's start to its Register, as the
        # kubelet recorded them: not the simulator's own stop (its server's grace, its threads' joins)
        # nor this thread's wake-up, which a loaded machine stretches past 2 s on their own.
        registered = next(t for t, r in sim.registrations if r == RES and t >= sim.started_at)
        assert registered - sim.started_at < 2.0
        assert sim.node_status()["allocatable"] == {RES: "1k"}
    # the checkpoint file is the kubelet's: only the simulator wrote it, with the same allocation
    assert (
        json.loads((dp_dir / CHECKPOINT).read_text())["Data"]["PodDeviceEntries"]
        == json.loads(checkpoint)["Data"]["PodDeviceEntries"]
    )


def test_plugin_survives_kubelet_absent_at_start(dp_dir: Path, start_plugin) -> None:  # type: ignore[no-untyped-def]
    plugin = start_plugin()
    time.sleep(1.0)
    assert plugin.proc.poll() is None
    sim = KubeletSimulator(str(dp_dir)).start()
    try:
        assert sim.wait_registered(RES, timeout=60), plugin.output()
    finally:
        sim.stop()


def test_lost_plugin_socket_is_recreated(sim: KubeletSimulator, start_plugin, dp_dir: Path) -> None:  # type: ignore[no-untyped-def]
    start_plugin()
    assert sim.wait_registered(RES)
    first = plugin_socket(dp_dir)
    os.unlink(first)
    assert sim.wait_registered(RES, count=2, timeout=60)
    again = plugin_socket(dp_dir)  # a name is used once: the next start of the same instance
    assert again.is_socket() and again != first
    assert sockets.parse(again.name).instance == sockets.parse(first.name).instance  # type: ignore[union-attr]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_clean_shutdown(sim: KubeletSimulator, start_plugin, dp_dir: Path, sig: int) -> None:  # type: ignore[no-untyped-def]
    plugin = start_plugin()
    assert sim.wait_registered(RES)
    rc, took = plugin.stop(sig)
    assert rc == 0 and took < 5.0
    assert not sockets.instances(str(dp_dir), RES)
    assert (dp_dir / "kubelet.sock").exists() and (dp_dir / CHECKPOINT).exists()


def test_two_resources_register_separately(sim: KubeletSimulator, start_plugin) -> None:  # type: ignore[no-untyped-def]
    start_plugin(
        {
            "resources": [
                {"name": "rdma/hca", "sharedDevices": 10, "selectors": {"ifNames": ["bond0", "bond1"]}},
                {"name": "rdma/hca_b", "sharedDevices": 20, "selectors": {"rdmaDevices": ["mlx5_bond_2"]}},
            ]
        }
    )
    assert sim.wait_registered("rdma/hca") and sim.wait_registered("rdma/hca_b")
    assert sim.node_status()["capacity"] == {"rdma/hca": "10", "rdma/hca_b": "20"}
    assert sim.allocate("rdma/hca_b").envs["RDMA_DEVICES"] == "mlx5_bond_2"
    assert sim.allocate("rdma/hca").envs["RDMA_DEVICES"] == "mlx5_bond_0,mlx5_bond_1"


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        ("mode: turbo\n", "mode: Input should be 'shared' or 'exclusive'"),
        ("resources:\n- name: Rdma/hca\n", "resources[0].name: invalid resource name 'Rdma/hca'"),
        (
            "resources:\n- {name: rdma/hca, sharedDevices: -1}\n",
            "sharedDevices: Input should be greater than or equal to 1",
        ),
        ("resources:\n- {name: rdma/a}\n- {name: rdma/a}\n", "duplicate resource name(s) ['rdma/a']"),
        ("surprise: true\n", "surprise: unknown key"),
        (None, "cannot read config file"),
    ],
)
def test_bad_config_exits_before_serving(
    short_tmp: Path, node: fixtures.FixtureNode, dp_dir: Path, config: str | None, expected: str
) -> None:
    path = short_tmp / "bad.yaml"
    if config is not None:
        path.write_text(config, encoding="utf-8")
    proc = subprocess.run(
        serve_command(node, dp_dir, path),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 2
    assert expected in proc.stderr
    assert "Traceback" not in proc.stderr
    assert list(dp_dir.iterdir()) == []


def test_discover_cli(node: fixtures.FixtureNode) -> None:
    base = [sys.executable, "-m", "rdma_device_plugin", "discover", "--sysfs-root", node.sysfs, "--dev-root", node.dev]
    table = subprocess.run(base, capture_output=True, text=True, check=True).stdout
    assert table.splitlines()[0].split()[:2] == ["RDMA", "DEVICE"]
    assert "mlx5_bond_0  0000:1a:00.0" in table and "rdma/hca" in table
    data = json.loads(subprocess.run([*base, "-o", "json"], capture_output=True, text=True, check=True).stdout)
    assert [n["name"] for n in data["nics"]] == ["mlx5_bond_0", "mlx5_bond_1", "mlx5_bond_2", "mlx5_bond_3"]
    assert data["nics"][0]["uverbs"]["path"] == "/dev/infiniband/uverbs1" and data["rdma_cm"] is True
    assert data["nics"][0]["resource"] == "rdma/hca"


def test_nic_usable_as_soon_as_its_uverbs_node_appears(
    sim: KubeletSimulator, start_plugin, node: fixtures.FixtureNode
) -> None:  # type: ignore[no-untyped-def]
    # udev may create /dev/infiniband/uverbsN after the sysfs entry: the NIC must not wait
    # for the (long) rediscovery timer once its node appears.
    uverbs = Path(node.dev, "infiniband", "uverbs1")
    uverbs.unlink()
    start_plugin({"rediscoveryIntervalSeconds": 3600})
    assert sim.wait_registered(RES)
    assert sim.allocatable(RES) == 0
    uverbs.write_text("", encoding="utf-8")
    assert sim.wait_for(lambda: sim.allocatable(RES) == 1000, timeout=3)


@pytest.mark.timeout(60)
def test_the_socket_mode_is_explicit_not_the_umask(
    sim: KubeletSimulator, node: fixtures.FixtureNode, dp_dir: Path, short_tmp: Path
) -> None:
    """Issue 39: a plugin started with umask 000 (a container's may be) serves a socket only root may
    connect to (sockets.SOCKET_MODE), not a world-writable one."""
    log = short_tmp / "umask.log"
    with open(log, "w", encoding="utf-8") as fh:
        proc = subprocess.Popen(serve_command(node, dp_dir), stdout=fh, stderr=subprocess.STDOUT, text=True, umask=0)
        try:
            assert sim.wait_registered("rdma/hca", timeout=30), log.read_text(encoding="utf-8")[-2000:]
            mode = plugin_socket(dp_dir).stat().st_mode & 0o777
        finally:
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=30) == 0
    assert sockets.SOCKET_MODE == 0o600 and mode == sockets.SOCKET_MODE, oct(mode)
