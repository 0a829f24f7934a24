"""node.nicchecks: the RDMA NIC checks of rdma_nic_validate, in Python on the node (was a Jinja template)."""

from __future__ import annotations

from pathlib import Path

import pytest

from rdma_device_plugin.node import fixtures, ipv6checks, nicchecks, selectors, sysfs

LINGJUN = nicchecks.Expectations(
    expected_nics=4, link_layer="Ethernet", rate_gbps=200, min_driver_version="24.10-1.1.4", min_fw_version="28.39.1002"
)
PER_NIC = ["port_state", "link_layer", "rate", "firmware_min", "uverbs"]


def _checks(root: Path, spec: fixtures.NodeSpec, want: nicchecks.Expectations = LINGJUN) -> list[ipv6checks.Check]:
    node = fixtures.write_node(str(root), spec)
    nics = sysfs.read_nics(node.sysfs, node.dev)
    chosen = selectors.Selectors().select(nics)
    read = nicchecks.NodeRead(
        nics=chosen,
        ignored=[n.name for n in nics if n not in chosen],
        modules=sysfs.loaded_modules(node.sysfs, list(want.modules)),
        driver_version=sysfs.module_version(node.sysfs, want.version_module),
        rdma_cm=sysfs.rdma_cm(node.dev),
    )
    return nicchecks.check(read, want, node.sysfs, nicchecks.selection_text({"vendors": ["15b3"]}))


def _failed(checks: list[ipv6checks.Check]) -> list[tuple[str, str]]:
    return [(c.name, c.nic) for c in checks if not c.passed]


def test_a_healthy_node_passes_every_check_in_order(short_tmp: Path) -> None:
    checks = _checks(short_tmp / "ok", fixtures.lingjun_node(nics=4))
    assert _failed(checks) == []
    assert [(c.name, c.nic) for c in checks] == (
        [("kernel_modules", ""), ("driver_version", ""), ("rdma_devices", "")]
        + [(name, f"mlx5_bond_{i}") for i in range(4) for name in PER_NIC]
        + [("firmware_consistent", ""), ("rdma_cm", "")]
    )
    by_name = {(c.name, c.nic): c.message() for c in checks}
    assert by_name["rdma_devices", ""] == (
        '4 compute RDMA device(s) match rdma_selectors {"vendors": ["15b3"]} '
        "(mlx5_bond_0, mlx5_bond_1, mlx5_bond_2, mlx5_bond_3)"
    )
    assert by_name["rate", "mlx5_bond_1"] == "mlx5_bond_1: rate 200 Gb/sec (4X HDR)"
    assert by_name["firmware_consistent", ""] == "every NIC runs firmware 28.39.1002"
    assert by_name["rdma_cm", ""] == "/dev/infiniband/rdma_cm present"
    # unset expectations are not checked
    bare = _checks(short_tmp / "bare", fixtures.lingjun_node(nics=1), nicchecks.Expectations())
    assert [c.name for c in bare] == ["kernel_modules", "rdma_devices", "port_state", "rate", "uverbs", "rdma_cm"]
    assert bare[3].message() == (  # rate is checked by default, against the node's own best port of the model
        "mlx5_bond_0: rate 200 Gb/sec (4X HDR), the node's best for its model (the fleet report compares it across "
        "nodes)"
    )


def _nic(spec: fixtures.NodeSpec, name: str, **changes: object) -> fixtures.NodeSpec:
    return fixtures.with_nic_changes(spec, name, **changes)


NODE = fixtures.lingjun_node(nics=4)


@pytest.mark.parametrize(
    ("spec", "failed", "message"),
    [
        (
            fixtures.NodeSpec(nics=NODE.nics, modules=("mlx5_core", "ib_core", "ib_uverbs", "rdma_ucm")),
            [("kernel_modules", "")],
            "kernel module(s) mlx5_ib not loaded. Fix: modprobe mlx5_ib (install MLNX_OFED/DOCA-OFED or rdma-core "
            "if a module is unknown) and list them in /etc/modules-load.d/.",
        ),
        (
            fixtures.NodeSpec(nics=NODE.nics, driver_version="5.8-1.0.1"),
            [("driver_version", "")],
            "mlx5_core driver version is 5.8-1.0.1, required >= 24.10-1.1.4. Fix: install MLNX_OFED/DOCA-OFED",
        ),
        (
            fixtures.NodeSpec(nics=NODE.nics, driver_version=""),
            [("driver_version", "")],
            "driver version is unknown (no ",
        ),
        (
            fixtures.NodeSpec(nics=NODE.nics[:3]),
            [("rdma_devices", "")],
            "3 compute RDMA device(s) match rdma_selectors",
        ),
        (
            _nic(NODE, "mlx5_bond_1", port_state="DOWN", phys_state="Disabled"),
            [("port_state", "mlx5_bond_1")],
            "mlx5_bond_1: port 1 is DOWN/Disabled, expected ACTIVE/LinkUp. Fix: check the cable",
        ),
        (
            _nic(NODE, "mlx5_bond_3", rate="100 Gb/sec (4X EDR)"),
            [("rate", "mlx5_bond_3")],
            "mlx5_bond_3: port rate is 100 Gb/sec (4X EDR), expected 200 Gb/sec. Fix: check the cable/transceiver "
            "(its type and speed), the switch port's speed and width, and the port's configured speed (ethtool bond3; "
            "InfiniBand: ibportstate)",
        ),
        (
            _nic(NODE, "mlx5_bond_2", fw_ver="28.41.1000"),
            [("firmware_consistent", "mlx5_bond_2")],
            "firmware differs across NICs: mlx5_bond_2=28.41.1000 while the others run 28.39.1002. Fix: flash",
        ),
        (
            _nic(NODE, "mlx5_bond_2", fw_ver="28.38.9"),
            [("firmware_min", "mlx5_bond_2"), ("firmware_consistent", "mlx5_bond_2")],
            "mlx5_bond_2: firmware 28.38.9 is older than the required 28.39.1002",
        ),
        (
            fixtures.NodeSpec(nics=_nic(NODE, "mlx5_bond_0", char_device=False).nics, rdma_cm=False),
            [("uverbs", "mlx5_bond_0"), ("rdma_cm", "")],
            "/dev/infiniband/rdma_cm is missing. Fix: modprobe rdma_ucm",
        ),
    ],
    ids=["module", "driver-old", "driver-unknown", "count", "port", "rate", "fw-odd", "fw-min", "chardev"],
)
def test_each_check_fails_on_its_broken_node(
    short_tmp: Path, spec: fixtures.NodeSpec, failed: list[tuple[str, str]], message: str
) -> None:
    checks = _checks(short_tmp / "bad", spec)
    assert _failed(checks) == failed
    bad = [c.message() for c in checks if not c.passed]
    assert any(message in m for m in bad), bad
    assert all(". Fix: " in m for m in bad)


def test_link_layer_infiniband_fails_every_nic_when_ethernet_is_wanted(short_tmp: Path) -> None:
    checks = _checks(short_tmp / "ib", fixtures.lingjun_node(nics=4, link_layer="InfiniBand"))
    assert [f for f in _failed(checks) if f[0] == "link_layer"] == [("link_layer", f"mlx5_bond_{i}") for i in range(4)]
    msg = next(c.message() for c in checks if c.name == "link_layer" and c.nic == "mlx5_bond_2")
    assert msg.startswith(
        "mlx5_bond_2: link layer is InfiniBand, expected Ethernet. "
        "Fix: set the port type with mlxconfig (LINK_TYPE_P1=ETH)"
    )


def test_versions_compare_numerically() -> None:
    assert nicchecks.version_tuple("24.10-1.1.4") == (24, 10, 1, 1, 4)
    assert nicchecks.version_tuple("28.100.1") > nicchecks.version_tuple("28.39.1002")  # not as strings
    with pytest.raises(ValueError, match="link_layer"):
        nicchecks.Expectations(link_layer="ethernet")
    with pytest.raises(ValueError, match="expected_nics"):
        nicchecks.Expectations(expected_nics=0)


def test_a_missing_or_wrong_root_is_reported_as_such(short_tmp: Path) -> None:
    node = fixtures.write_node(str(short_tmp / "n"), fixtures.lingjun_node(nics=1))
    assert all(c.passed for c in nicchecks.root_checks(node.sysfs, node.procfs, node.dev))
    bad = nicchecks.root_checks(str(short_tmp / "nope"), node.sysfs, node.dev)
    assert [(c.passed, c.message()) for c in bad] == [
        (
            False,
            f"the sysfs root {short_tmp}/nope does not exist. "
            "Fix: set rdma_sysfs_root to where the node's sysfs is mounted.",
        ),
        (
            False,
            f"the procfs root {node.sysfs} is not a procfs tree (no net/ under it). "
            "Fix: set rdma_procfs_root to where the node's procfs is mounted.",
        ),
        (True, f"dev root {node.dev}"),
    ]


def test_a_string_selector_is_refused_not_split_into_characters() -> None:
    with pytest.raises(
        ValueError, match=r'selector vendors must be a list of strings, not \'15b3\'; write vendors: \["15b3"\]'
    ):
        selectors.Selectors.from_mapping({"vendors": "15b3"})  # type: ignore[dict-item]


IB = fixtures.lingjun_node(nics=4, bond=False, link_layer="InfiniBand")


@pytest.mark.parametrize(
    ("spec", "failed"),
    [
        (IB, []),
        (_nic(IB, "mlx5_2", rate="200 Gb/sec (2X NDR)"), [("rate", "mlx5_2")]),  # two of the four lanes
        # another model at its own rate is no fault (each model against its own best port)
        (_nic(IB, "mlx5_3", device_id="101b", hca_type="MT4123", rate="200 Gb/sec (4X HDR)"), []),
        # a port that is down is port_state's, not rate's
        (
            _nic(IB, "mlx5_1", port_state="DOWN", phys_state="Disabled", rate="10 Gb/sec (4X SDR)"),
            [("port_state", "mlx5_1")],
        ),
    ],
    ids=["ndr", "2x-ndr", "other-model", "down"],
)
def test_rate_is_checked_by_default_against_the_best_port_of_the_model(
    short_tmp: Path, spec: fixtures.NodeSpec, failed: list[tuple[str, str]]
) -> None:
    """Issue 32: an NDR port at 200 Gb/sec (2X NDR) passed (rate was checked only with rate_gbps)."""
    checks = _checks(short_tmp / "n", spec, nicchecks.Expectations())
    assert _failed(checks) == failed
    if failed == [("rate", "mlx5_2")]:
        msg = next(c.message() for c in checks if c.name == "rate" and c.nic == "mlx5_2")
        assert msg.startswith(
            "mlx5_2: port 1 runs at 200 Gb/sec (2X NDR), below the 400 Gb/sec (4X NDR) of mlx5_0 (same model "
            "15b3:1021). Fix: check the cable/transceiver"
        )
