# Copyright: rdma-device-plugin maintainers; Apache-2.0
"""The arguments of the one node read from the role variables.

Shared by the rdma_node_info action plugin and bench/fleet.py's stand-in for it. The mapping is Python
rather than a Jinja template on the task: ansible-core compiles a task's templates again in every host's
worker (nothing compiled survives into the fork), which cost validate's controller about 0.04 s of CPU a
host against ping's 0.09 s in all. Typed variables go through the converters every role uses (filter
``rdma_bool`` / ``rdma_int``, the argument specs' spellings); a None value is left out (the module's
default: for the optional checks, not checked).

Two callers: the role's own read (roles/rdma_nic_validate/tasks/read.yml: the role's variables are in the
task's), and playbooks/validate.yml's node play, which imports no role (each import_role costs every host
variable merges in Ansible's main process): there :class:`RoleVariables` layers the validation roles'
defaults and vars under the host's variables, as the imports did, and templates only the values that
are templates.
"""

from __future__ import annotations

import json
import os
from collections import ChainMap

from ansible import constants as C
from ansible.template import trust_as_template
from ansible_collections.lingjun.rdma.plugins.filter.rdma_typed import (
    rdma_bool,
    rdma_int,
)

# The collection root (realpath: playbooks/collections links back to this checkout's roles/)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(__file__))))
ROLES = ("rdma_node_facts", "rdma_nic_validate", "ipv6_compute_validate")  # what validate.yml reads with


def role_args(templar, task_vars):
    """``read_args`` over the task's variables, each templated (role defaults may be templates)."""
    return read_args(lambda name: templar.template(task_vars[name]), task_vars.__contains__)


def fails_on_read_error(templar, task_vars):
    """A failed read fails the role's own read only with rdma_validation_fail (its default)."""
    return rdma_bool(templar.template(task_vars["rdma_validation_fail"]), "rdma_validation_fail")


def _is_template(value):
    if isinstance(value, str):
        return "{{" in value or "{%" in value
    if isinstance(value, dict):
        return any(_is_template(v) for v in value.values())
    if isinstance(value, list):
        return any(_is_template(v) for v in value)
    return False


def _trusted(value):
    """JSON's values with their templates trusted again, as a role's own files are."""
    if isinstance(value, str):
        return trust_as_template(value) if _is_template(value) else value
    if isinstance(value, dict):
        return dict((k, _trusted(v)) for k, v in value.items())
    if isinstance(value, list):
        return [_trusted(v) for v in value]
    return value


def role_layers(loader):
    """(defaults, vars) of ROLES. Parsed once per run: the first worker keeps them as JSON in the run's
    local temporary directory (ansible-playbook's own, the same for every worker), the others read that
    (Ansible's YAML loader cost each host's worker about 3.5 ms)."""
    cache = os.path.join(C.DEFAULT_LOCAL_TMP, "rdma-role-variables.json")
    try:
        with open(cache, encoding="utf-8") as fh:
            defaults, role_vars = json.load(fh)
        return _trusted(defaults), _trusted(role_vars)
    except (OSError, ValueError):
        pass
    defaults, role_vars = {}, {}
    for role in ROLES:
        for sub, layer in (("defaults", defaults), ("vars", role_vars)):
            path = os.path.join(ROOT, "roles", role, sub, "main.yml")
            if os.path.exists(path):
                # trusted: a role's own files may hold templates, as Ansible's role loading takes them
                layer.update(loader.load_from_file(path, cache="none", unsafe=True, trusted_as_template=True) or {})
    try:
        partial = "%s.%d" % (cache, os.getpid())
        with open(partial, "w", encoding="utf-8") as fh:
            json.dump([defaults, role_vars], fh)
        os.replace(partial, cache)
    except (OSError, TypeError, ValueError):
        pass  # not kept: the next worker parses them again
    return defaults, role_vars


class RoleVariables(object):
    """The host's variables over the validation roles' defaults and vars (ROLES), as ``import_role`` of
    them gives a task: the defaults below everything the host sets, the roles' vars (internal names only)
    beside them. ``value(name)`` templates a value only when it is a template."""

    def __init__(self, loader, templar, task_vars):
        defaults, role_vars = role_layers(loader)
        self._all = ChainMap(task_vars, role_vars, defaults)
        self._templar = templar.copy_with_new_env(available_variables=self._all)

    def defined(self, name):
        return name in self._all

    def raw(self, name):
        return self._all.get(name)

    def value(self, name):
        value = self._all[name]
        return self._templar.template(value) if _is_template(value) else value


def read_args(var, defined, fleet=False):
    """The module arguments of the one node read from the role variables: ``var(name)`` is the variable's
    templated value, ``defined(name)`` whether it is set. A None value is left out: the module's default
    (for the optional checks: not checked). ``fleet``: validate.yml's read, which records the host's
    findings as its rdma_validation fact (``record_host``)."""

    def opt(name):
        return var(name) if defined(name) else None

    def flag(name):
        return rdma_bool(var(name), name)

    def number(name):
        return rdma_int(var(name), name)

    non_host_network = flag("rdma_non_host_network")
    gid_index = var("rdma_nic_validate_nccl_gid_index")
    if gid_index is not None:
        gid_index = number("rdma_nic_validate_nccl_gid_index")
    else:  # the chart's env, as the deploy would set it (NCCL then uses that index on every NIC)
        gid_index = ((opt("plugin_deploy_extra_values") or {}).get("env") or {}).get("NCCL_IB_GID_INDEX")
    ipc_lock = var("rdma_nic_validate_pods_ipc_lock")
    if ipc_lock is not None:
        ipc_lock = flag("rdma_nic_validate_pods_ipc_lock")
    else:  # the admission policy, when it denies, makes every RDMA pod ask for IPC_LOCK
        policy = flag("rdma_admission_policy_enabled") if defined("rdma_admission_policy_enabled") else True
        actions = (
            var("rdma_admission_policy_validation_actions")
            if defined("rdma_admission_policy_validation_actions")
            else ["Deny"]
        )
        ipc_lock = policy and "Deny" in actions
    args = {
        "sysfs_root": var("rdma_sysfs_root"),
        "procfs_root": var("rdma_procfs_root"),
        "dev_root": var("rdma_dev_root"),
        "selectors": var("rdma_selectors"),
        "modules": var("rdma_nic_validate_modules"),
        "version_module": var("rdma_nic_validate_version_module"),
        "min_driver_version": var("rdma_nic_validate_min_driver_version") or None,
        "expected_nics": number("rdma_nic_validate_expected_nics") or None,
        "compute_nics": var("rdma_nic_validate_compute_nics"),
        "compute_link_types": var("rdma_nic_validate_compute_link_types"),
        "compute_networks": var("rdma_nic_validate_compute_networks"),
        "link_layer": var("rdma_nic_validate_link_layer") or None,
        "rate_gbps": var("rdma_nic_validate_rate_gbps") or None,
        "min_fw_version": var("rdma_nic_validate_min_fw_version") or None,
        "fw_consistent": flag("rdma_nic_validate_fw_consistent"),
        "ipv6_netns_mode": opt("ipv6_compute_validate_netns_mode"),
        "ipv6_roce_v2_gid": flag("ipv6_compute_validate_roce_v2_gid")
        if defined("ipv6_compute_validate_roce_v2_gid")
        else None,
        "record_host": var("inventory_hostname") if fleet else None,
        "ipv6_record": non_host_network
        or (defined("ipv6_compute_validate_force") and flag("ipv6_compute_validate_force")),
        "health": flag("rdma_nic_validate_health"),
        "health_record": True,
        "host_root": opt("rdma_nic_validate_host_root") or None,
        "skip_checks": var("rdma_nic_validate_skip_checks"),
        "fail_not_checked": flag("rdma_nic_validate_fail_not_checked"),
        "mtu": number("rdma_nic_validate_mtu") or None,
        "roce_mtu": number("rdma_nic_validate_roce_mtu"),
        "bond_mode": var("rdma_nic_validate_bond_mode") or None,
        "roce_trust": var("rdma_nic_validate_roce_trust"),
        "pfc_priority": number("rdma_nic_validate_pfc_priority"),
        "counter_max": var("rdma_nic_validate_counter_max"),
        "counter_watch": var("rdma_nic_validate_counter_watch"),
        "counter_interval": var("rdma_nic_validate_counter_interval"),
        "counter_window": opt("rdma_nic_validate_counter_window"),
        "counter_baseline_dir": (f"{var('rdma_validation_report_dir')}/counters")
        if flag("rdma_nic_validate_counter_baseline")
        else None,
        "nccl_addr_family": var("rdma_nic_validate_nccl_addr_family") or ("AF_INET6" if non_host_network else "auto"),
        "nccl_gid_index": gid_index,
        "ipc_lock": ipc_lock,
        "topology_expected": var("rdma_nic_validate_topology_expected") or None,
        "gpudirect_required": flag("rdma_nic_validate_gpudirect_required"),
        "perftest": flag("rdma_nic_validate_perftest"),
        "perftest_min_percent": var("rdma_nic_validate_perftest_min_percent"),
        "perftest_seconds": number("rdma_nic_validate_perftest_seconds"),
        "perftest_command": var("rdma_nic_validate_perftest_command"),
    }
    return {key: value for key, value in args.items() if value is not None}
