"""The app: routes, and what wraps every request (access log, CORS, auth, size limit,
errors as JSON), plus the uvicorn server that drains on SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import math
import re
import signal
import socket
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from localrun import __version__
from localrun.errors import LocalrunError
from localrun.server import (
    anthropic_api,
    limits,
    manage_api,
    ollama_api,
    openai_api,
    policy,
    responses_api,
)
from localrun.server.config import ServerConfig
from localrun.server.errors import APIError
from localrun.server.jobs import stop_all
from localrun.server.manager import ModelManager
from localrun.server.metrics import Metrics
from localrun.server.protocol import spec
from localrun.server.state import ServerState, to_api_error

log = logging.getLogger("localrun.server")
access_log = logging.getLogger("localrun.server.access")

PUBLIC_PATHS = ("/health",)
Scope = dict[str, Any]
ASGIApp = Callable[..., Any]


def create_app(config: ServerConfig, *, manager: ModelManager | None = None) -> FastAPI:
    metrics = manager.metrics if manager is not None else Metrics()
    manager = manager or ModelManager(config, metrics)
    state = ServerState(config, manager, metrics)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await manager.start()
        try:
            yield
        finally:
            await manager.stop()
            responses_api.close_store(app)

    app = FastAPI(title="localrun", version=__version__, lifespan=lifespan, docs_url=None,
                  redoc_url=None, openapi_url=None)
    app.state.localrun = state
    app.include_router(openai_api.router)
    app.include_router(responses_api.router)
    app.include_router(anthropic_api.router)
    app.include_router(ollama_api.router)
    app.include_router(manage_api.router)

    @app.head("/health", include_in_schema=False)
    @app.get("/health", **spec.operation("GET", "/health", "localrun",
                                         summary="Liveness (no API key needed)"))
    async def health() -> Any:
        return JSONResponse({"status": "ok", "models_loaded": len(manager.models)})

    @app.get("/metrics", **spec.operation("GET", "/metrics", "localrun",
                                          summary="Prometheus metrics"))
    async def metrics_route() -> Any:
        for m in manager.models.values():  # gauges that time alone changes
            metrics.queue_depth.labels(model=m.name).set(m.waiting)
        return Response(metrics.render(), media_type=metrics.content_type)

    document: dict[str, Any] = {}

    @app.get("/openapi.json", **spec.operation("GET", "/openapi.json", "localrun",
                                               summary="This document"))
    async def openapi_route() -> Any:
        if not document:  # built once, on the first ask
            document.update(spec.openapi(app))
        return JSONResponse(document)

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> Any:
        return JSONResponse(exc.body_for(request.url.path), status_code=exc.status,
                            headers=exc.headers)

    @app.exception_handler(LocalrunError)
    async def library_error(request: Request, exc: LocalrunError) -> Any:
        e = to_api_error(exc)
        return JSONResponse(e.body_for(request.url.path), status_code=e.status,
                            headers=e.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Any:
        what = f"{request.method} {printable(request.url.path)}"
        message = {404: f"No such endpoint: {what}. localrun serves {spec.endpoints()}",
                   405: f"Method not allowed: {what}"}.get(exc.status_code, str(exc.detail))
        e = APIError(exc.status_code, message, code="not_found" if exc.status_code == 404
                     else None)
        return JSONResponse(e.body_for(request.url.path), status_code=e.status,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> Any:
        e = APIError(400, f"Invalid request: {exc.errors()[:1]}")
        return JSONResponse(e.body_for(request.url.path), status_code=400)

    # Outermost last: the access log sees every answer, CORS answers preflights (and
    # adds its headers to refusals), requests a web page could forge are refused before
    # auth, auth runs before a body is read, the guard turns any escape into JSON.
    app.add_middleware(GuardMiddleware)
    app.add_middleware(SizeLimitMiddleware, limit=config.max_request_bytes)
    if config.api_key:
        app.add_middleware(AuthMiddleware, key=config.api_key)
    app.add_middleware(BrowserGuardMiddleware, config=config)
    if config.cors_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(config.cors_origins),
                           allow_methods=["GET", "POST", "DELETE", "HEAD", "OPTIONS"],
                           allow_headers=["Authorization", "Content-Type", "x-api-key",
                                          "anthropic-version", "anthropic-beta"],
                           allow_credentials=False)
    app.add_middleware(AccessLogMiddleware, metrics=metrics)
    return app


async def _send_error(send: Any, scope: Scope, error: APIError) -> None:
    import json

    body = json.dumps(error.body_for(scope.get("path", "")), separators=(",", ":")).encode()
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in error.headers.items()]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class _HTTPMiddleware:
    """An ASGI middleware that acts on HTTP requests only (lifespan passes through)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        await self.http(scope, receive, send)

    async def http(self, scope: Scope, receive: Any, send: Any) -> None:
        await self.app(scope, receive, send)


class AuthMiddleware(_HTTPMiddleware):
    """The API key on every route but /health: ``Authorization: Bearer KEY`` (OpenAI's
    and Ollama's clients), or ``x-api-key: KEY`` (Anthropic's)."""

    def __init__(self, app: ASGIApp, key: str) -> None:
        super().__init__(app)
        self.key = key.encode()

    async def http(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope.get("path") in PUBLIC_PATHS:
            await self.app(scope, receive, send)
            return
        given: list[bytes] = []
        for name, value in scope.get("headers", []):
            if name == b"authorization" and value[:7].lower() == b"bearer ":
                given.append(value[7:].strip())
            elif name == b"x-api-key":
                given.append(value.strip())
        given = [g for g in given if g]
        if not any(hmac.compare_digest(g, self.key) for g in given):
            why = "Invalid API key" if given else "Missing API key"
            await _send_error(send, scope, APIError(
                401, f"{why}: send 'Authorization: Bearer KEY' or 'x-api-key: KEY' with the "
                "key the server was started with (--api-key or LOCALRUN_API_KEY)",
                code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"}))
            return
        await self.app(scope, receive, send)


class BrowserGuardMiddleware(_HTTPMiddleware):
    """What a web page could make a browser send, refused before any work: a ``Host``
    the server does not answer to (DNS rebinding: 403), an ``Origin`` of another site
    not in --cors-origins (403), a POST body that is not JSON (a form or ``text/plain``
    post needs no preflight: 415; :func:`policy.body_is_json` lets ``curl -d``
    through). /health answers whatever the Host (probes)."""

    def __init__(self, app: ASGIApp, config: ServerConfig) -> None:
        super().__init__(app)
        self.hosts = policy.HostRule.for_config(config)
        self.cors = config.cors_origins

    async def http(self, scope: Scope, receive: Any, send: Any) -> None:
        host = origin = ctype = agent = None
        browser = False
        for name, value in scope.get("headers", []):
            if name == b"host" and host is None:
                host = value.decode("latin-1")
            elif name == b"content-type" and ctype is None:
                ctype = value.decode("latin-1")
            elif name == b"user-agent" and agent is None:
                agent = value.decode("latin-1")
            elif name in policy.BROWSER_HEADERS:
                browser = True
                if name == b"origin" and origin is None:
                    origin = value.decode("latin-1")
        path = scope.get("path", "")
        error = None
        if path in PUBLIC_PATHS:
            pass
        elif not self.hosts.allows(host):
            error = policy.host_refused(host or "", self.hosts)
        elif origin is not None and not policy.origin_allowed(origin, host, self.cors):
            error = policy.origin_refused(origin)
        elif (policy.needs_json(scope.get("method", ""), path)
              and not policy.body_is_json(ctype, user_agent=agent, browser_headers=browser)):
            error = policy.not_json(ctype)
        if error is not None:
            await _send_error(send, scope, error)
            return
        await self.app(scope, receive, send)


class SizeLimitMiddleware(_HTTPMiddleware):
    """413 for a body over the limit: by Content-Length at once, else as it arrives."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        super().__init__(app)
        self.limit = limit

    async def http(self, scope: Scope, receive: Any, send: Any) -> None:
        for name, value in scope.get("headers", []):
            if name == b"content-length" and value.isdigit() and int(value) > self.limit:
                await _send_error(send, scope, self._error(int(value)))
                return
        seen = 0

        async def counted() -> Any:
            nonlocal seen
            message = await receive()
            if message.get("type") == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise self._error(seen)
            return message

        await self.app(scope, counted, send)

    def _error(self, size: int) -> APIError:
        return APIError(413, f"Request body of {size:,} bytes is over the limit of "
                        f"{self.limit:,} bytes (--max-request-mb)", code="request_too_large")


class GuardMiddleware(_HTTPMiddleware):
    """Whatever escapes the routes becomes a JSON 500 naming the error, never a
    traceback; the traceback goes to the server's log."""

    async def http(self, scope: Scope, receive: Any, send: Any) -> None:
        started = False

        async def tracked(message: Any) -> None:
            nonlocal started
            if message.get("type") == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except asyncio.CancelledError:
            raise
        except ClientDisconnect:  # gone while sending its body (or cut for its slowness)
            return
        except Exception as exc:
            if started:
                log.error("error after the response began: %s: %s", type(exc).__name__, exc,
                          exc_info=exc)
                return
            await _send_error(send, scope, to_api_error(exc))


_MODEL_PATH = re.compile(r"^/v1/models/.+")


class AccessLogMiddleware(_HTTPMiddleware):
    """One line per request (client, method, path, status, time, model, tokens), and the
    request counters."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        super().__init__(app)
        self.metrics = metrics

    async def http(self, scope: Scope, receive: Any, send: Any) -> None:
        t0 = time.monotonic()
        status = 0
        scope.setdefault("state", {})
        stream = False

        refusal = bytearray()  # the start of an error answer's body, for its reason

        async def watched(message: Any) -> None:
            nonlocal status, stream
            if message.get("type") == "http.response.start":
                status = int(message["status"])
                for name, value in message.get("headers", []):
                    if name == b"content-type" and (b"event-stream" in value
                                                    or b"ndjson" in value):
                        stream = True
            elif status >= 400 and len(refusal) < REASON_BYTES:
                refusal.extend(message.get("body", b"")[:REASON_BYTES - len(refusal)])
            await send(message)

        try:
            await self.app(scope, receive, watched)
        finally:
            self._log(scope, status or 500, time.monotonic() - t0, stream, bytes(refusal))

    def _log(self, scope: Scope, status: int, seconds: float, stream: bool,
             refusal: bytes = b"") -> None:
        path = scope.get("path", "")
        endpoint = "/v1/models/{model}" if _MODEL_PATH.match(path) and \
            path not in _ENDPOINTS else path
        known = endpoint in _ENDPOINTS
        note = scope.get("state", {})
        model = note.get("model", "")
        self.metrics.requests.labels(endpoint=endpoint if known else "other", model=model,
                                     status=str(status)).inc()
        self.metrics.duration.labels(endpoint=endpoint if known else "other").observe(seconds)
        client = scope.get("client") or ("-", 0)
        parts = [f'{client[0]}:{client[1]} "{printable(str(scope.get("method")))} '
                 f'{printable(path)}" {status} {seconds:.3f}s']
        if model or note.get("asked"):
            parts.append(f"model={printable(str(model or note.get('asked')))}")
        if "prompt_tokens" in note:
            parts.append(f"tokens={note['prompt_tokens']}+{note.get('completion_tokens', 0)}")
        if note.get("queued"):
            parts.append(f"queued={note['queued']:.3f}s")
        if stream:
            parts.append("stream")
        reason = error_reason(refusal) if status >= 400 else None
        if reason:
            parts.append(f'error="{printable(reason)}"')
        access_log.info(" ".join(parts))


#: how much of an error answer's body the access log reads for its reason
REASON_BYTES = 4096


def error_reason(body: bytes) -> str | None:
    """The message of an error answer, in any dialect's shape, cut to 300 characters."""
    import json

    try:
        data = json.loads(body)
    except ValueError:
        text = body.decode("utf-8", "replace").strip()
        return text[:300] or None
    error = data.get("error") if isinstance(data, dict) else None
    if isinstance(error, dict):
        error = error.get("message")
    if not isinstance(error, str):
        return None
    return error if len(error) <= 300 else error[:297] + "..."


def printable(text: str, *, quotes: bool = True) -> str:
    """``text`` as one log line shows it unambiguously: control characters (CR, LF,
    NUL, C0/C1, DEL) and other non-printable ones (bidi overrides, line separators)
    escaped as Python writes them (``\\n``, ``\\x00``, ``\\u202e``), and with ``quotes``
    the quote and the backslash too, so that a client can neither forge nor hide a line
    nor close a quoted field."""
    special = '"\\' if quotes else ""
    if text.isprintable() and not any(c in text for c in special):
        return text
    out = []
    for ch in text:
        if ch in special:
            out.append("\\" + ch)
        elif ch.isprintable():
            out.append(ch)
        else:
            out.append(ch.encode("unicode_escape").decode("ascii"))
    return "".join(out)


_ENDPOINTS = {"/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/models/{model}",
              "/v1/embeddings", "/api/chat", "/api/generate", "/api/embed", "/api/embeddings",
              "/api/tags", "/api/show", "/api/ps", "/api/version", "/api/pull", "/health",
              "/metrics", "/", "/v1/messages", "/v1/messages/count_tokens", "/openapi.json",
              "/v1/responses", "/api/create", "/api/copy", "/api/delete", "/models/load",
              "/models/unload", "/v1/models/load", "/v1/models/unload"}


# -- running it -------------------------------------------------------------------------

def bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound before anything prints (a busy port is one line)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = limits.Listener(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host.strip("[]"), port))
    except OSError as e:
        sock.close()
        if e.errno in (98, 48, 10048):  # EADDRINUSE on Linux, macOS, Windows
            raise LocalrunError(f"Port {port} on {host} is already in use",
                                hint=f"pick another: localrun serve --port {port + 1} (or "
                                "--port 0 for any free port)") from None
        raise LocalrunError(f"Cannot listen on {host}:{port}: {e.strerror or e}",
                            hint="check --host (an address of this machine, e.g. 127.0.0.1)"
                            ) from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


class Server(uvicorn.Server):
    """uvicorn's server, draining on SIGTERM/SIGINT: it stops accepting, finishes what
    is in flight for up to ``--drain-timeout`` seconds, then ends what still runs with an
    error in its API's format (a stream: its last event), unloads the models and
    returns — exit status 0, not the re-raised signal. Its connections go through
    ``gate`` (:mod:`localrun.server.limits`)."""

    def __init__(self, config: uvicorn.Config, gate: limits.Gate, drain_timeout: float
                 ) -> None:
        super().__init__(config)
        self.gate = gate
        self.drain_timeout = drain_timeout

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        asyncio.get_running_loop().set_exception_handler(limits.exception_handler(self.gate))
        await super().startup(sockets=sockets)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        expire = asyncio.get_running_loop().call_later(self.drain_timeout, self._drain_over)
        try:
            await super().shutdown(sockets=sockets)
        finally:
            expire.cancel()
            self.gate.logs.flush_all()  # what the throttled lines still held back

    def _drain_over(self) -> None:
        n = stop_all(APIError(
            503, f"The server is stopping and its --drain-timeout ({self.drain_timeout:g} s) "
            "is over: this request was stopped", code="server_stopping"))
        if n:
            log.warning(f"--drain-timeout {self.drain_timeout:g} s over: ended {n} "
                        f"request{'s' * (n > 1)} still running, with an error")

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        handled = (signal.SIGINT, signal.SIGTERM)
        original = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)


def tune_process() -> None:
    """Process settings for serving: hand the GIL over every 1 ms instead of 5 ms. An
    engine whose token loop holds the GIL (ONNX Runtime GenAI's, MLX's) otherwise makes
    the event loop wait up to 5 ms at each hand-over before a token reaches the client
    (measured here: ONNX TTFT +20 ms served vs in process). And the open-file limit up to
    4096 where allowed (macOS starts at 256): the connection caps are sized from it."""
    sys.setswitchinterval(0.001)
    limits.raise_fd_limit()


#: seconds uvicorn waits past --drain-timeout for the error events to go out, before
#: it cancels what is left
DRAIN_GRACE = 2


def make_server(app: FastAPI, config: ServerConfig) -> Server:
    """The server for ``app``: connections capped and request reading timed (a
    LocalrunError if --max-connections is more than the open-file limit allows)."""
    gate = limits.Gate(limits.resolve(config))
    uv = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on",
                        http=limits.protocol_class(gate), ws="none",
                        timeout_graceful_shutdown=math.ceil(config.drain_timeout) + DRAIN_GRACE,
                        server_header=False, timeout_keep_alive=5)
    return Server(uv, gate, config.drain_timeout)
