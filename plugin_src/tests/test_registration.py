"""Pieces of the registration state machine: socket names, the stream-end backoff, the
ListAndWatch message serialized once per change."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import grpc
import pytest

from rdma_device_plugin import registration, resources, sockets
from rdma_device_plugin.api import deviceplugin_pb2 as pb
from rdma_device_plugin.api import deviceplugin_pb2_grpc as pb_grpc
from rdma_device_plugin.config import PluginConfig, load_config_text
from rdma_device_plugin.resources import build_pools
from rdma_device_plugin.server import Hooks, PluginServer
from rdma_device_plugin.supervision import BACKOFF_INITIAL_SECONDS, REPEAT_SECONDS, Backoff, LogOnce
from rdma_node import fixtures, sysfs

NAME_IN_A_PID_NAMESPACE = (
    "from rdma_device_plugin import sockets; import os; print(os.getpid(), sockets.socket_name('rdma/hca', 0))"
)


def test_socket_names_parse_and_order_by_instance_start() -> None:
    name = sockets.socket_name("rdma/hca.v2", 3)
    parsed = sockets.parse(name)
    assert parsed is not None and parsed.base == "rdma-dp-rdma_hca-v2" and parsed.start == 3
    assert parsed.instance == sockets.INSTANCE
    older = sockets.parse(sockets.socket_name("rdma/hca", 7, instance="0" * 20))
    newer = sockets.parse(sockets.socket_name("rdma/hca", 0, instance="f" * 20))
    assert older is not None and newer is not None and older < newer
    for other in ("kubelet.sock", "rdma-dp-rdma_hca.sock", "rdma-dp-rdma_hca.xyz.0.sock", "rdma-dp-x.1234.0.sock"):
        assert sockets.parse(other) is None


@pytest.mark.skipif(shutil.which("unshare") is None, reason="unshare (util-linux) is not installed")
def test_two_instances_that_are_pid_1_in_their_pid_namespace_get_different_names() -> None:
    """The plugin is PID 1 in every pod: a name built from the PID (the temporary names were
    `.{pid}.{n}`) is the same in every instance."""
    names = set()
    for _ in range(2):
        run = subprocess.run(
            ["unshare", "--pid", "--fork", sys.executable, "-c", NAME_IN_A_PID_NAMESPACE],
            capture_output=True,
            text=True,
            timeout=60,
        )
        if run.returncode != 0:
            pytest.skip(f"no PID namespace here: {run.stderr.strip()}")
        pid, name = run.stdout.split()
        assert pid == "1"
        names.add(name)
    assert len(names) == 2, names
    assert all(sockets.parse(n) is not None for n in names)


def test_socket_paths_that_do_not_fit_are_refused_with_the_longest_name() -> None:
    from rdma_device_plugin.config import socket_path_problems

    config = load_config_text("resources: [{name: rdma/hca}]", "test")
    fits = "/" + "d" * (107 - len("/rdma-dp-rdma_hca") - sockets.MAX_SUFFIX_LENGTH - 1)
    assert not socket_path_problems(config, fits)
    (problem,) = socket_path_problems(config, fits + "x")
    assert "unix sockets allow 107: shorten the resource name or the device-plugin dir" in problem


def test_a_stream_end_is_registered_again_at_once_and_repeats_back_off() -> None:
    backoff = Backoff()
    assert backoff.cut(100.0) == 0.0 and backoff.due(100.0)
    assert backoff.cut(101.0) == BACKOFF_INITIAL_SECONDS  # again within REPEAT_SECONDS: a repeat
    assert backoff.cut(102.0) == 2 * BACKOFF_INITIAL_SECONDS
    assert backoff.cut(102.0 + REPEAT_SECONDS + 0.1) == 0.0, "a stream end long after the last is a first"


def test_listandwatch_is_serialized_once_per_change_for_every_stream(
    node: fixtures.FixtureNode, dp_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ten open streams, three health changes: every stream gets the same bytes, encoded once (they
    were built and serialized per stream, on the loop that answers Allocate: 40 encodings here)."""
    calls: list[int] = []
    encode = resources.encode_devices

    def counting(devices: Any) -> bytes:
        calls.append(len(devices))
        return encode(devices)

    monkeypatch.setattr(resources, "encode_devices", counting)
    pool = build_pools(PluginConfig())[0]
    pool.set_nics(sysfs.read_nics(node.sysfs, node.dev))
    plugin = PluginServer(pool, str(dp_dir), "feed.sock")
    plugin.start()
    received: list[list[bytes]] = []

    async def watch(n: int) -> None:
        async with grpc.aio.insecure_channel(f"unix://{plugin.path}") as ch:
            stream = pb_grpc.DevicePluginStub(ch).ListAndWatch(pb.Empty())
            got: list[bytes] = []
            async for msg in stream:
                got.append(msg.SerializeToString())
                if len(got) == n:
                    break
            received.append(got)

    async def run() -> None:
        watchers = [asyncio.ensure_future(watch(4)) for _ in range(10)]
        while plugin.open_streams() < 10:
            await asyncio.sleep(0.01)
        for state in ("DOWN", "ACTIVE", "DOWN"):
            node.set_port_state("mlx5_bond_1", state)
            await asyncio.to_thread(pool.set_port_states, sysfs.read_port_states(node.sysfs, ["mlx5_bond_1"]))
            await asyncio.sleep(0.2)
        await asyncio.wait_for(asyncio.gather(*watchers), 60)

    try:
        asyncio.run(run())
    finally:
        plugin.stop()
    # All Healthy, then all Unhealthy; flipping back reuses the first: at most one encoding per
    # change (per distinct device list), not one per stream.
    assert calls == [1000, 1000], "one encoding per device list, whatever the number of streams"
    assert len(received) == 10 and all(r == received[0] for r in received)
    healthy = [sum(d.health == "Healthy" for d in pb.ListAndWatchResponse.FromString(m).devices) for m in received[0]]
    assert healthy == [1000, 0, 1000, 0]


def test_the_real_kubelet_is_found_through_the_build_script_and_its_absence_names_the_fix(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """find_binary(version): an environment variable names a binary, else scripts/kube-build.sh says
    where `make kube` put it; a missing build names `make kube`. The simulator package lives outside
    the plugin's now (plugin_src/kubesim): the build script is still found from its file."""
    from rdma_kubesim import real

    # The build script is found from the simulator package's own file
    assert Path(__file__).resolve().parents[2] / "scripts" / "kube-build.sh" == real._BUILD_SCRIPT
    assert real._BUILD_SCRIPT.exists()
    for version, (env_name, _, _) in real.BINARIES.items():
        monkeypatch.setenv(env_name, str(tmp_path / "nope"))
        binary, why = real.find_binary(version)
        assert binary is None and f"${env_name}={tmp_path / 'nope'} is not an executable file" in why
        monkeypatch.delenv(env_name)
    # Not a checkout: no build script to ask, so the variable is the way
    monkeypatch.setattr(real, "_BUILD_SCRIPT", tmp_path / "absent.sh")
    binary, why = real.find_binary()
    assert binary is None and real.ENV_BINARY in why and "absent.sh" in why
    assert "not a checkout of the repository" in why
    # A checkout where `make kube` has not run: the script names the directory, the binary is missing
    bin_dir = tmp_path / "bin"
    script = tmp_path / "kube-build.sh"
    script.write_text(f'[ "$1" = --print-bin ] && echo {bin_dir}\n', encoding="utf-8")
    monkeypatch.setattr(real, "_BUILD_SCRIPT", script)
    binary, why = real.find_binary()
    assert binary is None and "make kube" in why and str(bin_dir / real.BINARY_NAME) in why
    bin_dir.mkdir()
    found = bin_dir / real.BINARY_NAME
    found.write_text("#!/bin/sh\n", encoding="utf-8")
    found.chmod(0o755)
    assert real.find_binary() == (str(found), "")
    assert real.find_binary("1.32")[0] is None  # the other version is asked with its own flag


def test_the_longest_allocatable_0_window_of_a_recording() -> None:
    from rdma_kubesim.real import longest_zero_window

    up = {"running": True, "allocatable": {"rdma/hca": 1000}}
    down = {"running": True, "allocatable": {"rdma/hca": 0}}
    stopped = {"running": False}
    transitions = [{**up, "ms": 0}, {**down, "ms": 10}, {**up, "ms": 15}, {**stopped, "ms": 40}, {**up, "ms": 52}]
    assert longest_zero_window(transitions, "rdma/hca", 100) == 12  # no kubelet running counts as 0
    assert longest_zero_window([*transitions, {**down, "ms": 80}], "rdma/hca", 100) == 20  # still 0 at the end


def test_a_register_reaches_the_kubelet_start_it_was_pinned_to_never_a_later_one(
    node: fixtures.FixtureNode, dp_dir: Path
) -> None:
    """kubelet.sock opened O_PATH: a kubelet that started since (deleting the plugin sockets, then
    binding a new kubelet.sock) is not reached through the old pin; a pin taken now reaches it."""
    from rdma_kubesim import KubeletSimulator

    pool = build_pools(PluginConfig())[0]
    pool.set_nics(sysfs.read_nics(node.sysfs, node.dev))
    kubelet_sock = str(dp_dir / "kubelet.sock")
    first = KubeletSimulator(str(dp_dir)).start()
    pin = sockets.SocketPin(kubelet_sock)
    assert pin.id == sockets.file_id(kubelet_sock)
    first.stop()
    second = KubeletSimulator(str(dp_dir)).start()
    plugin = PluginServer(pool, str(dp_dir), "pinned.sock")
    plugin.start()
    try:
        assert pin.id != sockets.file_id(kubelet_sock), "a new kubelet.sock"
        with pytest.raises(grpc.RpcError) as refused:
            plugin.register(pin).result(30)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert kubelet_sock in refused.value.details() and "/proc/self/fd" not in refused.value.details()
        assert second.registration_count(pool.name) == 0, "the later kubelet never saw it"
        plugin.register(sockets.SocketPin(kubelet_sock)).result(30)
        assert second.registration_count(pool.name) == 1
    finally:
        plugin.stop()
        second.stop()


def test_a_socket_pin_is_closed_once_by_whoever_owns_it(short_tmp: Path) -> None:
    """Taken by a call: that call closes it (abandon then leaves it, its connect may be under way);
    never taken (cancelled before it started): abandon closes it."""
    import socket

    path = str(short_tmp / "s.sock")
    with socket.socket(socket.AF_UNIX) as listener:
        listener.bind(path)
        fds = len(os.listdir("/proc/self/fd"))
        untaken = sockets.SocketPin(path)
        untaken.abandon()
        assert untaken.take() is None and len(os.listdir("/proc/self/fd")) == fds
        taken = sockets.SocketPin(path)
        target = taken.take()
        assert target is not None and target.startswith("unix:///proc/self/fd/")
        assert taken.take() is None, "one call per pin"
        taken.abandon()
        assert len(os.listdir("/proc/self/fd")) == fds + 1, "still open for the call that took it"
        taken.close()
        taken.close()
        assert len(os.listdir("/proc/self/fd")) == fds


def test_an_older_instance_gone_before_the_takeover_looks_again_is_still_seen_going(
    node: fixtures.FixtureNode, dp_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The older instance stands down as soon as it sees its socket renamed and removes the .retiring
    file; its removal is the newer one's event to register again (on 1.28-1.34 its stream's end cut the
    client registered last). Here it is gone before the newer one looks at the dir again (a loaded
    machine can deschedule it right after its rename): the next pass must still see it go. The peers
    were listed after the renames, and allocatable stayed 0 (test_lifecycle's
    test_an_older_instances_register_reaching_the_kubelet_last_never_leaves_0, 2 of 6 under load)."""
    pool = build_pools(PluginConfig())[0]
    pool.set_nics(sysfs.read_nics(node.sysfs, node.dev))
    reg = registration.Registration(
        pool, str(dp_dir), Hooks(), lambda *a: None, lambda *a: None, LogOnce(logging.getLogger("t"))
    )
    older = sockets.socket_name(pool.name, 0, instance="0" * 20)
    rename = os.rename

    def rename_and_stand_down(src: str, dst: str) -> None:  # the older instance, at once
        rename(src, dst)
        os.unlink(dst)

    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:  # the older instance serves
        listener.bind(str(dp_dir / older))
        listener.listen()
        reg.step(0.0, kubelet_present=False, slow=False)  # serving, the older instance seen
        reg.state = registration.State.REGISTERED  # the kubelet holds our stream (the events' part)
        monkeypatch.setattr(registration.os, "rename", rename_and_stand_down)
        reg._take_over()
        monkeypatch.undo()
    assert not list(dp_dir.glob(f"{older}*"))
    first = reg.server
    try:
        with caplog.at_level(logging.INFO, logger=registration.LOG.name):
            reg.step(1.0, kubelet_present=False, slow=True)
        assert "another instance's socket of rdma/hca went away" in caplog.text
        assert reg.server is not None and reg.server is not first  # a fresh socket, to register again
    finally:
        servers, _ = reg.stop()
        for server in servers:
            server.stop()
