"""The IPv6 compute-network checks against a real kernel network stack.

A network namespace with veth devices named like a Lingjun node's bonds (bond0..bond3),
real IPv6 addresses (one healthy, one on a netdev with the real disable_ipv6 sysctl set,
one tentative, one dadfailed), real routes, read through the one reader (procfs.py /
ipv6checks.py) from /proc inside the netns, together with the fixture's RDMA sysfs whose
GIDs point at those netdevs. Needs root and iproute2 (skipped otherwise).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from rdma_device_plugin.kubesim.netns import Netns
from rdma_device_plugin.kubesim.netns import available as netns_available
from rdma_device_plugin.node import fixtures

pytestmark = pytest.mark.skipif(netns_available() is not None, reason=f"network namespaces: {netns_available()}")

READ = """
import json, sys
from rdma_device_plugin.node import ipv6checks, procfs, sysfs
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
