"""How kernel text (sysfs, procfs, directory and link names, pyverbs names) becomes str.

One policy everywhere: UTF-8 with ``backslashreplace``. A byte that is not UTF-8 becomes the
printable ``\\xNN``, never a lone surrogate (what ``os.listdir`` and ``os.readlink`` give for
such bytes with a str path): a surrogate cannot be encoded by protobuf, JSON (strict
encoders) or a log handler writing UTF-8, so one odd device name would break every answer.
"""

from __future__ import annotations

import os

ENCODING = "utf-8"
ERRORS = "backslashreplace"


def decode(raw: bytes) -> str:
    """Kernel bytes -> printable str (the one policy)."""
    return raw.decode(ENCODING, ERRORS)


def name(entry: str) -> str:
    """A name that came from the file system as str (``os.listdir``, ``os.readlink``, with
    surrogateescape for non-UTF-8 bytes) -> the same text :func:`decode` gives for its bytes."""
    return decode(os.fsencode(entry))


def read(path: str) -> str | None:
    """A sysfs/procfs file's text (stripped), None when it cannot be read."""
    try:
        with open(path, "rb") as fh:
            return decode(fh.read()).strip()
    except OSError:
        return None
