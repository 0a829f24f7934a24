"""One house for both APIs: the node inventory (``inventory.py``) is what the device plugin's pools and
the DRA driver read, and the driver's plumbing stands apart from what it decides."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from rdma_device_plugin.config import PluginConfig, load_config_data
from rdma_device_plugin.discovery import Discovery
from rdma_device_plugin.dra.inventory import Inventory
from rdma_device_plugin.inventory import NodeInventory
from rdma_device_plugin.resources import build_pools
from rdma_node import fixtures

DRA = Path(__file__).resolve().parent.parent / "src" / "rdma_device_plugin" / "dra"
PACKAGE = "rdma_device_plugin"
# The device plugin's pools and serving: what the DRA package must not build on.
DEVICE_PLUGIN = {"resources", "server", "discovery", "supervisor", "registration", "published", "status", "cdi"}
PLUMBING = {"kubeletplugin", "service", "publisher"}  # sockets, registration, the kubelet's gRPC, slices
DECISIONS = {"model", "claims", "containers", "inventory"}  # the devices, prepare, the NICs as published


def _imports(module: str) -> dict[str, set[str]]:
    """What one ``dra/`` module imports from the package: module -> names (an empty set: the module)."""
    tree = ast.parse((DRA / f"{module}.py").read_text(encoding="utf-8"))
    out: dict[str, set[str]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = {0: "", 1: f"{PACKAGE}.dra", 2: PACKAGE}[node.level]
            target = f"{base}.{node.module}" if node.module and base else node.module or base
            if not target.startswith(PACKAGE):
                continue
            if node.module is None:  # from . import kubeapi, model
                for alias in node.names:
                    out.setdefault(f"{target}.{alias.name}", set())
            else:
                out.setdefault(target, set()).update(a.name for a in node.names)
        elif isinstance(node, ast.Import):
            out.update({a.name: set() for a in node.names if a.name.startswith(PACKAGE)})
    return out


def test_the_dra_package_imports_none_of_the_device_plugins_pools_or_serving() -> None:
    modules = sorted(p.stem for p in DRA.glob("*.py") if p.stem != "__init__")
    assert {"driver", "claims", "model", "service"} <= set(modules)  # the test reads the right files
    found = {
        (m, target)
        for m in modules
        for target in _imports(m)
        if target.removeprefix(f"{PACKAGE}.").split(".")[0] in DEVICE_PLUGIN
    }
    assert not found, "the DRA driver reads the node inventory (inventory.py), not the device plugin's pools"
    assert f"{PACKAGE}.inventory" in _imports("driver")  # the one house it reads instead


def test_plumbing_and_decisions_stand_apart() -> None:
    """As upstream's kubeletplugin helper: the plumbing knows no decision; the decisions meet the
    plumbing in its two types (what a prepare answers, a refused claim)."""
    dra = f"{PACKAGE}.dra."
    for m in sorted(PLUMBING):
        crossing = {t for t in _imports(m) if t.startswith(dra) and t.removeprefix(dra) in DECISIONS}
        assert not crossing, f"dra/{m}.py (plumbing) imports {crossing}"
    for m in sorted(DECISIONS):
        used = {t.removeprefix(dra): names for t, names in _imports(m).items() if t.startswith(dra)}
        plumbing = {t: names for t, names in used.items() if t in PLUMBING}
        assert plumbing in ({}, {"kubeletplugin": {"PreparedDevice", "PrepareError"}}), (m, plumbing)
    assert "kubeletplugin" in {t.removeprefix(dra) for t in _imports("claims")}


def test_the_driver_loads_no_discovery_or_serving_of_the_device_plugin() -> None:
    probe = "import json, sys; import rdma_device_plugin.dra.driver; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=120)
    mods = set(json.loads(out.stdout))
    assert f"{PACKAGE}.inventory" in mods
    # nor the pools and gRPC server (since issue 38's memory cut; with and without metrics: test_dra_imports.py)
    unwanted = {f"{PACKAGE}.{m}" for m in ("discovery", "supervisor", "registration", "status", "events", "nfd")}
    unwanted |= {f"{PACKAGE}.{m}" for m in ("resources", "server")}
    assert not unwanted & mods


def _device_plugin(config: PluginConfig, node: fixtures.FixtureNode) -> tuple[Discovery, dict[str, dict[str, Any]]]:
    pools = build_pools(config)
    discovery = Discovery(config, pools, node.sysfs, node.dev)
    discovery.full()
    return discovery, _summary(discovery)


def _summary(discovery: Discovery) -> dict[str, dict[str, Any]]:
    """Every NIC the device plugin's pools know (the status file's view), with its resource."""
    return {str(n["name"]): {**n, "resource": p.name} for p in discovery.pools for n in p.nic_summary()}


def _facts_of_device_plugin(summary: dict[str, dict[str, Any]]) -> dict[str, tuple[object, ...]]:
    return {
        name: (n["pci_address"], n["numa_node"], n["present"], tuple(n["ports"]), n["healthy"], n["why"], n["resource"])
        for name, n in summary.items()
    }


def _facts_of_driver(inventory: NodeInventory, views: Inventory) -> dict[str, tuple[object, ...]]:
    return {
        v.nic.name: (
            v.nic.pci_address,
            v.nic.numa_node,
            v.health.present,
            v.health.ports,
            v.health.healthy,
            v.health.why,
            v.resource,
        )
        for v in views.views(inventory)
    }


@pytest.mark.parametrize("mode", ["shared", "exclusive"])
def test_the_device_plugin_and_the_driver_report_the_same_nics(node: fixtures.FixtureNode, mode: str) -> None:
    """The same fixture node, read by the device plugin's discovery and pools and by the DRA driver's
    inventory: the same NICs, health and why, GID and env, through a port going down and a NIC vanishing."""
    config = load_config_data({"version": "v1", "mode": mode})
    discovery, summary = _device_plugin(config, node)
    inventory = NodeInventory(config, node.sysfs, node.dev)
    inventory.full()
    views = Inventory(config, node.sysfs)
    try:
        facts = _facts_of_device_plugin(summary)
        assert len(facts) == 4 and all(f[4] for f in facts.values())  # four healthy NICs to compare
        assert _facts_of_driver(inventory, views) == facts
        for v in views.views(inventory):  # NCCL's GID: the pool's status shows the one the driver publishes
            assert v.gid and summary[v.nic.name]["gid"].startswith(f"{v.gid_index} (")
        # What a container given NICs gets: the pool's Allocate answer is the driver's env and devices.
        pool = discovery.pools[0]
        nics = inventory.resources[pool.name].present_nics()
        ids = [pool.snapshot()[1][0].id] if mode == "shared" else [n.pci_address for n in nics]
        answer = pool.allocate(ids)
        current = inventory.resources[pool.name].current
        assert inventory.rules.env(nics, current.facts) == answer.envs
        assert answer.envs["RDMA_DEVICES"] == ",".join(n.name for n in nics)
        assert tuple(inventory.rules.device_specs(nics)) == answer.devices

        node.set_port_state("mlx5_bond_1", "DOWN")
        discovery.probe()
        inventory.probe()
        down = _facts_of_device_plugin(_summary(discovery))
        assert down["mlx5_bond_1"][4:6] == (False, "port 1 DOWN (not ACTIVE)")
        assert _facts_of_driver(inventory, views) == down

        node.remove_nic("mlx5_bond_2")  # gone, kept unhealthy for health.vanishGraceSeconds
        discovery.check_devices()
        inventory.check_devices()
        gone = _facts_of_device_plugin(_summary(discovery))
        assert gone["mlx5_bond_2"][2:6] == (False, (), False, "NIC gone from sysfs")
        assert _facts_of_driver(inventory, views) == gone
    finally:
        discovery.close()
        inventory.close()
