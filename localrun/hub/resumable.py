"""localrun's own resumable download of a plain-HTTP Hub file into the HF cache.

The Hub answers a file's URL with a 302 to its CDN (a signed URL that expires). The bytes
go into ``blobs/<etag>`` + :data:`PARTIAL_SUFFIX` and are continued with Range requests
after a dropped connection, an expired URL or a killed process; the LFS sha256 is checked
before the blob takes its name, and huggingface_hub then links it into the snapshot.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

import huggingface_hub
from huggingface_hub import constants, get_session, hf_hub_download, hf_raise_for_status

# Public API (documented, and in the ``__all__`` of huggingface_hub.utils' lazy facade,
# which mypy cannot follow).
from huggingface_hub.utils import (  # type: ignore[attr-defined]
    WeakFileLock,
    build_hf_headers,
)

from localrun.hub.chosen import PlannedFile
from localrun.hub.client import Retry, cache_dir, storage
from localrun.hub.progress import FileMeter

#: Suffix of localrun's partial downloads, next to the blob they become in the HF cache.
#: Kept across tries and processes (huggingface_hub >= 1.18 discards its own partial
#: files), so that a download cut off by an expired URL or a killed process continues;
#: ``*.incomplete`` is what ``hf cache`` lists (and ``hf cache prune`` removes) as partial.
PARTIAL_SUFFIX = ".localrun.incomplete"


def sha256_file(path: str | os.PathLike[str]) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


class Mismatch(Exception):
    """A downloaded file whose sha256 is not the one the Hub listed (already deleted)."""

    def __init__(self, path: str, actual: str) -> None:
        super().__init__(path)
        self.path = path
        self.actual = actual


def http_to_cache(repo: str, f: PlannedFile, revision: str, url: str,
                  meta: huggingface_hub.HfFileMetadata, meter: FileMeter) -> str:
    """Download to ``blobs/<etag>`` + PARTIAL_SUFFIX, continuing what is there; check the
    sha256 before the blob takes its name, then let huggingface_hub link it into the
    snapshot (with the blob in place, ``hf_hub_download`` only makes the link)."""
    etag = meta.etag
    if not etag or meta.location is None:
        raise Retry(f"the Hub gave no ETag or location for {f.path}")
    size = meta.size if meta.size is not None else (f.size or None)
    folder = storage(repo)
    blob = folder / "blobs" / etag
    if not blob.exists():
        blob.parent.mkdir(parents=True, exist_ok=True)
        lock = Path(cache_dir()) / ".locks" / folder.name / f"{etag}.lock"
        lock.parent.mkdir(parents=True, exist_ok=True)
        partial = blob.with_name(etag + PARTIAL_SUFFIX)
        with WeakFileLock(lock):  # the lock huggingface_hub takes for this blob
            if not blob.exists():
                stream(partial, url, meta.location, size, meter)
                if f.sha256:
                    actual = sha256_file(partial)
                    if actual != f.sha256:
                        partial.unlink()
                        raise Mismatch(str(blob), actual)
                os.replace(partial, blob)
    meter.at(blob.stat().st_size)
    return str(hf_hub_download(repo, f.path, revision=revision, cache_dir=cache_dir()))


def same_origin(a: str, b: str) -> bool:
    from urllib.parse import urlsplit

    ua, ub = urlsplit(a), urlsplit(b)
    return (ua.scheme, ua.hostname, ua.port) == (ub.scheme, ub.hostname, ub.port)


def stream(partial: Path, url: str, location: str, size: int | None,
           meter: FileMeter) -> None:
    """GET ``location`` into ``partial`` from the bytes it already holds (a Range
    request). A server that answers the Range with 200 sends the whole file: it is
    written from the start. Raises :class:`~localrun.hub.client.Retry` when the file
    came out short, or when the signed URL no longer works (the next try asks the Hub
    for a fresh one)."""
    have = partial.stat().st_size if partial.exists() else 0
    if size is not None and have > size:
        have = 0
    meter.at(have, size)
    if size is not None and have == size:
        return  # complete: the checksum decides
    headers = build_hf_headers()
    if not same_origin(url, location):
        # A signed CDN URL carries its own authorization; the token must not leave the Hub.
        headers = {k: v for k, v in headers.items() if k.lower() != "authorization"}
    if have:
        headers["Range"] = f"bytes={have}-"
    with get_session().stream("GET", location, headers=headers, follow_redirects=True,
                              timeout=constants.HF_HUB_DOWNLOAD_TIMEOUT) as r:
        if r.status_code == 416:  # the partial is no prefix of this file: start over
            partial.unlink(missing_ok=True)
            raise Retry(f"the file storage refused to continue at byte {have} of {size} "
                        "(416): it holds another length than the Hub lists")
        if r.status_code in (401, 403, 410) and not same_origin(url, location):
            raise Retry(f"{r.status_code} from the file storage: the signed URL expired")
        if r.status_code >= 400:
            r.read()
            hf_raise_for_status(r)
        start = 0
        if r.status_code == 206:
            m = re.match(r"bytes (\d+)-", r.headers.get("Content-Range", ""))
            start = int(m.group(1)) if m else 0
            if start > have:
                partial.unlink(missing_ok=True)
                raise Retry(f"the server resumed at byte {start}, not {have}")
        with open(partial, "r+b" if partial.exists() else "wb") as fh:
            fh.seek(start)
            fh.truncate()
            meter.at(start, size)
            # As the bytes arrive (no buffering to a chunk size): what arrived before a
            # dropped connection is on disk for the next try to continue from.
            for chunk in r.iter_bytes():
                fh.write(chunk)
                meter.add(len(chunk))
    got = partial.stat().st_size
    if size is not None and got != size:
        raise Retry(f"the download stopped at byte {got} of {size}")

