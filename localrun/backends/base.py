"""The contract every engine honours.

A backend turns a model on disk into a :class:`Session`. A session only has to
encode prompts and stream text pieces; everything the public API promises beyond
that (sampling defaults, the token limit and the seed, stop strings, usage in
streams, timings, thread safety, cancellation between tokens) is built once in
:mod:`localrun.driver`. An engine that runs many sequences at once also gives a
:class:`Batcher` (``Session.batcher()``), which the driver's scheduler steps.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from localrun.adapters import Adapter
from localrun.errors import LocalrunError
from localrun.sampling import ResolvedSampling
from localrun.structured.constraint import Constraint
from localrun.types import CancelToken, FinishReason, Message, ModelInfo, TokenLogprob

if TYPE_CHECKING:
    from localrun.images import Image
    from localrun.memory import EngineMemory, MemoryEstimate, MemoryRows


@dataclass(frozen=True)
class LoadRequest:
    path: str
    format: str
    context: int | None = None  # None: the backend's sensible default for this model
    device: str | None = None  # e.g. "CPU", "GPU.1", "cuda:0"; None: the backend decides
    threads: int | None = None
    options: Mapping[str, Any] = field(default_factory=dict)  # engine-specific extras
    #: an engine's progress while it starts, where that takes long (vLLM: a minute or
    #: more; ``localrun.backends.vllm.Startup`` reports); None: its log
    on_startup: Callable[[Any], None] | None = None
    #: LoRA adapters to load with the model (checked: there, scales in range, this
    #: engine's kind; ``localrun.adapters``); an engine without adapters gets none
    adapters: tuple[Adapter, ...] = ()
    #: speculative decoding (types.SpeculativeMode); None: the engine's default ("auto"
    #: where it speculates)
    speculative: str | None = None
    #: the draft model's path (speculative="draft"), already checked to exist
    draft_model: str | None = None
    #: ``load(exact=True)``: replies that do not depend on what ran before (the cache,
    #: the batch) at some speed; False: the engine's fastest (README, "Speed")
    exact: bool = False


@dataclass(frozen=True)
class Prompt:
    tokens: Sequence[int]
    text: str | None = None  # the rendered text, for engines that take text
    #: the images of the prompt as the engine takes them (llama.cpp: its mtmd chunks;
    #: OpenVINO: tensors), made by :meth:`Session.attach_images`; None: text alone
    media: Any = field(default=None, kw_only=True)


@dataclass
class GenerationStats:
    """Filled in by a session while it generates; read by the API even after an early stop."""

    completion_tokens: int = 0
    finish_reason: FinishReason | None = None  # "stop" at end-of-sequence, "length" at a limit
    prefill_tokens: int = 0
    prefill_seconds: float = 0.0  # engine's own figures, 0 when it reports none
    decode_tokens: int = 0
    decode_seconds: float = 0.0
    #: perf_counter() when the engine admitted this sequence (batching); 0: the call's start
    started: float = 0.0
    #: set by a Batcher before it ends ONE sequence with ``(key, None)`` because the engine
    #: failed that sequence alone (the others go on); the driver raises it for that one
    error: LocalrunError | None = None
    #: ``sampling.logprobs`` set: the driver puts a list here and the engine appends one
    #: entry per token it chooses (:mod:`localrun.backends.logprobs` makes them), BEFORE
    #: it hands over that token's text piece, and one for the end-of-sequence token when
    #: it ends on one; None: not asked (the engine does no work for it)
    logprobs: list[TokenLogprob] | None = None
    #: speculative decoding: tokens drafted, and how many of them were kept
    drafted_tokens: int = 0
    accepted_tokens: int = 0


@dataclass(frozen=True)
class Footprint:
    """What a loaded engine holds in memory (bytes) with ``slots`` sequences running at
    once (:meth:`Session.footprint`, ``Model.footprint``): ``fixed + slots * per_slot +
    kept`` in all (:attr:`total`)."""

    #: sequences it runs at once: those asked for, at most what its engine runs
    slots: int
    #: held whatever runs: weights, overhead, the context's KV cache, and a batch
    #: context's reserve where one is built already (llama.cpp's)
    fixed: int
    #: what each of those slots adds: a KV stream a batch context will reserve (llama.cpp,
    #: before it is built), a KV cache that grows with its sequence (MLX); 0 where the
    #: sequences share the context's KV cache (OpenVINO's pages, ExLlama's cache)
    per_slot: int
    #: kept between calls for KV reuse beyond the KV caches above (MLX's prompt caches);
    #: 0 where the cells it reuses are in a KV cache counted already (llama.cpp, OpenVINO)
    kept: int

    @property
    def running(self) -> int:
        """Bytes it holds to run :attr:`slots` at once, less what it keeps between calls."""
        return self.fixed + self.slots * self.per_slot

    @property
    def total(self) -> int:
        return self.running + self.kept


def loaded_estimate(info: ModelInfo, engine: EngineMemory) -> MemoryEstimate | None:
    """A loaded model's memory for one sequence: :func:`localrun.memory.local_estimate` of
    its path at the context it loaded with, by its engine's row ``engine``, and its LoRA
    adapters' files; None when its files cannot be read (a model on a server)."""
    from localrun.adapters import adapters_bytes
    from localrun.memory import local_estimate

    try:
        est = local_estimate(Path(info.path), info.context_length, engine=engine)
    except (OSError, ValueError, LocalrunError):
        return None
    return replace(est, adapter_bytes=adapters_bytes(info.adapters)) if info.adapters else est


class Batcher(ABC):
    """Many sequences through one engine at once; they join and leave between steps.

    Always driven from ONE thread (the driver's scheduler thread); never concurrently,
    and never while the session's own :meth:`Session.generate` runs."""

    #: most sequences the engine wants in flight at once (the scheduler admits no more)
    capacity: int
    #: Memory (bytes) the batcher holds beyond the session's own (weights, overhead, one
    #: KV cache), whatever the sequences in flight: 0 when they share the session's KV
    #: cache or run elsewhere (a server). None: not fixed, each sequence's KV cache
    #: grows with it (counted as one more KV cache per sequence beyond the first).
    reserved_bytes: int | None = None

    @abstractmethod
    def add(self, key: int, prompt: Prompt, sampling: ResolvedSampling,
            stats: GenerationStats) -> None:
        """Admit one sequence now. ``sampling.max_tokens`` is already clamped to the
        context and ``sampling.seed`` is an int; ``sampling.constraint`` (if set) must be
        enforced. Sets ``stats.started = time.perf_counter()`` and ``stats.prefill_tokens``.
        May raise a LocalrunError for THIS sequence only (e.g. a schema the engine
        refuses); the batcher stays usable for the others."""

    @abstractmethod
    def cancel(self, key: int) -> None:
        """Stop this sequence now (a stop string matched, the caller cancelled or went
        away). Its KV cells/slot are freed; :meth:`step` will report ``(key, None)``."""

    @abstractmethod
    def step(self) -> list[tuple[int, str | None]]:
        """Run one engine step over every sequence in flight (prefill of new ones, one
        decode token for the others). Return the new text pieces as ``(key, piece)``, one
        per generated token (a piece may be ""), and ``(key, None)`` once a sequence has
        finished, after setting ``stats.finish_reason`` ("stop" at end-of-sequence,
        "length" at max_tokens) and keeping ``stats.completion_tokens`` and the decode
        figures current. A cancelled sequence ends with ``(key, None)`` too; one the
        engine failed alone ends so with ``stats.error`` set. Keys are add()'s."""

    def idle(self) -> None:  # noqa: B027 - optional hook
        """Called on the engine thread when it has run out of sequences, before it waits
        for more: free what only running needs on that thread (llama.cpp: its OpenMP
        workers, which would slow another thread's decoding meanwhile)."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Free what the batcher holds (idempotent). Sequences still in flight end."""


class Session(ABC):
    """One loaded model. Never called from two threads at once (the driver serializes)."""

    info: ModelInfo
    #: the model's own sampling defaults (generation_config.json / GGUF metadata)
    sampling_defaults: Mapping[str, Any] = {}

    @abstractmethod
    def encode_chat(self, messages: Sequence[Message]) -> Prompt:
        """Render the model's chat template with a generation prompt, and tokenize."""

    @abstractmethod
    def encode_text(self, text: str) -> Prompt:
        """Tokenize raw text as a completion prompt (no chat template)."""

    def count_tokens(self, text: str) -> int:
        """``Model.count_tokens``: the tokens of ``text`` as a completion prompt (an
        engine whose tokenizer is on a server asks the server)."""
        return len(self.encode_text(text).tokens)

    @abstractmethod
    def generate(self, prompt: Prompt, sampling: ResolvedSampling, cancel: CancelToken,
                 stats: GenerationStats) -> Iterator[str]:
        """Yield text pieces, one per generated token (possibly empty strings).

        A ``sampling.constraint`` (only ever set after :meth:`check_constraint` passed)
        must be enforced on every token.

        ``sampling.max_tokens`` arrives already clamped to what the context leaves after
        the prompt, and ``sampling.seed`` is always an int (the driver draws one when the
        caller gave none): use both as they are.

        Must stop at end-of-sequence (finish_reason "stop") or after
        ``sampling.max_tokens`` ("length"), keep ``stats`` current as it goes, and clean
        up when closed early.
        """

    # -- log probabilities (localrun.backends.logprobs) ------------------------------------
    #: What the engine reports, checked by the driver before any token is generated (an
    #: UnsupportedFeatureError otherwise): "logprobs" (each chosen token's, in
    #: ``stats.logprobs``), "top" (with the most likely alternatives), "echo" (the prompt's,
    #: :meth:`prompt_logprobs`), "tokens" (token-id prompts, :meth:`encode_ids`).
    features: frozenset[str] = frozenset()

    def prompt_logprobs(self, prompt: Prompt, top: int) -> list[TokenLogprob]:
        """Each prompt token with its log probability given the tokens before it (the
        first: None) and its ``top`` most likely alternatives: one forward pass over the
        prompt that keeps every position's logits. Only asked where "echo" is in
        :attr:`features`."""
        raise NotImplementedError(f"{type(self).__name__} has no prompt log probabilities")

    def use_adapters(self, active: tuple[tuple[str, float], ...] | None) -> None:  # noqa: B027
        """Put the adapter set ``active`` (``ResolvedSampling.adapters``) on before
        :meth:`prompt_logprobs` (``generate`` and a Batcher read it from the sampling).
        Only engines with per-request adapters ("adapters" in :attr:`features`) act."""

    def encode_ids(self, tokens: Sequence[int]) -> Prompt:
        """A prompt given as token ids, used as they are (no BOS added); raises a
        LocalrunError for an id outside the vocabulary. Only asked where "tokens" is in
        :attr:`features`."""
        raise NotImplementedError(f"{type(self).__name__} takes no token-id prompts")

    #: whether :meth:`attach_images` takes images (a vision model on an engine that runs it)
    accepts_images: bool = False

    def attach_images(self, prompt: Prompt, images: Sequence[Image]) -> Prompt:
        """The prompt with its images: ``prompt.text`` holds :data:`localrun.images.MARKER`
        where each goes. A prompt with media runs through :meth:`generate` alone (never
        the batcher). An engine or model without a vision path raises
        ImagesUnsupportedError, before anything runs."""
        from localrun.images import NO_VISION, ImagesUnsupportedError

        backend = self.info.backend
        raise ImagesUnsupportedError(backend, NO_VISION.get(backend, "localrun runs no vision "
                                     "model on this engine (or this model has no vision "
                                     "part)"))

    def batcher(self) -> Batcher | None:
        """This session's engine batcher, created on first use and kept; None: the engine
        runs one sequence at a time (the driver then queues). Closing the session closes
        it too."""
        return None

    #: The engine's own facts (its package's ``facts.SPEC``): their memory rows size the
    #: model's weights, overhead and KV cache in :meth:`footprint`.
    memory_facts: MemoryRows | None = None

    def estimate(self) -> MemoryEstimate | None:
        """The loaded model's memory for one sequence: weights, overhead, one KV cache of
        its context, on its device by its engine's row, and its LoRA adapters' files
        (:func:`loaded_estimate`); None when its files cannot be read."""
        from localrun.memory import memory_row

        return loaded_estimate(self.info, memory_row(self.memory_facts, self.info.device))

    def footprint(self, slots: int | None = None) -> Footprint:
        """What the engine holds (bytes) with ``slots`` sequences running at once (None:
        as many as it runs, within :attr:`max_concurrency`): the one memory contract.
        The result's ``slots`` are those it would run (at most its batcher's capacity; 1
        without one). An engine whose batcher holds memory per slot from the moment it is
        built (llama.cpp's KV streams) answers without building it, so that a caller can
        size it first; any other may be built here to learn its capacity (that holds
        nothing up front).

        This default reads the batcher's :attr:`Batcher.reserved_bytes`: a fixed reserve
        (0: the sequences share the context's KV cache) goes into ``fixed``; None (each
        sequence's cache grows with it) makes each slot one KV cache of the context."""
        est = self.estimate()
        one, kv = (est.total_bytes, est.kv_cache_bytes) if est is not None else (0, 0)
        batcher = self.batcher() if slots is None or slots > 1 else None
        if batcher is None:
            return Footprint(1, one, 0, 0)
        n = min(slots or batcher.capacity, batcher.capacity)
        if batcher.reserved_bytes is None:
            return Footprint(n, one - kv, kv, 0)
        return Footprint(n, one + batcher.reserved_bytes, 0, 0)

    #: Most sequences the session's user will run at once (``load(max_concurrency=)``,
    #: ``Model.limit_concurrency``), set by the driver before it first asks for the
    #: batcher; None: no limit. An engine whose batcher holds memory per slot (llama.cpp's
    #: KV streams) builds no more slots than this; the driver admits no more in any case.
    max_concurrency: int | None = None

    #: True when one sequence alone runs as fast through the batcher as through
    #: generate(): the scheduler then sends every sequence through it. False: a lone
    #: sequence (nothing else in flight or waiting) runs through generate().
    batch_alone: bool = False

    # -- structured output and tools (localrun.structured) ---------------------------------
    #: the model's own chat template source, and the BOS/EOS texts it renders with: the API
    #: renders it itself (localrun.templates) when a conversation carries tools
    chat_template: str | None = None
    bos_token: str = ""
    eos_token: str = ""

    def encode_rendered(self, text: str) -> Prompt:
        """Tokenize a chat prompt localrun rendered itself, adding no special tokens (the
        rendered template holds the ones it wants)."""
        raise NotImplementedError(f"{type(self).__name__} cannot tokenize a rendered prompt")

    def check_constraint(self, constraint: Constraint) -> None:
        """Raise unless :meth:`generate` will enforce ``sampling.constraint``: a typed
        error (ConstrainedDecodingUnavailableError, UnsupportedSchemaError) before any
        token is generated, never unconstrained output."""
        from localrun.errors import ConstrainedDecodingUnavailableError

        raise ConstrainedDecodingUnavailableError(
            self.info.backend, "localrun has no constrained decoding for this engine")

    def close(self) -> None:  # noqa: B027 - optional hook
        """Free the engine's memory. Idempotent."""


class Embedder(ABC):
    """One embedding model in an engine's embedding mode (the module an engine's
    ``embedder`` fact names makes it with ``load_embedder(path, name, context, device)``)."""

    info: ModelInfo
    dimensions: int  # the length of each vector
    max_tokens: int  # the tokens one input is embedded with at most (longer ones are cut)

    @abstractmethod
    def count(self, text: str) -> int:
        """The tokens of ``text`` as the model embeds it."""

    @abstractmethod
    def embed(self, texts: list[str]) -> list[list[float]]:
        """One unit-length vector per text, each text cut to :attr:`max_tokens`."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Free the engine's memory. Idempotent."""


class Backend(Protocol):
    name: str

    def load(self, request: LoadRequest) -> Session: ...


class SessionBackend:
    """The :class:`Backend` of an engine whose ``load`` is its session class: each
    engine's module names one as ``BACKEND``."""

    def __init__(self, name: str, session: Callable[[LoadRequest], Session]) -> None:
        self.name = name
        self.session = session

    def load(self, request: LoadRequest) -> Session:
        session = self.session(request)
        if request.exact and not session.info.exact:  # the mode the Model shows
            session.info = replace(session.info, exact=True)
        return session
