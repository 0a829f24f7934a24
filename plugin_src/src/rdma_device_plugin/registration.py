"""One resource's life with the kubelet: its sockets, its registration, the kubelet's stream, and
handing over between two plugin instances. The state machine is driven by the supervisor loop
(:mod:`.supervisor`) and never blocks it: Register runs on the gRPC loop (:mod:`.server`) and its
result comes back as an event.

States (of the socket registered last, the *primary*)::

    down ──serve──> serving ──Register sent──> registering ──OK──> awaiting stream ──kubelet's
     ^                 ^                            │ failed (backoff)                 ListAndWatch──> registered
     │                 └────────────────────────────┘                                                 │
     └── renewed: a fresh socket (the kubelet ended our stream, an other instance's socket went,  <────┘
         no stream after Register); our socket removed (no newer instance); kubelet restart
                                                           stood down <── a newer instance took over

What the kubelet does, and what the rules below rest on (pkg/kubelet/cm/devicemanager/plugin/v1beta1
handler.go): ``Register`` records the new client under the resource name, dials the plugin back,
then runs its ListAndWatch; re-registration never closes the earlier client. Kubelets 1.28-1.34
keep one client per resource name, and when *any* client's stream ends (``runClient`` after
``client.Run`` returns) they disconnect the client registered under the name at that moment and
mark the resource unhealthy (kubernetes issues 121994/127803): whoever's stream ends, the client
registered last is cut. Kubelets with kubernetes PR 135437 (1.35+) keep clients by socket path,
disconnect only the one whose stream ended, and refuse to register a path whose client is still
connected. So:

- **A socket is registered once.** Every new registration is of a fresh socket name (a fresh
  server, :mod:`.sockets`); an earlier socket whose kubelet stream is still open is *retired*: it
  keeps serving (ending its stream would cut the current client on 1.28-1.34) until the kubelet
  ends that stream or restarts. No path is ever registered while its client may be connected.
- **Never register while a newer instance lives** (its lock, :class:`.sockets.InstanceLock`, taken
  before anything else at its start), **nor while another instance is ending its streams** (its
  sockets renamed ``<name>.retiring`` until they are over): each of those ends cuts the client
  registered last on 1.28-1.34, so a registration then would only be cut. A Register such an end
  cut (in flight when the other instance began winding down) is sent again once it is over,
  without a back-off step: the failure repeats nothing.
- **The newest instance registers again whenever another instance's socket goes away** (removed by
  that instance once its streams ended, or here for a dead instance): on 1.28-1.34 that end
  disconnected the client registered last, which may have been ours or theirs (an older
  instance's Register can reach the kubelet after ours). When ours was cut, the cut is the event
  (the kubelet has then done with the other client: registering before that, ours could be
  dropped from its table without a word, as ``runClient`` reads the client, then deregisters by
  name). When the kubelet kept our stream, the registration it held was theirs, or the kubelet
  has PR 135437: the next once-a-second pass registers again, which is harmless on the latter.
  Not doing it can leave allocatable at 0 with our own stream open and every signal green. The
  outcome does not depend on the order in which the Register calls arrived or on how long either
  instance was stalled.
- **Handover**: once the kubelet holds our stream and has taken in our first snapshot (it rewrites
  its checkpoint file at the end of every update it takes in: the event we wait for; at the latest
  the next once-a-second pass), we rename the older instances' sockets to ``<name>.retiring``. An
  older instance sees its name gone while a newer instance lives, stands down (stops serving: its
  streams end) and removes the ``.retiring`` file, which is the event that makes us register again.
  With PR 135437 the older stream's end touches nothing of ours and allocatable never drops; on
  1.28-1.34 it drops for one registration. (Waiting for the checkpoint matters there: the older
  stream's end cuts our client, and if the kubelet is still busy with our first update, its
  goroutine of our cut client then cuts our next registration too, during its dial-back.)
- **A Register reaches the kubelet start it was meant for.** It goes through kubelet.sock opened
  ``O_PATH`` (:class:`.sockets.SocketPin`), opened before our socket is seen present: a kubelet
  starting later deletes the plugin sockets before it binds its new kubelet.sock (server.go Start
  -> CleanupPluginDirectory), so the Register could only reach it with a socket it cannot dial back
  (counted as a registration all the same, then failing after the 10 s dial). The pinned inode's
  listener is the old kubelet, or nobody (refused): the new kubelet.sock is then the event.
- **A Register in flight is never abandoned**: its server stops only after the call returned.
  Abandoned, the kubelet would fail its dial-back and, on 1.28-1.34, drop whichever client is
  registered at that moment from its table (``connectClient`` -> ``deregisterClient`` by name).

A registration without its stream after STREAM_WAIT_SECONDS (the kubelet cut it before its
ListAndWatch opened: nothing reaches the plugin then) is renewed too; every other step is an event.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import enum
import logging
import os
import time
from collections.abc import Callable, Iterable

import grpc

from . import sockets
from .kubeletapi import CHECKPOINT, KUBELET_SOCKET
from .resources import ResourcePool
from .server import Hooks, PluginServer, SocketVanished, StreamEvent
from .supervision import Backoff, LogOnce

LOG = logging.getLogger(__name__)

# After Register the kubelet opens ListAndWatch at once (a few ms). Without it in this long the
# registration was cut before its stream opened, which nothing else tells: register again.
STREAM_WAIT_SECONDS = 2.0
# Retired sockets kept serving (their kubelet streams open); beyond this the oldest is stopped.
RETIRED_MAX = 4


class State(enum.Enum):
    DOWN = "down"
    SERVING = "serving"
    REGISTERING = "registering"
    AWAITING_STREAM = "awaiting stream"
    REGISTERED = "registered"
    STOOD_DOWN = "stood down"


SENT = (State.REGISTERING, State.AWAITING_STREAM, State.REGISTERED)


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
        self._on_stream = on_stream
        self._on_registered = on_registered
        self.once = once
        self.state = State.DOWN
        self.server: PluginServer | None = None  # the primary: served, and registered (or to be)
        self.retired: list[PluginServer] = []  # registered earlier, their kubelet streams still open
        self.starts = 0  # server starts so far: the <n> of the next socket name
        self.serve_backoff = Backoff()
        self.register_backoff = Backoff()
        self.unregistered_since: float | None = time.time()
        self._pending: concurrent.futures.Future[None] | None = None
        self._stream_deadline = 0.0
        self._stopping: list[concurrent.futures.Future[None]] = []  # servers stopping on the gRPC loop
        self._doomed: list[PluginServer] = []  # to stop once no Register is in flight
        self._peers: frozenset[str] | None = None  # other instances' socket files at the last look
        self._renew_wanted = False  # register again on a fresh socket when step() may (see there)
        self._gone_unexplained = False  # another instance's socket went, and no cut of ours followed yet
        self._other_went = False  # another instance's socket went while our Register was out
        self._kubelet_registered: tuple[int, int] | None = None  # the kubelet.sock we last registered with
        self._taken_over = False  # since the last registration: the older instances were told
        self._checkpoint_sent: tuple[int, int] | None = None  # the kubelet's checkpoint when we sent Register
        self.changes = 0  # bumped at every state change: the liveness file says so at once
        # What the gRPC loop told us (events, in order): the servers whose kubelet stream is open,
        # and when the kubelet first called the primary.
        self._streaming: set[PluginServer] = set()
        self._confirmed_at: float | None = None

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

    @property
    def awaiting_takeover(self) -> bool:
        """Registered, and the older instances not yet told (the supervisor then watches the checkpoint)."""
        return self.state is State.REGISTERED and not self._taken_over

    @property
    def confirmed_at(self) -> float | None:
        """When the kubelet first called our registered socket for a pod (Allocate,
        GetPreferredAllocation): proof that its endpoint for the resource is ours. None without."""
        return self._confirmed_at if self.registered else None

    # ------------------------------------------------------------------ events

    def kubelet_restarted(self) -> None:
        """A new kubelet.sock: the kubelet emptied the dir of sockets and knows no endpoint."""
        if self.state is State.STOOD_DOWN:
            return  # the newer instance registers with the new kubelet
        self.register_backoff.last_cut = float("-inf")  # a new kubelet: its cuts repeat none of the old one's
        if self.state in SENT and self.server is not None and self.server.present():
            # Our socket outlived the new kubelet's start-up cleanup (server.go Start ->
            # CleanupPluginDirectory): it was served, and registered, with the new kubelet. One
            # registration per kubelet start: a second would leave the first client's stream open in
            # the kubelet, and its end would cut the second (kubernetes 121994).
            return
        self._cancel()
        for server in self.retired:  # their kubelet is gone: so are their streams
            self._stop(server)
        self.retired = []
        if self.server is not None and not self.server.present():
            self._stop(self.server)
            self.server = None
        self._set(State.SERVING if self.server is not None else State.DOWN)
        self.serve_backoff.succeeded()
        self.register_backoff.succeeded()

    def stream_event(self, server: PluginServer, what: str, now: float) -> None:
        """From the gRPC loop (through the supervisor's inbox): a stream of ``server`` opened or ended,
        or the kubelet called it."""
        if what == "kubelet opened":
            self._streaming.add(server)
        elif what == "kubelet ended":
            self._streaming.discard(server)
        if server in self.retired:
            if server not in self._streaming:  # the kubelet let go of it: stopping it cuts nothing
                self.retired.remove(server)
                self._stop(server)
            return
        if server is not self.server:
            return  # a stopped server's stream: it no longer speaks for the resource
        if what == "kubelet called":
            self._confirmed_at = time.time()
            self.changes += 1
        elif what == "kubelet opened":
            if self.state in (State.REGISTERING, State.AWAITING_STREAM):
                self._registered()
        elif what == "kubelet ended" and self.state in (State.REGISTERED, State.AWAITING_STREAM):
            self.hooks.stream_ended(self.name)
            wait = 0.0
            kubelet = os.path.join(self.dir, KUBELET_SOCKET)
            if sockets.file_id(kubelet) != self._kubelet_registered or not sockets.listening(kubelet):
                # The kubelet is restarting (its socket gone, replaced, or nobody behind it): no repeat
                # to back off from; the new kubelet.sock is the event (supervisor: kubelet_restarted).
                self._want_renew(keep_backoff=False)
                when = "when it is back (it is restarting)"
            elif self._gone_unexplained or any(s.retiring for s in self._others()):
                # Another instance is ending its streams: that is what cut ours, and it may cut again
                # until it is done. Registering again then (step) is no repeat to back off from.
                self._want_renew(keep_backoff=False)
                when = "once the other instance's streams are over"
            else:
                wait = self.register_backoff.cut(now)
                self._want_renew(keep_backoff=True)
                when = "at once" if wait <= 0 else f"in {wait:.1f} s (it ended again within 10 s)"
            LOG.log(
                logging.INFO if wait <= 0 else logging.WARNING,  # a kubelet restart, a handover; repeats warn
                "the kubelet ended the ListAndWatch stream of %s; registering again %s",
                self.name,
                when,
                extra={"resource": self.name},
            )

    def register_done(self, server: PluginServer, future: concurrent.futures.Future[None]) -> None:
        """The Register call of ``server`` finished (on the gRPC loop; delivered here)."""
        if future is not self._pending:
            return  # cancelled, or a server since renewed
        self._pending = None
        self._flush_stops()
        exc = None if future.cancelled() else future.exception()
        if exc is not None:
            detail = exc.details() if isinstance(exc, grpc.RpcError) else str(exc)
            if self._other_went or any(s.retiring for s in self._others()):
                # Another instance ended its streams meanwhile: on 1.28-1.34 that end cuts the client
                # registered last, ours during its dial-back ("failed to get device plugin options:
                # ... the client connection is closing"), and the kubelet is done with it once our
                # call failed. No repeat to back off from: again once that instance is over (step).
                LOG.info(
                    "registration of %s failed while another instance ended its streams (%s); "
                    "registering again once it is over",
                    self.name,
                    detail,
                    extra={"resource": self.name},
                )
                self._set(State.SERVING)
                self._want_renew(keep_backoff=False)
                return
            self.register_backoff.failed(time.monotonic())
            # The first failures come with a kubelet restart (its socket there, nobody listening yet):
            # INFO; from the third on, WARNING.
            keeps = self.register_backoff.failures >= 3
            self.once.problem(
                f"register {self.name}",
                "registration of %s with the kubelet %s: %s; retrying with backoff (0.5 s doubling to 5 s)",
                self.name,
                "keeps failing" if keeps else "failed",
                detail,
                level=logging.WARNING if keeps else logging.INFO,
                extra={"resource": self.name},
            )
            # On a fresh socket: a kubelet that timed out may still connect this one later, and one
            # with PR 135437 refuses a path it holds.
            self._set(State.SERVING)
            self._want_renew(keep_backoff=True)
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
        self.hooks.registered(self.name)
        if server in self._streaming:  # its stream opened before the answer got here
            if self.state is not State.REGISTERED:
                self._registered()
        else:
            self._stream_deadline = time.monotonic() + STREAM_WAIT_SECONDS
            self._set(State.AWAITING_STREAM)

    def _registered(self) -> None:
        self._set(State.REGISTERED)
        if self._checkpoint_id() != self._checkpoint_sent:
            self._take_over()

    def _checkpoint_id(self) -> tuple[int, int] | None:
        try:
            st = os.stat(os.path.join(self.dir, CHECKPOINT))
        except OSError:
            return None
        return (st.st_ino, st.st_mtime_ns)

    # ------------------------------------------------------------------ the other instances

    def _others(self) -> list[sockets.SocketName]:
        return [s for s in sockets.instances(self.dir, self.name) if s.instance != sockets.INSTANCE]

    def _alive(self, instance: str, files: Iterable[sockets.SocketName]) -> bool:
        """By its lock; without one (an older version, or an instance exiting), by a listening socket."""
        found = sockets.alive(self.dir, instance)
        if found is not None:
            return found
        return any(sockets.listening(os.path.join(self.dir, f.name)) for f in files if f.instance == instance)

    def newer_instance(self, others: list[sockets.SocketName] | None = None) -> str | None:
        """A newer instance that is alive (it serves the resource, or will again in a moment), if any."""
        others = self._others() if others is None else others
        newer = {s.instance for s in others if s.instance > sockets.INSTANCE}
        newer.update(sockets.live_instances(self.dir, after=sockets.INSTANCE))
        for instance in sorted(newer, reverse=True):
            if self._alive(instance, others):
                return instance
        return None

    def _remove_dead(self, others: list[sockets.SocketName]) -> None:
        """Remove the sockets (served or retiring) of instances that are gone."""
        verdict: dict[str, bool] = {}
        for other in others:
            if other.instance not in verdict:
                verdict[other.instance] = self._alive(other.instance, others)
            if verdict[other.instance]:
                continue
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(self.dir, other.name))
                LOG.info("removed the stale socket %s", other.name, extra={"resource": self.name})

    def _take_over(self) -> None:
        """The kubelet holds our stream: rename the older instances' served sockets (they stand down
        and remove the renamed file once they stopped serving); remove those of dead instances."""
        others = self._others()
        self._remove_dead(others)
        others = self._others()
        # Our own renames are no news, but what we renamed may already be gone by the next look: the
        # older instance stands down as soon as it sees the rename. The peers are the names as we left
        # them, not a listing taken after the renames (that one can miss the .retiring file, and its
        # removal, the event to register again on, would then never be seen).
        peers = {s.name for s in others}
        for other in others:
            if other.instance > sockets.INSTANCE or other.retiring:
                continue
            path = os.path.join(self.dir, other.name)
            try:
                os.rename(path, path + sockets.RETIRING)
            except FileNotFoundError:
                continue  # gone meanwhile: kept in the peers, so the next pass sees it went
            peers.remove(other.name)
            peers.add(other.name + sockets.RETIRING)
            LOG.info(
                "took over %s from an older instance: renamed its socket %s (it stands down)",
                self.name,
                other.name,
                extra={"resource": self.name},
            )
        self._taken_over = True
        self._peers = frozenset(peers)

    def _stand_down(self, newer: str) -> None:
        LOG.info(
            "a newer instance (%s) took over %s; standing down",
            newer,
            self.name,
            extra={"resource": self.name},
        )
        for server in [*self.retired, self.server]:
            if server is not None:
                self._stop(server)
        self.server, self.retired = None, []
        self._set(State.STOOD_DOWN)

    # ------------------------------------------------------------------ the pass

    def step(self, now: float, kubelet_present: bool, slow: bool) -> None:
        """React to the sockets' state and run what is due (``slow``: the once-a-second pass)."""
        others = self._others()
        newer = self.newer_instance(others)
        if self.state is State.STOOD_DOWN:
            if newer is not None:
                self._peers = frozenset(s.name for s in others)
                return
            LOG.info("no newer instance serves %s any more; serving it again", self.name)
            self._set(State.DOWN)
        if self.server is not None and not self.server.present():
            if newer is not None:
                if self.state is not State.REGISTERING:  # else when the Register in flight returns
                    self._stand_down(newer)
                return
            LOG.info("plugin socket %s was removed; serving it again", self.server.path, extra={"resource": self.name})
            self._want_renew(keep_backoff=False)
            self._renew(now)
        for server in [s for s in self.retired if not s.present()]:
            self.retired.remove(server)
            self._stop(server)
        self._remove_dead(others)
        others = self._others()
        names = frozenset(s.name for s in others)
        gone = self._peers is not None and not names >= self._peers
        self._peers = names
        if gone and newer is None and self.state in SENT:
            if self.registered and self.kubelet_stream_open:
                # On 1.28-1.34 that end cuts the client registered last: ours, as a rule, and the
                # kubelet's cut is the sign that its teardown of the other client is over (registering
                # before it, ours can be dropped from its table without a word: handler.go runClient
                # reads the client, then deregisters by name). An older instance's Register that
                # reached the kubelet after ours gives no sign: the next once-a-second pass renews then.
                self._gone_unexplained = True
            else:
                self._other_went = True
                LOG.info(
                    "another instance's socket of %s went away while registering; registering again",
                    self.name,
                    extra={"resource": self.name},
                )
                self._want_renew(keep_backoff=False)
        if self._gone_unexplained and slow:
            LOG.info(
                "another instance's socket of %s went away (its streams ended) and the kubelet kept our "
                "stream; registering again in case its registration was the one it held",
                self.name,
                extra={"resource": self.name},
            )
            self._want_renew(keep_backoff=False)
        # Another instance is ending its streams (standing down or exiting: its sockets are renamed
        # <name>.retiring until they are over): each end cuts the client registered last on 1.28-1.34,
        # so registering now would only be cut. Its last file going is the event to go on.
        winding = any(s.retiring for s in others)
        if self._renew_wanted and not winding and self.state is not State.REGISTERING:
            self._renew(now)
        if self.state is State.DOWN:
            self._serve(now)
        if (
            self.state is State.SERVING
            and kubelet_present
            and self.register_backoff.due(now)
            and newer is None
            and not winding
        ):
            self._register()
        if self.awaiting_takeover and (slow or self._checkpoint_id() != self._checkpoint_sent):
            self._take_over()  # the kubelet has taken in our first update (or a second has passed)
        elif (
            self._taken_over
            and self.state is State.REGISTERED
            and any(s.instance < sockets.INSTANCE and not s.retiring for s in others)
        ):  # an older instance served (again) after we took over
            self._take_over()
        if self.state is State.AWAITING_STREAM and now >= self._stream_deadline and not self._renew_wanted:
            LOG.warning(
                "the kubelet did not open the ListAndWatch stream of %s within %g s of registering; "
                "registering again on a fresh socket",
                self.name,
                STREAM_WAIT_SECONDS,
                extra={"resource": self.name},
            )
            self.register_backoff.failed(now)
            self._want_renew(keep_backoff=True)
            if not winding:
                self._renew(now)
        self._flush_stops()

    def next_due(self, kubelet_present: bool) -> float:
        """When :meth:`step` must run again without a notification (monotonic; inf: only on events)."""
        if self.state is State.DOWN:
            return self.serve_backoff.next_at
        if self.state is State.SERVING and kubelet_present:
            return self.register_backoff.next_at
        if self.state is State.AWAITING_STREAM:
            return self._stream_deadline
        return float("inf")

    def _want_renew(self, keep_backoff: bool) -> None:
        """Register again on a fresh socket, as soon as :meth:`step` may (``keep_backoff``: when the
        backoff says; else at once)."""
        self._renew_wanted = True
        if not keep_backoff:
            self.register_backoff.succeeded()

    def _renew(self, now: float) -> None:
        """The primary retires when the kubelet may still hold it (its stream open, or about to open:
        never ended by us), else stops; a fresh one is served now."""
        self._cancel()  # only when our socket vanished under a Register in flight: that call is lost
        self._renew_wanted = self._gone_unexplained = False
        old, self.server = self.server, None
        may_hold = old is not None and (old in self._streaming or self.state is State.AWAITING_STREAM)
        self._confirmed_at = None
        self._set(State.DOWN)
        self.serve_backoff.succeeded()
        self._serve(now)  # first: stopping a server holds the gRPC loop for a few ms
        if old is None:
            return
        if may_hold and old.present():
            self.retired.append(old)
            while len(self.retired) > RETIRED_MAX:
                self._stop(self.retired.pop(0))
        else:
            self._stop(old)

    def _serve(self, now: float) -> None:
        if not self.serve_backoff.due(now):
            return
        server = PluginServer(
            self.pool,
            self.dir,
            sockets.socket_name(self.name, self.starts),
            self.hooks,
            self._on_stream,
        )
        try:
            server.start()
        except SocketVanished as exc:
            # Deleted between bind and look: a kubelet starting up empties the dir. Its new
            # kubelet.sock comes next; serve again now, under the next name (this one existed).
            self.starts += 1
            LOG.info("%s (a kubelet starting empties the dir); a fresh socket next", exc, extra={"resource": self.name})
            return
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
        path = os.path.join(self.dir, KUBELET_SOCKET)
        try:
            kubelet = sockets.SocketPin(path)
        except FileNotFoundError:
            return  # gone again (a kubelet restarting): its new socket is the event
        except OSError as exc:
            self.register_backoff.failed(time.monotonic())
            self.once.problem(
                f"register {self.name}",
                "cannot open %s to register %s: %s; retrying with backoff (0.5 s doubling to 5 s)",
                path,
                self.name,
                exc,
                level=logging.WARNING,
                extra={"resource": self.name},
            )
            return
        if not server.present():
            # A kubelet started since we served, and its start-up cleanup took our socket: the
            # kubelet pinned (or a later one) could not dial it back. Serve afresh first (step).
            kubelet.close()
            return
        self._kubelet_registered = kubelet.id
        self._other_went = False
        self._checkpoint_sent = self._checkpoint_id()
        self._taken_over = False
        future = server.register(kubelet)
        self._pending = future
        self._set(State.REGISTERING)
        future.add_done_callback(lambda f: self._on_registered(self, server, f))

    # ------------------------------------------------------------------ teardown

    def _cancel(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.cancel()
        self._flush_stops()

    def _stop(self, server: PluginServer) -> None:
        """Stop a server on the gRPC loop, not waiting here: its streams end there, then its file goes.
        Not while our Register is in flight: a server's stop holds the gRPC loop for a few ms, and
        the kubelet's dial-back inside Register is answered on that loop."""
        self._streaming.discard(server)
        server.forget()
        self._doomed.append(server)
        self._flush_stops()

    def _flush_stops(self) -> None:
        if self._pending is not None or not self._doomed:
            return
        self._stopping = [f for f in self._stopping if not f.done()]
        self._stopping += [server.stop_soon() for server in self._doomed]
        self._doomed = []

    def stop(self) -> tuple[list[PluginServer], list[concurrent.futures.Future[None]]]:
        """At exit: cancel a Register in flight; the servers to stop (all together, by the caller)
        and the servers still stopping."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.cancel()
        servers = [s for s in [self.server, *self.retired, *self._doomed] if s is not None]
        self.server, self.retired, self._doomed = None, [], []
        return servers, self._stopping

    def open_streams(self) -> int:
        return sum(s.open_streams() for s in [self.server, *self.retired] if s is not None)

    @property
    def kubelet_stream_open(self) -> bool:
        return self.server is not None and self.server in self._streaming
