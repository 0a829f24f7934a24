"""Node Feature Discovery local feature file (``--nfd-features-file``; off by default).

NFD's ``local`` source reads every non-hidden file in its ``features.d`` directory
(/etc/kubernetes/node-feature-discovery/features.d/), one ``name=value`` per line, ``#`` for
comments and ``# +directive`` lines, at most 64 KiB (node-feature-discovery
source/local/local.go: getFeaturesFromFiles, parseFeatureFile, MaxFeatureFileSize), and nfd-master
turns each line into a node label; names without a prefix get ``feature.node.kubernetes.io/``.
So the node's RDMA facts become labels with no RBAC for the plugin. The file is written to a
hidden temp file (NFD skips names starting with ".") and renamed into place, and only when a fact
changes. Label names: docs/operations.md ("Node labels through NFD").
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping, Sequence

from . import netchecks
from .node import sysfs

LOG = logging.getLogger(__name__)

PREFIX = "feature.node.kubernetes.io/"
MAX_FILE_SIZE = 65536  # NFD's MaxFeatureFileSize
# A label value: at most 63 characters, alphanumerics, "-", "_", "." inside (apimachinery validation).
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
LABELS = (
    "rdma-nics",
    "rdma-link-layer",
    "rdma-roce-v2",
    "rdma-ipv6-compute-ready",
    "rdma-netns-mode",
    "rdma-plugin-mode",
)


def facts(nics: Sequence[sysfs.Nic], mode: str, netns_mode: str | None, ipv6_ready: bool) -> dict[str, str]:
    """Label name (without prefix) -> value for the NICs the plugin serves. Pure."""
    layers = sorted({p.link_layer for n in nics for p in n.ports if p.link_layer})
    roce_v2 = any(g.type == "RoCE v2" and g.is_ipv6 for n in nics for p in n.ports for g in p.gids)
    return {
        "rdma-nics": str(len(nics)),
        "rdma-link-layer": layers[0] if len(layers) == 1 else ("mixed" if layers else "none"),
        "rdma-roce-v2": "true" if roce_v2 else "false",
        "rdma-ipv6-compute-ready": "true" if ipv6_ready and nics else "false",
        "rdma-netns-mode": netns_mode or "unknown",
        "rdma-plugin-mode": mode,
    }


def render(labels: Mapping[str, str]) -> str:
    """The features.d file text; raises ValueError for a value NFD would reject as a label."""
    lines = ["# Written by rdma-device-plugin; node-feature-discovery turns each line into a node label."]
    for name, value in labels.items():
        if not LABEL_VALUE.match(value) or len(value) > 63:
            raise ValueError(f"label {name}={value!r} is not a valid Kubernetes label value")
        lines.append(f"{PREFIX}{name}={value}")
    text = "\n".join(lines) + "\n"
    if len(text.encode()) > MAX_FILE_SIZE:
        raise ValueError(f"feature file exceeds NFD's {MAX_FILE_SIZE} bytes")
    return text


class FeatureFile:
    """Keeps ``path`` in step with the node's RDMA facts (called at every NIC re-list)."""

    def __init__(self, path: str, mode: str, sysfs_root: str, procfs_root: str) -> None:
        self.path = path
        self.mode = mode
        self.sysfs_root = sysfs_root
        self.procfs_root = procfs_root
        self._written = ""

    def update(self, nics: Sequence[sysfs.Nic]) -> None:
        ipv6_ready = not netchecks.read_and_check(nics, self.sysfs_root, self.procfs_root) if nics else False
        text = render(facts(nics, self.mode, sysfs.netns_mode(self.sysfs_root), ipv6_ready))
        if text == self._written:
            return
        directory, name = os.path.split(self.path)
        tmp = os.path.join(directory, f".{name}.tmp")
        try:
            with open(tmp, "w", encoding="utf-8") as fh:
                fh.write(text)
            os.replace(tmp, self.path)
        except OSError as exc:
            LOG.error("cannot write the NFD feature file", extra={"path": self.path, "error": str(exc)})
            return
        self._written = text
        LOG.info("NFD feature file written", extra={"path": self.path, "labels": text.count("\n") - 1})
