"""Port counters of RDMA devices from sysfs (standard library only, world-readable).

``/sys/class/infiniband/<dev>/ports/<n>/counters/`` (the IB PortCounters: ``symbol_error``,
``link_downed``, ``port_rcv_errors``, ``excessive_buffer_overrun_errors``, ...) and
``.../hw_counters/`` (driver counters: mlx5's ``out_of_buffer``, ``rnr_nak_retry_err``,
``np_cnp_sent``, ...), merged into one mapping; a name in both keeps the ``counters/`` value.
Reading a counter asks the device (a MAD for ``counters/``), so a read costs a little: the second
read of a flap check takes only the counters it compares.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

from . import text
from .sysfs import read_text

# Not counters: hw_counters/lifespan is the counters' cache time (ms), writable.
NOT_COUNTERS = frozenset({"lifespan"})
FLAP_COUNTERS = ("link_downed",)


def _read_dir(directory: str, names: Iterable[str] | None) -> dict[str, int]:
    out: dict[str, int] = {}
    if names is None:
        try:
            entries = sorted(text.from_fs(e) for e in os.listdir(directory))
        except OSError:
            return out
    else:
        entries = list(names)
    for name in entries:
        if name in NOT_COUNTERS:
            continue
        value = read_text(os.path.join(directory, text.to_fs(name)))
        if value is not None and value.isdigit():
            out[name] = int(value)
    return out


def read_port(sysfs_root: str, nic: str, port: int, names: Iterable[str] | None = None) -> dict[str, int]:
    """The port's counters (``names`` only, when given), ``counters/`` over ``hw_counters/``."""
    base = os.path.join(sysfs_root, "class", "infiniband", text.to_fs(nic), "ports", str(port))
    wanted = None if names is None else list(names)
    merged = _read_dir(os.path.join(base, "hw_counters"), wanted)
    merged.update(_read_dir(os.path.join(base, "counters"), wanted))
    return merged
