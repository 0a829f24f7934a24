"""Small pieces that keep the supervisor's loops alive and quiet: backoff, log-once, heartbeats."""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field

BACKOFF_INITIAL_SECONDS = 0.5
BACKOFF_MAX_SECONDS = 5.0
# A stream end this long after the previous one is a first: registered again at once. Closer ones
# are repeats (a kubelet that keeps cutting): they back off.
REPEAT_SECONDS = 10.0


@dataclass
class Backoff:
    """``initial`` (0.5 s) doubling to ``maximum`` (5 s); ``due`` says when the next attempt may run."""

    initial: float = BACKOFF_INITIAL_SECONDS
    maximum: float = BACKOFF_MAX_SECONDS
    delay: float = field(init=False)
    next_at: float = 0.0
    failures: int = 0
    last_cut: float = float("-inf")  # when the kubelet last ended the stream (monotonic)

    def __post_init__(self) -> None:
        self.delay = self.initial

    def due(self, now: float) -> bool:
        return now >= self.next_at

    def failed(self, now: float) -> None:
        self.failures += 1
        self.next_at = now + self.delay
        self.delay = min(self.delay * 2, self.maximum)

    def cut(self, now: float) -> float:
        """The kubelet ended the stream: the next attempt at once the first time, one step of
        backoff when it happens again within REPEAT_SECONDS. Returns the wait."""
        if now - self.last_cut > REPEAT_SECONDS:
            self.delay = self.initial
            self.next_at = now
        else:
            self.next_at = now + self.delay
            self.delay = min(self.delay * 2, self.maximum)
        self.last_cut = now
        return self.next_at - now

    def succeeded(self) -> None:
        """Done: the next attempt (when there is one) may run at once, with a fresh delay."""
        self.delay, self.next_at, self.failures = self.initial, 0.0, 0


@dataclass
class LogOnce:
    """Log a condition once while it holds (per key); say so again only when it changes or clears."""

    logger: logging.Logger
    _last: dict[str, str] = field(default_factory=dict)

    def problem(
        self,
        key: str,
        message: str,
        *args: object,
        level: int = logging.WARNING,
        extra: dict[str, object] | None = None,
    ) -> None:
        text = message % args if args else message
        if self._last.get(key) == text:
            self.logger.debug(text, extra=extra)
            return
        self._last[key] = text
        self.logger.log(level, text, extra=extra)

    @property
    def pending(self) -> dict[str, str]:
        """The conditions logged and not cleared yet (key -> message)."""
        return self._last

    def cleared(self, key: str, message: str | None = None, extra: dict[str, object] | None = None) -> None:
        if self._last.pop(key, None) is not None and message:
            self.logger.info(message, extra=extra)


DEFAULT_HEALTH_FILE = "/dev/shm/rdma-device-plugin.health"  # tmpfs, writable under readOnlyRootFilesystem
UNREGISTERED_GRACE_SECONDS = 120.0  # a kubelet restart re-registers in seconds; longer means stuck


def write_health(path: str, doc: dict[str, object]) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(json.dumps(doc))  # one write: json.dump writes every token through the text layer
    os.replace(tmp, path)


def remove_health(path: str) -> None:
    """Remove the health file if this process wrote it (never another instance's)."""
    try:
        with open(path, encoding="utf-8") as fh:
            if json.load(fh).get("pid") == os.getpid():
                os.unlink(path)
    except (OSError, ValueError):
        pass


def check_health(path: str, now: float | None = None) -> list[str]:
    """Why the serving process is not live (empty when it is). Standard library only: the
    liveness probe runs this every few seconds and must stay cheap."""
    now = time.time() if now is None else now
    try:
        with open(path, encoding="utf-8") as fh:
            doc = json.load(fh)
    except (OSError, ValueError) as exc:
        return [f"cannot read the health file {path}: {exc}"]
    problems = []
    for name, loop in sorted(doc.get("loops", {}).items()):
        age = now - float(loop["last"])
        if age > float(loop["max_age"]):
            problems.append(f"loop {name} has not completed for {age:.0f} s (limit {loop['max_age']:.0f} s)")
    for resource, since in sorted(doc.get("unregistered_since", {}).items()):
        if now - float(since) > UNREGISTERED_GRACE_SECONDS:
            problems.append(f"resource {resource} has not been registered with the kubelet for {now - since:.0f} s")
    return problems


def check_ready(path: str, now: float | None = None) -> list[str]:
    """Why the serving process is not ready (the chart's readinessProbe; empty when it is): not live,
    or a resource it serves is not registered. Registered is the registration's REGISTERED state:
    Register answered and the kubelet's ListAndWatch stream open (registration.py), so a plugin
    that starts but never reaches the kubelet, or whose stream the kubelet ended, is not ready and
    halts a DaemonSet rollout (with minReadySeconds) before it spreads."""
    problems = check_health(path, now)
    if problems:
        return problems
    now = time.time() if now is None else now
    with open(path, encoding="utf-8") as fh:
        doc = json.load(fh)
    means = doc.get("registered_means", "its ListAndWatch stream open")
    for resource, since in sorted(doc.get("unregistered_since", {}).items()):
        problems.append(
            f"resource {resource} is not registered with the kubelet ({means}) since {now - float(since):.0f} s"
        )
    if not problems and not doc.get("registered") and not doc.get("stood_down"):
        problems.append("no resource is registered with the kubelet yet")
    # what else the process says keeps it from serving (the DRA driver: its slices not in the API)
    problems += [str(p) for p in doc.get("not_ready", [])]
    return problems
