"""The few Kubernetes API calls the DRA driver makes, over plain HTTPS (standard library only).

The image carries no Kubernetes client (plugin_src/requirements.lock): the driver needs GET, LIST,
WATCH, CREATE, UPDATE and DELETE of JSON objects, which ``http.client`` and ``ssl`` do in a page.
Credentials come from a kubeconfig (``--kubeconfig``: client certificate, bearer token, CA file or
data, as client-go reads them) or, inside a pod, from the service account the kubelet mounts
(``/var/run/secrets/kubernetes.io/serviceaccount``: the token is re-read at each request, since
bound tokens rotate, client-go's ``rest.InClusterConfig``).
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import json
import os
import socket
import ssl
import tempfile
import threading
import time
import urllib.parse
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import yaml

SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
USER_AGENT = "rdma-device-plugin-dra"

Obj = dict[str, Any]


class ApiError(Exception):
    """The API server answered with an error status (``code``: HTTP status, ``reason``: its Status reason)."""

    def __init__(self, code: int, reason: str, message: str) -> None:
        super().__init__(f"{code} {reason}: {message}")
        self.code = code
        self.reason = reason


class ConfigError(ValueError):
    """No usable credentials; the message says which file or variable and what to do."""


@dataclass
class Credentials:
    server: str  # https://host:port
    ca_file: str = ""
    ca_data: str = ""  # PEM
    cert_file: str = ""
    key_file: str = ""
    token: str = ""
    token_file: str = ""  # re-read at every request (rotating bound tokens)
    insecure: bool = False

    def bearer(self) -> str:
        if self.token_file:
            with open(self.token_file, encoding="utf-8") as fh:
                return fh.read().strip()
        return self.token


def _data_file(data: str, suffix: str) -> str:
    """A ``*-data`` kubeconfig field as a private file (ssl loads certificates from files only)."""
    fd, path = tempfile.mkstemp(prefix="rdma-dra-", suffix=suffix)
    with os.fdopen(fd, "wb") as fh:
        fh.write(base64.b64decode(data))
    return path


def from_kubeconfig(path: str) -> Credentials:
    """The current context's cluster and user of a kubeconfig file."""
    try:
        with open(path, encoding="utf-8") as fh:
            doc = yaml.safe_load(fh) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"--kubeconfig {path}: cannot read it ({exc})") from exc
    base = os.path.dirname(os.path.abspath(path))

    def named(kind: str, name: str) -> Mapping[str, Any]:
        for item in doc.get(kind + "s") or []:
            if item.get("name") == name:
                return dict(item.get(kind) or {})
        raise ConfigError(f"--kubeconfig {path}: no {kind} named {name!r} (check current-context)")

    ctx = named("context", str(doc.get("current-context", "")))
    cluster, user = named("cluster", str(ctx.get("cluster", ""))), named("user", str(ctx.get("user", "")))

    def local(p: str) -> str:
        return p if not p or os.path.isabs(p) else os.path.join(base, p)

    creds = Credentials(
        server=str(cluster.get("server", "")),
        ca_file=local(str(cluster.get("certificate-authority", ""))),
        cert_file=local(str(user.get("client-certificate", ""))),
        key_file=local(str(user.get("client-key", ""))),
        token=str(user.get("token", "")),
        token_file=local(str(user.get("tokenFile", ""))),
        insecure=bool(cluster.get("insecure-skip-tls-verify", False)),
    )
    if cluster.get("certificate-authority-data"):
        creds.ca_data = base64.b64decode(cluster["certificate-authority-data"]).decode()
    if user.get("client-certificate-data"):
        creds.cert_file = _data_file(user["client-certificate-data"], ".crt")
    if user.get("client-key-data"):
        creds.key_file = _data_file(user["client-key-data"], ".key")
    if not creds.server.startswith("https://"):
        raise ConfigError(f"--kubeconfig {path}: server {creds.server!r} is not an https:// URL")
    return creds


def in_cluster(sa_dir: str = SERVICE_ACCOUNT_DIR) -> Credentials:
    host, port = os.environ.get("KUBERNETES_SERVICE_HOST", ""), os.environ.get("KUBERNETES_SERVICE_PORT", "")
    token = os.path.join(sa_dir, "token")
    if not host or not port or not os.path.exists(token):
        raise ConfigError(
            "no API server credentials: not in a pod (KUBERNETES_SERVICE_HOST/PORT unset or no service account "
            f"token in {sa_dir}); give --kubeconfig FILE, or run it from the chart (driver: dra)"
        )
    if ":" in host:
        host = f"[{host}]"
    return Credentials(server=f"https://{host}:{port}", ca_file=os.path.join(sa_dir, "ca.crt"), token_file=token)


class Client:
    """One HTTPS connection per thread (a watch holds its own), JSON in and out."""

    def __init__(self, creds: Credentials, timeout: float = 30.0) -> None:
        self.creds = creds
        self.timeout = timeout
        url = urllib.parse.urlsplit(creds.server)
        self.host, self.port = url.hostname or "", url.port or 443
        self.prefix = url.path.rstrip("/")
        ctx = ssl.create_default_context(cafile=creds.ca_file or None, cadata=creds.ca_data or None)
        if creds.insecure:
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
        if creds.cert_file:
            ctx.load_cert_chain(creds.cert_file, creds.key_file or None)
        self.ssl = ctx
        self._local = threading.local()
        self._watches: set[http.client.HTTPSConnection] = set()
        self._watches_lock = threading.Lock()

    def _connection(self, timeout: float | None) -> http.client.HTTPSConnection:
        return http.client.HTTPSConnection(self.host, self.port, context=self.ssl, timeout=timeout)

    def _headers(self, body: bool, content_type: str = "application/json") -> dict[str, str]:
        h = {"Accept": "application/json", "User-Agent": USER_AGENT}
        token = self.creds.bearer()
        if token:
            h["Authorization"] = f"Bearer {token}"
        if body:
            h["Content-Type"] = content_type
        return h

    def request(
        self,
        method: str,
        path: str,
        body: Obj | None = None,
        query: Mapping[str, str] | None = None,
        content_type: str = "application/json",
    ) -> Obj:
        url = self.prefix + path + ("?" + urllib.parse.urlencode(query) if query else "")
        data = json.dumps(body).encode() if body is not None else None
        t0 = time.monotonic()
        try:
            return self._request(method, url, data, content_type)
        finally:
            self._local.waited = self.waited() + time.monotonic() - t0

    def waited(self) -> float:
        """Seconds this thread has spent in requests, from sending to the decoded answer: the API
        server's time, the network's, and this process's own (TLS, JSON, the GIL) meanwhile."""
        return float(getattr(self._local, "waited", 0.0))

    def _request(self, method: str, url: str, data: bytes | None, content_type: str) -> Obj:
        for attempt in (1, 2):  # a kept-alive connection the server closed: retry once on a new one
            conn = getattr(self._local, "conn", None)
            if conn is None:
                conn = self._local.conn = self._connection(self.timeout)
            try:
                conn.request(method, url, body=data, headers=self._headers(data is not None, content_type))
                resp = conn.getresponse()
                raw = resp.read()
            except (http.client.HTTPException, OSError):
                conn.close()
                self._local.conn = None
                if attempt == 2:
                    raise
                continue
            return _decode(resp.status, raw)
        raise AssertionError("unreachable")

    def get(self, path: str, query: Mapping[str, str] | None = None) -> Obj:
        return self.request("GET", path, query=query)

    def create(self, path: str, obj: Obj) -> Obj:
        return self.request("POST", path, obj)

    def update(self, path: str, obj: Obj) -> Obj:
        return self.request("PUT", path, obj)

    def delete(self, path: str) -> Obj:
        return self.request("DELETE", path)

    def watch(self, path: str, query: Mapping[str, str], stop: threading.Event) -> Iterator[Obj]:
        """Watch events (``{"type", "object"}``) until the server ends the watch or ``stop`` is set."""
        q = {**query, "watch": "1", "allowWatchBookmarks": "true"}
        conn = self._connection(timeout=None)
        with self._watches_lock:
            self._watches.add(conn)
        try:
            conn.request("GET", self.prefix + path + "?" + urllib.parse.urlencode(q), headers=self._headers(False))
            resp = conn.getresponse()
            if resp.status != 200:
                _decode(resp.status, resp.read())
            while not stop.is_set():
                line = resp.readline()
                if not line:
                    return
                if line.strip():
                    yield json.loads(line)
        finally:
            with self._watches_lock:
                self._watches.discard(conn)
            conn.close()

    def close_watches(self) -> None:
        """End every open watch at once (its read fails; the watcher sees ``stop`` set and returns)."""
        with self._watches_lock:
            conns = list(self._watches)
        for conn in conns:
            sock = conn.sock
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
            self._local.conn = None


def _decode(status: int, raw: bytes) -> Obj:
    try:
        doc = json.loads(raw) if raw else {}
    except ValueError:
        doc = {"message": raw[:200].decode(errors="replace")}
    if status >= 400:
        raise ApiError(status, str(doc.get("reason", "")), str(doc.get("message", "")))
    return dict(doc)


def segment(value: str) -> str:
    """One URL path segment, escaped as client-go escapes each segment: a name with ``/``, ``?``,
    ``#``, ``%`` or a whole ``.``/``..`` names nothing but itself (the server answers 404)."""
    if value in (".", ".."):
        return "%2E" * len(value)
    return urllib.parse.quote(value, safe="")


def claim_path(namespace: str, name: str) -> str:
    """A ResourceClaim's path, both names escaped (the kubelet sends them; they name a URL here)."""
    return f"/apis/resource.k8s.io/v1/namespaces/{segment(namespace)}/resourceclaims/{segment(name)}"


def pod_path(namespace: str, name: str) -> str:
    return f"/api/v1/namespaces/{segment(namespace)}/pods/{segment(name)}"


def connect(kubeconfig: str = "") -> Client:
    """A client from ``kubeconfig``, else the pod's service account."""
    return Client(from_kubeconfig(kubeconfig) if kubeconfig else in_cluster())


def not_found(exc: BaseException) -> bool:
    return isinstance(exc, ApiError) and exc.code == 404


def conflict(exc: BaseException) -> bool:
    return isinstance(exc, ApiError) and exc.code == 409


@contextlib.contextmanager
def suppress_not_found() -> Iterator[None]:
    try:
        yield
    except ApiError as exc:
        if exc.code != 404:
            raise
