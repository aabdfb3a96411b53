"""localrun serve [MODEL …]: an OpenAI- and Ollama-compatible server on this machine."""

from __future__ import annotations

import sys
from typing import Annotated, Any

import typer

from localrun.cli import options as o
from localrun.server.config import (
    DEFAULT_DRAIN_TIMEOUT,
    DEFAULT_MAX_QUEUE,
    DEFAULT_MAX_REQUEST_BYTES,
    DEFAULT_PORT,
    DEFAULT_REQUEST_TIMEOUT,
)


@o.with_groups
def serve(
    models: Annotated[list[str] | None, typer.Argument(
        help="Models to load now and keep loaded (any name localrun accepts). Others load "
        "on their first request.", show_default=False)] = None,
    host: Annotated[str, typer.Option("--host", help="Address to listen on. Anything but "
                    "loopback needs --api-key (or --insecure).")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", "-p", help="Port (0: any free port).")]
    = DEFAULT_PORT,
    api_key: Annotated[str | None, typer.Option(
        "--api-key", envvar="LOCALRUN_API_KEY", show_envvar=True,
        help="Require 'Authorization: Bearer KEY' on every route but /health.")] = None,
    parallel: Annotated[int | None, typer.Option(
        "--parallel", help="Requests one model runs at once, together in its engine's batch; "
        "an engine that does not batch runs one at a time. Default: the engine's capacity, "
        "at most 4 on the CPU.", show_default=False)] = None,
    max_queue: Annotated[int, typer.Option("--max-queue", help="Requests that may wait for "
                         "a busy model; more get 429 with Retry-After.")] = DEFAULT_MAX_QUEUE,
    keep_alive: Annotated[str, typer.Option("--keep-alive", help="How long an idle model "
                          "stays loaded: 5m, 1h, 30s; -1 forever, 0 unload at once. Models "
                          "named on the command line stay.")] = "5m",
    cors_origins: Annotated[list[str] | None, typer.Option(
        "--cors-origins", help="Allow browser pages from these origins (repeatable or "
        "comma-separated; '*' for any). Off by default.")] = None,
    request_timeout: Annotated[float, typer.Option(
        "--request-timeout", help="Seconds one request may take, queue included (0: no "
        "limit); then it is stopped and answered 504.")] = DEFAULT_REQUEST_TIMEOUT,
    drain_timeout: Annotated[float, typer.Option(
        "--drain-timeout", help="On SIGTERM/Ctrl-C, seconds to finish requests in flight.")]
    = DEFAULT_DRAIN_TIMEOUT,
    max_request_mb: Annotated[float, typer.Option(
        "--max-request-mb", help="Largest request body, in MiB; larger ones get 413.")]
    = DEFAULT_MAX_REQUEST_BYTES / 2**20,
    max_memory: Annotated[float | None, typer.Option(
        "--max-memory", help="GiB all loaded models may take together (default: the "
        "machine's available memory). Past it, idle models unload, least recently used "
        "first.")] = None,
    insecure: Annotated[bool, typer.Option("--insecure", help="Allow a non-loopback --host "
                        "without --api-key.")] = False,
    *,
    loading: o.LoadingFlags,
) -> None:
    """Serve models over the OpenAI API (/v1) and the Ollama API (/api).

    Clients made for OpenAI or Ollama work unchanged: point them at the URL
    printed at start. A model runs up to --parallel requests at once where
    its engine batches, one at a time otherwise; more queue (up to
    --max-queue); a client that disconnects stops its generation; SIGTERM
    drains in-flight requests, then exits.

    Examples:

      localrun serve smollm2:135m

      localrun serve qwen2.5:0.5b --port 9000 --keep-alive 30m

      LOCALRUN_API_KEY=secret localrun serve --host 0.0.0.0
    """
    from dataclasses import replace

    from localrun.errors import LocalrunError
    from localrun.install import pip_install
    from localrun.server.config import ServerConfig, parse_duration

    try:
        from localrun.server.app import bind, create_app, make_server, tune_process
        from localrun.server.manager import ModelManager
        from localrun.server.metrics import Metrics
    except ImportError as e:
        raise LocalrunError(f"localrun serve needs its web stack ({e.name or e} is missing)",
                            hint=pip_install("serve")) from None

    origins = tuple(x.strip() for item in cors_origins or () for x in item.split(",")
                    if x.strip())
    config = ServerConfig(
        models=tuple(models or ()), host=host, port=port, api_key=api_key or None,
        parallel=parallel, max_queue=max_queue,
        keep_alive=parse_duration(keep_alive, what="--keep-alive"), cors_origins=origins,
        request_timeout=request_timeout if request_timeout > 0 else None,
        drain_timeout=max(0.0, drain_timeout), max_request_bytes=int(max_request_mb * 2**20),
        max_memory=int(max_memory * 2**30) if max_memory is not None else None,
        insecure=insecure, backend=loading.backend, context=loading.context,
        allow_unoptimized=loading.allow_unoptimized)
    config.check()
    sock = bind(config.host, config.port)
    config = replace(config, port=sock.getsockname()[1])
    _setup_logging()
    manager = ModelManager(config, Metrics())
    loaded = manager.preload(config.models, load=loading.load)
    sys.stderr.write(banner(config, loaded))
    sys.stderr.flush()
    app = create_app(config, manager=manager)
    tune_process()
    make_server(app, config).run(sockets=[sock])
    sys.stderr.write("localrun serve stopped\n")


def _setup_logging() -> None:
    import logging

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S"))
    logger = logging.getLogger("localrun.server")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


def banner(config: Any, loaded: list[Any]) -> str:
    """What the server says when it starts: where, what, and one request to try."""
    import json

    from localrun import __version__
    from localrun.server.config import format_duration
    from localrun.server.manager import DEFAULT_PARALLEL_CPU

    url = config.url
    lines = [f"localrun serve {__version__} · {url}"]
    for m in loaded:
        i = m.info
        quant = f" {i.quantization}" if i.quantization else ""
        at_once = "one request at a time" if m.slots == 1 else f"{m.slots} requests at once"
        lines.append(f"  model {m.name} · {i.backend} {i.engine_version} · {i.format}{quant} "
                     f"· {i.device or 'cpu'} · context {i.context_length} · {at_once}")
    keep = format_duration(config.keep_alive)
    lines.append(f"  {'other models' if loaded else 'models'} load on their first request "
                 f"(any name localrun accepts); idle ones unload after {keep}")
    lines.append(f"  OpenAI API {url}/v1 · Ollama API {url}/api · {url}/health · "
                 f"{url}/metrics")
    parallel = (f"up to {config.parallel} requests at once" if config.parallel is not None
                else f"up to {DEFAULT_PARALLEL_CPU} requests at once on the CPU (its engine's "
                "capacity on a GPU)")
    lines.append("  a model runs one request at a time (--parallel 1)" if config.parallel == 1
                 else f"  a model whose engine batches runs {parallel}, others one at a time")
    lines.append(f"  up to {config.max_queue} more requests wait per model, then 429")
    auth = "Bearer key required" if config.api_key else "off"
    cors = ", ".join(config.cors_origins) if config.cors_origins else "off"
    timeout = "none" if config.request_timeout is None else \
        format_duration(config.request_timeout)
    lines.append(f"  auth: {auth} · CORS: {cors} · request timeout: {timeout}")
    name = loaded[0].name if loaded else "smollm2:135m"
    body = json.dumps({"model": name, "messages": [{"role": "user", "content": "Hello!"}]})
    key = ' -H "Authorization: Bearer $LOCALRUN_API_KEY"' if config.api_key else ""
    lines.append("Try:")
    lines.append(f"  curl {url}/v1/chat/completions -H 'Content-Type: application/json'{key} "
                 f"-d '{body}'")
    lines.append("Ctrl-C (or SIGTERM) finishes the requests in flight, then stops.")
    return "\n".join(lines) + "\n"


def register(app: typer.Typer) -> None:
    app.command("serve")(serve)

