"""The rdma_node_info module's work: read the node, run the checks, build the result (standard library only).

The module file (plugins/modules/rdma_node_info.py) keeps only its documentation and argument spec and
calls :func:`run`. AnsiballZ ships the module file as source and Python compiles it at every run, while
this package's code is compiled once per node (:mod:`._bytecode`): the logic lives here so a node does
not compile it again for every read (issue 40, bench/RESULTS.md).
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any, NoReturn, Protocol

from . import checks, compute, healthchecks, ipv6checks, nicchecks, selectors, sysfs, verbs


class Module(Protocol):
    """What :func:`run` uses of Ansible's AnsibleModule (this package does not import Ansible)."""

    params: dict[str, Any]
    check_mode: bool

    def fail_json(self, msg: str, **kwargs: Any) -> NoReturn: ...

    def exit_json(self, **kwargs: Any) -> NoReturn: ...


NIC_OPTIONS = (
    "modules",
    "version_module",
    "min_driver_version",
    "expected_nics",
    "compute_nics",
    "compute_link_types",
    "compute_networks",
    "link_layer",
    "rate_gbps",
    "min_fw_version",
    "fw_consistent",
)
IPV6_OPTIONS = ("ipv6_netns_mode", "ipv6_roce_v2_gid")
HEALTH_OPTIONS = (
    "health",
    "skip_checks",
    "fail_not_checked",
    "mtu",
    "roce_mtu",
    "bond_mode",
    "roce_trust",
    "pfc_priority",
    "counter_max",
    "counter_watch",
    "counter_interval",
    "nccl_addr_family",
    "nccl_gid_index",
    "ipc_lock",
    "topology_expected",
    "gpudirect_required",
    "perftest",
    "perftest_min_percent",
    "perftest_seconds",
    "perftest_command",
)
HEALTH = "rdma_node_health"


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
    for port_obj, port in zip(nic.ports, ports, strict=True):
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


def _rows(found: list[checks.Check], role: str) -> list[dict[str, Any]]:
    """The fact rows of the roles: {name, nic, passed, message, role}."""
    return [
        {"name": c.name, "nic": c.nic or None, "passed": c.passed, "message": c.message(), "role": role} for c in found
    ]


def _health_rows(found: list[checks.Check]) -> list[dict[str, Any]]:
    """The health rows: {name, nic, netdev, gpu, passed, skipped, message, role}."""
    rows = _rows(found, HEALTH)
    for row, c in zip(rows, found, strict=True):
        row.update(netdev=c.netdev or None, gpu=c.gpu or None, skipped=c.skipped, warning=c.warning)
    return rows


def _samples_path(host_root: str) -> str:
    return os.path.join(host_root, "var", "tmp", f"lingjun-rdma-counters-{os.getuid()}.json")


def _load_samples(path: str) -> dict[str, Any] | None:
    """The node's kept counter samples; None when there are none, or the file is not this user's own (a
    file another user planted must not stand in for the counters)."""
    try:
        with open(path, encoding="utf-8") as fh:
            if os.fstat(fh.fileno()).st_uid != os.getuid():
                return None
            data = json.load(fh)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _keep_samples(path: str, data: dict[str, Any]) -> None:
    """Replace the file atomically; a node where it cannot be written keeps reading the counters twice."""
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, partial = tempfile.mkstemp(prefix=".lingjun-rdma-counters-", dir=os.path.dirname(path))
    except OSError:
        return
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(data, fh, sort_keys=True)
        os.replace(partial, path)
    except OSError:
        os.unlink(partial)


def compact_rows(rows: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, dict[str, int]]]:
    """The fact's rows at fleet scale: every row that failed or was not checked stays a row; the
    plain passes become counts per role and check name (``passed_checks``). About 100 rows a node
    (health checks per NIC and GPU) would otherwise be kept by the controller for every host, twice
    (fact and registered read): 526 MB at 2000 hosts (bench/fleet.py)."""
    listed: list[dict[str, Any]] = []
    passed: dict[str, dict[str, int]] = {}
    for row in rows:
        if row["passed"] and not row.get("skipped") and not row.get("warning"):
            per_role = passed.setdefault(row["role"], {})
            per_role[row["name"]] = per_role.get(row["name"], 0) + 1
        else:
            listed.append(row)
    return listed, passed


def _health_expectations(p: dict[str, Any]) -> healthchecks.Expectations:
    """The health options as Expectations; raises ValueError naming the option and the fix."""
    counter_max = {}
    for name, value in (p["counter_max"] or {}).items():
        try:
            counter_max[str(name)] = int(value)
        except (TypeError, ValueError):
            raise ValueError(f"counter_max.{name} must be a count, not {value!r}") from None
    expected = p["topology_expected"]
    if expected is not None:
        for nic, gpus in expected.items():
            if not isinstance(gpus, list) or not all(isinstance(g, str) for g in gpus):
                raise ValueError(f"topology_expected.{nic} must be a list of GPU PCI addresses, not {gpus!r}")
    return healthchecks.Expectations(
        mtu=p["mtu"],
        roce_mtu=p["roce_mtu"],
        bond_mode=p["bond_mode"],
        roce_trust=p["roce_trust"],
        pfc_priority=p["pfc_priority"],
        counter_max=counter_max,
        counter_watch=tuple(p["counter_watch"]),
        counter_interval=p["counter_interval"],
        nccl_addr_family=p["nccl_addr_family"],
        nccl_gid_index=p["nccl_gid_index"],
        compute_networks=tuple(p["compute_networks"]),
        ipc_lock=p["ipc_lock"],
        topology_expected=expected,
        gpudirect_required=p["gpudirect_required"],
        perftest=p["perftest"],
        perftest_min_percent=p["perftest_min_percent"],
        perftest_seconds=p["perftest_seconds"],
        perftest_command=p["perftest_command"],
        skip=frozenset(p["skip_checks"] or ()),
        fail_not_checked=p["fail_not_checked"],
    )


def run(module: Module) -> NoReturn:
    """Read the node with the module's parameters and exit with the result (``exit_json``/``fail_json``)."""
    p = module.params
    chosen_keys = {k: v for k, v in (p["selectors"] or {}).items() if v is not None}
    options = {k: p[k] for k in NIC_OPTIONS + IPV6_OPTIONS + HEALTH_OPTIONS}
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
        health_want = _health_expectations(p)
        want_compute = compute.Compute(
            tuple(p["compute_nics"]), tuple(p["compute_link_types"]), tuple(p["compute_networks"])
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
                "checks": {
                    "rdma_nic_validate": _rows(failed, "rdma_nic_validate"),
                    "ipv6_compute_validate": [],
                    HEALTH: [],
                },
                "summary": {
                    "rdma_nic_validate": {"nic_count": None},
                    "ipv6_compute_validate": {"ipv6": "not read"},
                    HEALTH: {"health": "not read"},
                },
            },
        )

    nics = sysfs.read_nics(p["sysfs_root"], p["dev_root"])
    names = {n.name for n in chosen.select(nics)}
    ignored = [n for n in nics if n.name not in names]
    roles = compute.classify([n for n in nics if n.name in names], want_compute)
    selected = roles.compute  # the compute NICs: every check below is about them
    watch = None
    host_root = p["host_root"] or os.path.dirname(os.path.abspath(p["procfs_root"]))
    samples = (
        _samples_path(host_root) if p["health"] and p["counter_interval"] > 0 and p["counter_window"] > 0 else None
    )
    if samples:  # the node's own earlier sample: no wait for the counters to move
        watch = healthchecks.watch_from_samples(_load_samples(samples), selected, health_want, p["counter_window"])
    if p["health"] and watch is None:  # the first counter read now: counter_interval runs while the rest is read
        watch = healthchecks.watch_counters(selected, p["sysfs_root"], health_want)
    loaded = sysfs.loaded_modules(p["sysfs_root"], sorted(set(p["modules"]) | {"ib_core"}))
    driver_version = sysfs.module_version(p["sysfs_root"], p["version_module"])
    cm = sysfs.rdma_cm(p["dev_root"])
    nic_checks = nicchecks.check(
        nicchecks.NodeRead(
            selected,
            [n.name for n in ignored],
            loaded,
            driver_version,
            cm,
            storage=roles.other,
            vf_devices=roles.vf_devices,
            vfs=roles.vfs,
            missing=roles.missing,
        ),
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
    by_netdev: dict[str, list[sysfs.Nic]] = {}
    for nic in selected:
        for netdev in nic.compute_netdevs:
            by_netdev.setdefault(netdev, []).append(nic)

    health_read = None
    health: list[checks.Check] = []
    if p["health"]:
        real = os.path.realpath(p["sysfs_root"]) == "/sys" and os.path.realpath(p["procfs_root"]) == "/proc"
        try:
            health_read = healthchecks.read(
                selected,
                p["sysfs_root"],
                p["procfs_root"],
                host_root,
                health_want,
                real,
                active_mtu=seen.active_mtu,
                watch=watch,
                baseline=p["counter_baseline"],
            )
            health = healthchecks.check(health_read, health_want)
        except Exception as exc:  # a reader bug must not cost the node its NIC and IPv6 checks
            health_read = None
            health = [
                checks.Check(
                    "health_read", "", "", False,
                    f"the node-health read failed ({type(exc).__name__}: {exc})",
                    "report it with this message; set health: false to validate without the node-health checks",
                )
            ]  # fmt: skip

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
            HEALTH: _health_rows(health),
        },
        "summary": {
            "rdma_nic_validate": {
                "nic_count": len(selected),
                "nics": [n.name for n in selected],
                "storage": sorted(roles.other),
                "vfs": roles.vfs,
                "ignored": [n.name for n in ignored] + roles.vf_devices,
                "link_layers": sorted({ll for n in selected for ll in n.link_layers}),
                "firmware": sorted({n.fw_ver for n in selected}),
                "driver_version": driver_version,
                "roce_v2_gid_index": _gid_indexes(selected),
                "port_rates": sorted({p.rate for n in selected for p in n.ports if p.active and p.rate}),
            },
            "ipv6_compute_validate": {
                "ipv6": "passed" if all(c.passed for c in ipv6) else "failed",
                "ipv6_addresses": [a.address for netdev in by_netdev for a in netdevs[netdev].addresses],
                "netns_mode": netns_mode,
            },
            HEALTH: healthchecks.summary(health_read, health)
            if health_read is not None
            else {"health": "failed" if health else "not checked"},
        },
    }
    if health_read is not None:
        node["counter_baseline_next"] = healthchecks.next_baseline(health_read, health_want)
        if samples and not module.check_mode:
            _keep_samples(samples, healthchecks.kept_samples(health_read, health_want))
    if p["details"]:
        node["ipv6"] = {netdev: _ipv6(netdev, netdevs[netdev], owners) for netdev, owners in by_netdev.items()}
        if health_read is not None:
            node["health"] = healthchecks.details(health_read)
    _exit(module, node)


def _exit(module: Module, node: dict[str, Any]) -> NoReturn:
    """Return the read; with record_host, also the host's rdma_validation fact (both roles' rows)."""
    host = module.params["record_host"]
    if not host:
        module.exit_json(changed=False, node=node)
    rows, summary = node["checks"], node["summary"]
    ipv6, health = module.params["ipv6_record"], module.params["health_record"]
    recorded = (
        rows["rdma_nic_validate"] + (rows["ipv6_compute_validate"] if ipv6 else []) + (rows[HEALTH] if health else [])
    )
    listed, passed = compact_rows(recorded)
    fact = {
        "node": host,
        "validated": True,
        "errors": {},
        "checks": listed,
        "passed_checks": passed,
        "summary": {
            **summary["rdma_nic_validate"],
            **(summary["ipv6_compute_validate"] if ipv6 else {"ipv6": "not checked (hostNetwork)"}),
            **(summary[HEALTH] if health else {}),
        },
    }
    # The fact is the result: the node's read is not returned again (controller memory at fleet scale).
    keep = ("sysfs_root", "procfs_root", "dev_root", "options", "verbs", "counter_baseline_next")
    lean = {k: node[k] for k in keep if k in node}
    module.exit_json(changed=False, node=lean, ansible_facts={"rdma_validation": fact})
