"""What a request may do, decided before any work.

A browser on this machine can be made to send requests to the server by any page it
visits: simple cross-site POSTs (``text/plain``, form-encoded: no preflight) and, through
DNS rebinding (a name of the attacker's that resolves to 127.0.0.1), requests whose
answers that page can read. So the server answers only to the host names it listens under
(:class:`HostRule`), only to pages of its own origin or of those ``--cors-origins`` lists
(:func:`origin_allowed`), reads only JSON bodies (:func:`is_json`), and API requests load
only models already on disk (:func:`check_model`): downloading (``--allow-pull``) and
files or folders named by path (``--allow-local-paths``) are allowed by flags, or when an
API key guards the server. Models named on the command line are always served. A
preset's name is the user's own: it loads its model as a name on disk does (a path it
names included), and downloads only where downloads are allowed. Deleting a model's
files over the API (``/api/delete``) takes ``--allow-delete`` or an API key
(:func:`check_delete`); presets are localrun's own small files, which any client the
server answers may make and remove.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from localrun.errors import LocalrunError
from localrun.server.config import ServerConfig, is_loopback
from localrun.server.errors import APIError

if TYPE_CHECKING:
    from localrun.naming.presets import Preset

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

#: Addresses that listen on every interface.
WILDCARDS = ("0.0.0.0", "::", "")


# -- Host ------------------------------------------------------------------------------

@dataclass(frozen=True)
class HostRule:
    """The ``Host`` header values a server answers to (ports are not compared: DNS
    rebinding needs a host name of the attacker's, and a forwarded port changes the
    port a client sees).

    An address literal cannot be rebound, so the addresses the server is reachable at
    are allowed: the loopback ones for a loopback bind, the bound one for one address,
    any for a wildcard bind. Names: ``localhost`` always; this machine's host name
    where other machines can connect; ``--allowed-hosts`` adds names ("*": any)."""

    bound: str
    names: frozenset[str]
    any_address: bool = False
    address: IPAddress | None = None
    any_host: bool = False

    @classmethod
    def for_config(cls, config: ServerConfig) -> HostRule:
        extra = {normal_host(h) for h in config.allowed_hosts}
        names = {"localhost"} | (extra - {"*"})
        host = config.host.strip().strip("[]")
        address = _address(host)
        if address is None and host.lower() not in WILDCARDS:
            names.add(normal_host(host))  # bound by a name of this machine
        if not is_loopback(config.host):
            names |= machine_names()
        return cls(bound=config.host, names=frozenset(names),
                   any_address=host in WILDCARDS, address=address, any_host="*" in extra)

    def allows(self, header: str | None) -> bool:
        """Whether a request with this ``Host`` header is answered. No header (HTTP/1.0)
        is: a browser always sends one."""
        if self.any_host or header is None:
            return True
        host = normal_host(header)
        address = _address(host)
        if address is None:
            return host in self.names
        return (self.any_address or address.is_loopback or address == self.address
                or host in self.names)

    def describe(self) -> str:
        """What the banner says about it."""
        if self.any_host:
            return "any (--allowed-hosts '*')"
        addresses = ("any address" if self.any_address else
                     "loopback addresses" if self.address is None or self.address.is_loopback
                     else f"{self.address} and loopback addresses")
        return f"{', '.join(sorted(self.names))}, {addresses}"


def normal_host(header: str) -> str:
    """A ``Host`` header or an --allowed-hosts entry as compared: lower case, without its
    port, brackets or trailing dot (``[::1]:8799`` → ``::1``)."""
    host = header.strip().lower()
    if host.startswith("["):
        host = host[1:].partition("]")[0]
    elif host.count(":") == 1:
        host = host.partition(":")[0]
    return host.rstrip(".")


def _address(host: str) -> IPAddress | None:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


def machine_names() -> set[str]:
    """This machine's host name, its first label, and its mDNS name (``.local``); no DNS
    lookup (``--allowed-hosts`` adds any other name)."""
    name = socket.gethostname().strip().lower().rstrip(".")
    if not name:
        return set()
    short = name.split(".")[0]
    return {name, short, f"{short}.local"}


def host_refused(header: str, rule: HostRule) -> APIError:
    host = normal_host(header)
    return APIError(
        403, f"Host '{_shown(host)}' is not a name this server answers to (it listens on "
        f"{rule.bound}); a web page may be trying to reach it through DNS rebinding. To "
        f"reach it by that name (e.g. behind a reverse proxy), start it with --allowed-hosts "
        f"{_shown(host)}", type="permission_error", code="host_not_allowed")


# -- Origin ----------------------------------------------------------------------------

def origin_allowed(origin: str, host: str | None, cors_origins: Iterable[str]) -> bool:
    """A browser page's ``Origin`` may use the server when it is the server's own (the
    same host and port as the ``Host`` header, already checked) or listed in
    ``--cors-origins`` ("*": any)."""
    listed = {o.strip().rstrip("/").lower() for o in cors_origins}
    given = origin.strip().rstrip("/").lower()
    if "*" in listed or given in listed:
        return True
    if host is None or given == "null":
        return False
    parts = urlsplit(given)
    return parts.scheme in ("http", "https") and parts.netloc == host.strip().lower()


def origin_refused(origin: str) -> APIError:
    return APIError(
        403, f"Origin '{_shown(origin)}' may not use this server: requests from web pages of "
        "other sites are refused. To allow that page, start the server with --cors-origins "
        f"{_shown(origin)}", type="permission_error", code="origin_not_allowed")


# -- Content-Type ----------------------------------------------------------------------

def is_json(content_type: str | None) -> bool:
    """``application/json``, with or without parameters (``; charset=utf-8``)."""
    if not content_type:
        return False
    return content_type.split(";", 1)[0].strip().lower() == "application/json"


#: Request headers a browser adds on its own and a web page cannot remove: a request
#: with any of them may come from a page the user is visiting.
BROWSER_HEADERS = frozenset({b"origin", b"referer", b"sec-fetch-site", b"sec-fetch-mode",
                             b"sec-fetch-dest", b"sec-fetch-user"})
#: What ``curl -d`` sends (a form type) and what scripts that post a JSON string
#: without headers send (nothing): accepted as JSON from a client that is not a browser.
_SCRIPT_TYPES = ("", "application/x-www-form-urlencoded")


def body_is_json(content_type: str | None, *, user_agent: str | None,
                 browser_headers: bool) -> bool:
    """Whether a POST's body may be read as JSON. ``application/json`` always. A web
    page can make a browser POST a form, ``text/plain`` or an untyped body to any site
    without a CORS preflight (the cross-site forgery of Ollama's CVE-2024-28224), so
    other types are refused, except the two that ``curl -d`` and header-less scripts
    send, from a client that cannot be a browser: no header only a browser adds (an
    ``Origin``, ``Sec-Fetch-*``, a ``Referer``) and a ``User-Agent`` that is not a
    browser's (every browser's starts with ``Mozilla/``, and a page cannot set its own
    without a preflight). Ollama's documented ``curl … -d '{…}'`` keeps working."""
    if is_json(content_type):
        return True
    base = (content_type or "").split(";", 1)[0].strip().lower()
    if base not in _SCRIPT_TYPES or browser_headers:
        return False
    agent = (user_agent or "").strip().lower()
    return bool(agent) and not agent.startswith("mozilla/")


def needs_json(method: str, path: str) -> bool:
    """The routes that read a JSON body: every POST (and DELETE: Ollama's /api/delete)
    under /v1, /api and /models (llama-server's load and unload)."""
    return method in ("POST", "DELETE") and path.startswith(("/v1/", "/api/", "/models/"))


def not_json(content_type: str | None) -> APIError:
    shown = f"'{_shown(content_type)}'" if content_type else "missing"
    return APIError(415, f"Content-Type {shown}: this route reads JSON; send the body with "
                    "'Content-Type: application/json' (curl: -H 'Content-Type: "
                    "application/json')", code="unsupported_media_type")


# -- model names -----------------------------------------------------------------------

_DRIVE = re.compile(r"^[A-Za-z]:[\\/]")


def looks_like_path(name: str) -> bool:
    """Whether ``name`` is written as a file or folder (whether or not it exists):
    what :func:`localrun.naming.refs.parse_ref` takes for a path (``/x``, ``./x``, ``~/x``,
    ``x.gguf``), a ``file:`` URL, a Windows path, or any name with a ``.``/``..``
    segment (``ollama:../x`` would lead out of Ollama's folder)."""
    s = name.strip()
    low = s.lower()
    if s.startswith((".", "/", "~", "\\")) or low.endswith(".gguf") or low.startswith("file:"):
        return True
    if _DRIVE.match(s) or "\\" in s or "\x00" in s:
        return True
    return any(part in (".", "..") for part in re.split(r"[/:]", s))


def _exists(name: str) -> bool:
    """Whether ``name`` is a file or folder relative to the server's working directory
    (resolving then takes it for a path, :func:`localrun.naming.refs.local_path`)."""
    try:
        return Path(name).expanduser().exists()
    except (OSError, ValueError, RuntimeError):  # too long, NUL, unknown ~user
        return False


def check_model(config: ServerConfig, name: str, *, loads: bool = True) -> None:
    """Refuse (403) an API request's model name that would read a local path or, when
    ``loads``, download, unless the server allows it. Decided from the name and what is
    on disk (the Hugging Face cache, the pull records, Ollama's and LM Studio's stores,
    the packaged default): no Hub request. A name written as a path gets the same
    answer whether or not it exists. Blocking I/O: call it in a worker thread."""
    from localrun.naming.refs import is_default_name

    if config.pull_allowed and config.local_paths_allowed:
        return
    s = name.strip()
    if not s or name in config.models:
        return
    preset = _preset(s)
    if preset is not None:  # the user's own name: its model loads as a name on disk does
        if loads and not config.pull_allowed and not looks_like_path(preset.model) \
                and would_download(preset.model):
            raise pull_refused(name, preset.model)
        return
    if looks_like_path(s):
        if not config.local_paths_allowed:
            raise local_path_refused(name)
        return
    if is_default_name(s):
        return
    if _exists(s):  # a relative path shaped like a name ("org/repo", "models")
        if config.local_paths_allowed:
            return
        # without --allow-pull, answered as a name that is not downloaded is, so that
        # the answer does not say whether the path exists
        raise local_path_refused(name) if config.pull_allowed else pull_refused(name)
    if loads and not config.pull_allowed and would_download(s):
        raise pull_refused(name)


def _preset(name: str) -> Preset | None:
    """The preset ``name`` names (a damaged presets file: PresetError, a 400)."""
    from localrun.naming.presets import lookup

    return lookup(name)


def would_download(name: str) -> bool:
    """Whether loading ``name`` needs a download: a catalog alias or Hub repo id that no
    earlier download put in the Hugging Face cache (no pull record of it with its files
    there, nor the repo itself), and that Ollama's or LM Studio's store does not have.
    Names localrun cannot read at all download nothing (their load says why)."""
    from localrun import hub
    from localrun.hub import pulls
    from localrun.naming import stores
    from localrun.naming.refs import parse_ref

    try:
        r = parse_ref(name)
    except LocalrunError:
        return False
    if r.kind not in ("alias", "repo"):
        return False  # the packaged default, Ollama's and LM Studio's stores
    if hub.pulled_backends(r):
        return False
    if r.kind == "alias" and r.alias and stores.find_ollama(r.alias) is not None:
        return False
    if r.kind == "repo" and r.repo:
        if r.revision is None and stores.find_lmstudio(r.repo, r.quant) is not None:
            return False
        want = pulls.norm_quant(r.quant)
        for m in hub.cached_models():
            if ((m.repo or "").lower() == r.repo.lower()
                    and (m.revision or "main") == (r.revision or "main")
                    and (not want or pulls.norm_quant(m.quant) == want)):
                return False
    return True


def check_pull(config: ServerConfig, name: str) -> None:
    """/api/pull: refused unless the server allows downloads (a path, as a load)."""
    check_model(config, name, loads=False)
    if not config.pull_allowed:
        raise pull_refused(name)


def local_path_refused(name: str) -> APIError:
    return APIError(
        403, f"Model '{_shown(name)}' names a file or folder: this server does not load "
        "local paths named by API requests. Name the model on the server's command line, "
        "or start it with --allow-local-paths (or with an API key)", type="permission_error",
        param="model", code="local_paths_not_allowed")


def pull_refused(name: str, model: str | None = None) -> APIError:
    """403 for a name that would download (``model``: what the preset ``name`` runs)."""
    what = (f"Model '{_shown(name)}' is not downloaded" if model is None else
            f"Preset '{_shown(name)}' runs {_shown(model)}, which is not downloaded")
    return APIError(
        403, f"{what}, and this server does not download models for API requests. Run "
        f"`localrun pull {_shown(model or name)}` on the server, or start it with "
        "--allow-pull (or with an API key)", type="permission_error", param="model",
        code="pull_not_allowed")


def check_delete(config: ServerConfig, name: str) -> None:
    """/api/delete of a model's files: refused (403) unless the server allows deletes
    (``--allow-delete``, or an API key); a path never (localrun deletes only what it
    pulled, as ``localrun rm`` does)."""
    if not config.delete_allowed:
        raise APIError(
            403, f"Deleting '{_shown(name)}' would delete model files, and this server does "
            "not delete models for API requests. Run `localrun rm NAME` on the server, or "
            "start it with --allow-delete (or with an API key)", type="permission_error",
            param="model", code="delete_not_allowed")
    if looks_like_path(name):
        raise APIError(400, f"'{_shown(name)}' names a file or folder: localrun deletes only "
                       "what it pulled (delete your own files yourself)", param="model",
                       code="not_pulled")


def _shown(text: str, limit: int = 300) -> str:
    return text if len(text) <= limit else text[:limit] + "…"
