"""The locked-memory limit the container runtime passes on to pods (standard library only).

A pod's processes inherit RLIMIT_MEMLOCK from the runtime that starts them (containerd, dockerd,
CRI-O) unless the runtime sets its own; RDMA libraries size their pinned buffers by it and
``ibv_reg_mr`` fails past it. Two sources, both world-readable:

- the running runtime's ``/proc/<pid>/limits`` (``proc_pid_limits()`` in ``fs/proc/base.c``: a
  header line, then ``%-25s %-20s %-20s %-10s`` rows such as ``Max locked memory  8388608
  8388608  bytes``, ``unlimited`` for RLIM_INFINITY), the runtime found by ``/proc/<pid>/comm``;
- its systemd unit and drop-ins (``LimitMEMLOCK=``, systemd.exec(5)): the unit file from the first
  of ``/etc``, ``/run``, ``/usr/local/lib``, ``/usr/lib``, ``/lib`` ``systemd/system`` that has it,
  then ``<unit>.d/*.conf`` of all of them in file-name order (a name in an earlier directory hides
  the same name in later ones), the last assignment winning; unset, systemd's
  ``DefaultLimitMEMLOCK=`` (``system.conf``), else its built-in default (8 MiB since systemd 253,
  64 KiB before).

The unit says what the runtime gets at its next restart, the process what pods get now.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

from . import text
from .sysfs import read_text

RUNTIMES = {"containerd": "containerd.service", "dockerd": "docker.service", "crio": "crio.service"}
UNIT_DIRS = (
    "etc/systemd/system",
    "run/systemd/system",
    "usr/local/lib/systemd/system",
    "usr/lib/systemd/system",
    "lib/systemd/system",
)
_SUFFIX = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40, "P": 1 << 50, "E": 1 << 60}


@dataclass(frozen=True)
class Limit:
    soft: int | None  # bytes, None = unlimited
    hard: int | None

    @property
    def unlimited(self) -> bool:
        return self.soft is None

    def describe(self) -> str:
        def one(v: int | None) -> str:
            return "unlimited" if v is None else f"{v} bytes"

        return one(self.soft) if self.soft == self.hard else f"{one(self.soft)} (hard {one(self.hard)})"


def parse_limits(proc_text: str) -> dict[str, Limit]:
    """``/proc/<pid>/limits`` -> limit name ("Max locked memory") -> Limit (unparsable rows left out)."""
    out: dict[str, Limit] = {}
    for line in proc_text.splitlines()[1:]:
        values = line[26:].split()
        if len(values) < 2:
            continue
        soft, hard = values[:2]
        try:
            limit = Limit(None if soft == "unlimited" else int(soft), None if hard == "unlimited" else int(hard))
        except ValueError:
            continue
        out[line[:25].strip()] = limit
    return out


def parse_systemd(value: str) -> Limit | None:
    """A ``LimitMEMLOCK=`` value (``infinity``, ``8M``, ``65536``, ``soft:hard``) -> Limit; None: unparsable."""

    def one(v: str) -> int | None:
        v = v.strip()
        if v == "infinity":
            return None
        if v and v[-1].upper() in _SUFFIX:
            return int(float(v[:-1]) * _SUFFIX[v[-1].upper()])
        return int(v)

    soft, _, hard = value.partition(":")
    try:
        low = one(soft)
        return Limit(low, one(hard) if hard else low)
    except ValueError:
        return None


@dataclass(frozen=True)
class UnitSetting:
    value: str | None  # the LimitMEMLOCK= value in force; None when no file sets it
    source: str  # the file that set it last, or where the default comes from
    files: tuple[str, ...]  # unit and drop-ins read, in order


def _assignments(path: str, key: str) -> list[str]:
    """Values of ``key=`` in the [Service] section of a unit file, in order."""
    body = read_text(path)
    if body is None:
        return []
    out, section = [], ""
    for raw in body.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line
            continue
        name, sep, value = line.partition("=")
        if sep and section == "[Service]" and name.strip() == key:
            out.append(value.strip())
    return out


def unit_setting(host_root: str, unit: str, key: str = "LimitMEMLOCK") -> UnitSetting | None:
    """The ``key`` a unit ends up with; None when no unit file exists."""
    main = next(
        (os.path.join(host_root, d, unit) for d in UNIT_DIRS if os.path.isfile(os.path.join(host_root, d, unit))), None
    )
    if main is None:
        return None
    dropins: dict[str, str] = {}
    for directory in UNIT_DIRS:
        folder = os.path.join(host_root, directory, f"{unit}.d")
        try:
            names = os.listdir(folder)
        except OSError:
            continue
        for name in names:
            if name.endswith(".conf"):
                dropins.setdefault(name, os.path.join(folder, name))
    files = [main, *(dropins[n] for n in sorted(dropins))]
    value, source = None, ""
    for path in files:
        for assigned in _assignments(path, key):
            value, source = (assigned or None), path  # an empty assignment resets to the default
    shown = tuple(text.from_fs(os.path.relpath(f, host_root)) for f in files)
    if value is None:
        default = _default(host_root, f"Default{key}")
        if default is not None:
            return UnitSetting(default[0], default[1], shown)
        return UnitSetting(None, "systemd's built-in default (8 MiB since systemd 253, 64 KiB before)", shown)
    return UnitSetting(value, text.from_fs(os.path.relpath(source, host_root)), shown)


def _default(host_root: str, key: str) -> tuple[str, str] | None:
    """``DefaultLimitMEMLOCK=`` of system.conf and its drop-ins ([Manager] section)."""
    base = os.path.join(host_root, "etc", "systemd")
    files = [os.path.join(base, "system.conf")]
    with contextlib.suppress(OSError):
        files += [
            os.path.join(base, "system.conf.d", n) for n in sorted(os.listdir(os.path.join(base, "system.conf.d")))
        ]
    found = None
    for path in files:
        body = read_text(path) or ""
        section = ""
        for raw in body.splitlines():
            line = raw.strip()
            if line.startswith("["):
                section = line
            name, sep, value = line.partition("=")
            if sep and section == "[Manager]" and name.strip() == key and value.strip():
                found = (value.strip(), text.from_fs(os.path.relpath(path, host_root)))
    return found


@dataclass(frozen=True)
class Runtime:
    name: str  # "containerd", "dockerd", "crio"
    pid: int | None  # None: not running
    running: Limit | None  # None: not running or /proc/<pid>/limits unreadable
    running_source: str
    unit: str
    unit_setting: UnitSetting | None

    def to_dict(self) -> dict[str, object]:
        setting = self.unit_setting
        return {
            "runtime": self.name,
            "pid": self.pid,
            "running": None if self.running is None else self.running.describe(),
            "running_unlimited": None if self.running is None else self.running.unlimited,
            "unit": self.unit,
            "unit_limit_memlock": None if setting is None else setting.value,
            "unit_source": None if setting is None else setting.source,
        }


def _processes(procfs_root: str) -> dict[str, int]:
    """First pid of each known runtime, from ``/proc/<pid>/comm``."""
    found: dict[str, int] = {}
    try:
        pids = sorted(int(e) for e in os.listdir(procfs_root) if e.isdigit())
    except OSError:
        return found
    for pid in pids:
        comm = read_text(os.path.join(procfs_root, str(pid), "comm"))
        if comm in RUNTIMES and comm not in found:
            found[comm] = pid
    return found


def read(procfs_root: str, host_root: str) -> list[Runtime]:
    """Every runtime that runs or has a unit file, containerd first."""
    running = _processes(procfs_root)
    out = []
    for name, unit in RUNTIMES.items():
        pid = running.get(name)
        setting = unit_setting(host_root, unit)
        if pid is None and setting is None:
            continue
        limit, source = None, "not running"
        if pid is not None:
            limits_path = os.path.join(procfs_root, str(pid), "limits")
            body = read_text(limits_path)
            limit = parse_limits(body).get("Max locked memory") if body is not None else None
            source = f"/proc/{pid}/limits" if limit is not None else f"/proc/{pid}/limits is unreadable"
        out.append(Runtime(name, pid, limit, source, unit, setting))
    return out
