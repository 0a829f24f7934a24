"""node.netdev on bonds: /proc/net/bonding/<bond> as bond_procfs.c prints it (for root, with the
LACP details, and for everyone else; before and after churn states were printed), and the
fixture's bonds read back."""

from __future__ import annotations

from pathlib import Path

from rdma_node import fixtures, netdev

# Linux 6.x, read as root (CAP_NET_ADMIN adds the system and active-aggregator lines and the
# per-slave "details ... lacp pdu" blocks, indented).
ROOT_VIEW = """Ethernet Channel Bonding Driver: v6.8.0-45-generic

Bonding Mode: IEEE 802.3ad Dynamic link aggregation
Transmit Hash Policy: layer3+4 (1)
MII Status: up
MII Polling Interval (ms): 100
Up Delay (ms): 0
Down Delay (ms): 0
Peer Notification Delay (ms): 0

802.3ad info
LACP active: on
LACP rate: fast
Min links: 0
Aggregator selection policy (ad_select): stable
System priority: 65535
System MAC address: b8:ce:f6:1a:00:01
Active Aggregator Info:
\tAggregator ID: 1
\tNumber of ports: 2
\tActor Key: 15
\tPartner Key: 32769
\tPartner Mac Address: 00:00:5e:00:01:01

Slave Interface: eth0
MII Status: up
Speed: 200000 Mbps
Duplex: full
Link Failure Count: 2
Permanent HW addr: b8:ce:f6:1a:00:01
Slave queue ID: 0
Aggregator ID: 1
Actor Churn State: none
Partner Churn State: none
Actor Churned Count: 0
Partner Churned Count: 0
details actor lacp pdu:
    system priority: 65535
    system mac address: b8:ce:f6:1a:00:01
    port key: 15
    port priority: 255
    port number: 1
    port state: 63
details partner lacp pdu:
    system priority: 32768
    system mac address: 00:00:5e:00:01:01
    oper key: 32769
    port priority: 32768
    port number: 257
    port state: 63

Slave Interface: eth1
MII Status: going down
Speed: 200000 Mbps
Duplex: full
Link Failure Count: 3
Permanent HW addr: b8:ce:f6:1a:00:02
Slave queue ID: 0
Aggregator ID: N/A
"""

# Linux 4.x for a user: no churn lines, no details
OLD_VIEW = """Ethernet Channel Bonding Driver: v3.7.1 (April 27, 2011)

Bonding Mode: fault-tolerance (active-backup)
Primary Slave: None
Currently Active Slave: eth0
MII Status: up
MII Polling Interval (ms): 100
Up Delay (ms): 0
Down Delay (ms): 0

Slave Interface: eth0
MII Status: up
Speed: 25000 Mbps
Duplex: full
Link Failure Count: 0
Permanent HW addr: 0c:42:a1:00:00:01
Slave queue ID: 0
"""


def test_parse_the_root_view() -> None:
    master, slaves = netdev.parse_bonding(ROOT_VIEW)
    assert master["Bonding Mode"] == "IEEE 802.3ad Dynamic link aggregation"
    assert master["MII Status"] == "up" and "Aggregator ID" not in master  # the indented active-aggregator lines
    assert [s["Slave Interface"] for s in slaves] == ["eth0", "eth1"]
    assert slaves[0]["Aggregator ID"] == "1" and slaves[0]["Partner Churn State"] == "none"
    assert "port state" not in slaves[0] and slaves[0]["Link Failure Count"] == "2"
    assert slaves[1]["MII Status"] == "going down" and slaves[1]["Aggregator ID"] == "N/A"


def test_parse_an_older_kernel() -> None:
    master, slaves = netdev.parse_bonding(OLD_VIEW)
    assert netdev.MODE_NAMES[master["Bonding Mode"]] == "active-backup"
    assert slaves == [
        {
            "Slave Interface": "eth0",
            "MII Status": "up",
            "Speed": "25000 Mbps",
            "Duplex": "full",
            "Link Failure Count": "0",
            "Permanent HW addr": "0c:42:a1:00:00:01",
            "Slave queue ID": "0",
        }
    ]


def test_read_the_fixture_bond(short_tmp: Path) -> None:
    spec = fixtures.with_nic_changes(fixtures.lingjun_node(nics=2), "mlx5_bond_1", members_down=("eth3",))
    node = fixtures.write_node(str(short_tmp / "n"), spec)
    healthy = netdev.read_bond(node.sysfs, node.procfs, "bond0")
    assert healthy is not None and healthy.mode == "802.3ad" and healthy.mii_status == "up" and healthy.proc
    assert [(s.name, s.aggregator_id, s.partner_churn, s.partner_in_service) for s in healthy.slaves] == [
        ("eth0", "1", "none", True),
        ("eth1", "1", "none", True),
    ]
    broken = netdev.read_bond(node.sysfs, node.procfs, "bond1")
    assert broken is not None
    eth3 = broken.slaves[1]
    assert (eth3.mii_status, eth3.link_failure_count, eth3.partner_state, eth3.partner_in_service) == (
        "down",
        1,
        fixtures.LACP_DEFAULTED,
        False,
    )
    assert netdev.read_bond(node.sysfs, node.procfs, "eth0") is None  # a slave is no bond
    member = netdev.read_netdev(node.sysfs, "eth3")
    assert (member.operstate, member.carrier, member.master, member.pci, member.link_up) == (
        "down",
        False,
        "bond1",
        True,
        False,
    )
    assert netdev.read_netdev(node.sysfs, "bond0").pci is False
    assert netdev.read_netdev(node.sysfs, "nope").exists is False
