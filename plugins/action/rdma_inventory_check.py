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

The first check of a run also looks for ``rdma_*``/``plugin_*`` variables that no role declares (every
entry point of every roles/*/meta/argument_specs.yml, read at run time): a misspelt name is silently
unused, so it is named with the closest declared one (difflib); rdma_unknown_variables says whether that
warns, fails or is ignored. Facts and registered results (the variable manager's fact caches) are not
inventory variables and are left out.
"""

from __future__ import annotations

import difflib
import glob
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
from ansible_collections.lingjun.rdma.plugins.modules.rdma_local_plugin import STATE_FILE
from ansible_collections.lingjun.rdma.plugins.plugin_utils.rdma_hosts import MISSING, Hosts

# The collection root (realpath: playbooks/collections links back to this checkout's plugins/ and roles/)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(__file__))))
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


PREFIXES = ("rdma_", "plugin_")


def known_variables():
    """Every option of every entry point of every role's argument spec (the declared variables)."""
    names = set()
    for path in sorted(glob.glob(os.path.join(ROOT, "roles", "*", "meta", "argument_specs.yml"))):
        with open(path, encoding="utf-8") as fh:
            for entry in ((yaml.safe_load(fh) or {}).get("argument_specs") or {}).values():
                names.update((entry or {}).get("options") or {})
    return names


def unknown_variables(names_by_where, known):
    """One line per undeclared rdma_*/plugin_* variable: where it is set and the closest declared name.
    ``names_by_where`` maps each variable name to the hosts (or "-e") that set it."""
    out = []
    for name in sorted(names_by_where):
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.75)
        out.append(
            "%s (%s) is not a variable of any lingjun.rdma role, so nothing reads it.%s"
            % (name, names_by_where[name], " Did you mean %s?" % close[0] if close else "")
        )
    return out


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
        values = Hosts(task_vars, self._templar)
        agree = dict(
            (name, self._templar.template(task_vars.get(name)) if name in task_vars else None)
            for name in args.get("agree") or []
        )
        first = not checked  # the run's first check: the inventory and -e are the same for every later one
        local = self._templar.template(task_vars.get("rdma_deploy_target")) == "local"
        known = known_variables() if first else set()
        groups, odd, unknown, local_dirs = {}, {}, {}, set()
        for host in hosts:  # one pass: a merge of each host's variables (Hosts keeps the last host's)
            got = {}
            for name in specs:
                value = values.get(host, name)
                if value is not MISSING:
                    got[name] = value
            key = json.dumps(got, sort_keys=True, default=str)
            groups.setdefault(key, ([], got))[0].append(host)
            for name, mine in agree.items():
                theirs = values.get(host, name)
                if theirs is not MISSING and json.dumps(theirs, sort_keys=True, default=str) != json.dumps(
                    mine, sort_keys=True, default=str
                ):
                    odd.setdefault(name, {}).setdefault(json.dumps(theirs, sort_keys=True, default=str), []).append(host)
            if first:
                facts = self._facts(host)
                for name in values.raw(host):
                    if name.startswith(PREFIXES) and name not in known and name not in extra and name not in facts:
                        unknown.setdefault(name, []).append(host)
            if local:
                local_dirs.add(str(values.get(host, "rdma_local_dir", None) or ""))
        if not hosts:  # a play without node hosts: the controller's own values (-e, group all, defaults)
            got = dict((n, self._templar.template(task_vars[n])) for n in specs if n in task_vars)
            groups[json.dumps(got, sort_keys=True, default=str)] = (["the controller"], got)
        found = []
        for name, mine in agree.items():
            for value, who in sorted(odd.get(name, {}).items()):
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
        warnings = []
        if first:
            unknown = self._unknown(unknown, extra, known, len(hosts))
            mode = str(self._templar.template(task_vars.get("rdma_unknown_variables", "warn")))
            if unknown and mode == "fail":
                found += [u.rstrip(".") + " (rdma_unknown_variables=fail)" for u in unknown]
            elif unknown and mode != "ignore":
                warnings += [
                    u + " Fix the name in the inventory or -e (rdma_unknown_variables=fail refuses to run, "
                    "=ignore silences this)." for u in unknown
                ]
        done = sorted(set(checked) | set(args.get("roles") or []))
        result.update(changed=False, ansible_facts={"rdma_inventory_checked": done})
        if warnings:
            result["warnings"] = warnings
        states = self._local_states(local, local_dirs, hosts, task_vars)
        if states:  # the stdout callback names what still runs if the run is interrupted
            result["rdma_local_state"] = states
        if self._checkout_config_ignored(task_vars):
            result.setdefault("warnings", []).append(self._checkout_config_ignored(task_vars))
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

    def _local_states(self, local, dirs, hosts, task_vars):
        """The state files of the local target's processes (rdma_local_plugin's, in <rdma_local_dir>/run as
        roles/plugin_deploy/vars/main.yml puts them); rdma_deploy_target agrees on every host. ``dirs``:
        the hosts' rdma_local_dir ("" where unset)."""
        if not local:
            return []
        mine = self._templar.template(task_vars.get("rdma_local_dir")) if "rdma_local_dir" in task_vars else None
        dirs = set(d or str(mine or "") for d in dirs) if hosts else {str(mine or "")}
        return sorted(os.path.join(d, "run", STATE_FILE) for d in dirs if d)

    def _facts(self, host):
        """The names of the host's facts and registered results (the variable manager's fact caches): they
        are not inventory variables."""
        manager = self._task.get_variable_manager()
        facts = set()
        for cache in ("_fact_cache", "_nonpersistent_fact_cache"):
            try:
                facts.update(getattr(manager, cache)[host] or {})
            except (AttributeError, KeyError, TypeError):
                pass
        return facts

    def _unknown(self, where, extra, known, total):
        """One line per undeclared rdma_*/plugin_* variable, from -e or the hosts (``where``: name -> hosts)."""
        named = dict((n, "set for " + self._hosts_text(w, total)) for n, w in where.items())
        for name in extra:
            if name.startswith(PREFIXES) and name not in known:
                named[name] = "from -e"
        return unknown_variables(named, known)

    @staticmethod
    def _checkout_config_ignored(task_vars):
        """Run from a checkout of the repository without its ansible.cfg (another working directory): the
        playbooks work (playbooks/roles and playbooks/collections link back), the output settings do not."""
        config = os.path.join(ROOT, "ansible.cfg")
        used = task_vars.get("ansible_config_file") or ""
        if not os.path.isfile(config) or (used and os.path.realpath(used) == os.path.realpath(config)):
            return ""
        return (
            "this checkout's ansible.cfg (%s) is not in effect (%s), so its output and connection settings are not "
            "either; run from the repository root (cd %s) or export ANSIBLE_CONFIG=%s"
            % (config, "ansible.cfg in use: %s" % used if used else "no ansible.cfg in use", ROOT, config)
        )

    @staticmethod
    def _hosts_text(host_list, total):
        if len(host_list) == total and total > 1:
            return "every host"
        shown = ", ".join(host_list[:3])
        return "host%s %s%s" % ("s" if len(host_list) > 1 else "", shown, " and %d more" % (len(host_list) - 3) if len(host_list) > 3 else "")
