"""Allocate over real gRPC on a unix socket, served in-process by ``PluginServer`` from a pool
fed by a fixture node: answers are built once and reused until the NICs change (issue 11)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import pytest

from rdma_device_plugin import nccl_env
from rdma_device_plugin.api import deviceplugin_pb2 as pb
from rdma_device_plugin.api import deviceplugin_pb2_grpc as pb_grpc
from rdma_device_plugin.config import load_config_text
from rdma_device_plugin.resources import PoolView, ResourcePool, build_pools
from rdma_device_plugin.server import PluginServer
from rdma_node import fixtures, sysfs

SPEC0 = next(n for n in fixtures.lingjun_node(nics=4).nics if n.name == "mlx5_bond_0")  # the conftest `node`
SERVER_LOG = "rdma_device_plugin.server"


def rename_bond0(node: fixtures.FixtureNode, pool: ResourcePool) -> None:
    """LAG re-formation: the same PCI function comes back as rocep31s0; discovery re-lists."""
    node.remove_nic("mlx5_bond_0")
    node.add_nic(replace(SPEC0, name="rocep31s0"))
    pool.set_nics(sysfs.read_nics(node.sysfs, node.dev))


@pytest.fixture
def serve(node: fixtures.FixtureNode, dp_dir: Path) -> Iterator[Any]:
    servers: list[PluginServer] = []

    def start(config: str) -> tuple[ResourcePool, Any, PluginServer]:
        pool = build_pools(load_config_text(config))[0]
        pool.set_nics(sysfs.read_nics(node.sysfs, node.dev))
        server = PluginServer(pool, str(dp_dir), f"t{len(servers)}.sock")
        server.start()
        servers.append(server)
        channel = grpc.insecure_channel(f"unix://{server.path}")
        stub = pb_grpc.DevicePluginStub(channel)

        def allocate(*ids: str) -> dict[str, str]:
            req = pb.AllocateRequest()
            req.container_requests.add(devices_ids=list(ids))
            return dict(stub.Allocate(req, timeout=30).container_responses[0].envs)

        return pool, allocate, server

    yield start
    for server in servers:
        server.stop()


def answers(caplog: pytest.LogCaptureFixture, level: int, message: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == SERVER_LOG and r.levelno == level and r.getMessage() == message]


def test_shared_answer_is_rebuilt_when_a_nic_is_renamed(  # type: ignore[no-untyped-def]
    serve, node: fixtures.FixtureNode, caplog: pytest.LogCaptureFixture
) -> None:
    """The shared answer is the same for every pod while the NICs stay: built (and logged at
    INFO) once, then reused; a NIC renamed in place rebuilds it, so no pod gets the old name."""
    caplog.set_level(logging.INFO, logger=SERVER_LOG)
    pool, allocate, _ = serve("{}")
    before = "mlx5_bond_0,mlx5_bond_1,mlx5_bond_2,mlx5_bond_3"
    assert [allocate(f"hca-{i}")["RDMA_DEVICES"] for i in (0, 7, 999)] == [before] * 3
    built = answers(caplog, logging.INFO, "Allocate answer")
    assert len(built) == 1 and built[0].nics == before  # type: ignore[attr-defined]
    assert not answers(caplog, logging.INFO, "allocated")  # no INFO line per call
    rename_bond0(node, pool)
    assert allocate("hca-0")["RDMA_DEVICES"] == "mlx5_bond_1,mlx5_bond_2,mlx5_bond_3,rocep31s0"
    assert allocate("hca-1")["RDMA_DEVICES"] == "mlx5_bond_1,mlx5_bond_2,mlx5_bond_3,rocep31s0"
    assert len(answers(caplog, logging.INFO, "Allocate answer")) == 2


def test_shared_answer_drops_a_removed_nic_and_takes_it_back(serve, node: fixtures.FixtureNode) -> None:  # type: ignore[no-untyped-def]
    pool, allocate, _ = serve("{}")
    assert "mlx5_bond_2" in allocate("hca-0")["RDMA_DEVICES"]
    node.remove_nic("mlx5_bond_2")
    pool.set_nics(sysfs.read_nics(node.sysfs, node.dev))
    assert allocate("hca-0")["RDMA_DEVICES"] == "mlx5_bond_0,mlx5_bond_1,mlx5_bond_3"
    node.add_nic(next(n for n in fixtures.lingjun_node(nics=4).nics if n.name == "mlx5_bond_2"))
    pool.set_nics(sysfs.read_nics(node.sysfs, node.dev))
    assert allocate("hca-0")["RDMA_DEVICES"] == "mlx5_bond_0,mlx5_bond_1,mlx5_bond_2,mlx5_bond_3"


def test_exclusive_answer_is_rebuilt_when_its_nic_is_renamed(serve, node: fixtures.FixtureNode) -> None:  # type: ignore[no-untyped-def]
    pool, allocate, _ = serve("mode: exclusive")
    assert allocate(SPEC0.pci_address)["RDMA_DEVICES"] == "mlx5_bond_0"
    assert allocate(SPEC0.pci_address)["RDMA_DEVICES"] == "mlx5_bond_0"
    rename_bond0(node, pool)
    assert allocate(SPEC0.pci_address)["RDMA_DEVICES"] == "rocep31s0"


def test_every_call_is_logged_at_debug(serve, caplog: pytest.LogCaptureFixture) -> None:  # type: ignore[no-untyped-def]
    caplog.set_level(logging.DEBUG, logger=SERVER_LOG)
    _, allocate, _ = serve("{}")
    for i in range(3):
        allocate(f"hca-{i}")
    calls = answers(caplog, logging.DEBUG, "allocated")
    assert len(calls) == 3 and all(r.resource == "rdma/hca" for r in calls)  # type: ignore[attr-defined]


def test_a_relist_that_finds_the_same_nics_keeps_the_answer(  # type: ignore[no-untyped-def]
    serve, node: fixtures.FixtureNode, caplog: pytest.LogCaptureFixture
) -> None:
    """Discovery re-lists every rediscoveryIntervalSeconds: finding the same NICs must neither
    rebuild (and re-log) the answer nor keep the replaced answers of earlier NIC sets around."""
    caplog.set_level(logging.INFO, logger=SERVER_LOG)
    pool, allocate, _ = serve("{}")
    allocate("hca-0")
    for _ in range(3):
        pool.set_nics(sysfs.read_nics(node.sysfs, node.dev))
        allocate("hca-1")
    assert len(answers(caplog, logging.INFO, "Allocate answer")) == 1
    for _ in range(3):  # three real changes: each rebuilds once, and only the last answer is kept
        node.set_port_state("mlx5_bond_1", "DOWN")  # a re-list reads port states too: a changed Nic
        pool.set_nics(sysfs.read_nics(node.sysfs, node.dev))
        node.set_port_state("mlx5_bond_1", "ACTIVE")
        pool.set_nics(sysfs.read_nics(node.sysfs, node.dev))
        allocate("hca-2")
    assert len(answers(caplog, logging.INFO, "Allocate answer")) == 4
    assert len(pool.view.responses) == 1


@pytest.mark.parametrize("mode", ["shared", "exclusive"])
def test_a_relist_between_the_answer_and_its_caching_never_keeps_the_old_nics(  # type: ignore[no-untyped-def]
    serve, node: fixtures.FixtureNode, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 30: the pool hands out an answer, and a re-list changes the NICs (bond_0 renamed by
    a LAG re-formation) before the gRPC layer caches that answer: the interleaving is forced here
    (right after the view the call read built its answer). The old answer may go to the call that
    asked before the re-list, never to a later one."""
    pool, allocate, _ = serve(f"mode: {mode}")
    ids = ("hca-0",) if mode == "shared" else (SPEC0.pci_address,)
    before, after = (
        ("mlx5_bond_0,mlx5_bond_1,mlx5_bond_2,mlx5_bond_3", "mlx5_bond_1,mlx5_bond_2,mlx5_bond_3,rocep31s0")
        if mode == "shared"
        else ("mlx5_bond_0", "rocep31s0")
    )
    original = PoolView.allocate
    relisted = False

    def allocate_then_relist(view: PoolView, device_ids: Any) -> Any:
        nonlocal relisted
        answer = original(view, device_ids)
        if not relisted:  # once: between the pool's answer and the servicer's cache
            relisted = True
            rename_bond0(node, pool)
        return answer

    monkeypatch.setattr(PoolView, "allocate", allocate_then_relist)
    assert allocate(*ids)["RDMA_DEVICES"] == before  # asked before the re-list: the NICs then
    assert relisted
    for _ in range(3):
        assert allocate(*ids)["RDMA_DEVICES"] == after


def test_allocate_and_the_streams_are_answered_while_a_relist_is_half_done(  # type: ignore[no-untyped-def]
    serve, node: fixtures.FixtureNode, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 30 (one owner): a re-list held the pool lock 0.3-0.45 s at 64 NICs, and Allocate and
    every stream waited for it. Here the re-list (bond_0 renamed) is stopped half-way, in its GID
    reads, until the test lets it go: Allocate and a new stream are answered
    meanwhile from the view published before it, and the re-list's NICs from the next call on."""
    pool, allocate, server = serve("{}")
    before = "mlx5_bond_0,mlx5_bond_1,mlx5_bond_2,mlx5_bond_3"
    assert allocate("hca-0")["RDMA_DEVICES"] == before
    inside, release = threading.Event(), threading.Event()
    read_facts = nccl_env.nic_facts

    def held_facts(*args: Any, **kwargs: Any) -> Any:
        inside.set()
        release.wait(120)  # until the test has asked its questions (a bound only against a hang)
        return read_facts(*args, **kwargs)

    monkeypatch.setattr(nccl_env, "nic_facts", held_facts)
    relist = threading.Thread(target=rename_bond0, args=(node, pool), name="re-list")
    relist.start()
    try:
        assert inside.wait(30), "the re-list never reached its GID reads"
        assert allocate("hca-1")["RDMA_DEVICES"] == before  # the NICs of the published view
        stub = pb_grpc.DevicePluginStub(grpc.insecure_channel(f"unix://{server.path}"))
        first = next(iter(stub.ListAndWatch(pb.Empty(), timeout=30)))
        assert len(first.devices) == 1000 and all(d.health == "Healthy" for d in first.devices)
        assert relist.is_alive()  # all of that while the re-list was still half-done
    finally:
        release.set()
        relist.join(30)
    assert allocate("hca-2")["RDMA_DEVICES"] == "mlx5_bond_1,mlx5_bond_2,mlx5_bond_3,rocep31s0"
