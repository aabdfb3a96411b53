"""MLX through mlx-lm: MLX-quantized folders on Apple Silicon (Metal) or Linux (CPU).

mlx streams are thread-local since mlx 0.31, and a Model is called from whichever
thread the user has: so every mlx call (load, seeding, prefill, decode) runs on one
worker thread, the process's mlx thread (:func:`~.engine.shared_worker`). ``generate`` hands
it a job and reads text pieces back through a :class:`~localrun.backends._worker.Relay`;
closing the generator early (stop string, cancel, abandoned stream) sets a flag the
worker checks between tokens, and waits for the job to end, so the Session is ready
for the next call.

We drive ``generate_step`` (not ``stream_generate``) so that we count exactly: EOS
is never counted as a completion token and ``max_tokens`` tokens are all yielded.

How localrun's sampling options map onto mlx-lm:

=====================  =========================================================
localrun               mlx-lm
=====================  =========================================================
temperature 0          mlx-lm's ``greedy_sampler``: argmax (greedy)
temperature > 0        **first**, then top_k, top_p, min_p (transformers' order), from
                       mlx-lm's ``apply_top_k/apply_top_p/apply_min_p`` and a
                       categorical draw: ``make_sampler`` applies the
                       temperature last, and top_p before top_k
                       (:func:`~.sampling.seeded_sampler`)
top_p (1 = off)        ``apply_top_p`` (only when 0 < top_p < 1)
top_k (0 = off)        ``apply_top_k`` (0 = off, the same convention)
min_p (0 = off)        ``apply_min_p`` (0 = off)
repetition_penalty     ``make_logits_processors(repetition_penalty=...)`` over the
                       last :data:`~.sampling.REPETITION_CONTEXT`
                       tokens (llama.cpp's window), the cached prompt included;
                       not installed at 1.0
seed                   the request's own key chain, ``mx.random.key(seed)`` split per
                       token: what ``mx.random.seed`` would draw, without mlx's one
                       global stream (so a seed means the same in a batch)
max_tokens             ``generate_step(max_tokens=...)`` and our own count (the driver
                       keeps it within the context)
stop strings           handled by localrun's API layer (mlx-lm has none)
EOS                    the tokenizer's ``eos_token_ids`` plus every id in
                       generation_config.json
=====================  =========================================================

**KV reuse**: each call takes the prompt cache of a recent call sharing the longest
prefix with its prompt and prefills only the rest; its own cache (prompt and reply) is
kept for the next (:class:`~.reuse.PrefixCache`, a few entries).
**Batching**: overlapping calls go through mlx-lm's ``BatchGenerator`` (:mod:`.batcher`,
given the loaded model as an :class:`~.engine.Engine`); a call alone runs here, through
``generate_step``, which is a little faster for one sequence (``batch_alone`` is False).

Text comes from mlx-lm's streaming detokenizer with its trimming of the reply's first
space turned off (:func:`~.engine.keep_first_space`): a completion is the text that follows the
prompt, " the" after "The cat is", as on every other engine.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from localrun.backends._worker import Relay
from localrun.backends.base import (
    Batcher,
    Footprint,
    GenerationStats,
    LoadRequest,
    Prompt,
    Session,
    SessionBackend,
)
from localrun.backends.hf_config import (
    architecture,
    eos_ids,
    read_json,
    require_files,
    sampling_defaults,
    trained_context,
)
from localrun.backends.installed import installed_version, missing
from localrun.backends.logprobs import PROMPT_ROWS, Scorer, TokenBytes, check_ids
from localrun.backends.mlx.adapters import adapter_path, load_error, scale_layers
from localrun.backends.mlx.batcher import CAPACITY, MLXBatcher
from localrun.backends.mlx.engine import Engine, shared_worker
from localrun.backends.mlx.facts import SPEC
from localrun.backends.mlx.reuse import PrefixCache
from localrun.backends.mlx.sampling import reuse_processors, seeded_sampler, with_raw
from localrun.backends.mlx.speculative import load_draft, speculative_steps
from localrun.backends.options import check_options
from localrun.errors import ChatTemplateError, LocalrunError, ModelFileError
from localrun.memory import context_window
from localrun.sampling import ResolvedSampling, check_speculative
from localrun.structured.constraint import Constraint
from localrun.structured.grammar import LazyGrammar, TokenMask, tokenizer_in_folder
from localrun.types import CancelToken, FinishReason, Message, ModelInfo, TokenLogprob

#: Tokenizer files of which an MLX folder needs one.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def _check_files(folder: Path) -> None:
    require_files(folder, ("config.json",), what="MLX")
    names = {p.name for p in folder.iterdir()}
    if not any(n in names for n in TOKENIZER_FILES):
        raise ModelFileError(str(folder), "MLX model has no tokenizer (looked for "
                             + ", ".join(TOKENIZER_FILES) + ")")
    from localrun.formats.safetensors import read_safetensors_header

    index = read_json(folder / "model.safetensors.index.json")
    wmap = index.get("weight_map")
    weights = sorted({str(v) for v in wmap.values()}) if isinstance(wmap, dict) else \
        sorted(n for n in names if n.endswith(".safetensors"))
    if not weights:
        raise ModelFileError(str(folder), "MLX model has no weights (*.safetensors)")
    missing = [w for w in weights if w not in names]
    if missing:
        raise ModelFileError(str(folder), "MLX model is incomplete, missing: "
                             + ", ".join(missing))
    for w in weights:  # a truncated download fails here, not deep inside mlx
        read_safetensors_header(folder / w)


#: Where mlx runs here: Metal on a Mac, the CPU elsewhere (mlx[cpu] on Linux).
NATIVE_DEVICE = "metal" if sys.platform == "darwin" else "cpu"
#: Device words meaning that native device.
DEVICE_WORDS: dict[str, tuple[str, ...]] = {"metal": ("metal", "gpu", "mps"), "cpu": ("cpu",)}


def _context_kv_bytes(config: dict[str, Any], context: int, device: str) -> int | None:
    """Bytes of a prompt cache of ``context`` tokens (rounded up to mlx-lm's KVCache
    steps of 256), as the memory estimate counts MLX's KV cache; None: shape unknown."""
    from localrun.memory import estimate, memory_row, shape_from_config

    shape = shape_from_config(config)
    if shape is None:
        return None
    return estimate(0, shape, -(-context // 256) * 256,
                    engine=memory_row(SPEC, device)).kv_cache_bytes


def _device(requested: str | None) -> str:
    """The device mlx runs on; any other request is an error, not a silent CPU run."""
    if requested is None or requested.strip().lower() in DEVICE_WORDS[NATIVE_DEVICE]:
        return NATIVE_DEVICE
    raise LocalrunError(
        f"MLX runs on {NATIVE_DEVICE} here, not on device {requested!r}",
        hint=f"leave device unset (or device='{NATIVE_DEVICE}'), or pick another engine "
        "with --backend")


class MLXSession(Session):
    def __init__(self, request: LoadRequest) -> None:
        path = Path(request.path).expanduser()
        check_options(SPEC, request.options)
        device = _device(request.device)
        # mlx_lm.load treats a path that does not exist as a Hub repo id and downloads
        # it: the checks come first.
        _check_files(path)
        config = read_json(path / "config.json", required=True)
        gen_config = read_json(path / "generation_config.json")
        try:
            import mlx.core as mx
            import mlx_lm
            from mlx_lm.generate import generate_step
        except ImportError as e:  # installed per metadata but broken
            raise missing(SPEC, reason=str(e)) from e
        self._mx = mx
        self._generate_step = generate_step
        worker = shared_worker()
        lora = adapter_path(request.adapters)
        try:
            loaded: Any = worker.call(lambda: mlx_lm.load(str(path), adapter_path=lora))
        except Exception as e:
            if lora is not None and isinstance(e, ValueError):
                raise load_error(lora, str(path), e) from e
            raise ModelFileError(str(path), f"mlx-lm could not load it "
                                 f"({type(e).__name__}: {str(e).strip()[:300]})") from e
        model, tok = loaded[0], loaded[1]
        worker.call(lambda: scale_layers(model, request.adapters))
        eos = frozenset(set(tok.eos_token_ids) | eos_ids(gen_config, config))
        vocab = config.get("vocab_size")
        self._engine: Engine | None = Engine(
            worker, model, tok, eos,
            prefixes=PrefixCache(model),
            grammar=LazyGrammar("mlx", lambda: tokenizer_in_folder(path, sorted(eos), "MLX"),
                                vocab if isinstance(vocab, int) else None),
            scorer=Scorer(TokenBytes(path / "tokenizer.json", lambda t: str(tok.decode([t])))))
        self._tok = tok  # encoding needs no mlx thread
        self._batcher: MLXBatcher | None = None
        self._capacity = CAPACITY[device]
        self.chat_template = getattr(tok, "chat_template", None)
        self.bos_token = str(getattr(tok, "bos_token", None) or "")
        self.eos_token = str(getattr(tok, "eos_token", None) or "")
        self._vocab = vocab if isinstance(vocab, int) else len(tok.get_vocab())
        self.sampling_defaults = sampling_defaults(gen_config)
        quant = config.get("quantization")
        bits = quant.get("bits") if isinstance(quant, dict) else None
        trained = trained_context(config)
        self.info = ModelInfo(
            backend="mlx",
            engine_version=installed_version(SPEC) or "unknown",
            format="mlx",
            quantization=f"{bits}bit" if bits else None,
            path=str(path),
            context_length=context_window(request.context, trained),
            trained_context_length=trained,
            architecture=architecture(config),
            name=str(config.get("_name_or_path") or path.name),
            device=device,
            adapters=request.adapters,
        )
        self._kept = self._engine.prefixes.most_bytes(_context_kv_bytes(
            config, self.info.context_length or 0, device))
        #: speculative decoding: mlx-lm's, with a draft model (.speculative)
        self._speculative = check_speculative(request.speculative) or "auto"
        self._draft: Any = None
        if request.draft_model:
            self._draft = load_draft(worker, request.draft_model, tok, str(path))

    # -- encoding ---------------------------------------------------------------------

    def encode_chat(self, messages: Sequence[Message]) -> Prompt:
        try:
            text = self._tok.apply_chat_template(list(messages), add_generation_prompt=True,
                                                 tokenize=False)
        except Exception as e:  # jinja2 TemplateError, or the template's raise_exception
            raise ChatTemplateError(str(e), messages) from e
        # The rendered template holds the special tokens it wants: add none
        # (as transformers' apply_chat_template(tokenize=True) does).
        return Prompt(list(self._tok.encode(str(text), add_special_tokens=False)), str(text))

    def encode_text(self, text: str) -> Prompt:
        return Prompt(list(self._tok.encode(text, add_special_tokens=True)), text)

    def encode_rendered(self, text: str) -> Prompt:
        return Prompt(list(self._tok.encode(text, add_special_tokens=False)), text)

    def encode_ids(self, tokens: Sequence[int]) -> Prompt:
        return Prompt(check_ids("mlx", tokens, self._vocab))

    # -- log probabilities (localrun.backends.logprobs) ----------------------------------

    features = frozenset({"logprobs", "top", "echo", "tokens"})
    memory_facts = SPEC

    def footprint(self, slots: int | None = None) -> Footprint:
        """Each sequence's KV cache grows with it (the batcher reserves nothing: a slot
        counts as one KV cache of the context); kept: the prompt caches of recent calls
        (:mod:`.reuse`: a few, within 1 GiB, or the last one's whatever it takes)."""
        return replace(super().footprint(slots), kept=self._kept)

    @property
    def engine(self) -> Engine:
        """The loaded model (what the batcher is given); LocalrunError once closed."""
        if self._engine is None:
            raise LocalrunError("This MLX session is closed", hint="load the model again")
        return self._engine

    def prompt_logprobs(self, prompt: Prompt, top: int) -> list[TokenLogprob]:
        engine = self.engine
        return engine.worker.call(lambda: self._score(engine, list(prompt.tokens), top))

    def _score(self, engine: Engine, tokens: list[int], top: int) -> list[TokenLogprob]:
        """On the mlx thread: the prompt through the model in pieces of
        :data:`~localrun.backends.logprobs.PROMPT_ROWS` tokens, every position's logits
        kept; the cache is offered to the prefix cache, so the reply that follows
        prefills only the last prompt token."""
        import numpy as np
        from mlx_lm.models.cache import make_prompt_cache

        mx = self._mx
        cache = make_prompt_cache(engine.model)
        out = [engine.scorer.first(tokens[0])]
        for start in range(0, len(tokens), PROMPT_ROWS):
            logits = engine.model(mx.array(tokens[start:start + PROMPT_ROWS])[None],
                                  cache=cache)
            rows = np.array(logits[0].astype(mx.float32))
            out += engine.scorer.prompt(rows, tokens, start, top)
        engine.prefixes.keep(tokens, cache)
        return out

    # -- constrained decoding (llguidance as a logits processor) ------------------------

    def check_constraint(self, constraint: Constraint) -> None:
        self.engine.grammar.check(constraint)

    # -- generation -------------------------------------------------------------------

    def _run(self, engine: Engine, prompt: Prompt, sampling: ResolvedSampling,
             cancel: CancelToken, relay: Relay[tuple[FinishReason, str]],
             stats: GenerationStats, mask: TokenMask | None = None
             ) -> tuple[FinishReason, str]:
        """One request, on the worker thread: (why it ended, the detokenizer's held-back
        text). Prefills only what the longest cached prefix lacks."""
        tokens = list(prompt.tokens)
        cache, reused = engine.prefixes.borrow(tokens)
        detok = engine.detokenizer()
        detok.reset()
        eos = engine.eos
        limit = sampling.max_tokens
        entries, top = stats.logprobs, sampling.logprobs or 0  # None: not asked
        procs, raw = with_raw(reuse_processors(sampling, mask, tokens, reused),
                              entries is not None)
        mode = sampling.speculative or self._speculative
        draft = self._draft if mode in ("auto", "draft") and mask is None and \
            entries is None else None
        counts = [0, 0]  # drafted, accepted
        if draft is not None:  # its own cache (target and draft layers): no reuse
            reused = 0
            procs = reuse_processors(sampling, None, tokens, 0)
            steps = speculative_steps(engine.model, draft, self._mx.array(tokens),
                                      max_tokens=limit, sampler=seeded_sampler(sampling),
                                      processors=procs, counts=counts)
        else:
            steps = self._generate_step(
                self._mx.array(tokens[reused:]), engine.model, max_tokens=limit,
                sampler=seeded_sampler(sampling), prompt_cache=cache,
                logits_processors=procs)
        reason: FinishReason = "length"
        t0 = time.perf_counter()
        t_first = t_last = 0.0
        n = 0
        given: list[int] = []  # every token generate_step gave: it ran the model on each
        try:
            for token, logprobs in steps:
                t_last = time.perf_counter()
                if not n:
                    t_first = t_last
                given.append(int(token))
                if entries is not None:  # before its piece (base.GenerationStats)
                    assert raw is not None
                    entries.append(engine.scorer.entry(raw.row(logprobs), int(token), top))
                if token in eos:
                    reason = "stop"
                    break
                n += 1
                detok.add_token(token)
                relay.put(detok.last_segment)
                if n >= limit or relay.halted or cancel.cancelled:
                    break
            detok.finalize()
            tail = detok.last_segment
        finally:
            steps.close()
            stats.prefill_tokens = len(tokens) - reused if t_first else 0
            stats.prefill_seconds = t_first - t0 if t_first else 0.0
            stats.decode_tokens = max(n - 1, 0)
            stats.decode_seconds = t_last - t_first if n > 1 else 0.0
            stats.drafted_tokens, stats.accepted_tokens = counts
        if draft is None:  # for the next call (not after an error)
            engine.prefixes.keep(tokens + given, cache)
        return reason, tail

    def generate(self, prompt: Prompt, sampling: ResolvedSampling, cancel: CancelToken,
                 stats: GenerationStats) -> Iterator[str]:
        engine = self.engine
        # The worker fills the engine timings into its own stats object; we count
        # the pieces the caller actually received.
        engine_stats = GenerationStats(logprobs=stats.logprobs)  # entries: the same list
        mask = engine.grammar.mask(sampling.constraint) if sampling.constraint else None
        relay: Relay[tuple[FinishReason, str]] = Relay()
        engine.worker.submit(relay.job(lambda: self._run(engine, prompt, sampling, cancel,
                                                         relay, engine_stats, mask)))
        try:
            for piece in relay:
                stats.completion_tokens += 1
                yield piece
            reason, tail = relay.result()
            if tail:
                yield tail
            stats.finish_reason = reason
        finally:
            relay.close()  # closed early: the worker ends the job before we return
            stats.prefill_tokens = engine_stats.prefill_tokens
            stats.prefill_seconds = engine_stats.prefill_seconds
            stats.decode_tokens = engine_stats.decode_tokens
            stats.decode_seconds = engine_stats.decode_seconds
            stats.drafted_tokens = engine_stats.drafted_tokens
            stats.accepted_tokens = engine_stats.accepted_tokens

    # -- batching (.batcher) ---------------------------------------------------------------

    #: One sequence through generate_step costs a little less than through the
    #: BatchGenerator (its per-step bookkeeping, a thread hand-off per token:
    #: docs/results/kv_reuse.md)
    batch_alone = False

    def batcher(self) -> Batcher | None:
        engine = self.engine
        if self._batcher is None:
            self._batcher = MLXBatcher(engine, self._capacity)
        return self._batcher

    def close(self) -> None:
        engine, self._engine = self._engine, None
        self._draft = None
        if engine is not None:
            batcher, self._batcher = self._batcher, None
            if batcher is not None:
                batcher.close()
            engine.worker.call(engine.prefixes.clear)  # the kept caches' memory goes now


BACKEND = SessionBackend("mlx", MLXSession)
