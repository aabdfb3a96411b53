"""Planning and memory fit: the quality each format aims for, the model's shape (from a
GGUF header or config.json, never the weights), and which variant fits the budget at
the context the engines load it with (:func:`localrun.memory.context_window`)."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import httpx2
import huggingface_hub
from huggingface_hub import hf_hub_download
from huggingface_hub.errors import HfHubHTTPError

from localrun import memory
from localrun.backends import BACKENDS, compat, engine_memory
from localrun.errors import HubNotFoundError
from localrun.formats import gguf
from localrun.hub.chosen import Download, PlannedFile, QuantOption, Source
from localrun.hub.client import cache_dir, range_read
from localrun.hub.listing import Listing
from localrun.hub.variants import Candidate, trust_rank
from localrun.memory import Fit, ModelShape
from localrun.naming.refs import ModelRef
from localrun.naming.stores import StoredModel, find_lmstudio, find_ollama

#: The quality each format aims for by default (bits per weight); the nearest variant that
#: fits wins. Each engine's ``target_bpw`` for the format it asks for (backends.spec):
#: GGUF Q4_K_M, MLX/OpenVINO/ONNX 4-bit, EXL2/EXL3 the largest bpw that fits.
DEFAULT_TARGET: dict[str, float] = {
    s.formats[0]: s.target_bpw for s in BACKENDS.values() if s.target_bpw is not None}
#: How the plan's reasons name each format's default target: the engine's ``quant``.
DEFAULT_TARGET_NAMES: dict[str, str] = {
    s.formats[0]: "largest bpw" if s.target_bpw == math.inf else s.quant
    for s in BACKENDS.values() if s.target_bpw is not None and s.quant is not None}

#: GGUF header bytes read to learn the model's shape (retried once with the larger size).
GGUF_HEADER_READS = (2 * 2**20, 24 * 2**20)


def fmt_target(fmt: str) -> str:
    return DEFAULT_TARGET_NAMES.get(fmt, "default")


# --- the model's shape (for the KV cache) ---------------------------------------------------------

def read_shape(cand: Candidate) -> ModelShape | None:
    """From GGUF metadata (a Range read of the file's head) or config.json /
    genai_config.json; never downloads weights."""
    lst = cand.listing
    try:
        if cand.format == "gguf" and cand.primary:
            if lst.snapshot is not None:
                return shape_from_gguf_head(file_reader(lst.snapshot / cand.primary))
            if lst.source == "hub":
                primary, rev = cand.primary, lst.commit or lst.revision
                return shape_from_gguf_head(
                    lambda at, n: range_read(lst.repo, primary, rev, at, n))
            return None
        name = f"{cand.subfolder}/genai_config.json" if cand.subfolder else (
            "genai_config.json" if "genai_config.json" in lst.files else "config.json")
        if name not in lst.files:
            return memory.shape_from_config(lst.config) if lst.config else None
        if lst.snapshot is not None:
            path = str(lst.snapshot / name)
        else:
            path = hf_hub_download(lst.repo, name, revision=lst.commit or lst.revision)
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        return memory.shape_from_config(data) if isinstance(data, dict) else None
    except (OSError, ValueError, HfHubHTTPError, httpx2.HTTPError):
        return None


def shape_from_gguf_head(read: Callable[[int, int], bytes]) -> ModelShape | None:
    """The model's shape from the metadata at a GGUF file's head; ``read(start, n)`` gives
    the ``n`` bytes from ``start`` (fewer at the end of the file)."""
    buf = b""
    for size in GGUF_HEADER_READS:
        buf += read(len(buf), size - len(buf))
        try:
            return memory.shape_from_gguf_metadata(gguf.metadata_from_bytes(buf))
        except EOFError:
            continue
    return None


def file_reader(path: str | os.PathLike[str]) -> Callable[[int, int], bytes]:
    def read(start: int, n: int) -> bytes:
        with open(path, "rb") as fh:
            fh.seek(start)
            return fh.read(n)

    return read


# --- the fit ------------------------------------------------------------------------------------

def fit(weights_bytes: int, shape: ModelShape | None, context: int | None,
        budget: int | None, *, backend: str, device: str | None) -> Fit:
    """:func:`localrun.memory.fit` on ``backend``'s own memory row on ``device``."""
    return memory.fit(weights_bytes, shape, context, budget,
                      engine=engine_memory(backend, device))


def _option(c: Candidate, f: Fit) -> QuantOption:
    return QuantOption(c.listing.repo, c.quant, c.weights_bytes, f.estimate.total_bytes,
                       f.fits, c.listing.revision, c.subfolder)


def choose(r: ModelRef, backend: str, fmt: str, cands: list[Candidate], base: str | None,
           budget: int | None, context: int | None, reasons: list[str], *,
           explicit: bool, why: str | None = None, device: str | None = None) -> Download:
    """The variant nearest the format's default quality (``explicit``: the one asked
    for) that fits; the shape is read once, from the first variant whose weights fit."""
    target = DEFAULT_TARGET.get(fmt, 4.0)
    own = (base or cands[0].listing.repo).split("/")[0]
    repo_order = {c.listing.repo: i for i, c in enumerate(
        sorted(cands, key=lambda c: trust_rank(c.listing.repo, own)))}

    def key(c: Candidate) -> tuple[float, float, bool, int, float]:
        dist = -c.bpw if math.isinf(target) else abs(c.bpw - target)
        return (round(dist, 2), c.penalty, not c.pinned, repo_order[c.listing.repo], -c.bpw)

    ordered = sorted(cands, key=key)
    shape: ModelShape | None = None
    shape_read = False
    options: list[QuantOption] = []
    chosen: tuple[Candidate, Fit] | None = None
    for c in ordered:
        bare = fit(c.weights_bytes, None, context, budget, backend=backend, device=device)
        if not bare.fits:
            # The weights alone do not fit: no need to read anything more.
            options.append(_option(c, bare))
            continue
        if not shape_read:
            shape, shape_read = read_shape(c), True
        f = fit(c.weights_bytes, shape, context, budget, backend=backend, device=device)
        options.append(_option(c, f))
        if f.fits and chosen is None:
            chosen = (c, f)
            if budget is None:
                break
    if chosen is None:
        # Nothing fits: report the smallest (explicit: the one asked for) with its numbers.
        c = ordered[0] if explicit else min(ordered, key=lambda c: c.weights_bytes)
        chosen = (c, fit(c.weights_bytes, shape, context, budget, backend=backend,
                         device=device))
    cand, f = chosen
    lst = cand.listing
    reasons.append(f"chose {cand.label}" + (
        f" ({why})" if why else " (asked for)" if explicit
        else f" (default quality {fmt_target(fmt)}, nearest that fits)"))
    if shape is None:
        reasons.append("KV cache size unknown (no GGUF header or config.json read)")
    if lst.gated and huggingface_hub.get_token() is None:
        reasons.append(f"{lst.repo} is gated: set HF_TOKEN after accepting its licence")
    files = tuple(_with_cache_state(lst, lst.files[name]) for name in cand.files)
    return Download(
        ref=r.raw, source="cache" if lst.source == "cache" else "hub", format=fmt,
        backend=backend, repo=lst.repo, revision=lst.revision, commit=lst.commit,
        quant=cand.quant, subfolder=cand.subfolder, files=files, primary=cand.primary,
        local_path=None, memory=f.estimate, budget_bytes=budget, context=f.context,
        max_context=f.max_context, fits=f.fits, options=tuple(options),
        reasons=tuple(reasons), gated=lst.gated)


def _with_cache_state(lst: Listing, f: PlannedFile) -> PlannedFile:
    if f.cached or lst.commit is None:
        return f
    hit = huggingface_hub.try_to_load_from_cache(lst.repo, f.path, cache_dir=cache_dir(),
                                                 revision=lst.commit)
    return replace(f, cached=isinstance(hit, str))


# --- models that need no download ------------------------------------------------------------

def plan_local(r: ModelRef, backend: str, fmt: str, quant: str | None, budget: int | None,
               context: int | None, device: str | None = None) -> Download | None:
    """Models that need no download: local paths, the packaged default, Ollama, LM Studio."""
    found = _find_local(r, fmt, quant)
    if found is None:
        return None
    model, source = found
    if model.format != fmt:
        compat.check(model.format, backend, model=r.raw)
    shape = None
    if model.format == "gguf":
        try:
            shape = shape_from_gguf_head(file_reader(model.path))
        except OSError:
            shape = None
    f = fit(model.size, shape, context, budget, backend=backend, device=device)
    return Download(
        ref=r.raw, source=source, format=model.format, backend=backend, repo=model.repo,
        revision=None, commit=None, quant=model.quant, subfolder=None, files=(),
        primary=None, local_path=model.path, memory=f.estimate, budget_bytes=budget,
        context=f.context, max_context=f.max_context, fits=f.fits,
        reasons=(f"found in place ({source}): {model.path}",))


def _find_local(r: ModelRef, fmt: str, quant: str | None) -> tuple[StoredModel, Source] | None:
    """The model ``r`` names on this machine outside the HF cache, and where it is."""
    if r.kind in ("path", "default"):
        from localrun.formats.detect import detect, folder_bytes
        from localrun.naming.stores import default_model_path

        p = r.path if r.kind == "path" else default_model_path()
        assert p is not None
        d = detect(p)
        size = folder_bytes(p)
        return StoredModel(r.raw, d.path, d.format, d.quantization, size, "default"), "local"
    if r.kind == "ollama":
        found = find_ollama(r.alias or "")
        if found is None:
            raise HubNotFoundError(f"ollama:{r.alias}", hint=f"ollama pull {r.alias}")
        return found, "ollama"
    if r.kind == "lmstudio":
        found = find_lmstudio(r.repo or "", quant)
        if found is None:
            raise HubNotFoundError(f"lmstudio:{r.repo}", hint="download it in LM Studio, or "
                                   f"localrun pull {r.repo}")
        return found, "lmstudio"
    if fmt == "gguf" and r.kind == "alias" and r.alias:
        hit = find_ollama(r.alias)
        if hit is not None and (quant is None or (hit.quant or "").lower() == quant.lower()):
            return hit, "ollama"
    elif fmt == "gguf" and r.kind == "repo" and r.repo and r.revision is None:
        hit = find_lmstudio(r.repo, quant)
        if hit is not None:
            return hit, "lmstudio"
    return None


def pulled_paths(model: str) -> list[Path]:
    """What earlier downloads of ``model`` (this name, for any engine) left in the cache:
    the GGUF file, or the variant's folder; read offline to size the model for another
    engine or machine (:func:`localrun.planning.plan.plan`)."""
    from localrun.errors import LocalrunError
    from localrun.hub import pulls
    from localrun.hub.listing import cached_repos, record_listing, record_name, records
    from localrun.naming.refs import parse_ref

    try:
        name = record_name(parse_ref(model))
    except LocalrunError:
        return []
    found = pulls.find(records(), name) if name else []
    cached = cached_repos() if found else {}
    out: list[Path] = []
    for rec in found:
        lst = record_listing(rec, cached)
        if lst is None or lst.snapshot is None:
            continue
        folder = lst.snapshot / rec.subfolder if rec.subfolder else lst.snapshot
        out.append(folder / rec.primary if rec.primary else folder)
    return out
