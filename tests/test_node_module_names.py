"""rdma_node_info's JSON with an RDMA device and a netdev whose names are not UTF-8: the names
come back decoded by the reader's one policy (``\\xNN``), so the result is valid UTF-8 JSON."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

from conftest import node_info

from rdma_node import fixtures


def test_non_utf8_names_in_module_json(tmp_path: Path) -> None:
    spec = fixtures.lingjun_node(nics=2)
    odd = replace(spec.nics[0], name="mlx5_bond_\udcff0", bond="bond\udcfe0")  # the raw bytes 0xff, 0xfe
    node = fixtures.write_node(str(tmp_path / "odd"), replace(spec, nics=(odd, *spec.nics[1:])))
    result = node_info(
        sys.executable,
        f"sysfs_root={node.sysfs}",
        f"procfs_root={node.procfs}",
        f"dev_root={node.dev}",
        "details=true",
    )
    nics = {n["name"]: n for n in result["node"]["nics"]}
    assert set(nics) == {"mlx5_bond_\\xff0", "mlx5_bond_1"}
    assert nics["mlx5_bond_\\xff0"]["compute_netdevs"] == ["bond\\xfe0"]
    assert "bond\\xfe0" in result["node"]["ipv6"]
    failed = [c["message"] for role in result["node"]["checks"].values() for c in role if not c["passed"]]
    assert failed == []
