# Copyright: rdma-device-plugin maintainers; Apache-2.0
"""What a node's ResourceSlices say, for the verify of the DRA path, and what must hold before a
deploy switches nodes to DRA (pure logic, no I/O).

A node passes when the driver's pool of that node (``spec.pool.name`` = the node) is complete (every
slice of its newest generation is there: ``resourceSliceCount``, the rule the scheduler's allocator
uses) and it has devices, none tainted by the driver (a NIC down or gone: the taint's value says
which and why).

Before the deploy: the cluster is of the driver's floor or later (the driver's own dra/version.py,
a test compares), and no pod on a node that DRA will serve asks a numaPools ``<resource>-local``
resource, which has no DRA counterpart (docs/dra.md).
"""

from __future__ import annotations

import re

from ansible_collections.lingjun.rdma.plugins.module_utils.rdma_fleet import Verdict

SLICES = "/apis/resource.k8s.io/v1/resourceslices"


class PoolView(object):
    def __init__(self, generation, slices, expected, devices, tainted, nics=None, published=None, sets=()):
        self.generation = generation
        self.slices = slices
        self.expected = expected
        self.devices = devices  # device names of the newest generation
        self.tainted = tainted  # device -> "key=value:effect" of its taints
        self.nics = nics or {}  # device -> the NICs it hands out (a set device: its nicCount; a NIC's view: 1)
        self.published = published or {}  # resource -> its NICs on the node (one shared view each)
        self.sets = set(sets)  # devices that stand for a set of NICs (nicCount)

    @property
    def complete(self):
        return self.slices == self.expected


def pools(slices):
    """node -> PoolView of the newest generation of that node's pool."""
    by_node = {}
    for s in slices:
        spec = s.get("spec") or {}
        node = spec.get("nodeName") or (spec.get("pool") or {}).get("name")
        if node:
            by_node.setdefault(node, []).append(spec)
    out = {}
    for node, specs in by_node.items():
        top = max(int(sp["pool"].get("generation", 0)) for sp in specs)
        current = [sp for sp in specs if int(sp["pool"].get("generation", 0)) == top]
        devices, tainted, nics, published, sets = [], {}, {}, {}, []
        for sp in current:
            for d in sp.get("devices") or []:
                devices.append(d["name"])
                attrs = d.get("attributes") or {}
                if "nicCount" in attrs:
                    nics[d["name"]] = int(attrs["nicCount"].get("int", 0))
                    sets.append(d["name"])
                elif "rdmaDevice" in attrs:
                    nics[d["name"]] = 1
                    if (attrs.get("sharing") or {}).get("string") == "shared":
                        resource = (attrs.get("resource") or {}).get("string", "")
                        published[resource] = published.get(resource, 0) + 1
                if d.get("taints"):
                    tainted[d["name"]] = ",".join(
                        "%s=%s:%s" % (t.get("key"), t.get("value", ""), t.get("effect")) for t in d["taints"]
                    )
        expected = int(current[0]["pool"].get("resourceSliceCount", 1))
        out[node] = PoolView(top, len(current), expected, sorted(devices), tainted, nics, published, sets)
    return out


def nic_count_problem(node, view, resource, allocated, want=None, source=""):
    """Why the NICs a test pod got (``allocated``: its devices on the node) are not what the node should
    give one unit of ``resource`` ('' when they are): every NIC the node publishes through a set device
    (shared mode), one NIC through a NIC's exclusive view; and the node publishes ``want`` NICs when the
    inventory knows the count (``source``: where from)."""
    published = view.published.get(resource, 0)
    got = sum(view.nics.get(d, 0) for d in allocated)
    whole = any(d in view.sets for d in allocated)
    if want is not None and published != want:
        return "node %s publishes %d NICs of %s, %d expected (%s): a NIC is missing or not selected. Next: " \
            "rdma-device-plugin discover on the node" % (node, published, resource, want, source)
    expected = published if whole else 1
    if got != expected:
        return "the test pod got %d NICs (%s), %d expected (%s)" % (
            got, ", ".join(allocated) or "none", expected, "every NIC of the node" if whole else "one NIC per unit")
    return ""


def verdict(node, view, driver, release):
    """Whether ``node`` publishes its NICs through ``driver``, and what to do when not."""
    if view is None:
        return Verdict(
            False,
            "node %s: no ResourceSlice of driver %s. Next: is the DRA driver running there (label "
            "node-restriction.kubernetes.io/rdma-driver=dra or driver: dra; kubectl -n <namespace> get pods -l "
            "app.kubernetes.io/instance=%s,app.kubernetes.io/component=dra-driver -o wide and its log)?"
            % (node, driver, release),
            False,
        )
    if not view.complete:
        return Verdict(
            False,
            "node %s: the pool of %s is incomplete (%d of %d slices of generation %d): the driver is writing it, "
            "or the kubelet removed them (it does at its start and 30 s after the driver stopped)"
            % (node, driver, view.slices, view.expected, view.generation),
            False,
        )
    if not view.devices:
        return Verdict(
            False,
            "node %s: the driver %s publishes no device: no NIC matches the selectors (rdma-device-plugin discover "
            "on the node)" % (node, driver),
            False,
        )
    if view.tainted:
        shown = "; ".join("%s (%s)" % kv for kv in sorted(view.tainted.items()))
        return Verdict(
            False,
            "node %s: %d of %d devices of %s tainted, new claims stay away from them: %s. Next: the NIC's port "
            "state and link (rdma-device-plugin discover on the node)"
            % (node, len(view.tainted), len(view.devices), driver, shown),
            False,
        )
    return Verdict(
        True,
        "node %s: %d devices of %s published (generation %d, %d slice(s)), none tainted"
        % (node, len(view.devices), driver, view.generation, view.slices),
        False,
    )


KUBE_FLOOR = (1, 37)
KUBE_TESTED = "v1.37.2"
NEXT = "ansible-playbook playbooks/deploy.yml -i <your inventory>"


def server_version(doc):
    """(major, minor) of an API server's /version (a provider's "37+" counts as 37), None if it names none."""
    major, minor = (re.match(r"\d+", str(doc.get(k) or "")) for k in ("major", "minor"))
    if major and minor:
        return int(major.group(0)), int(minor.group(0))
    git = re.match(r"v?(\d+)\.(\d+)", str(doc.get("gitVersion") or ""))
    return (int(git.group(1)), int(git.group(2))) if git else None


def version_problem(doc):
    """Why the DRA driver cannot run with the API server of ``doc`` (its /version), '' when it can."""
    version = server_version(doc)
    if version is None:
        return "the API server's /version names no version (%r): cannot check the DRA driver's floor" % (doc,)
    if version >= KUBE_FLOOR:
        return ""
    floor = "%d.%d" % KUBE_FLOOR
    return (
        "the cluster runs Kubernetes %s; rdma_driver=dra needs %s or later (tested on %s): 1.36's scheduler and "
        "kubelet lack fixes the DRA driver relies on (kubernetes#138882, #139034, the v1 health API; docs/dra.md, "
        "Supported versions). Next: upgrade the control plane and the kubelets to %s and run %s again, or keep the "
        "device plugin: %s -e rdma_driver=devicePlugin"
        % (doc.get("gitVersion") or "%d.%d" % version, floor, KUBE_TESTED, floor, NEXT, NEXT)
    )


def dra_nodes(nodes, label_key, driver, legacy_keys=()):
    """The names of ``nodes`` (API objects) the release serves by DRA: labelled ``dra``, or unlabelled
    while the chart's ``driver`` is dra. A node that has only a key of ``legacy_keys`` (the label before
    chart 3.0.0, which the deploy copies to ``label_key`` after this check) is judged by it."""
    out = []
    for n in nodes:
        meta = n.get("metadata") or {}
        labels = meta.get("labels") or {}
        value = labels.get(label_key) or next((labels[k] for k in legacy_keys if labels.get(k)), None)
        if (value or driver) == "dra":
            out.append(meta.get("name", ""))
    return sorted(out)


def local_pods(pods, nodes, resources):
    """(``namespace/name``, node, resource) of the unfinished pods bound to ``nodes`` that ask a
    numaPools ``<resource>-local`` of ``resources`` (requests or limits, any container)."""
    wanted = set(r + "-local" for r in resources)
    nodes = set(nodes)
    out = []
    for p in pods:
        spec, meta = p.get("spec") or {}, p.get("metadata") or {}
        if spec.get("nodeName") not in nodes or (p.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
            continue
        asked = set()
        for c in (spec.get("initContainers") or []) + (spec.get("containers") or []):
            res = c.get("resources") or {}
            asked.update(k for part in ("requests", "limits") for k in (res.get(part) or {}) if k in wanted)
        for r in sorted(asked):
            out.append(("%s/%s" % (meta.get("namespace"), meta.get("name")), spec["nodeName"], r))
    return sorted(out)


def local_pods_problem(found, label_key):
    """The refusal for :func:`local_pods`' answer ('' when it is empty)."""
    if not found:
        return ""
    shown = "; ".join("%s on %s (%s)" % f for f in found[:20]) + ("; ..." if len(found) > 20 else "")
    return (
        "%d pod(s) on nodes DRA would serve ask a numaPools -local resource, which has no DRA counterpart (no "
        "DeviceClass; docs/dra.md, Migrating): %s. On DRA they and their replacements would stay Pending. Next: "
        "move them to nodes kept on the device plugin (kubectl label node <node> %s=devicePlugin) or change them to "
        "ask NICs by claim aligned with their GPUs (docs/dra.md), then run %s again"
        % (len(found), shown, label_key, NEXT)
    )
