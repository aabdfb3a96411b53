"""Presets: a model under a name of the user's own, with its system prompt and defaults.

``localrun create mybot --from qwen2.5:7b --system "..." --temperature 0.2 --context 16384``
(or ``-f FILE``, :mod:`localrun.naming.presetfile`) saves a preset; then ``mybot`` works wherever
a model name does: ``localrun run/chat/generate/plan/serve mybot``, ``localrun.load("mybot")``
(:func:`lookup` is called by ``load()`` and ``plan()``). The preset's model loads with its
context, engine and adapters; its sampling values become the model's defaults, between
the caller's values (which win) and the model's own; its system prompt (and example
messages) open every conversation whose caller gives no system prompt. Ollama's
Modelfiles and ``ollama create`` are the model.

Where: ``presets.json`` in localrun's home (``$LOCALRUN_HOME``, else the ``localrun``
folder next to the Hugging Face cache, beside ``pulls.json``), one file for all presets,
written atomically under a lock file (as :mod:`localrun.hub.pulls`). Entries this version
cannot read are kept as they are. A damaged file is reported, never overwritten.

Names: letters, digits, ``.``, ``_``, ``-``, with an optional ``:tag`` (``mybot``,
``coder:16k``), case-insensitive. A name that already means something is refused: a
catalog alias, the embedded model's names, a Hub repo id or any ``org/name`` shape, a
path (``./x``, ``~/x``, ``x.gguf``, a file or folder of that name here), a store prefix
(``ollama:``, ``lmstudio:``). A preset made ``--from`` another preset copies it (one
level: the new one holds the model and the values, so no chain or cycle can form).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from localrun.adapters import MAX_SCALE, SCALE_ALLOWED, Adapter
from localrun.errors import InvalidModelNameError, LocalrunError, UnknownModelError
from localrun.sharedfile import locked, write_atomic

if TYPE_CHECKING:
    from localrun.batch import BatchInput
    from localrun.types import Message

FILE_NAME = "presets.json"
VERSION = 1
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(?::[A-Za-z0-9][A-Za-z0-9._-]*)?$")
MAX_NAME = 64
#: Roles a preset's example messages (MESSAGE) may have: the system prompt is SYSTEM.
MESSAGE_ROLES = ("user", "assistant")
_STORE_PREFIXES = ("ollama:", "lmstudio:", "hf.co", "huggingface.co", "http:", "https:", "hf:")


class PresetError(LocalrunError, ValueError):
    """A preset that cannot be made, read or used; the message names it and why."""


class PresetNotFoundError(PresetError, LookupError):
    """No preset of this name."""

    def __init__(self, name: str, known: Sequence[str] = ()):
        self.name = name
        shown = f" (presets: {', '.join(known[:8])})" if known else " (there are none yet)"
        super().__init__(f"No preset named {name!r}{shown}",
                         hint="localrun list shows presets and models; localrun create NAME "
                         "--from MODEL makes one")


@dataclass(frozen=True)
class Preset:
    """A saved preset. ``sampling`` holds the sampling options it sets (validated, in
    ``localrun.sampling``'s names); unset fields are None or empty."""

    name: str
    model: str  # what it is made from: a name or an absolute path (never another preset)
    system: str | None = None
    sampling: Mapping[str, Any] = field(default_factory=dict)
    context: int | None = None
    backend: str | None = None  # canonical engine name; None: auto
    allow_unoptimized: bool = False
    adapters: tuple[Adapter, ...] = ()
    messages: tuple[tuple[str, str], ...] = ()  # (role, content) opening every chat
    created_at: float = 0.0
    exact: bool = False  # load(exact=True): README, "Speed"

    # -- what a preset does to a load and a conversation ----------------------------

    def load_args(self, backend: str, context: int | None, allow_unoptimized: bool
                  ) -> tuple[str, str, int | None, bool]:
        """``load()``'s model, backend, context and allow_unoptimized for this preset: the
        caller's backend and context win over the preset's (its :attr:`adapters` load
        with the model: ``load()`` and the server read them)."""
        chosen = backend if backend != "auto" or not self.backend else self.backend
        return (self.model, chosen, context if context is not None else self.context,
                allow_unoptimized or self.allow_unoptimized)

    def conversation(self, messages: list[Message]) -> list[Message]:
        """``messages`` opened by the preset's system prompt (unless the caller gave one)
        and its example messages."""
        if not self.system and not self.messages:
            return messages
        lead = 0  # the caller's opening system message(s)
        while lead < len(messages) and messages[lead].get("role") == "system":
            lead += 1
        if any(m.get("role") == "system" for m in messages):
            head = messages[:lead]
        else:
            head = [{"role": "system", "content": self.system}] if self.system else []
        examples: list[Message] = [{"role": r, "content": c} for r, c in self.messages]
        return [*head, *examples, *messages[lead:]]

    def batch_items(self, items: Iterable[BatchInput]) -> Iterator[BatchInput]:
        """Batch inputs with :meth:`conversation` applied to each chat item (raw ones stay)."""
        from localrun.batch import BatchItem
        from localrun.templates import normalize_messages

        for item in items:
            if isinstance(item, BatchItem):
                if not item.raw:
                    yield replace(item, input=self.conversation(normalize_messages(item.input)))
                else:
                    yield item
            else:
                yield self.conversation(normalize_messages(item))

    # -- as data ----------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "from": self.model}
        if self.system is not None:
            out["system"] = self.system
        if self.sampling:
            out["parameters"] = {k: list(v) if k == "stop" else v
                                 for k, v in self.sampling.items()}
        if self.context is not None:
            out["context"] = self.context
        if self.backend is not None:
            out["backend"] = self.backend
        if self.allow_unoptimized:
            out["allow_unoptimized"] = True
        if self.exact:
            out["exact"] = True
        if self.adapters:
            out["adapters"] = [{"path": a.path, "scale": a.scale,
                                **({"name": a.name} if a.name else {})}
                               for a in self.adapters]
        if self.messages:
            out["messages"] = [{"role": r, "content": c} for r, c in self.messages]
        out["created_at"] = self.created_at
        return out

    @classmethod
    def from_json(cls, d: Any) -> Preset:
        """A stored entry; PresetError when it is not one this version can use."""
        try:
            name, model = d["name"], d["from"]
            if not (isinstance(name, str) and isinstance(model, str)):
                raise TypeError
            return make(name, model, system=d.get("system"),
                        sampling=d.get("parameters") or {}, context=d.get("context"),
                        backend=d.get("backend"),
                        allow_unoptimized=d.get("allow_unoptimized") is True,
                        exact=d.get("exact") is True,
                        adapters=[Adapter(a["path"], a.get("scale", 1.0), a.get("name"))
                                  for a in d.get("adapters") or ()],
                        messages=[(m["role"], m["content"]) for m in d.get("messages") or ()],
                        created_at=float(d.get("created_at") or 0.0), check_refs=False)
        except (KeyError, TypeError, AttributeError, ValueError, LocalrunError) as e:
            if isinstance(e, PresetError):
                raise
            raise PresetError(f"A stored preset is not readable: {str(d)[:120]}",
                              hint=f"remove or fix it in {presets_path()}") from None


# -- names --------------------------------------------------------------------------

def shadowed(name: str) -> str | None:
    """Why ``name`` cannot be a preset's (what it already means), or None if it can."""
    from localrun.naming.refs import DEFAULT_NAMES, parse_ref

    low = name.strip().lower()
    if not name.strip():
        return "it is empty"
    if len(name) > MAX_NAME:
        return f"it is {len(name)} characters long (at most {MAX_NAME})"
    if low.startswith(_STORE_PREFIXES):
        return "it names a model in another store or on the Hub"
    if "/" in name or "\\" in name:
        return ("it has the shape of a Hub repo id (org/name)" if not
                name.startswith((".", "/", "~")) else "it is a path")
    if name.startswith((".", "~")) or low.endswith(".gguf"):
        return "it is a path"
    if low in DEFAULT_NAMES:
        return "it is a name of the embedded default model"
    try:
        ref = parse_ref(name)
    except (UnknownModelError, InvalidModelNameError):
        if not NAME_RE.match(name):
            return ("it may hold only letters, digits, '.', '_' and '-', with one optional "
                    "':tag' (e.g. mybot, coder:16k)")
        return None
    if ref.kind == "path":
        return "a file or folder of that name is in the current folder"
    if ref.kind == "alias":
        return f"it is the catalog alias of {ref.entry.base if ref.entry else ref.alias}"
    return f"it already names a model ({ref.kind})"


def check_name(name: str) -> None:
    why = shadowed(name)
    if why is not None:
        raise PresetError(f"Cannot name a preset {name!r}: {why}",
                          hint="pick a name of your own, e.g. mybot or coder:16k "
                          "(localrun list shows the names in use)")


def could_be(name: str | None) -> bool:
    """Whether ``name`` has a preset name's shape (no I/O): the cheap test before a
    lookup, so paths and Hub ids never read the presets file."""
    from localrun.naming.refs import DEFAULT_NAMES

    return (isinstance(name, str) and 0 < len(name) <= MAX_NAME and bool(NAME_RE.match(name))
            and not name.lower().endswith(".gguf") and name.lower() not in DEFAULT_NAMES)


# -- making one -------------------------------------------------------------------------

def make(
    name: str,
    model: str,
    *,
    system: str | None = None,
    sampling: Mapping[str, Any] | None = None,
    context: int | None = None,
    backend: str | None = None,
    allow_unoptimized: bool = False,
    adapters: Sequence[Adapter] = (),
    messages: Sequence[tuple[str, str]] = (),
    created_at: float | None = None,
    exact: bool = False,
    check_refs: bool = True,
) -> Preset:
    """A validated Preset. ``check_refs``: also check that the name is free, that
    ``model`` names a model (a preset there is copied, one level) and that adapter files
    exist; off for entries read back from the file."""
    from localrun.sampling import SAMPLING_OPTIONS, make_sampling

    if check_refs:
        check_name(name)
    if not isinstance(model, str) or not model.strip():
        raise PresetError(f"Preset {name!r} names no model to make it from",
                          hint=f"localrun create {name} --from MODEL")
    values = dict(sampling or {})
    unknown = sorted(set(values) - set(SAMPLING_OPTIONS))
    if unknown:
        raise PresetError(f"Preset {name!r}: {unknown[0]!r} is not a sampling option",
                          hint="use " + ", ".join(SAMPLING_OPTIONS))
    checked = make_sampling(**values)  # InvalidSamplingError names the option and range
    values = {k: getattr(checked, k) for k in values if getattr(checked, k) is not None}
    if "stop" in values:
        values["stop"] = tuple(values["stop"])
    if context is not None and (isinstance(context, bool) or not isinstance(context, int)
                                or context < 16):
        raise PresetError(f"Preset {name!r}: invalid context {context!r}",
                          hint="a number of tokens >= 16, e.g. --context 8192")
    if backend is not None:
        from localrun.backends import canonical_backend

        backend = None if backend.strip().lower() == "auto" else canonical_backend(backend)
    if system is not None and not isinstance(system, str):
        raise PresetError(f"Preset {name!r}: the system prompt is not text")
    for role, content in messages:
        if role not in MESSAGE_ROLES or not isinstance(content, str):
            raise PresetError(f"Preset {name!r}: a message's role is {role!r}",
                              hint="example messages are user or assistant turns; the "
                              "system prompt is SYSTEM (--system)")
    for a in adapters:
        if isinstance(a.scale, bool) or not (isinstance(a.scale, (int, float))
                                             and math.isfinite(a.scale)
                                             and abs(a.scale) <= MAX_SCALE):
            raise PresetError(f"Preset {name!r}: adapter scale {a.scale!r} is out of range",
                              hint="write PATH:SCALE with SCALE " + SCALE_ALLOWED)
    preset = Preset(name, model, system, values, context, backend, bool(allow_unoptimized),
                    tuple(Adapter(a.path, float(a.scale), a.name) for a in adapters),
                    tuple(messages), time.time() if created_at is None else created_at,
                    exact=bool(exact))
    return _checked_refs(preset) if check_refs else preset


def _checked_refs(p: Preset) -> Preset:
    """The model reference read (a preset there copied), adapter files made absolute."""
    from localrun.naming.refs import parse_ref

    base = get(p.model) if could_be(p.model) else None
    if base is not None:
        p = replace(p, model=base.model, system=p.system if p.system is not None
                    else base.system, sampling={**base.sampling, **p.sampling},
                    context=p.context or base.context, backend=p.backend or base.backend,
                    allow_unoptimized=p.allow_unoptimized or base.allow_unoptimized,
                    exact=p.exact or base.exact, adapters=p.adapters or base.adapters,
                    messages=p.messages or base.messages)
    else:
        try:
            ref = parse_ref(p.model)
        except (UnknownModelError, InvalidModelNameError) as e:
            raise PresetError(f"Preset {p.name!r} cannot be made from {p.model!r}: "
                              f"{e.message}", hint=e.hint) from None
        if ref.kind == "path" and ref.path is not None:
            p = replace(p, model=str(ref.path.resolve()))
    adapters = []
    for a in p.adapters:
        path = Path(a.path).expanduser()
        if not path.exists():
            raise PresetError(f"Preset {p.name!r}: no adapter at {a.path}",
                              hint="give the path of a LoRA adapter file or folder")
        adapters.append(Adapter(str(path.resolve()), a.scale, a.name))
    return replace(p, adapters=tuple(adapters))


def parse_adapter(text: str) -> Adapter:
    """``[name=]PATH[:SCALE]`` (:func:`localrun.adapters.parse_adapter`), its errors a
    PresetError's."""
    from localrun.adapters import parse_adapter as parse

    try:
        return parse(text)
    except LocalrunError as e:
        raise PresetError(e.message, hint=e.hint) from None


# -- the file ---------------------------------------------------------------------------

def home_dir() -> Path:
    """localrun's home for its own state: ``$LOCALRUN_HOME``, else the ``localrun``
    folder next to the Hugging Face cache (where the pull records are)."""
    from localrun.hub import pulls

    home = os.environ.get(pulls.HOME_ENV)
    if home:
        return Path(home).expanduser()
    from localrun.hub.client import cache_dir

    return pulls.records_path(cache_dir()).parent


def presets_path() -> Path:
    return home_dir() / FILE_NAME


def _read(path: Path) -> list[dict[str, Any]]:
    """The stored entries as dicts (all of them, readable or not)."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return []
    except OSError as e:
        raise PresetError(f"Cannot read the presets file {path}: {e.strerror or e}",
                          hint="make it readable, or set LOCALRUN_HOME to another folder"
                          ) from None
    try:
        data = json.loads(text)
    except ValueError as e:
        raise PresetError(f"The presets file {path} is damaged: {e}",
                          hint="fix the JSON, or move the file away to start over") from None
    items = data.get("presets") if isinstance(data, dict) else None
    if not isinstance(items, list):
        raise PresetError(f"The presets file {path} holds no preset list",
                          hint="fix it, or move it away to start over")
    return [d for d in items if isinstance(d, dict)]


def _key(d: Mapping[str, Any]) -> str:
    name = d.get("name")
    return name.lower() if isinstance(name, str) else ""


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Serialize read-modify-write between processes (two creates at once)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise PresetError(f"Cannot create localrun's home {path.parent}: {e.strerror or e}",
                          hint="set LOCALRUN_HOME to a writable folder") from None
    with locked(path):
        yield


def _write(path: Path, entries: list[dict[str, Any]]) -> None:
    body = json.dumps({"version": VERSION, "presets": entries}, indent=1, ensure_ascii=False)
    try:
        write_atomic(path, body + "\n")
    except OSError as e:
        raise PresetError(f"Cannot write {path}: {e.strerror or e}",
                          hint="free some space, make its folder writable, or set "
                               "LOCALRUN_HOME to another folder") from None


def _update(change: Callable[[list[dict[str, Any]]], list[dict[str, Any]]]) -> None:
    path = presets_path()
    with _locked(path):
        before = _read(path)
        after = change(before)
        if after != before:
            _write(path, after)


def all_presets() -> list[Preset]:
    """Every preset this version can read, by name (others stay in the file untouched)."""
    out = []
    for d in _read(presets_path()):
        with contextlib.suppress(PresetError):
            out.append(Preset.from_json(d))
    return sorted(out, key=lambda p: p.name.lower())


def get(name: str) -> Preset | None:
    """The preset called ``name`` (any case), or None."""
    if not could_be(name):
        return None
    low = name.lower()
    for d in _read(presets_path()):
        if _key(d) == low:
            return Preset.from_json(d)
    return None


def lookup(model: str | None) -> Preset | None:
    """The preset ``model`` names, for ``load()`` and ``plan()``: None for anything that
    cannot be a preset's name (paths, Hub ids, the default model) without reading a file.
    A damaged presets file fails only names that could mean nothing else."""
    if model is None or not could_be(model):
        return None
    try:
        return get(model)
    except PresetError:
        if shadowed(model) is not None:  # an alias or a path here: not the preset's
            return None
        raise


def save(preset: Preset) -> Preset | None:
    """Store ``preset`` (validated by :func:`make`), replacing one of the same name;
    returns the one it replaced."""
    old: list[Preset] = []
    low = preset.name.lower()

    def change(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
        kept = []
        for d in entries:
            if _key(d) == low:
                with contextlib.suppress(PresetError):
                    old.append(Preset.from_json(d))
            else:
                kept.append(d)
        return [*kept, preset.to_json()]

    _update(change)
    return old[0] if old else None


def remove(name: str) -> Preset:
    """Delete the preset ``name`` (never a model's files); returns what it was."""
    low = name.lower()
    gone: list[dict[str, Any]] = []

    def change(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
        gone.extend(d for d in entries if _key(d) == low)
        return [d for d in entries if _key(d) != low]

    if could_be(name):
        _update(change)
    if not gone:
        raise PresetNotFoundError(name, [str(d.get("name")) for d in _read(presets_path())])
    try:
        return Preset.from_json(gone[0])
    except PresetError:
        return Preset(str(gone[0].get("name")), str(gone[0].get("from")))


__all__ = ["Adapter", "Preset", "PresetError", "PresetNotFoundError", "all_presets",
           "check_name", "could_be", "get", "home_dir", "lookup", "make", "parse_adapter",
           "presets_path", "remove", "save", "shadowed"]
