"""Kernel notifications instead of polling (issue 15): inotify on the device-plugin dir and the
config dir, rtnetlink link events where the NICs' netdevs are in the plugin's network namespace.

The parsers are checked against hand-built kernel records; the watches against the real kernel
(inotify on a temp dir; a network namespace with the fixture node's netdevs for link events).
"""

from __future__ import annotations

import struct
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import PluginProcess

from rdma_device_plugin import events
from rdma_kubesim import KubeletSimulator, netns
from rdma_node import fixtures, sysfs

RES = "rdma/hca"


def _rtattr(kind: int, payload: bytes) -> bytes:
    raw = struct.pack("=HH", 4 + len(payload), kind) + payload
    return raw + b"\0" * (-len(raw) % 4)


def _link_message(kind: int, index: int, name: str) -> bytes:
    body = struct.pack("=BxHiII", 0, 1, index, 0, 0) + _rtattr(4, struct.pack("=I", 1500))  # IFLA_MTU first
    body += _rtattr(events.IFLA_IFNAME, name.encode() + b"\0")
    return struct.pack("=IHHII", 16 + len(body), kind, 0, 0, 0) + body


def test_link_messages_are_parsed_by_name_and_index() -> None:
    other = struct.pack("=IHHII", 20, 20, 0, 0, 0) + b"\0" * 4  # RTM_NEWADDR: not a link message
    buf = _link_message(events.RTM_NEWLINK, 470, "bond1") + other + _link_message(events.RTM_DELLINK, 9, "eth7")
    assert events.parse_link_messages(buf) == [(events.RTM_NEWLINK, 470, "bond1"), (events.RTM_DELLINK, 9, "eth7")]
    assert events.parse_link_messages(buf[:-3]) == [(events.RTM_NEWLINK, 470, "bond1")]  # truncated: kept so far


def test_inotify_records_are_parsed() -> None:
    name = b"kubelet.sock\0\0\0\0"
    buf = struct.pack("=iIII", 1, events.IN_CREATE, 0, len(name)) + name
    buf += struct.pack("=iIII", 1, events.IN_IGNORED, 0, 0)
    assert events.parse_inotify(buf) == [(1, events.IN_CREATE, "kubelet.sock"), (1, events.IN_IGNORED, "")]


def test_dir_watch_sees_sockets_come_and_go_and_its_dir_vanish(short_tmp: Path) -> None:
    d = short_tmp / "dp"
    d.mkdir()
    watch = events.DirWatch(str(d))
    try:
        assert watch.drain() is False
        (d / "kubelet.sock").write_text("")
        assert watch.drain() is True
        assert watch.drain() is False  # drained
        (d / "kubelet.sock").unlink()
        assert watch.drain() is True and watch.alive
        d.rmdir()
        assert watch.drain() is True
        assert not watch.alive  # the loop opens a new watch (or polls) from here
    finally:
        watch.close()


def test_dir_watch_of_a_missing_dir_names_it(short_tmp: Path) -> None:
    with pytest.raises(OSError, match="no-such-dir"):
        events.DirWatch(str(short_tmp / "no-such-dir"))


def test_link_coverage_needs_roce_and_the_netdevs_in_this_netns(node: fixtures.FixtureNode) -> None:
    nics = sysfs.read_nics(node.sysfs, node.dev)

    def in_sysfs(netdev: str) -> int | None:
        return sysfs.netdev_ifindex(node.sysfs, netdev)

    same = events.link_coverage(nics, in_sysfs, in_sysfs)
    assert same.complete
    assert {"bond0", "bond1", "eth2", "eth3"} <= same.netdevs  # bond masters and their slaves
    elsewhere = events.link_coverage(nics, in_sysfs, lambda n: None)
    assert not elsewhere.complete
    assert "mlx5_bond_1's netdev bond1 is not in this network namespace" in "; ".join(elsewhere.uncovered)
    ib = fixtures.write_node(node.root + "-ib", fixtures.lingjun_node(nics=1, link_layer="InfiniBand"))
    ib_nics = sysfs.read_nics(ib.sysfs, ib.dev)
    ib_cov = events.link_coverage(ib_nics, lambda n: 1, lambda n: 1)
    assert not ib_cov.complete and "InfiniBand ports" in ib_cov.uncovered[0]


# --------------------------------------------------------------------------- the real kernel


def _wakeups(pid: int) -> int:
    """Times the main thread (the supervisor loop) went to sleep: its voluntary context switches.
    Not schedstat's timeslices, which a loaded machine inflates by preempting one wake-up's work."""
    with open(f"/proc/{pid}/task/{pid}/status", encoding="ascii") as fh:
        for line in fh:
            if line.startswith("voluntary_ctxt_switches:"):
                return int(line.split()[1])
    raise AssertionError(f"no voluntary_ctxt_switches in /proc/{pid}/task/{pid}/status")


@pytest.mark.skipif(netns.available() is not None, reason=f"network namespaces: {netns.available()}")
@pytest.mark.timeout(120)
def test_link_events_drive_the_probe_in_the_nodes_netns(
    sim: KubeletSimulator, start_plugin: Callable[..., PluginProcess], node: fixtures.FixtureNode
) -> None:
    """hostNetwork stand-in: the plugin runs in a netns holding the node's netdevs. With both poll
    intervals at 60 s, a port DOWN/ACTIVE still reaches the kubelet within seconds (the link
    message), the idle loop wakes about once a second, and a kubelet restart (inotify) is seen."""
    with netns.NodeNetns(node) as ns:
        config = {"health": {"intervalSeconds": 60, "linkEventsIntervalSeconds": 60}}
        spawned = time.monotonic()
        plugin = start_plugin(config, prefix=ns.exec_prefix)
        assert sim.wait_registered(RES, timeout=30), plugin.output()
        assert sim.wait_for(lambda: sim.allocatable(RES) == 1000, timeout=30), plugin.output()[-3000:]
        assert "re-read at once on link events of bond0,bond1," in plugin.output()
        # The start-up probe is behind us and the next poll is 60 s after it: from here until
        # spawned + 60, only a link message can make the plugin re-read a port.
        ns.set_port("mlx5_bond_1", "bond1", "DOWN")
        assert sim.wait_for(lambda: sim.allocatable(RES) == 0, timeout=20), plugin.output()[-3000:]
        ns.set_port("mlx5_bond_1", "bond1", "ACTIVE")
        assert sim.wait_for(lambda: sim.allocatable(RES) == 1000, timeout=20), plugin.output()[-3000:]
        assert time.monotonic() - spawned < 58, "seen too late to prove the link events carried it"

        time.sleep(3)  # the fast follow-up after the events is over
        before = _wakeups(plugin.proc.pid)
        time.sleep(5)
        per_second = (_wakeups(plugin.proc.pid) - before) / 5
        assert per_second < 3, f"the idle supervisor loop woke {per_second:.1f} times a second"

        sim.restart()  # seen through inotify on the device-plugin dir: nothing polls it now
        assert sim.wait_registered(RES, timeout=30), plugin.output()[-3000:]
        assert plugin.stop()[0] == 0


def test_a_broken_notification_source_is_dropped_not_fatal(node: fixtures.FixtureNode, short_tmp: Path) -> None:
    """A read error on a notification (netlink, inotify) must not end the supervisor loop: the
    source is dropped, polling covers for it, and the pass looks at everything once."""
    from rdma_device_plugin.config import PluginConfig
    from rdma_device_plugin.supervisor import Supervisor

    dp = short_tmp / "dp-broken"
    dp.mkdir()
    sup = Supervisor(PluginConfig(), node.sysfs, node.dev, str(dp))
    sup._keep_watching()
    links, watch = sup._links, sup._dir_watch
    assert links is not None and watch is not None

    def broken(*args: object) -> bool:
        raise OSError(5, "Input/output error")

    links.drain = broken  # type: ignore[method-assign]

    class Ready:
        def poll(self, timeout: int) -> list[tuple[int, int]]:
            return [(links.fileno(), 1)]

        def unregister(self, fd: int) -> None:
            pass

    sup._poller = Ready()  # type: ignore[assignment]
    woke = sup._wait(0)
    assert woke and sup._links is None and sup._links_failed  # polled from now on
    assert sup._dir_watch is watch  # the other sources stay
    watch.close()
