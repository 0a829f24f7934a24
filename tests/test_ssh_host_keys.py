"""SSH host key checking with the project's ansible.cfg: a real sshd (Debian's openssh-server) on
127.0.0.1 whose host key the inventory's known_hosts file does not pin is refused, as is one whose
pinned key differs; pinned from the trusted source (here: the public key file sshd was given, not a
scan of whatever answers on the port), the same host is reached (docs/security.md, "SSH host keys")."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import BIN, ROOT, ansible_env

sys.path.insert(0, str(ROOT / "scripts"))
from kube_pytest import wait_for

SSHD = shutil.which("sshd") or "/usr/sbin/sshd"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _keygen(path: Path) -> str:
    """A new ed25519 key pair at ``path``; its public key as known_hosts takes it ("<type> <base64>")."""
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(path)], check=True)
    return " ".join(path.with_suffix(".pub").read_text().split()[:2])


@pytest.fixture
def sshd(tmp_path: Path) -> Iterator[tuple[int, Path, str]]:
    """sshd on 127.0.0.1:<port> in the foreground (key authentication only), its host key (public part)."""
    if not Path(SSHD).exists():
        pytest.fail("no sshd: install openssh-server (scripts/system-packages.txt, make system-deps)")
    host_pub = _keygen(tmp_path / "host_ed25519")
    client_pub = _keygen(tmp_path / "client_ed25519")
    (tmp_path / "authorized_keys").write_text(client_pub + "\n")
    (tmp_path / "authorized_keys").chmod(0o600)
    port = _free_port()
    config = tmp_path / "sshd_config"
    config.write_text(
        f"Port {port}\nListenAddress 127.0.0.1\nHostKey {tmp_path / 'host_ed25519'}\n"
        f"AuthorizedKeysFile {tmp_path / 'authorized_keys'}\nPidFile {tmp_path / 'sshd.pid'}\n"
        "PasswordAuthentication no\nKbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\n"
        "PermitRootLogin prohibit-password\n"
    )
    Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # its privilege separation directory
    proc = subprocess.Popen([SSHD, "-D", "-e", "-f", str(config)], stderr=subprocess.PIPE, text=True)
    try:

        def listening() -> bool:
            if proc.poll() is not None:
                pytest.fail(f"sshd exited: {proc.stderr.read() if proc.stderr else ''}")
            with socket.socket() as s:
                return s.connect_ex(("127.0.0.1", port)) == 0

        assert wait_for(listening, timeout=60)
        yield port, tmp_path, host_pub
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _ping(tmp_path: Path, port: int) -> dict[str, Any]:
    """ansible -m ping over ssh with this repository's ansible.cfg and an inventory that names its
    known_hosts file, as the example inventory does."""
    inventory = tmp_path / "inventory" / "hosts.yml"
    inventory.parent.mkdir(exist_ok=True)
    host = {
        "ansible_host": "127.0.0.1",
        "ansible_port": port,
        "ansible_user": "root",
        "ansible_ssh_private_key_file": str(tmp_path / "client_ed25519"),
        "ansible_python_interpreter": str(BIN / "python"),
    }
    # The example inventory's setting (inventories/lingjun-example/hosts.yml), verbatim.
    example = yaml.safe_load((ROOT / "inventories/lingjun-example/hosts.yml").read_text())
    common = example["all"]["children"]["rdma_nodes"]["vars"]["ansible_ssh_common_args"]
    assert "{{ inventory_dir }}/known_hosts" in common
    inventory.write_text(
        yaml.safe_dump({"all": {"hosts": {"node-a": host}, "vars": {"ansible_ssh_common_args": common}}})
    )
    run = subprocess.run(
        [str(BIN / "ansible"), "node-a", "-i", str(inventory), "-m", "ping"],
        cwd=ROOT,
        # a control socket of this test's own, so that no earlier connection is reused
        env={
            **ansible_env(),
            "ANSIBLE_SSH_CONTROL_PATH_DIR": str(tmp_path / "cp"),
            "ANSIBLE_STDOUT_CALLBACK": "json",
            "ANSIBLE_LOAD_CALLBACK_PLUGINS": "1",
        },
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    result: dict[str, Any] = json.loads(run.stdout)["plays"][0]["tasks"][0]["hosts"]["node-a"]
    return result


def test_an_unpinned_or_changed_host_key_is_refused_and_a_pinned_one_accepted(sshd: tuple[int, Path, str]) -> None:
    port, tmp_path, host_pub = sshd
    known = tmp_path / "inventory" / "known_hosts"
    known.parent.mkdir(exist_ok=True)

    unknown = _ping(tmp_path, port)
    assert unknown.get("unreachable") and "Host key verification failed" in unknown["msg"], unknown
    assert not known.exists()  # nothing was learnt on the way (no trust on first use)

    other = _keygen(tmp_path / "other_ed25519")
    known.write_text(f"[127.0.0.1]:{port} {other}\n")
    changed = _ping(tmp_path, port)
    assert changed.get("unreachable") and "Host key verification failed" in changed["msg"], changed

    known.write_text(f"[127.0.0.1]:{port} {host_pub}\n")
    pinned = _ping(tmp_path, port)
    assert pinned.get("ping") == "pong" and not pinned.get("unreachable"), pinned
