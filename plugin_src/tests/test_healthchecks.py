"""node.healthchecks on fixture nodes: every check passes on a healthy Lingjun node and fails, naming
the NIC/netdev/GPU, the value seen, the expected and the fix, on a node with that one fault."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from rdma_node import fixtures, healthchecks, sysfs
from rdma_node.checks import Check
from rdma_node.healthchecks import Expectations

NODE = fixtures.lingjun_node(nics=4)
HEALTHY_NAMES = {
    "pcie_link", "mtu", "netdev_link", "bond", "lacp", "roce_trust", "roce_pfc", "roce_ecn", "port_counters",
    "link_flap", "mtu_consistent", "gid_index", "memlock", "gpu_pcie_link", "gpu_nic_numa",
}  # fmt: skip


def _no_wait(seconds: float) -> None:
    """The counter interval's wait: a fixture's counters move only when a test moves them."""


def _read(
    root: Path, spec: fixtures.NodeSpec, want: Expectations, sleep: Callable[[float], None] = _no_wait
) -> tuple[fixtures.FixtureNode, healthchecks.NodeRead]:
    node = fixtures.write_node(str(root), spec)
    nics = sysfs.read_nics(node.sysfs, node.dev)
    return node, healthchecks.read(nics, node.sysfs, node.procfs, node.root, want, real_node=False, sleep=sleep)


def _checks(root: Path, spec: fixtures.NodeSpec, want: Expectations | None = None) -> list[Check]:
    want = want or Expectations()
    _, read = _read(root, spec, want)
    return healthchecks.check(read, want)


def _subject(c: Check) -> str:
    return c.gpu or (f"{c.nic}/{c.netdev}" if c.netdev and c.name.startswith("roce_") else c.nic)


def _failed(checks: list[Check]) -> list[tuple[str, str]]:
    return sorted((c.name, _subject(c)) for c in checks if not c.passed)


def test_a_healthy_lingjun_node_passes_every_check(short_tmp: Path) -> None:
    checks = _checks(short_tmp / "ok", NODE)
    assert _failed(checks) == []
    assert {c.name for c in checks} == HEALTHY_NAMES
    # PFC needs DCB netlink: said, never passed silently (the counters are watched over counter_interval)
    assert sorted({c.name for c in checks if c.skipped}) == ["roce_pfc"]
    skipped = next(c for c in checks if c.name == "roce_pfc")
    assert skipped.passed and skipped.message().startswith("mlx5_bond_0 (eth0): not checked: PFC unknown: DCB netlink")
    by = {(c.name, _subject(c)): c.message() for c in checks}
    pcie = [c.message() for c in checks if c.name == "pcie_link" and c.nic == "mlx5_bond_0"]
    assert pcie == [  # the NIC's own link, then each link up to the root port (here the switch's uplink)
        "mlx5_bond_0 PCIe 0000:1a:00.0: link at 32 GT/s x16",
        "mlx5_bond_0 PCIe 0000:16:00.0 (switch uplink above 0000:1a:00.0): link at 32 GT/s x16",
    ]
    assert by["mtu", "mlx5_bond_1"] == (
        "mlx5_bond_1 (bond1): MTU eth2 4200, bond1 4200, eth3 4200; RoCE active MTU 4096 (derived from bond1 MTU 4200)"
    )
    assert by["lacp", "mlx5_bond_2"] == "mlx5_bond_2 (bond2): LACP partner in sync on eth4, eth5"
    assert by["roce_trust", "mlx5_bond_3/eth7"] == "mlx5_bond_3 (eth7): trust dscp (sysfs qos/trust)"
    assert by["gpu_pcie_link", "0000:18:00.0"] == (
        "GPU 0000:18:00.0: link at 2.5 GT/s x16 (an idle GPU lowers its speed: it is checked only under load, not here)"
    )
    assert by["gpu_nic_numa", "0000:79:00.0"] == (
        "GPU 0000:79:00.0: NUMA node 1, closest NIC(s) mlx5_bond_3 at the switch level"
    )
    assert by["memlock", ""].startswith("containerd (pid 1234) runs with unlimited locked memory; containerd.service")
    # one row per GPU, one lossless triple per bond member
    assert sum(c.name == "gpu_nic_numa" for c in checks) == 8
    assert sum(c.name == "roce_trust" for c in checks) == 8


def _nic(name: str, **changes: object) -> fixtures.NodeSpec:
    return fixtures.with_nic_changes(NODE, name, **changes)


def _gpu(index: int, **changes: object) -> fixtures.NodeSpec:
    gpus = list(NODE.gpus)
    gpus[index] = replace(gpus[index], **changes)  # type: ignore[arg-type]
    return replace(NODE, gpus=tuple(gpus))


FAULTS = [
    pytest.param(
        _nic("mlx5_bond_0", pcie_width=8),
        Expectations(),
        [("pcie_link", "mlx5_bond_0")],
        "mlx5_bond_0 PCIe 0000:1a:00.0: link runs at 32 GT/s x8, expected 32 GT/s x16. Fix: reseat the card",
        id="nic-pcie-width",
    ),
    pytest.param(
        _nic("mlx5_bond_1", pcie_speed="16.0 GT/s PCIe"),
        Expectations(),
        [("pcie_link", "mlx5_bond_1")],
        "link runs at 16 GT/s x16, expected 32 GT/s x16",
        id="nic-pcie-speed",
    ),
    pytest.param(
        _nic("mlx5_bond_1", pcie_speed="Unknown", pcie_width=0),
        Expectations(),
        [("pcie_link", "mlx5_bond_1")],
        "link runs at Unknown x0, expected 32 GT/s x16",
        id="nic-pcie-down",
    ),
    pytest.param(
        _gpu(0, pcie_width=8),
        Expectations(),
        [("gpu_pcie_link", "0000:18:00.0")],
        "GPU 0000:18:00.0: link runs at 2.5 GT/s x8, expected x16. Fix:",
        id="gpu-pcie-width",
    ),
    pytest.param(
        _nic("mlx5_bond_2", mtu=1500),
        Expectations(),
        [("mtu", "mlx5_bond_2"), ("mtu_consistent", "mlx5_bond_2")],
        "mlx5_bond_2 (bond2): RoCE active MTU 1024 (derived from bond2 MTU 1500), expected RoCE active MTU 4096 "
        "(a netdev MTU of at least 4192). Fix: ip link set bond2 mtu 4200",
        id="mtu-1500",
    ),
    pytest.param(
        NODE,
        Expectations(mtu=9000),
        [("mtu", f"mlx5_bond_{i}") for i in range(4)],
        "mlx5_bond_0 (bond0): eth0 MTU 4200; bond0 MTU 4200; eth1 MTU 4200, expected MTU 9000 and RoCE active MTU 4096",
        id="mtu-inventory",
    ),
    pytest.param(
        _nic("mlx5_bond_1", members_down=("eth3",)),
        Expectations(),
        [("bond", "mlx5_bond_1"), ("lacp", "mlx5_bond_1"), ("netdev_link", "mlx5_bond_1")],
        "mlx5_bond_1: eth3 is down (no carrier) (a bond with a member down runs at part of its bandwidth)",
        id="bond-member-down",
    ),
    pytest.param(
        _nic("mlx5_bond_2", lacp_churned=("eth5",)),
        Expectations(),
        [("lacp", "mlx5_bond_2")],
        "mlx5_bond_2 (bond2): eth5 partner churn state churned; eth5 partner LACP state 0x41 is not in "
        "sync/collecting/distributing; slaves are split over aggregators 1, 2. Fix: configure the switch ports",
        id="lacp-partner-gone",
    ),
    pytest.param(
        NODE,
        Expectations(bond_mode="active-backup"),
        [("bond", f"mlx5_bond_{i}") for i in range(4)],
        "mlx5_bond_3 (bond3): mode is 802.3ad, expected active-backup. Fix:",
        id="bond-mode",
    ),
    pytest.param(
        _nic("mlx5_bond_3", trust="pcp"),
        Expectations(),
        [("roce_trust", "mlx5_bond_3/eth6"), ("roce_trust", "mlx5_bond_3/eth7")],
        "mlx5_bond_3 (eth6): trust pcp (sysfs qos/trust), expected dscp. Fix: mlnx_qos -i eth6 --trust dscp",
        id="trust-pcp",
    ),
    pytest.param(
        _nic("mlx5_bond_0", ecn=(0, 1, 2, 4, 5, 6, 7)),
        Expectations(),
        [("roce_ecn", "mlx5_bond_0/eth0"), ("roce_ecn", "mlx5_bond_0/eth1")],
        "mlx5_bond_0 (eth1): RoCE ECN on priority 3 off at the notification point and reaction point. Fix: echo 1",
        id="ecn-off",
    ),
    pytest.param(
        NODE,
        Expectations(pfc_priority=5),
        [],
        "",
        id="ecn-on-every-priority-passes-another-priority",
    ),
    pytest.param(
        replace(NODE, pcie_bridge_width={"0000:16:00.0": 8}),
        Expectations(),
        [("pcie_link", "mlx5_bond_0")],
        "mlx5_bond_0 PCIe 0000:16:00.0 (switch uplink above 0000:1a:00.0): link runs at 32 GT/s x8, expected "
        "32 GT/s x16. Fix: reseat",
        id="switch-uplink-x8",
    ),
    pytest.param(
        _nic("mlx5_bond_1", ipv4=("10.0.1.11",)),
        Expectations(nccl_gid_index=3),
        [("gid_index", "mlx5_bond_1")],
        "mlx5_bond_1: port 1: NCCL_IB_GID_INDEX=3 (pinned by the deployment) is 3 (RoCE v2 10.0.1.11): not a RoCE "
        "v2 GID with an AF_INET6 address; NCCL's own choice here would be 5 (RoCE v2 2408:4005:300:1::11). Fix: unpin",
        id="gid-index-pinned",
    ),
    pytest.param(
        NODE,
        Expectations(compute_networks=("2408:4005:300::/64",)),
        [("gid_index", f"mlx5_bond_{i}") for i in (1, 2, 3)],
        "mlx5_bond_2: port 1: NCCL (AF_INET6) picks GID 3 (RoCE v2 2408:4005:300:2::11): not on the compute network "
        "(2408:4005:300::/64). Fix: give bond2 an address of the compute network",
        id="gid-off-the-compute-network",
    ),
    pytest.param(
        replace(NODE, nics=NODE.nics[:2]),
        Expectations(),
        [("gpu_nic_numa", g.address) for g in NODE.gpus[4:]],
        "GPU 0000:58:00.0: on NUMA node 1 has no RDMA NIC on its NUMA node. Fix: put an RDMA NIC",
        id="gpu-without-numa-nic",
    ),
    pytest.param(
        NODE,
        Expectations(topology_expected={"mlx5_bond_0": ["0000:18:00.0", "0000:38:00.0"], "mlx5_9": []}),
        [("topology", "mlx5_9"), ("topology", "mlx5_bond_0")],
        "mlx5_bond_0: shares its PCIe switch with 0000:18:00.0, 0000:19:00.0, expected 0000:18:00.0, 0000:38:00.0",
        id="topology-expected",
    ),
    pytest.param(
        replace(NODE, nvidia_peermem=False, nvidia_driver="470.223.02"),
        Expectations(gpudirect_required=True),
        [("gpudirect", "")],
        "no GPUDirect RDMA path: no nvidia_peermem (or nv_peer_mem) module is loaded; NVIDIA driver 470.223.02 is "
        "older than R515; the NVIDIA kernel modules are not the open ones. Fix: modprobe nvidia-peermem",
        id="gpudirect-none",
    ),
    pytest.param(
        replace(NODE, runtime_memlock="8388608", unit_memlock=""),
        Expectations(ipc_lock=False),
        [("memlock", "")],
        "containerd (pid 1234) runs with max locked memory 8388608 bytes (containerd.service LimitMEMLOCK=unset "
        "(systemd's built-in default (8 MiB since systemd 253, 64 KiB before))): RDMA pods run without "
        "CAP_IPC_LOCK (ipc_lock false), so ibv_reg_mr fails past it (ib_umem_get)",
        id="memlock-8m-without-ipc-lock",
    ),
    pytest.param(
        replace(NODE, unit_memlock="64M"),
        Expectations(ipc_lock=False),
        [("memlock", "")],
        "containerd (pid 1234) runs unlimited now, but containerd.service LimitMEMLOCK=64M "
        "(etc/systemd/system/containerd.service.d/10-memlock.conf) limits locked memory after a restart",
        id="memlock-unit-finite",
    ),
]


@pytest.mark.parametrize(("spec", "want", "failed", "message"), FAULTS)
def test_each_fault_fails_its_check_only(
    short_tmp: Path, spec: fixtures.NodeSpec, want: Expectations, failed: list[tuple[str, str]], message: str
) -> None:
    checks = _checks(short_tmp / "n", spec, want)
    assert _failed(checks) == sorted(failed)
    messages = [c.message() for c in checks if not c.passed]
    assert all(". Fix: " in m for m in messages), messages
    if message:
        assert any(message in m for m in messages), messages


@pytest.mark.parametrize(("width", "passed"), [(8, True), (4, False)])
def test_a_gpu_in_a_narrower_slot_is_expected_to_train_to_the_slot(short_tmp: Path, width: int, passed: bool) -> None:
    # an x16 GPU behind an x8 downstream port: the expected width is the lower of the two maxima
    gpu = replace(NODE.gpus[0], pcie_width=width)
    node = fixtures.write_node(str(short_tmp / "n"), replace(NODE, gpus=(gpu,)))
    port = Path(node.sysfs, "devices", *gpu.pcie_path)
    (port / "max_link_width").write_text("8\n")
    want = Expectations()
    nics = sysfs.read_nics(node.sysfs, node.dev)
    read = healthchecks.read(nics, node.sysfs, node.procfs, node.root, want, False, sleep=_no_wait)
    assert read.gpus[0].link is not None and read.gpus[0].link.expected_width == 8
    check = next(c for c in healthchecks.check(read, want) if c.name == "gpu_pcie_link")
    assert check.passed is passed, check.message()
    if not passed:
        assert check.message().startswith("GPU 0000:18:00.0: link runs at 2.5 GT/s x4, expected x8. Fix:")


def test_not_checked_never_passes_silently_and_can_fail(short_tmp: Path) -> None:
    spec = _nic("mlx5_bond_0", trust="", ecn_sysfs=False)  # upstream mlx5: no qos/trust, no ecn/
    checks = _checks(short_tmp / "a", spec)
    skipped = {(c.name, c.netdev) for c in checks if c.skipped and c.nic == "mlx5_bond_0"}
    assert {("roce_trust", "eth0"), ("roce_ecn", "eth1")} <= skipped
    msg = next(c.message() for c in checks if c.name == "roce_ecn" and c.nic == "mlx5_bond_0")
    assert msg.startswith("mlx5_bond_0 (eth0): not checked: RoCE ECN unknown: no ecn/roce_np and ecn/roce_rp enable/3")
    strict = _checks(short_tmp / "b", spec, Expectations(fail_not_checked=True))
    failed = _failed(strict)
    assert ("roce_trust", "mlx5_bond_0/eth0") in failed and ("roce_pfc", "mlx5_bond_1/eth2") in failed
    bad = next(c for c in strict if c.name == "roce_trust" and c.nic == "mlx5_bond_0" and c.netdev == "eth0")
    assert bad.message().startswith("mlx5_bond_0 (eth0): could not be checked: trust mode unknown: no qos/trust")


def test_skip_checks_leaves_them_out(short_tmp: Path) -> None:
    want = Expectations(skip=frozenset({"memlock", "gpu_nic_numa", "roce_pfc"}))
    names = {c.name for c in _checks(short_tmp / "n", replace(NODE, runtime_memlock="1"), want)}
    assert names == HEALTHY_NAMES - {"memlock", "gpu_nic_numa", "roce_pfc"}


def test_link_flap_watches_link_downed_and_carrier_changes_over_the_interval(short_tmp: Path) -> None:
    want = Expectations(counter_interval=2.0)
    asked: list[float] = []
    state: dict[str, fixtures.FixtureNode] = {}

    def flap(seconds: float) -> None:  # stands in for the wait: the links go down meanwhile
        asked.append(seconds)
        state["node"].bump_counter("mlx5_bond_1", "link_downed")
        state["node"].flap_netdev("eth4")

    node = fixtures.write_node(str(short_tmp / "n"), NODE)
    state["node"] = node
    nics = sysfs.read_nics(node.sysfs, node.dev)
    read = healthchecks.read(nics, node.sysfs, node.procfs, node.root, want, False, sleep=flap)
    assert len(asked) == 1 and 0 < asked[0] <= 2.0  # the rest of the read counts toward the interval
    checks = healthchecks.check(read, want)
    assert _failed(checks) == [("link_flap", "mlx5_bond_1"), ("link_flap", "mlx5_bond_2")]
    msgs = {c.nic: c.message() for c in checks if c.name == "link_flap"}
    assert "port 1 link_downed 0 -> 1. Fix: the link flaps" in msgs["mlx5_bond_1"]
    assert "eth4 carrier_changes 2 -> 4" in msgs["mlx5_bond_2"]
    assert msgs["mlx5_bond_0"].startswith("mlx5_bond_0: no link down within ")
    # without movement the same interval passes
    quiet = healthchecks.read(nics, node.sysfs, node.procfs, node.root, want, False, sleep=lambda s: None)
    assert _failed(healthchecks.check(quiet, want)) == []


def test_gpudirect_through_dma_buf_and_not_required_by_default(short_tmp: Path) -> None:
    spec = replace(NODE, nvidia_peermem=False, nvidia_open=True, nvidia_driver="550.54.15", kernel_release="6.8.0-45")
    required = _checks(short_tmp / "a", spec, Expectations(gpudirect_required=True))
    msg = next(c.message() for c in required if c.name == "gpudirect")
    assert msg == "GPUDirect RDMA through DMA-BUF (kernel 6.8.0-45, NVIDIA open driver 550.54.15)"
    old_kernel = replace(spec, kernel_release="5.4.0-150-generic")
    failed = _checks(short_tmp / "b", old_kernel, Expectations(gpudirect_required=True))
    assert "kernel 5.4.0-150-generic is older than 5.12" in next(c.message() for c in failed if c.name == "gpudirect")
    assert "gpudirect" not in {c.name for c in _checks(short_tmp / "c", old_kernel)}


@pytest.mark.parametrize(
    ("changes", "status", "fragment"),
    [
        ({"runtime": ""}, "not checked", "no container runtime (containerd, dockerd, crio) runs or has a systemd unit"),
        ({"runtime_memlock": ""}, "passed", "containerd is not running; containerd.service LimitMEMLOCK=infinity"),
        (
            {"runtime": "dockerd", "runtime_memlock": "65536"},
            "warning",
            "dockerd (pid 1234) runs with max locked memory 65536 bytes (docker.service LimitMEMLOCK=infinity "
            "(etc/systemd/system/docker.service.d/10-memlock.conf)): RDMA pods run with CAP_IPC_LOCK (the chart's "
            "admission policy requires it), which ib_umem_get exempts from the limit",
        ),
    ],
)
def test_memlock_sources(short_tmp: Path, changes: dict[str, Any], status: str, fragment: str) -> None:
    check = next(c for c in _checks(short_tmp / "n", replace(NODE, **changes)) if c.name == "memlock")
    assert check.status == status and fragment in check.message(), check.message()


def test_infiniband_node(short_tmp: Path) -> None:
    checks = _checks(short_tmp / "ib", fixtures.lingjun_node(nics=2, link_layer="InfiniBand"))
    assert _failed(checks) == []
    names = {c.name for c in checks}
    assert not names & {"netdev_link", "bond", "lacp", "roce_trust", "roce_pfc", "roce_ecn", "gid_index"}
    mtu = next(c for c in checks if c.name == "mtu")
    assert mtu.skipped and "InfiniBand: the subnet manager sets the port MTU" in mtu.message()


def test_perftest_on_a_fixture_is_not_checked(short_tmp: Path) -> None:
    checks = _checks(short_tmp / "n", NODE, Expectations(perftest=True))
    perf = [c for c in checks if c.name == "perftest"]
    assert len(perf) == 4 and all(c.skipped for c in perf)
    assert "perftest runs on the node's own devices" in perf[0].message()
    assert "perftest" not in {c.name for c in _checks(short_tmp / "m", NODE)}  # off by default


def test_summary_and_details(short_tmp: Path) -> None:
    want = Expectations()
    _, read = _read(short_tmp / "n", _nic("mlx5_bond_0", pcie_width=4), want)
    checks = healthchecks.check(read, want)
    summary = healthchecks.summary(read, checks)
    assert summary["health"] == "failed" and summary["pcie_degraded"] == ["mlx5_bond_0"]
    assert summary["gpus"] == 8 and summary["gpudirect"] == "peermem" and summary["memlock"] == "unlimited"
    # NCCL_IB_ADDR_FAMILY as the plugin gives hostNetwork pods: AF_INET6 here (no NIC has an IPv4 RoCE v2 GID)
    assert summary["gid_index"] == {f"mlx5_bond_{i}": 3 for i in range(4)} and summary["gid_family"] == "AF_INET6"
    assert summary["topology"]["mlx5_bond_2"] == {  # type: ignore[index]
        "switch": ["0000:58:00.0", "0000:59:00.0"],
        "root_port": ["0000:58:00.0", "0000:59:00.0"],
        "numa": ["0000:58:00.0", "0000:59:00.0", "0000:78:00.0", "0000:79:00.0"],
    }
    details = healthchecks.details(read)
    nic = details["nics"]["mlx5_bond_0"]  # type: ignore[index]
    assert nic["pci"][0]["link"]["width"] == 4 and nic["bond"]["mode"] == "802.3ad"
    assert nic["qos"]["eth1"]["trust"] == "dscp" and nic["counters"]["1"]["link_downed"] == 0


def test_roce_active_mtu_follows_the_kernel() -> None:
    # include/rdma/ib_addr.h iboe_get_mtu: 96 bytes of RoCE headers, then the largest IB MTU that fits
    got = {m: healthchecks.roce_active_mtu(m) for m in (200, 1500, 2144, 4191, 4192, 4200, 9000)}
    assert got == {200: 0, 1500: 1024, 2144: 2048, 4191: 2048, 4192: 4096, 4200: 4096, 9000: 4096}


@pytest.mark.parametrize(
    ("options", "error"),
    [
        ({"roce_mtu": 3000}, "roce_mtu must be one of [256, 512, 1024, 2048, 4096], not 3000"),
        ({"bond_mode": "lacp"}, "bond_mode must be one of ['balance-rr'"),
        ({"pfc_priority": 8}, "pfc_priority must be a priority from 0 to 7, not 8"),
        ({"counter_max": {"symbol_error": -1}}, "counter_max.symbol_error must be a count of 0 or more, not -1"),
        ({"counter_interval": 600}, "counter_interval must be seconds from 0 (off) to 60, not 600"),
        ({"skip": frozenset({"pcie"})}, "skip_checks must be check names out of"),
        ({"perftest_seconds": 0}, "perftest_seconds must be from 1 to 60, not 0"),
        ({"mtu": 10}, "mtu must be a netdev MTU between 68 and 65535 or null, not 10"),
        ({"nccl_gid_index": -1}, "nccl_gid_index must be a GID index from 0 to 255 or null (not pinned), not -1"),
        ({"nccl_addr_family": "inet"}, "nccl_addr_family must be one of ['AF_INET', 'AF_INET6', 'auto']"),
    ],
)
def test_bad_expectations_name_the_option(options: dict[str, Any], error: str) -> None:
    with pytest.raises(ValueError, match=None) as caught:
        Expectations(**options)
    assert error in str(caught.value)


def test_every_fault_survives_the_spec_file(short_tmp: Path) -> None:
    """molecule edits node-spec.json and rewrites the node with --spec: the new fields round-trip."""
    spec = replace(
        fixtures.with_nic_changes(NODE, "mlx5_bond_1", members_down=("eth3",), counters={"symbol_error": 5},
                                  ecn=(3,), pcie_path=("pci0000:80", "0000:80:01.0"), ipv4=("10.0.1.11",),
                                  ipv6_first=True, vfs=2, vf_rdma=("mlx5_9",), vf_in_pod=("mlx5_9",)),
        gpus=(replace(NODE.gpus[0], pcie_width=8),),
        runtime_memlock="65536",
        pcie_bridge_width={"0000:16:00.0": 8},
    )  # fmt: skip
    node = fixtures.write_node(str(short_tmp / "n"), spec)
    written = json.loads(Path(node.root, "node-spec.json").read_text())
    assert fixtures.NodeSpec.from_dict(written) == spec
    with pytest.raises(ValueError, match=r"gpus\[0\]: unknown key\(s\) \['pcie_lanes'\]"):
        fixtures.NodeSpec.from_dict({"nics": [], "gpus": [{"address": "0000:18:00.0", "pcie_lanes": 8}]})


# --- issue 32: counters by change, GIDs and memlock as NCCL and the kernel use them, the PCIe path ----------


def _row(checks: list[Check], name: str, nic: str) -> Check:
    return next(c for c in checks if c.name == name and c.nic == nic and not c.skipped)


def test_old_errors_are_lifetime_totals_not_failures(short_tmp: Path) -> None:
    """The 4-bit counters live in the HCA and saturate at 15: one error months ago failed the node
    until someone reset them. A total is reported; a saturated counter is said to be blind."""
    spec = _nic("mlx5_bond_2", counters={"excessive_buffer_overrun_errors": 7, "local_link_integrity_errors": 15})
    checks = _checks(short_tmp / "n", spec)
    assert _failed(checks) == []
    message = _row(checks, "port_counters", "mlx5_bond_2").message()
    assert message.startswith("mlx5_bond_2: no error counter grew within ")  # the read's own time, a fraction of a s
    assert message.endswith(
        " s; lifetime totals (not judged): port 1 excessive_buffer_overrun_errors 7, port 1 "
        "local_link_integrity_errors 15"
    )
    blind = next(c for c in checks if c.name == "port_counters" and c.nic == "mlx5_bond_2" and c.skipped)
    assert blind.message().startswith(
        "mlx5_bond_2: not checked: port 1 local_link_integrity_errors 15: at the counter's maximum (it saturates), "
        "so new errors cannot show; reset the port counters"
    )


def test_errors_climbing_while_the_node_is_read_fail_by_default(short_tmp: Path) -> None:
    """symbol_error climbing during the read used to pass: counter_interval defaulted to 0."""
    want = Expectations()  # the defaults: counter_interval 3 s, symbol_error watched
    assert want.counter_interval == 3.0
    node = fixtures.write_node(str(short_tmp / "n"), NODE)
    waits: list[float] = []

    def errors_meanwhile(seconds: float) -> None:
        waits.append(seconds)
        node.bump_counter("mlx5_bond_3", "symbol_error", by=12)

    nics = sysfs.read_nics(node.sysfs, node.dev)
    read = healthchecks.read(nics, node.sysfs, node.procfs, node.root, want, False, sleep=errors_meanwhile)
    assert len(waits) == 1 and 0 < waits[0] <= 3.0  # what the rest of the read took counts toward it
    checks = healthchecks.check(read, want)
    assert _failed(checks) == [("port_counters", "mlx5_bond_3")]
    message = _row(checks, "port_counters", "mlx5_bond_3").message()
    assert message.startswith("mlx5_bond_3: error counters grew: port 1 symbol_error 0 -> 12 within ")
    assert "Fix: the link takes errors: check the cable, transceiver and switch port" in message


def test_the_first_counter_read_can_be_taken_before_the_rest(short_tmp: Path) -> None:
    """The module takes the first read at its start: the interval then covers its whole run."""
    want = Expectations(counter_interval=5.0)
    node = fixtures.write_node(str(short_tmp / "n"), NODE)
    nics = sysfs.read_nics(node.sysfs, node.dev)
    now = [100.0]
    watch = healthchecks.watch_counters(nics, node.sysfs, want, clock=lambda: now[0])
    node.bump_counter("mlx5_bond_0", "port_rcv_errors", by=2)  # between the first read and the health read
    now[0] = 104.0  # four seconds went by meanwhile
    waits: list[float] = []
    read = healthchecks.read(
        nics, node.sysfs, node.procfs, node.root, want, False, sleep=waits.append, clock=lambda: now[0], watch=watch
    )
    assert waits == [1.0]  # only what is left of the interval
    assert _failed(healthchecks.check(read, want)) == [("port_counters", "mlx5_bond_0")]


def test_a_sample_the_node_kept_stands_for_the_first_counter_read(short_tmp: Path) -> None:
    """Issue 40: a read within counter_window of the node's kept samples compares with them and does not
    wait the interval (a worker held 3 s a node cost the controller ~25 ms a host); errors climbing since
    the sample still fail, link flaps too (carrier_changes kept)."""
    want = Expectations()  # counter_interval 3 s
    node = fixtures.write_node(str(short_tmp / "n"), NODE)
    nics = sysfs.read_nics(node.sysfs, node.dev)
    first = healthchecks.read(nics, node.sysfs, node.procfs, node.root, want, False, sleep=_no_wait)
    kept = healthchecks.kept_samples(first, want)
    taken = [s["taken"] for s in kept["samples"]]
    node.bump_counter("mlx5_bond_3", "symbol_error", by=12)  # between the two runs
    Path(node.sysfs, "class", "net", "eth2", "carrier_changes").write_text("9\n")
    waits: list[float] = []
    watch = healthchecks.watch_from_samples(kept, nics, want, 600, now=taken[-1] + 10)
    assert watch is not None and watch.kept and watch.taken == taken[-1]  # the newest one >= 3 s old
    second = healthchecks.read(nics, node.sysfs, node.procfs, node.root, want, False, sleep=waits.append, watch=watch)
    assert waits == []  # nothing left of the interval to wait for
    checks = healthchecks.check(second, want)
    assert _failed(checks) == [("link_flap", "mlx5_bond_1"), ("port_counters", "mlx5_bond_3")]
    assert (
        _row(checks, "port_counters", "mlx5_bond_3")
        .message()
        .startswith("mlx5_bond_3: error counters grew: port 1 symbol_error 0 -> 12 within ")
    )
    assert "eth2 carrier_changes" in _row(checks, "link_flap", "mlx5_bond_1").message()
    # a younger sample: only the rest of the interval is waited; none in the window, another NIC: read twice
    young = healthchecks.watch_from_samples(kept, nics, want, 600, clock=lambda: 50.0, now=taken[0] + 1)
    assert young is not None and young.start == 49.0
    assert healthchecks.watch_from_samples(kept, nics, want, 600, now=taken[0] + 601) is None
    other = json.loads(json.dumps(kept).replace(nics[0].node_guid, "0000:0000:0000:0001"))
    assert healthchecks.watch_from_samples(other, nics, want, 600, now=taken[-1] + 10) is None
    assert healthchecks.watch_from_samples(kept, nics, Expectations(counter_watch=("port_xmit_discards",)), 600) is None


def _with_baseline(
    node: fixtures.FixtureNode, want: Expectations, baseline: dict[str, Any] | None
) -> healthchecks.NodeRead:
    nics = sysfs.read_nics(node.sysfs, node.dev)
    return healthchecks.read(nics, node.sysfs, node.procfs, node.root, want, False, sleep=_no_wait, baseline=baseline)


def test_growth_since_the_previous_run_fails_until_the_counters_are_reset(short_tmp: Path) -> None:
    want = Expectations()
    node = fixtures.write_node(str(short_tmp / "n"), _nic("mlx5_bond_1", counters={"local_link_integrity_errors": 2}))
    first = _with_baseline(node, want, None)
    assert _failed(healthchecks.check(first, want)) == []
    stored = healthchecks.next_baseline(first, want)
    assert stored["nics"]["mlx5_bond_1"]["ports"]["1"]["local_link_integrity_errors"] == 2
    node.bump_counter("mlx5_bond_1", "local_link_integrity_errors", by=3)  # between two runs
    second = _with_baseline(node, want, stored)
    checks = healthchecks.check(second, want)
    assert _failed(checks) == [("port_counters", "mlx5_bond_1")]
    assert "port 1 local_link_integrity_errors 2 -> 5 since the previous run (" in (
        _row(checks, "port_counters", "mlx5_bond_1").message()
    )
    # the failing NIC keeps the values it is judged against; the others move on
    kept = healthchecks.next_baseline(second, want)
    assert kept["nics"]["mlx5_bond_1"] == stored["nics"]["mlx5_bond_1"]
    assert kept["nics"]["mlx5_bond_0"]["taken"] >= stored["nics"]["mlx5_bond_0"]["taken"]
    assert _failed(healthchecks.check(_with_baseline(node, want, kept), want)) == [("port_counters", "mlx5_bond_1")]
    # a counter reset (perfquery -R) after the repair: nothing grew since, the NIC passes and moves on
    Path(
        node.sysfs, "class", "infiniband", "mlx5_bond_1", "ports", "1", "counters", "local_link_integrity_errors"
    ).write_text("0\n")
    reset = _with_baseline(node, want, kept)
    assert _failed(healthchecks.check(reset, want)) == []
    assert (
        healthchecks.next_baseline(reset, want)["nics"]["mlx5_bond_1"]["ports"]["1"]["local_link_integrity_errors"] == 0
    )
    # another NIC under the same name (node GUID) is not compared with the old one's values
    other = {"nics": {"mlx5_bond_1": {**kept["nics"]["mlx5_bond_1"], "node_guid": "0000:0000:0000:0001"}}}
    replaced = healthchecks.check(_with_baseline(node, want, other), want)
    assert _failed(replaced) == []


def test_counter_max_allows_growth_up_to_its_limit(short_tmp: Path) -> None:
    want = Expectations(counter_max={"symbol_error": 100, "out_of_buffer": 2}, counter_watch=())
    node = fixtures.write_node(str(short_tmp / "n"), NODE)
    stored = healthchecks.next_baseline(_with_baseline(node, want, None), want)
    node.bump_counter("mlx5_bond_0", "symbol_error", by=100)
    node.bump_counter("mlx5_bond_0", "out_of_buffer", by=3)  # a driver counter (hw_counters/)
    checks = healthchecks.check(_with_baseline(node, want, stored), want)
    assert _failed(checks) == [("port_counters", "mlx5_bond_0")]
    message = _row(checks, "port_counters", "mlx5_bond_0").message()
    assert "port 1 out_of_buffer 0 -> 3 since the previous run" in message and "symbol_error 0 -> 100" not in message


def test_gid_index_differs_across_nics_only_matters_when_pinned(short_tmp: Path) -> None:
    """One extra IPv6 address on one NIC moves its IPv4 RoCE v2 GID from 3 to 5: NCCL picks the GID per
    device (ncclIbGetGidIndex), so that fails nothing unless NCCL_IB_GID_INDEX is pinned."""
    spec = fixtures.ipv4_roce_node(extra_ipv6=True)
    checks = _checks(short_tmp / "a", spec)
    assert _failed(checks) == []
    gid = {c.nic: c.message() for c in checks if c.name == "gid_index"}
    assert gid["mlx5_bond_1"] == "mlx5_bond_1: port 1: NCCL (AF_INET) picks GID 5 (RoCE v2 10.0.1.11)"
    assert gid["mlx5_bond_0"] == "mlx5_bond_0: port 1: NCCL (AF_INET) picks GID 3 (RoCE v2 10.0.0.11)"
    pinned = _checks(short_tmp / "b", spec, Expectations(nccl_gid_index=3))
    assert _failed(pinned) == [("gid_index", "mlx5_bond_1")]
    message = _row(pinned, "gid_index", "mlx5_bond_1").message()
    assert message.startswith(
        "mlx5_bond_1: port 1: NCCL_IB_GID_INDEX=3 (pinned by the deployment) is 3 (RoCE v2 2001:db8:1::11): not a "
        "RoCE v2 GID with an AF_INET address; NCCL's own choice here would be 5 (RoCE v2 10.0.1.11). Fix: unpin"
    )


def test_no_usable_gid_fails_naming_the_nic(short_tmp: Path) -> None:
    # no address at all on one NIC: NCCL would fall back to the link-local RoCE v1 GID 0
    checks = _checks(short_tmp / "n", _nic("mlx5_bond_2", ipv6=()))
    assert _failed(checks) == [("gid_index", "mlx5_bond_2")]
    message = _row(checks, "gid_index", "mlx5_bond_2").message()
    assert message.startswith(
        "mlx5_bond_2: port 1: NCCL (AF_INET6) picks GID 0 (IB/RoCE v1 fe80::bace:f6ff:fe5a:1): not a RoCE v2 GID "
        "with an AF_INET6 address. Fix: give bond2 an address of the compute network"
    )


def test_a_limited_memlock_warns_when_rdma_pods_get_ipc_lock(short_tmp: Path) -> None:
    """ib_umem_get checks RLIMIT_MEMLOCK only for callers without CAP_IPC_LOCK, which the chart's
    admission policy requires of RDMA pods: the node works, so a warning, not a failure."""
    spec = replace(NODE, runtime_memlock="8388608", unit_memlock="")
    checks = _checks(short_tmp / "n", spec)
    assert _failed(checks) == []
    memlock = next(c for c in checks if c.name == "memlock")
    assert memlock.status == "warning" and memlock.passed and memlock.to_dict()["warning"] is True
    assert memlock.message().endswith(
        "which ib_umem_get exempts from the limit, so they pin regardless; a container without it could pin no "
        "more. Fix: set LimitMEMLOCK=infinity in /etc/systemd/system/containerd.service.d/memlock.conf ([Service]), "
        "then systemctl daemon-reload and systemctl restart containerd.service"
    )


def test_a_gpu_only_switch_uplink_is_checked_for_width(short_tmp: Path) -> None:
    # NICs 2 and 3 gone: their switches hold GPUs only, whose uplinks no NIC path covers
    spec = replace(NODE, nics=NODE.nics[:2], pcie_bridge_width={"0000:56:00.0": 8})
    checks = _checks(short_tmp / "n", spec, Expectations(skip=frozenset({"gpu_nic_numa"})))
    assert _failed(checks) == [("gpu_pcie_link", "0000:58:00.0")]
    row = next(c for c in checks if not c.passed)
    assert row.message().startswith(
        "GPU 0000:58:00.0 PCIe 0000:56:00.0 (switch uplink above 0000:58:00.0): link runs at 32 GT/s x8, expected "
        "x16. Fix:"
    )
