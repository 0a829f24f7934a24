# Copyright: rdma-device-plugin maintainers; Apache-2.0
"""Controller side of lingjun.rdma.rdma_inventory_check: every typed value of every host, once, before
any node is read.

The roles' meta/argument_specs.yml are the source of truth; this checks the values every inventory
host gives (group_vars, host_vars and -e, as Ansible resolves them) against the specs of the roles a
playbook runs, once per distinct set of values (2000 hosts sharing group_vars cost one check), plus
the few checks a spec cannot say (absolute node roots, positive expectations), and that the node
hosts resolve the cluster-wide variables (``agree``: deploy target, kubeconfig, release) as the
controller does, since the controller plays act on the controller's values. Every problem is listed
in one failure that names the variable, the value, where it comes from (-e or the hosts) and the
fix; nothing has touched a node or the cluster yet.
"""

from __future__ import annotations

import json
import os

import yaml
from ansible.errors import AnsibleActionFail
from ansible.module_utils.common.validation import (
    check_type_bool,
    check_type_dict,
    check_type_float,
    check_type_int,
    check_type_list,
)
from ansible.plugins.action import ActionBase
from ansible_collections.lingjun.rdma.plugins.module_utils.rdma_node import healthchecks
from ansible_collections.lingjun.rdma.plugins.plugin_utils.rdma_hosts import MISSING, Hosts, differing

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ABSOLUTE = ("rdma_sysfs_root", "rdma_procfs_root", "rdma_dev_root")
POSITIVE = ("rdma_nic_validate_expected_nics", "rdma_nic_validate_rate_gbps", "rdma_shared_devices")
# rdma_nic_validate variable -> rdma_node_info option whose range healthchecks.Expectations checks (the
# module's own check, so a node never sees a value the controller let through).
HEALTH = dict(
    ("rdma_nic_validate_" + option, option)
    for option in ("mtu", "roce_mtu", "bond_mode", "roce_trust", "pfc_priority", "counter_max", "counter_interval",
                   "nccl_addr_family", "perftest_min_percent", "perftest_seconds")
)
CONVERT = {"int": check_type_int, "float": check_type_float, "dict": check_type_dict, "str": str}
SAMPLES = {"int": "4", "float": "200", "bool": "true", "list": '\'{"%s": ["a", "b"]}\'', "dict": '\'{"%s": {"k": "v"}}\''}


def role_spec(role, entry="main"):
    path = os.path.join(ROOT, "roles", role, "meta", "argument_specs.yml")
    try:
        with open(path, encoding="utf-8") as fh:
            specs = yaml.safe_load(fh)["argument_specs"]
    except (OSError, KeyError, TypeError) as exc:
        raise AnsibleActionFail("rdma_inventory_check: cannot read the argument spec of role %s (%s): %s" % (role, path, exc))
    if entry not in specs:
        raise AnsibleActionFail("rdma_inventory_check: role %s has no entry point %s in %s" % (role, entry, path))
    return specs[entry].get("options") or {}


def _example(name, kind):
    text = SAMPLES.get(kind, "...")
    return "-e " + (text % name if "%s" in text else "%s=%s" % (name, text))


def problems(name, spec, value):
    """What is wrong with ``value`` for option ``spec`` (empty when nothing)."""
    kind = spec.get("type", "str")
    if value is None:
        return [] if not spec.get("required") else ["%s is required" % name]
    try:
        if kind == "int":
            if isinstance(value, bool):
                raise TypeError
            value = check_type_int(value.strip() if isinstance(value, str) else value)
        elif kind == "float":
            if isinstance(value, bool):
                raise TypeError
            value = check_type_float(value)
        elif kind == "bool":
            value = check_type_bool(value)
        elif kind == "list":
            value = check_type_list(value)
        elif kind == "dict":
            value = check_type_dict(value)
        elif kind in ("str", "path") and not isinstance(value, str):
            if isinstance(value, (dict, list)):
                raise TypeError
            value = str(value)
    except (TypeError, ValueError):
        noun = {"int": "a whole number", "float": "a number", "bool": "a boolean (true or false)", "list": "a list",
                "dict": "a mapping", "str": "a string", "path": "a path"}.get(kind, kind)
        return ["%s=%s is not %s; e.g. %s" % (name, json.dumps(value, default=str), noun, _example(name, kind))]
    out = []
    choices = spec.get("choices")
    if choices:
        items = value if kind == "list" else [value]
        bad = [v for v in items if v not in choices]
        if bad:
            out.append("%s=%s must be one of: %s" % (name, json.dumps(value), ", ".join(str(c) for c in choices if c is not None)))
    if kind == "list" and spec.get("elements") and not choices:
        sub = {"type": spec["elements"]}
        for i, item in enumerate(value):
            out += problems("%s[%d]" % (name, i), sub, item)
    if kind == "dict" and spec.get("options"):
        for key, item in value.items():
            if key not in spec["options"]:
                out.append("%s has the unknown key %s; the keys are %s" % (name, key, ", ".join(spec["options"])))
            elif item is not None:
                out += problems("%s.%s" % (name, key), spec["options"][key], item)
    if name in ABSOLUTE and not os.path.isabs(value):
        out.append("%s=%s is not an absolute path" % (name, value))
    if name in POSITIVE and isinstance(value, (int, float)) and value <= 0:
        out.append("%s=%s must be positive (or null: not checked)" % (name, value))
    return out


def health_problems(specs, got):
    """(variable, problem) for the first node-health value out of its range; none while a type is wrong
    (problems() names that)."""
    kwargs = {}
    for name, option in HEALTH.items():
        if name not in specs or got.get(name) is None:
            continue
        try:
            value = CONVERT[specs[name].get("type", "str")](got[name])
        except (TypeError, ValueError):
            return []
        if option == "counter_max":
            value = dict((k, _count(v)) for k, v in value.items())
        kwargs[option] = value
    try:
        healthchecks.Expectations(**kwargs)
    except ValueError as exc:
        option = str(exc).split(" ", 1)[0].split(".", 1)[0]
        name = "rdma_nic_validate_" + option
        return [(name, "rdma_nic_validate_%s; set %s in the inventory or with -e" % (exc, name))]
    return []


def _count(value):
    try:
        return check_type_int(value) if not isinstance(value, bool) else value
    except TypeError:
        return value


class ActionModule(ActionBase):
    _supports_check_mode = True

    def run(self, tmp=None, task_vars=None):
        result = super().run(tmp, task_vars)
        args = self._task.args
        hosts = list(args.get("hosts") or [])
        checked = list(task_vars.get("rdma_inventory_checked") or [])
        specs = {}
        for role in args.get("roles") or []:
            if role not in checked:
                specs.update(role_spec(role))
        specs.update(args.get("options") or {})
        extra = self._task.get_variable_manager().extra_vars if self._task.get_variable_manager() else {}
        values = Hosts(task_vars)
        groups = {}
        for host in hosts:
            got = {}
            for name in specs:
                value = values.get(host, name)
                if value is not MISSING:
                    got[name] = value
            key = json.dumps(got, sort_keys=True, default=str)
            groups.setdefault(key, ([], got))[0].append(host)
        if not hosts:  # a play without node hosts: the controller's own values (-e, group all, defaults)
            got = dict((n, self._templar.template(task_vars[n])) for n in specs if n in task_vars)
            groups[json.dumps(got, sort_keys=True, default=str)] = (["the controller"], got)
        found = []
        for name in args.get("agree") or []:
            mine = self._templar.template(task_vars.get(name)) if name in task_vars else None
            for value, who in sorted(differing(values, hosts, name, mine).items()):
                found.append(
                    "%s=%s on %s, but %s on the controller, whose plays act for the whole cluster (set it in "
                    "group_vars/all.yml or with -e, not per host or node group)"
                    % (name, value, self._hosts_text(who, len(hosts)), mine if mine not in (None, "") else '""')
                )
        for host_list, got in groups.values():
            for name in sorted(got):
                for problem in problems(name, specs[name], got[name]):
                    where = "from -e" if name in extra else self._hosts_text(host_list, len(hosts))
                    found.append("%s (%s)" % (problem, where))
            for name, problem in health_problems(specs, got):
                where = "from -e" if name in extra else self._hosts_text(host_list, len(hosts))
                found.append("%s (%s)" % (problem, where))
        done = sorted(set(checked) | set(args.get("roles") or []))
        result.update(changed=False, ansible_facts={"rdma_inventory_checked": done})
        if found:
            unique = list(dict.fromkeys(found))
            result.update(
                failed=True,
                problems=unique,
                msg="invalid inventory values, nothing was read or changed: %s. Fix them in the inventory "
                "(group_vars/host_vars) or on the command line; the roles' meta/argument_specs.yml say what each "
                "variable takes." % "; ".join(unique),
            )
        else:
            result["msg"] = "%d host(s), %d distinct set(s) of values: every typed value is valid" % (len(hosts), len(groups))
        return result

    @staticmethod
    def _hosts_text(host_list, total):
        if len(host_list) == total and total > 1:
            return "every host"
        shown = ", ".join(host_list[:3])
        return "host%s %s%s" % ("s" if len(host_list) > 1 else "", shown, " and %d more" % (len(host_list) - 3) if len(host_list) > 3 else "")
