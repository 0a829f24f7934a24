# Copyright: rdma-device-plugin maintainers; Apache-2.0
"""Fleet logic shared by the modules, action plugins and filters of lingjun.rdma (pure, standard library).

- Kubernetes quantities as node status shows extended resources (``1k`` = 1000);
- rollout arithmetic of a DaemonSet with ``maxUnavailable`` (waves, deadlines);
- the verdict of one node from what the API shows (verify, mode switch);
- the fleet rollup of the validation report (counts, top failing checks, version spreads).
"""

from __future__ import annotations

import math
import re

# The defaults of the modules (the roles pass rdma_validated_label_key, rdma_mode_label_key): the node
# labels under node-restriction.kubernetes.io/, which no kubelet may set on its own Node, and the
# annotation validate writes (the chart's validation.required matches the label).
VALIDATED_LABEL = "node-restriction.kubernetes.io/rdma-validated"
MODE_LABEL = "node-restriction.kubernetes.io/rdma-mode"
DRIVER_LABEL = "node-restriction.kubernetes.io/rdma-driver"
VALIDATED_AT_ANNOTATION = "rdma.lingjun.io/validated-at"
MODES = ("shared", "exclusive")

_DECIMAL = (("E", 10**18), ("P", 10**15), ("T", 10**12), ("G", 10**9), ("M", 10**6), ("k", 10**3))
_BINARY = (("Ei", 2**60), ("Pi", 2**50), ("Ti", 2**40), ("Gi", 2**30), ("Mi", 2**20), ("Ki", 2**10))


def format_quantity(n):
    """Canonical DecimalSI form of a count: the largest suffix that divides it exactly (1000 -> 1k)."""
    n = int(n)
    for suffix, factor in _DECIMAL:
        if n and n % factor == 0:
            return "%d%s" % (n // factor, suffix)
    return str(n)


def parse_quantity(text):
    """A whole-number quantity (``1k``, ``4``, ``1Ki``) as int; None when absent or not a count."""
    if text is None:
        return None
    text = str(text).strip()
    for suffix, factor in _BINARY + _DECIMAL:
        if text.endswith(suffix) and text[: -len(suffix)].isdigit():
            return int(text[: -len(suffix)]) * factor
    return int(text) if text.isdigit() else None


# --- rollout -------------------------------------------------------------------------------------------


def max_unavailable_nodes(value, nodes):
    """Nodes a DaemonSet rolling update takes down at once: an int, or a percentage of the nodes rounded
    up (apps/v1 DaemonSetSpec: "Absolute number is calculated from percentage by rounding up"), at least 1."""
    text = str(value).strip()
    m = re.fullmatch(r"(\d+)%", text)
    if m:
        count = math.ceil(int(m.group(1)) * nodes / 100.0)
    elif text.isdigit():
        count = int(text)
    else:
        raise ValueError("maxUnavailable %r is neither a whole number nor a percentage like 10%%" % (value,))
    return max(1, count)


def rollout_waves(nodes, max_unavailable):
    """How many batches a rolling update of ``nodes`` pods takes."""
    if nodes <= 0:
        return 0
    return int(math.ceil(nodes / float(max_unavailable_nodes(max_unavailable, nodes))))


def rollout_seconds(nodes, max_unavailable, base, per_wave):
    """A deadline that scales with the fleet: ``base`` + ``per_wave`` for every rollout wave."""
    return float(base) + float(per_wave) * rollout_waves(nodes, max_unavailable)


# --- verdicts --------------------------------------------------------------------------------------------


class Want(object):
    """What one inventory host's node must advertise."""

    def __init__(self, host, node, nics=None, nics_source=""):
        self.host = host
        self.node = node
        self.nics = nics
        self.nics_source = nics_source


class Verdict(object):
    def __init__(self, ok, msg, final, mode=None, expected=None):
        self.ok = ok
        self.msg = msg
        self.final = final  # waiting longer cannot change it (no node, unknown shape, bad label)
        self.mode = mode
        self.expected = expected

    def to_dict(self):
        return {"ok": self.ok, "msg": self.msg, "final": self.final, "mode": self.mode, "expected": self.expected}


class Cluster(object):
    """Settings of one release that every verdict uses."""

    def __init__(
        self,
        resource="rdma/hca",
        mode_label_key=MODE_LABEL,
        default_mode="shared",
        shared_devices=1000,
        release="rdma",
        namespace="kube-system",
        validation_required=False,
        report="",
        selector="",
        validated_label_key=VALIDATED_LABEL,
    ):
        self.resource = resource
        self.mode_label_key = mode_label_key
        self.default_mode = default_mode
        self.shared_devices = int(shared_devices)
        self.release = release
        self.namespace = namespace
        self.validation_required = validation_required
        self.report = report
        self.selector = selector
        self.validated_label_key = validated_label_key


def _shown(value):
    return "(absent)" if value is None else value


def verdict(want, seen, cluster):
    """The verdict of one node from its compact API view ``seen`` ({mode, capacity, allocatable,
    validated, unschedulable}; None when the node is not in the list)."""
    node, res = want.node, cluster.resource
    named = node if want.host == node else "%s (inventory host %s)" % (node, want.host)
    if seen is None:
        narrowed = " or lacks the labels %s" % cluster.selector if cluster.selector else ""
        return Verdict(
            False,
            "node %s is not in the cluster%s. Next: set rdma_k8s_node_name for inventory host %s to its Kubernetes "
            "node name (kubectl get nodes)." % (named, narrowed, want.host),
            final=True,
        )
    mode = seen.get("mode") or cluster.default_mode
    if mode not in MODES:
        return Verdict(
            False,
            "node %s has %s=%s, which is neither shared nor exclusive. Next: playbooks/switch-mode.yml -e "
            "'{\"rdma_switch_nodes\": [\"%s\"], \"rdma_switch_to\": \"shared\"}'" % (named, cluster.mode_label_key, mode, node),
            final=True,
            mode=mode,
        )
    if mode == "shared":
        expected, why = cluster.shared_devices, "sharedDevices"
    else:
        if not want.nics:
            return Verdict(
                False,
                "node %s is in exclusive mode (%s) and its NIC count is unknown. Next: validate it "
                "(playbooks/validate.yml, whose report gives the count) or set rdma_nic_count for it "
                "(or rdma_nic_validate_expected_nics)." % (named, cluster.mode_label_key),
                final=True,
                mode=mode,
            )
        expected, why = int(want.nics), "one per NIC, %s" % want.nics_source if want.nics_source else "one per NIC"
    cap, alloc = seen.get("capacity"), seen.get("allocatable")
    q = format_quantity(expected)
    # Gating keeps the plugin off a node not labelled validated: waiting cannot change that.
    gated = cluster.validation_required and seen.get("validated") != "true" and cap is None
    if parse_quantity(cap) == expected and parse_quantity(alloc) == expected:
        return Verdict(
            True,
            "node %s (%s mode) advertises %s capacity %s, allocatable %s (%s)" % (named, mode, res, cap, alloc, why),
            final=True,
            mode=mode,
            expected=expected,
        )
    return Verdict(
        False,
        "node %s (%s mode) shows capacity %s=%s, allocatable %s=%s; expected %s for both (%s). Next: %s"
        % (named, mode, res, _shown(cap), res, _shown(alloc), q, why, _next_step(want, seen, cluster, expected)),
        final=gated,
        mode=mode,
        expected=expected,
    )


def _next_step(want, seen, cluster, expected):
    node, ns, rel = want.node, cluster.namespace, cluster.release
    pods = "kubectl -n %s get pods -l app.kubernetes.io/instance=%s -o wide --field-selector spec.nodeName=%s" % (
        ns,
        rel,
        node,
    )
    cap = parse_quantity(seen.get("capacity"))
    validated = seen.get("validated")
    # A kubelet keeps a resource whose plugin went in its Node status: allocatable 0 at once, capacity
    # for the device manager's grace period (5 minutes), then 0; it never removes the key (the real
    # node shows it, tests/node). So 0, like absent, means no plugin serves it.
    if cap is None or cap == 0:
        if cluster.validation_required and validated != "true":
            key = cluster.validated_label_key
            state = "%s=%s" % (key, validated) if validated is not None else "no %s label" % key
            where = " (see %s)" % cluster.report if cluster.report else ""
            return (
                "the node is not validated (%s), so validation.required keeps the plugin off it: fix its "
                "findings%s and run playbooks/validate.yml." % (state, where)
            )
        return "no plugin pod advertises the resource there: is it running? %s" % pods
    if cap == expected:
        return (
            "allocatable below capacity means a NIC port left ACTIVE, a NIC vanished, or the plugin stopped (the "
            "kubelet keeps its capacity for 5 minutes): kubectl -n %s exec <the plugin pod on %s> -- "
            "rdma-device-plugin status (%s)." % (ns, node, pods)
        )
    return (
        "the plugin there advertises another shape: check the node's %s label and the chart values "
        "(mode, sharedDevices, selectors) of release %s, then the plugin pod (%s)." % (cluster.mode_label_key, rel, pods)
    )


def node_view(node, resource, mode_label_key, validated_label_key=VALIDATED_LABEL):
    """The few fields of a Node object a verdict needs (what the module returns per node)."""
    meta = node.get("metadata") or {}
    labels = meta.get("labels") or {}
    status = node.get("status") or {}
    return {
        "mode": labels.get(mode_label_key),
        "capacity": (status.get("capacity") or {}).get(resource),
        "allocatable": (status.get("allocatable") or {}).get(resource),
        "validated": labels.get(validated_label_key),
        "unschedulable": bool((node.get("spec") or {}).get("unschedulable")),
    }


def daemonset_view(ds):
    meta = ds.get("metadata") or {}
    status = ds.get("status") or {}
    return {
        "name": meta.get("name"),
        "generation": int(meta.get("generation") or 0),
        "observed": int(status.get("observedGeneration") or 0),
        "desired": int(status.get("desiredNumberScheduled") or 0),
        "updated": int(status.get("updatedNumberScheduled") or 0),
        "ready": int(status.get("numberReady") or 0),
        "available": int(status.get("numberAvailable") or 0),
    }


def rolled_out(ds):
    return ds["observed"] >= ds["generation"] and ds["desired"] == ds["updated"] == ds["ready"] == ds["available"]


def rollout_text(daemonsets):
    if not daemonsets:
        return "no DaemonSet of the release"
    return ", ".join(
        "%s %d/%d updated, %d ready%s%s"
        % (
            d["name"],
            d["updated"],
            d["desired"],
            d["ready"],
            # Ready pods count as available only after the DaemonSet's minReadySeconds
            " (%d available)" % d["available"] if d["available"] < d["ready"] else "",
            "" if d["observed"] >= d["generation"] else " (not observed yet)",
        )
        for d in daemonsets
    )


# --- validation report rollup ----------------------------------------------------------------------------


class Facet(object):
    """One column of the fleet rollup: how many nodes show each value, and the odd ones out.

    ``get(entry)`` returns the node's value (a string, or a list of strings for per-NIC facts such as
    firmware); None when the node does not report it. ``check`` names the drift finding the odd nodes
    get (``drift_<fact>``; None: a column only) and ``fix`` says how to align them. Add a facet to
    FACETS to add a column."""

    def __init__(self, title, get, drift=True, check=None, fix=""):
        self.title = title
        self.get = get
        self.drift = drift
        self.check = check
        self.fix = fix


def _summary(key):
    def get(entry):
        value = (entry.get("summary") or {}).get(key)
        if value in (None, "", []):
            return None
        return [str(v) for v in value] if isinstance(value, list) else str(value)

    return get


def _gid_index(entry):
    """The GID index NCCL picks per NIC: the health read's (NCCL_IB_ADDR_FAMILY of the run, always
    reported), else the IPv6 read's (non-hostNetwork only). A NIC without one counts as ``none``."""
    summary = entry.get("summary") or {}
    idx = summary.get("gid_index") or summary.get("roce_v2_gid_index")
    if not idx:
        return None
    return sorted({"none" if v is None else str(v) for v in idx.values()}) if isinstance(idx, dict) else str(idx)


DRIFT_ROLE = "fleet_drift"
DRIFT_MODES = ("warn", "fail", "ignore")

FACETS = [
    Facet("firmware", _summary("firmware"), check="drift_firmware",
          fix="flash the fleet's firmware (mlxfwmanager -u, or mstflint) and reset the NICs (mlxfwreset)"),
    Facet("driver (mlx5_core / OFED)", _summary("driver_version"), check="drift_driver",
          fix="install the fleet's MLNX_OFED / DOCA-OFED version (the mlx5_core module version)"),
    Facet("kernel", _summary("kernel"), check="drift_kernel", fix="boot the fleet's kernel"),
    Facet("link layer", _summary("link_layers")),
    Facet("RDMA NICs", _summary("nic_count")),
    Facet("RoCE v2 GID index", _gid_index, check="drift_gid_index",
          fix="it matters only where NCCL_IB_GID_INDEX is pinned (one value for the whole job; NCCL otherwise picks the "
          "GID per NIC): give the node's RoCE netdevs the fleet's address layout (the same IPv4/IPv6 addresses in the "
          "same order) so that its RoCE v2 GID lands at the same index"),
    # sysfs shows a port's active rate only (its supported widths need a MAD): a node whose ports all trained
    # low passes its own rate check; the fleet's most common rate is the reference then.
    Facet("port rate", _summary("port_rates"), check="drift_port_rate",
          fix="check the cables/transceivers and the switch ports' speed and width of the node's compute ports "
          "(ethtool <netdev>; InfiniBand: ibportstate, ibstat), then reseat or replace what trains low"),
]  # fmt: skip


def _values(value):
    return value if isinstance(value, list) else [value]


def _spread(facet, validated):
    """(value counts, host -> values, the most common value, its rivals, the odd hosts): every host that
    reports another value, or every host when no value is the single most common one (a tie names no
    host right)."""
    counts = {}
    per_host = {}
    for host, entry in validated.items():
        value = facet.get(entry)
        if value is None:
            continue
        per_host[host] = _values(value)
        for v in set(per_host[host]):
            counts[v] = counts.get(v, 0) + 1
    if not counts:
        return counts, per_host, None, [], []
    common = max(sorted(counts), key=lambda v: counts[v])
    rivals = sorted(v for v in counts if v != common and counts[v] == counts[common])
    odd = sorted(h for h, vs in per_host.items() if vs != [common] or rivals)
    if len(counts) == 1 or len(per_host) < 2:  # one value, or one node: nothing drifts
        odd = []
    return counts, per_host, common, rivals, odd


def rollup(nodes, top=10):
    """The fleet view of the report's entries (host -> entry), validated entries only for the facets."""
    validated = dict((h, e) for h, e in nodes.items() if e.get("validated"))
    failing = {}
    for host, entry in validated.items():
        for c in entry.get("checks") or []:
            if not c.get("passed"):
                failing.setdefault(c.get("name"), set()).add(host)
    top_checks = sorted(failing.items(), key=lambda kv: (-len(kv[1]), kv[0]))[:top]
    facets = []
    for facet in FACETS:
        counts, per_host, common, _, odd = _spread(facet, validated)
        if not counts:
            continue
        facets.append(
            {
                "title": facet.title,
                "values": sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])),
                "most_common": common,
                "odd": odd if facet.drift else [],
                "reported_by": len(per_host),
            }
        )
    return {
        "total": len(nodes),
        "validated": len(validated),
        "passed": sum(1 for e in nodes.values() if e.get("passed")),
        "failed": sum(1 for e in validated.values() if not e.get("passed")),
        "not_validated": sum(1 for e in nodes.values() if not e.get("validated")),
        "top_failing_checks": [{"check": name, "nodes": len(hosts), "hosts": sorted(hosts)} for name, hosts in top_checks],
        "facets": facets,
    }


def drift(nodes, mode="warn"):
    """Host -> its fleet drift findings, check rows like the node's own (role ``fleet_drift``): per facet
    with a ``check``, each odd node out of the validated ones gets a row naming its value, the fleet's
    most common one and the fix. ``warn`` rows pass (``warning`` true: reported only), ``fail`` rows
    fail the node, ``ignore`` gives none."""
    if mode not in DRIFT_MODES:
        raise ValueError("drift mode %r is not one of %s" % (mode, ", ".join(DRIFT_MODES)))
    if mode == "ignore":
        return {}
    validated = dict((h, e) for h, e in nodes.items() if e.get("validated"))
    found = {}
    for facet in FACETS:
        if not facet.check:
            continue
        counts, per_host, common, rivals, odd = _spread(facet, validated)
        for host in odd:
            seen = ", ".join(per_host[host])
            if rivals:
                fleet_text = "no single most common value across the fleet: %s" % ", ".join(
                    "%s on %d node(s)" % (v, counts[v]) for v in [common] + rivals
                )
            else:
                fleet_text = "the fleet's most common is %s (%d of %d nodes)" % (common, counts[common], len(per_host))
            found.setdefault(host, []).append(
                {
                    "name": facet.check,
                    "nic": None,
                    "passed": mode != "fail",
                    "warning": mode == "warn",
                    "message": "%s %s differs across the fleet: %s. Fix: %s" % (facet.title, seen, fleet_text, facet.fix),
                    "role": DRIFT_ROLE,
                }
            )
    return found


def rollup_markdown(r, max_hosts=8):
    def hosts(names):
        shown = ", ".join(names[:max_hosts])
        return shown + (" and %d more" % (len(names) - max_hosts) if len(names) > max_hosts else "")

    lines = [
        "## Fleet",
        "",
        "%d node(s): %d passed, %d failed, %d not validated." % (r["total"], r["passed"], r["failed"], r["not_validated"]),
    ]
    if r["top_failing_checks"]:
        lines += ["", "| failing check | nodes | e.g. |", "|---|---|---|"]
        lines += ["| %s | %d | %s |" % (c["check"], c["nodes"], hosts(c["hosts"])) for c in r["top_failing_checks"]]
    if r["facets"]:
        lines += ["", "| fact | values (nodes) | odd nodes out |", "|---|---|---|"]
        for f in r["facets"]:
            values = ", ".join("%s (%d)" % (v, n) for v, n in f["values"])
            odd = hosts(f["odd"]) if f["odd"] else "none"
            if f["odd"] and f["title"].startswith("RoCE"):
                odd = "DRIFT: " + odd + " (NCCL_IB_GID_INDEX must be the same on every node)"
            lines.append("| %s | %s | %s |" % (f["title"], values.replace("|", "\\|"), odd))
    return "\n".join(lines) + "\n"
