"""Non-hostNetwork mode: start checks on passing and failing fixture nodes, and the pod env."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml
from conftest import serve_command

from rdma_device_plugin import netchecks
from rdma_kubesim import KubeletSimulator
from rdma_node import fixtures, sysfs

RES = "rdma/hca"
NHN = {"version": "v1", "nonHostNetwork": {"enabled": True}}


def _findings(root: Path, spec: fixtures.NodeSpec) -> list[netchecks.Finding]:
    node = fixtures.write_node(str(root), spec)
    return netchecks.read_and_check(sysfs.read_nics(node.sysfs, node.dev), node.sysfs, node.procfs)


def test_checks_pass_on_a_lingjun_node(short_tmp: Path) -> None:
    assert _findings(short_tmp / "ok", fixtures.lingjun_node(nics=4)) == []
    # plain (unbonded) ports pass too: the port netdev owns the GIDs
    assert _findings(short_tmp / "plain", fixtures.lingjun_node(nics=2, bond=False)) == []


def test_gid_netdev_is_the_bond(short_tmp: Path) -> None:
    node = fixtures.write_node(str(short_tmp / "n"), fixtures.lingjun_node(nics=2))
    nics = sysfs.read_nics(node.sysfs, node.dev)
    assert [netchecks.gid_netdev(n) for n in nics] == ["bond0", "bond1"]


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        (
            fixtures.NodeSpec(nics=fixtures.lingjun_node(nics=2).nics, netns_mode="exclusive"),
            [("", "", "netns mode is exclusive")],
        ),
        (
            fixtures.NodeSpec(nics=fixtures.lingjun_node(nics=1).nics, netns_mode=""),
            [("", "", "netns_mode is missing")],
        ),
        (
            fixtures.lingjun_node(nics=2, ipv6=False),
            [("mlx5_bond_0", "bond0", "no global IPv6 address"), ("mlx5_bond_1", "bond1", "no global IPv6 address")],
        ),
        (
            fixtures.with_nic_changes(fixtures.lingjun_node(nics=2), "mlx5_bond_1", ipv6=()),
            [("mlx5_bond_1", "bond1", "no global IPv6 address")],
        ),
        (
            fixtures.with_nic_changes(fixtures.lingjun_node(nics=2), "mlx5_bond_0", roce_v2_ipv6_gid=False),
            [
                (
                    "mlx5_bond_0",
                    "bond0",
                    "no RoCE v2 GID carries 2408:4005:300::11",
                )
            ],
        ),
        (
            fixtures.NodeSpec(nics=fixtures.lingjun_node(nics=1).nics, ipv6_disabled=("bond0",)),
            [("mlx5_bond_0", "bond0", "IPv6 is disabled")],
        ),
    ],
    ids=["netns-exclusive", "netns-unknown", "no-ipv6", "one-nic-no-ipv6", "no-rocev2-gid", "ipv6-disabled"],
)
def test_checks_fail_with_one_finding_per_problem(
    short_tmp: Path, spec: fixtures.NodeSpec, expected: list[tuple[str, str, str]]
) -> None:
    findings = _findings(short_tmp / "bad", spec)
    assert [(f.nic, f.netdev) for f in findings] == [(n, d) for n, d, _ in expected]
    for finding, (_, _, problem) in zip(findings, expected, strict=True):
        assert problem in finding.problem
        assert finding.fix  # every problem says what to fix
        assert finding.fix in finding.message()


def test_default_env_is_the_socket_family_only() -> None:
    """The NICs and the GID are workloadEnv's (nccl_env), for hostNetwork pods too."""
    assert netchecks.default_env() == {"NCCL_SOCKET_FAMILY": "AF_INET6"}


def _serve(node: fixtures.FixtureNode, dp_dir: Path, cfg: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        serve_command(node, dp_dir, cfg, "--cdi-dir", str(dp_dir.parent / "cdi")),
        capture_output=True,
        text=True,
        timeout=30,
    )


def test_enforced_failure_exits_3_with_one_message_per_problem_and_no_socket(
    sim: KubeletSimulator, short_tmp: Path, dp_dir: Path
) -> None:
    spec = fixtures.with_nic_changes(fixtures.lingjun_node(nics=4), "mlx5_bond_2", ipv6=())
    node = fixtures.write_node(str(short_tmp / "bad"), fixtures.NodeSpec(nics=spec.nics, netns_mode="exclusive"))
    cfg = short_tmp / "nhn.yaml"
    cfg.write_text(yaml.safe_dump({**NHN, "cdi": {"enabled": True}}), encoding="utf-8")
    proc = _serve(node, dp_dir, cfg)
    assert proc.returncode == 3, proc.stderr
    problems = [line for line in proc.stderr.splitlines() if line.startswith("  - ")]
    assert len(problems) == 2, proc.stderr
    assert "netns mode is exclusive" in problems[0] and "rdma system set netns shared" in problems[0]
    assert "mlx5_bond_2 (bond2): no global IPv6 address on bond2. Fix: " in problems[1]
    assert "Traceback" not in proc.stderr
    # No plugin socket; the kubelet writes no checkpoint before a plugin sent it devices.
    assert sorted(p.name for p in dp_dir.iterdir()) == ["kubelet.sock"]
    assert not sim.registrations
    assert not (short_tmp / "cdi").exists() or list((short_tmp / "cdi").iterdir()) == []


def test_warn_mode_logs_and_serves(sim: KubeletSimulator, start_plugin, short_tmp: Path) -> None:  # type: ignore[no-untyped-def]
    node = fixtures.write_node(str(short_tmp / "v4"), fixtures.lingjun_node(nics=2, ipv6=False))
    plugin = start_plugin({**NHN, "nonHostNetwork": {"enabled": True, "checks": "warn"}}, fixture=node)
    assert sim.wait_registered(RES), plugin.output()
    out = plugin.output()
    assert out.count("non-hostNetwork check failed") == 2
    assert "WARNING" in out and "nonHostNetwork.checks: warn" in out
    assert sim.allocatable(RES) == 1000


def test_passing_node_serves_and_allocate_adds_ipv6_env(sim: KubeletSimulator, start_plugin) -> None:  # type: ignore[no-untyped-def]
    plugin = start_plugin(
        {
            "version": "v1",
            "mode": "exclusive",
            "env": {"GLOBAL": "1"},
            "nonHostNetwork": {"enabled": True, "env": {"NCCL_SOCKET_FAMILY": "AF_INET", "EXTRA": "x"}},
        }
    )
    assert sim.wait_registered(RES), plugin.output()
    assert "non-hostNetwork checks passed" in plugin.output()
    alloc = sim.allocate(RES, 2, pod="p")
    assert alloc.envs == {
        "NCCL_IB_HCA": "=mlx5_bond_0,mlx5_bond_1",  # exactly this allocation's devices
        "NCCL_IB_ADDR_FAMILY": "AF_INET6",  # the pod's own GID is unknown at Allocate: NCCL picks it
        "NCCL_IB_ROCE_VERSION_NUM": "2",
        "UCX_NET_DEVICES": "mlx5_bond_0:1,mlx5_bond_1:1",
        "NCCL_SOCKET_FAMILY": "AF_INET",  # user env overrides the default
        "EXTRA": "x",
        "GLOBAL": "1",
        "RDMA_DEVICES": "mlx5_bond_0,mlx5_bond_1",
    }
    other = sim.allocate(RES, 1, pod="q")
    assert other.envs["NCCL_IB_HCA"] == "=mlx5_bond_2"


def test_switch_off_adds_no_non_host_network_env(sim: KubeletSimulator, start_plugin) -> None:  # type: ignore[no-untyped-def]
    """hostNetwork pods: the GID index of the node's own address, no socket family, no nonHostNetwork.env."""
    start_plugin({"version": "v1", "nonHostNetwork": {"enabled": False, "env": {"IGNORED": "1"}}})
    assert sim.wait_registered(RES)
    nics = "mlx5_bond_0,mlx5_bond_1,mlx5_bond_2,mlx5_bond_3"
    assert sim.allocate(RES, 1).envs == {
        "RDMA_DEVICES": nics,
        "NCCL_IB_HCA": "=" + nics,
        "NCCL_IB_GID_INDEX": "3",
        "UCX_NET_DEVICES": "mlx5_bond_0:1,mlx5_bond_1:1,mlx5_bond_2:1,mlx5_bond_3:1",
    }


def test_workload_env_off_leaves_only_the_plugins_own(sim: KubeletSimulator, start_plugin) -> None:  # type: ignore[no-untyped-def]
    start_plugin({"version": "v1", "workloadEnv": {"enabled": False}, "nonHostNetwork": {"enabled": True}})
    assert sim.wait_registered(RES)
    assert sim.allocate(RES, 1).envs == {
        "RDMA_DEVICES": "mlx5_bond_0,mlx5_bond_1,mlx5_bond_2,mlx5_bond_3",
        "NCCL_SOCKET_FAMILY": "AF_INET6",
    }
