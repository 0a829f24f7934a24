"""One resource's life with the kubelet: its socket, its registration, the kubelet's stream, and
handing over between two plugin instances. The state machine is driven by the supervisor loop
(:mod:`.supervisor`) and never blocks it: Register runs on the gRPC loop (:mod:`.server`) and its
result comes back as an event.

States::

    down ──serve──> serving ──Register sent──> registering ──OK──> awaiting stream ──kubelet's
     ^                 ^  ^                         │ failed (backoff)                 ListAndWatch──> registered
     │                 │  └─────────────────────────┘          │ no stream in 2 s (backoff)              │
     │                 └───────────────────────────────────────┘ <── the kubelet ended its stream ─────┘
     │                                                              (at once the first time, then backoff)
     └── our socket removed (no newer instance) / kubelet restart      stood down <── a newer instance took over

Handover (a DaemonSet rolling update, a mode switch): every instance serves its own socket name
(:mod:`.sockets`). A new instance registers while the old one still serves; once the kubelet has
opened the new instance's stream (and TAKEOVER_DELAY_SECONDS later), the new instance removes the
older instances' sockets of the resource. The old one sees its socket gone while a newer instance
listens and stands down: it stops serving, so its stream ends only when the kubelet already holds
the new, healthy endpoint. Kubelets with kubernetes PR 135437 (endpoints by socket path) then
disconnect just the old client: no gap. Kubelets 1.28-1.34 cut the client registered *now* when an
older stream ends (kubernetes 121994/127803): the new instance sees the kubelet end its stream and
registers again at once, a gap of one registration.
"""

from __future__ import annotations

import concurrent.futures
import enum
import logging
import os
import time
from collections.abc import Callable

import grpc

from . import sockets
from .resources import ResourcePool
from .server import Hooks, PluginServer, SnapshotFeed, StreamEvent
from .supervision import Backoff, LogOnce

LOG = logging.getLogger(__name__)

# After Register the kubelet opens ListAndWatch at once (a few ms); without it in this long, the
# registration did not take (an older stream's end cut it before it opened): register again.
STREAM_WAIT_SECONDS = 2.0
# Taking over waits this long after the kubelet opened our stream. The older instance stands down
# at once, and on 1.28-1.34 kubelets its stream's end cuts whichever client is registered when
# the kubelet's goroutine of the cut client looks (handler.go runClient, after client.go Run
# returns): while the kubelet is still busy with our first snapshot (writing its checkpoint), that
# is our *next* registration (kubernetes 121994). Once the first snapshot is in, the kubelet is idle.
TAKEOVER_DELAY_SECONDS = 0.25


class State(enum.Enum):
    DOWN = "down"
    SERVING = "serving"
    REGISTERING = "registering"
    AWAITING_STREAM = "awaiting stream"
    REGISTERED = "registered"
    STOOD_DOWN = "stood down"


class Registration:
    """The state machine of one resource; every method runs on the supervisor's thread."""

    def __init__(
        self,
        pool: ResourcePool,
        device_plugin_dir: str,
        hooks: Hooks,
        on_stream: StreamEvent,
        on_registered: Callable[[Registration, PluginServer, concurrent.futures.Future[None]], None],
        once: LogOnce,
    ) -> None:
        self.pool = pool
        self.name = pool.name
        self.dir = device_plugin_dir
        self.hooks = hooks
        self.feed = SnapshotFeed(pool)
        self._on_stream = on_stream
        self._on_registered = on_registered
        self.once = once
        self.state = State.DOWN
        self.server: PluginServer | None = None
        self.starts = 0  # server starts so far: the <n> of the next socket name
        self.serve_backoff = Backoff()
        self.register_backoff = Backoff()
        self.unregistered_since: float | None = time.time()
        self._pending: concurrent.futures.Future[None] | None = None
        self._stream_deadline = 0.0
        self._takeover_at: float | None = None  # when to remove older instances' sockets
        self._sent_ns = 0  # when the last Register was sent (wall clock, as kubelet.sock's ctime)
        self._stopping: list[concurrent.futures.Future[None]] = []  # servers stopping on the gRPC loop
        self._newer_gone = False  # stood down, and no newer instance listened at the last slow pass
        self.changes = 0  # bumped at every state change: the liveness file says so at once

    def _set(self, state: State) -> None:
        if state is self.state:
            return
        LOG.debug("registration %s -> %s", self.state.value, state.value, extra={"resource": self.name})
        self.state = state
        self.changes += 1
        if state is State.REGISTERED:
            self.unregistered_since = None
        elif self.unregistered_since is None and state is not State.STOOD_DOWN:
            self.unregistered_since = time.time()

    @property
    def registered(self) -> bool:
        return self.state is State.REGISTERED

    @property
    def stood_down(self) -> bool:
        return self.state is State.STOOD_DOWN

    # ------------------------------------------------------------------ events

    def kubelet_restarted(self, since_ns: int) -> None:
        """A new kubelet.sock (created at ``since_ns``, wall clock): the kubelet emptied the dir of
        files and knows no endpoint."""
        if self.state is State.STOOD_DOWN:
            return  # the newer instance registers with the new kubelet
        sent_after = self._sent_ns >= since_ns
        if self.state in (State.REGISTERING, State.AWAITING_STREAM, State.REGISTERED) and sent_after:
            # Already sent to the new kubelet (the old one's streams ended first and were answered
            # at once): one registration per kubelet start. A second would leave the first client's
            # stream open in the kubelet, and its end would cut the second (kubernetes 121994).
            return
        self._cancel()
        if self.server is not None and not self.server.present():
            self._drop_server()
        self._set(State.SERVING if self.server is not None else State.DOWN)
        self.serve_backoff.succeeded()
        self.register_backoff.succeeded()

    def stream_event(self, server: PluginServer, what: str, now: float) -> None:
        """From the gRPC loop (through the supervisor's inbox): a stream of ``server`` opened or ended."""
        if server is not self.server:
            return  # a stopped server's stream: it no longer speaks for the resource
        if what == "kubelet opened":
            if self.state in (State.REGISTERING, State.AWAITING_STREAM):
                self._registered()
        elif what == "kubelet ended" and self.state in (State.REGISTERED, State.AWAITING_STREAM):
            self.hooks.stream_ended(self.name)
            wait = self.register_backoff.cut(now)
            when = "at once" if wait <= 0 else f"in {wait:.1f} s (it ended again within 10 s)"
            LOG.warning(
                "the kubelet ended the ListAndWatch stream of %s; registering again %s",
                self.name,
                when,
                extra={"resource": self.name},
            )
            self._set(State.SERVING)

    def register_done(self, server: PluginServer, future: concurrent.futures.Future[None]) -> None:
        """The Register call of ``server`` finished (on the gRPC loop; delivered here)."""
        if future is not self._pending:
            return  # cancelled, or a server since replaced
        self._pending = None
        exc = future.exception()
        if exc is not None:
            detail = exc.details() if isinstance(exc, grpc.RpcError) else str(exc)
            self.register_backoff.failed(time.monotonic())
            self.once.problem(
                f"register {self.name}",
                "registration of %s with the kubelet failed: %s; retrying with backoff (0.5 s doubling to 5 s)",
                self.name,
                detail,
                extra={"resource": self.name},
            )
            self._set(State.SERVING)
            return
        if self.register_backoff.failures:
            LOG.info(
                "registered %s after %d failed attempts",
                self.name,
                self.register_backoff.failures,
                extra={"resource": self.name},
            )
        self.once.cleared(f"register {self.name}")
        self.register_backoff.succeeded()
        if server.kubelet_stream_open:
            self._registered()
        else:
            self._stream_deadline = time.monotonic() + STREAM_WAIT_SECONDS
            self._set(State.AWAITING_STREAM)

    def _registered(self) -> None:
        self._set(State.REGISTERED)
        self._takeover_at = time.monotonic() + TAKEOVER_DELAY_SECONDS

    # ------------------------------------------------------------------ handover

    def _take_over(self) -> None:
        """The kubelet holds our stream: the older instances' sockets of the resource go (they
        stand down when they see it), stale ones of dead instances with them."""
        self._remove_stale(newer=False)

    def _remove_stale(self, newer: bool) -> None:
        """Remove the other instances' sockets of the resource: the older ones (``newer`` False:
        a takeover), or the newer ones, which nobody listens on any more (a newer instance died)."""
        for other in sockets.instances(self.dir, self.name):
            if other.instance == sockets.INSTANCE or (other.instance > sockets.INSTANCE) != newer:
                continue
            path = os.path.join(self.dir, other.name)
            live = sockets.listening(path)
            if live and newer:
                continue  # it came back since: the next once-a-second pass stands down again
            try:
                os.unlink(path)
            except FileNotFoundError:
                continue
            if live:
                LOG.info(
                    "took over %s from an older instance: removed its socket %s (it stands down)",
                    self.name,
                    other.name,
                    extra={"resource": self.name},
                )
            else:
                LOG.info("removed the stale socket %s", other.name, extra={"resource": self.name})

    def newer_instance(self) -> str | None:
        """The socket of a newer instance of this resource that is listening, if any."""
        for other in reversed(sockets.instances(self.dir, self.name)):
            if other.instance <= sockets.INSTANCE:
                return None
            if sockets.listening(os.path.join(self.dir, other.name)):
                return other.name
        return None

    def _stand_down(self, newer: str) -> None:
        LOG.warning(
            "a newer instance serves %s (%s) and removed our socket; standing down",
            self.name,
            newer,
            extra={"resource": self.name},
        )
        self._cancel()
        self._drop_server()
        self._set(State.STOOD_DOWN)

    # ------------------------------------------------------------------ the pass

    def step(self, now: float, kubelet_present: bool, slow: bool) -> None:
        """React to the socket's state and run what is due (``slow``: the once-a-second pass)."""
        if self.state is State.STOOD_DOWN:
            if not slow:
                return
            # Two passes in a row without a newer instance listening: a kubelet restart removes
            # every socket, and the newer instance serves again within milliseconds.
            gone, self._newer_gone = self._newer_gone, self.newer_instance() is None
            if not (gone and self._newer_gone):
                return
            self._newer_gone = False
            LOG.info("no newer instance serves %s any more; serving it again", self.name)
            self._remove_stale(newer=True)
            self._set(State.DOWN)
        if self.server is not None and not self.server.present():
            newer = self.newer_instance()
            if newer is not None:
                self._stand_down(newer)
                return
            LOG.info("plugin socket %s was removed; serving it again", self.server.path, extra={"resource": self.name})
            self._cancel()
            self._drop_server()
            self._set(State.DOWN)
            self.register_backoff.succeeded()
        if self.state is State.DOWN:
            self._serve(now)
        if self.state is State.SERVING and kubelet_present and self.register_backoff.due(now):
            self._register()
        if self._takeover_at is not None and now >= self._takeover_at:
            self._takeover_at = None
            if self.state is State.REGISTERED:
                self._take_over()
        if self.state is State.AWAITING_STREAM and now >= self._stream_deadline:
            LOG.warning(
                "the kubelet did not open the ListAndWatch stream of %s within %g s of registering; registering again",
                self.name,
                STREAM_WAIT_SECONDS,
                extra={"resource": self.name},
            )
            self.register_backoff.failed(now)
            self._set(State.SERVING)

    def next_due(self, kubelet_present: bool) -> float:
        """When :meth:`step` must run again without a notification (monotonic; inf: only on events)."""
        if self.state is State.DOWN:
            return self.serve_backoff.next_at
        if self.state is State.SERVING and kubelet_present:
            return self.register_backoff.next_at
        if self.state is State.AWAITING_STREAM:
            return self._stream_deadline
        if self.state is State.REGISTERED and self._takeover_at is not None:
            return self._takeover_at
        return float("inf")

    def _serve(self, now: float) -> None:
        if not self.serve_backoff.due(now):
            return
        server = PluginServer(
            self.pool,
            self.feed,
            self.dir,
            sockets.socket_name(self.name, self.starts),
            self.hooks,
            self._on_stream,
        )
        try:
            server.start()
        except (OSError, RuntimeError) as exc:
            self.serve_backoff.failed(now)
            self.once.problem(
                f"serve {self.name}",
                "cannot serve %s at %s (%s); retrying with backoff up to 5 s",
                self.name,
                server.path,
                exc,
                extra={"resource": self.name},
            )
            return
        self.starts += 1  # a name is used once: the next start gets the next one
        self.serve_backoff.succeeded()
        self.once.cleared(f"serve {self.name}", f"serving {self.name} again", extra={"resource": self.name})
        self.server = server
        self._set(State.SERVING)

    def _register(self) -> None:
        server = self.server
        assert server is not None
        self._sent_ns = time.time_ns()
        future = server.register()
        self._pending = future
        self._set(State.REGISTERING)
        future.add_done_callback(lambda f: self._on_registered(self, server, f))

    # ------------------------------------------------------------------ teardown

    def _cancel(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.cancel()

    def _drop_server(self) -> None:
        """Stop the server on the gRPC loop, not waiting here: its streams end there."""
        server, self.server = self.server, None
        self._stopping = [f for f in self._stopping if not f.done()]
        if server is not None:
            self._stopping.append(server.stop_soon())

    def stop(self) -> tuple[PluginServer | None, list[concurrent.futures.Future[None]]]:
        """At exit: cancel a Register in flight; the server to stop (all together, by the caller)
        and the servers still stopping."""
        self._cancel()
        server, self.server = self.server, None
        return server, self._stopping

    def open_streams(self) -> int:
        return self.server.open_streams() if self.server is not None else 0

    @property
    def kubelet_stream_open(self) -> bool:
        return self.server is not None and self.server.kubelet_stream_open
