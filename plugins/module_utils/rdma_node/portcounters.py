"""Port counters of RDMA devices from sysfs (standard library only, world-readable).

``/sys/class/infiniband/<dev>/ports/<n>/counters/`` (the IB PortCounters: ``symbol_error``,
``link_downed``, ``port_rcv_errors``, ``excessive_buffer_overrun_errors``, ...) and
``.../hw_counters/`` (driver counters: mlx5's ``out_of_buffer``, ``rnr_nak_retry_err``,
``np_cnp_sent``, ...), merged into one mapping; a name in both keeps the ``counters/`` value.
Reading a counter asks the device (a MAD for ``counters/``), so a read costs a little: a read takes
only the counters it compares.

The ``counters/`` attributes are the IBA PortCounters of the port's PMA, each of a fixed width
(``PORT_PMA_ATTR`` in drivers/infiniband/core/sysfs.c: ``symbol_error`` 16 bits, ``link_downed`` 8,
``local_link_integrity_errors`` and ``excessive_buffer_overrun_errors`` 4, ...). They are kept in
the HCA and saturate at their maximum (IBA: PortCounters stop at all ones instead of wrapping);
a counter reset (``perfquery -R``) or a firmware reset clears them, loading the driver does not.
So a counter's value is a lifetime total: the checks judge its growth, and a counter at its
maximum can show no growth at all (:func:`saturated`). ``hw_counters/`` are the driver's 64-bit
counters.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

from . import text
from .sysfs import read_text

# Not counters: hw_counters/lifespan is the counters' cache time (ms), writable.
NOT_COUNTERS = frozenset({"lifespan"})
FLAP_COUNTERS = ("link_downed",)
# PORT_PMA_ATTR widths, drivers/infiniband/core/sysfs.c (the error counters)
WIDTHS = {
    "symbol_error": 16,
    "link_error_recovery": 8,
    "link_downed": 8,
    "port_rcv_errors": 16,
    "port_rcv_remote_physical_errors": 16,
    "port_rcv_switch_relay_errors": 16,
    "port_xmit_discards": 16,
    "port_xmit_constraint_errors": 8,
    "port_rcv_constraint_errors": 8,
    "local_link_integrity_errors": 4,
    "excessive_buffer_overrun_errors": 4,
    "VL15_dropped": 16,
}


def ceiling(name: str) -> int | None:
    """The value a saturating PortCounters counter stops at (15 for a 4-bit one); None when it has none."""
    width = WIDTHS.get(name)
    return None if width is None else (1 << width) - 1


def saturated(name: str, value: int) -> bool:
    """The counter stands at its maximum: new errors cannot show."""
    top = ceiling(name)
    return top is not None and value >= top


def growth(before: int, after: int) -> int:
    """How much a counter grew between two reads; a lower value means it was reset in between, and
    ``after`` counts since the reset."""
    return after - before if after >= before else after


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
