"""Port state and GIDs through libibverbs (pyverbs), with sysfs as the fallback.

``VerbsProbe.available()`` is True only when ``pyverbs`` imports AND
``pyverbs.device.get_device_list()`` returns devices. With no RDMA device
``get_device_list()`` raises ``PyverbsRDMAError`` (it does not return ``[]``); that, an
import failure, or an empty list make the plugin use sysfs, said in one log line.

Where pyverbs is not on ``sys.path`` (a venv), Debian's ``python3-pyverbs`` in
/usr/lib/python3/dist-packages is tried, added to ``sys.path`` only for that import.

Verbs async events (IBV_EVENT_PORT_ACTIVE / PORT_ERR) are NOT used: pyverbs'
``Context.get_async_event()`` blocks inside libibverbs while holding the GIL (rdma-core
44) and the async fd is not exposed for select(), so waiting for an event would stall
every gRPC thread. Port state is polled with ``query_port`` at the health interval
instead, which bounds the delay to that interval, as with sysfs.

The loader is a seam: tests pass a fake module object.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

from rdma_node import verbs as node_verbs
from rdma_node.verbs import load_pyverbs_device

__all__ = ["VerbsProbe", "load_pyverbs_device", "verbs_unusable_reason"]

LOG = logging.getLogger(__name__)


def verbs_unusable_reason(dev_dir: str = "/dev/infiniband") -> str | None:
    """Why libibverbs cannot open any device in this process, or None when it might.

    libibverbs opens ``/dev/infiniband/uverbsN`` of the process's own /dev, not the host's
    (``--dev-root``): the chart's unprivileged pod has none, so pyverbs cannot work there and
    is not worth its import."""
    try:
        names = [n for n in os.listdir(dev_dir) if n.startswith("uverbs")]
    except OSError:
        return f"{dev_dir} does not exist in this container"
    if not any(os.access(os.path.join(dev_dir, n), os.R_OK | os.W_OK) for n in names):
        return f"no readable and writable {dev_dir}/uverbs* in this container"
    return None


class VerbsProbe:
    """Reads port states / GIDs through pyverbs when it can list devices."""

    def __init__(self, loader: Callable[[], Any] = load_pyverbs_device) -> None:
        self._loader = loader
        self._mod: Any = None
        self._available: bool | None = None
        self.reason = ""
        self._contexts: dict[str, Any] = {}

    def skip(self, reason: str) -> None:
        """Use sysfs without importing pyverbs at all."""
        self._fallback(f"pyverbs not used: {reason}")

    def available(self) -> bool:
        """Decide once; logs the single line that says which source is used."""
        if self._available is not None:
            return self._available
        try:
            mod = self._loader()
        except Exception as exc:  # ImportError, or a compiled extension that does not load
            return self._fallback(f"pyverbs does not import ({type(exc).__name__}: {exc})")
        try:
            devices = node_verbs.list_devices(mod)
        except Exception as exc:  # PyverbsRDMAError when the node has no RDMA device
            return self._fallback(f"pyverbs lists no RDMA devices ({type(exc).__name__}: {exc})")
        if not devices:
            return self._fallback("pyverbs lists no RDMA devices (empty list)")
        self._mod = mod
        self._available = True
        self.reason = "pyverbs lists " + ",".join(devices)
        LOG.info("port state and GIDs from pyverbs", extra={"devices": self.reason})
        return True

    def _fallback(self, reason: str) -> bool:
        self._available = False
        self.reason = reason
        LOG.info("port state and GIDs from sysfs: %s", reason)
        return False

    def devices(self) -> list[str]:
        if not self.available():
            return []
        try:
            return node_verbs.list_devices(self._mod)
        except Exception:
            return []

    def _context(self, name: str) -> Any:
        ctx = self._contexts.get(name)
        if ctx is None:
            ctx = self._mod.Context(name=name)
            self._contexts[name] = ctx
        return ctx

    def _drop(self, name: str) -> None:
        ctx = self._contexts.pop(name, None)
        if ctx is not None:
            try:
                ctx.close()
            except Exception:
                LOG.debug("closing verbs context of %s failed", name, exc_info=True)

    def port_states(self, names: Sequence[str]) -> dict[str, tuple[str, ...] | None]:
        """Port states of the NICs pyverbs knows (None = gone); NICs it does not know are left out."""
        known = set(self.devices())
        result: dict[str, tuple[str, ...] | None] = {}
        for name in names:
            if name not in known:
                self._drop(name)
                continue
            try:
                result[name] = node_verbs.port_states(self._context(name))
            except Exception as exc:  # device vanished under us, or a driver error
                LOG.debug("verbs query of %s failed: %s", name, exc)
                self._drop(name)
                result[name] = None
        return result

    def gids(self, name: str) -> list[tuple[str, str]]:
        """Non-zero GIDs of every port of ``name`` as (gid "fe80:0000:...", type "RoCE v2" | "IB/RoCE v1" | "")."""
        if not self.available() or name not in self.devices():
            return []
        try:
            return node_verbs.gids(self._context(name))
        except Exception as exc:
            LOG.debug("verbs GID query of %s failed: %s", name, exc)
            self._drop(name)
            return []

    def close(self) -> None:
        for name in list(self._contexts):
            self._drop(name)
