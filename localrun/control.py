"""Talk to a running ``localrun serve``: which models it holds, and unloading one.

``localrun ps`` and ``localrun stop`` use this. The server is found by its address:
``--host``/``--port``, else ``$LOCALRUN_HOST`` (as Ollama's ``OLLAMA_HOST``:
``host``, ``host:port``, ``:port`` or a URL), else ``127.0.0.1:8799``; the key is
``$LOCALRUN_API_KEY`` or the first line of a key file, sent as a Bearer token and never
shown. Only the Ollama routes every localrun server has are used: ``GET /api/ps`` and
``POST /api/generate`` with no prompt and ``keep_alive: 0`` (Ollama's unload). Plain
``urllib``: no dependency beyond the standard library.
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from localrun.errors import LocalrunError, RemoteError

HOST_ENV = "LOCALRUN_HOST"
KEY_ENV = "LOCALRUN_API_KEY"
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8799  # localrun.server.config.DEFAULT_PORT (not imported: no web stack here)
TIMEOUT = 30.0
#: expires_at at or after this year means "never" (the server's FOREVER is 2318)
_FOREVER_YEAR = 2200
_START = ("start one: localrun serve (or point at yours: --host HOST --port PORT, "
          f"or {HOST_ENV}=host:port)")


class ServerUnreachableError(RemoteError):
    """No localrun server answers at the address."""

    def __init__(self, url: str, reason: str):
        super().__init__(url, reason, hint=_START)
        self.message = f"No localrun server at {url} ({reason})"


class ServerAuthError(RemoteError, PermissionError):
    """The server wants a key (401), or another one."""

    def __init__(self, url: str, sent: bool, detail: str):
        super().__init__(url, detail, status=401, hint=(
            f"set {KEY_ENV} to the key the server was started with, or pass "
            "--api-key-file PATH (a file whose first line is the key)"))
        self.message = (f"{url} refused the API key sent" if sent else
                        f"{url} needs an API key") + (f": {detail}" if detail else "")


def server_url(host: str | None = None, port: int | None = None) -> str:
    """The server's base URL from ``--host``/``--port``, ``$LOCALRUN_HOST`` and the
    defaults. A wildcard listen address (0.0.0.0, ::) means this machine."""
    text = (host or os.environ.get(HOST_ENV) or "").strip()
    scheme = urlsplit(text).scheme if "://" in text else "http"
    name, given = parse_address(text)
    path = urlsplit(text).path.rstrip("/") if "://" in text else ""
    chosen = port if port is not None else given if given is not None else (
        443 if scheme == "https" and "://" in text else DEFAULT_PORT)
    if not 0 < chosen <= 65535:
        raise LocalrunError(f"Invalid port {chosen}", hint="pass --port between 1 and 65535")
    name = name or DEFAULT_HOST
    if name in ("0.0.0.0", "::", "[::]"):
        name = DEFAULT_HOST
    if ":" in name and not name.startswith("["):
        name = f"[{name}]"
    return f"{scheme}://{name}:{chosen}{path}"


def parse_address(text: str) -> tuple[str, int | None]:
    """``host``, ``host:port``, ``:port``, ``[v6]:port`` or ``http(s)://host:port`` (as
    Ollama reads ``OLLAMA_HOST``) -> (host, port); "" and None where not given."""
    text = text.strip()
    if "://" in text:
        parts = urlsplit(text)
        try:
            port = parts.port
        except ValueError:
            port = -1
        if parts.scheme not in ("http", "https") or not parts.hostname or port == -1:
            raise LocalrunError(f"Cannot read the server address {text!r}",
                                hint="give host:port or http://host:port, e.g. "
                                f"{HOST_ENV}=127.0.0.1:{DEFAULT_PORT}")
        return parts.hostname, port
    name, given, _ = _split_host(text)
    return name, given


def _split_host(text: str) -> tuple[str, int | None, str]:
    if not text:
        return "", None, ""
    if text.startswith("["):  # [::1]:8799
        name, _, rest = text[1:].partition("]")
        return name, _port(rest.removeprefix(":"), text) if rest else None, ""
    if text.count(":") > 1:  # a bare IPv6 address
        return text, None, ""
    name, sep, port = text.partition(":")
    return name, _port(port, text) if sep else None, ""


def _port(text: str, whole: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise LocalrunError(f"Cannot read the port in {whole!r}",
                            hint=f"give host:port, e.g. 127.0.0.1:{DEFAULT_PORT}") from None


def read_key(path: str | os.PathLike[str] | None = None) -> str | None:
    """The API key: the first line of ``path``, else ``$LOCALRUN_API_KEY``, else None."""
    if path is None:
        return os.environ.get(KEY_ENV) or None
    p = Path(path).expanduser()
    try:
        lines = p.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        why = e.strerror if isinstance(e, OSError) and e.strerror else type(e).__name__
        raise LocalrunError(f"Cannot read the API key file {path}: {why}",
                            hint="pass a readable text file whose first line is the key: "
                            "--api-key-file PATH") from None
    key = lines[0].strip() if lines else ""
    if not key:
        raise LocalrunError(f"The API key file {path} is empty",
                            hint="write the key on its first line")
    return key


@dataclass(frozen=True)
class LoadedModel:
    """One model a server holds, as ``GET /api/ps`` describes it."""

    name: str
    backend: str | None
    device: str | None
    size: int | None  # bytes of memory it takes, as the server counts them
    size_vram: int | None
    context_length: int | None
    expires_at: str | None
    #: seconds until it unloads when idle; None: never (pinned, or keep_alive -1)
    expires_in: float | None
    format: str | None
    quantization: str | None
    parallel: int | None  # requests it runs at once
    running: int | None
    waiting: int | None
    #: named on serve's command line; None where the server does not say
    pinned: bool | None = None
    #: the presets whose requests it served (a preset runs on its model's copy)
    presets: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_ps(cls, d: dict[str, Any], now: datetime | None = None) -> LoadedModel:
        got = d.get("details")
        details: dict[str, Any] = got if isinstance(got, dict) else {}

        def num(key: str) -> int | None:
            v = d.get(key)
            return v if isinstance(v, int) and not isinstance(v, bool) else None

        def text(v: Any) -> str | None:
            return v if isinstance(v, str) and v else None

        expires_at = text(d.get("expires_at"))
        pinned = d.get("pinned")
        return cls(name=str(d.get("name") or d.get("model") or "?"),
                   backend=text(d.get("backend")), device=text(d.get("device")),
                   size=num("size"), size_vram=num("size_vram"),
                   context_length=num("context_length"), expires_at=expires_at,
                   expires_in=_seconds_left(expires_at, now),
                   format=text(details.get("format")),
                   quantization=text(details.get("quantization_level")),
                   parallel=num("parallel"), running=num("running"), waiting=num("waiting"),
                   pinned=pinned if isinstance(pinned, bool) else None,
                   presets=tuple(p for p in d.get("presets") or () if isinstance(p, str)))


def _seconds_left(stamp: str | None, now: datetime | None) -> float | None:
    if stamp is None:
        return None
    try:
        when = datetime.fromisoformat(stamp.replace("Z", "+00:00"))
    except ValueError:
        return None
    if when.year >= _FOREVER_YEAR:
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    return max(0.0, (when - (now or datetime.now(timezone.utc))).total_seconds())


StopOutcome = Literal["unloaded", "pinned", "busy"]


@dataclass(frozen=True)
class StopResult:
    """What ``stop`` did: ``outcome`` "unloaded", or why the server kept the model."""

    name: str
    outcome: StopOutcome
    freed: int  # bytes the server no longer holds for it
    still: tuple[LoadedModel, ...]  # its copies still loaded

    @property
    def unloaded(self) -> bool:
        return self.outcome == "unloaded"

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "unloaded": self.unloaded, "outcome": self.outcome,
                "freed_bytes": self.freed, "still_loaded": [m.to_json() for m in self.still]}


class Server:
    """A running localrun server at ``url``, asked with ``key``."""

    def __init__(self, url: str, key: str | None = None, *, timeout: float = TIMEOUT):
        self.url = url.rstrip("/")
        self._key = key
        self.timeout = timeout

    def _call(self, method: str, path: str, body: Any = None) -> Any:
        headers = {"Accept": "application/json"}
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        if self._key:
            headers["Authorization"] = f"Bearer {self._key}"
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as r:
                raw = r.read()
        except urllib.error.HTTPError as e:
            detail = _error_text(e.read())
            if e.code == 401:
                raise ServerAuthError(self.url, bool(self._key), detail) from None
            if e.code == 404 and path == "/api/ps":
                raise RemoteError(self.url, "it has no /api/ps: not a localrun server?",
                                  status=404, hint=_START) from None
            raise RemoteError(self.url, detail or e.reason, status=e.code, hint=(
                "see the server's log for more")) from None
        except (urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", e)
            why = getattr(reason, "strerror", None) or str(reason)
            if isinstance(reason, TimeoutError) or "timed out" in why:
                why = f"no answer within {self.timeout:g} s"
            raise ServerUnreachableError(self.url, why) from None
        try:
            return json.loads(raw)
        except ValueError:
            raise RemoteError(self.url, f"{method} {path} answered something that is not "
                              "JSON: is it localrun serve?", hint=_START) from None

    def ps(self) -> list[LoadedModel]:
        """The models the server holds now."""
        data = self._call("GET", "/api/ps")
        items = data.get("models") if isinstance(data, dict) else None
        if not isinstance(items, list):
            raise RemoteError(self.url, "GET /api/ps did not list models: is it localrun "
                              "serve?", hint=_START)
        now = datetime.now(timezone.utc)
        return [LoadedModel.from_ps(d, now) for d in items if isinstance(d, dict)]

    def stop(self, name: str) -> StopResult:
        """Unload ``name`` (as ``ps`` lists it, or a preset it lists: the model that
        preset runs). LocalrunError when no model of that name is loaded; a model the
        server keeps comes back with the reason."""
        before = self.ps()
        mine = [m for m in before if m.name == name] or \
            [m for m in before if m.name.lower() == name.lower()] or \
            [m for m in before if name.lower() in (p.lower() for p in m.presets)]
        if not mine:
            listed = ", ".join(m.name for m in before) or "none"
            raise LocalrunError(f"No model named {name!r} is loaded at {self.url} "
                                f"(loaded: {listed})",
                                hint="localrun ps lists the loaded models by name")
        shown = mine[0].name
        self._call("POST", "/api/generate", {"model": shown, "keep_alive": 0})
        still = tuple(m for m in self.ps() if m.name == shown)
        if mine[0].name.lower() != name.lower():  # a preset's name: its model's copy
            shown = name
        freed = sum(m.size or 0 for m in mine) - sum(m.size or 0 for m in still)
        if not still:
            return StopResult(shown, "unloaded", freed, ())
        kept_busy = any((m.running or 0) + (m.waiting or 0) > 0 and not m.pinned
                        for m in still)
        pinned = any(m.pinned for m in still) or (
            not kept_busy and all(m.expires_in is None for m in still))
        return StopResult(shown, "pinned" if pinned else "busy", max(0, freed), still)


def _error_text(body: bytes) -> str:
    """The message of an error body in either dialect (Ollama's or OpenAI's)."""
    try:
        data = json.loads(body)
    except ValueError:
        return body.decode("utf-8", "replace").strip()[:200]
    err = data.get("error") if isinstance(data, dict) else None
    if isinstance(err, dict):
        err = err.get("message")
    return str(err)[:300] if err else ""


__all__ = ["HOST_ENV", "KEY_ENV", "LoadedModel", "Server", "ServerAuthError",
           "ServerUnreachableError", "StopResult", "parse_address", "read_key", "server_url"]
