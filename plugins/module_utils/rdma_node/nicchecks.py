"""The RDMA NIC checks of one node (standard library only).

The one implementation of the checks of the Ansible role ``rdma_nic_validate`` (formerly a
Jinja template evaluated per host on the controller). The ``rdma_node_info`` module runs
them on the node beside :mod:`.ipv6checks` and returns finished results. Pure logic over
data read through :mod:`.sysfs`; every result is an :class:`.ipv6checks.Check` (same
shape and message form: ``<nic>: <detail>``, plus ``. Fix: <fix>`` when failed). Messages
do not name the node: the report and the failure name it once.

==========================  =====  ===========================================================
name                        scope  passes when
==========================  =====  ===========================================================
``kernel_modules``          node   every wanted kernel module is loaded
``driver_version``          node   the driver version is at least ``min_driver_version``
``rdma_devices``            node   the selectors find ``expected_nics`` compute NICs (else >= 1); the
                                   storage/management NICs and the VFs are listed (:mod:`.compute`)
``port_state``              NIC    every port is ACTIVE/LinkUp
``link_layer``              NIC    every port has ``link_layer``
``rate``                    NIC    every port runs at ``rate_gbps``; unset, at the best rate of the
                                   node's ports of the same model (a port trained below its
                                   neighbours, e.g. ``200 Gb/sec (2X NDR)`` among 4X NDR ports). sysfs
                                   shows only the active rate (the supported widths need a MAD, root),
                                   so a node whose ports all run low is caught by the fleet report's
                                   ``drift_port_rate``
``firmware_min``            NIC    the firmware is at least ``min_fw_version``
``uverbs``                  NIC    the NIC's uverbs char device exists under /dev/infiniband
``firmware_consistent``     node   every selected NIC runs the same firmware (the odd ones named)
``rdma_cm``                 node   /dev/infiniband/rdma_cm exists
``verbs_open``              NIC    libibverbs lists and opens the NIC (from :mod:`.verbs`, added
                                   by ``rdma_node_info`` only when pyverbs imports on the real
                                   /sys and /dev)
==========================  =====  ===========================================================
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from . import sysfs
from .checks import Check, same_across_nics

LINK_LAYERS = ("Ethernet", "InfiniBand")


@dataclass(frozen=True)
class Expectations:
    """What the node must show; None = not checked (the role's variables, without prefix)."""

    modules: tuple[str, ...] = ("mlx5_core", "mlx5_ib", "ib_core", "ib_uverbs", "rdma_ucm")
    version_module: str = "mlx5_core"
    min_driver_version: str | None = None
    expected_nics: int | None = None
    link_layer: str | None = None
    rate_gbps: float | None = None
    min_fw_version: str | None = None
    fw_consistent: bool = True

    def __post_init__(self) -> None:
        if self.link_layer is not None and self.link_layer not in LINK_LAYERS:
            raise ValueError(f"link_layer must be one of {LINK_LAYERS} or null, not {self.link_layer!r}")
        if self.expected_nics is not None and self.expected_nics <= 0:
            raise ValueError(f"expected_nics must be positive or null, not {self.expected_nics}")
        if self.rate_gbps is not None and self.rate_gbps <= 0:
            raise ValueError(f"rate_gbps must be positive or null, not {self.rate_gbps}")


@dataclass(frozen=True)
class NodeRead:
    """What one read of the node found (the inputs of :func:`check`)."""

    nics: Sequence[sysfs.Nic]  # the selected compute NICs
    ignored: Sequence[str]  # RDMA devices the selectors leave out
    modules: Mapping[str, bool]  # module -> loaded
    driver_version: str | None
    rdma_cm: sysfs.CharDevice
    storage: Mapping[str, str] = field(default_factory=dict)  # selected PFs that are not compute -> why
    vf_devices: Sequence[str] = ()  # selected RDMA devices on VFs (not validated)
    vfs: int = 0  # VFs enabled on the compute NICs
    missing: Sequence[str] = ()  # compute NICs named by compute_nics that the node does not have


def version_tuple(value: str) -> tuple[int, ...]:
    """``24.10-1.1.4`` -> (24, 10, 1, 1, 4): every run of non-digits separates numbers."""
    return tuple(int(p) for p in re.split(r"[^0-9]+", value) if p)


def _at_least(have: str | None, want: str) -> bool:
    return bool(have) and version_tuple(have or "") >= version_tuple(want)


def check(
    node: NodeRead, want: Expectations, sysfs_root: str = "/sys", selection: str = "rdma_selectors"
) -> list[Check]:
    """Every RDMA NIC check of one node: node-wide ones, then per NIC, then firmware and rdma_cm."""
    out: list[Check] = []

    def add(name: str, nic: str, passed: bool, detail: str, fix: str = "") -> None:
        out.append(Check(name, nic, "", passed, detail, "" if passed else fix))

    missing = [m for m in want.modules if not node.modules.get(m)]
    add(
        "kernel_modules",
        "",
        not missing,
        f"kernel module(s) {', '.join(missing)} not loaded"
        if missing
        else f"kernel modules loaded: {', '.join(want.modules)}",
        f"modprobe {' '.join(missing)} (install MLNX_OFED/DOCA-OFED or rdma-core if a module is unknown) "
        "and list them in /etc/modules-load.d/.",
    )

    if want.min_driver_version is not None:
        have = node.driver_version
        ok = _at_least(have, want.min_driver_version)
        shown = (
            have
            if have is not None
            else (f"unknown (no {sysfs_root}/module/{want.version_module}/version: inbox driver?)")
        )
        add(
            "driver_version",
            "",
            ok,
            f"driver version {have} >= {want.min_driver_version}"
            if ok
            else f"{want.version_module} driver version is {shown}, required >= {want.min_driver_version}",
            f"install MLNX_OFED/DOCA-OFED {want.min_driver_version} or newer, then reload the driver or reboot.",
        )

    names = [n.name for n in node.nics]
    count_ok = len(names) == want.expected_nics if want.expected_nics is not None else bool(names)
    count_ok = count_ok and not node.missing
    found = f"{len(names)} compute RDMA device(s) match {selection} ({', '.join(names) or 'none'})"
    if node.storage:
        found += ", storage/management (not held to the RoCE settings): " + ", ".join(
            f"{n} ({why})" for n, why in node.storage.items()
        )
    if node.vfs or node.vf_devices:
        found += f", {node.vfs} VF(s) on them" + (
            f" (RDMA devices on VFs, not validated: {', '.join(node.vf_devices)})" if node.vf_devices else ""
        )
    if node.ignored:
        found += f", ignored: {', '.join(node.ignored)}"
    if node.missing:
        found += f", compute_nics names {', '.join(node.missing)}, which the node does not have"
    if not count_ok and not node.missing:
        found += f", expected {want.expected_nics if want.expected_nics is not None else 'at least 1'}"
    add(
        "rdma_devices",
        "",
        count_ok,
        found,
        "check that every NIC is bound to its driver (lspci -k), that RoCE LAG bonds are formed, "
        "and that rdma_selectors, rdma_nic_validate_compute_* and rdma_nic_validate_expected_nics are right.",
    )

    best = _best_rates(node.nics)
    for nic in node.nics:
        _nic_checks(nic, want, add, best)

    if want.fw_consistent and len(node.nics) > 1:
        out.append(
            same_across_nics(
                "firmware_consistent",
                {n.name: n.fw_ver for n in node.nics},
                lambda odd, common: (
                    "firmware differs across NICs: "
                    + ", ".join(f"{n}={v or 'unknown'}" for n, v in odd.items())
                    + f" while the others run {common}"
                ),
                lambda common: f"every NIC runs firmware {common}",
                "flash the same firmware on every NIC (mlxfwmanager --online -u) and reboot.",
            )
        )

    cm = node.rdma_cm
    add(
        "rdma_cm",
        "",
        cm.present,
        f"{cm.node_path} present" if cm.present else f"{cm.node_path} is missing",
        "modprobe rdma_ucm and check the udev rules that create /dev/infiniband.",
    )
    return out


def _model(nic: sysfs.Nic, port: sysfs.Port) -> tuple[str, str, str]:
    return (nic.vendor, nic.device_id, port.link_layer)


def _best_rates(nics: Sequence[sysfs.Nic]) -> dict[tuple[str, str, str], tuple[float, str, str]]:
    """Per model (vendor, device, link layer): the best active port rate of the node, its text and NIC."""
    best: dict[tuple[str, str, str], tuple[float, str, str]] = {}
    for nic in nics:
        for port in nic.ports:
            rate = port.rate_gbps
            if port.active and rate is not None and rate > best.get(_model(nic, port), (0.0, "", ""))[0]:
                best[_model(nic, port)] = (rate, port.rate, nic.name)
    return best


def _nic_checks(
    nic: sysfs.Nic, want: Expectations, add: _Add, best: Mapping[tuple[str, str, str], tuple[float, str, str]]
) -> None:
    ifs = ", ".join(nic.netdevs) or "none"
    bad = [p for p in nic.ports if not p.active] + [p for p in nic.ports if p.active and p.phys_state != "LinkUp"]
    desc = ", ".join(f"port {p.number} is {p.state}/{p.phys_state}" for p in bad)
    ok = bool(nic.ports) and not bad
    add(
        "port_state",
        nic.name,
        ok,
        "all ports ACTIVE/LinkUp" if ok else f"{desc if nic.ports else 'has no ports'}, expected ACTIVE/LinkUp",
        "check the cable, transceiver and switch port, and bring the netdev(s) up "
        f"(ip link set <dev> up; netdevs: {ifs}).",
    )

    if want.link_layer is not None:
        ok = list(nic.link_layers) == [want.link_layer]
        add(
            "link_layer",
            nic.name,
            ok,
            f"link layer {want.link_layer}"
            if ok
            else f"link layer is {'/'.join(nic.link_layers) or 'unknown'}, expected {want.link_layer}",
            f"set the port type with mlxconfig (LINK_TYPE_P1={'ETH' if want.link_layer == 'Ethernet' else 'IB'}) "
            "and reboot, or correct rdma_nic_validate_link_layer.",
        )

    rates = ", ".join(dict.fromkeys(p.rate for p in nic.ports)) or "unknown"
    netdev = nic.compute_netdevs[0] if nic.compute_netdevs else "<netdev>"
    fix = (
        f"check the cable/transceiver (its type and speed), the switch port's speed and width, and the port's "
        f"configured speed (ethtool {netdev}; InfiniBand: ibportstate), then reseat or replace what trains low"
    )
    if want.rate_gbps is not None:
        ok = bool(nic.ports) and all(p.rate_gbps == want.rate_gbps for p in nic.ports)
        add(
            "rate",
            nic.name,
            ok,
            f"rate {rates}" if ok else f"port rate is {rates}, expected {_num(want.rate_gbps)} Gb/sec",
            fix + ", or correct rdma_nic_validate_rate_gbps.",
        )
    elif any(p.active for p in nic.ports):
        low = [
            (p, best[_model(nic, p)])
            for p in nic.ports
            if p.active and (p.rate_gbps or 0.0) < best.get(_model(nic, p), (0.0, "", ""))[0]
        ]
        detail = "; ".join(
            f"port {p.number} runs at {p.rate or 'an unknown rate'}, below the {text} of {other} (same model "
            f"{nic.vendor}:{nic.device_id})"
            for p, (_, text, other) in low
        )
        add(
            "rate",
            nic.name,
            not low,
            detail or f"rate {rates}, the node's best for its model (the fleet report compares it across nodes)",
            fix + " (or set rdma_nic_validate_rate_gbps to the rate every port must have).",
        )

    if want.min_fw_version is not None:
        ok = _at_least(nic.fw_ver, want.min_fw_version)
        add(
            "firmware_min",
            nic.name,
            ok,
            f"firmware {nic.fw_ver} >= {want.min_fw_version}"
            if ok
            else f"firmware {nic.fw_ver or 'unknown'} is older than the required {want.min_fw_version}",
            "update the NIC firmware (mlxfwmanager --online -u, or mstflint) and reboot.",
        )

    uv = nic.uverbs
    ok = uv is not None and uv.present
    if uv is None:
        detail = "no uverbs char device names it in its ibdev file"
    else:
        detail = f"{uv.node_path} present" if ok else f"{uv.node_path} is missing (sysfs has {uv.name})"
    add("uverbs", nic.name, ok, detail, "modprobe ib_uverbs and check the udev rules that create /dev/infiniband.")


def _num(value: float) -> str:
    """200.0 -> "200" (the inventory's number, as the operator wrote it)."""
    return str(int(value)) if value == int(value) else str(value)


class _Add(Protocol):  # the signature of check()'s local ``add``
    def __call__(self, name: str, nic: str, passed: bool, detail: str, fix: str = "") -> None: ...


def root_checks(sysfs_root: str, procfs_root: str, dev_root: str) -> list[Check]:
    """``node_roots``: each root exists and looks like what it should be (one check per root).

    A wrong root would otherwise read as node faults ("module not loaded", "0 RDMA devices").
    """
    wants = (
        ("sysfs", sysfs_root, "module", "rdma_sysfs_root"),
        ("procfs", procfs_root, "net", "rdma_procfs_root"),
        ("dev", dev_root, "", "rdma_dev_root"),
    )
    out = []
    for kind, root, marker, var in wants:
        if not os.path.isdir(root):
            detail = f"the {kind} root {root} does not exist"
        elif marker and not os.path.isdir(os.path.join(root, marker)):
            detail = f"the {kind} root {root} is not a {kind} tree (no {marker}/ under it)"
        else:
            out.append(Check("node_roots", "", "", True, f"{kind} root {root}"))
            continue
        out.append(Check("node_roots", "", "", False, detail, f"set {var} to where the node's {kind} is mounted."))
    return out


def selection_text(selectors: Mapping[str, object]) -> str:
    """How the NICs were selected, as the NIC and IPv6 messages say it."""
    return "rdma_selectors " + json.dumps(dict(selectors), sort_keys=True)
