"""What the device plugin's metrics (:mod:`.metrics`) and the DRA driver's (:mod:`.dra.metrics`) share:
the latency buckets, the flags' TLS and token review (:func:`auth_of`, :mod:`.metricsauth` only when
asked for), and the bounded HTTP server. Apart from :mod:`.metrics` so that the DRA driver loads none
of the device plugin's modules (its pools, its gRPC server): memory, issue 38. prometheus_client is
imported only by the app that serves a registry.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import selectors
import socket
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)

# The HTTP server's bounds (issue 39): prometheus_client's own server starts a thread per connection,
# so 2,000 idle connections were 2,000 threads in a 128 Mi container. Here one thread waits on every
# open connection (selectors), at most MAX_CONNECTIONS stay open (a new one closes the longest idle),
# an idle one is closed after IDLE_SECONDS, and WORKERS threads answer the requests that arrived.
MAX_CONNECTIONS = 64
IDLE_SECONDS = 10.0
REQUEST_SECONDS = 5.0
WORKERS = 2


TlsSource = Callable[[], Any]  # the current ssl.SSLContext (metricsauth.ServingCert.context)


def auth_of(args: Any) -> tuple[TlsSource | None, Any]:
    """(TLS context source, token reviewer) of the --metrics-auth/--metrics-tls-* flags; ValueError
    names a bad one. Plain HTTP, the flags' default, imports neither ssl nor the API client."""
    if args.metrics_auth == "none" and not args.metrics_tls_cert and not args.metrics_tls_key:
        return None, None
    from . import metricsauth

    return metricsauth.from_args(args)


def guarded_app(registry: CollectorRegistry, reviewer: Any) -> Any:
    """prometheus_client's WSGI app, behind the reviewer when there is one (metricsauth.guard)."""
    from prometheus_client import make_wsgi_app

    app = make_wsgi_app(registry)
    if reviewer is None:
        return app
    from . import metricsauth

    return metricsauth.guard(app, reviewer)


def parse_address(address: str) -> tuple[str, int]:
    """``HOST:PORT`` / ``[v6]:PORT`` / ``:PORT`` (all addresses) -> (host, port)."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--metrics-address {address!r} must be HOST:PORT, e.g. 127.0.0.1:9108")
    host = host.strip("[]") or "0.0.0.0"
    return host, int(port)


class _QuietHandler(WSGIRequestHandler):
    timeout = REQUEST_SECONDS  # a request that stalls is cut, its worker freed

    def log_message(self, format: str, *args: Any) -> None:
        pass


class BoundedHTTPServer:
    """The metrics endpoint in bounded threads and memory, whatever clients open (see MAX_CONNECTIONS)."""

    def __init__(self, host: str, port: int, app: Any, tls: TlsSource | None = None) -> None:
        self._tls = tls  # HTTPS: the handshake runs on a worker, under the request's timeout
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind((host, port))
        self._listener.listen(128)
        self._listener.setblocking(False)
        self.port = int(self._listener.getsockname()[1])
        # wsgiref's environ and app holder, never bound: the handlers only read them
        self._wsgi = WSGIServer((host, self.port), _QuietHandler, bind_and_activate=False)
        self._wsgi.server_name, self._wsgi.server_port = host, self.port
        self._wsgi.setup_environ()
        self._wsgi.set_app(app)
        self._wsgi.socket.close()  # the unbound socket socketserver made
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._idle: collections.OrderedDict[socket.socket, float] = collections.OrderedDict()  # oldest first
        self._workers = concurrent.futures.ThreadPoolExecutor(WORKERS, thread_name_prefix="metrics")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="metrics-http", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            for key, _ in self._selector.select(timeout=1.0):
                if key.fileobj is self._listener:
                    self._accept()
                else:
                    conn = key.fileobj
                    assert isinstance(conn, socket.socket)
                    self._forget(conn)
                    self._workers.submit(self._answer, conn)
            deadline = time.monotonic() - IDLE_SECONDS
            while self._idle and next(iter(self._idle.values())) < deadline:
                self._drop(next(iter(self._idle)))

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # EMFILE and the like: the next select tries again
                return
            if len(self._idle) >= MAX_CONNECTIONS:
                self._drop(next(iter(self._idle)))  # the longest idle makes room
            conn.setblocking(False)
            self._selector.register(conn, selectors.EVENT_READ)
            self._idle[conn] = time.monotonic()

    def _forget(self, conn: socket.socket) -> None:
        self._idle.pop(conn, None)
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(conn)

    def _drop(self, conn: socket.socket) -> None:
        self._forget(conn)
        conn.close()

    def _answer(self, conn: socket.socket) -> None:
        """One request, then the connection is closed (HTTP/1.0, as prometheus_client's server)."""
        try:
            conn.setblocking(True)
            if self._tls is not None:
                conn.settimeout(REQUEST_SECONDS)
                conn = self._tls().wrap_socket(conn, server_side=True)
            _QuietHandler(conn, conn.getpeername(), self._wsgi)
        except OSError:
            pass  # the client went away, or timed out mid-request
        finally:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
            conn.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        for conn in list(self._idle):
            self._drop(conn)
        self._selector.close()
        self._listener.close()
        self._workers.shutdown(wait=True, cancel_futures=True)
