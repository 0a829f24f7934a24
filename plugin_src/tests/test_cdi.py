"""CDI: spec files validated against the CDI schema, and Allocate answering with CDI names."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import jsonschema

from rdma_device_plugin import cdi
from rdma_kubesim import KubeletSimulator
from rdma_node import fixtures, sysfs

RES = "rdma/hca"
KIND = "rdma.lingjun.io/hca"
SPEC_FILE = "rdma.lingjun.io-hca.json"
SCHEMA = json.loads((Path(__file__).parent / "data" / "cdi-schema.json").read_text(encoding="utf-8"))
UVERBS = {f"mlx5_bond_{i}": f"/dev/infiniband/uverbs{(i + 1) % 4}" for i in range(4)}
RDMA_CM = "/dev/infiniband/rdma_cm"


def _paths(edits: dict[str, Any]) -> list[str]:
    return [n["path"] for n in edits.get("deviceNodes", [])]


def _read(path: Path) -> dict[str, Any]:
    spec: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    jsonschema.validate(spec, SCHEMA)
    return spec


def _wait(predicate, timeout: float = 5.0) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return bool(predicate())


def test_schema_rejects_a_broken_spec() -> None:
    good = cdi.build_spec(KIND, "shared", [])
    jsonschema.validate(good, SCHEMA)
    for bad in (
        {**good, "cdiVersion": 6},
        {**good, "kind": "no-slash"},
        {**good, "devices": [{"name": "x"}]},
        {**good, "devices": [{"name": "-bad", "containerEdits": {}}]},
        {**good, "devices": [{"name": "x", "containerEdits": {"deviceNodes": [{"hostPath": "/dev/x"}]}}]},
    ):
        try:
            jsonschema.validate(bad, SCHEMA)
        except jsonschema.ValidationError:
            continue
        raise AssertionError(f"schema accepted {bad}")


def test_shared_mode_spec_allocate_refresh_and_kept_on_shutdown(
    sim: KubeletSimulator, start_plugin, short_tmp: Path, node: fixtures.FixtureNode
) -> None:  # type: ignore[no-untyped-def]
    cdi_dir = short_tmp / "cdi"
    plugin = start_plugin({"version": "v1", "cdi": {"enabled": True}}, extra=["--cdi-dir", str(cdi_dir)])
    assert sim.wait_registered(RES), plugin.output()
    spec = _read(cdi_dir / SPEC_FILE)
    assert spec["cdiVersion"] == "0.6.0" and spec["kind"] == KIND
    assert [d["name"] for d in spec["devices"]] == ["all"]
    assert _paths(spec["devices"][0]["containerEdits"]) == [*UVERBS.values(), RDMA_CM]
    assert [p.name for p in cdi_dir.iterdir()] == [SPEC_FILE]  # no temp file left behind
    alloc = sim.allocate(RES, 1, pod="p")
    assert [d.name for d in alloc.response.cdi_devices] == [f"{KIND}=all"]
    assert alloc.device_paths == []  # CDI replaces device specs ...
    assert alloc.envs["RDMA_DEVICES"] == "mlx5_bond_0,mlx5_bond_1,mlx5_bond_2,mlx5_bond_3"  # ... envs stay
    node.remove_nic("mlx5_bond_1")
    assert _wait(
        lambda: UVERBS["mlx5_bond_1"] not in _paths(_read(cdi_dir / SPEC_FILE)["devices"][0]["containerEdits"])
    )
    assert _paths(_read(cdi_dir / SPEC_FILE)["devices"][0]["containerEdits"]) == [
        UVERBS["mlx5_bond_0"],
        UVERBS["mlx5_bond_2"],
        UVERBS["mlx5_bond_3"],
        RDMA_CM,
    ]
    rc, _ = plugin.stop()
    assert rc == 0
    assert (cdi_dir / SPEC_FILE).exists()  # kept on shutdown for running pods (documented in cdi.py)


def test_exclusive_mode_one_cdi_device_per_nic(sim: KubeletSimulator, start_plugin, short_tmp: Path) -> None:  # type: ignore[no-untyped-def]
    cdi_dir = short_tmp / "cdi"
    plugin = start_plugin(
        {"version": "v1", "mode": "exclusive", "cdi": {"enabled": True, "kind": "example.com/rdma"}},
        extra=["--cdi-dir", str(cdi_dir)],
    )
    assert sim.wait_registered(RES), plugin.output()
    spec = _read(cdi_dir / "example.com-rdma.json")
    assert spec["kind"] == "example.com/rdma"
    assert {d["name"]: _paths(d["containerEdits"]) for d in spec["devices"]} == {n: [p] for n, p in UVERBS.items()}
    assert _paths(spec["containerEdits"]) == [RDMA_CM]
    alloc = sim.allocate(RES, 2, pod="p")
    assert [d.name for d in alloc.response.cdi_devices] == [
        "example.com/rdma=mlx5_bond_0",
        "example.com/rdma=mlx5_bond_1",
    ]
    assert alloc.device_paths == [] and alloc.envs["RDMA_DEVICES"] == "mlx5_bond_0,mlx5_bond_1"


def test_cdi_off_writes_nothing_and_returns_device_specs(sim: KubeletSimulator, start_plugin, short_tmp: Path) -> None:  # type: ignore[no-untyped-def]
    cdi_dir = short_tmp / "cdi"
    start_plugin({"version": "v1"}, extra=["--cdi-dir", str(cdi_dir)])
    assert sim.wait_registered(RES)
    alloc = sim.allocate(RES, 1)
    assert list(alloc.response.cdi_devices) == [] and RDMA_CM in alloc.device_paths
    assert not cdi_dir.exists()


def test_several_resources_get_their_own_kind_and_file(short_tmp: Path) -> None:
    node = fixtures.write_node(str(short_tmp / "n"), fixtures.lingjun_node(nics=2))
    nics = sysfs.read_nics(node.sysfs, node.dev)
    kinds = [cdi.resource_kind(KIND, r, 2) for r in ("rdma/hca", "rdma/hca_b")]
    assert kinds == ["rdma.lingjun.io/hca-hca", "rdma.lingjun.io/hca-hca_b"]
    for kind in kinds:
        writer = cdi.SpecWriter(str(short_tmp / "cdi"), kind, "exclusive")
        assert writer.update(nics) is True
        assert writer.update(nics) is False  # unchanged content is not rewritten
        _read(Path(writer.path))
    assert sorted(p.name for p in (short_tmp / "cdi").iterdir()) == [
        "rdma.lingjun.io-hca-hca.json",
        "rdma.lingjun.io-hca-hca_b.json",
    ]
