"""Downloading a plan: what the cache lacks, from the commit the plan listed, every
file checked against its LFS sha256; Xet-backed files through huggingface_hub (hf_xet),
the others through :mod:`localrun.hub.resumable`; tried again on 5xx, 429 (Retry-After)
and dropped connections; a disk-space check first."""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
from pathlib import Path
from typing import Literal

import httpx2
import huggingface_hub
from huggingface_hub import constants, get_hf_file_metadata, hf_hub_download, hf_hub_url
from huggingface_hub.errors import (
    HfHubHTTPError,
    LocalEntryNotFoundError,
    OfflineModeIsEnabled,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

from localrun.errors import (
    ChecksumError,
    DiskFullError,
    HubNotFoundError,
    LocalrunError,
    OfflineMissingError,
)
from localrun.hub.chosen import Download, PlannedFile
from localrun.hub.client import (
    RETRY_STATUS,
    Retry,
    cache_dir,
    missing_reason,
    offline,
    status,
    storage,
    typed,
    unreachable,
    wait_before_retry,
)
from localrun.hub.listing import remember
from localrun.hub.progress import FileMeter, Meter, ProgressCallback, bar_class
from localrun.hub.resumable import Mismatch, http_to_cache, sha256_file


def _check_disk(needed: int) -> None:
    p = Path(cache_dir())
    probe = p
    while not probe.exists() and probe.parent != probe:
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if needed > free:
        raise DiskFullError(str(p), needed_bytes=needed, free_bytes=free)


def _bad_checksum(path: str, f: PlannedFile) -> str | None:
    """The sha256 of a cached file that is not the one the Hub listed (the file is then
    dropped from the cache, its link and its blob); None when it matches or none is known."""
    if not f.sha256:
        return None
    actual = sha256_file(path)
    if actual == f.sha256:
        return None
    blob = os.path.realpath(path)
    for p in {path, blob}:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(p)
    return actual


def fetch(plan: Download, *, progress: ProgressCallback | None = None,
          verify: Literal["new", "all"] = "new") -> Path:
    """Download what ``plan`` names into the HF cache; return what the engine opens.

    Returns the GGUF file (first shard) for GGUF plans, the variant folder for ONNX,
    else the snapshot folder; for in-place models (Ollama, LM Studio, local) their path.
    Refuses a plan that does not fit (ModelTooLargeError) before any download. Files
    come from the commit the plan listed (``plan.commit``), not from wherever its branch
    points by now. Every file with an LFS sha256 that this call downloads (``verify=
    "all"``: every file) is checked before it enters the cache; a mismatch is fetched once
    more, then ChecksumError. Dropped connections, expired download URLs, 5xx and 429
    answers are tried again (a download continues from the bytes it has, also in a later
    process); then HubUnavailableError. Raises ModelGatedError, HubNotFoundError,
    HubAuthError, OfflineMissingError, DiskFullError.
    A Hub model's name is remembered with what it resolved to (:mod:`localrun.hub.pulls`),
    so that the same name runs offline later.
    """
    plan.require_fit()
    if plan.local_path is not None:
        return Path(plan.local_path)
    assert plan.repo is not None
    _ref_to_note(plan)  # a revision that is not a ref name fails before any download
    todo = [f for f in plan.files if not _cached_now(plan, f)]
    if offline() and todo:
        raise OfflineMissingError(plan.ref, [f"{plan.repo}/{f.path}" for f in todo],
                                  reason=unreachable() or "HF_HUB_OFFLINE=1 is set")
    _check_disk(sum(f.size for f in todo))
    meter = Meter(progress, todo)
    paths: dict[str, str] = {}
    for f in plan.files:
        if f in todo:
            path = _download(plan, f, meter.file(f, todo.index(f) + 1))
        else:
            path = _from_cache(plan, f)
            if verify == "all" and _bad_checksum(path, f) is not None:
                path = _download(plan, f, Meter(None, [f]).file(f, 1))
        paths[f.path] = path
    first = next(iter(paths.items()), None)
    if first is None:
        raise HubNotFoundError(plan.repo, hint="the plan names no files")
    rel, abs_path = first
    root = Path(abs_path)
    for _ in rel.split("/"):
        root = root.parent
    _note_ref(plan)
    remember(plan)
    if plan.primary:
        return root / plan.primary
    if plan.subfolder:
        return root / plan.subfolder
    return root


def _cached_now(plan: Download, f: PlannedFile) -> bool:
    assert plan.repo is not None
    hit = huggingface_hub.try_to_load_from_cache(
        plan.repo, f.path, cache_dir=cache_dir(), revision=plan.commit or plan.revision)
    return isinstance(hit, str)


def _pinned(plan: Download) -> str:
    """The revision files are fetched at: the commit the plan listed."""
    return plan.commit or plan.revision or "main"


def _shown_revision(plan: Download) -> str:
    rev = plan.revision or "main"
    if plan.commit and not plan.commit.startswith(rev):
        return f"{rev} (commit {plan.commit[:12]}, as planned)"
    return rev


def _from_cache(plan: Download, f: PlannedFile) -> str:
    """A file the cache has: asked for by commit, huggingface_hub answers without a
    request (the Hub may be out of reach, or the branch may have moved on)."""
    assert plan.repo is not None
    try:
        return str(hf_hub_download(plan.repo, f.path, revision=_pinned(plan),
                                   cache_dir=cache_dir()))
    except LocalEntryNotFoundError as e:
        raise OfflineMissingError(plan.ref, [f"{plan.repo}/{f.path}"],
                                  reason=missing_reason()) from e
    except HfHubHTTPError as e:
        raise typed(e, plan.repo, f"to look up {f.path}", revision=_shown_revision(plan),
                    filename=f.path) from e



def _download(plan: Download, f: PlannedFile, meter: FileMeter) -> str:
    """One file of the plan into the HF cache at the planned commit, checked; a file
    whose checksum is wrong is fetched once more, then ChecksumError."""
    try:
        return _download_once(plan, f, meter)
    except Mismatch:
        meter.at(0)  # the bad file is gone: the second try starts from byte 0
    try:
        return _download_once(plan, f, meter)
    except Mismatch as bad:
        meter.at(0)
        raise ChecksumError(bad.path, expected=f.sha256 or "?", actual=bad.actual) from None


def _xet_enabled() -> bool:
    import importlib.util

    return not constants.HF_HUB_DISABLE_XET and importlib.util.find_spec("hf_xet") is not None


def _download_once(plan: Download, f: PlannedFile, meter: FileMeter) -> str:
    """Ask the Hub where the file is (HEAD), then fetch it: Xet-backed files through
    huggingface_hub (hf_xet), the others with localrun's resumable HTTP download. Tried
    again while failures pass (see :data:`~localrun.hub.client.HUB_ATTEMPTS`)."""
    assert plan.repo is not None
    repo, revision = plan.repo, _pinned(plan)
    url = hf_hub_url(repo, f.path, revision=revision)
    what = f"to download {f.path} from {repo}"
    attempt = 1
    while True:
        before = meter.at_bytes
        try:
            meta = get_hf_file_metadata(url)
            if meta.xet_file_data is not None and _xet_enabled():
                return _via_huggingface_hub(repo, f, revision, meter)
            return http_to_cache(repo, f, revision, url, meta, meter)
        except (RepositoryNotFoundError, RevisionNotFoundError, RemoteEntryNotFoundError) as e:
            raise typed(e, repo, what, revision=_shown_revision(plan), filename=f.path) from e
        except (OfflineModeIsEnabled, LocalEntryNotFoundError) as e:
            raise OfflineMissingError(plan.ref, [f"{repo}/{f.path}"],
                                      reason=missing_reason()) from e
        except (HfHubHTTPError, httpx2.TransportError, Retry) as e:
            passing = (isinstance(e, (httpx2.TransportError, Retry))
                       or status(e) in RETRY_STATUS)
            if meter.at_bytes > before:
                attempt = 1  # bytes arrived: a slow, flaky line is not a failure
            if not passing or not wait_before_retry(e, attempt):
                raise typed(e, repo, what, tries=attempt) from e
            attempt += 1
        except OSError as e:
            if e.errno == errno.ENOSPC:
                raise DiskFullError(cache_dir(), needed_bytes=f.size,
                                    free_bytes=shutil.disk_usage(cache_dir()).free) from e
            raise


def _via_huggingface_hub(repo: str, f: PlannedFile, revision: str, meter: FileMeter) -> str:
    """A Xet-backed file: hf_xet fetches it (its chunk cache is what an interrupted Xet
    download continues from); progress comes through the same meter as HTTP's."""
    meter.at(0)
    path = str(hf_hub_download(repo, f.path, revision=revision, cache_dir=cache_dir(),
                               tqdm_class=bar_class(meter)))
    actual = _bad_checksum(path, f)
    if actual is not None:
        raise Mismatch(path, actual)
    return path


#: What git (and so the Hub) refuses in a ref name; with these, ``..`` and empty or dot-led
#: parts refused, a revision cannot name a path outside the repo's ``refs`` folder.
_BAD_REF = re.compile(r"[\x00-\x20\x7f~^:?*\[\\]|\.\.|@\{")
_COMMIT = re.compile(r"^(?:[0-9a-f]{40}|[0-9a-f]{64})$")


def _ref_to_note(plan: Download) -> tuple[Path, str] | None:
    """Where :func:`_note_ref` writes and what: ``refs/<revision>`` in the repo's cache
    folder, holding the commit. Raises LocalrunError for a revision that is not a ref name
    (``../x``, an absolute path, control characters) or a commit that is not a hash."""
    rev, commit = plan.revision, plan.commit
    if plan.source != "hub" or plan.repo is None or not rev or not commit \
            or commit.startswith(rev):
        return None
    parts = rev.split("/")
    if len(rev.encode("utf-8", "surrogatepass")) > 255 or _BAD_REF.search(rev) or rev == "@" \
            or any(not p or p.startswith(".") or p.endswith((".", ".lock")) for p in parts):
        raise LocalrunError(f"{rev!r} is not a valid revision name",
                            hint="a branch, tag or commit of the repo: no '..', spaces, "
                            "control characters or ~^:?*[\\, no empty part or part "
                            "starting with '.' between '/'")
    if not _COMMIT.match(commit):
        raise LocalrunError(f"The Hub named {commit!r} as the commit of {plan.repo}@{rev}, "
                            "which is not a commit hash",
                            hint="check that HF_ENDPOINT is a Hugging Face Hub or mirror")
    refs = storage(plan.repo) / "refs"
    ref = refs.joinpath(*parts)
    if refs.resolve() not in ref.resolve().parents:  # a linked folder on the way
        raise LocalrunError(f"{rev!r} is not a valid revision name",
                            hint=f"it would be written outside {refs}")
    return ref, commit


def _note_ref(plan: Download) -> None:
    """Write down in the cache which commit the plan's branch or tag named (what
    huggingface_hub does when asked by name, and offline plans look up): files were
    asked for by commit. Refuses a revision that is not a ref name (see
    :func:`_ref_to_note`)."""
    target = _ref_to_note(plan)
    if target is None:
        return
    ref, commit = target
    with contextlib.suppress(OSError):
        ref.parent.mkdir(parents=True, exist_ok=True)
        tmp = ref.with_name(ref.name + ".tmp")
        tmp.write_text(commit, encoding="utf-8")
        os.replace(tmp, ref)
