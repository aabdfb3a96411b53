"""localrun serve [MODEL …]: an OpenAI- and Ollama-compatible server on this machine."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from localrun.cli import options as o
from localrun.server.config import (
    DEFAULT_BODY_TIMEOUT,
    DEFAULT_DRAIN_TIMEOUT,
    DEFAULT_HEADER_TIMEOUT,
    DEFAULT_MAX_QUEUE,
    DEFAULT_MAX_REQUEST_BYTES,
    DEFAULT_PORT,
    DEFAULT_REQUEST_TIMEOUT,
)

#: Where the API key is read from when no flag gives it.
KEY_ENV = "LOCALRUN_API_KEY"


@o.with_groups
def serve(
    models: Annotated[list[str] | None, typer.Argument(
        help="Models to load now and keep loaded (any name localrun accepts). Others load "
        "on their first request.", show_default=False)] = None,
    host: Annotated[str | None, typer.Option(
        "--host", envvar="LOCALRUN_HOST", show_envvar=False,
        help="Address to listen on: host, host:port or http://host:port (default: "
        "$LOCALRUN_HOST, read as Ollama reads OLLAMA_HOST, else 127.0.0.1). Anything but "
        "loopback needs --api-key (or --insecure).", show_default=False)] = None,
    port: Annotated[int | None, typer.Option(
        "--port", "-p", help=f"Port (0: any free port; default: the one in --host, else "
        f"{DEFAULT_PORT}).", show_default=False)] = None,
    api_key: Annotated[str | None, typer.Option(
        "--api-key", help="Require 'Authorization: Bearer KEY' on every route but /health "
        "(and allow API requests to download and to load local paths). Other users of this "
        f"machine see it in `ps`: prefer ${KEY_ENV} or --api-key-file. (LOCALRUN_REMOTE_API_KEY "
        "is another key: the one run, chat and generate send to a --base-url server.)",
        show_default=False)] = None,
    api_key_file: Annotated[Path | None, typer.Option(
        "--api-key-file", help="Read the API key from this file (its first line), so that "
        "it is not on the command line.", show_default=False)] = None,
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
        "--cors-origins", help="Allow browser pages from these origins, e.g. "
        "http://localhost:3000 (repeatable or comma-separated; '*' for any). Off by "
        "default: requests with another site's Origin get 403.")] = None,
    allowed_hosts: Annotated[list[str] | None, typer.Option(
        "--allowed-hosts", help="Also answer requests for these host names (the Host "
        "header), e.g. a reverse proxy's (repeatable or comma-separated; '*' for any). By "
        "default: localhost and the listening address (and this machine's name when not "
        "on loopback); others get 403, which stops DNS rebinding.")] = None,
    allow_pull: Annotated[bool, typer.Option(
        "--allow-pull", help="Let API requests download models (/api/pull, a name not in "
        "the cache). Off by default unless an API key is set.")] = False,
    allow_local_paths: Annotated[bool, typer.Option(
        "--allow-local-paths", help="Let API requests load files and folders by path "
        "(/x/m.gguf, ./m, ~/m). Off by default unless an API key is set; models named "
        "here always load.")] = False,
    allow_delete: Annotated[bool, typer.Option(
        "--allow-delete", help="Let /api/delete delete model files: only what localrun "
        "pulled under the name, as localrun rm. Off by default unless an API key is set; "
        "presets are deleted either way.")] = False,
    request_timeout: Annotated[float, typer.Option(
        "--request-timeout", help="Seconds one request may take, queue included (0: no "
        "limit); then it is stopped and answered 504.")] = DEFAULT_REQUEST_TIMEOUT,
    drain_timeout: Annotated[float, typer.Option(
        "--drain-timeout", help="On SIGTERM/Ctrl-C, seconds to finish requests in flight.")]
    = DEFAULT_DRAIN_TIMEOUT,
    max_request_mb: Annotated[float, typer.Option(
        "--max-request-mb", help="Largest request body, in MiB; larger ones get 413.")]
    = DEFAULT_MAX_REQUEST_BYTES / 2**20,
    header_timeout: Annotated[float, typer.Option(
        "--header-timeout", help="Seconds a client has to send a request's headers, from "
        "connecting (or from the first byte of its next request); then it is closed.")]
    = DEFAULT_HEADER_TIMEOUT,
    body_timeout: Annotated[float, typer.Option(
        "--body-timeout", help="Seconds a request body has to arrive, plus 1 s per KiB "
        "received; a slower one gets 408 and is closed.")] = DEFAULT_BODY_TIMEOUT,
    max_connections: Annotated[int | None, typer.Option(
        "--max-connections", help="Connections open at once. At the cap, the oldest idle "
        "one of the client holding the most is closed, else the new one gets 503. Default: "
        "sized from the open-file limit (ulimit -n), at most 1024.", show_default=False)]
    = None,
    max_connections_per_client: Annotated[int | None, typer.Option(
        "--max-connections-per-client", help="Connections one client address may hold "
        "(its oldest idle one is closed for a new one, else 429). Default: half of "
        "--max-connections.", show_default=False)] = None,
    max_memory: Annotated[float | None, typer.Option(
        "--max-memory", help="GiB all loaded models may take together (default: the "
        "machine's available memory). Past it, idle models unload, least recently used "
        "first.")] = None,
    insecure: Annotated[bool, typer.Option("--insecure", help="Allow a non-loopback --host "
                        "without --api-key.")] = False,
    allow_image_urls: Annotated[bool, typer.Option(
        "--allow-image-urls", help="Fetch http(s) image URLs sent in requests (at most "
        "20 MiB each, 10 s for a request's all). Default: refused, send images as data: "
        "URIs or base64.")] = False,
    install_service: Annotated[bool, typer.Option(
        "--install-service", help="Do not serve now: install these models and flags as a "
        "service of yours that starts at login and restarts on failure (a systemd user unit "
        "on Linux, a launchd agent on macOS) and start it. Again with other flags: replaces "
        "it.")] = False,
    uninstall_service: Annotated[bool, typer.Option(
        "--uninstall-service", help="Stop the service --install-service installed and "
        "remove it.")] = False,
    lora: Annotated[list[str] | None, typer.Option(
        "--lora", help="A LoRA adapter the models named here load with, [NAME=]PATH[:SCALE] "
        "(repeat for several; name: the file's stem). A request picks another set with "
        "its 'lora' field (llama.cpp, vLLM).")] = None,
    *,
    ctx: typer.Context,
    loading: o.LoadingFlags,
) -> None:
    """Serve models over the OpenAI API (/v1) and the Ollama API (/api).

    Clients made for OpenAI or Ollama work unchanged: point them at the URL
    printed at start. A model runs up to --parallel requests at once where
    its engine batches, one at a time otherwise; more queue (up to
    --max-queue); a client that disconnects stops its generation; SIGTERM
    drains in-flight requests, then exits.

    By default only this machine can connect, web pages of other sites
    are refused (Host, Origin and JSON-only checks), and API requests load
    only models already on disk: --allow-pull and --allow-local-paths open
    more, as does an API key (LOCALRUN_API_KEY or --api-key-file).

    Examples:

      localrun serve smollm2:135m

      localrun serve qwen2.5:0.5b --port 9000 --keep-alive 30m

      LOCALRUN_API_KEY=secret localrun serve --host 0.0.0.0

      localrun serve qwen2.5:0.5b --keep-alive 1h --install-service
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

    if loading.draft_model is not None:  # one draft cannot serve every model
        loading.no_speculation("serve")
    from localrun.sampling import check_speculative

    check_speculative(loading.speculative)  # a bad value fails now, not at the first load
    key = _api_key(api_key, api_key_file)
    host, port = listen_address(host, port)
    config = ServerConfig(
        models=tuple(models or ()), host=host, port=port, api_key=key,
        parallel=parallel, max_queue=max_queue,
        keep_alive=parse_duration(keep_alive, what="--keep-alive"),
        cors_origins=_listed(cors_origins), allowed_hosts=_listed(allowed_hosts),
        allow_pull=allow_pull, allow_local_paths=allow_local_paths, allow_delete=allow_delete,
        request_timeout=request_timeout if request_timeout > 0 else None,
        drain_timeout=max(0.0, drain_timeout), max_request_bytes=int(max_request_mb * 2**20),
        header_timeout=header_timeout, body_timeout=body_timeout,
        max_connections=max_connections, max_connections_per_client=max_connections_per_client,
        max_memory=int(max_memory * 2**30) if max_memory is not None else None,
        insecure=insecure, backend=loading.backend, context=loading.context,
        allow_unoptimized=loading.allow_unoptimized, adapters=_adapters(lora),
        allow_image_urls=allow_image_urls, speculative=loading.speculative,
        exact=loading.exact)
    config.check()
    if install_service or uninstall_service:
        from localrun.cli._service import service_flags

        service_flags(ctx, install=install_service, uninstall=uninstall_service,
                      drain_timeout=config.drain_timeout)
        return
    sock = bind(config.host, config.port)
    config = replace(config, port=sock.getsockname()[1])
    _setup_logging()
    manager = ModelManager(config, Metrics())

    def load(name: str, adapters: Any = None, **preset: Any) -> Any:  # a preset's values
        return (replace(loading, **preset) if preset else loading).load(name,
                                                                         adapters=adapters)

    loaded = manager.preload(config.models, load=load)
    app = create_app(config, manager=manager)
    tune_process()
    server = make_server(app, config)  # its caps sized from the limits tune_process set
    sys.stderr.write(banner(config, loaded))
    sys.stderr.flush()
    server.run(sockets=[sock])
    sys.stderr.write("localrun serve stopped\n")


def listen_address(host: str | None, port: int | None) -> tuple[str, int]:
    """Where to listen: ``--host`` (or ``$LOCALRUN_HOST``: ``host``, ``host:port``,
    ``:port`` or ``http://host:port``, as Ollama reads ``OLLAMA_HOST``) and ``--port``,
    which wins over a port in the host; 127.0.0.1 and 8799 by default."""
    from localrun.control import parse_address

    name, given = parse_address(host or "")
    chosen = port if port is not None else given if given is not None else DEFAULT_PORT
    return name or "127.0.0.1", chosen


def _listed(values: list[str] | None) -> tuple[str, ...]:
    """A repeatable, comma-separated option's values."""
    return tuple(x.strip() for item in values or () for x in item.split(",") if x.strip())


def _api_key(given: str | None, path: Path | None) -> str | None:
    """The key from --api-key (with a warning: it shows in `ps`), --api-key-file, or
    the environment, in that order; one of the two flags at most."""
    import os

    from localrun.errors import LocalrunError

    if given is not None and path is not None:
        raise LocalrunError("Both --api-key and --api-key-file were given",
                            hint="pass the key one way: --api-key-file PATH (or "
                            f"{KEY_ENV}) keeps it out of `ps`")
    if given is not None:
        sys.stderr.write(f"warning: --api-key on the command line is visible to other users "
                         f"of this machine (ps, /proc); set {KEY_ENV} or use --api-key-file "
                         "instead\n")
        return given or None
    if path is not None:
        return _read_key_file(path)
    return os.environ.get(KEY_ENV) or None


def _read_key_file(path: Path) -> str:
    import os
    import stat

    from localrun.errors import LocalrunError

    try:
        text = path.expanduser().read_text(encoding="utf-8")
        mode = path.expanduser().stat().st_mode
    except (OSError, UnicodeDecodeError) as e:
        why = e.strerror if isinstance(e, OSError) and e.strerror else type(e).__name__
        raise LocalrunError(f"Cannot read the API key file {path}: {why}",
                            hint="pass a readable text file whose first line is the key: "
                            "--api-key-file PATH") from None
    lines = text.splitlines()
    key = lines[0].strip() if lines else ""
    if not key:
        raise LocalrunError(f"The API key file {path} is empty",
                            hint="write the key on its first line")
    if os.name == "posix" and mode & (stat.S_IRWXG | stat.S_IRWXO):
        sys.stderr.write(f"warning: the API key file {path} can be read by other users "
                         f"(chmod 600 {path})\n")
    return key


def log_formatter() -> Any:
    """The server log's format, with each message escaped (:func:`printable`): what
    clients sent (model names, paths) can neither forge nor hide a line; a traceback
    still prints as one."""
    import logging

    from localrun.server.app import printable

    class Printable(logging.Formatter):
        def formatMessage(self, record: logging.LogRecord) -> str:
            record.message = printable(record.message, quotes=False)
            return super().formatMessage(record)

    return Printable("%(asctime)s %(message)s", "%H:%M:%S")


def _setup_logging() -> None:
    import logging

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(log_formatter())
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
    from localrun.server.policy import HostRule

    url = config.url
    lines = [f"localrun serve {__version__} · {url}"]
    for m in loaded:
        i = m.info
        quant = f" {i.quantization}" if i.quantization else ""
        at_once = "one request at a time" if m.slots == 1 else f"{m.slots} requests at once"
        also = f" (preset {', '.join(sorted(m.presets))})" if m.presets else ""
        lines.append(f"  model {m.name}{also} · {i.backend} {i.engine_version} · "
                     f"{i.format}{quant} · {i.device or 'cpu'} · context {i.context_length} "
                     f"· {at_once}")
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
    lines.append(f"  hosts answered: {HostRule.for_config(config).describe()} "
                 "(--allowed-hosts adds names)")

    def allowed(flag: str, on: bool) -> str:
        return (f"on ({flag})" if on and not config.api_key else "on (API key set)" if on
                else f"off ({flag} turns it on)")

    lines.append("  API requests may download models: "
                 f"{allowed('--allow-pull', config.pull_allowed)} · load local paths: "
                 f"{allowed('--allow-local-paths', config.local_paths_allowed)} · delete "
                 f"model files: {allowed('--allow-delete', config.delete_allowed)}")
    name = (min(loaded[0].presets) if loaded[0].presets else loaded[0].name) if loaded \
        else "smollm2:135m"
    body = json.dumps({"model": name, "messages": [{"role": "user", "content": "Hello!"}]})
    key = ' -H "Authorization: Bearer $LOCALRUN_API_KEY"' if config.api_key else ""
    lines.append("Try:")
    lines.append(f"  curl {url}/v1/chat/completions -H 'Content-Type: application/json'{key} "
                 f"-d '{body}'")
    lines.append("Ctrl-C (or SIGTERM) finishes the requests in flight, then stops.")
    return "\n".join(lines) + "\n"


def register(app: typer.Typer) -> None:
    app.command("serve")(serve)


def _adapters(lora: list[str] | None) -> tuple[Any, ...]:
    """``--lora`` values, each checked (the file is there, the scale in range)."""
    return o.read_adapters(lora) or ()
