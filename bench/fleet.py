"""Ansible at fleet scale: per-host cost of ping, validate, deploy and verify over an N-host fixture inventory.

Generates an inventory of N hosts (``ansible_connection: local``), each pointing its
rdma_*_root variables at one of a few kernel-shaped fixture nodes (9 in 10 healthy, the rest a
port down, a firmware mismatch, or a missing sysfs root), then runs, over the same inventory,
each phase as its own ``ansible-playbook``/``ansible`` process:

- ``ping``:     ``ansible -m ansible.builtin.ping`` (the floor: one module run per host);
- ``validate``: ``playbooks/validate.yml -e rdma_validation_enforce=false``: per host one
  ``rdma_node_info`` run (reads the fixture node, returns the finished checks as the
  ``rdma_validation`` fact), the inventory checks once per play, the report written once on the
  controller (the bench checks that it lists all N hosts);
- ``deploy``:   ``playbooks/deploy.yml`` with the cluster target and
  ``plugin_deploy_render_only=true`` (there is no Helm binary or cluster here): per host the
  chart values rendered from the inventory (``set_fact``); once per play the per-host-values
  refusal and the IPv6 guard over every host's ``rdma_validation``, the values validated against
  the chart schema and the chart rendered by the real Helm engine into files (the one release);
- ``verify``:   ``playbooks/verify.yml`` with the cluster target against the Kubernetes API
  emulator (``scripts/kube-emulator.py``, seeded with N Node objects advertising the shared
  numbers and the chart's DaemonSets rolled out): per host the expected numbers noted and
  compared; once per play one labelled ``k8s_info`` list of the nodes and one of the DaemonSets.

With deploy or verify, every phase but ping runs with the ``jsonfile`` fact cache in the bench's
temporary directory, so that deploy and verify see the ``rdma_validation`` facts of the
validate run, as they do inside ``playbooks/site.yml``.

``--fake-facts`` replaces each host's node read by the stand-in in ``bench/fleet_plugins/``
(the real module runs once per fixture node; every host gets exactly that result with its
own host name), so that 5000 hosts take minutes instead of half an hour; everything else of
the play stays real. Use it for the controller memory at 5000 hosts, not for the per-host time.

Prints, per phase, the wall time, wall and CPU time per host, the ratio to ping and the peak
RSS of the largest process of the run (the controller or one of its forks), with the load
average beside them (the machine is shared: figures are noisy). ``--write-results`` puts the
table into bench/RESULTS.md (section "Ansible fleet").

    .venv/bin/python bench/fleet.py --hosts 120 [--hosts 1000] [--forks 20] [--write-results]
    .venv/bin/python bench/fleet.py --hosts 5000 --phase validate --fake-facts   # memory
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from rdma_device_plugin.node import fixtures

ROOT = Path(__file__).resolve().parent.parent
VENV_BIN = Path(sys.executable).parent
SECTION = "## Ansible fleet (bench/fleet.py)"
MEMORY_SECTION = "## Ansible fleet: controller memory (bench/fleet.py --fake-facts)"
FAKE_PLUGINS = ROOT / "bench" / "fleet_plugins" / "action"
PHASES = ("ping", "validate", "deploy", "verify")
REPORT_KEYS = ("total", "passed", "failed", "not_validated")
READY_KEYS = ("desiredNumberScheduled", "updatedNumberScheduled", "numberReady", "numberAvailable")


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


def run(phase: str, argv: list[str], hosts: int, env: dict[str, str], ok_rc: tuple[int, ...] = (0, 2, 4)) -> Figure:
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
    if got["rc"] not in ok_rc:  # validate: 2/4, failed/unreachable hosts are part of the fixture fleet
        raise SystemExit(f"{phase} exited {got['rc']}: {' '.join(argv)}")
    return Figure(hosts, phase, wall, got["cpu"], got["rss_kb"] / 1024, (load[0], load[1], load[2]))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def seed_cluster(kubeconfig: Path, hosts: int) -> None:
    """N Node objects advertising the shared numbers and the chart's DaemonSets, rolled out."""
    server = yaml.safe_load(kubeconfig.read_text())["clusters"][0]["cluster"]["server"]

    def post(path: str, obj: dict[str, Any]) -> None:
        req = urllib.request.Request(
            server + path, data=json.dumps(obj).encode(), headers={"Content-Type": "application/json"}, method="POST"
        )
        with urllib.request.urlopen(req, timeout=30):
            pass

    for i in range(hosts):
        post(
            "/api/v1/nodes",
            {
                "apiVersion": "v1",
                "kind": "Node",
                "metadata": {"name": f"node-{i:05d}", "labels": {}},
                "status": {
                    "capacity": {"cpu": "192", "rdma/hca": "1k"},
                    "allocatable": {"cpu": "189", "rdma/hca": "1k"},
                },
            },
        )
    status = {"observedGeneration": 1, **dict.fromkeys(READY_KEYS, hosts)}
    labels = {"app.kubernetes.io/instance": "rdma", "app.kubernetes.io/component": "device-plugin"}
    for mode in ("shared", "exclusive"):
        ds_status = status if mode == "shared" else {"observedGeneration": 1, **dict.fromkeys(READY_KEYS, 0)}
        post(
            "/apis/apps/v1/namespaces/kube-system/daemonsets",
            {
                "apiVersion": "apps/v1",
                "kind": "DaemonSet",
                "metadata": {
                    "name": f"rdma-rdma-device-plugin-{mode}",
                    "namespace": "kube-system",
                    "generation": 1,
                    "labels": {**labels, "rdma.lingjun.io/mode": mode},
                },
                "spec": {},
                "status": ds_status,
            },
        )


def bench(hosts: int, forks: int, phases: list[str], fake_facts: bool) -> list[Figure]:
    env = dict(os.environ, ANSIBLE_CONFIG=str(ROOT / "ansible.cfg"), ANSIBLE_FORKS=str(forks))
    env["PATH"] = f"{VENV_BIN}:{env.get('PATH', '')}"
    playbook = [str(VENV_BIN / "ansible-playbook")]
    figures = []
    with tempfile.TemporaryDirectory(prefix="rdp-fleet-") as tmp:
        base = Path(tmp)
        if fake_facts:
            (base / "fake").mkdir()
            env["ANSIBLE_ACTION_PLUGINS"] = f"{FAKE_PLUGINS}:{ROOT / 'action_plugins'}"  # replaces ansible.cfg's
            env["RDMA_FLEET_FAKE_CACHE"] = str(base / "fake")
        inventory = write_inventory(base, hosts, write_fixtures(base))
        suffix = " (fake facts)" if fake_facts else ""
        if "ping" in phases:
            ping = [str(VENV_BIN / "ansible"), "rdma_nodes", "-i", str(inventory), "-m", "ansible.builtin.ping"]
            figures.append(run("ping", ping, hosts, env))
        if "deploy" in phases or "verify" in phases:
            # What site.yml keeps in memory between its plays, kept on disk between the phases.
            env.update(ANSIBLE_CACHE_PLUGIN="jsonfile", ANSIBLE_CACHE_PLUGIN_CONNECTION=str(base / "facts"))
        if "validate" in phases:
            validate = [*playbook, "-i", str(inventory), str(ROOT / "playbooks" / "validate.yml")]
            figures.append(run("validate" + suffix, [*validate, "-e", "rdma_validation_enforce=false"], hosts, env))
            report = json.loads((base / "report" / "rdma-validation.json").read_text())
            if report["total"] != hosts:
                raise SystemExit(f"the report lists {report['total']} hosts, not {hosts}")
            counts = {k: len(v) if isinstance(v, list) else v for k in REPORT_KEYS for v in [report[k]]}
            print(f"validate report: {counts}", flush=True)
        cluster = ["-e", "rdma_deploy_target=cluster"]
        if "deploy" in phases:
            deploy = [*playbook, "-i", str(inventory), str(ROOT / "playbooks" / "deploy.yml"), *cluster]
            deploy += ["-e", "plugin_deploy_render_only=true", "-e", f"plugin_deploy_values_dir={base / 'values'}"]
            deploy += ["-e", f"plugin_deploy_manifests_dir={base / 'manifests'}"]
            figures.append(run("deploy (render only)" + suffix, deploy, hosts, env))
            if not list((base / "manifests").glob("*.yaml")):
                raise SystemExit("deploy rendered no manifests")
        if "verify" in phases:
            kubeconfig = base / "emulator" / "kubeconfig"
            emulator = [sys.executable, str(ROOT / "scripts" / "kube-emulator.py")]
            start = ["start", "--port", str(free_port()), "--kubeconfig", str(kubeconfig)]
            subprocess.run([*emulator, *start], check=True, stdout=subprocess.DEVNULL)
            try:
                seed_cluster(kubeconfig, hosts)
                verify = [*playbook, "-i", str(inventory), str(ROOT / "playbooks" / "verify.yml"), *cluster]
                verify += ["-e", f"rdma_kubeconfig={kubeconfig}", "-e", "plugin_verify_timeout=4"]
                figures.append(run("verify (API emulator)" + suffix, verify, hosts, env, ok_rc=(0,)))
            finally:
                stop = ["stop", "--kubeconfig", str(kubeconfig)]
                subprocess.run([*emulator, *stop], check=True, stdout=subprocess.DEVNULL)
    return figures


def table(figures: list[Figure]) -> str:
    lines = [
        "| hosts | phase | wall s | s/host | x ping/host | CPU s/host | peak RSS MB | load avg at start |",
        "|---|---|---|---|---|---|---|---|",
    ]
    ping = {f.hosts: f for f in figures if f.phase == "ping"}
    for f in figures:
        ratio = f"{f.per_host_s / ping[f.hosts].per_host_s:.2f}" if f.hosts in ping else "-"
        lines.append(
            f"| {f.hosts} | {f.phase} | {f.wall_s:.1f} | {f.per_host_s:.3f} | {ratio} | {f.cpu_s / f.hosts:.3f} "
            f"| {f.max_rss_mb:.0f} | {' '.join(f'{x:.2f}' for x in f.load)} |"
        )
    return "\n".join(lines)


def write_results(text: str, forks: int, fake_facts: bool) -> None:
    """Replace this run's section of bench/RESULTS.md (the timing one, or the memory one with --fake-facts)."""
    path = ROOT / "bench" / "RESULTS.md"
    old = path.read_text()
    heading = MEMORY_SECTION if fake_facts else SECTION
    intro = (
        "Each host's node read replaced by the real module's result for its fixture node (`bench/fleet_plugins/`);\n"
        "the rest of validate.yml real. Goal: the largest process of the run under 500 MB at 5000 hosts."
        if fake_facts
        else "Goal: validate per host <= 1.5x ping per host at 100-200 hosts; 1000 hosts in under 4 min on a quiet\n"
        "machine. The machine is shared: compare the load average column before comparing runs."
    )
    section = (
        f"{heading}\n\n`bench/fleet.py`, forks {forks}, `ansible_connection: local`, fixture nodes (1 in 10 broken).\n"
        f"{intro}\n\n{text}\n"
    )
    if heading in old:
        head, _, rest = old.partition(heading)
        tail = rest[rest.find("\n## ") :] if "\n## " in rest else ""
        new = head + section + tail
    else:
        new = old.rstrip("\n") + "\n\n" + section
    path.write_text(new)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hosts", type=int, action="append", help="fleet size (repeatable; default 120)")
    parser.add_argument("--forks", type=int, default=20)
    parser.add_argument("--phase", choices=PHASES, action="append", help="phases to run (repeatable; default all)")
    parser.add_argument(
        "--fake-facts",
        action="store_true",
        help="validate with the rdma_node_info stand-in (bench/fleet_plugins): controller memory at 5000 hosts",
    )
    parser.add_argument("--write-results", action="store_true", help="write the table into bench/RESULTS.md")
    args = parser.parse_args()
    figures: list[Figure] = []
    for hosts in args.hosts or [120]:
        figures += bench(hosts, args.forks, args.phase or list(PHASES), args.fake_facts)
        print(table(figures), flush=True)
    if args.write_results:
        write_results(table(figures), args.forks, args.fake_facts)
    print(f"peak RSS of this process: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MB")


if __name__ == "__main__":
    main()
