"""The HF cache as localrun shows it: one row per runnable variant (GGUF quant, EXL
branch, ONNX folder, else repo) with the names downloads resolved to it; what removing a
name would delete; the engines a name was downloaded for."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from huggingface_hub import scan_cache_dir
from huggingface_hub.errors import CacheNotFound

from localrun import pulls
from localrun.errors import HubNotFoundError, LocalrunError
from localrun.hub.client import cache_dir
from localrun.hub.listing import (
    cache_listing,
    cached_repos,
    record_listing,
    record_name,
    records,
)
from localrun.hub.variants import gguf_quant, quant_matches, repo_format, variant_candidates
from localrun.refs import ModelRef, parse_ref
from localrun.stores import StoredModel


def cached_models() -> list[StoredModel]:
    """Models in the HF cache: one row per GGUF quant, per EXL branch, per ONNX variant,
    else per repo; ``pulled_as`` names the aliases and repo ids downloads resolved to it."""
    out: list[StoredModel] = []
    cached = cached_repos()
    names = _pulled_names(cached)
    for repo_id, entry in sorted(cached.items()):
        for ref_name, rev in sorted(entry.refs.items()):
            lst = cache_listing(repo_id, ref_name, {repo_id: entry})
            if lst is None:
                continue
            fmt = repo_format(lst)
            cands, _ = variant_candidates(lst, fmt, None)
            for c in cands:
                size = sum(lst.files[f].size for f in c.files if f in lst.files)
                if fmt == "gguf" and c.primary:
                    name = f"{repo_id}:{c.quant}" if c.quant else repo_id
                    path = str(Path(rev.snapshot_path) / c.primary)
                elif fmt == "onnx" and c.subfolder:
                    name, path = repo_id, str(Path(rev.snapshot_path) / c.subfolder)
                else:
                    name, path = repo_id, str(rev.snapshot_path)
                if ref_name != "main":
                    name += f"@{ref_name}"
                out.append(StoredModel(name=name, path=path, format=fmt, quant=c.quant,
                                       size=size, store="hf", repo=repo_id, revision=ref_name,
                                       pulled_as=tuple(names.get(str(Path(path)), ()))))
    return out


def _pulled_names(cached: dict[str, Any]) -> dict[str, list[str]]:
    """Path of a cached model -> the names (with engine) downloads of it were asked by."""
    out: dict[str, list[str]] = {}
    for rec in records():
        lst = record_listing(rec, cached)
        if lst is None or lst.snapshot is None:
            continue
        shown = out.setdefault(str(lst.snapshot / (rec.primary or rec.subfolder or "")), [])
        if rec.display not in shown:
            shown.append(rec.display)
    return out


@dataclass(frozen=True)
class Removal:
    """What ``remove`` would delete from the HF cache."""

    ref: str
    repos: tuple[str, ...]
    files: tuple[str, ...]  # paths shown to the user
    freed_bytes: int
    _strategy: Any = field(default=None, repr=False, compare=False)


def plan_removal(ref: str | ModelRef) -> Removal:
    """What belongs to ``ref`` in the HF cache: a repo (with ``:QUANT``, only that
    quant's files), or for an alias every cached variant repo and its base repo."""
    r = ref if isinstance(ref, ModelRef) else parse_ref(ref)
    try:
        info = scan_cache_dir(cache_dir())
    except CacheNotFound:
        info = None
    repos_by_id = {x.repo_id.lower(): x for x in info.repos} if info else {}
    # What downloads of this very name resolved to (discovered repos are in no catalog).
    name = record_name(r)
    recorded = [rec.repo for rec in pulls.find(records(), name)] if name else []
    if r.kind == "repo" and r.repo:
        wanted = [r.repo, *recorded]
    elif r.kind == "alias" and r.entry is not None:
        e = r.entry
        wanted = [e.base, *(v.repo for v in e.variants), *recorded]
    else:
        raise LocalrunError(f"{r.raw} is not in the Hugging Face cache",
                            hint="localrun rm takes a Hub repo id or an alias; "
                            "see `localrun list`")
    wanted = list(dict.fromkeys(w.lower() for w in wanted))
    hits = [repos_by_id[w] for w in wanted if w in repos_by_id]
    if not hits or info is None:
        raise HubNotFoundError(r.raw, hint="nothing of it is cached; see `localrun list`")
    quant = r.quant
    if quant:
        files = [f for repo in hits for rev in repo.revisions for f in rev.files
                 if f.file_name.lower().endswith(".gguf")
                 and quant_matches(gguf_quant(f.file_name), 0.0, "gguf", quant)]
        if not files:
            raise HubNotFoundError(r.raw, hint=f"no cached {quant} file; see `localrun list`")
        strategy = info.delete_files(*files)
        shown = tuple(str(f.file_path) for f in files)
    else:
        strategy = info.delete_revisions(*[rev.commit_hash for repo in hits
                                           for rev in repo.revisions])
        shown = tuple(str(repo.repo_path) for repo in hits)
    return Removal(r.raw, tuple(repo.repo_id for repo in hits), shown,
                   int(strategy.expected_freed_size), strategy)


def remove(removal: Removal) -> int:
    """Delete what :func:`plan_removal` found; return the bytes freed. Records of
    downloads whose files are gone are dropped with them."""
    removal._strategy.execute()
    cached = cached_repos()
    with contextlib.suppress(OSError):
        pulls.forget(cache_dir(), lambda rec: record_listing(rec, cached) is None)
    return removal.freed_bytes



def pulled_backends(ref: str | ModelRef) -> list[str]:
    """Engines an earlier download of ``ref`` (the same name) is in the cache for."""
    r = ref if isinstance(ref, ModelRef) else parse_ref(ref)
    name = record_name(r)
    if name is None:
        return []
    cached = cached_repos()
    out: list[str] = []
    for rec in pulls.find(records(), name):
        if rec.backend not in out and record_listing(rec, cached) is not None:
            out.append(rec.backend)
    return out

