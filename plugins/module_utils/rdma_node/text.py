"""How kernel text (sysfs/procfs contents, directory and link names, pyverbs names) becomes str.

One policy everywhere: UTF-8 with ``backslashreplace``. The kernel does not require device or
netdev names to be UTF-8; a byte that is not becomes the printable ``\\xNN``, never the lone
surrogate that ``os.listdir``/``os.readlink`` give for it (surrogateescape): protobuf refuses to
encode a surrogate, so one odd name would fail every ListAndWatch snapshot, and strict JSON
encoders and UTF-8 log handlers fail the same way. Because contents and names are decoded alike,
a netdev named in ``gid_attrs/ndevs`` or ``/proc/net/if_inet6`` equals its ``class/net`` entry.

:func:`to_fs` maps such a name back to the path component it came from (``\\xNN`` with NN >= 80,
which ``backslashreplace`` writes only for undecodable bytes, back to the byte).
"""

from __future__ import annotations

import os
import re

ENCODING = "utf-8"
ERRORS = "backslashreplace"
_ESCAPED = re.compile(r"\\x([89a-f][0-9a-f])")


def decode(raw: bytes) -> str:
    """Kernel bytes -> printable str (the one policy)."""
    return raw.decode(ENCODING, ERRORS)


def from_fs(entry: str) -> str:
    """A name the OS gave as str (``os.listdir``, ``os.readlink``: surrogateescape) -> :func:`decode` of its bytes."""
    return decode(os.fsencode(entry))


def to_fs(name: str) -> str:
    """A decoded name -> the path component (os-level str) it was read from."""
    return _ESCAPED.sub(lambda m: chr(0xDC00 + int(m.group(1), 16)), name)
