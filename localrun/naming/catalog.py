"""The built-in alias catalog: short names for popular instruct models (data in catalog.json).

Every repo id in catalog.json carries its evidence (see the file's ``_about``). Entries
marked only by weak evidence ("C") are *unverified*: the Hub planner tries discovery
first and uses them last. A file or branch seen only in weaker evidence than its repo
carries its own mark (``file_evidence`` / ``branch_evidence``). Ids that the evidence
showed to be wrong are kept under ``_rejected`` so that they are not added back.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cache
from importlib import resources
from typing import Any

#: Evidence marks that count as verified (see ../shared/docs/catalog-sources.md).
VERIFIED_EVIDENCE = frozenset({"V", "R"})


@dataclass(frozen=True)
class Variant:
    """One known repo holding the model in one format."""

    repo: str
    format: str
    evidence: str
    file: str | None = None  # the Q4_K_M file, when known (GGUF)
    branch: str | None = None  # the bpw branch (EXL2/EXL3): the weights are not on main
    subfolder: str | None = None  # the variant folder (ONNX GenAI, multi-model repos)
    file_evidence: str | None = None  # the file's or branch's own mark, when weaker
    branch_evidence: str | None = None
    note: str = ""

    @property
    def verified(self) -> bool:
        return self.evidence in VERIFIED_EVIDENCE

    @property
    def where(self) -> str:
        """The repo with its branch and subfolder, as a label."""
        return (self.repo + (f"@{self.branch}" if self.branch else "")
                + (f"/{self.subfolder}" if self.subfolder else ""))


@dataclass(frozen=True)
class CatalogEntry:
    alias: str
    base: str  # the original (unquantized) repo
    license: str
    gated: bool
    names: tuple[str, ...]  # other spellings accepted for the alias
    variants: tuple[Variant, ...]
    #: the sampling its model card recommends, applied where the files say nothing
    sampling: Mapping[str, Any] = field(default_factory=dict)
    #: names the model goes by inside files (GGUF general.name, config.json
    #: _name_or_path) beyond its repo names, e.g. a training-run name
    model_names: tuple[str, ...] = ()
    #: parameters in billions, for entries whose names do not say (``phi4-mini``); a
    #: plan made without the Hub sizes the model from it
    params_b: float | None = None
    #: how the model thinks (a format of :data:`localrun.reasoning.FORMATS`), used where
    #: its chat template does not say; None: it does not think
    reasoning: str | None = None
    #: the alias of a smaller model of the same family and tokenizer that drafts for it
    #: (speculative decoding, ``load(draft_model=...)``); None: the family has none
    draft: str | None = None

    def variants_for(self, format: str) -> list[Variant]:
        """Known variants in ``format``: verified ones first, in catalog order."""
        found = [v for v in self.variants if v.format == format]
        return [v for v in found if v.verified] + [v for v in found if not v.verified]


def _entry(alias: str, raw: dict[str, Any]) -> CatalogEntry:
    variants = tuple(
        Variant(repo=v["repo"], format=fmt, evidence=v.get("evidence", "C"), file=v.get("file"),
                branch=v.get("branch"), subfolder=v.get("subfolder"),
                file_evidence=v.get("file_evidence"), branch_evidence=v.get("branch_evidence"),
                note=v.get("note", ""))
        for fmt, items in raw.get("variants", {}).items()
        for v in items
    )
    return CatalogEntry(alias=alias, base=raw["base"], license=raw.get("license", ""),
                        gated=bool(raw.get("gated", False)),
                        names=tuple(raw.get("names", ())), variants=variants,
                        sampling=dict(raw.get("sampling", {})),
                        model_names=tuple(raw.get("model_names", ())),
                        params_b=raw.get("params_b"), reasoning=raw.get("reasoning"),
                        draft=raw.get("draft"))


@cache
def _data() -> dict[str, Any]:
    text = resources.files("localrun.naming").joinpath("catalog.json").read_text(encoding="utf-8")
    data = json.loads(text)
    assert isinstance(data, dict)
    return data


@cache
def entries() -> dict[str, CatalogEntry]:
    """All catalog entries by alias."""
    return {alias: _entry(alias, raw) for alias, raw in _data()["models"].items()}


def rejected() -> dict[str, str]:
    """Repo ids the evidence showed to be wrong (id -> why); never catalog variants."""
    return {r["repo"]: r["why"] for r in _data().get("_rejected", [])}


@cache
def _index() -> dict[str, CatalogEntry]:
    idx: dict[str, CatalogEntry] = {}
    for e in entries().values():
        for name in (e.alias, *e.names):
            idx[name.lower()] = e
    return idx


def lookup(name: str) -> CatalogEntry | None:
    """The entry for an alias or one of its other spellings (case-insensitive)."""
    return _index().get(name.strip().lower())


def for_repo(repo: str) -> CatalogEntry | None:
    """The entry whose base repo or one of whose variants is ``repo``."""
    key = repo.lower()
    for e in entries().values():
        if e.base.lower() == key or any(v.repo.lower() == key for v in e.variants):
            return e
    return None


def _norm(name: str) -> str:
    return re.sub(r"[^a-z0-9.]+", "-", name.lower()).strip("-")


def for_model_name(name: str) -> CatalogEntry | None:
    """The entry a model name found in files denotes: a repo id (``org/name``, a Hub URL)
    of its base or a variant, or the base's own name however spelled (``SmolLM2 135M
    Instruct`` = ``SmolLM2-135M-Instruct``), or one of its ``model_names``. Exact
    matches only: ``SmolLM2-135M`` (the base model) is not ``SmolLM2-135M-Instruct``."""
    name = re.sub(r"^https?://(www\.)?huggingface\.co/", "", name.strip()).strip("/")
    if not name:
        return None
    if name.count("/") == 1:
        found = for_repo(name)
        if found is not None:
            return found
    key = _norm(name)
    for e in entries().values():
        spellings = (e.base.split("/")[-1], *(v.repo.split("/")[-1] for v in e.variants),
                     *e.model_names)
        if any(_norm(s) == key for s in spellings):
            return e
    return None


def names() -> list[str]:
    """Every accepted alias spelling, for suggestions."""
    return sorted(_index())
