"""The built-in alias catalog: short names for popular instruct models (data in catalog.json).

Every repo id in catalog.json carries its evidence (see the file's ``_about``). Entries
marked only by weak evidence ("C") are *unverified*: the Hub planner tries discovery
first and uses them last.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
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
    branch: str | None = None  # the bpw branch (EXL2/EXL3)
    subfolder: str | None = None  # the variant folder (ONNX GenAI)

    @property
    def verified(self) -> bool:
        return self.evidence in VERIFIED_EVIDENCE


@dataclass(frozen=True)
class CatalogEntry:
    alias: str
    base: str  # the original (unquantized) repo
    license: str
    gated: bool
    names: tuple[str, ...]  # other spellings accepted for the alias
    variants: tuple[Variant, ...]

    def variants_for(self, format: str) -> list[Variant]:
        """Known variants in ``format``: verified ones first, in catalog order."""
        found = [v for v in self.variants if v.format == format]
        return [v for v in found if v.verified] + [v for v in found if not v.verified]


def _entry(alias: str, raw: dict[str, Any]) -> CatalogEntry:
    variants = tuple(
        Variant(repo=v["repo"], format=fmt, evidence=v.get("evidence", "C"), file=v.get("file"),
                branch=v.get("branch"), subfolder=v.get("subfolder"))
        for fmt, items in raw.get("variants", {}).items()
        for v in items
    )
    return CatalogEntry(alias=alias, base=raw["base"], license=raw.get("license", ""),
                        gated=bool(raw.get("gated", False)),
                        names=tuple(raw.get("names", ())), variants=variants)


@cache
def entries() -> dict[str, CatalogEntry]:
    """All catalog entries by alias."""
    text = resources.files("localrun").joinpath("catalog.json").read_text(encoding="utf-8")
    data = json.loads(text)
    return {alias: _entry(alias, raw) for alias, raw in data["models"].items()}


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


def names() -> list[str]:
    """Every accepted alias spelling, for suggestions."""
    return sorted(_index())
