"""Scrapes behind authentication and authorization (``--metrics-auth kubernetes``), as kube-rbac-proxy
does, in-process: HTTPS with the serving certificate given (``--metrics-tls-cert``/``-key``, re-read
when the files change, as cert-manager renews them), the bearer token checked with a TokenReview and
its user authorized with a SubjectAccessReview (non-resource path ``/metrics``, verb ``get``) against
the API server, through the driver's small client (:mod:`.dra.kubeapi`). Imported only when the
flags ask for it: plain metrics load neither the client nor a certificate.

Results are cached per token (its SHA-256), at most :data:`CACHE_ENTRIES`: an allowed token for
:data:`ALLOWED_SECONDS`, a refused one for :data:`DENIED_SECONDS`. One Prometheus (one token) costs the
API server 2 reviews per node per ALLOWED_SECONDS whatever the scrape interval: 2,000 nodes, about 33
requests a second; an HA pair twice that. The price: a reader whose binding is removed keeps reading
for up to ALLOWED_SECONDS. docs/security.md ("Metrics").
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import http.client
import os
import ssl
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from .dra import kubeapi

ALLOWED_SECONDS = 120.0
DENIED_SECONDS = 10.0
CACHE_ENTRIES = 256
REVIEW_TIMEOUT_SECONDS = 5.0  # the metrics server's per-request bound (metricsserver.REQUEST_SECONDS)
PATH = "/metrics"
TOKEN_REVIEWS = "/apis/authentication.k8s.io/v1/tokenreviews"
ACCESS_REVIEWS = "/apis/authorization.k8s.io/v1/subjectaccessreviews"

OK, UNAUTHORIZED, FORBIDDEN, UNAVAILABLE = 200, 401, 403, 503


class Reviewer:
    """Bearer token -> 200 (read), 401 (no or unknown token), 403 (known, not allowed); the API
    server's verdicts cached (see the module). An API error is 503 and not cached."""

    def __init__(self, client: kubeapi.Client, clock: Callable[[], float] = time.monotonic) -> None:
        self.client = client
        self.clock = clock
        self.reviews = 0  # requests sent to the API server (tests read it)
        self._cache: collections.OrderedDict[bytes, tuple[float, int]] = collections.OrderedDict()
        self._lock = threading.Lock()

    def check(self, authorization: str) -> int:
        scheme, _, token = authorization.partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            return UNAUTHORIZED
        key = hashlib.sha256(token.encode()).digest()
        now = self.clock()
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None and hit[0] > now:
                self._cache.move_to_end(key)
                return hit[1]
        try:
            verdict = self._review(token)
        except (kubeapi.ApiError, OSError, http.client.HTTPException, ValueError):
            return UNAVAILABLE
        with self._lock:
            self._cache[key] = (now + (ALLOWED_SECONDS if verdict == OK else DENIED_SECONDS), verdict)
            self._cache.move_to_end(key)
            while len(self._cache) > CACHE_ENTRIES:
                self._cache.popitem(last=False)
        return verdict

    def _review(self, token: str) -> int:
        self.reviews += 1
        review = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview", "spec": {"token": token}}
        status = self.client.create(TOKEN_REVIEWS, review).get("status") or {}
        if not status.get("authenticated"):
            return UNAUTHORIZED
        user = status.get("user") or {}
        self.reviews += 1
        spec: dict[str, Any] = {
            "user": user.get("username", ""),
            "uid": user.get("uid", ""),
            "groups": user.get("groups") or [],
            "nonResourceAttributes": {"path": PATH, "verb": "get"},
        }
        if user.get("extra"):
            spec["extra"] = user["extra"]
        access = {"apiVersion": "authorization.k8s.io/v1", "kind": "SubjectAccessReview", "spec": spec}
        allowed = (self.client.create(ACCESS_REVIEWS, access).get("status") or {}).get("allowed")
        return OK if allowed else FORBIDDEN


_REASONS = {UNAUTHORIZED: "401 Unauthorized", FORBIDDEN: "403 Forbidden", UNAVAILABLE: "503 Service Unavailable"}
_BODIES = {
    UNAUTHORIZED: b"a bearer token the API server authenticates is required\n",
    FORBIDDEN: b"this identity may not get /metrics: bind it to the chart's metrics-reader ClusterRole\n",
    UNAVAILABLE: b"cannot review the token with the API server now\n",
}


def guard(app: Callable[..., Iterable[bytes]], reviewer: Reviewer) -> Callable[..., Iterable[bytes]]:
    """The WSGI app behind the reviewer: every request, whatever its path, needs a reader's token."""

    def guarded(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        verdict = reviewer.check(str(environ.get("HTTP_AUTHORIZATION", "")))
        if verdict == OK:
            return app(environ, start_response)
        headers = [("Content-Type", "text/plain; charset=utf-8")]
        if verdict == UNAUTHORIZED:
            headers.append(("WWW-Authenticate", 'Bearer realm="rdma-device-plugin metrics"'))
        start_response(_REASONS[verdict], headers)
        return [_BODIES[verdict]]

    return guarded


class ServingCert:
    """The TLS context of the certificate files, rebuilt when either file changes (a renewed Secret)."""

    def __init__(self, cert: str, key: str) -> None:
        self.cert, self.key = cert, key
        self._stamp: tuple[float, float] = (0.0, 0.0)
        self._context: ssl.SSLContext | None = None
        self._lock = threading.Lock()
        self.context()  # a missing or bad file fails at the start, not at the first scrape

    def context(self) -> ssl.SSLContext:
        stamp = (os.stat(self.cert).st_mtime, os.stat(self.key).st_mtime)
        with self._lock:
            if self._context is None or stamp != self._stamp:
                ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
                ctx.minimum_version = ssl.TLSVersion.TLSv1_2
                ctx.load_cert_chain(self.cert, self.key)
                self._context, self._stamp = ctx, stamp
            return self._context


def from_args(args: argparse.Namespace) -> tuple[Callable[[], ssl.SSLContext] | None, Reviewer | None]:
    """(TLS context source, reviewer) of the flags; ValueError names the flag and the fix. The reviews
    go through ``--kubeconfig``'s credentials, else the pod's service account (system:auth-delegator)."""
    cert, key = args.metrics_tls_cert, args.metrics_tls_key
    if bool(cert) != bool(key):
        raise ValueError("--metrics-tls-cert and --metrics-tls-key go together: give both files or neither")
    if args.metrics_auth == "kubernetes" and not cert:
        raise ValueError(
            "--metrics-auth kubernetes needs --metrics-tls-cert and --metrics-tls-key (bearer tokens "
            "never travel in plain HTTP)"
        )
    tls = None
    if cert:
        try:
            tls = ServingCert(cert, key).context
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(f"--metrics-tls-cert {cert} / --metrics-tls-key {key}: cannot load them ({exc})") from exc
    if args.metrics_auth != "kubernetes":
        return tls, None
    try:
        api = kubeapi.connect(args.kubeconfig)
    except kubeapi.ConfigError as exc:
        raise ValueError(f"--metrics-auth kubernetes: {exc}") from exc
    api.timeout = REVIEW_TIMEOUT_SECONDS
    return tls, Reviewer(api)
