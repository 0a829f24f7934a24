"""The NFD local feature file: its format as node-feature-discovery's local source parses it, and
the real `serve` writing and updating it for a fixture node."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from rdma_device_plugin import nfd
from rdma_device_plugin.kubesim import KubeletSimulator
from rdma_device_plugin.node import fixtures, sysfs

# Kubernetes qualified label names (apimachinery IsQualifiedName): optional DNS-subdomain prefix + "/"
# + a name of at most 63 characters.
_NAME = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)$")
_PREFIX = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


def parse_like_nfd(text: str) -> dict[str, str]:
    """Mirror of node-feature-discovery source/local/local.go parseFeatureFile / parseDirectives /
    updateFeatures: trimmed lines, "#" comments, "# +" directives (expiry-time, no-label, no-feature;
    anything else is an error there), "key=value" split once, a bare key means "true". Stricter than
    NFD: a directive we do not know, a bad label name or value fails here (nfd-master would drop it)."""
    assert len(text.encode()) <= 65536, "NFD skips feature files over 64 KiB"
    labels: dict[str, str] = {}
    for raw in text.split("\n"):
        line = raw.strip()
        if not line:
            continue
        if line.startswith("#"):
            if line.startswith("# +"):
                key = line[3:].split("=", 1)[0]
                assert key in ("expiry-time", "no-label", "no-feature"), f"unknown directive {key!r}"
            continue
        key, sep, value = line.partition("=")
        value = value if sep else "true"
        prefix, slash, name = key.rpartition("/")
        assert not slash or (_PREFIX.match(prefix) and len(prefix) <= 253), f"bad label prefix in {key!r}"
        assert _NAME.match(name) and len(name) <= 63, f"bad label name {key!r}"
        assert nfd.LABEL_VALUE.match(value) and len(value) <= 63, f"bad label value {value!r}"
        labels[key if slash else nfd.PREFIX + key] = value
    return labels


def test_parser_is_strict() -> None:
    with pytest.raises(AssertionError):
        parse_like_nfd("# +expires=1\n")
    with pytest.raises(AssertionError):
        parse_like_nfd("feature.node.kubernetes.io/rdma-nics=a,b\n")
    assert parse_like_nfd("# c\nfoo\n") == {"feature.node.kubernetes.io/foo": "true"}


def test_facts_of_a_lingjun_node(node: fixtures.FixtureNode) -> None:
    nics = sysfs.read_nics(node.sysfs, node.dev)
    labels = parse_like_nfd(nfd.render(nfd.facts(nics, "shared", sysfs.netns_mode(node.sysfs), True)))
    assert labels == {
        "feature.node.kubernetes.io/rdma-nics": "4",
        "feature.node.kubernetes.io/rdma-link-layer": "Ethernet",
        "feature.node.kubernetes.io/rdma-roce-v2": "true",
        "feature.node.kubernetes.io/rdma-ipv6-compute-ready": "true",
        "feature.node.kubernetes.io/rdma-netns-mode": "shared",
        "feature.node.kubernetes.io/rdma-plugin-mode": "shared",
    }
    assert set(labels) == {nfd.PREFIX + n for n in nfd.LABELS}
    none = parse_like_nfd(nfd.render(nfd.facts([], "exclusive", None, True)))
    assert none[nfd.PREFIX + "rdma-nics"] == "0" and none[nfd.PREFIX + "rdma-ipv6-compute-ready"] == "false"
    assert none[nfd.PREFIX + "rdma-link-layer"] == "none" and none[nfd.PREFIX + "rdma-netns-mode"] == "unknown"


def test_render_rejects_a_value_nfd_would_drop() -> None:
    with pytest.raises(ValueError, match="not a valid Kubernetes label value"):
        nfd.render({"rdma-link-layer": "Ethernet,InfiniBand"})


def test_serve_writes_and_updates_the_feature_file(
    sim: KubeletSimulator,
    start_plugin,
    node: fixtures.FixtureNode,
    short_tmp: Path,  # type: ignore[no-untyped-def]
) -> None:
    features_d = short_tmp / "features.d"
    features_d.mkdir()
    path = features_d / "rdma-device-plugin"
    plugin = start_plugin(extra=["--nfd-features-file", str(path)])
    assert sim.wait_registered("rdma/hca"), plugin.output()
    assert sim.wait_for(path.exists, timeout=30), plugin.output()
    labels = parse_like_nfd(path.read_text(encoding="utf-8"))
    assert labels[nfd.PREFIX + "rdma-nics"] == "4"
    # NFD reads every non-hidden file: nothing else may be left in the directory
    assert sorted(p.name for p in features_d.iterdir() if not p.name.startswith(".")) == ["rdma-device-plugin"]
    node.remove_nic("mlx5_bond_3")
    assert sim.wait_for(
        lambda: parse_like_nfd(path.read_text(encoding="utf-8")).get(nfd.PREFIX + "rdma-nics") == "3", timeout=60
    ), plugin.output()
