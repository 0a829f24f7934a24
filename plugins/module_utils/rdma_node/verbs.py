"""libibverbs through pyverbs, standard library only (pyverbs itself is optional).

The one implementation of opening an RDMA device and querying its ports and GID table with
pyverbs. The plugin's :class:`rdma_device_plugin.verbs.VerbsProbe` (contexts kept between
probes, one log line) and the ``rdma_node_info`` Ansible module (one read per run, findings)
both use it; this package is shipped to nodes as module_utils, so nothing here may need more
than the standard library when pyverbs is absent.

libibverbs enumerates devices from the real ``/sys/class/infiniband_verbs`` and opens the
process's own ``/dev/infiniband/uverbs*``: it never sees a fixture tree.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from .checks import Check
from .sysfs import PORT_STATES
from .text import decode

DEBIAN_DIST_PACKAGES = "/usr/lib/python3/dist-packages"
GID_TYPES = {0: "IB/RoCE v1", 1: "RoCE v2"}
VERBS_OPEN = "verbs_open"
FIX_PROVIDER = (
    "install rdma-core's verbs provider (Debian/Ubuntu: ibverbs-providers; RHEL: libibverbs) "
    "and load the verbs modules (modprobe ib_uverbs mlx5_ib)"
)
FIX_OPEN = "run as root (or give the user read/write on /dev/infiniband/uverbs*) and modprobe ib_uverbs"


def load_pyverbs_device(extra_path: str | None = DEBIAN_DIST_PACKAGES) -> ModuleType:
    """Import ``pyverbs.device``; when it is not on ``sys.path``, try ``extra_path`` (Debian's
    dist-packages, for a venv) for this import only. ``extra_path=None``: the interpreter's own
    path only."""
    try:
        return importlib.import_module("pyverbs.device")
    except ImportError:
        if extra_path is None or extra_path in sys.path:
            raise
    sys.path.append(extra_path)
    try:
        return importlib.import_module("pyverbs.device")
    finally:
        sys.path.remove(extra_path)


def device_name(dev: Any) -> str:
    """A device of ``get_device_list()``: its name (bytes in pyverbs) decoded like sysfs text."""
    name = dev.name
    return decode(name) if isinstance(name, bytes) else str(name)


def list_devices(mod: Any) -> list[str]:
    """Names libibverbs lists; raises as pyverbs does (PyverbsRDMAError when there is none)."""
    return sorted(device_name(d) for d in mod.get_device_list())


def port_states(ctx: Any) -> tuple[str, ...]:
    """State of every port of an open context (``ACTIVE``, ``DOWN``, ...)."""
    count = int(ctx.query_device().phys_port_cnt)
    return tuple(PORT_STATES.get(int(ctx.query_port(p).state), "UNKNOWN") for p in range(1, count + 1))


IBV_MTU = {1: 256, 2: 512, 3: 1024, 4: 2048, 5: 4096}  # enum ibv_mtu


def active_mtus(ctx: Any) -> list[int]:
    """The active MTU of every port in bytes (0 when libibverbs reports none)."""
    count = int(ctx.query_device().phys_port_cnt)
    return [IBV_MTU.get(int(ctx.query_port(p).active_mtu), 0) for p in range(1, count + 1)]


def gids(ctx: Any) -> list[tuple[str, str]]:
    """Non-zero GIDs of every port as (gid "fe80:0000:...", type "RoCE v2" | "IB/RoCE v1" | "")."""
    out: list[tuple[str, str]] = []
    for port in range(1, int(ctx.query_device().phys_port_cnt) + 1):
        for index in range(int(ctx.query_port(port).gid_tbl_len)):
            try:
                gid = str(ctx.query_gid(port, index)).lower()
            except Exception:  # an empty table entry answers an error
                continue
            if not gid or not set(gid) - {"0", ":"}:
                continue
            try:  # ibv_query_gid_type answers enum ibv_gid_type_sysfs: 0 IB/RoCE v1, 1 RoCE v2
                gtype = GID_TYPES.get(int(ctx.query_gid_type(port, index)), "")
            except Exception:
                gtype = ""
            out.append((gid, gtype))
    return out


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


@dataclass
class VerbsRead:
    """What libibverbs showed of the selected NICs in one read (the node module's view)."""

    status: str  # one line for the result: which source was used and why
    used: bool = False  # pyverbs listed devices and the selected NICs were tried
    ports: dict[str, list[str]] = field(default_factory=dict)  # opened NIC -> port states
    gids: dict[str, list[tuple[str, str]]] = field(default_factory=dict)  # opened NIC -> GIDs
    active_mtu: dict[str, list[int]] = field(default_factory=dict)  # opened NIC -> ports' active MTU
    failed: dict[str, tuple[str, str]] = field(default_factory=dict)  # NIC -> (problem, fix)

    def checks(self) -> list[Check]:
        """One ``verbs_open`` check per selected NIC when pyverbs was used or could not list the
        devices sysfs shows; none when verbs was not consulted."""
        out = [Check(VERBS_OPEN, nic, "", False, problem, fix) for nic, (problem, fix) in sorted(self.failed.items())]
        out += [
            Check(VERBS_OPEN, nic, "", True, f"opened through libibverbs (ports {','.join(states) or 'none'})")
            for nic, states in sorted(self.ports.items())
        ]
        return sorted(out, key=lambda c: c.nic)


def read(names: Sequence[str], loader: Callable[[], Any]) -> VerbsRead:
    """Open every NIC of ``names`` through pyverbs and query its ports and GID table.

    A NIC that sysfs lists and libibverbs does not list or cannot open is a failed check
    (named, with the fix). pyverbs not importable: sysfs only, said once in ``status``."""
    try:
        mod = loader()
    except Exception:  # ImportError, or a compiled extension that does not load
        return VerbsRead("pyverbs not importable: sysfs only")
    try:
        listed = set(list_devices(mod))
    except Exception as exc:  # PyverbsRDMAError when libibverbs finds no device
        why = f"libibverbs lists no device ({_error(exc)})"
        result = VerbsRead(f"pyverbs could not list devices ({_error(exc)}): sysfs only")
        result.failed = {n: (f"sysfs lists it but {why}", FIX_PROVIDER) for n in names}
        return result
    result = VerbsRead(f"pyverbs lists {','.join(sorted(listed)) or 'no device'}", used=True)
    for name in names:
        if name not in listed:
            result.failed[name] = ("sysfs lists it but libibverbs does not", FIX_PROVIDER)
            continue
        try:
            ctx = mod.Context(name=name)
        except Exception as exc:
            result.failed[name] = (f"libibverbs cannot open it ({_error(exc)})", FIX_OPEN)
            continue
        try:
            result.ports[name] = list(port_states(ctx))
            result.gids[name] = gids(ctx)
            with contextlib.suppress(Exception):  # optional: the MTU check derives it from sysfs without
                result.active_mtu[name] = active_mtus(ctx)
        except Exception as exc:
            result.failed[name] = (f"libibverbs cannot query it ({_error(exc)})", FIX_OPEN)
        finally:
            with contextlib.suppress(Exception):  # the read is done; a close error changes nothing
                ctx.close()
    return result
