"""Planning a Hub name: the repo it names or the variants of its base model (catalog
entries, the Hub's model tree), the one that fits, or offline what an earlier download of
the name fetched. :func:`plan_fetch` is the entry point; :class:`_Planner` holds one
call's state (online or from the cache, the reasons shown with the plan)."""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

import httpx2
import huggingface_hub
from huggingface_hub import constants
from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

from localrun.backends import BACKENDS, canonical_backend, compat
from localrun.errors import (
    HubNotFoundError,
    ModelGatedError,
    NoVariantError,
    OfflineMissingError,
)
from localrun.hub import pulls
from localrun.hub.chosen import Download
from localrun.hub.client import api, unreachable
from localrun.hub.fit import choose, plan_local
from localrun.hub.listing import (
    Listing,
    cache_listing,
    cached_repos,
    has_weights,
    hub_listing,
    record_listing,
    record_name,
    records,
)
from localrun.hub.variants import (
    BPW_BRANCH,
    Candidate,
    candidate_repos,
    keep_model_size,
    model_size,
    names_a_variant,
    quant_matches,
    repo_format,
    unusable,
    variant_candidates,
)
from localrun.naming.catalog import CatalogEntry, Variant
from localrun.naming.refs import ModelRef, as_catalog_alias, default_serves, parse_ref

#: The engine a plan is made for when the caller names none (until selection decides).
DEFAULT_BACKEND = "llama.cpp"
#: Hub repos examined per discovery (the search returns more).
MAX_DISCOVERED = 8


def default_backend() -> str:
    """The backend ``localrun pull`` plans for without --backend."""
    return DEFAULT_BACKEND


def plan_fetch(
    ref: str | ModelRef,
    *,
    backend: str | None = None,
    format: str | None = None,
    memory_budget_bytes: int | None = None,
    context: int | None = None,
    quant: str | None = None,
    device: str | None = None,
    allow_unoptimized: bool = False,
) -> Download:
    """Plan what to download for ``ref`` on ``backend``, before downloading anything.

    ``ref``: anything :func:`localrun.naming.refs.parse_ref` accepts. ``backend``: the engine
    (default :func:`default_backend`); ``format``: override the format it wants (default:
    the engine's native one). ``memory_budget_bytes``: free VRAM / unified memory / RAM;
    None skips the fit check. ``context``: tokens of KV cache to plan for, as the engines
    load it (:func:`localrun.memory.context_window`: at most the trained context; default
    the trained context up to 8192, or 8192 when the model does not say).
    ``quant``: a tag overriding the one in ``ref``.
    ``device``: "cpu", "cuda", "npu", "GPU.0", … (chooses among ONNX/OpenVINO device
    variants).

    Network use: Hub API calls (model info, file tree, refs, search) and, only once the
    weights fit the budget, a small read of the model's header or config.json for the
    KV-cache size. Offline (``HF_HUB_OFFLINE=1`` or the Hub unreachable) a name that was
    downloaded before is planned from what that download fetched, else from the cache.
    Raises UnknownModelError, HubNotFoundError, NoVariantError, FormatMismatchError,
    OfflineMissingError. A plan that does not fit is returned with ``fits=False`` (call
    ``require_fit()`` to refuse).
    """
    r = ref if isinstance(ref, ModelRef) else parse_ref(ref)
    name = canonical_backend(backend or default_backend())
    fmt = format or BACKENDS[name].formats[0]
    want_quant = quant or r.quant
    if r.kind == "default" and not default_serves(want_quant):
        r = as_catalog_alias(r)  # e.g. smollm2:135m --quant Q8_0: the alias, on the Hub

    local = plan_local(r, name, fmt, want_quant, memory_budget_bytes, context, device)
    if local is not None:
        return local
    planner = _Planner(r, name, fmt, want_quant, device, memory_budget_bytes, context,
                       allow_unoptimized)
    return replace(planner.plan(), asked_quant=want_quant)


class _Planner:
    """One :func:`plan_fetch` call for a Hub name: its state (online, or planning from the
    cache once the Hub is out of reach), the reasons shown with the plan, and its steps."""

    def __init__(self, r: ModelRef, backend: str, fmt: str, want_quant: str | None,
                 device: str | None, budget: int | None, context: int | None,
                 allow_unoptimized: bool) -> None:
        self.r = r
        self.backend = backend
        self.fmt = fmt
        self.want_quant = want_quant
        self.device = device
        self.budget = budget
        self.context = context
        self.allow_unoptimized = allow_unoptimized
        self.reasons: list[str] = []
        self.failures: dict[str, str] = {}  # repo (or repo@branch) -> why it was passed over
        self.offline_reason = ("HF_HUB_OFFLINE=1 is set" if constants.HF_HUB_OFFLINE
                               else unreachable())
        self.cached: dict[str, Any] = cached_repos() if self.offline_reason else {}
        self.pins: dict[str, Variant] = {}  # repo (lower case) -> its catalog entry
        self.passed: list[str] = []  # what was passed over, and why

    def note(self, line: str) -> None:
        """A reason that says what was passed over; it also goes with a NoVariantError
        (``passed_over``), so that an engine fallback can show why."""
        self.reasons.append(line)
        self.passed.append(line)

    def no_variant(self, fmt: str, tried: list[str], hint: str | None = None) -> NoVariantError:
        err = NoVariantError(self.r.raw, format=fmt, backend=self.backend, tried=tried,
                             hint=hint)
        err.passed_over = tuple(self.passed)
        return err

    # -- steps ------------------------------------------------------------------------------

    def plan(self) -> Download:
        if self.offline_reason:
            recorded = self.from_records()
            if recorded is not None:
                return recorded
        try:
            return self.search()
        except OfflineMissingError:
            # The Hub went out of reach half way: an earlier download of this name may do.
            recorded = self.from_records() if self.offline_reason else None
            if recorded is None:
                raise
            return recorded

    def listing(self, repo: str, revision: str | None) -> Listing | None:
        """The repo's files at ``revision`` from the Hub, or from the cache when offline.
        A repo other than the one the user named that the Hub refuses is None, with
        the reason kept in ``failures``."""
        if self.offline_reason is None:
            try:
                return hub_listing(repo, revision)
            except HubNotFoundError as e:
                if repo == self.r.repo:
                    raise
                where = f"{repo}@{revision}" if revision else repo
                self.failures[where] = ("is not on the Hub (404)" if e.revision is None
                                        else f"has no branch {revision!r} on the Hub")
                return None
            except ModelGatedError:
                if repo == self.r.repo:
                    raise
                self.failures[repo] = "is gated (401: accept its licence and set HF_TOKEN)"
                return None
            except (httpx2.ConnectError, httpx2.TimeoutException, OfflineModeIsEnabled) as e:
                self.offline_reason = f"the Hub cannot be reached ({type(e).__name__})"
                self.cached = cached_repos()
        return cache_listing(repo, revision, self.cached)

    def search(self) -> Download:
        """Plan from the Hub (or the cache): the named repo, or the variants of a base."""
        r = self.r
        if r.kind == "repo":
            listings, base = self.named_repo()
        else:  # alias
            entry = r.entry
            assert entry is not None
            listings, base = [], entry.base
            self.reasons.append(f"alias {r.alias} is {entry.base}")
        if base is not None:
            listings = self.variant_listings(base, r.entry or entry_for(base))
        return self.choose(listings, base)

    def named_repo(self) -> tuple[list[Listing], str | None]:
        """A repo id: the variant it is itself (its listings and no base), or an original
        model whose variants are looked for (no listings; it is the base)."""
        r = self.r
        assert r.repo is not None
        first = self.listing(r.repo, r.revision)
        if first is None:
            # Offline and not cached. A base model's own repo is rarely downloaded:
            # its variants in the cache (e.g. pulled by an older localrun) may do.
            if not (self.offline_reason and r.revision is None
                    and not names_a_variant(r.repo)):
                raise OfflineMissingError(r.raw, [f"{r.repo}@{r.revision or 'main'}"],
                                          reason=self.offline_reason or "not cached")
            self.reasons.append(f"{r.repo} is not in the cache: looking for its "
                                f"{self.fmt} variants there")
            return [], r.repo
        own_fmt = repo_format(first)
        if own_fmt == "hf" and not (first.config or {}).get("quantization_config"):
            self.reasons.append(f"{r.repo} is the original model; looking for its "
                                f"{self.fmt} variants")
            return [], r.repo
        # The repo is itself a variant: its format decides.
        if own_fmt != self.fmt:
            compat.check(own_fmt, self.backend, model=r.repo,
                         allow_unoptimized=self.allow_unoptimized)
            self.fmt = own_fmt
        listings = [first]
        if self.fmt in ("exl2", "exl3") and r.revision is None:
            listings = self.exl_branches(first)
        self.reasons.append(f"{r.repo} is a {self.fmt} repo")
        return listings, None

    def variant_listings(self, base: str, entry: CatalogEntry | None) -> list[Listing]:
        """The repos holding ``base`` in the wanted format: catalog entries and the Hub's
        model tree. A catalog entry the Hub refuses or that holds no usable weights is
        passed over with one line, never the end of the plan."""
        fmt = self.fmt
        self.pins = {v.repo.lower(): v for v in reversed(entry.variants_for(fmt))} \
            if entry else {}
        repos = candidate_repos(base, fmt, entry, search=not self.offline_reason)
        if self.offline_reason:
            stem = base.split("/")[-1].lower()
            repos += [rid for rid in self.cached if stem in rid.lower() and rid not in repos]
        listings = [lst for rid in repos[:MAX_DISCOVERED] for lst in self.repo_variants(rid)]
        # The original's own safetensors: what an engine that wants them (vLLM) runs, or
        # one that merely loads them (allowed). Offline, the cache step below has them.
        runs_hf = fmt == "hf" or (compat.support("hf", self.backend) == "loads"
                                  and self.allow_unoptimized)
        if not listings and self.offline_reason is None and runs_hf:
            base_lst = self.listing(base, self.r.revision)
            if base_lst is not None and repo_format(base_lst) == "hf":
                listings.append(base_lst)
                self.fmt = "hf"
                self.reasons.append(f"{base} is the {compat.title('hf')} model "
                                    f"{self.backend} runs as it is")
        if not listings:
            if self.offline_reason:
                raise OfflineMissingError(
                    self.r.raw, [f"any {fmt} variant of {base}"
                                 + (f" (e.g. {', '.join(repos[:3])})" if repos else "")],
                    reason=self.offline_reason)
            raise self.no_variant(fmt, repos or [base])
        return self.without_gated(listings)

    def repo_variants(self, rid: str) -> list[Listing]:
        """The listings of one candidate repo that hold usable weights in the wanted
        format (EXL: one per bpw branch); a catalog entry that does not says so."""
        fmt = self.fmt
        pin = self.pins.get(rid.lower())
        lst = self.listing(rid, None)
        if lst is None:
            if pin is not None and rid in self.failures:
                self.note(f"catalog entry {rid} {self.failures[rid]}: passed over; "
                          "the Hub's model tree is searched instead")
            return []
        told = pin is not None and lst.source == "hub"  # a catalog entry the Hub disowns
        own = repo_format(lst)
        if own != fmt:
            if told:
                self.note(
                    f"catalog entry {rid} holds no {compat.title(fmt)} weights on "
                    f"{lst.revision} (its files look like {compat.title(own)}): passed over")
            return []
        why = unusable(lst, fmt)
        if why is not None:
            if told:
                self.note(f"catalog entry {rid} {why}: passed over (no usable "
                          f"{compat.title(fmt)} weights)")
            return []
        if fmt not in ("exl2", "exl3"):
            return [lst]
        branches = self.exl_branches(lst, pin.branch if pin else None)
        if not branches and told:
            assert pin is not None
            self.note(f"catalog entry {pin.where} has no {fmt} weights on any "
                      "branch: passed over")
        return branches

    def without_gated(self, listings: list[Listing]) -> list[Listing]:
        """With no HF token, a gated variant would fail at download: use the open ones."""
        if huggingface_hub.get_token() is not None:
            return listings
        open_ = [lst for lst in listings if not lst.gated]
        gated = sorted({lst.repo for lst in listings if lst.gated})
        if open_ and gated:
            self.note(f"{', '.join(gated)} gated and no HF_TOKEN is set: passed over "
                      "for open variants")
            return open_
        return listings

    def exl_branches(self, first: Listing, pinned: str | None = None) -> list[Listing]:
        """EXL2/EXL3 repos keep each bpw on its own branch (main may hold only a README).
        The catalog's branch is tried too: it works when the Hub lists no refs."""
        out = [first] if BPW_BRANCH.match(first.revision) or has_weights(first) else []
        if first.source == "cache":
            entry = self.cached.get(first.repo) or cached_repos().get(first.repo)
            names = sorted(entry.refs) if entry is not None else []
        else:
            try:
                names = [b.name for b in api().list_repo_refs(first.repo).branches]
            except (HfHubHTTPError, httpx2.HTTPError):
                names = []
        if pinned and pinned not in names:
            names.append(pinned)
        for b in names:
            if b != first.revision and BPW_BRANCH.match(b):
                lst = self.listing(first.repo, b)
                if lst is not None:
                    out.append(lst)
                elif b == pinned and f"{first.repo}@{b}" in self.failures:
                    why = self.failures[f"{first.repo}@{b}"]
                    self.note(f"catalog entry {first.repo}@{b} {why}: passed over")
        return out

    def candidates(self, listings: list[Listing]) -> tuple[list[Candidate], list[str]]:
        """Every variant in ``listings`` (the catalog's own file/folder/branch pinned),
        then only those of the requested model size; also missing shard names."""
        cands: list[Candidate] = []
        missing: list[str] = []
        for lst in listings:
            cs, inc = variant_candidates(lst, self.fmt, self.device)
            cands.extend(self.pin(lst, cs))
            missing.extend(f"{lst.repo}: {m}" for m in inc)
        wanted = model_size(self.r.repo) if self.r.kind == "repo" and self.r.repo else None
        if self.r.kind == "alias" and self.r.entry is not None:
            wanted = model_size(self.r.entry.base)
        cands, lines = keep_model_size(cands, wanted)
        for line in lines:
            self.note(line)
        return cands, missing

    def pin(self, lst: Listing, cands: list[Candidate]) -> list[Candidate]:
        v = self.pins.get(lst.repo.lower())
        if v is None or not cands:
            return cands
        out = [replace(c, pinned=(
            (v.subfolder is None or c.subfolder == v.subfolder)
            and (v.file is None or c.primary == v.file)
            and (v.branch is None or lst.revision == v.branch)
            and bool(v.subfolder or v.file or v.branch))) for c in cands]
        if lst.source == "hub" and not any(c.pinned for c in out):
            if v.subfolder and not any(c.subfolder == v.subfolder for c in cands):
                self.note(f"catalog folder {v.subfolder} is not in {lst.repo}: its other "
                          "variants are candidates")
            elif v.file and not any(c.primary == v.file for c in cands):
                self.note(f"catalog file {v.file} is not in {lst.repo}: its other files "
                          "are candidates")
        return out

    def choose(self, listings: list[Listing], base: str | None) -> Download:
        r, fmt, want_quant = self.r, self.fmt, self.want_quant
        cands, missing = self.candidates(listings)
        if want_quant:
            matching = [c for c in cands if quant_matches(c.quant, c.bpw, fmt, want_quant)]
            if not matching:
                have = sorted({c.quant for c in cands if c.quant})
                if self.offline_reason:
                    raise OfflineMissingError(
                        r.raw, [f"{want_quant} of {r.repo or base}", *missing],
                        reason=self.offline_reason,
                        hint="cached quants: " + (", ".join(have) or "none")
                        + f"; connect and run `localrun pull {r.raw}`")
                raise self.no_variant(
                    fmt, [lst.repo for lst in listings],
                    hint=f"no {want_quant} file; available: {', '.join(have) or 'none'}")
            cands = matching
        if not cands:
            if self.offline_reason:
                raise OfflineMissingError(r.raw, missing or [f"{fmt} files of {r.repo or base}"],
                                          reason=self.offline_reason)
            whys = [f"{lst.repo} {w}" for lst in listings if (w := unusable(lst, fmt))]
            raise self.no_variant(fmt, [lst.repo for lst in listings],
                                  hint="; ".join(whys) + "; name another variant repo, or pick "
                                  "another engine with --backend" if whys else None)
        if self.offline_reason:
            self.reasons.append(f"{self.offline_reason}: planned from the Hugging Face cache")
        return choose(r, self.backend, fmt, cands, base, self.budget, self.context,
                      self.reasons, explicit=bool(want_quant), device=self.device)

    def from_records(self) -> Download | None:
        """Offline: plan what an earlier download of this very name fetched for this
        engine (and quant), if its files are still in the cache."""
        name = record_name(self.r)
        if name is None:
            return None
        recs = pulls.find(records(), name, backend=self.backend)
        if self.want_quant:
            want = pulls.norm_quant(self.want_quant)
            recs = [x for x in recs if want in (pulls.norm_quant(x.quant),
                                                pulls.norm_quant(x.variant_quant))]
        else:
            recs.sort(key=lambda x: x.quant is not None)  # the default choice first
        cached = self.cached or cached_repos()
        for rec in recs:
            lst = record_listing(rec, cached)
            if lst is None:
                continue
            cands = [c for c in variant_candidates(lst, rec.format, self.device)[0]
                     if (c.primary, c.subfolder) == (rec.primary, rec.subfolder)]
            if not cands:
                continue
            when = time.strftime("%Y-%m-%d", time.localtime(rec.pulled_at))
            reasons = [f"{self.offline_reason}: {rec.display} was downloaded for "
                       f"{rec.backend} on {when}; using those files"]
            return choose(self.r, self.backend, rec.format, cands[:1], None, self.budget,
                          self.context, reasons, explicit=True,
                          why="what that download fetched", device=self.device)
        return None


def entry_for(repo: str) -> CatalogEntry | None:
    from localrun.naming import catalog

    return catalog.for_repo(repo)

