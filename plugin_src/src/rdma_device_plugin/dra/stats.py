"""Prepare and unprepare counted per claim for the metrics (:mod:`.metrics`), apart from them so that
a driver without --metrics-address loads no prometheus_client (memory, issue 38)."""

from __future__ import annotations

import bisect
import threading

from ..metricsserver import LATENCY_BUCKETS

OPERATIONS = ("prepare", "unprepare")


class RequestStats:
    """Prepare and unprepare per claim: counts and latency buckets, written by the gRPC threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.ok = dict.fromkeys(OPERATIONS, 0)
        self.error = dict.fromkeys(OPERATIONS, 0)
        self.buckets = {op: [0] * (len(LATENCY_BUCKETS) + 1) for op in OPERATIONS}  # +Inf last
        self.total = dict.fromkeys(OPERATIONS, 0.0)

    def record(self, operation: str, seconds: float, ok: bool) -> None:
        with self._lock:
            (self.ok if ok else self.error)[operation] += 1
            self.buckets[operation][bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1
            self.total[operation] += seconds

    def copy(self) -> tuple[dict[str, int], dict[str, int], dict[str, list[int]], dict[str, float]]:
        with self._lock:
            return dict(self.ok), dict(self.error), {k: list(v) for k, v in self.buckets.items()}, dict(self.total)
