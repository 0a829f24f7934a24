"""The NICs' port counters as Prometheus counters: read from a kernel-shaped fixture at scrape time
only, units and saturation as the kernel declares them, and over HTTP from a real ``serve``."""

from __future__ import annotations

import urllib.request
from collections.abc import Iterable
from pathlib import Path

import pytest
from conftest import free_port
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from rdma_device_plugin import port_counters
from rdma_device_plugin.kubesim import KubeletSimulator
from rdma_device_plugin.metrics import MetricsHooks
from rdma_device_plugin.node import fixtures, portcounters, sysfs

RES = "rdma/hca"
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def _parse(text: str) -> Samples:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def _get(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), float("nan"))


def _collector_rig(
    fx: fixtures.FixtureNode, monkeypatch: pytest.MonkeyPatch
) -> tuple[MetricsHooks, list[tuple[str, int]]]:
    """The metrics hooks as serve builds them (their own registry, the sysfs root), fed the NICs of a
    re-list; every read of a port's counters (through the one reader) is recorded."""
    reads: list[tuple[str, int]] = []
    real = portcounters.read_port

    def recording(root: str, nic: str, port: int, names: Iterable[str] | None = None) -> dict[str, int]:
        reads.append((nic, port))
        return real(root, nic, port, names)

    monkeypatch.setattr(portcounters, "read_port", recording)
    hooks = MetricsHooks(sysfs_root=fx.sysfs)
    hooks.nics_found(sysfs.read_nics(fx.sysfs, fx.dev))
    return hooks, reads


def test_counters_read_at_scrape_time_only(node: fixtures.FixtureNode, monkeypatch: pytest.MonkeyPatch) -> None:
    hooks, reads = _collector_rig(node, monkeypatch)
    assert reads == []  # registered and fed NICs: nothing read yet (no cost while nobody scrapes)
    node.bump_counter("mlx5_bond_0", "port_rcv_data", 1000)
    node.bump_counter("mlx5_bond_0", "port_xmit_data", 250)
    node.bump_counter("mlx5_bond_1", "np_ecn_marked_roce_packets", 7)
    node.bump_counter("mlx5_bond_1", "np_cnp_sent", 3)
    node.bump_counter("mlx5_bond_2", "symbol_error", 2)
    node.bump_counter("mlx5_bond_2", "link_downed", 1)
    node.bump_counter("mlx5_bond_3", "out_of_sequence", 5)
    node.bump_counter("mlx5_bond_3", "local_ack_timeout_err", 4)
    m = _parse(generate_latest(hooks.registry).decode())
    assert sorted(reads) == [(f"mlx5_bond_{i}", 1) for i in range(4)]  # one read per port per scrape
    # port_*_data counts 4-octet words (Documentation/ABI/stable/sysfs-class-infiniband)
    assert _get(m, "rdma_dp_port_receive_bytes_total", nic="mlx5_bond_0", port="1") == 4000
    assert _get(m, "rdma_dp_port_transmit_bytes_total", nic="mlx5_bond_0", port="1") == 1000
    assert _get(m, "rdma_dp_port_ecn_marked_packets_total", nic="mlx5_bond_1", port="1") == 7
    assert _get(m, "rdma_dp_port_cnp_sent_packets_total", nic="mlx5_bond_1", port="1") == 3
    assert _get(m, "rdma_dp_port_symbol_errors_total", nic="mlx5_bond_2", port="1") == 2
    assert _get(m, "rdma_dp_port_link_downed_total", nic="mlx5_bond_2", port="1") == 1
    assert _get(m, "rdma_dp_port_out_of_sequence_packets_total", nic="mlx5_bond_3", port="1") == 5
    assert _get(m, "rdma_dp_port_local_ack_timeouts_total", nic="mlx5_bond_3", port="1") == 4
    assert _get(m, "rdma_dp_port_receive_bytes_total", nic="mlx5_bond_1", port="1") == 0
    # a counter the NIC does not have (not in the fixture, as on a NIC without roce_accl): no series
    assert not [k for k in m if k[0] == "rdma_dp_port_adaptive_retransmits_total"]
    assert not [k for k in m if k[0] == port_counters.SATURATED]
    node.bump_counter("mlx5_bond_0", "port_rcv_data", 1)
    m = _parse(generate_latest(hooks.registry).decode())
    assert _get(m, "rdma_dp_port_receive_bytes_total", nic="mlx5_bond_0", port="1") == 4004  # read again, fresh
    assert len(reads) == 8


def test_saturated_counters_are_marked(node: fixtures.FixtureNode, monkeypatch: pytest.MonkeyPatch) -> None:
    """IB PortCounters stop at their width's maximum: a 4-bit counter at 15 reads a rate of 0 while
    errors go on, so it is marked; one below its maximum and a 64-bit data counter past 2**32 are not."""
    hooks, _ = _collector_rig(node, monkeypatch)
    node.bump_counter("mlx5_bond_0", "local_link_integrity_errors", 15)
    node.bump_counter("mlx5_bond_0", "excessive_buffer_overrun_errors", 14)
    node.bump_counter("mlx5_bond_1", "symbol_error", 65535)
    node.bump_counter("mlx5_bond_2", "port_rcv_data", 5 * 2**32)  # extended (64-bit) counter
    node.bump_counter("mlx5_bond_3", "link_downed", 255)
    m = _parse(generate_latest(hooks.registry).decode())
    marked = sorted(
        (dict(labels)["nic"], dict(labels)["counter"]) for name, labels in m if name == port_counters.SATURATED
    )
    assert marked == [
        ("mlx5_bond_0", "local_link_integrity_errors"),
        ("mlx5_bond_1", "symbol_error"),
        ("mlx5_bond_3", "link_downed"),
    ]
    assert _get(m, "rdma_dp_port_receive_bytes_total", nic="mlx5_bond_2", port="1") == 4 * 5 * 2**32


def test_a_vanished_nic_is_not_read(node: fixtures.FixtureNode, monkeypatch: pytest.MonkeyPatch) -> None:
    hooks, reads = _collector_rig(node, monkeypatch)
    node.remove_nic("mlx5_bond_3")
    hooks.nics_found(sysfs.read_nics(node.sysfs, node.dev))  # the re-list that follows a removal
    m = _parse(generate_latest(hooks.registry).decode())
    assert ("mlx5_bond_3", 1) not in reads
    assert not [k for k in m if dict(k[1]).get("nic") == "mlx5_bond_3"]


def test_every_counter_is_documented_once() -> None:
    """One metric per kernel counter, each in docs/operations.md's metrics table."""
    names = [c.name for c in port_counters.COUNTERS]
    assert len(set(names)) == len(names) and len(set(port_counters.KERNEL_NAMES)) == len(names)
    doc = (Path(__file__).resolve().parents[2] / "docs" / "operations.md").read_text(encoding="utf-8")
    missing = [c.kernel for c in port_counters.COUNTERS if f"`{c.kernel}`" not in doc or f"{c.name}_total" not in doc]
    assert not missing, f"docs/operations.md does not list {missing}"


def test_counters_over_http(sim: KubeletSimulator, start_plugin, node: fixtures.FixtureNode) -> None:  # type: ignore[no-untyped-def]
    port = free_port()
    plugin = start_plugin(extra=["--metrics-address", f"127.0.0.1:{port}"])
    assert sim.wait_registered(RES), plugin.output()
    node.bump_counter("mlx5_bond_2", "rp_cnp_handled", 9)

    def scrape() -> Samples:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
            return _parse(resp.read().decode())

    assert sim.wait_for(
        lambda: _get(scrape(), "rdma_dp_port_cnp_handled_packets_total", nic="mlx5_bond_2", port="1") == 9
    )
