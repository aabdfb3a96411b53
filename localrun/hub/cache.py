"""The HF cache as localrun shows it: one row per runnable variant (GGUF quant, EXL
branch, ONNX folder, else repo) with the names downloads resolved to it; what removing a
name would delete (what its pulls put there, never what another program or name needs);
the engines a name was downloaded for."""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from huggingface_hub import scan_cache_dir
from huggingface_hub.errors import CacheNotFound

from localrun.errors import LocalrunError
from localrun.hub import pulls
from localrun.hub.client import cache_dir
from localrun.hub.listing import (
    cache_listing,
    cached_repos,
    record_listing,
    record_name,
    records,
)
from localrun.hub.variants import gguf_quant, quant_matches, repo_format, variant_candidates
from localrun.naming.refs import ModelRef, as_catalog_alias, parse_ref
from localrun.naming.stores import StoredModel


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


# --- `localrun rm NAME`: what NAME's pulls put in the cache, nothing else ----------------------

#: (repo id lower-cased, commit, path in the snapshot): one file of one cached revision.
_Key = tuple[str, str, str]
_HEX = re.compile(r"^[0-9a-f]{7,64}$")


@dataclass(frozen=True)
class Kept:
    """Something in the HF cache that ``rm`` matched and keeps: a file, or a repo at a
    revision (``org/name@main``); why; its size; the command that would remove it."""

    what: str
    reason: str
    size: int = 0
    command: str | None = None


@dataclass(frozen=True)
class Removal:
    """What :func:`remove` would delete from the HF cache, and what it keeps."""

    ref: str
    repos: tuple[str, ...]  # the repos files are removed from
    files: tuple[str, ...]  # the files removed (their paths in the snapshot folders)
    freed_bytes: int
    kept: tuple[Kept, ...] = ()
    forgets: tuple[str, ...] = ()  # pulled names that no longer run offline afterwards
    whole: tuple[str, ...] = ()  # revisions removed entirely (``org/name@main``)
    _strategy: Any = field(default=None, repr=False, compare=False)
    _records: tuple[pulls.PullRecord, ...] = field(default=(), repr=False, compare=False)
    _partial: tuple[Path, ...] = field(default=(), repr=False, compare=False)


def plan_removal(ref: str | ModelRef) -> Removal:
    """What ``rm ref`` deletes, and what it keeps (with why).

    An alias (or a repo id) removes the files its pulls' records list (:mod:`localrun.hub.pulls`),
    at the recorded commit only; ``@revision`` and ``:QUANT`` narrow that to the records
    that match. A file another pulled name still needs, or that was in the cache before
    localrun pulled it, is kept. A repo id also removes that repo as the user named it:
    every cached revision, or the ``@revision`` named, or with ``:QUANT`` only that
    quant's GGUF files. Whatever else of the alias's catalog entry (base repo, other
    variants, other revisions) is cached is listed as kept, with the ``localrun rm`` that
    would remove it. Raises LocalrunError (with what is cached) when nothing matches."""
    r = ref if isinstance(ref, ModelRef) else parse_ref(ref)
    packaged = r.kind == "default"
    if packaged:
        r = as_catalog_alias(r)
    if r.kind not in ("alias", "repo"):
        raise _not_in_hf_cache(r)
    info = _scan()
    repos = {x.repo_id.lower(): x for x in info.repos if x.repo_type == "model"} if info else {}
    recs = records()
    chosen = _chosen(r, recs)
    removed: dict[_Key, tuple[Any, Any, Any]] = {}  # key -> (repo, revision, file) infos
    named: set[tuple[str, str]] = set()  # revisions the user named (repo ids)
    entry = repos.get(r.repo.lower()) if r.kind == "repo" and r.repo else None
    if entry is not None:
        for rev in _revisions(entry, r.revision):
            named.add((entry.repo_id.lower(), rev.commit_hash))
            for f in rev.files:
                if not r.quant or _is_quant(f, r.quant):
                    removed[_key(entry, rev, f)] = (entry, rev, f)
    # What the chosen pulls put there, unless another pulled name needs it or it was in the
    # cache before the pull (found: then someone else downloaded it).
    needed: dict[_Key, list[str]] = {}
    for rec in recs:
        if rec not in chosen:
            for k, _ in _record_files(rec, repos):
                needed.setdefault(k, []).append(rec.display)
    pulled: dict[_Key, tuple[Any, Any, Any, bool]] = {}
    for rec in chosen:
        for k, (entry, rev, f) in _record_files(rec, repos):
            prev = pulled.get(k)  # found: by every chosen record that lists it
            pulled[k] = (entry, rev, f, k[2] in rec.found and (prev is None or prev[3]))
    kept: list[Kept] = []
    for k, (entry, rev, f, found) in pulled.items():
        if k in removed:
            continue  # in the repo the user named
        if k in needed:
            kept.append(Kept(str(f.file_path), f"also pulled as {', '.join(needed[k])}: kept "
                             "while that name needs it", f.size_on_disk))
        elif found:
            kept.append(Kept(str(f.file_path), "already in the cache before localrun pulled "
                             f"it as {r.raw} (downloaded by another program)", f.size_on_disk,
                             _quant_command(entry, rev, f)))
        else:
            removed[k] = (entry, rev, f)
    if not removed and not pulled:
        raise _nothing_cached(r, packaged, repos)
    settled = set(removed) | set(pulled)  # removed, or kept with a reason of its own
    names = _names_by_revision(recs, repos)
    touched: dict[tuple[str, str], tuple[Any, Any]] = {}
    for entry, rev, _ in [*removed.values(), *(v[:3] for v in pulled.values())]:
        touched[(entry.repo_id.lower(), rev.commit_hash)] = (entry, rev)
    whole: list[Any] = []
    partial: list[Any] = []
    for (repo_low, commit), (entry, rev) in touched.items():
        keys = {_key(entry, rev, f) for f in rev.files}
        gone = keys & set(removed)
        rest = [f for f in rev.files if _key(entry, rev, f) not in settled]
        if gone == keys:
            whole.append(rev)
            continue
        if gone:
            partial.append(rev)
        if rest:
            why = (f"not {r.quant}" if (repo_low, commit) in named
                   else _not_pulled_as(r.raw, names.get((repo_low, commit), [])))
            kept.append(Kept(f"{entry.repo_id}@{_label(rev)}",
                             f"{len(rest)} other file{'s' if len(rest) > 1 else ''} of this "
                             f"revision, {why}", sum(f.size_on_disk for f in rest),
                             _rm_command(entry, rev)))
    kept += _untouched(r, chosen, repos, touched, named, names)
    gone_keys = set(removed)
    forgets = [rec.display for rec in recs if rec in chosen
               or any(k in gone_keys for k, _ in _record_files(rec, repos))]
    strategy, freed = _strategy(info, [v[2] for v in removed.values()], whole)
    entire = [f"{entry.repo_id}@{_label(rev)}" for entry, rev in touched.values()
              if rev in whole]
    return Removal(r.raw, tuple(dict.fromkeys(e.repo_id for e, _, _ in removed.values())),
                   tuple(str(f.file_path) for _, _, f in removed.values()), freed,
                   tuple(kept), tuple(dict.fromkeys(forgets)), tuple(entire), strategy,
                   tuple(chosen), tuple(Path(rev.snapshot_path) for rev in partial))


def remove(removal: Removal) -> int:
    """Delete what :func:`plan_removal` found; return the bytes freed. The records of the
    names removed are dropped, and those of downloads whose files are gone with them."""
    if removal._strategy is not None:
        removal._strategy.execute()
    for snapshot in removal._partial:
        _drop_empty_folders(snapshot)
    dropped = {rec.key for rec in removal._records}
    cached = cached_repos()
    with contextlib.suppress(OSError):
        pulls.forget(cache_dir(),
                     lambda rec: rec.key in dropped or record_listing(rec, cached) is None)
    return removal.freed_bytes


def _scan() -> Any:
    try:
        return scan_cache_dir(cache_dir())
    except CacheNotFound:
        return None


def _key(entry: Any, rev: Any, f: Any) -> _Key:
    rel = Path(f.file_path).relative_to(rev.snapshot_path).as_posix()
    return (entry.repo_id.lower(), rev.commit_hash, rel)


def _label(rev: Any) -> str:
    """How a revision is named: ``main``, another branch or tag, else its short commit."""
    refs = sorted(rev.refs)
    return "main" if "main" in rev.refs else (refs[0] if refs else rev.commit_hash[:12])


def _rm_command(entry: Any, rev: Any) -> str:
    one = len(entry.revisions) == 1
    return f"localrun rm {entry.repo_id}" + ("" if one else f"@{_label(rev)}")


def _quant_command(entry: Any, rev: Any, f: Any) -> str | None:
    """``localrun rm org/name:QUANT[@rev]`` for a GGUF file (that quant's files only)."""
    quant = gguf_quant(f.file_name) if f.file_name.lower().endswith(".gguf") else None
    if not quant:
        return None
    one = len(entry.revisions) == 1
    return f"localrun rm {entry.repo_id}:{quant}" + ("" if one else f"@{_label(rev)}")


def _revisions(entry: Any, revision: str | None) -> list[Any]:
    """The cached revisions of a repo that ``revision`` names (a branch, tag or commit
    prefix), all of them for None."""
    if entry is None:
        return []
    revs = sorted(entry.revisions, key=lambda x: (_label(x) != "main", _label(x)))
    if revision is None:
        return revs
    low = revision.lower()
    return [x for x in revs if revision in x.refs
            or (_HEX.match(low) and x.commit_hash.startswith(low))]


def _rev_matches(rec: pulls.PullRecord, revision: str) -> bool:
    low = revision.lower()
    return rec.revision == revision or bool(
        _HEX.match(low) and (rec.commit or "").startswith(low))


def _chosen(r: ModelRef, recs: list[pulls.PullRecord]) -> list[pulls.PullRecord]:
    """The pull records ``r`` names: the alias's (or the repo id's, any ``@revision`` of
    it unless one is given), narrowed by ``@revision`` and ``:QUANT``."""
    out = []
    for rec in recs:
        n = rec.name.lower()
        if r.kind == "alias":
            ok = n == (r.alias or "").lower() and (not r.revision
                                                  or _rev_matches(rec, r.revision))
        else:
            repo = (r.repo or "").lower()
            if r.revision:
                ok = n == f"{repo}@{r.revision.lower()}" or (
                    n == repo and rec.repo.lower() == repo and _rev_matches(rec, r.revision))
            else:
                ok = n == repo or n.startswith(repo + "@")
        asked = pulls.norm_quant(r.quant)
        if ok and (not asked or asked in (pulls.norm_quant(rec.quant),
                                          pulls.norm_quant(rec.variant_quant))):
            out.append(rec)
    return out


def _record_files(rec: pulls.PullRecord, repos: dict[str, Any]
                  ) -> list[tuple[_Key, tuple[Any, Any, Any]]]:
    """The cached files a record lists, at the recorded commit (or its branch)."""
    entry = repos.get(rec.repo.lower())
    if entry is None:
        return []
    revs = [x for x in entry.revisions if x.commit_hash == rec.commit] if rec.commit else \
        [x for x in entry.revisions if rec.revision in x.refs]
    out = []
    for rev in revs[:1]:
        wanted = set(rec.files)
        for f in rev.files:
            k = _key(entry, rev, f)
            if k[2] in wanted:
                out.append((k, (entry, rev, f)))
    return out


def _names_by_revision(recs: list[pulls.PullRecord], repos: dict[str, Any]
                       ) -> dict[tuple[str, str], list[str]]:
    out: dict[tuple[str, str], list[str]] = {}
    for rec in recs:
        for (repo_low, commit, _), _ in _record_files(rec, repos)[:1]:
            out.setdefault((repo_low, commit), []).append(rec.display)
    return out


def _not_pulled_as(name: str, others: list[str]) -> str:
    if others:
        return f"not pulled as {name} (pulled as {', '.join(dict.fromkeys(others))})"
    return f"not pulled as {name} (another program or name downloaded it)"


def _untouched(r: ModelRef, chosen: list[pulls.PullRecord], repos: dict[str, Any],
               touched: dict[tuple[str, str], Any], named: set[tuple[str, str]],
               names: dict[tuple[str, str], list[str]]) -> list[Kept]:
    """Cached revisions of the repos ``r`` relates to (the alias's base and variants, the
    repos its pulls resolved to, the repo named) that nothing is removed from."""
    related = [rec.repo for rec in chosen]
    if r.kind == "alias" and r.entry is not None:
        related = [r.entry.base, *(v.repo for v in r.entry.variants), *related]
    if r.kind == "repo" and r.repo:
        related.insert(0, r.repo)
    out = []
    for repo_low in dict.fromkeys(x.lower() for x in related):
        entry = repos.get(repo_low)
        if entry is None:
            continue
        for rev in _revisions(entry, None):
            at = (repo_low, rev.commit_hash)
            if at in touched:
                continue
            if at in named:
                why = f"no {r.quant} file"
            elif r.kind == "repo" and r.repo and repo_low == r.repo.lower():
                why = "another revision, not named"
            else:
                why = _not_pulled_as(r.raw, names.get(at, []))
            out.append(Kept(f"{entry.repo_id}@{_label(rev)}", why, rev.size_on_disk,
                            _rm_command(entry, rev)))
    return out


def _strategy(info: Any, files: list[Any], whole: list[Any]) -> tuple[Any, int]:
    """huggingface_hub's deletion for these files: whole revisions go as revisions (their
    snapshot folder, refs, unshared blobs; the repo folder with its last revision), the
    others file by file (blobs no other cached file links to)."""
    if not files:
        return None, 0
    by_file = info.delete_files(*files)
    if not whole:
        return by_file, int(by_file.expected_freed_size)
    by_rev = info.delete_revisions(*(rev.commit_hash for rev in whole))
    folders = by_rev.repos | by_rev.snapshots

    def outside(p: Path) -> bool:
        return not any(d in p.parents for d in folders)

    strategy = replace(
        by_rev, files=frozenset(p for p in by_file.files if outside(p)),
        blobs=by_rev.blobs | {p for p in by_file.blobs if outside(p)},
        expected_freed_size=by_file.expected_freed_size)
    return strategy, int(by_file.expected_freed_size)


def _drop_empty_folders(snapshot: Path) -> None:
    """Folders a partial removal emptied (an ONNX variant's subfolder)."""
    for d in sorted((p for p in snapshot.rglob("*") if p.is_dir() and not p.is_symlink()),
                    key=lambda p: -len(p.parts)):
        with contextlib.suppress(OSError):
            d.rmdir()  # only succeeds when empty


def _is_quant(f: Any, quant: str) -> bool:
    return bool(f.file_name.lower().endswith(".gguf")
                and quant_matches(gguf_quant(f.file_name), 0.0, "gguf", quant))


def _not_in_hf_cache(r: ModelRef) -> LocalrunError:
    if r.kind == "default":
        return LocalrunError(f"{r.raw} is the model packaged with localrun, not in the Hugging "
                             "Face cache", hint="nothing to remove; `localrun list` shows "
                             "what is in the cache")
    hint = {"ollama": f"Ollama keeps it: ollama rm {r.alias}",
            "lmstudio": "LM Studio keeps it: remove it in LM Studio"}.get(
        r.kind, "localrun rm removes models from the Hugging Face cache; delete your own "
        "files yourself")
    where = ("a file or folder on disk" if r.kind == "path" else
             f"a model in {'Ollama' if r.kind == 'ollama' else 'LM Studio'}'s store")
    return LocalrunError(f"{r.raw} is {where}, not in the Hugging Face cache", hint=hint)


def _nothing_cached(r: ModelRef, packaged: bool, repos: dict[str, Any]) -> LocalrunError:
    """Nothing of ``r`` to remove: say what is cached instead and how to remove it."""
    see = "nothing to remove; `localrun list` shows what is in the cache"
    if r.kind == "alias":
        e = r.entry
        related = [e.base, *(v.repo for v in e.variants)] if e is not None else []
        cmds = [f"localrun rm {repos[x].repo_id}"
                for x in dict.fromkeys(x.lower() for x in related) if x in repos]
        what = (f"{r.raw} is the model packaged with localrun, and nothing pulled as it"
                if packaged else f"Nothing pulled as {r.raw}")
        hint = (f"localrun did not download what is cached for it; to remove it, name the "
                f"repo: {'; '.join(cmds)}") if cmds else see
        return LocalrunError(f"{what} is in the Hugging Face cache", hint=hint)
    assert r.repo is not None
    entry = repos.get(r.repo.lower())
    if entry is not None and r.revision and not _revisions(entry, r.revision):
        labels = ", ".join(_label(x) for x in _revisions(entry, None))
        return LocalrunError(f"{r.repo}@{r.revision} is not in the Hugging Face cache",
                             hint=f"cached revisions of {entry.repo_id}: {labels}")
    if entry is not None and r.quant:
        quants = sorted({q for rev in _revisions(entry, r.revision) for f in rev.files
                         if f.file_name.lower().endswith(".gguf")
                         and (q := gguf_quant(f.file_name))})
        return LocalrunError(f"{entry.repo_id} has no {r.quant} file in the Hugging Face cache",
                             hint=f"cached: {', '.join(quants) or 'no GGUF files'}; "
                             "`localrun list` shows them")
    return LocalrunError(f"{r.raw} is not in the Hugging Face cache", hint=see)


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

