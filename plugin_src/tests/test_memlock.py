"""node.memlock: /proc/<pid>/limits as the kernel prints it (this process's own), systemd's
LimitMEMLOCK= values and the unit/drop-in precedence."""

from __future__ import annotations

import os
import resource
from pathlib import Path

import pytest

from rdma_node import memlock
from rdma_node.memlock import Limit


def test_this_process_limits() -> None:
    text = Path(f"/proc/{os.getpid()}/limits").read_text()
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    got = memlock.parse_limits(text)["Max locked memory"]
    infinity = resource.RLIM_INFINITY
    assert got == Limit(None if soft == infinity else soft, None if hard == infinity else hard)


@pytest.mark.parametrize(
    ("value", "limit"),
    [
        ("infinity", Limit(None, None)),
        ("8M", Limit(8 << 20, 8 << 20)),
        ("64K", Limit(65536, 65536)),
        ("65536", Limit(65536, 65536)),
        ("1G:infinity", Limit(1 << 30, None)),
        ("lots", None),
    ],
)
def test_systemd_values(value: str, limit: Limit | None) -> None:
    assert memlock.parse_systemd(value) == limit


def _unit(root: Path, rel: str, body: str) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(body)


def test_unit_precedence(tmp_path: Path) -> None:
    root = tmp_path
    assert memlock.unit_setting(str(root), "containerd.service") is None
    _unit(root, "lib/systemd/system/containerd.service", "[Service]\nLimitMEMLOCK=64K\n")
    _unit(root, "usr/lib/systemd/system/containerd.service", "[Service]\nLimitNOFILE=1048576\n")
    got = memlock.unit_setting(str(root), "containerd.service")
    assert got is not None and got.value is None  # /usr/lib wins over /lib and sets nothing
    assert got.source.startswith("systemd's built-in default")
    _unit(root, "etc/systemd/system.conf", "[Manager]\n#DefaultLimitMEMLOCK=1M\nDefaultLimitMEMLOCK=16M\n")
    got = memlock.unit_setting(str(root), "containerd.service")
    assert got is not None and (got.value, got.source) == ("16M", "etc/systemd/system.conf")
    _unit(root, "usr/lib/systemd/system/containerd.service.d/20-rdma.conf", "[Service]\nLimitMEMLOCK=infinity\n")
    _unit(root, "etc/systemd/system/containerd.service.d/10-site.conf", "[Service]\nLimitMEMLOCK=8M\n")
    got = memlock.unit_setting(str(root), "containerd.service")  # drop-ins in name order: 20-rdma last
    assert got is not None and (got.value, got.source) == (
        "infinity",
        "usr/lib/systemd/system/containerd.service.d/20-rdma.conf",
    )
    _unit(
        root, "etc/systemd/system/containerd.service.d/20-rdma.conf", "[Service]\nLimitMEMLOCK=\n"
    )  # hides and resets
    got = memlock.unit_setting(str(root), "containerd.service")
    assert got is not None and got.value == "16M" and got.source == "etc/systemd/system.conf"
    _unit(root, "etc/systemd/system/containerd.service.d/30-other.conf", "[Unit]\nLimitMEMLOCK=1\n")  # not [Service]
    got = memlock.unit_setting(str(root), "containerd.service")
    assert got is not None and got.value == "16M"


def test_rows_that_do_not_parse_are_left_out() -> None:
    text = (
        "Limit Soft Limit Hard Limit Units\n"
        "Max locked memory         \n"
        "Max open files            1024                 4096                 files\n"
    )
    assert memlock.parse_limits(text) == {"Max open files": Limit(1024, 4096)}
