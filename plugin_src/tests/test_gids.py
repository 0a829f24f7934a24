"""node.gids: the GID index NCCL picks (ncclIbGetGidIndex / ncclUpdateGidIndex), on GID tables as
a RoCE port shows them in sysfs (empty slots included) and on fixture nodes."""

from __future__ import annotations

import ipaddress
from pathlib import Path

import pytest

from rdma_node import fixtures, gids, sysfs
from rdma_node.sysfs import Gid, Port

LL = "fe80:0000:0000:0000:bace:f6ff:fe1a:0001"


def _v4(address: str) -> str:
    return ipaddress.IPv6Address(b"\0" * 10 + b"\xff\xff" + ipaddress.IPv4Address(address).packed).exploded


def _v6(address: str) -> str:
    return ipaddress.IPv6Address(address).exploded


def _port(entries: list[tuple[str, str] | None], link_layer: str = "Ethernet") -> Port:
    table = [Gid(i, g, t, "bond0") for i, e in enumerate(entries) if e is not None for g, t in [e]]
    return Port(1, "ACTIVE", "LinkUp", link_layer, "200 Gb/sec (4X HDR)", tuple(table), len(entries))


V1, V2 = "IB/RoCE v1", "RoCE v2"


@pytest.mark.parametrize(
    ("entries", "family", "expected"),
    [
        # the usual mlx5 table: link-local v1/v2, then IPv4 v1/v2 -> NCCL (AF_INET) takes the IPv4 RoCE v2
        ([(LL, V1), (LL, V2), (_v4("10.0.0.11"), V1), (_v4("10.0.0.11"), V2)], gids.AF_INET, 3),
        # IPv6 only: with AF_INET no candidate is of the family: NCCL stays at 0 (RoCE v1 link-local)
        ([(LL, V1), (LL, V2), (_v6("2408:4005:300::11"), V1), (_v6("2408:4005:300::11"), V2)], gids.AF_INET, 0),
        # ... and with AF_INET6 it takes the global IPv6 RoCE v2
        ([(LL, V1), (LL, V2), (_v6("2408:4005:300::11"), V1), (_v6("2408:4005:300::11"), V2)], gids.AF_INET6, 3),
        # both families, AF_INET6: IPv6 v2 wins over IPv4 and link-local
        ([(LL, V1), (LL, V2), (_v4("10.0.0.11"), V1), (_v4("10.0.0.11"), V2),
          (_v6("2408::11"), V1), (_v6("2408::11"), V2)], gids.AF_INET6, 5),
        # empty slots between entries (a removed address) are skipped
        ([(LL, V1), (LL, V2), None, None, (_v4("10.0.0.11"), V1), (_v4("10.0.0.11"), V2), None], gids.AF_INET, 5),
        # only a RoCE v1 IPv4 GID: the family switch takes it (first rule), no v2 replaces it
        ([(LL, V1), (LL, V2), (_v4("10.0.0.11"), V1)], gids.AF_INET, 2),
    ],
)  # fmt: skip
def test_roce_picks(entries: list[tuple[str, str] | None], family: str, expected: int) -> None:
    assert gids.nccl_gid_index(_port(entries), family) == expected


def test_addr_range_narrows_the_candidates() -> None:
    port = _port([(LL, V1), (LL, V2), (_v4("10.0.0.11"), V1), (_v4("10.0.0.11"), V2),
                  (_v4("192.168.1.5"), V1), (_v4("192.168.1.5"), V2)])  # fmt: skip
    assert gids.nccl_gid_index(port) == 3  # the first IPv4 RoCE v2
    assert gids.nccl_gid_index(port, addr_range="192.168.0.0/16") == 5
    assert gids.describe(port, 5) == "5 (RoCE v2 192.168.1.5)"
    assert gids.describe(port, 9) == "9 (empty)"


def test_infiniband_uses_the_routable_flid_index() -> None:
    plain = _port([("fe80:0000:0000:0000:b8ce:f603:001a:2b3c", ""), ("fe80:0000:0000:0000:b8ce:f603:001a:2b3d", "")],
                  "InfiniBand")  # fmt: skip
    assert gids.nccl_gid_index(plain) == 0
    flid = _port([("fe80:0000:0000:0000:b8ce:f603:001a:2b3c", ""), ("fec0:0000:0007:0001:b8ce:f603:001a:2b3c", "")],
                 "InfiniBand")  # fmt: skip
    assert gids.nccl_gid_index(flid) == 1  # bytes 4-5 (FLID 0x0007) non-zero


def test_fixture_ports(short_tmp: Path) -> None:
    spec = fixtures.with_nic_changes(fixtures.lingjun_node(nics=2), "mlx5_bond_1", ipv4=("10.0.1.11",))
    node = fixtures.write_node(str(short_tmp / "n"), spec)
    nics = {n.name: n for n in sysfs.read_nics(node.sysfs, node.dev)}
    port0, port1 = nics["mlx5_bond_0"].ports[0], nics["mlx5_bond_1"].ports[0]
    assert port0.gid_table_len == 4 and port1.gid_table_len == 6
    assert [gids.nccl_gid_index(p) for p in (port0, port1)] == [0, 3]
    assert [gids.nccl_gid_index(p, gids.AF_INET6) for p in (port0, port1)] == [3, 5]


def test_bad_family() -> None:
    with pytest.raises(ValueError, match="addr_family must be one of"):
        gids.nccl_gid_index(_port([(LL, V1)]), "AF_UNIX")


def test_a_garbled_entry_reads_as_empty() -> None:
    port = _port([(LL, V1), (LL, V2), ("not-a-gid", V2), (_v4("10.0.0.11"), V2)])
    assert gids.nccl_gid_index(port) == 3
    assert gids.describe(port, 2) == "2 (empty)"
