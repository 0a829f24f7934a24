"""The NFD local feature file: its format as node-feature-discovery's local source parses it, and
the real `serve` writing and updating it for a fixture node."""

from __future__ import annotations

import datetime
import re
import time
from pathlib import Path

import pytest

from rdma_device_plugin import nfd
from rdma_kubesim import KubeletSimulator, netns
from rdma_node import fixtures, sysfs

# Kubernetes qualified label names (apimachinery IsQualifiedName): optional DNS-subdomain prefix + "/"
# + a name of at most 63 characters.
_NAME = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)$")
_PREFIX = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


def parse_like_nfd(text: str, now: float | None = None) -> dict[str, str]:
    """Mirror of node-feature-discovery source/local/local.go parseFeatureFile / parseDirectives /
    updateFeatures: trimmed lines, "#" comments, "# +" directives (expiry-time, no-label, no-feature;
    anything else is an error there), "key=value" split once, a bare key means "true". expiry-time is
    parsed as time.RFC3339 and, once it is past, the rest of the file is ignored (no labels). Stricter
    than NFD: a directive we do not know, a bad label name or value fails here (nfd-master would drop
    it)."""
    assert len(text.encode()) <= 65536, "NFD skips feature files over 64 KiB"
    labels: dict[str, str] = {}
    for raw in text.split("\n"):
        line = raw.strip()
        if not line:
            continue
        if line.startswith("#"):
            if line.startswith("# +"):
                key, _, value = line[3:].partition("=")
                assert key in ("expiry-time", "no-label", "no-feature"), f"unknown directive {key!r}"
                if key == "expiry-time":
                    assert re.match(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?(Z|[+-]\d\d:\d\d)$", value), value
                    moment = datetime.datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
                    if (time.time() if now is None else now) > moment:
                        return {}
            continue
        key, sep, value = line.partition("=")
        value = value if sep else "true"
        prefix, slash, name = key.rpartition("/")
        assert not slash or (_PREFIX.match(prefix) and len(prefix) <= 253), f"bad label prefix in {key!r}"
        assert _NAME.match(name) and len(name) <= 63, f"bad label name {key!r}"
        assert nfd.LABEL_VALUE.match(value) and len(value) <= 63, f"bad label value {value!r}"
        labels[key if slash else nfd.PREFIX + key] = value
    return labels


@pytest.fixture
def feature_file(short_tmp: Path) -> Path:
    """<features.d>/rdma-device-plugin, its directory made (NFD reads every non-hidden file there)."""
    features_d = short_tmp / "features.d"
    features_d.mkdir()
    return features_d / "rdma-device-plugin"


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
    # the GPU labels come from affinity.nfd_facts (the serve path adds them; test_affinity_summary)
    assert set(labels) == {nfd.PREFIX + n for n in nfd.LABELS if not n.startswith("rdma-gpu-")}
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
    feature_file: Path,  # type: ignore[no-untyped-def]
) -> None:
    path = feature_file
    features_d = path.parent
    plugin = start_plugin(extra=["--nfd-features-file", str(path)])
    assert sim.wait_registered("rdma/hca"), plugin.output()
    assert sim.wait_for(path.exists, timeout=30), plugin.output()
    labels = parse_like_nfd(path.read_text(encoding="utf-8"))
    assert labels[nfd.PREFIX + "rdma-nics"] == "4"
    # issue 23: every NIC shares its PCIe switch with two GPUs, every GPU has a NIC under its switch
    assert labels[nfd.PREFIX + "rdma-gpu-affine-nics"] == "4"
    assert labels[nfd.PREFIX + "rdma-gpu-nic-affinity"] == "switch"
    # NFD reads every non-hidden file: nothing else may be left in the directory
    assert sorted(p.name for p in features_d.iterdir() if not p.name.startswith(".")) == ["rdma-device-plugin"]
    node.remove_nic("mlx5_bond_3")
    assert sim.wait_for(
        lambda: parse_like_nfd(path.read_text(encoding="utf-8")).get(nfd.PREFIX + "rdma-nics") == "3", timeout=60
    ), plugin.output()
    labels = parse_like_nfd(path.read_text(encoding="utf-8"))
    # the GPUs of mlx5_bond_3's switch now reach a NIC only through the CPU (mlx5_bond_2, same NUMA node)
    assert labels[nfd.PREFIX + "rdma-gpu-affine-nics"] == "3"
    assert labels[nfd.PREFIX + "rdma-gpu-nic-affinity"] == "numa"


# ------------------------------------------------------------ labels only where true, never longer than the plugin


def test_ipv6_label_left_out_when_unknown(node: fixtures.FixtureNode) -> None:
    nics = sysfs.read_nics(node.sysfs, node.dev)
    labels = parse_like_nfd(nfd.render(nfd.facts(nics, "shared", "shared", None)))
    assert nfd.PREFIX + "rdma-ipv6-compute-ready" not in labels
    assert labels[nfd.PREFIX + "rdma-nics"] == "4"


def test_sees_node_netns_only_when_every_netdev_is_here(node: fixtures.FixtureNode) -> None:
    nics = sysfs.read_nics(node.sysfs, node.dev)
    index = {n: sysfs.netdev_ifindex(node.sysfs, n) for nic in nics for n in nic.netdevs}

    def in_sysfs(netdev: str) -> int | None:
        return sysfs.netdev_ifindex(node.sysfs, netdev)

    assert nfd.sees_node_netns(nics, in_sysfs, here=index.get)  # hostNetwork: same names, same ifindexes
    assert not nfd.sees_node_netns(nics, in_sysfs, here=lambda _n: None)  # pod network: only eth0, lo
    # a pod netns that happens to have a netdev of the same name (another ifindex) is not the node's
    assert not nfd.sees_node_netns(nics, in_sysfs, here=lambda n: (index.get(n) or 0) + 100)
    assert not nfd.sees_node_netns([], in_sysfs, here=index.get)


def test_expiry_time_is_rfc3339_and_nfd_drops_an_expired_file() -> None:
    text = nfd.render({"rdma-nics": "4"}, nfd.expiry(1_700_000_000, 600))
    assert "# +expiry-time=2023-11-14T22:23:20Z\n" in text
    assert parse_like_nfd(text, now=1_700_000_000 + 599) == {nfd.PREFIX + "rdma-nics": "4"}
    assert parse_like_nfd(text, now=1_700_000_000 + 601) == {}


def test_feature_file_is_refreshed_before_it_expires(node: fixtures.FixtureNode, short_tmp: Path) -> None:
    nics = sysfs.read_nics(node.sysfs, node.dev)
    now = [1_700_000_000.0]
    path = short_tmp / "rdma-device-plugin"
    ff = nfd.FeatureFile(str(path), "shared", node.sysfs, node.procfs, relist_seconds=60, clock=lambda: now[0])
    assert ff.ttl == nfd.TTL_MIN
    ff.update(nics)
    first = path.read_text(encoding="utf-8")
    now[0] += ff.ttl / 3 - 1
    ff.update(nics)
    assert path.read_text(encoding="utf-8") == first  # nothing changed, not due yet
    now[0] += 2
    ff.update(nics)
    second = path.read_text(encoding="utf-8")
    assert second != first and parse_like_nfd(second, now=now[0] + ff.ttl - 1)
    # every re-list comes within the lifetime, however long the interval
    assert nfd.FeatureFile(str(path), "shared", node.sysfs, node.procfs, relist_seconds=3600).ttl >= 3 * 3600
    ff.remove()
    assert not path.exists()
    ff.remove()  # already gone: fine


def test_serve_in_the_pod_network_omits_the_ipv6_label_and_removes_the_file_at_stop(
    sim: KubeletSimulator,
    start_plugin,
    node: fixtures.FixtureNode,
    feature_file: Path,  # type: ignore[no-untyped-def]
) -> None:
    """The fixture node's netdevs (bond0...) are not in this process's netns: the plugin does not see
    the node's network namespace, as in the chart's default pod network."""
    path = feature_file
    plugin = start_plugin(extra=["--nfd-features-file", str(path)])
    assert sim.wait_for(path.exists, timeout=30), plugin.output()
    text = path.read_text(encoding="utf-8")
    labels = parse_like_nfd(text)
    assert labels[nfd.PREFIX + "rdma-nics"] == "4"
    assert nfd.PREFIX + "rdma-ipv6-compute-ready" not in labels
    (expires,) = re.findall(r"^# \+expiry-time=(\S+)$", text, flags=re.M)
    left = datetime.datetime.fromisoformat(expires.replace("Z", "+00:00")).timestamp() - time.time()
    assert nfd.TTL_MIN - 60 < left <= nfd.TTL_MIN + 1
    assert plugin.stop()[0] == 0
    assert not path.exists(), "a clean stop (uninstall, rollout) must take the node's labels with it"


@pytest.mark.skipif(netns.available() is not None, reason=f"network namespaces: {netns.available()}")
def test_serve_in_the_node_netns_writes_the_ipv6_label(
    sim: KubeletSimulator,
    start_plugin,
    node: fixtures.FixtureNode,
    feature_file: Path,  # type: ignore[no-untyped-def]
) -> None:
    """hostNetwork stand-in: a real netns holding the fixture node's netdevs with their ifindexes."""
    path = feature_file
    with netns.NodeNetns(node) as ns:
        plugin = start_plugin(extra=["--nfd-features-file", str(path)], prefix=ns.exec_prefix)
        assert sim.wait_for(path.exists, timeout=30), plugin.output()
        labels = parse_like_nfd(path.read_text(encoding="utf-8"))
        # the fixture's procfs is an IPv6-ready Lingjun node
        assert labels[nfd.PREFIX + "rdma-ipv6-compute-ready"] == "true", plugin.output()[-2000:]
        assert plugin.stop()[0] == 0
    assert not path.exists()
