#!/usr/bin/python
# -*- coding: utf-8 -*-
"""Run the plugin and the kubelet simulator as background processes on the node (local deploy target)."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: rdma_local_plugin
short_description: Keep the kubelet simulator and C(rdma-device-plugin serve) running against a fixture node
description:
  - The local deploy target, without a cluster. Starts two detached background processes on the node,
    the kubelet simulator (C(python -m rdma_kubesim.sim_cli), which writes the node status to
    O(status_file)) and the plugin (C(python -m rdma_device_plugin serve --config ...)), and waits until
    the simulator reports every resource of the config registered.
  - Idempotent. Process ids and a fingerprint of each process's command line and config file are kept in
    O(run_dir)/local-plugin.json, each written the moment its process starts (before anything can fail); a
    process that is alive with the same fingerprint is left alone. A changed plugin config restarts only the
    plugin (as a DaemonSet rollout would), not the simulator.
  - A start that fails (the plugin cannot bind its metrics port, does not register, ...) stops every process
    it started before failing; O(state=stopped) (C(make stop)) ends every recorded process (by its pid, after
    checking the pid still runs it), also after a failed start.
  - With O(metrics), the plugin serves metrics on 127.0.0.1 at O(metrics_port), or, when it is 0, at a free
    port the kernel gives (kept across runs while the plugin runs with it); the address is recorded and
    returned (C(make status) shows it).
version_added: "0.1.0"
author: rdma-device-plugin maintainers
options:
  state:
    description: C(started) or C(stopped).
    type: str
    choices: [started, stopped]
    default: started
  run_dir:
    description: Directory for the state file and the process logs.
    type: path
    required: true
  python:
    description:
      - Python interpreter with the C(rdma_device_plugin) package and the kubelet simulator, C(rdma_kubesim)
        (a development package, installed by C(make setup)); default the module's own.
    type: path
  config_path:
    description: Plugin config file (the one extracted from the rendered chart).
    type: path
  sysfs_root:
    description: Fixture node sysfs root.
    type: path
  procfs_root:
    description: Fixture node procfs root.
    type: path
  dev_root:
    description: Fixture node dev root.
    type: path
  device_plugin_dir:
    description: Device-plugin dir shared by the simulator (C(kubelet.sock)) and the plugin (keep it short, unix sockets < 108 bytes).
    type: path
  status_file:
    description: JSON node status the simulator writes.
    type: path
  node_name:
    description: Node name the simulator reports.
    type: str
    default: lingjun-node-0
  resources:
    description: Resource names to wait for (default the C(resources[].name) of the config file).
    type: list
    elements: str
  timeout:
    description: Seconds to wait for the registration.
    type: int
    default: 30
  metrics:
    description: Serve Prometheus metrics on 127.0.0.1 (C(make prometheus-local) scrapes them).
    type: bool
    default: false
  metrics_port:
    description: The metrics port; 0 means a free port (the one recorded while the plugin runs with it).
    type: int
    default: 0
"""

EXAMPLES = r"""
- name: Run the plugin against the fixture node and the kubelet simulator
  rdma_local_plugin:
    run_dir: out/local/run
    config_path: out/local/config.yaml
    sysfs_root: out/local/node/sys
    procfs_root: out/local/node/proc
    dev_root: out/local/node/dev
    device_plugin_dir: out/local/dp
    status_file: out/local/run/node-status.json
"""

RETURN = r"""
status:
  description: The node status the simulator reports (node, registered, capacity, allocatable, registrations).
  type: dict
  returned: when state is started
pids:
  description: Process ids of the simulator and the plugin.
  type: dict
  returned: always
restarted:
  description: Which processes were (re)started in this run.
  type: list
  elements: str
  returned: always
metrics_address:
  description: C(127.0.0.1:PORT) of the plugin's metrics, empty when off.
  type: str
  returned: when state is started
"""

import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time

from ansible.module_utils.basic import AnsibleModule

STATE_FILE = "local-plugin.json"
# What a recorded pid must still be running to be ours: the plugin, or the simulator (rdma_kubesim).
MARKERS = ("rdma_device_plugin", "rdma_kubesim")


def _cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _running(pid):
    if not pid:
        return False
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as fh:
            if fh.read().rsplit(")", 1)[-1].split()[0] == "Z":
                return False
    except OSError:
        return False
    cmdline = _cmdline(pid)
    return any(marker in cmdline for marker in MARKERS)


def _stop(pid, timeout=10.0):
    if not _running(pid):
        return False
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not _running(pid):
            return True
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    return True


def _start(cmd, log_path):
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            close_fds=True,
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
        )
    return proc


def _stop_child(proc, timeout=10.0):
    """Stop a process this run started (its Popen: no /proc lookup, see _started_alive)."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _fingerprint(cmd, files=()):
    h = hashlib.sha256(json.dumps(cmd).encode())
    for path in files:
        with open(path, "rb") as fh:
            h.update(fh.read())
    return h.hexdigest()


def _read_json(path):
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _log_tail(path, lines=15):
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            return "".join(fh.readlines()[-lines:])
    except OSError:
        return ""


def _write_state(path, state):
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(state, fh, indent=2)
    os.replace(tmp, path)


def _port_free(port):
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the plugin's HTTP server binds
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _metrics_port(p, saved, plugin_alive):
    """The port to serve metrics on: the one asked for, else the recorded one while the plugin runs with it
    (or it is still free), else a free one."""
    if p["metrics_port"]:
        return p["metrics_port"]
    recorded = saved.get("metrics_address", "")
    port = int(recorded.rsplit(":", 1)[1]) if ":" in recorded else 0
    if port and (plugin_alive or _port_free(port)):
        return port
    return _free_port()


def _stop_all(state):
    """The plugin first, then the kubelet, as a node shutdown would; every recorded pid that still runs ours."""
    stopped = []
    for name in ("plugin", "simulator"):
        if _stop((state.get(name) or {}).get("pid")):
            stopped.append(name)
    return stopped



# Prints the plugin's socket-path (or config) problems for (config, device-plugin dir); exits 1 if any.
# The two packages the processes run (the simulator is a development package, not in the image).
_PACKAGES_CHECK = """
import importlib.util, sys
missing = [m for m in ("rdma_device_plugin", "rdma_kubesim") if importlib.util.find_spec(m) is None]
print(" ".join(missing))
sys.exit(1 if missing else 0)
"""

_SOCKET_CHECK = """
import sys
from rdma_device_plugin.config import ConfigError, load_config, socket_path_problems
try:
    problems = socket_path_problems(load_config(sys.argv[1]), sys.argv[2])
except ConfigError as exc:
    problems = [str(exc)]
print("; ".join(problems))
sys.exit(1 if problems else 0)
"""

def main():
    module = AnsibleModule(
        argument_spec=dict(
            state=dict(type="str", choices=["started", "stopped"], default="started"),
            run_dir=dict(type="path", required=True),
            python=dict(type="path"),
            config_path=dict(type="path"),
            sysfs_root=dict(type="path"),
            procfs_root=dict(type="path"),
            dev_root=dict(type="path"),
            device_plugin_dir=dict(type="path"),
            status_file=dict(type="path"),
            node_name=dict(type="str", default="lingjun-node-0"),
            resources=dict(type="list", elements="str"),
            timeout=dict(type="int", default=30),
            metrics=dict(type="bool", default=False),
            metrics_port=dict(type="int", default=0),
        ),
        required_if=[
            (
                "state",
                "started",
                ["config_path", "sysfs_root", "procfs_root", "dev_root", "device_plugin_dir", "status_file"],
            )
        ],
        supports_check_mode=True,
    )
    p = module.params
    run_dir = p["run_dir"]
    state_path = os.path.join(run_dir, STATE_FILE)
    saved = _read_json(state_path)
    pids = {"simulator": saved.get("simulator", {}).get("pid"), "plugin": saved.get("plugin", {}).get("pid")}

    if p["state"] == "stopped":
        alive = [name for name, pid in pids.items() if _running(pid)]
        if not module.check_mode:
            _stop_all(saved)
            if os.path.exists(state_path):
                os.unlink(state_path)
        module.exit_json(changed=bool(alive), pids=pids, restarted=[], stopped=alive)

    python = p["python"] or sys.executable
    if not os.path.isfile(p["config_path"]):
        module.fail_json(msg=f"plugin config {p['config_path']} does not exist")
    # The plugin's own rule (config.socket_path_problems: every pool's longest socket name), asked
    # before anything starts, so a long device_plugin_dir is named here and not in a log.
    rc, out, err = module.run_command([python, "-c", _PACKAGES_CHECK])
    if rc != 0:
        module.fail_json(
            msg=f"python {python} lacks {(out or err).strip()}: the local default runs the plugin and the kubelet "
            "simulator with it; run make setup (it installs plugin_src, plugins/module_utils and plugin_src/kubesim "
            "into .venv), or set rdma_local_python to an interpreter that has them",
            rc=rc,
        )
    rc, out, err = module.run_command([python, "-c", _SOCKET_CHECK, p["config_path"], p["device_plugin_dir"]])
    if rc != 0:
        module.fail_json(msg=f"device_plugin_dir {p['device_plugin_dir']}: {(out or err).strip()}", rc=rc)
    resources = p["resources"]
    if not resources:
        with open(p["config_path"], encoding="utf-8") as fh:
            import yaml

            config = yaml.safe_load(fh) or {}
        resources = [r.get("name", "rdma/hca") for r in config.get("resources", [{}])]

    sim_cmd = [
        python, "-m", "rdma_kubesim.sim_cli", "run",
        "--dir", p["device_plugin_dir"],
        "--status-file", p["status_file"],
        "--node-name", p["node_name"],
    ]
    plugin_cmd = [
        python, "-m", "rdma_device_plugin", "serve",
        "--config", p["config_path"],
        "--sysfs-root", p["sysfs_root"],
        "--procfs-root", p["procfs_root"],
        "--dev-root", p["dev_root"],
        "--device-plugin-dir", p["device_plugin_dir"],
        "--log-format", "json",
    ]
    metrics_address = ""
    if p["metrics"]:
        metrics_address = "127.0.0.1:%d" % _metrics_port(p, saved, _running(pids["plugin"]))
        plugin_cmd += ["--metrics-address", metrics_address]
    sim_fp = _fingerprint(sim_cmd)
    plugin_fp = _fingerprint(plugin_cmd, [p["config_path"]])

    restart = []
    if not (_running(pids["simulator"]) and saved.get("simulator", {}).get("fingerprint") == sim_fp):
        restart = ["simulator", "plugin"]  # a new kubelet needs the plugin to register again
    elif not (_running(pids["plugin"]) and saved.get("plugin", {}).get("fingerprint") == plugin_fp):
        restart = ["plugin"]

    if module.check_mode or not restart:
        status = _read_json(p["status_file"])
        module.exit_json(changed=bool(restart), pids=pids, restarted=restart, status=status,
                         metrics_address=saved.get("metrics_address", metrics_address))

    os.makedirs(run_dir, exist_ok=True)
    os.makedirs(p["device_plugin_dir"], exist_ok=True)
    sim_log = os.path.join(run_dir, "kubelet-sim.log")
    plugin_log = os.path.join(run_dir, "plugin.log")
    state = dict(saved)
    started = []
    procs = {}  # what this run started, by name: liveness from the child itself, not /proc

    def alive(name):
        # Not _running(): right after exec the kernel may show an empty /proc/<pid>/cmdline for a
        # moment (the new image's argument pages are not set up yet), which looked like an exit
        # and let a failed start leave the plugin running.
        return procs[name].poll() is None

    def fail(msg, **extra):
        # Nothing a failed start began keeps running, and the state file says so.
        for name in reversed(started):
            _stop_child(procs[name])
            state.pop(name, None)
        if state.get("simulator") or state.get("plugin"):
            _write_state(state_path, state)
        elif os.path.exists(state_path):
            os.unlink(state_path)
        module.fail_json(msg=msg, pids=pids, **extra)

    def launch(name, cmd, fingerprint, log):
        procs[name] = _start(cmd, log)
        pids[name] = procs[name].pid
        started.append(name)
        state[name] = {"pid": pids[name], "fingerprint": fingerprint, "cmd": cmd, "log": log}
        state["metrics_address"] = metrics_address
        _write_state(state_path, state)  # recorded at once: make stop can end it whatever happens next

    _stop(pids["plugin"])
    state.pop("plugin", None)
    before = {}
    if "simulator" in restart:
        _stop(pids["simulator"])
        state.pop("simulator", None)
        if os.path.exists(p["status_file"]):
            os.unlink(p["status_file"])
        launch("simulator", sim_cmd, sim_fp, sim_log)
        deadline = time.monotonic() + p["timeout"]
        while not os.path.exists(p["status_file"]):
            if time.monotonic() > deadline or not alive("simulator"):
                fail(f"the kubelet simulator did not start; {sim_log}:\n{_log_tail(sim_log)}")
            time.sleep(0.05)
    else:
        before = _read_json(p["status_file"]).get("registrations", {})
    if metrics_address and not _port_free(int(metrics_address.rsplit(":", 1)[1])):
        fail(
            f"the metrics port {metrics_address} is in use by another process. Fix: free it, or set "
            "plugin_deploy_local_metrics_port to another port (0 picks a free one)"
        )
    launch("plugin", plugin_cmd, plugin_fp, plugin_log)

    deadline = time.monotonic() + p["timeout"]
    status = {}
    while True:
        status = _read_json(p["status_file"])
        regs = status.get("registrations", {})
        if all(r in status.get("registered", []) and regs.get(r, 0) > before.get(r, 0) for r in resources):
            break
        if time.monotonic() > deadline or not alive("plugin"):
            fail(
                f"the plugin did not register {', '.join(resources)} with the kubelet simulator within "
                f"{p['timeout']}s; {plugin_log}:\n{_log_tail(plugin_log)}",
                status=status,
            )
        time.sleep(0.05)
    # Let the first ListAndWatch snapshot land in the status file.
    time.sleep(0.3)
    status = _read_json(p["status_file"])
    module.exit_json(changed=True, pids=pids, restarted=restart, status=status, metrics_address=metrics_address)


if __name__ == "__main__":
    main()
