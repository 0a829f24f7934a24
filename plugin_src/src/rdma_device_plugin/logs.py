"""Logging set up in one place: text for people, JSON lines for log pipelines.

Native code logs too: gRPC core (through abseil) writes its own lines to file descriptor 2, e.g.
``E1203 10:50:29.002862   21524 add_port.cc:83] Failed to add port ...``, which would land raw
in the middle of JSON lines. :func:`route_native_stderr` points fd 2 at a pipe whose lines this
process logs as records of the ``grpc.core`` logger (level from the line's first letter, the
source file and line as ``source``), while the handlers and ``sys.stderr`` keep the real stderr.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any, TextIO

_RESERVED = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        out.update({k: v for k, v in vars(record).items() if k not in _RESERVED})
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)-7s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        base = super().format(record)
        extra = {k: v for k, v in vars(record).items() if k not in _RESERVED}
        return base + "".join(f" {k}={quote(v)}" for k, v in extra.items())


_BARE = re.compile(r"^[^\s\"\\=]+$")


def quote(value: object) -> str:
    """A value of a text log line as logfmt writes it: bare when it has no space, quote, backslash or
    ``=``, else a JSON string (``k="v with spaces"``), so a value (a path, an error text from a node)
    can neither split into more pairs nor fake one."""
    text = str(value)
    return text if _BARE.match(text) and text.isprintable() else json.dumps(text)


def names(items: Sequence[str], shown: int = 4) -> str:
    """A list for an INFO line: ``mlx5_0,mlx5_1,mlx5_2,mlx5_3 (+60 more)``; the full list goes to debug."""
    head = ",".join(items[:shown])
    return f"{head} (+{len(items) - shown} more)" if len(items) > shown else head


# abseil's log prefix: severity letter, MMDD hh:mm:ss.uuuuuu, thread id, file:line]
_NATIVE = re.compile(r"^([IWEF])\d{4} [\d:.]+\s+\d+\s+([^\]\s]+)\] ?(.*)$")
_NATIVE_LEVELS = {"I": logging.INFO, "W": logging.WARNING, "E": logging.ERROR, "F": logging.CRITICAL}


def route_native_stderr() -> None:
    """Log what native code writes to fd 2 (module doc); a no-op when called twice."""
    if getattr(route_native_stderr, "done", False):
        return
    route_native_stderr.done = True  # type: ignore[attr-defined]
    real = os.dup(2)
    stream: TextIO = os.fdopen(real, "w", buffering=1, encoding="utf-8", errors="backslashreplace")
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.StreamHandler):
            handler.setStream(stream)
    sys.stderr = stream
    read, write = os.pipe2(os.O_CLOEXEC)
    os.dup2(write, 2)
    os.close(write)
    threading.Thread(target=_log_native, args=(read,), name="native-stderr", daemon=True).start()


def _log_native(fd: int) -> None:
    log = logging.getLogger("grpc.core")
    with os.fdopen(fd, "rb") as pipe:
        for raw in pipe:
            line = raw.decode("utf-8", "backslashreplace").rstrip()
            found = _NATIVE.match(line)
            if found is None:
                if line:
                    log.warning("%s", line)
                continue
            log.log(_NATIVE_LEVELS[found.group(1)], "%s", found.group(3), extra={"source": found.group(2)})


def setup_logging(level: str = "info", fmt: str = "text") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    logging.getLogger("grpc").setLevel(logging.WARNING)
