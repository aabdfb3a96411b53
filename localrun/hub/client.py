"""Talking to the Hub: is it reachable, where the cache is, tries again on 429/5xx
(honouring Retry-After), huggingface_hub's errors as localrun's, and Range reads.

Public huggingface_hub API only: ``HfApi``, ``hf_hub_url``, ``build_hf_headers``,
``get_session``, ``hf_raise_for_status``, ``constants`` and ``huggingface_hub.errors``.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import huggingface_hub
from huggingface_hub import (
    HfApi,
    constants,
    get_session,
    hf_hub_url,
    hf_raise_for_status,
)
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

# Public API (documented, and in the ``__all__`` of huggingface_hub.utils' lazy facade,
# which mypy cannot follow).
from huggingface_hub.utils import build_hf_headers  # type: ignore[attr-defined]

from localrun.errors import (
    HubAuthError,
    HubNotFoundError,
    HubUnavailableError,
    LocalrunError,
    ModelGatedError,
)

#: Seconds to wait for the Hub's TCP handshake before treating it as unreachable.
REACH_TIMEOUT = 3.0
#: HTTP statuses worth another try: the Hub or its file storage is busy or briefly down.
RETRY_STATUS = frozenset({408, 429, 500, 502, 503, 504})
#: Tries per Hub request, and per file download without progress (a dropped connection,
#: an expired signed URL, a 5xx or 429 each cost one; bytes that arrive reset the count).
HUB_ATTEMPTS = 4
#: The first wait between tries in seconds (doubling after each); Retry-After overrides it.
RETRY_BACKOFF = 1.0
#: The longest wait localrun sits out; a longer Retry-After is reported instead.
MAX_RETRY_WAIT = 60.0

_T = TypeVar("_T")


# --- where: the endpoint, the cache ------------------------------------------------------

def offline() -> bool:
    return bool(constants.HF_HUB_OFFLINE) or unreachable() is not None


def missing_reason() -> str:
    """Why a file cannot be fetched now (for OfflineMissingError)."""
    return "HF_HUB_OFFLINE=1 is set" if offline() else "the Hub cannot be reached"


def unreachable() -> str | None:
    """Why the Hub cannot be reached from here, or None. Asked once per endpoint.

    Without this, every API call of a plan on a machine with no network would sit in
    huggingface_hub's retry backoff (1+2+4+8+8 s) and print a warning per retry.
    """
    return _probe_endpoint(constants.ENDPOINT)


@functools.lru_cache(maxsize=4)
def _probe_endpoint(endpoint: str) -> str | None:
    import socket
    from urllib.parse import urlsplit

    if constants.HF_HUB_OFFLINE:
        return None
    url = urlsplit(endpoint)
    host = url.hostname or "huggingface.co"
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        with socket.create_connection((host, port), timeout=REACH_TIMEOUT):
            return None
    except OSError as e:
        return f"the Hub ({host}) cannot be reached ({e.strerror or type(e).__name__})"


def cache_dir() -> str:
    # Read at call time: tests and users may move the cache after import.
    return str(constants.HF_HUB_CACHE)


def storage(repo: str) -> Path:
    """The repo's folder in the HF cache (its documented layout: ``models--org--name``)."""
    return Path(cache_dir()) / ("models--" + repo.replace("/", "--"))


def api() -> HfApi:
    return HfApi()


def token_set() -> bool:
    return huggingface_hub.get_token() is not None


# --- tries, and errors that say what to do ----------------------------------------------------

class Retry(Exception):
    """A download try that ended for a passing reason (cut short, an expired URL)."""


def status(e: BaseException) -> int | None:
    code = getattr(getattr(e, "response", None), "status_code", None)
    return code if isinstance(code, int) else None


def _retry_after(e: BaseException) -> float | None:
    """The Retry-After seconds of an HTTP error response, if it has them."""
    response = getattr(e, "response", None)
    value = response.headers.get("Retry-After") if response is not None else None
    return float(value) if isinstance(value, str) and value.strip().isdigit() else None


def typed(e: BaseException, repo: str, what: str, *, revision: str | None = None,
          filename: str | None = None, tries: int = 1) -> LocalrunError:
    """A huggingface_hub error as localrun's: one line, and what to do next."""
    if isinstance(e, GatedRepoError):
        return ModelGatedError(repo, token_sent=status(e) == 403)
    if isinstance(e, RevisionNotFoundError):
        return HubNotFoundError(repo, revision=revision)
    if isinstance(e, RemoteEntryNotFoundError):
        return HubNotFoundError(repo, revision=revision, filename=filename)
    if isinstance(e, RepositoryNotFoundError):
        # The Hub answers 401 for a private repo and a missing one alike, and 404 to a
        # token without access to it: say which of the two cases this is.
        return HubNotFoundError(repo, hint=(
            "the token in HF_TOKEN has no access to it, or it does not exist: check the name "
            "at https://huggingface.co/models" if token_set() else
            "check the name at https://huggingface.co/models; for a private repo set HF_TOKEN"))
    code = status(e)
    message = getattr(getattr(e, "response", None), "headers", {}).get("X-Error-Message")
    if code in (401, 403):
        return HubAuthError(what, status=code, reason=message or (
            "invalid credentials" if code == 401 else "forbidden"))
    if code is not None:
        reason = f"HTTP {code}" + (f" ({message})" if message else "")
        if code == 429:
            reason = f"rate-limited (429){': ' + message if message else ''}"
    elif isinstance(e, Retry):
        reason = str(e)
    else:
        reason = f"the connection kept failing ({type(e).__name__}: {str(e)[:120]})"
    return HubUnavailableError(what, reason=f"{reason}, after {tries} "
                               f"tr{'y' if tries == 1 else 'ies'}", status=code,
                               retry_after=_retry_after(e))


def wait_before_retry(e: BaseException, attempt: int) -> bool:
    """Sleep before try ``attempt + 1`` of something that failed with ``e``; False when
    it should not be tried again (no tries left, or the Hub asks for a longer wait)."""
    if attempt >= HUB_ATTEMPTS:
        return False
    delay = _retry_after(e)
    if delay is None:
        delay = RETRY_BACKOFF * 2 ** (attempt - 1)
    if delay > MAX_RETRY_WAIT:
        return False
    time.sleep(delay)
    return True


def hub_call(fn: Callable[[], _T], repo: str, what: str, revision: str | None = None, *,
             retry: bool = True) -> _T:
    """``fn()`` (one Hub API request) tried again on 429/5xx, honouring Retry-After;
    errors typed. Network errors pass through: the planner then plans from the cache.
    ``retry=False`` for huggingface_hub's paginated listings, which it retries itself
    (``model_info`` it does not)."""
    attempt = 1
    while True:
        try:
            return fn()
        except (RepositoryNotFoundError, RevisionNotFoundError, RemoteEntryNotFoundError) as e:
            raise typed(e, repo, what, revision=revision) from e
        except HfHubHTTPError as e:
            if retry and status(e) in RETRY_STATUS and wait_before_retry(e, attempt):
                attempt += 1
                continue
            raise typed(e, repo, what, revision=revision, tries=attempt) from e


# --- reading part of a file -----------------------------------------------------------------

def range_read(repo: str, path: str, revision: str, start: int, n: int) -> bytes:
    """``n`` bytes of a repo file from ``start`` (one HTTP Range request; the Hub
    redirects LFS files to its CDN, and the Authorization header stays behind: httpx drops
    it on a redirect to another origin). A server that ignores the Range and answers 200
    sends the whole file: the wanted bytes are cut from it, and reading stops there."""
    url = hf_hub_url(repo, path, revision=revision)
    headers = build_hf_headers()
    headers["Range"] = f"bytes={start}-{start + n - 1}"
    out = bytearray()
    with get_session().stream("GET", url, headers=headers, follow_redirects=True,
                              timeout=constants.HF_HUB_DOWNLOAD_TIMEOUT) as r:
        if r.status_code == 416:  # start is past the end of the file
            return b""
        if r.status_code >= 400:
            r.read()
            hf_raise_for_status(r)
        skip = start if r.status_code == 200 else 0
        for chunk in r.iter_bytes():
            if skip:
                cut = min(skip, len(chunk))
                chunk, skip = chunk[cut:], skip - cut
            out += chunk
            if len(out) >= n:
                break
    return bytes(out[:n])
