#!/usr/bin/env python3
"""`make status`: the local default's plugin status, then its processes and metrics address; when
nothing of it runs, one line saying so and the command that starts it (exit 1).

  local_status.py <state file of rdma_local_plugin> <device-plugin dir> [<command to start it>]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

NAMES = {"simulator": "kubelet simulator", "plugin": "plugin"}


def alive(pid: object) -> bool:
    try:
        os.kill(int(str(pid)), 0)
    except (ValueError, OSError):
        return False
    return True


def main() -> int:
    state_file, dp_dir = sys.argv[1], sys.argv[2]
    start = sys.argv[3] if len(sys.argv) > 3 else "make demo"
    try:
        state = json.loads(Path(state_file).read_text())
    except (OSError, ValueError):
        state = {}
    if not alive((state.get("plugin") or {}).get("pid")):
        why = "its plugin is recorded but not running" if state.get("plugin") else "no plugin is recorded"
        print(f"the local default is not running ({why} in {state_file}). Start it with: {start}", file=sys.stderr)
        return 1
    bin_dir = Path(sys.executable).parent
    rc = subprocess.run([str(bin_dir / "rdma-device-plugin"), "status", "--device-plugin-dir", dp_dir], check=False).returncode
    for name in ("simulator", "plugin"):
        if name in state:
            pid = state[name]["pid"]
            print(f"{NAMES[name]}: pid {pid} ({'running' if alive(pid) else 'not running'}), log {state[name]['log']}")
    address = state.get("metrics_address")
    print("metrics: " + (f"http://{address}/metrics" if address else "off"))
    return rc


if __name__ == "__main__":
    sys.exit(main())
