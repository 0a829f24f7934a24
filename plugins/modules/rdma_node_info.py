#!/usr/bin/python
"""Ansible module: read a node's RDMA NICs, IPv6 compute network and node health (read-only)."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: rdma_node_info
short_description: Read a node's RDMA NICs, kernel modules, IPv6 compute network and node health
description:
  - Reads sysfs, procfs and /dev through the project's one reader
    (C(rdma_node), the package the plugin installs too, shipped to the node as module_utils),
    applies the device plugin's NIC selectors and returns plain data.
  - The node-health checks (C(rdma_node.healthchecks), listed with their sources,
    thresholds and fixes in C(docs/validation-checks.md)) read PCIe links, MTU, bonds and LACP,
    lossless RoCE, port counters, the NCCL GID index, GPU-NIC topology, GPUDirect RDMA and the
    container runtime's memlock limit in the same run. Reading needs no root.
  - Never changes the node, apart from the counter samples it keeps there (I(counter_window)). Supports
    check mode (then it keeps none) and always reports C(changed=false). Only I(perftest) loads the NICs
    (a bounded ib_write_bw loopback, off by default).
  - Only the compute NICs are validated (C(rdma_node.compute)) - physical functions
    (an RDMA device on an SR-IOV VF is listed and counted, never checked), selected as compute by
    link layer and/or a RoCE v2 GID on the compute network (I(compute_link_types),
    I(compute_networks)) or by name (I(compute_nics)); the other selected NICs are listed as
    storage/management and not held to the RoCE settings.
  - Error counters are judged by their growth (within I(counter_interval), spent while the rest
    of the node is read, and since the previous run's values, I(counter_baseline)), never by their
    lifetime totals. The action plugin beside this module keeps those values on the controller
    (I(counter_baseline_dir)). The node keeps its own last counter samples
    (C(<host_root>/var/tmp/lingjun-rdma-counters-<uid>.json)), and a read within I(counter_window)
    of one compares with it and does not wait I(counter_interval).
  - The node keeps the compiled code of the C(rdma_node) module_utils
    (C(~/.cache/lingjun-rdma/bytecode), the user's own, 0700; a file per module named by the hash of
    its source), which AnsiballZ would otherwise compile at every run; delete the directory at will.
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
    description: Number of compute RDMA devices the selectors must find; null = at least one.
    type: int
  compute_nics:
    description: >-
      RDMA device names of the compute NICs (a per-node override); empty = by link layer and network
      (I(compute_link_types), I(compute_networks)).
    type: list
    elements: str
    default: []
  compute_link_types:
    description: >-
      Link layers of the compute NICs; empty = InfiniBand on a node that has an InfiniBand port (its
      Ethernet ports serve storage), else Ethernet.
    type: list
    elements: str
    choices: [Ethernet, InfiniBand]
    default: []
  compute_networks:
    description: >-
      CIDRs of the compute network. An Ethernet NIC is compute only with a RoCE v2 GID in one, and
      the GID NCCL uses must be in one (C(gid_index)); empty = any.
    type: list
    elements: str
    default: []
  link_layer:
    description: Link layer every port must have; null = not checked.
    type: str
    choices: [Ethernet, InfiniBand]
  rate_gbps:
    description: >-
      Rate every port must run at, in Gb/sec; null = every port at the best rate of the node's ports
      of the same model (the fleet report compares the rates across nodes).
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
      - In that fact, C(checks) holds the rows that failed or were not checked and
        C(passed_checks) counts the plain passes per role and check name (controller memory at
        fleet scale); C(node.checks) of a read without I(record_host) keeps every row.
    type: str
  ipv6_record:
    description: With I(record_host), record the IPv6 checks (false records the IPv6 compute network as not checked).
    type: bool
    default: false
  details:
    description: >-
      Return the full NIC data (C(nics) as dicts, C(ipv6) per netdev, C(health) with everything the
      health read saw); false returns NIC names only.
    type: bool
    default: false
  health:
    description: Run the node-health checks (returned under C(checks.rdma_node_health)).
    type: bool
    default: true
  health_record:
    description: >-
      With I(record_host), also record the health checks and summary in the C(rdma_validation) fact
      (false leaves them in the module result only).
    type: bool
    default: false
  host_root:
    description: >-
      The node's root file system, for the container runtime's systemd unit files
      (C(etc/systemd), C(usr/lib/systemd)); default the directory that holds I(procfs_root)
      (C(/) for C(/proc)).
    type: path
  skip_checks:
    description: Names of health checks to leave out (C(pcie_link), C(mtu), C(memlock), ...).
    type: list
    elements: str
    default: []
  fail_not_checked:
    description: A health check whose source the node does not show fails instead of being reported as not checked.
    type: bool
    default: false
  mtu:
    description: Netdev MTU every RoCE netdev must have; null = any MTU that gives the RoCE active MTU I(roce_mtu).
    type: int
  roce_mtu:
    description: RoCE active MTU every port must have (the kernel derives it from the netdev MTU less 96 bytes).
    type: int
    default: 4096
    choices: [256, 512, 1024, 2048, 4096]
  bond_mode:
    description: Mode every RDMA bond must have; null = reported, not checked.
    type: str
    choices: [balance-rr, active-backup, balance-xor, broadcast, 802.3ad, balance-tlb, balance-alb]
  roce_trust:
    description: QoS trust mode of every RoCE netdev.
    type: str
    default: dscp
    choices: [dscp, pcp]
  pfc_priority:
    description: The lossless priority; PFC and RoCE ECN must be on for it.
    type: int
    default: 3
  counter_max:
    description: >-
      Port counter name (C(counters/) or C(hw_counters/)) -> the most it may grow since the values the
      previous run stored for the node (I(counter_baseline)); lifetime totals are reported, not judged.
    type: dict
    default: {excessive_buffer_overrun_errors: 0, local_link_integrity_errors: 0}
  counter_watch:
    description: Port counters that must not grow at all within I(counter_interval) (a link taking errors now).
    type: list
    elements: str
    default: [symbol_error, link_error_recovery, port_rcv_errors, port_rcv_remote_physical_errors,
              local_link_integrity_errors, excessive_buffer_overrun_errors]
  counter_interval:
    description: >-
      Seconds between the two reads of the watched counters, C(link_downed) and C(carrier_changes)
      (C(port_counters), C(link_flap)); 0 = one read. The first read is taken before the rest of the
      node is read and the second after it, so the run takes at least this long, not this much longer.
    type: float
    default: 3
  counter_window:
    description: >-
      Seconds a counter sample the node kept from an earlier read serves as the first of the two counter
      reads: the newest one at least I(counter_interval) old is compared with this read, so the run does
      not wait (one younger than that: only the rest of the interval); with none, the counters are read
      twice I(counter_interval) apart. 0 = always read twice. The file is kept only if this user owns it.
    type: float
    default: 600
  counter_baseline:
    description: >-
      The counters the previous run returned in C(counter_baseline_next) for this node; the action
      plugin passes them from I(counter_baseline_dir). Null = no previous run.
    type: dict
  counter_baseline_dir:
    description: >-
      Controller directory of the stored counters, one C(<inventory host>.json) per node: the action
      plugin reads this host's file into I(counter_baseline) and writes C(counter_baseline_next) back
      after a read (not in check mode). Null = nothing stored.
    type: path
  nccl_addr_family:
    description: >-
      NCCL_IB_ADDR_FAMILY the GID NCCL picks is computed for; C(auto) as the plugin's workloadEnv gives
      hostNetwork pods (AF_INET where every RoCE NIC has an IPv4 RoCE v2 GID, else AF_INET6).
    type: str
    default: auto
    choices: [auto, AF_INET, AF_INET6]
  nccl_gid_index:
    description: >-
      NCCL_IB_GID_INDEX when the deployment pins it (every RoCE NIC must then carry a RoCE v2 GID of the
      address family at that index); null = not pinned, NCCL picks per NIC.
    type: int
  ipc_lock:
    description: >-
      RDMA pods run with CAP_IPC_LOCK (the chart's admission policy requires it): a limited memlock is
      then a warning (ib_umem_get exempts them), else a failure.
    type: bool
    default: true
  topology_expected:
    description: RDMA device name -> PCI addresses of the GPUs that must share its PCIe switch; null = not checked.
    type: dict
  gpudirect_required:
    description: The node must offer GPUDirect RDMA (nvidia_peermem, or DMA-BUF); false = reported only.
    type: bool
    default: false
  perftest:
    description: Run a bounded ib_write_bw loopback per active port where perftest is installed (loads the NICs).
    type: bool
    default: false
  perftest_min_percent:
    description: Loopback bandwidth the I(perftest) check needs, in percent of the port rate.
    type: float
    default: 92.5
  perftest_seconds:
    description: Duration of each loopback (ib_write_bw -D), 1 to 60.
    type: int
    default: 5
  perftest_command:
    description: The ib_write_bw executable (name looked up in PATH, or a path).
    type: str
    default: ib_write_bw
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
        C(rdma_node.nicchecks)) and C(ipv6_compute_validate) (from
        C(rdma_node.ipv6checks)); each C({name, nic, passed, message}), the message
        without the node's name. C(rdma_node_health) (from C(rdma_node.healthchecks),
        empty with I(health) false) rows are C({name, nic, netdev, gpu, passed, skipped, message,
        role}): C(skipped) true means not checked (the message says why; C(passed) is true so that
        it fails no node, unless I(fail_not_checked)); an unexpected error of the health read is one
        failed C(health_read) row and leaves the other roles' checks as they are. A missing sysfs,
        procfs or dev root is one failed C(node_roots) check and nothing else is read.
      type: dict
    summary:
      description: >-
        Per role, the summary row of the fleet report (NIC count, link layers, firmware, IPv6, ...).
        C(rdma_node_health): C(health) (passed/failed), C(not_checked) (check names),
        C(gpus) (count), C(gid_index) (NIC -> NCCL's GID index of port 1), C(gid_family) (the
        NCCL address family it is for), C(mtu) (NIC -> netdev
        MTU of its RoCE netdev), C(bonds) (NIC -> bond mode), C(pcie_degraded) (NICs and GPU
        addresses), C(topology) (NIC -> C(switch)/C(root_port)/C(numa) -> GPU addresses, each list
        holding the closer ones too), C(gpudirect) (C(peermem), C(dma-buf) or C(none)), C(kernel) (the release) and
        C(memlock) (the running runtime's limit, null when none runs).
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
        C(rdma_node.ipv6checks) (the one implementation; the plugin runs the same
        at start): every applicable check with C(name) (C(netns_mode), C(ipv6_compute_netdevs),
        C(ipv6_enabled), C(ipv6_global_address), C(ipv6_route), C(roce_v2_gid)), C(nic),
        C(netdev) and C(gpu) (null when none), C(passed), C(skipped) (false), C(problem) and C(fix)
        (empty when passed) and C(message) (C(<nic> (<netdev>): ...), with C(. Fix: ...) when failed).
      type: list
      elements: dict
    counter_baseline_next:
      description: >-
        What the next run compares the counters with (the action plugin stores it and leaves it out of
        the result): per NIC its node GUID, the time and the latest values, or, for a NIC whose counters
        grew past I(counter_max) since I(counter_baseline), those previous values.
      type: dict
    health:
      description: >-
        With C(details) and I(health): everything the health read saw, C(interval) (seconds
        between the counter reads), C(dcb) (C(used) or why DCB netlink was not), C(perftest) (null
        or why it did not run), C(nics) per RDMA device (C(pci) functions with their links,
        C(netdevs), C(bond), C(qos) per netdev, C(counters), C(gid_index), C(perftest)),
        C(gpus), C(gpudirect) and C(runtimes).
      type: dict
"""

from ansible.module_utils.basic import AnsibleModule

# The work is in module_utils, compiled once per node and kept there (rdma_node/_bytecode.py): AnsiballZ
# ships this file as source, compiled at every run, so it holds only the documentation and the spec.
from ansible_collections.lingjun.rdma.plugins.module_utils.rdma_node import compute, healthchecks, nodeinfo

SELECTOR_KEYS = ("vendors", "deviceIDs", "drivers", "ifNames", "rdmaDevices", "linkTypes")


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
            "compute_nics": {"type": "list", "elements": "str", "default": []},
            "compute_link_types": {
                "type": "list", "elements": "str", "default": [], "choices": [compute.ETHERNET, compute.INFINIBAND]
            },
            "compute_networks": {"type": "list", "elements": "str", "default": []},
            "link_layer": {"type": "str", "choices": ["Ethernet", "InfiniBand"]},
            "rate_gbps": {"type": "float"},
            "min_fw_version": {"type": "str"},
            "fw_consistent": {"type": "bool", "default": True},
            "details": {"type": "bool", "default": False},
            "record_host": {"type": "str"},
            "ipv6_record": {"type": "bool", "default": False},
            "health": {"type": "bool", "default": True},
            "health_record": {"type": "bool", "default": False},
            "host_root": {"type": "path"},
            "skip_checks": {"type": "list", "elements": "str", "default": []},
            "fail_not_checked": {"type": "bool", "default": False},
            "mtu": {"type": "int"},
            "roce_mtu": {"type": "int", "default": 4096, "choices": [256, 512, 1024, 2048, 4096]},
            "bond_mode": {"type": "str", "choices": list(healthchecks.BOND_MODES)},
            "roce_trust": {"type": "str", "default": "dscp", "choices": ["dscp", "pcp"]},
            "pfc_priority": {"type": "int", "default": 3},
            "counter_max": {"type": "dict", "default": dict(healthchecks.DEFAULT_COUNTER_MAX)},
            "counter_watch": {"type": "list", "elements": "str", "default": list(healthchecks.DEFAULT_COUNTER_WATCH)},
            "counter_interval": {"type": "float", "default": healthchecks.DEFAULT_COUNTER_INTERVAL},
            "counter_window": {"type": "float", "default": 600.0},
            "counter_baseline": {"type": "dict"},
            "counter_baseline_dir": {"type": "path"},  # the action plugin's; unused here
            "nccl_addr_family": {"type": "str", "default": "auto", "choices": ["auto", "AF_INET", "AF_INET6"]},
            "nccl_gid_index": {"type": "int"},
            "ipc_lock": {"type": "bool", "default": True},
            "topology_expected": {"type": "dict"},
            "gpudirect_required": {"type": "bool", "default": False},
            "perftest": {"type": "bool", "default": False},
            "perftest_min_percent": {"type": "float", "default": 92.5},
            "perftest_seconds": {"type": "int", "default": 5},
            "perftest_command": {"type": "str", "default": "ib_write_bw"},
        },
        supports_check_mode=True,
    )
    nodeinfo.run(module)


if __name__ == "__main__":
    main()
