"""node.ipv6checks: the one implementation of the IPv6 compute-network checks (plugin and role)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from rdma_device_plugin.node import fixtures, ipv6checks, sysfs

PER_NETDEV = ["ipv6_enabled", "ipv6_global_address", "ipv6_route", "roce_v2_gid"]


def _checks(root: Path, spec: fixtures.NodeSpec, **options: Any) -> list[ipv6checks.Check]:
    node = fixtures.write_node(str(root), spec)
    nics = sysfs.read_nics(node.sysfs, node.dev)
    return ipv6checks.read_and_check(nics, node.sysfs, node.procfs, **options)


def _failed(checks: list[ipv6checks.Check]) -> list[tuple[str, str, str]]:
    return [(c.name, c.nic, c.netdev) for c in checks if not c.passed]


def test_a_healthy_node_passes_every_check(short_tmp: Path) -> None:
    checks = _checks(short_tmp / "ok", fixtures.lingjun_node(nics=4))
    assert _failed(checks) == []
    assert [(c.name, c.nic, c.netdev) for c in checks] == [("netns_mode", "", "")] + [
        (name, f"mlx5_bond_{i}", f"bond{i}") for i in range(4) for name in PER_NETDEV
    ]
    assert all(c.problem == "" and c.fix == "" for c in checks)
    assert checks[0].message() == "RDMA netns mode shared"
    by_name = {(c.name, c.nic): c.message() for c in checks}
    assert by_name["ipv6_enabled", "mlx5_bond_0"] == "mlx5_bond_0 (bond0): IPv6 enabled"
    assert by_name["ipv6_global_address", "mlx5_bond_2"] == "mlx5_bond_2 (bond2): global IPv6 2408:4005:300:2::11"
    assert by_name["ipv6_route", "mlx5_bond_1"] == "mlx5_bond_1 (bond1): IPv6 routes 2408:4005:300:1::/64"
    assert by_name["roce_v2_gid", "mlx5_bond_3"] == "mlx5_bond_3 (bond3): RoCE v2 GID for 2408:4005:300:3::11"
    # plain (unbonded) ports: the port netdev is the compute netdev
    plain = _checks(short_tmp / "plain", fixtures.lingjun_node(nics=2, bond=False))
    assert _failed(plain) == []
    assert {c.netdev for c in plain} == {"", "eth0", "eth1"}


@pytest.mark.parametrize(
    ("spec", "failed", "message"),
    [
        (
            fixtures.NodeSpec(nics=fixtures.lingjun_node(nics=2).nics, netns_mode="exclusive"),
            [("netns_mode", "", "")],
            "the RDMA subsystem netns mode is exclusive, non-hostNetwork pods need shared. "
            'Fix: rdma system set netns shared and persist it with "options ib_core netns_mode=1" in /etc/modprobe.d/',
        ),
        (
            fixtures.NodeSpec(nics=fixtures.lingjun_node(nics=1).nics, netns_mode=""),
            [("netns_mode", "", "")],
            "the RDMA subsystem netns mode is unknown (/sys/module/ib_core/parameters/netns_mode is missing)",
        ),
        (
            fixtures.NodeSpec(
                nics=fixtures.lingjun_node(nics=1).nics, modules=("mlx5_core", "mlx5_ib", "ib_uverbs", "rdma_ucm")
            ),
            [("netns_mode", "", "")],
            "the ib_core module is not loaded, so the RDMA subsystem netns mode cannot be read. "
            "Fix: load the RDMA driver stack (modprobe ib_core)",
        ),
        (
            fixtures.lingjun_node(nics=2, ipv6=False),
            # no address: nothing to route or to carry in a GID, so those are not checked
            [("ipv6_global_address", "mlx5_bond_0", "bond0"), ("ipv6_global_address", "mlx5_bond_1", "bond1")],
            "mlx5_bond_1 (bond1): no global IPv6 address on bond1. "
            "Fix: configure the compute network IPv6 address on bond1 (the bond for a RoCE LAG)",
        ),
        (
            fixtures.with_nic_changes(fixtures.lingjun_node(nics=2), "mlx5_bond_1", roce_v2_ipv6_gid=False),
            [("roce_v2_gid", "mlx5_bond_1", "bond1")],
            "mlx5_bond_1 (bond1): no RoCE v2 GID carries 2408:4005:300:1::11. "
            "Fix: put the address on the netdev that owns the RDMA port (bond1)",
        ),
        (
            fixtures.NodeSpec(nics=fixtures.lingjun_node(nics=2).nics, ipv6_disabled=("bond0",)),
            [("ipv6_enabled", "mlx5_bond_0", "bond0")],
            "mlx5_bond_0 (bond0): IPv6 is disabled (disable_ipv6=1 on bond0 or all). "
            "Fix: sysctl -w net.ipv6.conf.all.disable_ipv6=0 net.ipv6.conf.bond0.disable_ipv6=0",
        ),
        (
            fixtures.NodeSpec(nics=fixtures.lingjun_node(nics=2).nics, ipv6_disabled=("all",)),
            [("ipv6_enabled", "mlx5_bond_0", "bond0"), ("ipv6_enabled", "mlx5_bond_1", "bond1")],
            "mlx5_bond_1 (bond1): IPv6 is disabled (disable_ipv6=1 on bond1 or all)",
        ),
        (
            fixtures.NodeSpec(nics=fixtures.lingjun_node(nics=2).nics, routes=False),
            [("ipv6_route", "mlx5_bond_0", "bond0"), ("ipv6_route", "mlx5_bond_1", "bond1")],
            "mlx5_bond_0 (bond0): no IPv6 route for the compute network leaves through bond0. "
            "Fix: add the compute network route (ip -6 route add <prefix> dev bond0)",
        ),
    ],
    ids=[
        "netns-exclusive",
        "netns-unknown",
        "ib-core-missing",
        "no-ipv6",
        "no-rocev2-gid",
        "ipv6-disabled",
        "ipv6-disabled-all",
        "no-route",
    ],
)
def test_each_check_fails_on_its_broken_node(
    short_tmp: Path, spec: fixtures.NodeSpec, failed: list[tuple[str, str, str]], message: str
) -> None:
    checks = _checks(short_tmp / "bad", spec)
    assert _failed(checks) == failed
    bad = [c for c in checks if not c.passed]
    assert any(message in c.message() for c in bad), [c.message() for c in bad]
    for c in bad:
        assert c.problem and c.problem == c.detail
        assert c.message().endswith(f". Fix: {c.fix}") and c.fix.endswith(".")
    # the node-wide check comes first, and the checks that pass still report their outcome
    assert checks[0].name == "netns_mode"
    assert any(c.passed for c in checks)


def test_options_change_what_is_wanted(short_tmp: Path) -> None:
    spec = fixtures.with_nic_changes(
        fixtures.NodeSpec(nics=fixtures.lingjun_node(nics=2).nics, netns_mode="exclusive"),
        "mlx5_bond_0",
        roce_v2_ipv6_gid=False,
    )
    checks = _checks(short_tmp / "n", spec, want_netns_mode="exclusive", roce_v2_gid=False)
    assert _failed(checks) == []
    assert "roce_v2_gid" not in {c.name for c in checks}
    assert checks[0].message() == "RDMA netns mode exclusive"
    with pytest.raises(ValueError, match="want_netns_mode"):
        ipv6checks.check([], "shared", True, {}, want_netns_mode="Y")


def test_pyverbs_gids_replace_the_sysfs_ones(short_tmp: Path) -> None:
    node = fixtures.write_node(str(short_tmp / "n"), fixtures.lingjun_node(nics=2))
    nics = sysfs.read_nics(node.sysfs, node.dev)
    gid = "2408:4005:0300:0001:0000:0000:0000:0011"
    ok = ipv6checks.read_and_check(nics, node.sysfs, node.procfs, gids={"mlx5_bond_1": [gid.upper()]})
    assert _failed(ok) == []
    bad = ipv6checks.read_and_check(nics, node.sysfs, node.procfs, gids={"mlx5_bond_1": []})
    assert _failed(bad) == [("roce_v2_gid", "mlx5_bond_1", "bond1")]


def test_infiniband_nics_have_no_roce_v2_gid_check(short_tmp: Path) -> None:
    ib = fixtures.lingjun_node(nics=1, bond=False, link_layer="InfiniBand")
    checks = _checks(short_tmp / "ib", fixtures.with_nic_changes(ib, "mlx5_0", ipv6=("2408:4005:300::11/64",)))
    # InfiniBand GIDs are not IP addresses: the compute netdev (the port netdev) needs IPv6, no RoCE v2 GID
    assert _failed(checks) == []
    assert [c.name for c in checks if c.nic] == PER_NETDEV[:3]
    assert {c.netdev for c in checks if c.nic} == {"eth0"}


def test_no_nics_and_nics_without_netdev() -> None:
    none = ipv6checks.check([], "shared", True, {}, selection='the selectors {"vendors": ["15b3"]}')
    assert _failed(none) == [("ipv6_compute_netdevs", "", "")]
    assert none[1].message() == (
        'no RDMA device matches the selectors {"vendors": ["15b3"]}, so there is no compute netdev to check. '
        "Fix: bind the NICs to their driver or correct the NIC selectors."
    )
    assert _failed(ipv6checks.check([], "shared", True, {}, require_nics=False)) == []
    bare = sysfs.Nic("mlx5_0", "0000:1a:00.0", "15b3", "1021", "mlx5_core", 0, (), "", "", "", (), None)
    checks = ipv6checks.check([bare], "shared", True, {})
    assert _failed(checks) == [("ipv6_compute_netdevs", "mlx5_0", "")]
    assert (
        checks[1].message()
        == "mlx5_0: has no netdev, so it cannot carry IPv6. Fix: bind its netdev or deselect the NIC."
    )


def test_unknown_ipv6_state_fails(short_tmp: Path) -> None:
    node = fixtures.write_node(str(short_tmp / "n"), fixtures.lingjun_node(nics=1))
    nics = sysfs.read_nics(node.sysfs, node.dev)
    checks = ipv6checks.check(nics, "shared", True, {})  # nothing read for bond0
    assert _failed(checks) == [
        ("ipv6_enabled", "mlx5_bond_0", "bond0"),
        ("ipv6_global_address", "mlx5_bond_0", "bond0"),
    ]
    assert "IPv6 is in an unknown state" in checks[1].message()


def test_to_dict_is_plain_data(short_tmp: Path) -> None:
    checks = _checks(short_tmp / "n", fixtures.NodeSpec(nics=fixtures.lingjun_node(nics=1).nics, routes=False))
    node_wide, route = checks[0].to_dict(), next(c.to_dict() for c in checks if c.name == "ipv6_route")
    assert node_wide == {
        "name": "netns_mode",
        "nic": None,
        "netdev": None,
        "gpu": None,
        "passed": True,
        "skipped": False,
        "warning": False,
        "problem": "",
        "fix": "",
        "message": "RDMA netns mode shared",
    }
    assert route["nic"] == "mlx5_bond_0" and route["netdev"] == "bond0" and route["passed"] is False
    assert route["message"] == f"mlx5_bond_0 (bond0): {route['problem']}. Fix: {route['fix']}"
    assert set(ipv6checks.CHECK_NAMES) >= {c.name for c in checks}
