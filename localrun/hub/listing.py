"""What a repo holds: its files at one commit, from the Hub or from the HF cache; and
what earlier downloads of a name resolved it to (:mod:`localrun.hub.pulls`)."""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import huggingface_hub
from huggingface_hub import scan_cache_dir
from huggingface_hub.errors import CacheNotFound

from localrun.errors import LocalrunError
from localrun.hub import pulls
from localrun.hub.chosen import Download, PlannedFile, Source
from localrun.hub.client import api, cache_dir, hub_call
from localrun.naming.refs import ModelRef, as_catalog_alias, parse_ref


@dataclass
class Listing:
    repo: str
    revision: str
    commit: str | None
    files: dict[str, PlannedFile]
    tags: list[str] = field(default_factory=list)
    gated: bool = False
    config: dict[str, Any] | None = None
    downloads: int = 0
    source: Source = "hub"
    snapshot: Path | None = None  # cache listings: the snapshot folder


def has_weights(lst: Listing) -> bool:
    return any(n.endswith(".safetensors") for n in lst.files)


def hub_listing(repo: str, revision: str | None) -> Listing:
    hf = api()
    what = f"to list {repo}" + (f"@{revision}" if revision else "")
    info = hub_call(lambda: hf.model_info(repo, revision=revision), repo, what, revision)
    commit = info.sha
    # The tree of the commit the info named: a branch that moves on meanwhile cannot mix
    # the files of two commits into one plan.
    tree = hub_call(lambda: list(hf.list_repo_tree(repo, recursive=True,
                                                   revision=commit or revision)),
                    repo, what, revision, retry=False)
    files: dict[str, PlannedFile] = {}
    for f in tree:
        if isinstance(f, huggingface_hub.RepoFile):
            sha = f.lfs.sha256 if f.lfs is not None else None
            files[f.path] = PlannedFile(f.path, int(f.size), sha)
    config = info.config if isinstance(info.config, dict) else None
    return Listing(repo=repo, revision=revision or "main", commit=commit, files=files,
                   tags=list(info.tags or []), gated=bool(info.gated), config=config,
                   downloads=int(info.downloads or 0))


def cached_repos() -> dict[str, Any]:
    """Repo id -> huggingface_hub's ``CachedRepoInfo`` for every model in the HF cache."""
    try:
        info = scan_cache_dir(cache_dir())
    except CacheNotFound:
        return {}
    return {r.repo_id: r for r in info.repos if r.repo_type == "model"}


def cache_listing(repo: str, revision: str | None, cached: dict[str, Any]) -> Listing | None:
    """The cached snapshot of ``repo`` at ``revision`` (branch or commit), if any."""
    entry = cached.get(repo)
    if entry is None:
        return None
    rev = revision or "main"
    chosen = entry.refs.get(rev)
    if chosen is None:
        chosen = next((r for r in entry.revisions if r.commit_hash.startswith(rev)), None)
    if chosen is None:
        return None
    snap = Path(chosen.snapshot_path)
    files = {}
    for f in chosen.files:
        rel = Path(f.file_path).relative_to(snap).as_posix()
        files[rel] = PlannedFile(rel, int(f.size_on_disk), None, cached=True)
    config = None
    if (snap / "config.json").is_file():
        try:
            loaded = json.loads((snap / "config.json").read_text(encoding="utf-8"))
            config = loaded if isinstance(loaded, dict) else None
        except (OSError, ValueError):
            config = None
    return Listing(repo=repo, revision=rev, commit=chosen.commit_hash, files=files,
                   config=config, source="cache", snapshot=snap)


# --- what earlier downloads resolved names to ---------------------------------------------------

def record_name(r: ModelRef) -> str | None:
    """The name a download of ``r`` is remembered under: the catalog alias, or the repo
    id (with ``@revision`` when one was named); None for local models."""
    if r.kind == "alias" and r.alias:
        return r.alias
    if r.kind == "repo" and r.repo:
        return r.repo + (f"@{r.revision}" if r.revision else "")
    return None


def records() -> list[pulls.PullRecord]:
    return pulls.load(cache_dir())


def record_listing(rec: pulls.PullRecord, cached: dict[str, Any]) -> Listing | None:
    """The cached snapshot a record points at, if every file it names is still there."""
    lst = cache_listing(rec.repo, rec.commit or rec.revision, cached)
    if lst is None or not rec.files or any(f not in lst.files for f in rec.files):
        return None
    lst.revision = rec.revision  # the branch name (EXL bpw branches are quants)
    return lst


def remember(plan: Download) -> None:
    """Write down what ``plan``'s name resolved to (best effort: a read-only home only
    loses the offline shortcut, never the download)."""
    try:
        r = parse_ref(plan.ref)
    except LocalrunError:
        return
    if r.kind == "default":  # the packaged model's name, planned as the catalog alias
        r = as_catalog_alias(r)
    name = record_name(r)
    if name is None or plan.repo is None:
        return
    rec = pulls.PullRecord(
        name=name, backend=plan.backend, quant=plan.asked_quant, repo=plan.repo,
        revision=plan.revision or "main", commit=plan.commit, format=plan.format,
        variant_quant=plan.quant, subfolder=plan.subfolder, primary=plan.primary,
        files=tuple(f.path for f in plan.files), cache=cache_dir(), found=_found(plan))
    with contextlib.suppress(OSError):
        pulls.remember(rec)


def _found(plan: Download) -> tuple[str, ...]:
    """The plan's files that were cached when it was made and that no pull downloaded
    (another program did): ``localrun rm`` keeps them. A file an earlier pull (of any
    name) downloaded stays localrun's."""
    cached = [f.path for f in plan.files if f.cached]
    if not cached or plan.repo is None:
        return ()
    ours: set[str] = set()
    for rec in records():
        if rec.repo.lower() == plan.repo.lower() and rec.commit == plan.commit:
            ours.update(set(rec.files) - set(rec.found))
    return tuple(p for p in cached if p not in ours)
