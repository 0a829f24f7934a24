#!/usr/bin/python
"""Ansible module: read a node's RDMA NICs and IPv6 compute network (read-only)."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: rdma_node_info
short_description: Read a node's RDMA NICs, kernel modules and IPv6 compute network
description:
  - Reads sysfs, procfs and /dev through the project's one reader
    (C(rdma_device_plugin.node), shipped to the node as the C(rdma_node) module_utils
    package), applies the device plugin's NIC selectors and returns plain data.
  - Never changes the node. Supports check mode and always reports C(changed=false).
  - The roots are parameters so tests can point them at kernel-shaped fixture trees.
version_added: "0.1.0"
author: rdma-device-plugin maintainers
options:
  sysfs_root:
    description: Where sysfs is mounted.
    type: path
    default: /sys
  procfs_root:
    description: Where procfs is mounted.
    type: path
    default: /proc
  dev_root:
    description: Where /dev is.
    type: path
    default: /dev
  selectors:
    description:
      - The plugin config's selectors (keys C(vendors), C(deviceIDs), C(drivers),
        C(ifNames), C(rdmaDevices), C(linkTypes)). Every non-empty key must match.
      - RDMA devices not selected are listed under C(ignored) and not read further.
    type: dict
    default: {vendors: ['15b3']}
    suboptions:
      vendors: {description: PCI vendor IDs., type: list, elements: str}
      deviceIDs: {description: PCI device IDs., type: list, elements: str}
      drivers: {description: Kernel drivers., type: list, elements: str}
      ifNames: {description: Netdev names., type: list, elements: str}
      rdmaDevices: {description: RDMA device names., type: list, elements: str}
      linkTypes: {description: Link layers (Ethernet, InfiniBand)., type: list, elements: str}
  modules:
    description: Kernel modules whose presence under C(<sysfs_root>/module) is reported.
    type: list
    elements: str
    default: [mlx5_core, mlx5_ib, ib_core, ib_uverbs, rdma_ucm]
  version_module:
    description: Module whose C(version) file is the driver (OFED) version.
    type: str
    default: mlx5_core
  ipv6_netns_mode:
    description: RDMA subsystem netns mode the C(netns_mode) check of C(ipv6_checks) wants.
    type: str
    choices: [shared, exclusive]
    default: shared
  ipv6_roce_v2_gid:
    description: Whether C(ipv6_checks) requires a RoCE v2 GID carrying each global IPv6 address (Ethernet NICs).
    type: bool
    default: true
  min_driver_version:
    description: Minimum driver version for the C(driver_version) NIC check; null = not checked.
    type: str
  expected_nics:
    description: Number of RDMA devices the selectors must find; null = at least one.
    type: int
  link_layer:
    description: Link layer every port must have; null = not checked.
    type: str
    choices: [Ethernet, InfiniBand]
  rate_gbps:
    description: Rate every port must run at, in Gb/sec; null = not checked.
    type: float
  min_fw_version:
    description: Minimum firmware version of every NIC; null = not checked.
    type: str
  fw_consistent:
    description: Every selected NIC must run the same firmware version.
    type: bool
    default: true
  record_host:
    description:
      - Inventory host name; when set, the finished checks are also returned as the host's
        C(rdma_validation) fact (C(ansible_facts)), the shape the validation roles record, so
        that C(playbooks/validate.yml) needs no further task per node.
    type: str
  ipv6_record:
    description: With I(record_host), record the IPv6 checks (false records the IPv6 compute network as not checked).
    type: bool
    default: false
  details:
    description: Return the full NIC data (C(nics) as dicts, C(ipv6) per netdev); false returns NIC names only.
    type: bool
    default: false
"""

EXAMPLES = r"""
- name: Read the RDMA NICs of a node
  rdma_node_info:
    selectors: {vendors: ['15b3'], linkTypes: [Ethernet]}
  register: rdma

- name: Read a fixture node
  rdma_node_info:
    sysfs_root: /tmp/node0/sys
    procfs_root: /tmp/node0/proc
    dev_root: /tmp/node0/dev
"""

RETURN = r"""
node:
  description: What the node shows.
  returned: always
  type: dict
  contains:
    options:
      description: The check options this read used (so a caller can reuse the read).
      type: dict
    checks:
      description: >-
        Finished check results by role, C(rdma_nic_validate) (from
        C(rdma_device_plugin.node.nicchecks)) and C(ipv6_compute_validate) (from
        C(rdma_device_plugin.node.ipv6checks)); each C({name, nic, passed, message}), the message
        without the node's name. A missing sysfs, procfs or dev root is one failed C(node_roots)
        check and nothing else is read.
      type: dict
    summary:
      description: Per role, the summary row of the fleet report (NIC count, link layers, firmware, IPv6, ...).
      type: dict
    verbs:
      description: >-
        Whether pyverbs was used, said once: C(pyverbs lists <devices>) (every selected NIC opened
        and its port states and GID table queried; a NIC that sysfs lists but libibverbs does not
        list or cannot open is a failed C(verbs_open) check naming the NIC and the fix),
        C(pyverbs could not list devices (<error>): sysfs only), C(pyverbs not importable: sysfs only)
        or C(pyverbs not used: ...) for fixture roots (libibverbs reads only the real /sys and /dev).
      type: str
    nics:
      description: >-
        Names of the selected RDMA devices; with C(details), the reader's C(Nic.to_dict()), plus C(compute_netdevs)
        (netdevs that own the NIC's GIDs, i.e. carry its IP; the bond for a RoCE LAG),
        C(all_ports_active), per port C(active) and C(rate_gbps), and C(verbs) (C(port_states), C(gids)) when
        libibverbs opened it.
      type: list
      elements: dict
    ignored:
      description: RDMA devices that the selectors do not select (name, vendor, device_id, driver).
      type: list
      elements: dict
    modules:
      description: Kernel module name -> loaded.
      type: dict
    driver_version:
      description: Contents of C(/sys/module/<version_module>/version), null when absent.
      type: str
    netns_mode:
      description: RDMA subsystem netns mode, C(shared), C(exclusive) or null when unknown.
      type: str
    rdma_cm:
      description: The node-wide C(/dev/infiniband/rdma_cm) (name, path, present).
      type: dict
    ipv6:
      description: >-
        With C(details), per compute netdev: C(disabled) (null when unknown), C(addresses) (global ones, each
        with C(gid) and C(roce_v2_gid_index), null when no RoCE v2 GID carries it) and
        C(routes) through the netdev (link-local and host routes excluded).
      type: dict
    ipv6_checks:
      description: >-
        The IPv6 compute-network checks of the selected NICs, computed by the plugin's own
        C(rdma_device_plugin.node.ipv6checks) (the one implementation; the plugin runs the same
        at start): every applicable check with C(name) (C(netns_mode), C(ipv6_compute_netdevs),
        C(ipv6_enabled), C(ipv6_global_address), C(ipv6_route), C(roce_v2_gid)), C(nic) and
        C(netdev) (null for node-wide checks), C(passed), C(problem) and C(fix) (empty when
        passed) and C(message) (C(<nic> (<netdev>): ...), with C(. Fix: ...) when failed).
      type: list
      elements: dict
"""

import os
from typing import Any

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.lingjun.rdma.plugins.module_utils.rdma_node import (
    ipv6checks,
    nicchecks,
    selectors,
    sysfs,
    verbs,
)

NIC_OPTIONS = (
    "modules",
    "version_module",
    "min_driver_version",
    "expected_nics",
    "link_layer",
    "rate_gbps",
    "min_fw_version",
    "fw_consistent",
)
IPV6_OPTIONS = ("ipv6_netns_mode", "ipv6_roce_v2_gid")
SELECTOR_KEYS = ("vendors", "deviceIDs", "drivers", "ifNames", "rdmaDevices", "linkTypes")


def _verbs(sysfs_root: str, dev_root: str, names: list[str]) -> verbs.VerbsRead:
    """pyverbs where it can work: libibverbs enumerates the real /sys and opens the real /dev,
    so a fixture tree is read from sysfs only (and pyverbs is not imported). The interpreter's
    own pyverbs only: Debian's dist-packages is not borrowed for another Python."""
    if os.path.realpath(sysfs_root) != "/sys" or os.path.realpath(dev_root) != "/dev":
        return verbs.VerbsRead("pyverbs not used: libibverbs reads /sys and /dev, not these roots: sysfs only")
    return verbs.read(names, lambda: verbs.load_pyverbs_device(extra_path=None))


def _nic_data(nic: sysfs.Nic, seen: verbs.VerbsRead) -> dict[str, Any]:
    data = nic.to_dict()
    if nic.name in seen.ports:
        data["verbs"] = {"port_states": seen.ports[nic.name], "gids": [list(g) for g in seen.gids[nic.name]]}
    ports = data["ports"]
    assert isinstance(ports, list)
    for port_obj, port in zip(nic.ports, ports):
        port["active"] = port_obj.active
        port["rate_gbps"] = port_obj.rate_gbps
    data["link_layers"] = list(nic.link_layers)
    data["all_ports_active"] = nic.all_ports_active
    data["compute_netdevs"] = list(nic.compute_netdevs)
    return data


def _ipv6(netdev: str, state: ipv6checks.NetdevIpv6, nics: list[sysfs.Nic]) -> dict[str, Any]:
    roce_v2: dict[str, int] = {}
    for nic in nics:
        for gid, index in ipv6checks.roce_v2_gids(nic, netdev).items():
            roce_v2.setdefault(gid, index)
    return {
        "disabled": state.disabled,
        "addresses": [
            {
                "address": a.address,
                "prefix_len": a.prefix_len,
                "gid": a.gid,
                "roce_v2_gid_index": roce_v2.get(a.gid),
            }
            for a in state.addresses
        ],
        "routes": [
            {"destination": r.destination, "prefix_len": r.prefix_len, "next_hop": r.next_hop} for r in state.routes
        ],
    }


def _gid_indexes(nics: list[sysfs.Nic]) -> dict[str, int]:
    """Per NIC, the lowest index of a RoCE v2 GID carrying a global IPv6 address of its compute netdevs
    (what NCCL_IB_GID_INDEX must name); NICs without one are left out."""
    out: dict[str, int] = {}
    for nic in nics:
        found = [i for netdev in nic.compute_netdevs for i in ipv6checks.roce_v2_gids(nic, netdev).values()]
        if found:
            out[nic.name] = min(found)
    return out


def _rows(checks: list[ipv6checks.Check], role: str) -> list[dict[str, Any]]:
    """The fact rows of the roles: {name, nic, passed, message, role}."""
    return [{"name": c.name, "nic": c.nic or None, "passed": c.passed, "message": c.message(), "role": role} for c in checks]


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "sysfs_root": {"type": "path", "default": "/sys"},
            "procfs_root": {"type": "path", "default": "/proc"},
            "dev_root": {"type": "path", "default": "/dev"},
            "selectors": {
                "type": "dict",
                "default": {"vendors": ["15b3"]},
                "options": {key: {"type": "list", "elements": "str"} for key in SELECTOR_KEYS},
            },
            "modules": {
                "type": "list",
                "elements": "str",
                "default": ["mlx5_core", "mlx5_ib", "ib_core", "ib_uverbs", "rdma_ucm"],
            },
            "version_module": {"type": "str", "default": "mlx5_core"},
            "ipv6_netns_mode": {"type": "str", "choices": ["shared", "exclusive"], "default": "shared"},
            "ipv6_roce_v2_gid": {"type": "bool", "default": True},
            "min_driver_version": {"type": "str"},
            "expected_nics": {"type": "int"},
            "link_layer": {"type": "str", "choices": ["Ethernet", "InfiniBand"]},
            "rate_gbps": {"type": "float"},
            "min_fw_version": {"type": "str"},
            "fw_consistent": {"type": "bool", "default": True},
            "details": {"type": "bool", "default": False},
            "record_host": {"type": "str"},
            "ipv6_record": {"type": "bool", "default": False},
        },
        supports_check_mode=True,
    )
    p = module.params
    chosen_keys = {k: v for k, v in (p["selectors"] or {}).items() if v is not None}
    options = {k: p[k] for k in NIC_OPTIONS + IPV6_OPTIONS}
    options["selectors"] = chosen_keys
    try:
        chosen = selectors.Selectors.from_mapping(chosen_keys)
        want = nicchecks.Expectations(
            modules=tuple(p["modules"]),
            version_module=p["version_module"],
            min_driver_version=p["min_driver_version"],
            expected_nics=p["expected_nics"],
            link_layer=p["link_layer"],
            rate_gbps=p["rate_gbps"],
            min_fw_version=p["min_fw_version"],
            fw_consistent=p["fw_consistent"],
        )
    except (TypeError, ValueError) as exc:
        module.fail_json(msg=f"invalid options: {exc}")
    selection = nicchecks.selection_text(chosen_keys)

    roots = nicchecks.root_checks(p["sysfs_root"], p["procfs_root"], p["dev_root"])
    if any(not c.passed for c in roots):
        # A wrong root is one finding, not "module not loaded" and "0 RDMA devices".
        failed = [c for c in roots if not c.passed]
        _exit(
            module,
            {
                "sysfs_root": p["sysfs_root"],
                "procfs_root": p["procfs_root"],
                "dev_root": p["dev_root"],
                "options": options,
                "nics": [],
                "checks": {"rdma_nic_validate": _rows(failed, "rdma_nic_validate"), "ipv6_compute_validate": []},
                "summary": {"rdma_nic_validate": {"nic_count": None}, "ipv6_compute_validate": {"ipv6": "not read"}},
            },
        )

    nics = sysfs.read_nics(p["sysfs_root"], p["dev_root"])
    selected = chosen.select(nics)
    names = {n.name for n in selected}
    ignored = [n for n in nics if n.name not in names]
    loaded = sysfs.loaded_modules(p["sysfs_root"], sorted(set(p["modules"]) | {"ib_core"}))
    driver_version = sysfs.module_version(p["sysfs_root"], p["version_module"])
    cm = sysfs.rdma_cm(p["dev_root"])
    nic_checks = nicchecks.check(
        nicchecks.NodeRead(selected, [n.name for n in ignored], loaded, driver_version, cm),
        want,
        sysfs_root=p["sysfs_root"],
        selection=selection,
    )
    seen = _verbs(p["sysfs_root"], p["dev_root"], [n.name for n in selected])
    nic_checks += seen.checks()

    netns_mode = sysfs.netns_mode(p["sysfs_root"])
    netdevs = ipv6checks.read_netdevs(p["procfs_root"], selected)
    ipv6 = ipv6checks.check(
        selected,
        netns_mode=netns_mode,
        ib_core_loaded=loaded["ib_core"],
        netdevs=netdevs,
        want_netns_mode=p["ipv6_netns_mode"],
        roce_v2_gid=p["ipv6_roce_v2_gid"],
        selection=selection,
    )
    compute: dict[str, list[sysfs.Nic]] = {}
    for nic in selected:
        for netdev in nic.compute_netdevs:
            compute.setdefault(netdev, []).append(nic)

    node: dict[str, Any] = {
        "sysfs_root": p["sysfs_root"],
        "procfs_root": p["procfs_root"],
        "dev_root": p["dev_root"],
        "options": options,
        "verbs": seen.status,
        "nics": [_nic_data(n, seen) for n in selected] if p["details"] else [n.name for n in selected],
        "ignored": [
            {"name": n.name, "vendor": n.vendor, "device_id": n.device_id, "driver": n.driver} for n in ignored
        ],
        "modules": {m: loaded[m] for m in p["modules"]},
        "driver_version": driver_version,
        "netns_mode": netns_mode,
        "rdma_cm": {"name": cm.name, "path": cm.node_path, "present": cm.present},
        "ipv6_checks": [c.to_dict() for c in ipv6],
        "checks": {
            "rdma_nic_validate": _rows(nic_checks, "rdma_nic_validate"),
            "ipv6_compute_validate": _rows(ipv6, "ipv6_compute_validate"),
        },
        "summary": {
            "rdma_nic_validate": {
                "nic_count": len(selected),
                "nics": [n.name for n in selected],
                "ignored": [n.name for n in ignored],
                "link_layers": sorted({ll for n in selected for ll in n.link_layers}),
                "firmware": sorted({n.fw_ver for n in selected}),
                "driver_version": driver_version,
                "roce_v2_gid_index": _gid_indexes(selected),
            },
            "ipv6_compute_validate": {
                "ipv6": "passed" if all(c.passed for c in ipv6) else "failed",
                "ipv6_addresses": [a.address for netdev in compute for a in netdevs[netdev].addresses],
                "netns_mode": netns_mode,
            },
        },
    }
    if p["details"]:
        node["ipv6"] = {netdev: _ipv6(netdev, netdevs[netdev], owners) for netdev, owners in compute.items()}
    _exit(module, node)


def _exit(module: AnsibleModule, node: dict[str, Any]) -> None:
    """Return the read; with record_host, also the host's rdma_validation fact (both roles' rows)."""
    host = module.params["record_host"]
    if not host:
        module.exit_json(changed=False, node=node)
    checks, summary = node["checks"], node["summary"]
    ipv6 = module.params["ipv6_record"]
    fact = {
        "node": host,
        "validated": True,
        "errors": {},
        "checks": checks["rdma_nic_validate"] + (checks["ipv6_compute_validate"] if ipv6 else []),
        "summary": {
            **summary["rdma_nic_validate"],
            **(summary["ipv6_compute_validate"] if ipv6 else {"ipv6": "not checked (hostNetwork)"}),
        },
    }
    # The fact is the result: the node's read is not returned again (controller memory at fleet scale).
    lean = {k: node[k] for k in ("sysfs_root", "procfs_root", "dev_root", "options", "verbs") if k in node}
    module.exit_json(changed=False, node=lean, ansible_facts={"rdma_validation": fact})


if __name__ == "__main__":
    main()
