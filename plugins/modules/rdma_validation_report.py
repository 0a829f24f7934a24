#!/usr/bin/python
"""Ansible module: write the fleet validation report (JSON + Markdown) on the controller."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: rdma_validation_report
short_description: Write the RDMA fleet validation report, merged with the previous one
description:
  - Builds the fleet report from the C(rdma_validation) facts of the hosts of one run and
    writes C(rdma-validation.json) and C(rdma-validation.md) into I(dest).
  - The Markdown and JSON open with a fleet rollup (module_utils C(rdma_fleet)) - pass/fail counts,
    the most frequent failing checks, and per fact (firmware, driver/OFED,
    kernel, link layer, NIC count, RoCE v2 GID index) the values with their node counts and the
    nodes that differ from the most common one (GID index drift is flagged).
  - Hosts of the run without results (unreachable, or failed before the checks) are listed as
    not validated. Hosts of the previous report that this run did not cover (C(--limit)) keep
    their entry and its date, so a stale entry is visible. With I(inventory_hosts), entries of
    hosts no longer in the inventory are dropped and listed once under C(removed).
  - Each entry of this run is dated (C(validated_on), UTC day); the same findings on the same
    day rewrite nothing.
  - In check mode nothing is written and no change is reported; C(msg) says what would be written.
  - Each node's row shows its node-health verdict, not-checked count, GID index, MTU, GPUDirect and
    degraded PCIe links (C(rdma_node_info)'s C(rdma_node_health) summary); I(drift) turns the odd nodes out
    into findings.
  - Linear in the number of hosts (the former Jinja report rebuilt lists per host).
version_added: "0.2.0"
author: rdma-device-plugin maintainers
options:
  dest:
    description: Directory of the report files (created when missing).
    type: path
    required: true
  hosts:
    description: Inventory hosts of this run, in any order.
    type: list
    elements: str
    required: true
  results:
    description:
      - Host -> its C(rdma_validation) fact (null when the host has none).
      - One of I(results), I(results_file) and I(fact) is required.
    type: dict
  results_file:
    description:
      - A JSON file holding I(results) (what the action plugin passes on with I(fact)), removed
        with the module's temporary directory.
    type: path
  fact:
    description:
      - Controller side only (action_plugins/rdma_validation_report.py), instead of I(results),
        the name of the per-host fact holding each host's findings (C(rdma_validation)). The
        action takes it from every host's variables without a templated copy of them all and
        passes it on in I(results_file) (controller memory at thousands of hosts).
    type: str
  read:
    description:
      - With I(fact), the name of the registered node read (C(rdma_node_read)); a host whose read
        returned no facts (module failure, unreachable) is listed as not validated with its
        message.
    type: str
  node_names:
    description: Host -> Kubernetes node name, when it differs from the inventory host name.
    type: dict
    default: {}
  drift:
    description:
      - Fleet drift (module_utils C(rdma_fleet.drift)) - every validated node whose firmware, driver (OFED),
        kernel or RoCE GID index differs from the most common value of the report's validated nodes gets a
        C(drift_<fact>) finding (role C(fleet_drift)). C(warn) - reported, the node still passes; C(fail) - the
        node fails; C(ignore) - no finding. Recomputed over the whole report at every run.
    type: str
    choices: [warn, fail, ignore]
    default: warn
  inventory_hosts:
    description:
      - Every host of the inventory's node group (not only this run's, under C(--limit)). Entries of
        the previous report for other hosts are dropped and listed once under C(removed).
    type: list
    elements: str
"""

EXAMPLES = r"""
- name: Write the fleet report
  rdma_validation_report:
    dest: /tmp/report
    hosts: [node-a, node-b]
    results: {node-a: "{{ hostvars['node-a'].rdma_validation }}", node-b: null}

- name: Write the fleet report from every host's fact, gathered on the controller (playbooks/validate.yml)
  rdma_validation_report:
    dest: "{{ rdma_validation_report_dir }}"
    hosts: "{{ ansible_play_hosts_all }}"
    fact: rdma_validation
    read: rdma_node_read
  delegate_to: localhost
  run_once: true
"""

RETURN = r"""
drift:
  description: Host of this run -> its fleet drift findings (check rows), only the hosts that have some.
  returned: always
  type: dict
summary:
  description: C(total), C(passed), C(failed), C(not_validated) and C(removed) of the report (its nodes are in the files).
  returned: always
  type: dict
paths:
  description: The JSON and Markdown files.
  returned: always
  type: list
  elements: str
"""

import datetime
import json
import os
from typing import Any

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.lingjun.rdma.plugins.module_utils.rdma_fleet import DRIFT_ROLE, drift, rollup, rollup_markdown

NOT_VALIDATED = "not validated (unreachable, or a task failed before the checks)"


def _entry(host: str, node_name: str, fact: Any, today: str) -> dict[str, Any]:
    base = {"host": host, "node_name": node_name, "validated_on": today}
    if not isinstance(fact, dict) or not fact.get("validated", True) or "checks" not in fact:
        reason = NOT_VALIDATED
        errors = fact.get("errors") if isinstance(fact, dict) else None
        if errors:
            reason = "not validated: " + "; ".join(f"{role}: {msg}" for role, msg in sorted(errors.items()))
        return {**base, "validated": False, "passed": False, "failed": [reason], "checks": [], "summary": {}}
    entry = {**base, "validated": True, "checks": list(fact.get("checks") or []), "summary": dict(fact.get("summary") or {})}
    if fact.get("passed_checks"):  # the plain passes as counts (rdma_node_info's fleet fact)
        entry["passed_checks"] = fact["passed_checks"]
    return _judged(entry)


def passed_count(entry: dict[str, Any]) -> int:
    """Checks passed: the passing rows plus the passes recorded as counts (``passed_checks``)."""
    rows = sum(1 for c in entry.get("checks") or [] if c.get("passed"))
    return rows + sum(n for per_role in (entry.get("passed_checks") or {}).values() for n in per_role.values())


def _judged(entry: dict[str, Any]) -> dict[str, Any]:
    """The entry with ``failed`` and ``passed`` from its check rows."""
    failed = [c["name"] + (f" {c['nic']}" if c.get("nic") else "") for c in entry["checks"] if not c.get("passed")]
    return {**entry, "passed": not failed, "failed": failed}


def build(
    previous: dict[str, Any],
    hosts: list[str],
    results: dict[str, Any],
    names: dict[str, str],
    today: str,
    inventory: list[str] | None = None,
    drift_mode: str = "warn",
) -> dict[str, Any]:
    nodes = dict(previous.get("nodes") or {})
    for host in hosts:
        nodes[host] = _entry(host, str(names.get(host) or host), results.get(host), today)
    # Drift is a fleet fact: the previous run's drift rows go, and every entry is judged again.
    for host, n in nodes.items():
        if n.get("validated") and any(c.get("role") == DRIFT_ROLE for c in n.get("checks") or []):
            nodes[host] = _judged({**n, "checks": [c for c in n["checks"] if c.get("role") != DRIFT_ROLE]})
    removed = []
    if inventory is not None:
        keep = set(inventory) | set(hosts)
        removed = [{"host": h, "validated_on": nodes[h].get("validated_on")} for h in sorted(nodes) if h not in keep]
        nodes = {h: n for h, n in nodes.items() if h in keep}
    nodes = dict(sorted(nodes.items()))
    found = drift(nodes, drift_mode)
    for host, rows in found.items():
        nodes[host] = _judged({**nodes[host], "checks": nodes[host]["checks"] + rows})
    return {
        "drift": {h: rows for h, rows in found.items() if h in hosts},
        "rollup": rollup(nodes),
        "nodes": nodes,
        "total": len(nodes),
        "passed": sum(1 for n in nodes.values() if n.get("passed")),
        "failed": [h for h, n in nodes.items() if not n.get("passed")],
        "not_validated": [h for h, n in nodes.items() if not n.get("validated")],
        "removed": removed,
        "this_run": sorted(hosts),
    }


def _cell(value: Any) -> str:
    text = ", ".join(str(v) for v in value) if isinstance(value, list) else str(value)
    return (text or "-").replace("|", "\\|").replace("\n", " ")


def _per_nic(value: Any) -> str:
    """A NIC -> value map in one cell: the value when every NIC has the same one, else each NIC's."""
    if not isinstance(value, dict) or not value:
        return "-"
    shown = {"-" if v is None else str(v) for v in value.values()}
    if len(shown) == 1:
        return shown.pop()
    return ", ".join(f"{nic}={'-' if v is None else v}" for nic, v in sorted(value.items()))


def markdown(report: dict[str, Any]) -> str:
    nodes = report["nodes"]
    lines = [
        "# RDMA node validation",
        "",
        f"{report['passed']} of {report['total']} node(s) passed"
        + (f"; {len(report['not_validated'])} not validated" if report["not_validated"] else "")
        + ". Entries not validated in the latest run keep their older date.",
        "",
        rollup_markdown(report["rollup"]),
    ]
    if report.get("removed"):
        gone = ", ".join(f"{r['host']} (last validated {r.get('validated_on') or '-'})" for r in report["removed"])
        lines += [f"Removed from the inventory since the previous report (listed this once): {gone}.", ""]
    lines += [
        "## Nodes",
        "",
        "| host | result | node | validated on | checks passed | checks failed | RDMA NICs | link layer "
        "| firmware | driver | IPv6 compute | health | not checked | GID index | MTU | GPUDirect | PCIe degraded "
        "| failed checks |",
        "|" + "---|" * 18,
    ]
    for host, n in nodes.items():
        s = n.get("summary") or {}
        checks = n.get("checks") or []
        result = "PASS" if n.get("passed") else ("FAIL" if n.get("validated") else "NOT VALIDATED")
        ok = passed_count(n)
        row = [
            host,
            result,
            n.get("node_name", host),
            n.get("validated_on", "-"),
            ok,
            sum(1 for c in checks if not c.get("passed")),
            s.get("nic_count", "-") if s.get("nic_count") is not None else "-",
            s.get("link_layers") or "-",
            s.get("firmware") or "-",
            s.get("driver_version") or "-",
            s.get("ipv6", "not checked"),
            s.get("health", "not checked"),
            len(s.get("not_checked") or []) if "health" in s else "-",
            _per_nic(s.get("gid_index")),
            _per_nic(s.get("mtu")),
            s.get("gpudirect") or "-",
            s.get("pcie_degraded") or ("none" if "health" in s else "-"),
            n.get("failed") or "-",
        ]
        lines.append("| " + " | ".join(_cell(v) for v in row) + " |")
    bad = [(h, n) for h, n in nodes.items() if not n.get("passed") or any(c.get("warning") for c in n.get("checks") or [])]
    if bad:
        lines += ["", "## Findings"]
    for host, n in bad:
        name = n.get("node_name", host)
        lines += ["", f"### {host}" + (f" (node {name})" if name != host else "") + f", {n.get('validated_on', '-')}", ""]
        found = [c for c in n.get("checks") or [] if not c.get("passed") or c.get("warning")]
        for c in found:
            warn = " (warning)" if c.get("passed") else ""
            lines.append(f"- **{c['name']}**{warn}" + (f" ({c['nic']})" if c.get("nic") else "") + f": {c['message']}")
        if not found:
            lines.append("- " + "; ".join(n.get("failed") or [NOT_VALIDATED]))
    return "\n".join(lines) + "\n"


def dump(report: dict[str, Any]) -> str:
    """The report as JSON, one node per line (``grep <host>`` finds its entry). json's C encoder
    writes each piece: with ``indent`` the pure-Python one would write the whole file, four to five
    times slower at thousands of hosts (once-per-run work on the controller)."""
    parts = []
    for key in sorted(report):
        if key == "nodes":
            lines = ",\n".join(f"{json.dumps(h)}: {json.dumps(n, sort_keys=True)}" for h, n in sorted(report[key].items()))
            parts.append(f'"nodes": {{\n{lines}\n}}' if lines else '"nodes": {}')
        else:
            parts.append(f"{json.dumps(key)}: {json.dumps(report[key], sort_keys=True)}")
    return "{\n" + ",\n".join(parts) + "\n}\n"


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as fh:
            return fh.read()
    except FileNotFoundError:
        return None


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "dest": {"type": "path", "required": True},
            "hosts": {"type": "list", "elements": "str", "required": True},
            "results": {"type": "dict"},
            "results_file": {"type": "path"},
            "node_names": {"type": "dict", "default": {}},
            "inventory_hosts": {"type": "list", "elements": "str"},
            "drift": {"type": "str", "choices": ["warn", "fail", "ignore"], "default": "warn"},
        },
        required_one_of=[("results", "results_file")],
        mutually_exclusive=[("results", "results_file")],
        supports_check_mode=True,
    )
    p = module.params
    if p["results_file"]:
        with open(p["results_file"], encoding="utf-8") as fh:
            p["results"] = json.load(fh)
    json_path = os.path.join(p["dest"], "rdma-validation.json")
    md_path = os.path.join(p["dest"], "rdma-validation.md")
    old_json = _read(json_path)
    previous: dict[str, Any] = {}
    if old_json:
        try:
            previous = json.loads(old_json)
        except ValueError:
            module.warn(f"{json_path} is not JSON; it is replaced, not merged")
    today = datetime.datetime.now(datetime.timezone.utc).date().isoformat()
    report = build(previous, p["hosts"], p["results"], p["node_names"], today, p["inventory_hosts"], p["drift"])
    found = report.pop("drift")  # already in the entries; returned for the playbook to record on the hosts
    new_json = dump(report)
    new_md = markdown(report)
    differs = old_json != new_json or _read(md_path) != new_md
    paths = [json_path, md_path]
    summary = {k: report[k] for k in ("total", "passed", "failed", "not_validated", "removed")}
    # Not the default echo of every host's results (module_utils/basic.py, _return_formatted):
    # the controller would hold the whole fleet's findings a second time (memory at 5000 hosts).
    invocation = {"module_args": {"dest": p["dest"], "hosts": len(p["hosts"]), "results": len(p["results"] or {})}}
    if module.check_mode:
        would = "would rewrite" if differs else "would leave unchanged"
        module.exit_json(
            changed=False,
            summary=summary,
            paths=paths,
            msg=f"check mode: {would} {json_path} and {md_path}",
            drift=found,
            invocation=invocation,
        )
    if differs:
        os.makedirs(p["dest"], exist_ok=True)
        for path, text in ((json_path, new_json), (md_path, new_md)):
            tmp = path + ".tmp"
            with open(tmp, "w", encoding="utf-8") as fh:
                fh.write(text)
            os.chmod(tmp, 0o644)
            os.replace(tmp, path)  # atomic: a reader never sees half a report
    module.exit_json(changed=differs, summary=summary, paths=paths, drift=found, invocation=invocation)


if __name__ == "__main__":
    main()
