"""The DRA device model (pure): names the API accepts, the counters that keep a NIC's views apart, which
view serves the extended resource in each mode, taints. The real allocator's verdicts on it are in
test_dra_cluster.py."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest

from rdma_device_plugin.dra import model, version
from rdma_device_plugin.health import NicHealth
from rdma_node import fixtures, sysfs

DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")


def views(tmp_path: object, nics: int = 4, down: tuple[str, ...] = ()) -> list[model.NicView]:
    node = fixtures.write_node(str(tmp_path), fixtures.lingjun_node(nics=nics))
    for name in down:
        node.set_port_state(name, "DOWN")
    found = sysfs.read_nics(node.sysfs, node.dev)
    return [
        model.NicView(n, NicHealth(True, tuple(p.state for p in n.ports)), "rdma/hca", f"pci0000:{i:02x}")
        for i, n in enumerate(found)
    ]


def test_device_names_are_dns_labels_unique_and_stable() -> None:
    keys = {n: n for n in ["mlx5_bond_0", "MLX5-bond-0", "mlx5_0", "roce\\xff0", "\\xfe", "a-x", "a"]}
    keys["mlx5_9"] = "0000:5a:00.0"
    names = model.device_names(keys)
    assert names["mlx5_bond_0"] == "mlx5-bond-0" and names["mlx5_0"] == "mlx5-0" and names["mlx5_9"] == "0000-5a-00-0"
    assert all(DNS_LABEL.fullmatch(n) for n in names.values())
    labels = list(names.values())
    # Unique, also against every NIC's exclusive view (<name>-x): "a-x" must not be "a"'s exclusive view.
    assert len(set(labels) | {n + model.EXCLUSIVE_SUFFIX for n in labels}) == 2 * len(labels)
    two = {"MLX5-bond-0": "MLX5-bond-0", "mlx5_bond_0": "mlx5_bond_0"}
    assert model.device_names(two) == {k: names[k] for k in two}
    assert model.device_names({"all_hca": "all_hca"}, reserved=["all-hca"])["all_hca"] != "all-hca"


def test_device_names_follow_the_pci_function_not_the_kernel_name(tmp_path: object) -> None:
    """A reboot that gives mlx5_bond_0 and mlx5_bond_2 each other's names (probe order): every device
    name still stands for the same PCI function, with the same pcieRoot, and the slices are the same
    but for the rdmaDevice (and netdev) attributes."""
    r = [model.ResourceView("rdma/hca", 10, "all")]
    before = model.build("d.example.com", "n", "shared", r, views(tmp_path), {})
    renamed = {"mlx5_bond_0": "mlx5_bond_2", "mlx5_bond_2": "mlx5_bond_0"}
    after_views = [
        model.NicView(replace(v.nic, name=renamed.get(v.nic.name, v.nic.name)), v.health, v.resource, v.pcie_root)
        for v in views(tmp_path)
    ]
    after = model.build("d.example.com", "n", "shared", r, after_views, {})

    def by_device(pub: model.Published) -> dict[str, tuple[str, str, str]]:
        return {
            d["name"]: (
                d["attributes"][model.PCI_BUS_ID]["string"],
                d["attributes"][model.PCIE_ROOT]["string"],
                d["attributes"]["rdmaDevice"]["string"],
            )
            for d in pub.all_devices()
            if model.PCI_BUS_ID in d["attributes"]
        }

    b, a = by_device(before), by_device(after)
    assert b["0000-1a-00-0"][:2] == a["0000-1a-00-0"][:2] == ("0000:1a:00.0", "pci0000:00")
    assert (b["0000-1a-00-0"][2], a["0000-1a-00-0"][2]) == ("mlx5_bond_0", "mlx5_bond_2")
    assert {k: v[:2] for k, v in b.items()} == {k: v[:2] for k, v in a.items()}
    assert after.refs["0000-1a-00-0-x"].nics == ("mlx5_bond_2",)  # prepare hands out the NIC by its new name
    assert [d["name"] for d in before.all_devices()] == [d["name"] for d in after.all_devices()]
    assert before.counters == after.counters


def test_the_set_device_name_stays_a_dns_label() -> None:
    long = "example.com/" + "r" * 61  # a 61-character resource name: "all-" + 61 is 65 characters
    name = model.set_device_name(long)
    assert DNS_LABEL.fullmatch(name) and len(name) == 63 and name.startswith("all-rrrr")
    assert model.set_device_name(long) == name  # stable
    assert model.set_device_name("b.example.com/hca", taken=["all-hca"]) not in ("all-hca", name)
    assert model.set_device_name("rdma/hca") == "all-hca"


def test_a_resource_name_longer_than_an_attribute_is_refused_by_name(tmp_path: object) -> None:
    long = "example.com/" + "r" * 61  # 73 characters: the resource attributes hold 64
    with pytest.raises(ValueError, match=r"resource name\(s\) \['example.com/r+'\] longer than 64 characters"):
        model.build("d.example.com", "n", "shared", [model.ResourceView(long, 10, "all")], views(tmp_path), {})
    numa = "example.com/" + "r" * 50  # 62 characters, but <it>-numa0 is 68
    mine = [replace(v, resource=numa) for v in views(tmp_path)]
    with pytest.raises(ValueError, match="-numa0 is longer than 64 characters"):
        model.build("d.example.com", "n", "shared", [model.ResourceView(numa, 10, "all", True)], mine, {})


@pytest.mark.parametrize(
    ("rate", "gbps"),
    [("200 Gb/sec (4X HDR)", 200.0), ("400 Gb/sec (4X NDR)", 400.0), ("2.5 Gb/sec (1X SDR)", 2.5), ("", None)],
)
def test_rate(rate: str, gbps: float | None) -> None:
    assert model.rate_gbps(rate) == gbps


@pytest.mark.parametrize(
    ("health", "value"),
    [
        (NicHealth(False, ()), "gone"),
        (NicHealth(True, ()), "no-ports"),
        (NicHealth(True, ("ACTIVE", "DOWN")), "port-down"),
        (NicHealth(True, ("INIT",)), "port-init"),
        (NicHealth(True, ("ACTIVE",), uverbs=False), "no-uverbs"),
    ],
)
def test_taint_values_say_why(health: NicHealth, value: str) -> None:
    assert model.taint_value(health) == value


def test_counters_keep_the_views_of_a_nic_apart(tmp_path: object) -> None:
    r = model.ResourceView("rdma/hca", 1000, "all")
    pub = model.build("rdma.lingjun.io", "node-a", "shared", [r], views(tmp_path), {})
    assert pub.counters is not None
    counters = pub.counters["sharedCounters"][0]["counters"]
    devices = {d["name"]: d for d in pub.devices["devices"]}
    nics = [f"0000-{0x1A + 0x20 * i:02x}-00-0" for i in range(4)]  # the PCI functions of mlx5_bond_0..3
    assert counters == {nic: {"value": "2"} for nic in nics}  # its shared view + the set
    for nic in nics:
        (shared,) = devices[nic]["consumesCounters"]
        (excl,) = devices[nic + "-x"]["consumesCounters"]
        assert shared["counters"] == {nic: {"value": "1"}} and devices[nic]["allowMultipleAllocations"]
        assert excl["counters"] == {nic: {"value": "2"}} and "allowMultipleAllocations" not in devices[nic + "-x"]
    (whole,) = devices["all-hca"]["consumesCounters"]
    assert whole["counters"] == {nic: {"value": "1"} for nic in nics}
    assert pub.devices["pool"] == pub.counters["pool"] == {"name": "node-a", "generation": 1, "resourceSliceCount": 2}
    assert pub.refs["all-hca"].nics == tuple(f"mlx5_bond_{i}" for i in range(4))


@pytest.mark.parametrize("mode", ["shared", "exclusive"])
def test_the_mode_decides_which_view_serves_the_extended_resource(tmp_path: object, mode: str) -> None:
    pub = model.build("d.example.com", "n", mode, [model.ResourceView("rdma/hca", 10, "all")], views(tmp_path), {})
    serving = sorted(d["name"] for d in pub.devices["devices"] if "extendedResource" in d["attributes"])
    expected = ["all-hca"] if mode == "shared" else [f"0000-{0x1A + 0x20 * i:02x}-00-0-x" for i in range(4)]
    assert serving == expected


def test_a_nic_down_taints_its_views_and_the_set_by_policy(tmp_path: object) -> None:
    vs = views(tmp_path, down=("mlx5_bond_1",))
    since = {"mlx5_bond_1": "2026-01-01T00:00:00Z"}
    for policy, set_tainted in (("all", True), ("any", False)):
        pub = model.build("d.example.com", "n", "shared", [model.ResourceView("rdma/hca", 10, policy)], vs, since)
        taints = {d["name"]: d.get("taints", []) for d in pub.devices["devices"]}
        bad = {
            "key": "rdma.lingjun.io/unhealthy",
            "value": "port-down",
            "effect": "NoSchedule",
            "timeAdded": since["mlx5_bond_1"],
        }
        assert taints["0000-3a-00-0"] == taints["0000-3a-00-0-x"] == [bad]  # mlx5_bond_1
        assert taints["0000-1a-00-0"] == []
        assert bool(taints["all-hca"]) is set_tainted
        assert pub.health["0000-3a-00-0"] == (False, "port 1 DOWN (not ACTIVE)")


def test_33_nics_take_two_counter_sets_and_two_device_slices(tmp_path: object) -> None:
    """More NICs than a counter set holds (32): the pool gets a counter set per 32 NICs and a devices
    slice per 64 devices, each within the API's limits, and every NIC's views count against its NIC."""
    node = fixtures.write_node(str(tmp_path), fixtures.many_nics_node(33))
    found = sysfs.read_nics(node.sysfs, node.dev)
    vs = [model.NicView(n, NicHealth(True, ("ACTIVE",)), "rdma/hca") for n in found]
    pub = model.build("d.example.com", "n", "shared", [model.ResourceView("rdma/hca", 10, "all")], vs, {})
    specs = pub.specs()
    assert sorted(specs) == ["counters", "devices", "devices-1"]
    assert all(s["pool"]["resourceSliceCount"] == 3 for s in specs.values())
    assert pub.counters is not None
    sets = {cs["name"]: cs["counters"] for cs in pub.counters["sharedCounters"]}
    assert sorted(sets) == ["nics", "nics-1"] and [len(c) for c in sets.values()] == [32, 1]
    devices = pub.all_devices()
    assert len(devices) == 2 * 33 + 1 and [len(specs[k]["devices"]) for k in ("devices", "devices-1")] == [64, 3]
    counted = {name for c in sets.values() for name in c}
    for d in devices:
        assert DNS_LABEL.fullmatch(d["name"])
        for use in d["consumesCounters"]:
            assert set(use["counters"]) <= set(sets[use["counterSet"]])  # counted in the set it names
    (whole,) = [d for d in devices if d["name"] == "all-hca"]
    assert (
        len(whole["consumesCounters"]) == 2 and {n for u in whole["consumesCounters"] for n in u["counters"]} == counted
    )
    assert len(counted) == 33


def test_beyond_the_limits_a_clear_error_and_no_nic_publishes_an_empty_pool(tmp_path: object) -> None:
    node = fixtures.write_node(str(tmp_path), fixtures.many_nics_node(65))
    vs = [model.NicView(n, NicHealth(True, ("ACTIVE",)), "rdma/hca") for n in sysfs.read_nics(node.sysfs, node.dev)]
    with pytest.raises(
        ValueError, match="65 NICs of resource rdma/hca on node n: its all-NICs device can count at most 64"
    ):
        model.build("d.example.com", "n", "shared", [model.ResourceView("rdma/hca", 10, "all")], vs, {})
    empty = model.build("d.example.com", "n", "shared", [model.ResourceView("rdma/hca", 10, "all")], [], {})
    assert empty.counters is None and empty.devices["devices"] == []
    assert empty.devices["pool"]["resourceSliceCount"] == 1 and list(empty.specs()) == ["devices"]


def test_numa_pools_get_a_set_per_numa_node_in_shared_mode(tmp_path: object) -> None:
    """``numaPools``: ``rdma/hca-numa<N>`` through DRA, a set device of node N's NICs that serves it;
    each such set is one more share of its NICs in their counters."""
    r = model.ResourceView("rdma/hca", 10, "all", numa_pools=True)
    pub = model.build("d.example.com", "n", "shared", [r], views(tmp_path), {})
    devices = {d["name"]: d for d in pub.all_devices()}
    serving = {
        d["attributes"]["extendedResource"]["string"]: n
        for n, d in devices.items()
        if "extendedResource" in d["attributes"]
    }
    assert serving == {"rdma/hca": "all-hca", "rdma/hca-numa0": "all-hca-numa0", "rdma/hca-numa1": "all-hca-numa1"}
    assert pub.refs["all-hca-numa1"].nics == ("mlx5_bond_2", "mlx5_bond_3")
    assert devices["all-hca-numa1"]["attributes"][model.NUMA_NODE] == {"int": 1}
    assert pub.counters is not None
    assert set(c["value"] for c in pub.counters["sharedCounters"][0]["counters"].values()) == {"3"}
    assert devices["0000-5a-00-0-x"]["consumesCounters"][0]["counters"] == {"0000-5a-00-0": {"value": "3"}}
    # Exclusive mode has no numaPools (the config refuses it): no NUMA sets.
    excl = model.build("d.example.com", "n", "exclusive", [r], views(tmp_path), {})
    assert not [d for d in excl.all_devices() if "numa" in d["name"]]


@pytest.mark.parametrize(
    ("doc", "refused"),
    [
        ({"major": "1", "minor": "37", "gitVersion": "v1.37.2"}, False),
        ({"major": "1", "minor": "38+", "gitVersion": "v1.38.0-gke.1"}, False),  # a provider's "+"
        ({"gitVersion": "v1.37.0"}, False),  # no major/minor: the gitVersion says
        ({"major": "1", "minor": "36+", "gitVersion": "v1.36.9-eks-1"}, True),
        ({"major": "1", "minor": "36", "gitVersion": "v1.36.2"}, True),
    ],
)
def test_the_servers_below_the_floor(doc: dict[str, str], refused: bool) -> None:
    why = version.refusal(doc)
    assert bool(why) is refused
    if refused:
        assert why.startswith(f"the API server is Kubernetes {doc['gitVersion']}; the DRA driver needs 1.37 or later")
    with pytest.raises(ValueError, match="names no version"):
        version.server_version({"major": "", "gitVersion": "unknown"})
