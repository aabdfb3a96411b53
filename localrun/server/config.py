"""What ``localrun serve`` runs with: one frozen record, shared by the CLI, the app and tests."""

from __future__ import annotations

import ipaddress
import math
import re
from dataclasses import dataclass
from typing import Any

from localrun.adapters import Adapter
from localrun.errors import LocalrunError

#: The documented default port. Chosen to collide with none of the servers people run
#: next to localrun: Ollama 11434, LM Studio 1234, llama-server 8080 (9931 in newer
#: builds), vLLM / llama-cpp-python 8000, mlx_lm.server 8080, Lemonade 13305.
DEFAULT_PORT = 8799
#: Ollama's default keep-alive, which clients built on it expect.
DEFAULT_KEEP_ALIVE = 300.0
DEFAULT_MAX_QUEUE = 64
DEFAULT_REQUEST_TIMEOUT = 600.0
DEFAULT_DRAIN_TIMEOUT = 30.0
DEFAULT_MAX_REQUEST_BYTES = 16 * 2**20
#: Seconds a client has to send a request's headers (Apache's mod_reqtimeout: 20-40).
DEFAULT_HEADER_TIMEOUT = 20.0
#: Seconds a request body has to arrive, plus 1 s per KiB (limits.MIN_BODY_RATE).
DEFAULT_BODY_TIMEOUT = 30.0


@dataclass(frozen=True)
class ServerConfig:
    """Settings of one server. Durations in seconds; ``keep_alive`` None = forever."""

    models: tuple[str, ...] = ()  # loaded at start and kept loaded (no keep-alive expiry)
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    api_key: str | None = None
    #: requests one model runs at once where its engine batches (None: the engine's
    #: capacity, at most manager.DEFAULT_PARALLEL_CPU on the CPU); 1: one at a time
    parallel: int | None = None
    max_queue: int = DEFAULT_MAX_QUEUE
    keep_alive: float | None = DEFAULT_KEEP_ALIVE
    cors_origins: tuple[str, ...] = ()
    request_timeout: float | None = DEFAULT_REQUEST_TIMEOUT  # None: no limit
    drain_timeout: float = DEFAULT_DRAIN_TIMEOUT
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    #: request headers due this long after connecting (or after a request's first byte)
    header_timeout: float = DEFAULT_HEADER_TIMEOUT
    #: a request body's time, plus 1 s per KiB it has sent (see localrun.server.limits)
    body_timeout: float = DEFAULT_BODY_TIMEOUT
    #: connections open at once, in all and per client address (None: sized from the
    #: process's open-file limit, see localrun.server.limits.resolve)
    max_connections: int | None = None
    max_connections_per_client: int | None = None
    #: bytes all loaded models may take together (None: the machine's available memory)
    max_memory: int | None = None
    insecure: bool = False
    backend: str = "auto"
    context: int | None = None
    allow_unoptimized: bool = False
    #: LoRA adapters the command line's models load with (``--lora``); a load's own
    #: config holds the set that load uses (copies.ask: a preset's, else these for the
    #: command line's models, else none)
    adapters: tuple[Adapter, ...] = ()
    #: every served model's speculative decoding (serve --speculative); None: "auto"
    speculative: str | None = None
    exact: bool = False  # --exact: every model it loads (README, "Speed")
    #: Host names answered beside the bound address's own (a reverse proxy's); "*": any
    allowed_hosts: tuple[str, ...] = ()
    #: API requests may download models (/api/pull, a name not in the cache); an API
    #: key allows it too
    allow_pull: bool = False
    #: API requests may load files and folders by path; an API key allows it too
    allow_local_paths: bool = False
    #: /api/delete may delete model files (what localrun pulled); an API key allows it too
    allow_delete: bool = False
    #: image URLs (http/https) in requests are fetched by the server, bounded in bytes
    #: and time (localrun.server.imagefetch); without it they are refused, nothing fetched
    allow_image_urls: bool = False

    def load_options(self) -> dict[str, Any]:
        """What a load of its own takes from it beside the engine and context: its LoRA
        adapters, the mode (``exact``) and ``speculative``."""
        return {"adapters": self.adapters, "exact": self.exact,
                "speculative": self.speculative}

    def check(self) -> None:
        """Refuse settings that make no sense, or that would expose the server unasked."""
        if not 0 <= self.port <= 65535:
            raise LocalrunError(f"Invalid port {self.port}",
                                hint="pass --port between 1 and 65535 (0 picks a free one)")
        if self.parallel is not None and self.parallel < 1:
            raise LocalrunError(f"Invalid --parallel {self.parallel}",
                                hint="pass --parallel 1 or more")
        if self.max_queue < 0:
            raise LocalrunError(f"Invalid --max-queue {self.max_queue}",
                                hint="pass --max-queue 0 or more (0: never wait)")
        if self.max_request_bytes < 1024:
            raise LocalrunError(f"Invalid request size limit {self.max_request_bytes} bytes",
                                hint="pass --max-request-mb 1 or more")
        for flag, seconds in (("--header-timeout", self.header_timeout),
                              ("--body-timeout", self.body_timeout)):
            if not (math.isfinite(seconds) and seconds > 0):
                raise LocalrunError(f"Invalid {flag} {seconds:g}",
                                    hint=f"pass {flag} in seconds, more than 0 (e.g. 20)")
        for flag, count in (("--max-connections", self.max_connections),
                            ("--max-connections-per-client", self.max_connections_per_client)):
            if count is not None and count < 1:
                raise LocalrunError(f"Invalid {flag} {count}",
                                    hint=f"pass {flag} 1 or more, or leave it out (then it "
                                    "is sized from the open-file limit)")
        if self.api_key is not None and not self.api_key.strip():
            raise LocalrunError("The API key is empty",
                                hint="pass --api-key with a non-empty value, or leave it out")
        for entry in self.allowed_hosts:
            if not _HOST_ENTRY.match(entry.strip()):
                raise LocalrunError(f"Invalid --allowed-hosts entry {entry!r}",
                                    hint="give host names as clients send them in the Host "
                                    "header, without scheme or path: --allowed-hosts "
                                    "llm.example.com (or '*' for any)")
        if not is_loopback(self.host) and not self.api_key and not self.insecure:
            raise LocalrunError(
                f"Refusing to serve on {self.host} without an API key: anyone who can reach "
                "this machine could use it",
                hint=f"localrun serve --host {self.host} --api-key KEY (or set "
                "LOCALRUN_API_KEY); --insecure to serve without one anyway")

    @property
    def pull_allowed(self) -> bool:
        """Whether API requests may download models (see :mod:`localrun.server.policy`)."""
        return self.allow_pull or bool(self.api_key)

    @property
    def delete_allowed(self) -> bool:
        """Whether /api/delete may delete model files (see :mod:`localrun.server.policy`)."""
        return self.allow_delete or bool(self.api_key)

    @property
    def local_paths_allowed(self) -> bool:
        """Whether API requests may name files and folders on this machine."""
        return self.allow_local_paths or bool(self.api_key)

    @property
    def url(self) -> str:
        host = self.host
        if host in ("0.0.0.0", "::"):
            host = "127.0.0.1"
        if ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{self.port}"


#: An --allowed-hosts entry: a host name or address (a port is ignored), or "*".
_HOST_ENTRY = re.compile(r"^(\*|\[[0-9A-Za-z:.%]+\](:\d+)?|[\w.%-]+(:\d+)?|[0-9A-Fa-f:.%]+)$")


def is_loopback(host: str) -> bool:
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")


def parse_duration(value: str | float | int | None, *, what: str = "keep_alive"
                   ) -> float | None:
    """Seconds from Ollama's keep-alive forms: a number of seconds, or a Go duration
    ("5m", "1h30m", "250ms"). Negative means forever (None); 0 means at once."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise _bad_duration(value, what)
    if isinstance(value, (int, float)):
        if not math.isfinite(value):
            raise _bad_duration(value, what)
        return None if value < 0 else float(value)
    text = value.strip().lower()
    if not text:
        raise _bad_duration(value, what)
    try:
        number = float(text)
    except ValueError:
        pass
    else:
        return None if number < 0 else number
    sign = -1.0 if text.startswith("-") else 1.0
    body = text.lstrip("+-")
    parts = _PART.findall(body)
    if not parts or "".join(n + u for n, u in parts) != body:
        raise _bad_duration(value, what)
    seconds = sum(float(n) * _UNITS[u] for n, u in parts)
    return None if sign < 0 else seconds


def format_duration(seconds: float | None) -> str:
    """The way people write it back: 5m, 1h30m, 45s, 0.5s; None is "forever"."""
    if seconds is None:
        return "forever"
    if seconds < 60 and seconds != int(seconds):
        return f"{seconds:g}s"
    total = int(seconds)
    h, rest = divmod(total, 3600)
    m, sec = divmod(rest, 60)
    out = (f"{h}h" if h else "") + (f"{m}m" if m else "") + (f"{sec}s" if sec else "")
    return out or "0s"


def _bad_duration(value: object, what: str) -> LocalrunError:
    return LocalrunError(f"Invalid {what} {value!r}",
                         hint=f"pass {what} as seconds (300) or a duration such as 5m, 1h, "
                         "30s; -1 keeps the model loaded, 0 unloads it at once")
