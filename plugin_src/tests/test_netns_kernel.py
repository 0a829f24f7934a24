"""The IPv6 compute-network checks against a real kernel network stack.

A network namespace with veth devices named like a Lingjun node's bonds (bond0..bond3),
real IPv6 addresses (one healthy, one on a netdev with the real disable_ipv6 sysctl set,
one tentative, one dadfailed), real routes, read through the one reader (procfs.py /
ipv6checks.py) from /proc inside the netns, together with the fixture's RDMA sysfs whose
GIDs point at those netdevs. Needs root and iproute2 (skipped otherwise).
"""

from __future__ import annotations

import errno
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from rdma_kubesim.netns import Netns
from rdma_kubesim.netns import available as netns_available
from rdma_node import fixtures

pytestmark = pytest.mark.skipif(netns_available() is not None, reason=f"network namespaces: {netns_available()}")

READ = """
import json, sys
from rdma_node import ipv6checks, procfs, sysfs
nics = sysfs.read_nics(sys.argv[1], sys.argv[2])
checks = ipv6checks.read_and_check(nics, sys.argv[1], "/proc")
print(json.dumps({
    "checks": [c.to_dict() for c in checks],
    "if_inet6": [[a.address, a.ifname, a.flags, a.unusable] for a in procfs.read_if_inet6("/proc")],
    "routes": {n: [f"{r.destination}/{r.prefix_len}" for r in procfs.routes_via("/proc", n)] for n in sys.argv[3:]},
}))
"""


def _wait_for(what: str, probe: object, timeout: float = 60.0) -> None:
    """Poll a kernel state change (DAD takes about a second; generous on a loaded machine)."""
    deadline = time.monotonic() + timeout
    while not probe():  # type: ignore[operator]
        if time.monotonic() > deadline:
            pytest.fail(f"the kernel did not reach: {what}")
        time.sleep(0.2)


@pytest.fixture
def netns() -> Iterator[Netns]:
    try:
        ns = Netns()
    except subprocess.CalledProcessError as exc:
        pytest.skip(f"cannot create a network namespace: {exc.stderr.strip()}")
    with ns:
        yield ns


def test_ipv6_checks_read_a_real_kernel_network_stack(short_tmp: Path, netns: Netns) -> None:
    node = fixtures.write_node(str(short_tmp / "node"), fixtures.lingjun_node(nics=4))
    address = {i: f"2408:4005:300:{i:x}::11" for i in range(4)}  # what the fixture's GIDs carry
    for i in range(4):
        netns.ip("link", "add", f"bond{i}", "type", "veth", "peer", "name", f"peer{i}")
    # bond0: healthy, with an extra compute route besides the prefix route
    netns.ip("link", "set", "peer0", "up")
    netns.ip("link", "set", "bond0", "up")
    netns.ip("-6", "addr", "add", f"{address[0]}/64", "dev", "bond0")
    netns.ip("-6", "route", "add", "2408:4005:3ff::/56", "dev", "bond0")
    # bond1: IPv6 disabled by the real sysctl (the kernel drops its addresses)
    netns.ip("link", "set", "peer1", "up")
    netns.ip("link", "set", "bond1", "up")
    netns.ip("-6", "addr", "add", f"{address[1]}/64", "dev", "bond1")
    subprocess.run([*netns.exec_prefix, "sysctl", "-qw", "net.ipv6.conf.bond1.disable_ipv6=1"], check=True)
    # bond2: its peer is down, so there is no carrier and DAD never finishes: tentative
    netns.ip("link", "set", "bond2", "up")
    netns.ip("-6", "addr", "add", f"{address[2]}/64", "dev", "bond2")
    # bond3: its peer already owns the address, so DAD fails: dadfailed
    netns.ip("link", "set", "peer3", "up")
    netns.ip("link", "set", "bond3", "up")
    netns.ip("-6", "addr", "add", f"{address[3]}/64", "dev", "peer3", "nodad")
    netns.ip("-6", "addr", "add", f"{address[3]}/64", "dev", "bond3")

    _wait_for("bond0's address out of DAD", lambda: "tentative" not in netns.ip("-6", "addr", "show", "dev", "bond0"))
    _wait_for("bond3's address dadfailed", lambda: "dadfailed" in netns.ip("-6", "addr", "show", "dev", "bond3"))

    out = subprocess.run(
        [*netns.exec_prefix, sys.executable, "-c", READ, node.sysfs, node.dev, "bond0", "bond2", "bond3"],
        check=True,
        capture_output=True,
        text=True,
    )
    seen = json.loads(out.stdout)
    failed = [(c["name"], c["nic"], c["netdev"]) for c in seen["checks"] if not c["passed"]]
    assert failed == [
        ("ipv6_enabled", "mlx5_bond_1", "bond1"),
        ("ipv6_global_address", "mlx5_bond_1", "bond1"),
        ("ipv6_global_address", "mlx5_bond_2", "bond2"),
        ("ipv6_global_address", "mlx5_bond_3", "bond3"),
    ], seen
    messages = {c["netdev"]: c["message"] for c in seen["checks"] if not c["passed"] and c["name"] != "ipv6_enabled"}
    assert f"{address[2]} is tentative (duplicate address detection has not finished" in messages["bond2"]
    assert f"{address[3]} is dadfailed (another host on the compute network has this address)" in messages["bond3"]
    assert messages["bond1"].startswith("mlx5_bond_1 (bond1): no global IPv6 address on bond1")
    # bond0 passes all four checks, from the kernel's own tables
    bond0 = {c["name"]: c for c in seen["checks"] if c["netdev"] == "bond0"}
    assert all(c["passed"] for c in bond0.values()) and len(bond0) == 4, bond0
    assert seen["routes"]["bond0"] == ["2408:4005:300::/64", "2408:4005:3ff::/56"]
    # the kernel's flags as /proc/net/if_inet6 prints them, read by the one parser
    flags = {(a, n): (f, u) for a, n, f, u in seen["if_inet6"]}
    assert flags[address[2], "bond2"][1] == "tentative"
    assert flags[address[3], "bond3"][1] == "dadfailed"
    assert flags[address[3], "peer3"][1] == ""
    assert not any(n == "bond1" and a == address[1] for a, n, _, _ in seen["if_inet6"])
    # the host's own /proc does not show the namespace's addresses: the read was inside it
    with open("/proc/net/if_inet6", encoding="ascii") as fh:
        assert "2408400503000000" not in fh.read()


HEALTH = """
import json, subprocess, sys, time
from rdma_node import dcb, healthchecks, lossless, sysfs
root, dev = sys.argv[1], sys.argv[2]
nics = sysfs.read_nics(root, dev)
want = healthchecks.Expectations(counter_interval=1.5)

def flap(seconds):  # the link of eth0 goes down and up again while the counters are watched
    subprocess.run(["ip", "link", "set", "peer0", "down"], check=True)
    subprocess.run(["ip", "link", "set", "peer0", "up"], check=True)
    time.sleep(seconds)

read = healthchecks.read(nics, root, "/proc", "/", want, real_node=True, sleep=flap)
with dcb.Client() as client:
    errors = {}
    for name in ("eth0", "rdp-nosuch0"):
        try:
            client.ieee(name)
        except dcb.DcbError as exc:
            errors[name] = exc.errno
    qos = lossless.read(root, "eth0", 3, client, "")
print(json.dumps({
    "checks": [c.to_dict() for c in healthchecks.check(read, want)],
    "dcb_errno": errors,
    "trust_source": qos.trust_source,
    "pfc_source": qos.pfc_source,
}))
"""


def test_health_checks_read_a_real_kernel_network_stack(short_tmp: Path, netns: Netns) -> None:
    """MTU, operstate/carrier and carrier_changes of real veths (named like the fixture's NIC
    netdevs, the fixture's class/net entries pointing at the namespace's own sysfs), a real carrier
    flap during the counter interval, and the kernel's DCB answers for netdevs without DCB."""
    node = fixtures.write_node(str(short_tmp / "node"), fixtures.lingjun_node(nics=2, bond=False))
    for i, mtu in ((0, "4200"), (1, "1500")):
        netns.ip("link", "add", f"eth{i}", "type", "veth", "peer", "name", f"peer{i}")
        netns.ip("link", "set", f"eth{i}", "mtu", mtu)
        netns.ip("link", "set", f"eth{i}", "up")
    netns.ip("link", "set", "peer0", "up")  # eth1's peer stays down: no carrier
    for i in range(2):  # ip netns exec mounts the namespace's sysfs on /sys
        link = Path(node.sysfs, "class", "net", f"eth{i}")
        link.unlink()
        link.symlink_to(f"/sys/class/net/eth{i}")
    out = subprocess.run(
        [*netns.exec_prefix, sys.executable, "-c", HEALTH, node.sysfs, node.dev],
        check=True,
        capture_output=True,
        text=True,
    )
    seen = json.loads(out.stdout)
    by = {(c["name"], c["nic"]): c for c in seen["checks"]}
    failed = sorted(k for k, c in by.items() if not c["passed"])
    assert failed == [
        ("link_flap", "mlx5_0"),
        ("mtu", "mlx5_1"),
        ("mtu_consistent", "mlx5_1"),
        ("netdev_link", "mlx5_1"),
    ], seen
    assert by["mtu", "mlx5_0"]["message"].endswith("RoCE active MTU 4096 (derived from eth0 MTU 4200)")
    assert "RoCE active MTU 1024 (derived from eth1 MTU 1500)" in by["mtu", "mlx5_1"]["message"]
    # the kernel's own words for a veth whose peer is down
    assert by["netdev_link", "mlx5_1"]["message"].startswith("mlx5_1: eth1 is lowerlayerdown (no carrier)")
    assert by["netdev_link", "mlx5_0"]["message"] == "mlx5_0: eth0 up with carrier"
    flap = by["link_flap", "mlx5_0"]["message"]
    assert "eth0 carrier_changes" in flap and flap.startswith("mlx5_0: the link went down within "), flap
    assert by["link_flap", "mlx5_1"]["passed"]
    assert seen["dcb_errno"] == {"eth0": errno.EOPNOTSUPP, "rdp-nosuch0": errno.ENODEV}
    assert seen["trust_source"] == ("no qos/trust in sysfs and DCB netlink: its driver has no DCB support (EOPNOTSUPP)")
    assert seen["pfc_source"] == "DCB netlink: its driver has no DCB support (EOPNOTSUPP)"
