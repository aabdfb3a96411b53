"""llama.cpp through llama-cpp-python: GGUF models on CPU, CUDA, Metal or Vulkan.

We drive ``Llama.generate`` token by token rather than ``create_chat_completion``:
its defaults are not neutral (min_p 0.05, top_k 40), its streams carry no usage, and
a token loop lets us count exactly, stop at the context's end and cancel between
tokens. The chat template is the GGUF's own, rendered by :mod:`localrun.templates`.

Sampling runs llama.cpp's own samplers, in transformers' order: penalties, temperature,
top_k, top_p, min_p, then the draw (:mod:`.sampling`). llama-cpp-python's chain applies
the temperature last, so its filters would act at temperature 1. The seed is the
driver's (always set; 2**32 - 1, llama.cpp's "random", goes in as 0), and so is
``max_tokens``, already within the context.

**KV reuse.** The context keeps the last call's cells, and a prompt that starts as the
last one did keeps them. By default every cell of the common prefix, the last reply's
included (:func:`~.reuse.fast_prefix`, as llama-server's ``cache_prompt``): the next turn
of a chat feeds only its new message. With ``exact`` only as many as let every other
prompt token be computed by the kernel that computes it when the prompt is fed whole,
so that a reply never depends on what ran before (llama.cpp's CPU kernels are not
batch-invariant; the rule is :func:`~.reuse.reusable_prefix`, the batcher's too)
(:meth:`LlamaCppSession._keep_cells`).

**Speculative decoding** (``speculative=``, "auto" by default): on this single path a
request's tokens may come from :mod:`.speculative`'s loop instead of
``Llama.generate``: drafts from the prompt's n-grams or a draft model, verified in one
batched decode, kept only where the auto policy measures a gain.

**Several sequences at once** run in a second context over the same weights
(:mod:`.batcher`), built on the first overlap; the session hands it the loaded model as
an :class:`~.engine.Engine`.
"""

from __future__ import annotations

import codecs
import inspect
from collections.abc import Iterator, Sequence
from typing import Any

from localrun.backends.base import (
    Batcher,
    Footprint,
    GenerationStats,
    LoadRequest,
    Prompt,
    Session,
    SessionBackend,
)
from localrun.backends.installed import installed_version, missing
from localrun.backends.llama_cpp.adapters import check_adapters, load_loras
from localrun.backends.llama_cpp.batcher import make_batcher
from localrun.backends.llama_cpp.constraints import llama_cpp_processors
from localrun.backends.llama_cpp.devices import default_threads, engine_constants, placement
from localrun.backends.llama_cpp.engine import Engine
from localrun.backends.llama_cpp.facts import SPEC
from localrun.backends.llama_cpp.memory import batch_slots, element_bytes
from localrun.backends.llama_cpp.openmp import release_pool
from localrun.backends.llama_cpp.reuse import fast_prefix, reusable_prefix
from localrun.backends.llama_cpp.sampling import temperature_first
from localrun.backends.llama_cpp.speculative import SpeculativeRun, speculation_for
from localrun.backends.llama_cpp.vision import load_vision, no_projector
from localrun.backends.logprobs import check_ids, llama_row
from localrun.backends.prefix import common_prefix
from localrun.errors import ModelFileError
from localrun.formats.gguf import read_gguf
from localrun.images import Image
from localrun.memory import context_window, shape_from_gguf_metadata
from localrun.sampling import ResolvedSampling
from localrun.structured.constraint import Constraint
from localrun.templates import render_chat
from localrun.types import CancelToken, Message, ModelInfo, TokenLogprob


class LlamaCppSession(Session):
    def __init__(self, request: LoadRequest) -> None:
        try:
            import llama_cpp
        except ImportError as e:  # installed per metadata but broken
            raise missing(SPEC, reason=str(e)) from e
        gguf = read_gguf(request.path)
        check_adapters(request.adapters, request.path, gguf.architecture)  # before the load
        trained = gguf.context_length
        n_ctx = context_window(request.context, trained)
        takes = inspect.signature(llama_cpp.Llama.__init__).parameters
        options = dict(request.options)
        vision_opts: dict[str, Any] = {k: options.pop(k) for k in ("mmproj", "image_tokens")
                                       if k in options}
        place = placement(request.device, options, gguf, n_ctx,
                          flash_attn_type="flash_attn_type" in takes)
        self.placement = place
        opts: dict[str, Any] = {
            "n_threads": request.threads or default_threads(),
            # threads= caps prompts too (llama.cpp's own -t does; llama-cpp-python's
            # default for prompts is every logical CPU)
            **({"n_threads_batch": request.threads} if request.threads else {}),
            "verbose": False,
            **engine_constants(llama_cpp, place.kwargs),
        }
        try:
            llm = llama_cpp.Llama(model_path=request.path, n_ctx=n_ctx, **opts)
        except (ValueError, RuntimeError) as e:
            raise ModelFileError(request.path, f"llama.cpp could not load it ({e})") from e
        temperature_first(llm, llama_cpp)
        try:
            loras = load_loras(llama_cpp, llm, request.adapters, model_path=request.path,
                               architecture=gguf.architecture)
        except BaseException:
            llm.close()
            raise
        self._vision = load_vision(llama_cpp, llm, request.path, vision_opts,
                                   opts["n_threads"])
        self.accepts_images = self._vision is not None
        self._engine: Engine | None = Engine(
            llama_cpp, llm, shape=shape_from_gguf_metadata(gguf.metadata),
            kv_element_bytes=element_bytes(place.kwargs), loras=loras)
        self._batcher: Batcher | None = None
        try:  # speculative decoding (.speculative), with its draft model if one is given
            self._speculation = speculation_for(llama_cpp, request, self._engine,
                                                n_ctx=n_ctx, opts=opts)
        except BaseException:
            llm.close()
            raise
        #: prompt tokens at the start of the context whose cells were computed as that
        #: prompt fed whole computes them (the last call's prompt; not its reply)
        self._prompt_cells = 0
        self._piece_size = _prompt_piece(llama_cpp, llm)
        self.exact = request.exact
        model = llm._model
        self._bos = _token_text(model, llm.token_bos())
        self._eos = _token_text(model, llm.token_eos())
        self._template = gguf.chat_template
        self.chat_template, self.bos_token, self.eos_token = \
            gguf.chat_template, self._bos, self._eos
        self.sampling_defaults = dict(gguf.sampling_defaults)
        self.info = ModelInfo(
            backend="llama.cpp",
            engine_version=installed_version(SPEC) or "unknown",
            format="gguf",
            quantization=gguf.quantization,
            path=request.path,
            context_length=llm.n_ctx(),
            trained_context_length=trained,
            architecture=gguf.architecture,
            name=gguf.name,
            # a CPU-only build ignores n_gpu_layers: then it really runs on the CPU
            device=place.device if llama_cpp.llama_supports_gpu_offload() else "cpu",
            adapters=request.adapters,
        )

    @property
    def engine(self) -> Engine:
        """The loaded model (what the batcher is given); LocalrunError once closed."""
        if self._engine is None:
            from localrun.errors import LocalrunError

            raise LocalrunError("This llama.cpp session is closed", hint="load the model again")
        return self._engine

    # -- encoding ---------------------------------------------------------------------

    def _tokenize(self, text: str) -> list[int]:
        engine = self.engine
        llm = engine.llm
        if not self.exact:  # a chat's last reply as it was generated (replies.py)
            again = engine.replies.tokenize(
                text, lambda rest: llm.tokenize(rest.encode("utf-8"), add_bos=False,
                                                special=True), engine.is_special)
            if again is not None:
                return again
        # add_bos lets llama.cpp add BOS when the model asks for it, unless the
        # rendered template already starts with it (Llama 3 templates do).
        add_bos = not (self._bos and text.startswith(self._bos))
        tokens: list[int] = llm.tokenize(text.encode("utf-8"), add_bos=add_bos, special=True)
        return tokens

    def encode_chat(self, messages: Sequence[Message]) -> Prompt:
        text = render_chat(self._template, messages, bos_token=self._bos, eos_token=self._eos)
        return Prompt(self._tokenize(text), text)

    def encode_text(self, text: str) -> Prompt:
        tokens: list[int] = self.engine.llm.tokenize(text.encode("utf-8"), add_bos=True,
                                                     special=False)
        return Prompt(tokens, text)

    def encode_rendered(self, text: str) -> Prompt:
        return Prompt(self._tokenize(text), text)

    def encode_ids(self, tokens: Sequence[int]) -> Prompt:
        return Prompt(check_ids("llama.cpp", tokens, self.engine.n_vocab))

    @property
    def image_encode_seconds(self) -> float | None:
        """mtmd's encode time of the last prompt's images (``localrun bench --image``)."""
        return self._vision.last_encode_s if self._vision is not None else None

    def attach_images(self, prompt: Prompt, images: Sequence[Image]) -> Prompt:
        if self._vision is None:
            raise no_projector(self.info.path)
        text = prompt.text or ""
        add_special = not (self._bos and text.startswith(self._bos))
        tokens, chunks = self._vision.encode(self.engine.llm, text, images, add_special)
        return Prompt(tokens, text, media=chunks)

    # -- log probabilities (localrun.backends.logprobs) ----------------------------------

    features = frozenset({"logprobs", "top", "echo", "tokens", "adapters"})
    memory_facts = SPEC

    def use_adapters(self, active: tuple[tuple[str, float], ...] | None) -> None:
        engine = self.engine
        if engine.loras is not None and engine.loras.use(engine.ctx, active):
            # cells computed under another set are kept in neither mode (exact counts
            # _prompt_cells; the default, every cell the context holds)
            self._prompt_cells = 0
            engine.llm.n_tokens = 0

    def prompt_logprobs(self, prompt: Prompt, top: int) -> list[TokenLogprob]:
        """Feeds the prompt as ``Llama.eval`` does (pieces of ``n_batch`` tokens from 0),
        keeping every token's logits: its cells are then the ones a whole-prompt feed
        computes (which rows give logits changes no cell), so the reply that follows
        keeps them, as after a previous call with this prompt (:meth:`_keep_cells`)."""
        engine = self.engine
        llm, scorer = engine.llm, engine.scorer
        tokens = list(prompt.tokens)
        out = [scorer.first(tokens[0])]
        self._prompt_cells = 0
        llm.n_tokens = 0
        llm._ctx.kv_cache_seq_rm(-1, 0, -1)
        size = int(llm.n_batch)
        for start in range(0, len(tokens), size):
            piece = tokens[start:start + size]
            llm._batch.set_batch(batch=piece, n_past=start, logits_all=True)
            llm._ctx.decode(llm._batch)
            llm.input_ids[start:start + len(piece)] = piece
            llm.n_tokens = start + len(piece)
            rows = llama_row(engine.lc, engine.ctx, None, engine.n_vocab, len(piece))
            out += scorer.prompt(rows, tokens, start, top)
        self._prompt_cells = len(tokens)
        return out

    # -- constrained decoding (llguidance through logits_processor) ---------------------

    def check_constraint(self, constraint: Constraint) -> None:
        self.engine.grammar.check(constraint)

    # -- generation -------------------------------------------------------------------

    def generate(self, prompt: Prompt, sampling: ResolvedSampling, cancel: CancelToken,
                 stats: GenerationStats) -> Iterator[str]:
        engine = self.engine
        lc, llm, ctx, n_vocab = engine.lc, engine.llm, engine.ctx, engine.n_vocab
        limit = sampling.max_tokens  # the driver keeps it within the context
        assert sampling.seed is not None, "the driver sets the seed"
        # LLAMA_DEFAULT_SEED (2**32 - 1) means "draw a random one" to llama.cpp: that seed
        # goes in as 0, so that every seed localrun takes repeats its sample
        llm.set_seed(sampling.seed % lc.LLAMA_DEFAULT_SEED)
        lc.llama_perf_context_reset(ctx)
        self.use_adapters(sampling.adapters)
        if prompt.media is not None:  # images: fed here, nothing of it kept for later
            assert self._vision is not None
            self._prompt_cells = 0
            feed = self._vision.feed(llm, prompt.media)
        else:
            self._keep_cells(engine, prompt.tokens)
            feed = list(prompt.tokens)
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        to_piece, scorer = engine.piece, engine.scorer
        is_eog = lc.llama_vocab_is_eog
        vocab = engine.vocab
        mask = engine.grammar.mask(sampling.constraint) if sampling.constraint else None
        entries, top = stats.logprobs, sampling.logprobs or 0  # None: not asked
        spec = None if prompt.media is not None else \
            self._speculative(engine, prompt, sampling)  # images: never speculated
        tokens = spec.tokens() if spec is not None else llm.generate(
            feed,
            top_k=sampling.top_k,
            top_p=sampling.top_p,
            min_p=sampling.min_p,
            typical_p=1.0,
            temp=sampling.temperature,
            repeat_penalty=sampling.repetition_penalty,
            frequency_penalty=0.0,
            presence_penalty=0.0,
            mirostat_mode=0,
            logits_processor=llama_cpp_processors(mask) if mask is not None else None,
        )
        reply: list[int] = []
        try:
            for n, token in enumerate(tokens, 1):
                if n == 1 and prompt.media is None:  # the whole prompt has its cells now
                    self._prompt_cells = len(prompt.tokens)
                if entries is not None:  # the logits it was drawn from are the context's
                    entries.append(scorer.entry(llama_row(lc, ctx, -1, n_vocab), token, top))
                if is_eog(vocab, token):
                    stats.finish_reason = "stop"
                    break
                if mask is not None:
                    mask.consume(token)
                stats.completion_tokens = n
                reply.append(token)
                yield decoder.decode(to_piece(token))
                if n >= limit or cancel.cancelled:
                    stats.finish_reason = "length"
                    break
            else:
                stats.finish_reason = "length"
            tail = decoder.decode(b"", final=True)
            if tail:
                yield tail
            if not self.exact and prompt.media is None:
                engine.remember(prompt.text, list(prompt.tokens), reply)
        finally:
            tokens.close()
            if spec is not None:
                spec.report(stats)
            else:
                perf = lc.llama_perf_context(ctx)
                stats.prefill_tokens = int(perf.n_p_eval)
                stats.prefill_seconds = perf.t_p_eval_ms / 1000.0
                stats.decode_tokens = int(perf.n_eval)
                stats.decode_seconds = perf.t_eval_ms / 1000.0
            release_pool()  # this thread may not decode again soon (openmp.py)

    def _speculative(self, engine: Engine, prompt: Prompt, sampling: ResolvedSampling
                     ) -> SpeculativeRun | None:
        """This request's speculative token loop (.speculative), or None: plain
        ``Llama.generate``. Its sampler chain is the one ``Llama.generate`` builds."""
        spec = self._speculation
        if spec is None:
            return None
        mode = spec.mode_for(sampling, sampling.speculative)
        if mode == "off":
            return None
        sampler = engine.llm._init_sampler(
            top_k=sampling.top_k, top_p=sampling.top_p, min_p=sampling.min_p,
            typical_p=1.0, temp=sampling.temperature,
            repeat_penalty=sampling.repetition_penalty, frequency_penalty=0.0,
            presence_penalty=0.0, mirostat_mode=0)
        return spec.run(engine, prompt.tokens, sampler, mode, sampling.max_tokens)

    def _keep_cells(self, engine: Engine, tokens: Sequence[int]) -> None:
        """Keep the cells of the last prompt that this prompt may keep, feed what
        ``Llama.generate`` would feed in pieces that do not start where a whole-prompt
        feed's pieces (ubatches) start, and leave it only the rest to feed.

        ``reusable_prefix`` says how many: a prompt fed whole goes in pieces of
        ``self._piece_size`` tokens from 0, and the kept cells must end where feeding the
        rest keeps each token's piece computed by the same kernel. ``Llama.generate``
        keeps the longest common prefix of its ``input_ids[:n_tokens]`` and feeds the
        rest in pieces from there; so ``n_tokens`` is set to what is kept (or, after
        feeding up to the next piece boundary here, to that boundary): it cannot keep
        more. When that feeds the whole prompt, ``Llama.generate`` (0.3.32+) samples from
        the logits of that feed; older ones feed the last token again, so there the kept
        cells stop at the start of the last piece.
        """
        llm = engine.llm
        if not self.exact:
            self._keep_all(engine, tokens)
            return
        held = min(self._prompt_cells, int(llm.n_tokens))
        self._prompt_cells = 0  # until this prompt's cells are all computed
        n, size = len(tokens), self._piece_size
        keep = end = 0
        if held and size:
            cells = llm.input_ids[:held].tolist()
            keep = reusable_prefix(n, common_prefix(cells, tokens), size, held)
            end = min(keep - keep % size + size, n)
            if end == n and keep % size and not hasattr(llm, "_requires_eval"):
                keep -= keep % size
            if keep and not (_window_holds(engine, keep)
                             and llm._ctx.kv_cache_seq_rm(-1, keep, -1)):
                keep = 0
        llm.n_tokens = keep
        if keep % max(size, 1):
            llm.eval(tokens[keep:end])

    def _keep_all(self, engine: Engine, tokens: Sequence[int]) -> None:
        """The default: keep the cells of every token the context holds that this prompt
        starts with (the last prompt's and its reply's), less the last prompt token (its
        logits are drawn from); ``Llama.generate`` feeds the rest."""
        llm = engine.llm
        held = int(llm.n_tokens)
        keep = 0
        if held and self._piece_size:  # 0: a recurrent state cannot be cut back
            keep = fast_prefix(len(tokens), common_prefix(llm.input_ids[:held].tolist(),
                                                          tokens))
            if keep and not (_window_holds(engine, keep)
                             and llm._ctx.kv_cache_seq_rm(-1, keep, -1)):
                keep = 0
        llm.n_tokens = keep

    # -- several sequences at once (.batcher) -------------------------------------------

    #: False until the batcher is built (on the first overlap, or when a server asks
    #: Model.max_concurrency): its context holds capacity x this one's KV cache. Then
    #: True: a lone sequence runs through the batcher too, so that sequences arriving
    #: while it runs join it there instead of waiting for it to end.
    batch_alone = False

    def batcher(self) -> Batcher | None:
        batcher = self._batcher
        if batcher is None and self._engine is not None:
            try:
                batcher = self._batcher = make_batcher(self._engine, self.max_concurrency,
                                                       exact=self.exact,
                                                       speculation=self._speculation)
            finally:
                release_pool()  # its calibration decoded here; steps run on the engine thread
            self.batch_alone = batcher is not None
        return batcher

    def footprint(self, slots: int | None = None) -> Footprint:
        """Before the batcher is built, its batch context would reserve a KV stream of the
        whole context per slot (the slots that fit the budget, within ``slots`` and
        :attr:`max_concurrency`; under 2, none): counted in ``per_slot``, nothing built.
        Once built, its reserve (``reserved_bytes``) is in ``fixed``, whatever runs. The
        cells it reuses between calls are in those KV caches: ``kept`` is 0."""
        est = self.estimate()
        one = est.total_bytes if est is not None else 0
        batcher = self._batcher
        if batcher is not None:
            n = min(slots or batcher.capacity, batcher.capacity)
            return Footprint(n, one + (batcher.reserved_bytes or 0), 0, 0)
        asked = [n for n in (slots, self.max_concurrency) if n is not None]
        n, stream = batch_slots(self.engine, min(asked) if asked else None)
        return Footprint(n, one, stream, 0) if n > 1 else Footprint(1, one, 0, 0)

    def close(self) -> None:
        batcher, self._batcher = getattr(self, "_batcher", None), None
        if batcher is not None:  # its context goes before the model it runs on
            batcher.close()
            self.batch_alone = False
        spec, self._speculation = getattr(self, "_speculation", None), None
        if spec is not None:
            spec.close()
        vision, self._vision = getattr(self, "_vision", None), None
        if vision is not None:  # mtmd's context goes before the model it was made for
            vision.close()
        engine, self._engine = getattr(self, "_engine", None), None
        if engine is not None:
            engine.llm.close()


def _prompt_piece(lc: Any, llm: Any) -> int:
    """Tokens llama.cpp computes a prompt in at once (a ubatch), where ``Llama.eval``'s
    pieces (``n_batch`` tokens) are whole ubatches; 0 means keep no cells between calls:
    a recurrent or hybrid model's state cannot be cut back to a prefix, and pieces
    that end mid-ubatch would shift every ubatch after a kept prefix."""
    if getattr(llm, "_is_recurrent", False) or getattr(llm, "_is_hybrid", False):
        return 0
    n_batch, n_ubatch = int(llm.n_batch), int(lc.llama_n_ubatch(llm._ctx.ctx))
    return n_ubatch if n_ubatch > 0 and n_batch % n_ubatch == 0 else 0


def _window_holds(engine: Engine, keep: int) -> bool:
    """Whether the cells a token at position ``keep`` attends to are still there: a
    sliding-window cache (Gemma) drops those more than the window behind the last token
    it decoded (llama-server's check)."""
    lc = engine.lc
    if not hasattr(lc, "llama_memory_seq_pos_min"):  # before 0.3.10: no way to ask
        return True
    n_swa = int(lc.llama_model_n_swa(engine.llm._model.model))
    if n_swa <= 0:
        return True
    first = int(lc.llama_memory_seq_pos_min(lc.llama_get_memory(engine.ctx), 0))
    return first <= max(0, keep - n_swa)


def _token_text(model: Any, token: int) -> str:
    if token < 0:
        return ""
    try:
        return str(model.token_get_text(token))
    except Exception:  # some vocabularies have no text for BOS/EOS
        return ""


BACKEND = SessionBackend("llama.cpp", LlamaCppSession)
