"""rdma_node_info and pyverbs, for real: the module run by Ansible (AnsiballZ) with an
interpreter that has Debian's python3-pyverbs (on this machine ``get_device_list()`` raises:
no RDMA device) and with one that has no pyverbs (this venv's)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import node_info

from rdma_node import fixtures

SYSTEM_PYTHON = "/usr/bin/python3"


def _has_pyverbs(python: str) -> bool:
    probe = subprocess.run([python, "-c", "import pyverbs.device"], capture_output=True, check=False)
    return probe.returncode == 0


@pytest.mark.skipif(not _has_pyverbs(SYSTEM_PYTHON), reason="no python3-pyverbs for /usr/bin/python3")
@pytest.mark.skipif(any(Path("/sys/class/infiniband").glob("*")), reason="this machine has RDMA devices")
def test_system_pyverbs_cannot_list_devices_and_module_uses_sysfs() -> None:
    result = node_info(SYSTEM_PYTHON)
    verbs = result["node"]["verbs"]
    assert verbs.startswith("pyverbs could not list devices (PyverbsRDMAError: "), verbs
    assert verbs.endswith(": sysfs only"), verbs
    checks = result["node"]["checks"]["rdma_nic_validate"]
    assert [c for c in checks if c["name"] == "verbs_open"] == []  # sysfs lists no NIC here: nothing to blame


def test_without_pyverbs_module_says_so_once() -> None:
    assert not _has_pyverbs(sys.executable), "this venv must not have pyverbs for this test"
    result = node_info(sys.executable)
    assert result["node"]["verbs"] == "pyverbs not importable: sysfs only"
    assert json.dumps(result).count("pyverbs") == 1


def test_fixture_roots_do_not_consult_verbs(tmp_path: Path) -> None:
    node = fixtures.write_node(str(tmp_path / "n"), fixtures.lingjun_node(nics=2))
    result = node_info(SYSTEM_PYTHON, f"sysfs_root={node.sysfs}", f"procfs_root={node.procfs}", f"dev_root={node.dev}")
    assert result["node"]["verbs"].startswith("pyverbs not used: libibverbs reads /sys and /dev")
    assert len(result["node"]["nics"]) == 2
