"""Ansible at fleet scale: per-host cost of ping and validate over an N-host fixture inventory.

Generates an inventory of N hosts (``ansible_connection: local``), each pointing its
rdma_*_root variables at one of a few kernel-shaped fixture nodes (most healthy, some
broken, one with a missing sysfs root), then runs, over the same inventory:

- ``ping``:     ``ansible -m ansible.builtin.ping`` (the floor: one module run per host);
- ``validate``: ``playbooks/validate.yml`` (report only, no enforcement);

and prints, per phase, the wall time, wall and CPU time per host, the ratio to ping and the
controller's peak RSS, with the load average beside them (the machine is shared: figures
are noisy). ``--write-results`` puts the table into bench/RESULTS.md (section "Ansible fleet").
Deploy and verify are not run per host here: the local target runs one plugin per machine
and the cluster target needs a cluster (their per-run work is one render/one k8s_info list).

    .venv/bin/python bench/fleet.py --hosts 120 [--hosts 1000] [--forks 20] [--write-results]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from rdma_device_plugin.node import fixtures

ROOT = Path(__file__).resolve().parent.parent
VENV_BIN = Path(sys.executable).parent
SECTION = "## Ansible fleet (bench/fleet.py)"


@dataclass(frozen=True)
class Figure:
    hosts: int
    phase: str
    wall_s: float
    cpu_s: float
    max_rss_mb: float
    load: tuple[float, float, float]

    @property
    def per_host_s(self) -> float:
        return self.wall_s / self.hosts


def write_fixtures(base: Path) -> list[tuple[str, str]]:
    """A few fixture nodes: (name, root); a missing root stands for a wrongly set inventory."""
    node = fixtures.lingjun_node(nics=4)
    nodes = {
        "healthy": node,
        "port-down": fixtures.with_nic_changes(node, "mlx5_bond_1", port_state="DOWN", phys_state="Disabled"),
        "fw-mismatch": fixtures.with_nic_changes(node, "mlx5_bond_2", fw_ver="28.41.1000"),
    }
    out = []
    for name, spec in nodes.items():
        fixtures.write_node(str(base / name), spec)
        out.append((name, str(base / name)))
    out.append(("missing-root", str(base / "no-such-node")))
    return out


def write_inventory(base: Path, hosts: int, nodes: list[tuple[str, str]]) -> Path:
    """JSON inventory (a YAML subset): 9 of 10 hosts healthy, the rest cycle through the broken nodes."""
    host_vars = {}
    for i in range(hosts):
        name, root = nodes[0] if i % 10 else nodes[1 + (i // 10) % (len(nodes) - 1)]
        host_vars[f"node-{i:05d}"] = {
            "rdma_sysfs_root": f"{root}/sys",
            "rdma_procfs_root": f"{root}/proc",
            "rdma_dev_root": f"{root}/dev",
            "fixture": name,
        }
    inventory = {
        "all": {
            "vars": {
                "ansible_connection": "local",
                "ansible_python_interpreter": sys.executable,
                "rdma_validation_report_dir": str(base / "report"),
                "rdma_nic_validate_expected_nics": 4,
                "rdma_nic_validate_link_layer": "Ethernet",
                "rdma_non_host_network": True,
            },
            "children": {"rdma_nodes": {"hosts": host_vars}},
        }
    }
    path = base / "inventory.yml"
    path.write_text(json.dumps(inventory))
    return path


def run(phase: str, argv: list[str], hosts: int, env: dict[str, str]) -> Figure:
    """Run one phase in a child that reports its descendants' peak RSS and CPU (the controller tree)."""
    probe = (
        "import json, resource, subprocess, sys;"
        "rc = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL).returncode;"
        "u = resource.getrusage(resource.RUSAGE_CHILDREN);"
        "print(json.dumps({'rc': rc, 'cpu': u.ru_utime + u.ru_stime, 'rss_kb': u.ru_maxrss}))"
    )
    load = os.getloadavg()
    start = time.monotonic()
    out = subprocess.run([sys.executable, "-c", probe, *argv], env=env, check=True, capture_output=True, text=True)
    wall = time.monotonic() - start
    got = json.loads(out.stdout.strip().splitlines()[-1])
    if got["rc"] not in (0, 2, 4):  # 2/4: failed/unreachable hosts are part of the fixture fleet
        raise SystemExit(f"{phase} exited {got['rc']}: {' '.join(argv)}")
    return Figure(hosts, phase, wall, got["cpu"], got["rss_kb"] / 1024, (load[0], load[1], load[2]))


def bench(hosts: int, forks: int) -> list[Figure]:
    env = dict(os.environ, ANSIBLE_CONFIG=str(ROOT / "ansible.cfg"), ANSIBLE_FORKS=str(forks))
    env["PATH"] = f"{VENV_BIN}:{env.get('PATH', '')}"
    with tempfile.TemporaryDirectory(prefix="rdp-fleet-") as tmp:
        base = Path(tmp)
        inventory = write_inventory(base, hosts, write_fixtures(base))
        ping = run(
            "ping",
            [str(VENV_BIN / "ansible"), "rdma_nodes", "-i", str(inventory), "-m", "ansible.builtin.ping"],
            hosts,
            env,
        )
        validate = run(
            "validate",
            [
                str(VENV_BIN / "ansible-playbook"),
                "-i",
                str(inventory),
                str(ROOT / "playbooks" / "validate.yml"),
                "-e",
                "rdma_validation_enforce=false",
            ],
            hosts,
            env,
        )
        report = json.loads((base / "report" / "rdma-validation.json").read_text())
        if report["total"] != hosts:
            raise SystemExit(f"the report lists {report['total']} hosts, not {hosts}")
    return [ping, validate]


def table(figures: list[Figure]) -> str:
    lines = [
        "| hosts | phase | wall s | s/host | x ping/host | CPU s/host | controller peak RSS MB | load avg at start |",
        "|---|---|---|---|---|---|---|---|",
    ]
    ping = {f.hosts: f for f in figures if f.phase == "ping"}
    for f in figures:
        ratio = f.per_host_s / ping[f.hosts].per_host_s if f.hosts in ping else float("nan")
        lines.append(
            f"| {f.hosts} | {f.phase} | {f.wall_s:.1f} | {f.per_host_s:.3f} | {ratio:.2f} | {f.cpu_s / f.hosts:.3f} "
            f"| {f.max_rss_mb:.0f} | {' '.join(f'{x:.2f}' for x in f.load)} |"
        )
    return "\n".join(lines)


def write_results(text: str, forks: int) -> None:
    path = ROOT / "bench" / "RESULTS.md"
    old = path.read_text()
    section = (
        f"{SECTION}\n\n`bench/fleet.py`, forks {forks}, `ansible_connection: local`, fixture nodes (1 in 10 broken).\n"
        f"Goal: validate per host <= 1.5x ping per host at 100-200 hosts; 1000 hosts in under 4 min on a quiet\n"
        f"machine. The machine is shared: compare the load average column before comparing runs.\n\n{text}\n"
    )
    if SECTION in old:
        head, _, rest = old.partition(SECTION)
        tail = rest[rest.find("\n## ") :] if "\n## " in rest else ""
        new = head + section + tail
    else:
        new = old.rstrip("\n") + "\n\n" + section
    path.write_text(new)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hosts", type=int, action="append", help="fleet size (repeatable; default 120)")
    parser.add_argument("--forks", type=int, default=20)
    parser.add_argument("--write-results", action="store_true", help="write the table into bench/RESULTS.md")
    args = parser.parse_args()
    figures: list[Figure] = []
    for hosts in args.hosts or [120]:
        figures += bench(hosts, args.forks)
        print(table(figures), flush=True)
    if args.write_results:
        write_results(table(figures), args.forks)
    print(f"peak RSS of this process: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MB")


if __name__ == "__main__":
    main()
