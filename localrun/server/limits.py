"""What a client may hold before any request of its own runs: connections and time.

uvicorn reads a request's headers and body for as long as a client takes, and accepts
every connection it can, so a client that opens many and sends slowly can hold them all
(slowloris), and with them the process's file descriptors. Here, before anything parses
a byte (auth included):

- a connection that has not sent complete request headers ``--header-timeout`` seconds
  after it connected (or after the first byte of its next request) is closed, as is a
  request body that arrives slower than ``--body-timeout`` seconds plus 1 s per KiB;
  the response is never timed (a stream can take as long as it takes);
- connections open at once are capped, overall and per client address, below the
  process's open-file limit; at a cap, the oldest connection that is not running a
  request (an idle keep-alive, or one still owing its headers) of the client holding
  the most is closed to make room, and only when none is, the new one is refused;
- the listening socket takes a few connections per turn of the event loop, and an
  accept that fails for want of file descriptors is reported in one line per interval
  (asyncio's own loop would retry, and log a traceback, up to 2048 times at once).
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, cast

from localrun.errors import LocalrunError
from localrun.server.config import ServerConfig
from localrun.server.errors import APIError

log = logging.getLogger("localrun.server")

#: bytes per second a request body must keep up, on top of --body-timeout (Apache's
#: mod_reqtimeout extends its body timeout the same way, by 1 s per 500 bytes)
MIN_BODY_RATE = 1024
#: connections at most by default, whatever the open-file limit: far above what a local
#: server's clients hold (a request per model slot and queue place, a few kept alive)
DEFAULT_MAX_CONNECTIONS = 1024
#: the open-file limit asked for at start where the hard limit allows (macOS starts
#: processes at 256)
WANTED_FD_LIMIT = 4096
#: connections the listening socket takes per turn of the event loop: few enough that
#: those not yet counted (accepted, not yet seen by the cap) never run out the files
ACCEPT_BATCH = 8
#: at most one line per this many seconds for each kind of refusal and accept error
LOG_INTERVAL = 10.0
#: accept() errors that mean "out of file descriptors or memory": retried later
_OUT_OF = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})

#: seconds a connection that runs no request keeps its place at the caps, at least
EVICT_AFTER = 0.5
#: connections at most that linger after a refusal (see :meth:`Guarded.refuse`), and
#: for how long (seconds)
MAX_LINGERING = 16
LINGER = 1.0

Phase = Literal["headers", "body", "app", "idle", "lingering", "closed"]


@dataclass(frozen=True)
class Limits:
    header_timeout: float
    body_timeout: float
    max_connections: int
    max_per_client: int
    fd_limit: int | None  # the soft RLIMIT_NOFILE they were sized for (None: unknown)


def fd_limit() -> int | None:
    """This process's soft open-file limit (None where there is none to read: Windows)."""
    try:
        import resource
    except ImportError:
        return None
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return None if soft == resource.RLIM_INFINITY else int(soft)


def raise_fd_limit(wanted: int = WANTED_FD_LIMIT) -> None:
    """Raise the soft open-file limit to ``wanted`` where the hard limit allows."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != resource.RLIM_INFINITY and soft < wanted:
            target = wanted if hard == resource.RLIM_INFINITY else min(hard, wanted)
            if target > soft:
                resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ImportError, OSError, ValueError):  # not allowed here: keep the limit there is
        pass


def fds_in_use() -> int:
    """File descriptors this process has open now (an estimate where it cannot list them)."""
    for where in ("/proc/self/fd", "/dev/fd"):
        try:
            return len(os.listdir(where))
        except OSError:
            continue
    return 32


def resolve(config: ServerConfig) -> Limits:
    """The limits ``config`` asks for, the connection caps sized from the open-file
    limit where not given: a quarter of the files still free (at least 48) stays for what
    the server itself opens (model files, the event loop, connections being accepted)."""
    nofile = fd_limit()
    most = DEFAULT_MAX_CONNECTIONS
    if nofile is not None:
        free = nofile - fds_in_use()
        most = max(8, min(most, free - max(48, free // 4)))
        if config.max_connections is not None and config.max_connections > free - 16:
            raise LocalrunError(
                f"--max-connections {config.max_connections} needs more files than this "
                f"process may open ({nofile}, {nofile - free} in use already)",
                hint=f"pass --max-connections {most} or less, or raise the limit (ulimit -n)")
    total = config.max_connections if config.max_connections is not None else most
    per_client = config.max_connections_per_client
    if per_client is None:
        per_client = max(1, total // 2)
    return Limits(config.header_timeout, config.body_timeout, total, min(per_client, total),
                  nofile)


class Throttled:
    """Log lines that an attack repeats: the first at once, then at most one per
    ``interval`` for each key, saying how many there were."""

    def __init__(self, interval: float = LOG_INTERVAL) -> None:
        self.interval = interval
        self._last: dict[str, float] = {}
        self._held: dict[str, tuple[int, str]] = {}

    def note(self, key: str, message: str) -> None:
        now = time.monotonic()
        last = self._last.get(key)
        if last is None or (now - last >= self.interval and key not in self._held):
            self._last[key] = now
            log.warning(message)
            return
        count, _ = self._held.get(key, (0, ""))
        if not count:
            with_loop = _running_loop()
            if with_loop is not None:
                with_loop.call_later(max(0.0, last + self.interval - now), self.flush, key)
        self._held[key] = (count + 1, message)

    def flush_all(self) -> None:
        for key in list(self._held):
            self.flush(key)

    def flush(self, key: str) -> None:
        count, message = self._held.pop(key, (0, ""))
        if count:
            self._last[key] = time.monotonic()
            log.warning(f"{message} [{count} time{'s' * (count > 1)} in the last "
                        f"{self.interval:g} s]")


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


class Gate:
    """The connections of one server: counted per client address, capped, timed."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self.count = 0
        self.lingering = 0  # refused connections being closed gently, counted apart
        self.by_client: dict[str, dict[Guarded, None]] = {}
        #: per client, its connections that run no request, longest waiting first
        self.waiting: dict[str, dict[Guarded, None]] = {}
        self.logs = Throttled()
        #: a connection waits this long at least before it may be closed to make room:
        #: one just accepted has not been read yet (its request may be there, complete)
        self.grace = min(EVICT_AFTER, limits.header_timeout / 2)

    def opened(self, conn: Guarded) -> bool:
        """Count ``conn`` in, making room if need be; False: it was refused (closed)."""
        lim = self.limits
        mine = self.by_client.get(conn.peer, {})
        now = conn.loop.time()
        if len(mine) >= lim.max_per_client:
            if not self._evict(conn.peer, now):
                conn.refuse(APIError(
                    429, f"Too many connections from {conn.peer}: {len(mine)} open, at most "
                    f"{lim.max_per_client} per client (--max-connections-per-client); "
                    "retry in a second", code="too_many_connections",
                    headers={"Retry-After": "1"}))
                self.logs.note("client", f"refused a connection from {conn.peer}: it has "
                               f"{len(mine)} open (--max-connections-per-client "
                               f"{lim.max_per_client})")
                return False
        elif self.count >= lim.max_connections:
            fullest = max((c for c, w in self.waiting.items() if w
                           and now - next(iter(w)).waiting_since >= self.grace),
                          default=None, key=lambda c: len(self.by_client[c]))
            if fullest is None or not self._evict(fullest, now):
                conn.refuse(APIError(
                    503, f"The server has {self.count} connections open, its limit "
                    f"(--max-connections {lim.max_connections}); retry in a second",
                    code="too_many_connections", headers={"Retry-After": "1"}))
                self.logs.note("total", f"refused a connection from {conn.peer}: "
                               f"{self.count} open (--max-connections "
                               f"{lim.max_connections})")
                return False
        self.by_client.setdefault(conn.peer, {})[conn] = None
        self.count += 1
        self.set_waiting(conn, True)
        return True

    def _evict(self, client: str, now: float) -> bool:
        """Close ``client``'s connection that has waited longest running no request, if
        that is ``grace`` seconds at least (a new one has not been read yet)."""
        waiting = self.waiting.get(client)
        if not waiting:
            return False
        victim = next(iter(waiting))
        if now - victim.waiting_since < self.grace:
            return False
        self.logs.note("evict", f"closed a waiting connection from {client} to make room "
                       f"(it had {len(self.by_client[client])} open; limits: "
                       f"{self.limits.max_per_client} per client, "
                       f"{self.limits.max_connections} in all)")
        victim.drop()
        return True

    def set_waiting(self, conn: Guarded, waiting: bool) -> None:
        mine = self.waiting.setdefault(conn.peer, {})
        mine.pop(conn, None)
        if waiting:
            mine[conn] = None  # to the end: the longest waiting come first
            conn.waiting_since = conn.loop.time()
        elif not mine:
            del self.waiting[conn.peer]

    def closed(self, conn: Guarded) -> None:
        mine = self.by_client.get(conn.peer)
        if mine is None or conn not in mine:
            return
        del mine[conn]
        self.count -= 1
        if not mine:
            del self.by_client[conn.peer]
        self.set_waiting(conn, False)

    def accept_failed(self, exc: OSError) -> None:
        """The listening socket ran out of file descriptors (asyncio retries in 1 s)."""
        limit = self.limits.fd_limit
        self.logs.note("accept", f"cannot accept connections: {exc.strerror or exc} "
                       f"(this process may open {limit or 'a limited number of'} files; "
                       f"{self.count} connections are open); new ones wait. Lower "
                       "--max-connections or raise the limit (ulimit -n)")


class Guarded(asyncio.Protocol):
    """Mixed into uvicorn's HTTP protocol (h11's or httptools'): the timers and the
    caps, in its ``connection_made``, ``data_received``, ``on_response_complete``
    and ``connection_lost``. Phases: "headers" (a request owed, timed), "body" (timed,
    by rate), "app" (the request is the app's, its response untimed), "idle" (kept
    alive between requests: uvicorn's own --keep-alive timer)."""

    gate: ClassVar[Gate]
    # what uvicorn's protocols have
    transport: asyncio.Transport
    loop: asyncio.AbstractEventLoop
    client: tuple[str, int] | None
    cycle: Any
    flow: Any

    peer = "-"
    phase: Phase = "headers"
    _since = 0.0  # loop time the phase began
    waiting_since = 0.0  # loop time it last began to run no request
    _got = 0  # bytes received in this phase
    _timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self.peer = self.client[0] if self.client else "-"
        self._since = self.loop.time()
        if self.gate.opened(self):
            self._arm(self._since + self.gate.limits.header_timeout)

    def data_received(self, data: bytes) -> None:
        if self.phase in ("lingering", "closed"):
            return  # answered already: what still comes is dropped
        if self.phase == "idle":  # the first byte of the next request: its headers are due
            self._enter("headers")
            self._arm(self._since + self.gate.limits.header_timeout)
        self._got += len(data)
        super().data_received(data)
        self._review()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # type: ignore[misc]
        self._review()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self.phase == "lingering":
            self.gate.lingering -= 1
        self.phase = "closed"
        self.gate.closed(self)
        super().connection_lost(exc)

    # -- phases --------------------------------------------------------------------

    def _review(self) -> None:
        """Follow the protocol's request: parsed, its body read, its response sent."""
        if self.phase == "closed" or self.transport.is_closing():
            return
        cycle = self.cycle
        if cycle is None or cycle.response_complete:
            if self.phase in ("body", "app"):
                self._enter("idle")
                self._disarm()
                self.gate.set_waiting(self, True)
        elif cycle.more_body:
            if self.phase != "body":
                self._enter("body")
                self.gate.set_waiting(self, False)
                self._arm(self._since + self.gate.limits.body_timeout)
        elif self.phase != "app":
            self._enter("app")
            self._disarm()
            self.gate.set_waiting(self, False)

    def _enter(self, phase: Phase) -> None:
        self.phase = phase
        self._since = self.loop.time()
        self._got = 0

    def _arm(self, at: float) -> None:
        self._disarm()
        self._timer = self.loop.call_at(at, self._expired)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expired(self) -> None:
        self._timer = None
        if self.phase == "closed" or self.transport.is_closing():
            return
        lim = self.gate.limits
        now = self.loop.time()
        if self.phase == "headers":
            self.gate.logs.note("headers", f"closed a connection from {self.peer}: no "
                                f"complete request headers in {lim.header_timeout:g} s "
                                "(--header-timeout)")
            if self._got:
                self.refuse(APIError(408, "The request headers did not arrive within "
                                     f"{lim.header_timeout:g} s (--header-timeout)",
                                     code="request_timeout"))
            else:
                self.drop()
        elif self.phase == "body":
            if self.flow is not None and self.flow.read_paused:
                self._enter("body")  # the server stopped reading, not the client: start over
                self._arm(self._since + lim.body_timeout)
                return
            deadline = self._since + lim.body_timeout + self._got / MIN_BODY_RATE
            if now < deadline:
                self._arm(deadline)
                return
            self.gate.logs.note("body", f"closed a connection from {self.peer}: its "
                                f"request body came slower than allowed ({self._got} bytes "
                                f"in {now - self._since:.0f} s; --body-timeout "
                                f"{lim.body_timeout:g} s plus 1 s per KiB)")
            started = self.cycle is not None and self.cycle.response_started
            if started:
                self.drop()
            else:
                path = str((getattr(self.cycle, "scope", None) or {}).get("path", ""))
                self.refuse(APIError(408, f"The request body came too slowly: {self._got} "
                                     f"bytes in {now - self._since:.0f} s (--body-timeout "
                                     f"{lim.body_timeout:g} s, plus 1 s per KiB)",
                                     code="request_timeout"), path=path)

    # -- closing -------------------------------------------------------------------

    def drop(self) -> None:
        """Close without a word (nothing was asked, or the answer already began)."""
        self._disarm()
        if self.phase == "lingering":
            self.gate.lingering -= 1
        self.phase = "closed"
        self.gate.closed(self)
        if not self.transport.is_closing():
            self.transport.close()

    def refuse(self, error: APIError, path: str = "") -> None:
        """Answer ``error`` (in the dialect of ``path`` where known) and close. Closed
        at once, a socket with unread bytes (the rest of what the client is sending)
        resets, and the client may lose the answer; so, up to ``MAX_LINGERING`` at a
        time, it is half-closed and what still comes is read and dropped for up to
        ``LINGER`` seconds first (Apache's lingering close)."""
        body = json.dumps(error.body_for(path), separators=(",", ":")).encode()
        reason = _REASONS.get(error.status, "Error")
        head = [f"HTTP/1.1 {error.status} {reason}", "content-type: application/json",
                f"content-length: {len(body)}", "connection: close"]
        head += [f"{k.lower()}: {v}" for k, v in error.headers.items()]
        if self.transport.is_closing():
            self.drop()
            return
        self.transport.write(("\r\n".join(head) + "\r\n\r\n").encode() + body)
        gate = self.gate
        if gate.lingering >= MAX_LINGERING or not self.transport.can_write_eof():
            self.drop()
            return
        self._disarm()
        gate.closed(self)
        gate.lingering += 1
        self.phase = "lingering"
        self.transport.write_eof()
        self._timer = self.loop.call_later(LINGER, self.drop)


_REASONS = {408: "Request Timeout", 429: "Too Many Requests", 503: "Service Unavailable"}


def protocol_class(gate: Gate) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol (httptools' where installed, as uvicorn picks it, else
    h11's) with ``gate``'s caps and timers."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    return cast(type[asyncio.Protocol], type(f"Guarded{AutoHTTPProtocol.__name__}",
                                             (Guarded, AutoHTTPProtocol), {"gate": gate}))


class Listener(socket.socket):
    """A listening socket that asyncio accepts at most ``ACCEPT_BATCH`` connections from
    per turn of its loop (it would take up to its backlog, 2048, before the caps see
    one), and none more in a turn whose accept ran out of file descriptors: asyncio then
    stops accepting for a second, once, instead of retrying and logging a traceback for
    every connection still in the backlog."""

    _taken = 0

    def accept(self) -> tuple[socket.socket, Any]:
        if self._taken >= ACCEPT_BATCH:
            raise BlockingIOError(errno.EAGAIN, "enough connections accepted this turn")
        if self._taken == 0:
            loop = _running_loop()
            if loop is None:  # not under an event loop: a plain socket
                return super().accept()
            loop.call_soon(self._next_turn)
        self._taken += 1
        try:
            return super().accept()
        except OSError as e:
            if e.errno in _OUT_OF:
                self._taken = ACCEPT_BATCH
            raise

    def _next_turn(self) -> None:
        self._taken = 0


def exception_handler(gate: Gate) -> Callable[[asyncio.AbstractEventLoop, dict[str, Any]],
                                              None]:
    """The event loop's handler: an accept out of file descriptors is one throttled
    line (asyncio's default logs a traceback each time); anything else as before."""

    def handle(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        exc = context.get("exception")
        if isinstance(exc, OSError) and exc.errno in _OUT_OF \
                and "accept" in str(context.get("message", "")):
            gate.accept_failed(exc)
            return
        loop.default_exception_handler(context)

    return handle

