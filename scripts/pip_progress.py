#!/usr/bin/env python3
"""`make setup`'s pip install with one line per step, through the whole install:

  pip_progress.py -r requirements-dev.txt        (the arguments of `pip install`)

pip prints a line per package it collects, then installs them all after one "Installing collected
packages" line and prints nothing while it does (minutes on a first run: ansible alone is tens of
thousands of files). Each package's *.dist-info directory appears in site-packages when its
install ends (pip/_internal/operations/install/wheel.py writes it with the package's files), so
watching for new ones shows the install package by package. Errors pass through; the exit code is
pip's.
"""

from __future__ import annotations

import re
import subprocess
import sys
import sysconfig
import threading
from pathlib import Path


def dist_infos(site: Path) -> set[str]:
    return {p.name for p in site.glob("*.dist-info")}


def normalized(name: str) -> str:
    """PEP 503 name: what "Installing collected packages" lists and a dist-info directory is named after."""
    return re.sub(r"[-_.]+", "-", name).lower()


def watch(site: Path, before: set[str], names: list[str], done: threading.Event) -> None:
    wanted = {normalized(n) for n in names}
    seen = set(before)
    count = 0
    finished = False
    while not finished:
        finished = done.wait(0.5)  # one more look after pip has exited: the last packages
        for entry in sorted(dist_infos(site) - seen):
            seen.add(entry)
            name, _, version = entry[: -len(".dist-info")].rpartition("-")
            if normalized(name) in wanted:
                wanted.discard(normalized(name))
                count += 1
                print(f"  installed {count:3d}/{len(names)} {name} {version}", flush=True)


def main() -> int:
    site = Path(sysconfig.get_paths()["purelib"])
    proc = subprocess.Popen(
        [sys.executable, "-m", "pip", "install", "--progress-bar", "off", *sys.argv[1:]],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
    )  # fmt: skip
    assert proc.stdout is not None
    collected = 0
    done = threading.Event()
    watcher = None
    for line in proc.stdout:
        text = line.strip()
        if text.startswith("Collecting "):
            collected += 1
            print(f"  {collected:3d} {text.split()[1]}", flush=True)
        elif text.startswith(("Downloading ", "Building wheel for ")):
            print(f"      {text}", flush=True)
        elif text.startswith("Installing collected packages:") and watcher is None:
            names = [n.strip() for n in text.split(":", 1)[1].split(",") if n.strip()]
            print(f"  installing {len(names)} packages (one line as each one is in place)", flush=True)
            watcher = threading.Thread(target=watch, args=(site, dist_infos(site), names, done), daemon=True)
            watcher.start()
        elif text.startswith(("ERROR", "error")) or "error:" in text:
            print(line, end="", flush=True)
    rc = proc.wait()
    done.set()
    if watcher is not None:
        watcher.join()
    return rc


if __name__ == "__main__":
    sys.exit(main())
