"""Node Feature Discovery local feature file (``--nfd-features-file``; off by default).

NFD's ``local`` source reads every non-hidden file in its ``features.d`` directory
(/etc/kubernetes/node-feature-discovery/features.d/), one ``name=value`` per line, ``#`` for
comments and ``# +directive`` lines, at most 64 KiB (node-feature-discovery
source/local/local.go: getFeaturesFromFiles, parseFeatureFile, MaxFeatureFileSize), and nfd-master
turns each line into a node label; names without a prefix get ``feature.node.kubernetes.io/``.
So the node's RDMA facts become labels with no RBAC for the plugin. The file is written to a
hidden temp file (NFD skips names starting with ".") and renamed into place, when a fact changes
and when a third of its lifetime has passed.

Labels only where they are true, and never longer than the plugin:
- ``rdma-ipv6-compute-ready`` is computed from the plugin's own /proc/net, which is the node's only
  when the plugin runs in the node's network namespace (hostNetwork). In the pod network it would
  always say false, so it is left out unless every served NIC's netdev is visible here with the
  ifindex sysfs gives it (the test :mod:`.events` uses for link events).
- ``# +expiry-time`` (RFC 3339; NFD ignores an expired file, local.go parseDirectives): a plugin
  that dies without cleaning up stops labelling the node within :data:`TTL_MIN` (or three re-list
  intervals, if longer).
- A clean stop (SIGTERM: uninstall, rollout, drain) removes the file (:meth:`FeatureFile.remove`);
  during a rollout the node may lack the labels until the new pod writes them and nfd-worker reads
  its directory again (``core.sleepInterval``, 60 s by default).

Label names: docs/operations.md ("Node labels through NFD").
"""

from __future__ import annotations

import datetime
import logging
import os
import re
import time
from collections.abc import Callable, Mapping, Sequence

from rdma_node import sysfs

from . import affinity, events, netchecks

LOG = logging.getLogger(__name__)

PREFIX = "feature.node.kubernetes.io/"
MAX_FILE_SIZE = 65536  # NFD's MaxFeatureFileSize
TTL_MIN = 600.0  # seconds a written file stays valid at least (# +expiry-time)
# A label value: at most 63 characters, alphanumerics, "-", "_", "." inside (apimachinery validation).
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
LABELS = (
    "rdma-nics",
    "rdma-link-layer",
    "rdma-roce-v2",
    "rdma-ipv6-compute-ready",
    "rdma-netns-mode",
    "rdma-plugin-mode",
    "rdma-gpu-affine-nics",
    "rdma-gpu-nic-affinity",
)


def facts(nics: Sequence[sysfs.Nic], mode: str, netns_mode: str | None, ipv6_ready: bool | None) -> dict[str, str]:
    """Label name (without prefix) -> value for the NICs the plugin serves. Pure.

    ``ipv6_ready`` None: not known here (the plugin does not see the node's network namespace), so
    ``rdma-ipv6-compute-ready`` is left out rather than written false."""
    layers = sorted({p.link_layer for n in nics for p in n.ports if p.link_layer})
    roce_v2 = any(g.type == "RoCE v2" and g.is_ipv6 for n in nics for p in n.ports for g in p.gids)
    labels = {
        "rdma-nics": str(len(nics)),
        "rdma-link-layer": layers[0] if len(layers) == 1 else ("mixed" if layers else "none"),
        "rdma-roce-v2": "true" if roce_v2 else "false",
        "rdma-ipv6-compute-ready": "true" if ipv6_ready and nics else "false",
        "rdma-netns-mode": netns_mode or "unknown",
        "rdma-plugin-mode": mode,
    }
    if ipv6_ready is None:
        del labels["rdma-ipv6-compute-ready"]
    return labels


def sees_node_netns(
    nics: Sequence[sysfs.Nic],
    sysfs_ifindex: Callable[[str], int | None],
    here: Callable[[str], int | None] = events.visible_ifindex,
) -> bool:
    """Is this process in the node's network namespace, as far as the served NICs tell? Every NIC's
    compute netdev (the bond in a LAG) must be visible here with the ifindex the sysfs tree gives it;
    False without any such netdev (InfiniBand only: nothing to judge by)."""
    carriers = [n.compute_netdevs[0] for n in nics if n.compute_netdevs]
    return bool(carriers) and all((i := sysfs_ifindex(c)) is not None and i == here(c) for c in carriers)


def expiry(now: float, ttl: float) -> str:
    """The ``# +expiry-time`` value NFD parses (time.RFC3339), in UTC, whole seconds."""
    moment = datetime.datetime.fromtimestamp(int(now + ttl), tz=datetime.UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


def render(labels: Mapping[str, str], expires: str | None = None) -> str:
    """The features.d file text; raises ValueError for a value NFD would reject as a label."""
    lines = ["# Written by rdma-device-plugin; node-feature-discovery turns each line into a node label."]
    if expires is not None:
        lines.append(f"# +expiry-time={expires}")
    for name, value in labels.items():
        if not LABEL_VALUE.match(value) or len(value) > 63:
            raise ValueError(f"label {name}={value!r} is not a valid Kubernetes label value")
        lines.append(f"{PREFIX}{name}={value}")
    text = "\n".join(lines) + "\n"
    if len(text.encode()) > MAX_FILE_SIZE:
        raise ValueError(f"feature file exceeds NFD's {MAX_FILE_SIZE} bytes")
    return text


class FeatureFile:
    """Keeps ``path`` in step with the node's RDMA facts (called at every NIC re-list, at least every
    ``relist_seconds``): rewritten when a fact changes or a third of its lifetime has passed."""

    def __init__(
        self,
        path: str,
        mode: str,
        sysfs_root: str,
        procfs_root: str,
        relist_seconds: float = 60.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.path = path
        self.mode = mode
        self.sysfs_root = sysfs_root
        self.procfs_root = procfs_root
        # Three re-lists fit in a lifetime: a rewrite is due after ttl/3 and comes within one re-list.
        self.ttl = max(TTL_MIN, 3 * relist_seconds)
        self.clock = clock
        self._facts: dict[str, str] | None = None
        self._written_at = 0.0

    def update(self, nics: Sequence[sysfs.Nic], gpus: affinity.NodeAffinity | None = None) -> None:
        ipv6_ready: bool | None = None
        if sees_node_netns(nics, lambda netdev: sysfs.netdev_ifindex(self.sysfs_root, netdev)):
            ipv6_ready = not netchecks.read_and_check(nics, self.sysfs_root, self.procfs_root)
        labels = facts(nics, self.mode, sysfs.netns_mode(self.sysfs_root), ipv6_ready)
        if gpus is not None:
            labels.update(affinity.nfd_facts(gpus))  # GPU-NIC affinity: only on nodes with GPUs
        now = self.clock()
        if labels == self._facts and now - self._written_at < self.ttl / 3:
            return
        text = render(labels, expiry(now, self.ttl))
        directory, name = os.path.split(self.path)
        tmp = os.path.join(directory, f".{name}.tmp")
        try:
            with open(tmp, "w", encoding="utf-8") as fh:
                fh.write(text)
            os.replace(tmp, self.path)
        except OSError as exc:
            LOG.error("cannot write the NFD feature file", extra={"path": self.path, "error": str(exc)})
            return
        if labels != self._facts:
            LOG.info("NFD feature file written", extra={"path": self.path, "labels": len(labels)})
        self._facts, self._written_at = labels, now

    def remove(self) -> None:
        """A clean stop: the labels go with the plugin (nfd-worker drops them at its next pass)."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            LOG.error("cannot remove the NFD feature file", extra={"path": self.path, "error": str(exc)})
            return
        self._facts = None
        LOG.info("NFD feature file removed", extra={"path": self.path})
