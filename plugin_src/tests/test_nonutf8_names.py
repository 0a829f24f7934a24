"""Non-UTF-8 RDMA device and netdev names (the kernel allows any bytes but '/' and NUL in an RDMA
device name, and most bytes in a netdev name) are decoded by one policy (node/text.py: UTF-8 with
backslashreplace) through discovery, serve (ListAndWatch snapshot and Allocate, protobuf) and JSON."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from rdma_kubesim import KubeletSimulator
from rdma_node import fixtures, ipv6checks, sysfs, text

# os-level names: surrogateescape for the bytes 0xff and 0xfe, which are never UTF-8
ODD_NIC, ODD_NETDEV = "mlx5_bond_\udcff0", "bond\udcfe0"
NIC, NETDEV = "mlx5_bond_\\xff0", "bond\\xfe0"  # as the reader shows them


def odd_node(root: Path) -> fixtures.FixtureNode:
    spec = fixtures.lingjun_node(nics=2)
    first = replace(spec.nics[0], name=ODD_NIC, bond=ODD_NETDEV)
    return fixtures.write_node(str(root / "odd"), replace(spec, nics=(first, *spec.nics[1:])))


def _strict_json(data: object) -> str:
    """JSON as UTF-8 bytes, as Ansible and the health file write it: a surrogate fails here."""
    return json.dumps(data, ensure_ascii=False).encode("utf-8").decode("utf-8")


def test_policy_round_trips_a_name_to_its_path() -> None:
    assert text.from_fs(ODD_NIC) == NIC == text.decode(ODD_NIC.encode("utf-8", "surrogateescape"))
    assert text.to_fs(NIC) == ODD_NIC
    assert text.to_fs("mlx5_0") == "mlx5_0" and text.from_fs("é") == "é"  # UTF-8 names are kept


def test_discovery_decodes_names_and_contents_alike(short_tmp: Path) -> None:
    node = odd_node(short_tmp)
    assert os.fsencode(ODD_NIC) in os.listdir(os.fsencode(f"{node.sysfs}/class/infiniband"))  # the raw byte
    nics = sysfs.read_nics(node.sysfs, node.dev)
    assert [n.name for n in nics] == ["mlx5_bond_1", NIC]
    odd = nics[1]
    assert odd.problems == () and odd.uverbs is not None  # its uverbs ibdev file names it in the same decoding
    assert NETDEV in odd.netdevs and odd.compute_netdevs == (NETDEV,)  # class/net entry == gid_attrs/ndevs text
    assert odd.all_ports_active
    assert sysfs.read_port_states(node.sysfs, [NIC]) == {NIC: ("ACTIVE",)}
    reader = sysfs.PortStateReader(node.sysfs, [NIC])
    try:
        assert reader.read() == {NIC: ("ACTIVE",)}, reader.failed
    finally:
        reader.close()
    state = ipv6checks.read_netdev(node.procfs, NETDEV)  # /proc/net/if_inet6 and conf/<netdev>
    assert state.disabled is False and [a.address for a in state.addresses] == ["2408:4005:300::11"]
    checks = ipv6checks.read_and_check(nics, node.sysfs, node.procfs)
    assert all(c.passed for c in checks), [c.message() for c in checks]
    assert [d["name"] for d in json.loads(_strict_json([n.to_dict() for n in nics]))] == ["mlx5_bond_1", NIC]


def test_serve_snapshot_and_allocate_encode(  # type: ignore[no-untyped-def]
    sim: KubeletSimulator, start_plugin: Callable[..., object], short_tmp: Path
) -> None:
    node = odd_node(short_tmp)
    plugin = start_plugin(config={"version": "v1", "mode": "exclusive"}, fixture=node)
    res = "rdma/hca"
    assert sim.wait_registered(res), plugin.output()  # type: ignore[attr-defined]
    assert sim.wait_for(lambda: sim.allocatable(res) == 2, timeout=30), plugin.output()  # type: ignore[attr-defined]
    alloc = sim.allocate(res, 2, pod="p")
    assert any(NIC in value for value in alloc.envs.values()), alloc.envs
    assert "UnicodeEncodeError" not in plugin.output() and "Traceback" not in plugin.output()  # type: ignore[attr-defined]
