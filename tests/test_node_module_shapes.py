"""Issue 32: the node shapes a validation must get right, through the real module (AnsiballZ, the
rdma_node module_utils), each with its expected verdict as validate.yml records it (the
rdma_validation fact of a hostNetwork inventory). The healthy shapes pass with no false failure;
each broken one fails naming the NIC, port or PCIe device."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from conftest import node_info, node_info_run
from rdma_device_plugin.node import fixtures


def _fact(root: Path, spec: fixtures.NodeSpec, **options: Any) -> dict[str, Any]:
    node = fixtures.write_node(str(root), spec)
    args = {"sysfs_root": node.sysfs, "procfs_root": node.procfs, "dev_root": node.dev}
    args |= {"record_host": "node-1", "health_record": True, "counter_interval": 1, **options}
    run = node_info_run(sys.executable, args)
    assert run.returncode == 0, run.stdout + run.stderr
    result: dict[str, Any] = json.loads(run.stdout)["plays"][0]["tasks"][0]["hosts"]["localhost"]
    fact: dict[str, Any] = result["ansible_facts"]["rdma_validation"]
    return fact


def _failed(fact: dict[str, Any]) -> list[str]:
    return sorted(c["message"] for c in fact["checks"] if not c["passed"])


def _passes(fact: dict[str, Any]) -> dict[str, int]:
    return {name: n for per_role in fact["passed_checks"].values() for name, n in per_role.items()}


def _lingjun(fact: dict[str, Any]) -> None:
    assert fact["summary"]["nic_count"] == 4 and fact["summary"]["bonds"]["mlx5_bond_0"] == "802.3ad"


def _dgx(fact: dict[str, Any]) -> None:
    # 8 InfiniBand compute NICs; the Ethernet storage ports (MTU 1500, trust pcp) listed, not held to RoCE settings
    s = fact["summary"]
    assert s["nic_count"] == 8 and s["link_layers"] == ["InfiniBand"] and s["storage"] == ["mlx5_8", "mlx5_9"]
    assert s["port_rates"] == ["400 Gb/sec (4X NDR)"] and s["gid_family"] is None
    assert not {"roce_trust", "roce_pfc", "roce_ecn", "gid_index", "netdev_link"} & set(_passes(fact))


def _lag(fact: dict[str, Any]) -> None:
    assert set(fact["summary"]["bonds"].values()) == {"active-backup"} and "lacp" not in _passes(fact)


def _sriov(fact: dict[str, Any]) -> None:
    # VFs are counted, their RDMA devices listed; none is checked (14 false failures on this shape before)
    s = fact["summary"]
    assert s["nics"] == ["mlx5_0", "mlx5_1"] and s["vfs"] == 16
    assert s["ignored"] == ["mlx5_2", "mlx5_3", "mlx5_4", "mlx5_5"]
    assert _passes(fact)["port_state"] == 2 and _passes(fact)["pcie_link"] == 4  # two PFs, each link and uplink


def _numa0(fact: dict[str, Any]) -> None:
    assert _passes(fact)["gpu_nic_numa"] == 8


def _ipv4(fact: dict[str, Any]) -> None:
    assert fact["summary"]["gid_family"] == "AF_INET" and set(fact["summary"]["gid_index"].values()) == {3}


def _extra_ipv6(fact: dict[str, Any]) -> None:
    # NCCL picks per device: index 5 on the NIC with the extra IPv6 address is no fault (it was)
    gid = fact["summary"]["gid_index"]
    assert gid == {"mlx5_bond_0": 3, "mlx5_bond_1": 5, "mlx5_bond_2": 3, "mlx5_bond_3": 3}


def _grace(fact: dict[str, Any]) -> None:
    # every device under its own root port: GPUs and NICs meet at the NUMA level only
    topology = fact["summary"]["topology"]
    assert topology["mlx5_0"] == {"switch": [], "root_port": [], "numa": ["0001:01:00.0", "0003:01:00.0"]}
    assert _passes(fact)["gpu_nic_numa"] == 4 and _passes(fact)["pcie_link"] == 4


HEALTHY: dict[str, Callable[[dict[str, Any]], None]] = {
    "lingjun": _lingjun,
    "dgx-h100": _dgx,
    "roce-lag-active-backup": _lag,
    "sriov": _sriov,
    "numa0-gpus": _numa0,
    "ipv4-roce": _ipv4,
    "ipv4-roce-extra-ipv6": _extra_ipv6,
    "grace": _grace,
}


def test_every_shape_has_a_verdict() -> None:
    assert set(HEALTHY) == set(fixtures.SHAPES)


@pytest.mark.parametrize("shape", sorted(HEALTHY))
def test_a_healthy_node_of_each_shape_passes(tmp_path: Path, shape: str) -> None:
    fact = _fact(tmp_path / shape, fixtures.SHAPES[shape]())
    assert _failed(fact) == []
    assert fact["summary"]["health"] == "passed"
    HEALTHY[shape](fact)


def _ib_port_at_2x(spec: fixtures.NodeSpec) -> fixtures.NodeSpec:
    return fixtures.with_nic_changes(spec, "mlx5_3", rate="200 Gb/sec (2X NDR)")


BROKEN = [
    pytest.param(
        "dgx-h100",
        _ib_port_at_2x,
        {},
        ["mlx5_3: port 1 runs at 200 Gb/sec (2X NDR), below the 400 Gb/sec (4X NDR) of mlx5_0 (same model 15b3:1021)"],
        id="dgx-ndr-port-at-2x",
    ),
    pytest.param(
        "sriov",
        lambda spec: replace(spec, pcie_bridge_width={"0000:16:00.0": 8}),
        {},
        ["mlx5_0 PCIe 0000:16:00.0 (switch uplink above 0000:1a:00.0): link runs at 32 GT/s x8, expected 32 GT/s x16"],
        id="sriov-switch-uplink-x8",
    ),
    pytest.param(
        "ipv4-roce-extra-ipv6",
        lambda spec: spec,
        {"nccl_gid_index": 3},
        ["mlx5_bond_1: port 1: NCCL_IB_GID_INDEX=3 (pinned by the deployment) is 3 (RoCE v2 2001:db8:1::11)"],
        id="gid-index-pinned",
    ),
    pytest.param(
        "grace",
        lambda spec: fixtures.with_nic_changes(spec, "mlx5_2", pcie_width=8),
        {},
        ["mlx5_2 PCIe 0004:01:00.0: link runs at 32 GT/s x8, expected 32 GT/s x16"],
        id="grace-nic-x8",
    ),
    pytest.param(
        "roce-lag-active-backup",
        lambda spec: fixtures.with_nic_changes(spec, "mlx5_bond_0", members_down=("eth1",)),
        {},
        ["mlx5_bond_0 (bond0): slave eth1 MII status down", "mlx5_bond_0: eth1 is down (no carrier)"],
        id="lag-backup-member-down",
    ),
]


@pytest.mark.parametrize(("shape", "breaks", "options", "messages"), BROKEN)
def test_a_broken_node_of_a_shape_fails_naming_the_device(
    tmp_path: Path,
    shape: str,
    breaks: Callable[[fixtures.NodeSpec], fixtures.NodeSpec],
    options: dict[str, Any],
    messages: list[str],
) -> None:
    fact = _fact(tmp_path / shape, breaks(fixtures.SHAPES[shape]()), **options)
    failed = _failed(fact)
    assert len(failed) == len(messages), failed
    for got, want in zip(failed, sorted(messages), strict=True):
        assert got.startswith(want) and ". Fix: " in got, (got, want)


def test_the_counters_of_the_previous_run_are_kept_per_host_on_the_controller(tmp_path: Path) -> None:
    """The action plugin reads <counter_baseline_dir>/<host>.json into the module and writes the new values
    back; the 4-bit counter growing between two runs fails the NIC until its counters are reset."""
    node = fixtures.write_node(str(tmp_path / "n"), fixtures.lingjun_node(nics=2))
    stored = tmp_path / "out" / "counters"
    roots = [f"sysfs_root={node.sysfs}", f"procfs_root={node.procfs}", f"dev_root={node.dev}"]
    args = [*roots, f"counter_baseline_dir={stored}", "counter_interval=0"]
    first = node_info(sys.executable, *args)
    saved = json.loads((stored / "localhost.json").read_text())
    assert set(saved["nics"]) == {"mlx5_bond_0", "mlx5_bond_1"}
    assert "counter_baseline_next" not in first["node"]  # kept on disk, not in the controller's memory
    assert first["node"]["summary"]["rdma_node_health"]["health"] == "passed"
    node.bump_counter("mlx5_bond_1", "excessive_buffer_overrun_errors")
    for _ in range(2):  # the stored values stay those it is judged against while it fails
        again = node_info(sys.executable, *args)
        rows = again["node"]["checks"]["rdma_node_health"]
        bad = [r["message"] for r in rows if not r["passed"]]
        assert len(bad) == 1 and bad[0].startswith(
            "mlx5_bond_1: error counters grew: port 1 excessive_buffer_overrun_errors 0 -> 1 since the previous run ("
        )
        assert (
            json.loads((stored / "localhost.json").read_text())["nics"]["mlx5_bond_1"] == saved["nics"]["mlx5_bond_1"]
        )
