"""Which loaded model serves a request, whatever the request calls it.

A request's name is first read as a preset's (:func:`ask`): a preset is its model plus
per-request defaults, so its request loads (or shares) its model's copy at the preset's
context and on its engine, and :class:`PresetModel` applies its system prompt, example
turns and sampling defaults to each call on that shared copy; the presets file is read
again only when it changes (:class:`PresetTable`).

A model is loaded once per file, engine and context. Every spelling of one file is that
file (``/x/m.gguf``, ``/x``, ``/x/./m.gguf``, a symlink, the alias it was pulled as: one
device and inode), and a request's context is the one the engine would load (``num_ctx``
capped at the context the model was trained for, as :func:`localrun.memory.context_window`
decides for every engine, then rounded up as the engine rounds it: llama.cpp pads to
256). That triple, the LoRA adapters it loaded with (:func:`adapters_for`: a
preset's own, ``serve --lora``'s for the command line's models, else none) and its mode
(``exact``: serve's ``--exact`` or the preset's) are a loaded model's key. At most
:data:`MAX_COPIES` contexts of one file are loaded at once (see
:class:`localrun.server.manager.ModelManager`).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from localrun.errors import UnknownModelError
from localrun.server.config import ServerConfig
from localrun.server.errors import APIError
from localrun.server.sizing import Kind

if TYPE_CHECKING:
    from localrun.naming.presets import Preset
    from localrun.resolve import Target
    from localrun.types import ModelInfo

#: A model file's identity: (st_dev, st_ino) of the file or folder the engine opens; its
#: path where it is not a file here (a remote model's URL and name).
FileId = tuple[int, int] | str

#: Contexts of one model file loaded at once. Each is a whole copy (weights, KV cache);
#: past this a request takes the largest loaded copy when it holds the context asked
#: for, else an idle copy makes way, else it is refused with Retry-After.
MAX_COPIES = 2

#: What an engine rounds the context it is given up to (llama.cpp pads its KV cache to
#: 256 cells; the others load exactly the context they are given).
CONTEXT_STEP: dict[str, int] = {"llama.cpp": 256}

#: Names remembered with the file they came to (see :class:`Names`).
MAX_NAMES = 1024

#: The context an embedder falls back to where the model does not say (embeddings.py).
EMBED_DEFAULT_CONTEXT = 512


def file_id(path: str) -> FileId:
    """The identity of the file or folder at ``path``, whatever its spelling."""
    try:
        st = os.stat(path)
    except (OSError, ValueError):
        return path
    return (st.st_dev, st.st_ino)


@dataclass(frozen=True)
class ModelFile:
    """A model as its engine opens it: which file, and what fixes its context."""

    id: FileId
    path: str
    backend: str
    trained: int | None  # the context it was trained for (None: it does not say)

    @classmethod
    def of(cls, info: ModelInfo) -> ModelFile:
        """The file a loaded model opened."""
        return cls(file_id(info.path), info.path, info.backend,
                   info.trained_context_length)

    def context(self, kind: Kind, asked: int | None, config: ServerConfig) -> int:
        """The context ``kind`` loads this model with for a request that asks for
        ``asked`` (None: the server's ``--context``, else the model's default)."""
        from localrun.memory import context_window

        if kind == "embed":  # the embedders' rule (embeddings.py): within the trained one
            trained = self.trained or EMBED_DEFAULT_CONTEXT
            return min(asked, trained) if asked else trained
        n = context_window(asked or config.context, self.trained)
        step = CONTEXT_STEP.get(self.backend, 1)
        return -(-n // step) * step


def identify(name: str, kind: Kind, config: ServerConfig
             ) -> tuple[ModelFile, Target] | None:
    """The model file ``name`` names on this machine, found as the loader will find it,
    before anything loads; None for a name that is not on disk (the Hub's, decided as
    the model loads). What the loader would refuse is refused here, sooner: a folder that
    is no model (detection is bounded: formats/detect.py), an engine that is not
    installed, an embedding model asked to chat (a 400)."""
    from localrun.formats.detect import detect
    from localrun.resolve import resolve_local
    from localrun.server.embeddings import embedding_only

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the unoptimized-format warning: the CLI said it
            target = resolve_local(name, backend=config.backend,
                                   allow_unoptimized=config.allow_unoptimized)
    except UnknownModelError:
        return None
    if kind == "chat" and embedding_only(target.path, target.format):
        raise APIError(400, f"'{name}' is an embedding model: it cannot generate text; use it "
                       "with POST /v1/embeddings or /api/embed", param="model",
                       code="model_not_generative")
    trained = detect(target.path).context_length
    return ModelFile(file_id(target.path), target.path, target.backend, trained), target


class Copy(Protocol):
    """What choosing among the loaded copies of a file reads (manager.Loaded)."""

    name: str
    context: int | None
    pinned: bool
    serves: set[int]


C = TypeVar("C", bound=Copy)


def pick(copies: Sequence[C], mf: ModelFile, kind: Kind, name: str, asked: int | None,
         config: ServerConfig) -> C | None:
    """The copy (of ``mf``'s file) a request for ``name`` at context ``asked`` gets: the
    one at the context the engine would load; for a request that names none, the copy
    named on the command line (by that name first), if any."""
    if asked is None:
        pinned = sorted((m for m in copies if m.pinned), key=lambda m: m.name != name)
        if pinned:
            return pinned[0]
    want = mf.context(kind, asked, config)
    return next((m for m in copies if m.context == want or want in m.serves), None)


class Names:
    """The names requests used and the file each came to (under the engine asked for):
    a name's next request needs no lookup. Forgotten when no copy of that file is loaded
    (the name may mean another file by then); at most :data:`MAX_NAMES`, the oldest
    forgotten first."""

    def __init__(self) -> None:
        self._files: dict[tuple[Kind, str, str], ModelFile] = {}

    def get(self, kind: Kind, name: str, backend: str) -> ModelFile | None:
        return self._files.get((kind, name, backend))

    def learn(self, kind: Kind, name: str, backend: str, mf: ModelFile | None) -> None:
        if mf is None:
            return
        self._files.pop((kind, name, backend), None)
        self._files[(kind, name, backend)] = mf
        while len(self._files) > MAX_NAMES:
            del self._files[next(iter(self._files))]

    def forget(self, kind: Kind, file: FileId) -> None:
        for k in [k for k, f in self._files.items() if k[0] == kind and f.id == file]:
            del self._files[k]


# -- presets -----------------------------------------------------------------------------

@dataclass(frozen=True)
class Asked:
    """What a request's model name asks for: ``model`` loads (the name itself, or the
    preset's model) at ``context`` (the request's, else the preset's; None: the server's
    ``--context``, else the model's default) with ``config`` (the server's, with the
    preset's engine and allow_unoptimized where it sets them)."""

    name: str
    model: str
    context: int | None
    config: ServerConfig
    preset: Preset | None = None

    @property
    def backend(self) -> str:
        """The engine asked for ("auto": the one the host rules pick)."""
        return self.config.backend


class PresetTable:
    """The presets (:mod:`localrun.naming.presets`), read again only when their file changes
    (its size, time or inode), so a request pays one ``stat``. A damaged file fails only
    the names that could mean nothing else, as :func:`localrun.naming.presets.lookup` does."""

    def __init__(self) -> None:
        self._stamp: tuple[Any, ...] | None = None
        self._by: dict[str, Preset] = {}
        self._error: Exception | None = None

    def get(self, name: str) -> Preset | None:
        """The preset called ``name`` (any case), or None; PresetError where the file
        cannot be read and ``name`` can only be a preset's."""
        from localrun.naming import presets

        if not presets.could_be(name):
            return None
        path = presets.presets_path()
        try:
            st = path.stat()
        except FileNotFoundError:
            return None
        except OSError:
            return presets.lookup(name)  # says why it cannot be read
        stamp = (str(path), st.st_mtime_ns, st.st_size, st.st_ino)
        if stamp != self._stamp:
            try:
                self._by, self._error = {p.name.lower(): p for p in presets.all_presets()}, None
            except presets.PresetError as e:
                self._by, self._error = {}, e
            self._stamp = stamp
        if self._error is not None and presets.shadowed(name) is None:
            raise self._error
        return self._by.get(name.lower())

    def all(self) -> list[Preset]:
        """Every preset (an unreadable file: none)."""
        from localrun.naming import presets

        try:
            return presets.all_presets()
        except presets.PresetError:
            return []


def ask(name: str, context: int | None, config: ServerConfig,
        table: PresetTable) -> Asked:
    """What ``name`` asks for (a preset read first); a PresetError or AdapterError (a
    400) for a preset that cannot load. ``config.adapters`` becomes the LoRA adapters
    this name loads with (:func:`adapters_for`)."""
    preset = table.get(name)
    if preset is None:
        return Asked(name, name, context, adapters_for(name, None, config))
    model, backend, ctx, unoptimized = preset.load_args(config.backend, context,
                                                        config.allow_unoptimized)
    exact = config.exact or preset.exact
    if (backend, unoptimized, exact) != (config.backend, config.allow_unoptimized,
                                         config.exact):
        config = replace(config, backend=backend, allow_unoptimized=unoptimized, exact=exact)
    return Asked(name, model, ctx, adapters_for(name, preset, config), preset)


def adapters_for(name: str, preset: Preset | None, config: ServerConfig) -> ServerConfig:
    """``config`` holding the adapters ``name`` loads with: a preset's own; else the
    command line's ``--lora`` for a model named on the command line; else none. A
    loaded copy serves a request only when it was loaded with that set."""
    from localrun.adapters import normalize

    if preset is not None and preset.adapters:
        chosen = normalize(preset.adapters)
    elif name in config.models:
        chosen = config.adapters
    else:
        chosen = ()
    return config if chosen == config.adapters else replace(config, adapters=chosen)


class PresetModel:
    """A loaded model answering as a preset, for one request: each call gets the
    preset's system prompt (unless the conversation has its own) and example turns, and
    its sampling values where the call sets none, between the caller's and the model's
    own, as ``localrun.load(PRESET)`` would; the model itself is shared with every
    other request for it. Anything else is the model's."""

    def __init__(self, model: Any, preset: Preset) -> None:
        self.model = model
        self.preset = preset

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)

    def _sampling(self, given: dict[str, Any]) -> dict[str, Any]:
        out = dict(given)
        for key, value in self.preset.sampling.items():
            if out.get(key) is None:
                out[key] = value
        return out

    def _conversation(self, messages: Any) -> Any:
        from localrun.templates import normalize_messages

        return self.preset.conversation(normalize_messages(messages))

    def stream(self, messages: Any, **kwargs: Any) -> Any:
        if not kwargs.get("raw"):
            messages = self._conversation(messages)
        return self.model.stream(messages, **self._sampling(kwargs))

    def chat(self, messages: Any, **kwargs: Any) -> Any:
        return self.stream(messages, **kwargs).join()

    def complete(self, prompt: Any, **kwargs: Any) -> Any:
        return self.stream(prompt, raw=True, **kwargs).join()

    def batch(self, items: Iterable[Any], **kwargs: Any) -> Any:
        return self.model.batch(self.preset.batch_items(items), **self._sampling(kwargs))

    def batch_iter(self, items: Iterable[Any], **kwargs: Any) -> Any:
        """As :meth:`batch`, each result as it ends (a request's several choices)."""
        return self.model.batch_iter(self.preset.batch_items(items), **self._sampling(kwargs))

    def count_prompt_tokens(self, messages: Any, **kwargs: Any) -> int:
        return int(self.model.count_prompt_tokens(self._conversation(messages), **kwargs))
