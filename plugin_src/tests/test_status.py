"""`rdma-device-plugin status`: the real serve process keeps a status file current; the command
prints mode, capacity/allocatable, each NIC's ports, netdevs, NUMA node, health and why, and the
last allocations."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rdma_device_plugin.health import NicHealth
from rdma_device_plugin.status import default_status_file, render
from rdma_node import fixtures

RES = "rdma/hca"


def status(dp_dir: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "rdma_device_plugin", "status", "--device-plugin-dir", str(dp_dir), *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)


def wait_doc(dp_dir: Path, pred: Callable[[dict[str, Any]], bool], timeout: float = 20.0) -> dict[str, Any]:
    path, doc = Path(default_status_file(str(dp_dir))), {}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            doc = json.loads(path.read_text())
            if pred(doc):
                return doc
        time.sleep(0.1)
    raise AssertionError(f"status file never matched; last: {doc}")


def test_status_shows_resources_nics_health_and_allocations(  # type: ignore[no-untyped-def]
    sim, start_plugin, dp_dir: Path, node: fixtures.FixtureNode
) -> None:
    plugin = start_plugin()
    assert sim.wait_registered(RES), plugin.output()
    doc = wait_doc(
        dp_dir,
        lambda d: (
            [(r["name"], r["capacity"], r["allocatable"]) for r in d["resources"]] == [(RES, 1000, 1000)]
            and all(n["gpus"] for n in d["nics"])
        ),
    )
    assert doc["mode"] == "shared"
    assert [n["name"] for n in doc["nics"]] == [f"mlx5_bond_{i}" for i in range(4)]
    assert all(n["healthy"] and n["ports"] == ["ACTIVE"] and n["netdevs"] for n in doc["nics"])
    assert {n["numa_node"] for n in doc["nics"]} == {0, 1}
    # issue 23: the GID NCCL uses, the GPUs by level, the env a pod gets
    bond0 = doc["nics"][0]
    assert bond0["gid"] == "3 (RoCE v2 2408:4005:300::11)"
    assert bond0["gpus"]["switch"] == ["0000:18:00.0", "0000:19:00.0"] and len(bond0["gpus"]["numa"]) == 4
    [env] = doc["resources"][0]["env"]
    assert env["env"]["NCCL_IB_GID_INDEX"] == "3" and env["unset"] == []

    sim.allocate(RES, 1, pod="p1")
    node.set_port_state("mlx5_bond_2", "DOWN")
    doc = wait_doc(dp_dir, lambda d: d["resources"][0]["allocatable"] == 0 and d["allocations"])
    bad = next(n for n in doc["nics"] if n["name"] == "mlx5_bond_2")
    assert not bad["healthy"] and bad["why"] == "port 1 DOWN (not ACTIVE)"
    assert doc["allocations"][0]["resource"] == RES and doc["allocations"][0]["ok"] is True

    out = status(dp_dir)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert text.splitlines()[0].startswith("mode: shared")
    assert "rdma/hca: capacity 1000, allocatable 0" in text
    assert "mlx5_bond_2" in text and "Unhealthy" in text and "port 1 DOWN (not ACTIVE)" in text
    assert "last allocations:" in text and " ok " in text
    assert "3 (RoCE v2 2408:4005:300::11)" in text and "2/2/4" in text  # NCCL GID, GPUS sw/rp/numa
    assert "env a pod gets (rdma/hca):" in text and "  NCCL_IB_GID_INDEX=3" in text
    assert json.loads(status(dp_dir, "-o", "json").stdout)["mode"] == "shared"

    rc, _ = plugin.stop()
    assert rc == 0
    assert not Path(default_status_file(str(dp_dir))).exists()  # no stale status after a clean stop


def test_status_says_what_the_plugin_knows_of_the_kubelets_side(  # type: ignore[no-untyped-def]
    kubelet, start_plugin, dp_dir: Path
) -> None:
    """Issue 30: status said "registered, 1000 devices" while the kubelet's endpoint was another
    instance's registration (allocatable 0). Now each resource says its registration, whether the
    kubelet's stream is open, and whether the kubelet confirmed the registration (an Allocate reaches
    only the endpoint the kubelet holds); until then the figures are said to be the plugin's own."""
    start_plugin()
    assert kubelet.wait_registered(RES, timeout=30)
    doc = wait_doc(dp_dir, lambda d: bool(d["resources"]) and d["resources"][0].get("kubelet", {}).get("stream_open"))
    seen = doc["resources"][0]["kubelet"]
    assert (seen["registration"], seen["confirmed"], seen["unregistered_since"]) == ("registered", None, None)
    text = status(dp_dir).stdout
    assert "kubelet: registered, its stream open; not confirmed by the kubelet" in text
    assert "kubectl get node" in text  # where to see the kubelet's own figures

    kubelet.allocate(RES, 1, pod="p1")
    doc = wait_doc(dp_dir, lambda d: d["resources"][0]["kubelet"]["confirmed"] is not None)
    assert "kubelet: registered, its stream open; confirmed by its first Allocate at" in status(dp_dir).stdout

    kubelet.stop()  # kubelet.sock removed, the stream ended: no longer registered, and since when
    doc = wait_doc(dp_dir, lambda d: d["resources"][0]["kubelet"]["registration"] != "registered")
    seen = doc["resources"][0]["kubelet"]
    assert seen["confirmed"] is None and seen["unregistered_since"] is not None
    line = f"kubelet: NOT registered ({seen['registration']}) since {seen['unregistered_since']}"
    assert line in status(dp_dir).stdout


def test_status_without_a_running_plugin_says_so(tmp_path: Path) -> None:
    out = status(tmp_path)
    assert out.returncode == 1
    assert "the plugin is not running there" in out.stderr


def test_nic_health_reasons() -> None:
    """The one health rule (health.py): the pools apply it, the status file shows its reason."""
    assert NicHealth(True, ("ACTIVE",), True).healthy and NicHealth(True, ("ACTIVE",), True).why == ""
    assert NicHealth(False, (), False).why == "NIC gone from sysfs"
    assert NicHealth(True, ("ACTIVE", "INIT"), True).why == "port 2 INIT (not ACTIVE)"
    assert NicHealth(True, ("ACTIVE",), False).why == "no uverbs character device"
    assert NicHealth(True, (), True).why == "no ports" and not NicHealth(True, (), True).healthy


def test_render_puts_the_result_first() -> None:
    doc = {"mode": "exclusive", "updated": "t", "resources": [{"name": RES, "capacity": 4, "allocatable": 4}],
           "nics": [], "allocations": []}  # fmt: skip
    lines = render(doc).splitlines()
    assert lines[0].startswith("mode: exclusive") and lines[1] == "rdma/hca: capacity 4, allocatable 4"


def test_status_file_survives_a_kubelet_restart(sim, start_plugin, dp_dir: Path) -> None:  # type: ignore[no-untyped-def]
    """A restarting 1.32 kubelet deletes every file of the device-plugin dir but the checkpoint
    (manager.go CleanupPluginDirectory, as the simulator's start does); the status file lives in a
    subdirectory."""
    start_plugin()
    assert sim.wait_registered(RES)
    wait_doc(dp_dir, lambda d: bool(d["resources"]))
    sim.restart()
    assert sim.wait_registered(RES, timeout=30)
    assert status(dp_dir).returncode == 0


def test_status_hooks_forward_every_hook_to_the_wrapped_one(tmp_path: Path) -> None:
    """serve wraps the metrics hooks in the status-file hooks: a hook not forwarded would
    silently freeze the metrics alerts rely on (stream open, loop timestamps, NIC info)."""
    import inspect

    from rdma_device_plugin.server import Hooks
    from rdma_device_plugin.status import StatusFileHooks

    calls: list[str] = []

    class Recorder(Hooks):
        pass

    names = [n for n, f in inspect.getmembers(Hooks, inspect.isfunction) if not n.startswith("_")]
    for name in names:
        setattr(Recorder, name, lambda self, *a, _n=name, **k: calls.append(_n))
    hooks = StatusFileHooks(str(tmp_path / "status.json"), Recorder())
    try:
        for name in names:
            args = [() for _ in list(inspect.signature(getattr(Hooks, name)).parameters)[1:]]
            if name == "allocated":
                args = ["rdma/hca", 0.001, True]
            if name == "published":  # a real one: the status writer thread reads it
                from rdma_device_plugin.published import EMPTY_AFFINITY, NodeView

                args = [NodeView((), {}, (), EMPTY_AFFINITY, {}, (), False)]
            getattr(hooks, name)(*args)
    finally:
        hooks.stop()
    assert sorted(calls) == sorted(names)


def test_the_published_view_is_the_pools_after_each_change(node: fixtures.FixtureNode, short_tmp: Path) -> None:
    """The status-file writer and the metrics read only what the supervisor publishes: every view
    it publishes shows the pools after the change (never before it), and a view once published
    never changes, whatever the pools do next (one owner, issue 30)."""
    from rdma_device_plugin.config import PluginConfig
    from rdma_device_plugin.published import NodeView
    from rdma_device_plugin.server import Hooks
    from rdma_device_plugin.supervisor import Supervisor

    seen: list[NodeView] = []

    class Seen(Hooks):
        def published(self, view: NodeView) -> None:
            seen.append(view)

    dp = short_tmp / "dp-views"
    dp.mkdir()
    sup = Supervisor(PluginConfig(), node.sysfs, node.dev, str(dp), Seen())
    try:
        sup.discovery.full()
        sup._publish()
        node.set_port_state("mlx5_bond_1", "DOWN")
        sup.discovery.probe()
        sup._publish()
        sup._publish()  # nothing changed: nothing published
        node.set_port_state("mlx5_bond_1", "ACTIVE")
        sup.discovery.probe()
        sup._publish()
    finally:
        sup.discovery.close()
    assert [{d.health for d in v.pools[0].devices} for v in seen] == [{"Healthy"}, {"Unhealthy"}, {"Healthy"}]
    assert [v.port_states["mlx5_bond_1"] for v in seen] == [("ACTIVE",), ("DOWN",), ("ACTIVE",)]
    assert [v.pools[0].healthy for v in seen] == [1000, 0, 1000]  # the first view did not change meanwhile


def test_render_shows_the_env_a_pod_gets_and_what_is_left_unset() -> None:
    """docs/nccl.md: the resource line flags it, the env block names the variable, reason and picks."""
    unset = {"variable": "NCCL_IB_GID_INDEX", "reason": "gid_index_differs", "detail": "mlx5_bond_1 port 1: 5 (...)"}
    env = {"scope": "", "env": {"NCCL_IB_HCA": "=mlx5_bond_0,mlx5_bond_1"}, "unset": [unset]}
    doc = {"mode": "shared", "resources": [{"name": RES, "capacity": 4, "allocatable": 4, "env": [env]}],
           "nics": [], "allocations": []}  # fmt: skip
    text = render(doc)
    assert "rdma/hca: capacity 4, allocatable 4   <- env left unset, see below" in text
    assert "env a pod gets (rdma/hca):\n  NCCL_IB_HCA==mlx5_bond_0,mlx5_bond_1\n" in text
    assert "  unset NCCL_IB_GID_INDEX (gid_index_differs): mlx5_bond_1 port 1: 5 (...)" in text
