"""The plugin config inside every rendered ConfigMap is accepted by the plugin's own loader and carries
the values it was rendered from."""

from __future__ import annotations

import pytest
from conftest import CASES, manifests, one
from rdma_device_plugin.config import load_config_text


def _configs(values: dict):
    objs = manifests(values)
    return {mode: load_config_text(one(objs, "ConfigMap", f"-{mode}")["data"]["config.yaml"], f"configmap {mode}") for mode in ("shared", "exclusive")}


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_config_loads(case: str) -> None:
    values = CASES[case]
    configs = _configs(values)
    for mode, cfg in configs.items():
        assert cfg.version == "v1"
        assert cfg.mode == mode
        assert cfg.resources[0].name == values.get("resourceName", "rdma/hca")
        assert cfg.resources[0].shared_devices == values.get("sharedDevices", 1000)
        nhn = values.get("nonHostNetwork", {})
        assert cfg.non_host_network.enabled is nhn.get("enabled", False)
        assert cfg.non_host_network.checks == nhn.get("checks", "enforce")
        assert dict(cfg.non_host_network.env) == nhn.get("env", {})
        assert cfg.cdi.enabled is values.get("cdi", {}).get("enabled", False)
    # the two configs differ only in mode
    shared, exclusive = configs["shared"], configs["exclusive"]
    assert shared.model_dump() | {"mode": None} == exclusive.model_dump() | {"mode": None}


def test_defaults_match_ack() -> None:
    cfg = _configs({})["shared"]
    assert [(r.name, r.shared_devices, r.selectors.vendors) for r in cfg.resources] == [("rdma/hca", 1000, ["15b3"])]
    assert cfg.health.policy == "all" and cfg.health.interval_seconds == 0.1
    assert cfg.rediscovery_interval_seconds == 60
    assert not cfg.char_devices.umad and not cfg.char_devices.issm


def test_extra_resources_and_selectors_reach_the_plugin() -> None:
    cfg = _configs(CASES["extra-resources"])["shared"]
    assert [(r.name, r.shared_devices) for r in cfg.resources] == [
        ("rdma/hca_roce", 500),
        ("rdma/hca_ib", 100),
        ("example.com/bond0", 1000),
    ]
    main = cfg.resources[0].selectors
    assert main.device_ids == ["101d", "1021"] and main.drivers == ["mlx5_core"] and main.link_types == ["Ethernet"]
    assert cfg.resources[1].selectors.link_types == ["InfiniBand"]
    assert cfg.resources[2].selectors.vendors == ["15b3"]  # plugin default when a pool gives no selectors
    assert cfg.char_devices.umad and cfg.char_devices.issm
    assert dict(cfg.env) == {"NCCL_IB_HCA": "mlx5"}
    assert cfg.health.policy == "any" and cfg.health.interval_seconds == 2
    assert cfg.rediscovery_interval_seconds == 30


def test_cdi_kind_reaches_the_plugin() -> None:
    cfg = _configs(CASES["cdi"])["exclusive"]
    assert cfg.cdi.enabled and cfg.cdi.kind == "example.com/rdma"


def test_link_event_health_values_reach_the_plugin_and_hostnetwork_gives_them_netdevs() -> None:
    """health.linkEvents* pass through to the plugin; hostNetwork puts the plugin in the node's
    network namespace (where it sees the netdevs' link events) without enabling nonHostNetwork."""
    values = {"hostNetwork": True, "health": {"linkEvents": False, "linkEventsIntervalSeconds": 5}}
    cfg = _configs(values)["shared"]
    assert cfg.health.link_events is False and cfg.health.link_events_interval_seconds == 5
    assert cfg.non_host_network.enabled is False
    objs = manifests(values)
    for mode in ("shared", "exclusive"):
        pod = one(objs, "DaemonSet", f"-{mode}")["spec"]["template"]["spec"]
        assert pod["hostNetwork"] is True and pod["dnsPolicy"] == "ClusterFirstWithHostNet"
    default = one(manifests({}), "DaemonSet", "-shared")["spec"]["template"]["spec"]
    assert "hostNetwork" not in default
    assert _configs({})["shared"].health.link_events is True


def test_numa_pools_reach_the_shared_config_only() -> None:
    """numaPools splits shared pools; the exclusive DaemonSet's config leaves it out (the plugin refuses it
    there: exclusive devices already carry each NIC's NUMA node)."""
    values = {"numaPools": True, "extraResources": [{"name": "rdma/ib", "numaPools": True}, {"name": "rdma/x"}]}
    configs = _configs(values)
    assert [r.numa_pools for r in configs["shared"].resources] == [True, True, False]
    assert [r.numa_pools for r in configs["exclusive"].resources] == [False, False, False]


def test_workload_env_reaches_the_plugin() -> None:
    assert _configs({})["shared"].workload_env.model_dump(by_alias=True) == {
        "enabled": True,
        "addrFamily": "auto",
        "addrRange": "",
        "roceVersion": 2,
        "ucx": True,
    }
    values = {"workloadEnv": {"enabled": False, "addrFamily": "AF_INET6", "addrRange": "2408:4005::/32", "ucx": False}}
    env = _configs(values)["exclusive"].workload_env
    assert (env.enabled, env.addr_family, env.addr_range, env.ucx) == (False, "AF_INET6", "2408:4005::/32", False)
