"""nccl_env: the NCCL/UCX variables for a set of allocated NICs, on fixture nodes as sysfs shows them
(hostNetwork and non-hostNetwork, IPv4 and IPv6 compute addresses, InfiniBand, disagreeing NICs)."""

from __future__ import annotations

import ipaddress
from dataclasses import replace
from pathlib import Path

import pytest

from rdma_device_plugin import nccl_env
from rdma_device_plugin.config import ConfigError, load_config_data
from rdma_device_plugin.nccl_env import EnvSettings, nic_facts, workload_env
from rdma_node import fixtures, gids, sysfs
from rdma_node.sysfs import Gid

HOST = EnvSettings()
POD = EnvSettings(host_network=False)


def _facts(tmp: Path, spec: fixtures.NodeSpec, settings: EnvSettings = HOST) -> list[nccl_env.NicFacts]:
    fx = fixtures.write_node(str(tmp / "node"), spec)
    return [nic_facts(n, settings) for n in sysfs.read_nics(fx.sysfs, fx.dev)]


def test_host_network_ipv6_node_gets_the_gid_index_of_its_compute_address(tmp_path: Path) -> None:
    """IPv6-only Lingjun node: NCCL's default (AF_INET) would take index 0, a link-local RoCE v1 GID
    (the Mooncake 1593 failure); the plugin hands the index of the RoCE v2 GID of the IPv6 address."""
    facts = _facts(tmp_path, fixtures.lingjun_node())
    got = workload_env(facts[:2], HOST)
    assert got.env == {
        "NCCL_IB_HCA": "=mlx5_bond_0,mlx5_bond_1",
        "UCX_NET_DEVICES": "mlx5_bond_0:1,mlx5_bond_1:1",
        "NCCL_IB_GID_INDEX": "3",  # ll v1, ll v2, 2408:...::11 v1, 2408:...::11 v2
    }
    assert got.unset == () and got.family == "AF_INET6"


def test_host_network_ipv4_node_uses_the_ipv4_gid_like_nccl(tmp_path: Path) -> None:
    spec = fixtures.lingjun_node(ipv6=False)
    spec = replace(spec, nics=tuple(replace(n, ipv4=(f"10.0.{i}.11",)) for i, n in enumerate(spec.nics)))
    got = workload_env(_facts(tmp_path, spec), HOST)
    assert got.env["NCCL_IB_GID_INDEX"] == "3" and got.family == "AF_INET"


def test_dual_stack_follows_the_configured_family(tmp_path: Path) -> None:
    spec = fixtures.lingjun_node()
    spec = replace(spec, nics=tuple(replace(n, ipv4=(f"10.0.{i}.11",)) for i, n in enumerate(spec.nics)))
    facts = _facts(tmp_path, spec)
    assert workload_env(facts, HOST).env["NCCL_IB_GID_INDEX"] == "3"  # auto: IPv4 on every NIC -> AF_INET
    v6 = replace(HOST, addr_family="AF_INET6")
    assert workload_env(facts, v6).env["NCCL_IB_GID_INDEX"] == "5"  # ll v1/v2, IPv4 v1/v2, IPv6 v1/v2


def test_nics_that_disagree_leave_the_index_unset_and_say_why(tmp_path: Path) -> None:
    """One NIC carries an extra IPv4 address: its IPv6 RoCE v2 GID moves to index 5. No guess: the
    index is left unset, NCCL picks per port by family, and the reason names each NIC's pick."""
    spec = fixtures.with_nic_changes(fixtures.lingjun_node(), "mlx5_bond_1", ipv4=("10.0.1.11",))
    got = workload_env(_facts(tmp_path, spec), HOST)
    assert "NCCL_IB_GID_INDEX" not in got.env
    assert got.env["NCCL_IB_ADDR_FAMILY"] == "AF_INET6" and got.env["NCCL_IB_ROCE_VERSION_NUM"] == "2"
    [unset] = got.unset
    assert unset.variable == "NCCL_IB_GID_INDEX" and unset.reason == nccl_env.GID_INDEX_DIFFERS
    assert "mlx5_bond_0 port 1: 3 (RoCE v2 2408:4005:300::11)" in unset.detail
    assert "mlx5_bond_1 port 1: 5 (RoCE v2 2408:4005:300:1::11)" in unset.detail
    # the NICs that agree still get it
    facts = _facts(tmp_path, spec)
    assert workload_env([facts[0], facts[2]], HOST).env["NCCL_IB_GID_INDEX"] == "3"


def test_a_nic_without_a_suitable_gid_leaves_the_index_unset(tmp_path: Path) -> None:
    spec = fixtures.with_nic_changes(fixtures.lingjun_node(), "mlx5_bond_2", roce_v2_ipv6_gid=False)
    got = workload_env(_facts(tmp_path, spec), HOST)
    assert "NCCL_IB_GID_INDEX" not in got.env
    [unset] = got.unset
    assert unset.reason == nccl_env.NO_SUITABLE_GID
    assert unset.detail.startswith("no AF_INET6 RoCE v2 GID on mlx5_bond_2 port 1")
    assert unset.message().startswith("NCCL_IB_GID_INDEX left unset: ")


def test_non_host_network_names_the_family_not_an_index(tmp_path: Path) -> None:
    """The pod's own IPv6 address enters the GID table after Allocate: only what NCCL must look for."""
    got = workload_env(_facts(tmp_path, fixtures.lingjun_node(), POD), POD)
    assert got.env == {
        "NCCL_IB_HCA": "=mlx5_bond_0,mlx5_bond_1,mlx5_bond_2,mlx5_bond_3",
        "UCX_NET_DEVICES": "mlx5_bond_0:1,mlx5_bond_1:1,mlx5_bond_2:1,mlx5_bond_3:1",
        "NCCL_IB_ADDR_FAMILY": "AF_INET6",
        "NCCL_IB_ROCE_VERSION_NUM": "2",
    }
    assert got.unset == ()
    ranged = replace(POD, addr_range="2408:4005:300::/48")
    assert workload_env(_facts(tmp_path, fixtures.lingjun_node(), ranged), ranged).env["NCCL_IB_ADDR_RANGE"] == (
        "2408:4005:300::/48"
    )


def test_addr_range_narrows_the_host_network_pick(tmp_path: Path) -> None:
    """Two IPv6 addresses on each bond: NCCL keeps the first RoCE v2 one unless NCCL_IB_ADDR_RANGE says."""
    spec = fixtures.lingjun_node()
    spec = replace(spec, nics=tuple(replace(n, ipv6=(*n.ipv6, f"fd00:{i}::11/64")) for i, n in enumerate(spec.nics)))
    facts = _facts(tmp_path, spec)
    assert workload_env(facts, HOST).env["NCCL_IB_GID_INDEX"] == "3"
    ranged = replace(HOST, addr_range="fd00::/16")
    assert workload_env(_facts(tmp_path, spec, ranged), ranged).env["NCCL_IB_GID_INDEX"] == "5"


def test_infiniband_needs_no_gid_variables(tmp_path: Path) -> None:
    got = workload_env(_facts(tmp_path, fixtures.lingjun_node(bond=False, link_layer="InfiniBand")), HOST)
    assert got.env == {
        "NCCL_IB_HCA": "=mlx5_0,mlx5_1,mlx5_2,mlx5_3",
        "UCX_NET_DEVICES": "mlx5_0:1,mlx5_1:1,mlx5_2:1,mlx5_3:1",
    }


def test_exact_match_form_keeps_prefixes_apart(tmp_path: Path) -> None:
    spec = fixtures.lingjun_node()
    spec = replace(spec, nics=(replace(spec.nics[0], name="mlx5_bond_10"), *spec.nics[1:]))
    facts = {f.name: f for f in _facts(tmp_path, spec)}
    assert workload_env([facts["mlx5_bond_1"], facts["mlx5_bond_10"]], HOST).env["NCCL_IB_HCA"] == (
        "=mlx5_bond_1,mlx5_bond_10"
    )


def test_switches(tmp_path: Path) -> None:
    facts = _facts(tmp_path, fixtures.lingjun_node())
    assert workload_env(facts, replace(HOST, enabled=False)).env == {}
    assert "UCX_NET_DEVICES" not in workload_env(facts, replace(HOST, ucx=False)).env
    assert workload_env([], HOST).env == {}


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        ({}, EnvSettings()),
        ({"nonHostNetwork": {"enabled": True}}, EnvSettings(host_network=False)),
        (
            {"workloadEnv": {"enabled": False, "addrFamily": "AF_INET", "addrRange": "10.1.2.3/8", "ucx": False}},
            EnvSettings(enabled=False, addr_family="AF_INET", addr_range="10.0.0.0/8", ucx=False),
        ),
    ],
)
def test_settings_from_config(config: dict[str, object], expected: EnvSettings) -> None:
    assert EnvSettings.from_config(load_config_data(config)) == expected


@pytest.mark.parametrize(
    ("workload_env", "message"),
    [
        ({"addrRange": "10.0.0.1"}, "workloadEnv.addrRange: '10.0.0.1' has no prefix length"),
        ({"addrRange": "10.0.0.300/8"}, "workloadEnv.addrRange: '10.0.0.300/8' is not a CIDR"),
        ({"addrRange": "10.0.0.0/8", "addrFamily": "AF_INET6"}, "workloadEnv: addrRange 10.0.0.0/8 is an AF_INET"),
        ({"addrFamily": "inet6"}, "workloadEnv.addrFamily: Input should be 'auto', 'AF_INET' or 'AF_INET6'"),
        ({"roceVersion": 3}, "workloadEnv.roceVersion: Input should be 1 or 2"),
        ({"enable": True}, r"workloadEnv.enable: unknown key \(remove it or check its spelling\)"),
    ],
)
def test_bad_workload_env_config_names_the_key(workload_env: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config_data({"workloadEnv": workload_env})


DOC = Path(__file__).resolve().parents[2] / "docs" / "nccl.md"


def _nccl_gid_text(gid: str) -> str:
    """NCCL's ``GID %ld (%lX/%lX)`` of subnet_prefix/interface_id: the raw bytes as little-endian words."""
    raw = ipaddress.IPv6Address(gid).packed
    return f"{int.from_bytes(raw[:8], 'little'):X}/{int.from_bytes(raw[8:], 'little'):X}"


def test_the_nccl_debug_lines_of_the_doc_are_what_this_node_gives(node: fixtures.FixtureNode) -> None:
    """docs/nccl.md: the hostNetwork line's index and GID are the fixture node's, and the pod-network
    line's index is what NCCL's own choice makes of the node's table plus the pod's entries."""
    text = DOC.read_text()
    bond0, bond1 = sysfs.read_nics(node.sysfs, node.dev)[:2]
    host = workload_env([nic_facts(bond0, HOST)], HOST)
    index = int(host.env["NCCL_IB_GID_INDEX"])
    gid = next(g.gid for g in bond0.ports[0].gids if g.index == index)
    assert f"NCCL_IB_GID_INDEX set by environment to {index}." in text
    assert f"GID {index} ({_nccl_gid_text(gid)})" in text
    prefix1 = _nccl_gid_text(next(g.gid for g in bond1.ports[0].gids if g.index == index)).split("/")[0]
    assert f"the prefix reads `{prefix1}`" in text
    # the pod's interface over bond0 adds its link-local and global address, RoCE v1 and v2 each
    port = bond0.ports[0]
    pod_ll, pod_global = "fe80::bace:f6ff:fe1a:12", "2408:4005:301::a12"
    added = [(pod_ll, "IB/RoCE v1"), (pod_ll, "RoCE v2"), (pod_global, "IB/RoCE v1"), (pod_global, "RoCE v2")]
    used = len(port.gids)
    table = (
        *port.gids,
        *(Gid(used + i, ipaddress.IPv6Address(g).exploded, t, "pod0") for i, (g, t) in enumerate(added)),
    )
    pod_port = replace(port, gids=table, gid_table_len=max(port.gid_table_len, len(table)))
    chosen = gids.nccl_gid_index(pod_port, "AF_INET6", 2, "2408:4005:301::/48")
    assert f"GID {chosen} ({_nccl_gid_text(pod_global)})" in text
    assert f"`GID {gids.nccl_gid_index(pod_port, 'AF_INET6')} ({_nccl_gid_text(gid).split('/')[0]}/...)`" in text
