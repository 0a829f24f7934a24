# Copyright: rdma-device-plugin maintainers; Apache-2.0
"""Controller side of the lingjun.rdma action plugins: every inventory host's values, read in Python.

The cluster plays run once on the controller and need a few values of every node host (its
Kubernetes node name, its validation facts, its NIC count). Reading them here, from the variable
manager's stored values (``HostVars.raw_get``, ansible-core lib/ansible/vars/hostvars.py), costs one
lookup per host; a Jinja loop over ``hostvars`` templated every host's whole namespace instead.
A value that is itself a template (``rdma_k8s_node_name: "{{ inventory_hostname }}.example"``) is
templated with that host's variables: over the stored values already read when a templar is given (no
second merge of the host's variables), else through ``hostvars``.
"""

from __future__ import annotations

import json
import os

MISSING = object()
INVENTORY_HOSTNAME = "{{inventory_hostname}}"  # a template that is the host's own name (spaces removed)


def _is_template(value):
    return isinstance(value, str) and ("{{" in value or "{%" in value)


class Hosts(object):
    """Values of the hosts of one run, from ``task_vars['hostvars']``."""

    def __init__(self, task_vars, templar=None):
        self.hostvars = task_vars["hostvars"]
        self._templar = templar
        self._last = (None, None)  # one host's variables at a time: 5000 hosts' facts would not fit twice

    def raw(self, host):
        if self._last[0] != host:
            self._last = (host, self.hostvars.raw_get(host))
        return self._last[1]

    def get(self, host, name, default=MISSING):
        raw = self.raw(host)
        if name not in raw:
            return default
        value = raw[name]
        if _is_template(value):  # templated with the host's own variables
            if self._templar is None:
                return self.hostvars[host][name]
            return self._templar.copy_with_new_env(available_variables=raw).template(value)
        return value

    def node_name(self, host):
        raw = self.raw(host).get("rdma_k8s_node_name")
        if isinstance(raw, str) and raw.replace(" ", "") == INVENTORY_HOSTNAME:
            # rdma_node_facts' default: the host's name, without templating the host's whole namespace (a
            # second variable merge per host; the report and the labels ask it of every host, once per run)
            return host
        value = self.get(host, "rdma_k8s_node_name", None)
        return str(value) if value else host


def differing(values, hosts, name, mine):
    """{value: [hosts]} of the hosts whose ``name`` (as they resolve it) differs from ``mine``."""
    want = json.dumps(mine, sort_keys=True, default=str)
    odd = {}
    for host in hosts:
        theirs = values.get(host, name)
        if theirs is not MISSING and json.dumps(theirs, sort_keys=True, default=str) != want:
            odd.setdefault(json.dumps(theirs, sort_keys=True, default=str), []).append(host)
    return odd


def read_report(path):
    """The nodes of a previous validation report (``rdma-validation.json``), {} when there is none."""
    try:
        with open(path, encoding="utf-8") as fh:
            return (json.load(fh) or {}).get("nodes") or {}
    except (OSError, ValueError):
        return {}


def nic_count(hosts, host, report_nodes):
    """The host's NIC count for the exclusive shape, where it comes from, and a conflict ('' when none):
    this run's validation facts, else the inventory's last validation report, else rdma_nic_count, else
    rdma_nic_validate_expected_nics. A counted node wins over rdma_nic_count (it is what the plugin
    advertises); an rdma_nic_count that says otherwise is reported, not silently dropped."""
    counted, source = None, ""
    fact = hosts.get(host, "rdma_validation", None)
    entry = report_nodes.get(host) or {}
    if isinstance(fact, dict) and fact.get("validated") and (fact.get("summary") or {}).get("nic_count"):
        counted, source = int(fact["summary"]["nic_count"]), "validated in this run"
    elif entry.get("validated") and (entry.get("summary") or {}).get("nic_count"):
        counted, source = int(entry["summary"]["nic_count"]), "validated on %s" % entry.get("validated_on", "?")
    given = hosts.get(host, "rdma_nic_count", None)
    if counted is not None:
        if given not in (None, "", MISSING) and int(given) != counted:
            return counted, source, (
                "rdma_nic_count=%s for %s, but its node has %d NICs (%s): %d is expected. Fix rdma_nic_count or "
                "remove it (the validation counts the NICs)" % (given, host, counted, source, counted)
            )
        return counted, source, ""
    for name in ("rdma_nic_count", "rdma_nic_validate_expected_nics"):
        value = hosts.get(host, name, None)
        if value not in (None, "", MISSING):
            return int(value), name, ""
    return None, "", ""


def report_path(report_dir):
    return os.path.join(report_dir, "rdma-validation.json")
