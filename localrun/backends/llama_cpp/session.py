"""llama.cpp through llama-cpp-python: GGUF models on CPU, CUDA, Metal or Vulkan.

We drive ``Llama.generate`` token by token rather than ``create_chat_completion``:
its defaults are not neutral (min_p 0.05, top_k 40), its streams carry no usage, and
a token loop lets us count exactly, stop at the context's end and cancel between
tokens. The chat template is the GGUF's own, rendered by :mod:`localrun.templates`.

Sampling runs llama.cpp's own samplers, in transformers' order: penalties, temperature,
top_k, top_p, min_p, then the draw (:func:`temperature_first`). llama-cpp-python's
chain applies the temperature last, so its filters would act at temperature 1. The seed
is the driver's (always set; 2**32 - 1, llama.cpp's "random", goes in as 0), and so is
``max_tokens``, already within the context.

**KV reuse.** The context keeps the last call's cells, and a prompt that starts as the
last one did keeps some of them (:meth:`LlamaCppSession._keep_cells`): only as many as
let every other prompt token be computed by the kernel that computes it when the prompt
is fed whole, so that a reply never depends on what ran before (llama.cpp's CPU kernels
are not batch-invariant; the rule is the batcher's, :func:`reusable_prefix`).
llama-cpp-python's own prefix match would keep every common token, the last reply's
included, and feed the rest in pieces from there.
"""

from __future__ import annotations

import codecs
import ctypes
import inspect
import os
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from localrun.backends import engine_version, not_installed
from localrun.backends.base import (
    Batcher,
    GenerationStats,
    LoadRequest,
    Prompt,
    Session,
    check_options,
)
from localrun.backends.llama_cpp.constraints import llama_cpp_processors
from localrun.backends.llama_cpp.facts import KV_TYPES
from localrun.backends.llama_cpp.openmp import release_pool
from localrun.backends.llama_cpp.reuse import common_prefix, reusable_prefix
from localrun.backends.logprobs import Scorer, check_ids, llama_row
from localrun.errors import LocalrunError, ModelFileError
from localrun.formats.gguf import GGUFInfo, read_gguf
from localrun.memory import (
    Offload,
    context_window,
    gpu_offload,
    kv_cache_bytes,
    shape_from_gguf_metadata,
)
from localrun.sampling import ResolvedSampling
from localrun.structured.constraint import Constraint
from localrun.structured.grammar import LazyGrammar, tokenizer_from_llama
from localrun.templates import render_chat
from localrun.types import CancelToken, Message, ModelInfo, TokenLogprob

#: Device words llama.cpp takes. Each GPU kind is a llama.cpp build (CUDA, HIP, Vulkan,
#: Metal); "gpu" is whichever the installed build has. ``kind:N`` / ``kind:N,M`` name GPUs
#: in the order the build lists them (CUDA's order for CUDA and HIP builds).
GPU_KINDS = ("cuda", "rocm", "vulkan", "metal", "gpu")
#: GPU kind -> hardware vendor whose free VRAM sizes a partial offload.
VRAM_VENDOR: dict[str, str] = {"cuda": "nvidia", "rocm": "amd"}
DEVICE_HELP = "cpu, gpu, cuda, cuda:N, cuda:N,M, rocm:N, vulkan:N or metal"
_DEVICE = re.compile(rf"^(cpu|{'|'.join(GPU_KINDS)})(?::(\d+(?:,\d+)*))?$")


def default_threads() -> int:
    # llama-cpp-python's own default (cpu_count // 2) leaves half of a small machine
    # idle; on bigger ones half the logical CPUs is about the physical core count.
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return n if n <= 4 else n // 2


def parse_device(device: str | None) -> tuple[str, tuple[int, ...]]:
    """``(kind, GPU indices)`` for a device string; None: "gpu", every layer the build can."""
    if device is None:
        return "gpu", ()
    m = _DEVICE.match(device.strip().lower())
    if m is None:
        raise LocalrunError(f"Unknown device {device!r} for llama.cpp",
                            hint=f"use one of: {DEVICE_HELP}")
    kind, idx = m.group(1), m.group(2)
    if kind in ("cpu", "metal") and idx:
        raise LocalrunError(f"Unknown device {device!r} for llama.cpp",
                            hint=f"{kind} takes no index; use one of: {DEVICE_HELP}")
    return kind, tuple(sorted({int(i) for i in idx.split(",")})) if idx else ()


def free_vram(kind: str, indices: Sequence[int]) -> list[int] | None:
    """Free bytes of each GPU the model goes on, asked now (models loaded since the plan
    was made have taken some); None when unknown (no NVML/sysfs figure, Metal, Vulkan)."""
    vendor = VRAM_VENDOR.get(kind)
    if vendor is None:
        return None
    from localrun.hardware import detect_hardware

    detect_hardware.cache_clear()
    gpus = [g for g in detect_hardware().gpus if g.vendor == vendor
            and (not indices or g.index in indices)]
    sizes = [g.memory_free for g in sorted(gpus, key=lambda g: g.index)]
    if not gpus or (indices and len(gpus) != len(indices)) or any(s is None for s in sizes):
        return None
    return [int(s) for s in sizes if s is not None]


@dataclass(frozen=True)
class Placement:
    """Where llama.cpp puts a model: the Llama() keyword arguments, and for ModelInfo."""

    kwargs: dict[str, Any]
    device: str  # "cpu", "cuda:0", "gpu", ...
    offload: Offload | None = None  # set when the free VRAM was checked


def placement(device: str | None, options: Mapping[str, Any], gguf: GGUFInfo, n_ctx: int, *,
              flash_attn_type: bool,
              vram: Callable[[str, Sequence[int]], list[int] | None] | None = None
              ) -> Placement:
    """The device and engine options as llama-cpp-python's ``Llama(**kwargs)``.

    ``device="cpu"`` keeps every layer on the CPU; ``cuda:N`` puts the whole model on GPU
    N (split mode none); ``cuda:N,M`` splits layers over those GPUs (by free VRAM); a
    model larger than the free VRAM gets the layers that fit (partial offload). Flash
    attention follows llama-server: "auto" unless told. ``flash_attn_type``: the
    installed Llama takes llama.cpp's tri-state ``flash_attn_type``; 0.3.x takes only a
    bool, where False means disabled, so "auto" is sent as True there (llama.cpp runs
    flash attention on CPU, CUDA, Metal, Vulkan and ROCm).
    """
    opts = check_options("llama.cpp", options)
    kind, indices = parse_device(device)
    kw: dict[str, Any] = {}
    offload: Offload | None = None
    if kind == "cpu":
        kw["n_gpu_layers"] = 0
    else:
        kw["n_gpu_layers"] = -1
        if len(indices) == 1:
            kw["split_mode"], kw["main_gpu"] = "LLAMA_SPLIT_MODE_NONE", indices[0]
        elif len(indices) > 1:
            kw["split_mode"] = "LLAMA_SPLIT_MODE_LAYER"
        free = (vram or free_vram)(kind, indices)
        if len(indices) > 1 and "tensor_split" not in opts:
            share: dict[int, float] = dict(zip(indices, map(float, free), strict=True)) \
                if free else dict.fromkeys(indices, 1.0)
            kw["tensor_split"] = [float(share.get(i, 0.0)) for i in range(max(indices) + 1)]
        shape = shape_from_gguf_metadata(gguf.metadata)
        if free and shape is not None and "n_gpu_layers" not in opts:
            kv_type = str(opts.get("kv_cache", "f16"))
            kv = int(kv_cache_bytes(shape, n_ctx, 1) * KV_TYPES[kv_type][1])
            offload = gpu_offload(gguf.tensor_bytes or gguf.file_size, shape.n_layers, kv,
                                  sum(free))
            if not offload.full:
                kw["n_gpu_layers"] = offload.layers
    flash = opts.pop("flash_attn", "auto")
    if "kv_cache" in opts:
        kv_type = str(opts.pop("kv_cache"))
        if kv_type != "f16" and flash is False:
            raise LocalrunError(f"kv_cache={kv_type!r} needs flash attention (llama.cpp cannot "
                                "build a quantized V cache without it)",
                                hint="leave flash_attn at 'auto', or use kv_cache='f16'")
        kw["type_k"] = kw["type_v"] = KV_TYPES[kv_type][0]
    if flash_attn_type:
        kw["flash_attn_type"] = {"auto": "LLAMA_FLASH_ATTN_TYPE_AUTO",
                                 True: "LLAMA_FLASH_ATTN_TYPE_ENABLED",
                                 False: "LLAMA_FLASH_ATTN_TYPE_DISABLED"}[flash]
    else:
        kw["flash_attn"] = flash is not False
    kw.update(opts)
    label = kind + (":" + ",".join(map(str, indices)) if indices else "")
    if kw["n_gpu_layers"] == 0:
        label = "cpu"
    elif offload is not None and not offload.full:
        label += f" ({offload.layers}/{offload.total} layers; the rest on cpu)"
    return Placement(kw, label, offload)


def _engine_constants(lc: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Replace the names of llama.cpp enum values (kept readable above) with their values."""
    return {k: getattr(lc, v) if isinstance(v, str) and v.startswith(("LLAMA_", "GGML_"))
            else v for k, v in kwargs.items()}


class LlamaCppSession(Session):
    def __init__(self, request: LoadRequest) -> None:
        try:
            import llama_cpp
        except ImportError as e:  # installed per metadata but broken
            raise not_installed("llama.cpp", reason=str(e)) from e
        self._lc = llama_cpp
        gguf = read_gguf(request.path)
        trained = gguf.context_length
        n_ctx = context_window(request.context, trained)
        takes = inspect.signature(llama_cpp.Llama.__init__).parameters
        place = placement(request.device, request.options, gguf, n_ctx,
                          flash_attn_type="flash_attn_type" in takes)
        self.placement = place
        opts: dict[str, Any] = {
            "n_threads": request.threads or default_threads(),
            # threads= caps prompts too (llama.cpp's own -t does; llama-cpp-python's
            # default for prompts is every logical CPU)
            **({"n_threads_batch": request.threads} if request.threads else {}),
            "verbose": False,
            **_engine_constants(llama_cpp, place.kwargs),
        }
        try:
            self._llm = llama_cpp.Llama(model_path=request.path, n_ctx=n_ctx, **opts)
        except (ValueError, RuntimeError) as e:
            raise ModelFileError(request.path, f"llama.cpp could not load it ({e})") from e
        temperature_first(self._llm, llama_cpp)
        #: prompt tokens at the start of the context whose cells were computed as that
        #: prompt fed whole computes them (the last call's prompt; not its reply)
        self._prompt_cells = 0
        self._piece_size = _prompt_piece(llama_cpp, self._llm)
        self._vocab = self._llm._model.vocab
        # llama-cpp-python's token_to_piece returns its whole 32-byte buffer, NULs and
        # all; we call the C function ourselves and keep each token's bytes.
        self._piece_buf = ctypes.create_string_buffer(64)
        self._pieces: dict[int, bytes] = {}
        self._scorer = Scorer(self._piece)  # log probabilities (backends/logprobs.py)
        self._n_vocab = int(self._llm.n_vocab())
        self._ctx_ptr = self._llm._ctx.ctx
        model = self._llm._model
        self._bos = _token_text(model, self._llm.token_bos())
        self._eos = _token_text(model, self._llm.token_eos())
        self._template = gguf.chat_template
        self.chat_template, self.bos_token, self.eos_token = \
            gguf.chat_template, self._bos, self._eos
        self._grammar = LazyGrammar("llama.cpp", self._llg_tokenizer, self._llm.n_vocab())
        self.sampling_defaults = dict(gguf.sampling_defaults)
        self.info = ModelInfo(
            backend="llama.cpp",
            engine_version=engine_version("llama.cpp") or "unknown",
            format="gguf",
            quantization=gguf.quantization,
            path=request.path,
            context_length=self._llm.n_ctx(),
            trained_context_length=trained,
            architecture=gguf.architecture,
            name=gguf.name,
            # a CPU-only build ignores n_gpu_layers: then it really runs on the CPU
            device=place.device if llama_cpp.llama_supports_gpu_offload() else "cpu",
        )

    def _piece(self, token: int) -> bytes:
        """The bytes of one token (special tokens render as nothing), memoized."""
        piece = self._pieces.get(token)
        if piece is None:
            buf = self._piece_buf
            n = self._lc.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, False)
            if n < 0:  # longer than the buffer: -n bytes are needed
                buf = ctypes.create_string_buffer(-n)
                n = self._lc.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, False)
            piece = buf.raw[: max(n, 0)]
            self._pieces[token] = piece
        return piece

    # -- encoding ---------------------------------------------------------------------

    def _tokenize(self, text: str) -> list[int]:
        # add_bos lets llama.cpp add BOS when the model asks for it, unless the
        # rendered template already starts with it (Llama 3 templates do).
        add_bos = not (self._bos and text.startswith(self._bos))
        tokens: list[int] = self._llm.tokenize(text.encode("utf-8"), add_bos=add_bos,
                                               special=True)
        return tokens

    def encode_chat(self, messages: Sequence[Message]) -> Prompt:
        text = render_chat(self._template, messages, bos_token=self._bos, eos_token=self._eos)
        return Prompt(self._tokenize(text), text)

    def encode_text(self, text: str) -> Prompt:
        tokens: list[int] = self._llm.tokenize(text.encode("utf-8"), add_bos=True, special=False)
        return Prompt(tokens, text)

    def encode_rendered(self, text: str) -> Prompt:
        return Prompt(self._tokenize(text), text)

    def encode_ids(self, tokens: Sequence[int]) -> Prompt:
        return Prompt(check_ids("llama.cpp", tokens, self._n_vocab))

    # -- log probabilities (localrun.backends.logprobs) ----------------------------------

    features = frozenset({"logprobs", "top", "echo", "tokens"})

    def prompt_logprobs(self, prompt: Prompt, top: int) -> list[TokenLogprob]:
        """Feeds the prompt as ``Llama.eval`` does (pieces of ``n_batch`` tokens from 0),
        keeping every token's logits: its cells are then the ones a whole-prompt feed
        computes (which rows give logits changes no cell), so the reply that follows
        keeps them, as after a previous call with this prompt (:meth:`_keep_cells`)."""
        llm = self._llm
        tokens = list(prompt.tokens)
        out = [self._scorer.first(tokens[0])]
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
            rows = llama_row(self._lc, self._ctx_ptr, None, self._n_vocab, len(piece))
            out += self._scorer.prompt(rows, tokens, start, top)
        self._prompt_cells = len(tokens)
        return out

    # -- constrained decoding (llguidance through logits_processor) ---------------------

    def _llg_tokenizer(self) -> Any:
        vocab = self._vocab
        eog = [t for t in range(self._llm.n_vocab()) if self._lc.llama_vocab_is_eog(vocab, t)]
        return tokenizer_from_llama(vocab, eog)

    def check_constraint(self, constraint: Constraint) -> None:
        self._grammar.check(constraint)

    # -- generation -------------------------------------------------------------------

    def generate(
        self,
        prompt: Prompt,
        sampling: ResolvedSampling,
        cancel: CancelToken,
        stats: GenerationStats,
    ) -> Iterator[str]:
        lc, llm = self._lc, self._llm
        limit = sampling.max_tokens  # the driver keeps it within the context
        assert sampling.seed is not None, "the driver sets the seed"
        # LLAMA_DEFAULT_SEED (2**32 - 1) means "draw a random one" to llama.cpp: that seed
        # goes in as 0, so that every seed localrun takes repeats its sample
        llm.set_seed(sampling.seed % lc.LLAMA_DEFAULT_SEED)
        lc.llama_perf_context_reset(self._ctx_ptr)
        self._keep_cells(prompt.tokens)
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        to_piece = self._piece
        is_eog = lc.llama_vocab_is_eog
        vocab = self._vocab
        mask = self._grammar.mask(sampling.constraint) if sampling.constraint else None
        entries, top = stats.logprobs, sampling.logprobs or 0  # None: not asked
        tokens = llm.generate(
            prompt.tokens,
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
        try:
            for n, token in enumerate(tokens, 1):
                if n == 1:  # the whole prompt has its cells now
                    self._prompt_cells = len(prompt.tokens)
                if entries is not None:  # the logits it was drawn from are the context's
                    entries.append(self._scorer.entry(
                        llama_row(lc, self._ctx_ptr, -1, self._n_vocab), token, top))
                if is_eog(vocab, token):
                    stats.finish_reason = "stop"
                    break
                if mask is not None:
                    mask.consume(token)
                stats.completion_tokens = n
                yield decoder.decode(to_piece(token))
                if n >= limit or cancel.cancelled:
                    stats.finish_reason = "length"
                    break
            else:
                stats.finish_reason = "length"
            tail = decoder.decode(b"", final=True)
            if tail:
                yield tail
        finally:
            tokens.close()
            perf = lc.llama_perf_context(self._ctx_ptr)
            stats.prefill_tokens = int(perf.n_p_eval)
            stats.prefill_seconds = perf.t_p_eval_ms / 1000.0
            stats.decode_tokens = int(perf.n_eval)
            stats.decode_seconds = perf.t_eval_ms / 1000.0
            release_pool()  # this thread may not decode again soon (openmp.py)

    def _keep_cells(self, tokens: Sequence[int]) -> None:
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
        llm = self._llm
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
            if keep and not (self._window_holds(keep)
                             and llm._ctx.kv_cache_seq_rm(-1, keep, -1)):
                keep = 0
        llm.n_tokens = keep
        if keep % max(size, 1):
            llm.eval(tokens[keep:end])

    def _window_holds(self, keep: int) -> bool:
        """Whether the cells a token at position ``keep`` attends to are still there: a
        sliding-window cache (Gemma) drops those more than the window behind the last
        token it decoded (llama-server's check)."""
        lc = self._lc
        if not hasattr(lc, "llama_memory_seq_pos_min"):  # before 0.3.10: no way to ask
            return True
        n_swa = int(lc.llama_model_n_swa(self._llm._model.model))
        if n_swa <= 0:
            return True
        first = int(lc.llama_memory_seq_pos_min(lc.llama_get_memory(self._ctx_ptr), 0))
        return first <= max(0, keep - n_swa)

    # -- several sequences at once (localrun.backends.llama_cpp.batcher) -----------------

    #: False until the batcher is built (on the first overlap, or when a server asks
    #: Model.max_concurrency): its context holds capacity x this one's KV cache. Then
    #: True: a lone sequence runs through the batcher too, so that sequences arriving
    #: while it runs join it there instead of waiting for it to end.
    batch_alone = False

    def batcher(self) -> Batcher | None:
        batcher: Batcher | None = getattr(self, "_batcher", None)
        if batcher is None and getattr(self, "_llm", None) is not None:
            from localrun.backends.llama_cpp.batcher import make_batcher

            try:
                batcher = self._batcher = make_batcher(self)
            finally:
                release_pool()  # its calibration decoded here; steps run on the engine thread
            self.batch_alone = batcher is not None
        return batcher

    def batch_slots(self) -> tuple[int, int] | None:
        from localrun.backends.llama_cpp.batcher import batch_slots

        return batch_slots(self)

    def close(self) -> None:
        batcher = getattr(self, "_batcher", None)
        if batcher is not None:  # its context goes before the model it runs on
            batcher.close()
            self._batcher = None
            self.batch_alone = False
        llm = getattr(self, "_llm", None)
        if llm is not None:
            llm.close()
            self._llm = None  # type: ignore[assignment]


def _prompt_piece(lc: Any, llm: Any) -> int:
    """Tokens llama.cpp computes a prompt in at once (a ubatch), where ``Llama.eval``'s
    pieces (``n_batch`` tokens) are whole ubatches; 0 means keep no cells between calls:
    a recurrent or hybrid model's state cannot be cut back to a prefix, and pieces
    that end mid-ubatch would shift every ubatch after a kept prefix."""
    if getattr(llm, "_is_recurrent", False) or getattr(llm, "_is_hybrid", False):
        return 0
    n_batch, n_ubatch = int(llm.n_batch), int(lc.llama_n_ubatch(llm._ctx.ctx))
    return n_ubatch if n_ubatch > 0 and n_batch % n_ubatch == 0 else 0


def temperature_first(llm: Any, lc: Any) -> None:
    """Make ``llm`` sample as transformers does: temperature before top_k, top_p, min_p.

    ``Llama.generate`` builds its sampler chain with ``Llama._init_sampler`` on every
    call: [logits processors], penalties, top_k, typical, top_p, min_p, temp, dist, so
    top_p=0.05 at temperature 50 keeps only the most likely token. This wraps it: the
    same chain is built with a negative temperature (llama-cpp-python then adds only
    ``dist`` after the penalties), ``dist`` is taken off the end, and temp, top_k, top_p
    and min_p go in before it is put back. The logits processors (structured output)
    stay first and the seed stays the one ``dist`` was made with. Greedy (temp 0) and
    mirostat chains are left as they are. All samplers are llama.cpp's, in C: no cost
    per token.
    """
    build = llm._init_sampler

    def init_sampler(*, temp: float, top_k: int, top_p: float, min_p: float,
                     typical_p: float = 1.0, mirostat_mode: int = 0, **kwargs: Any) -> Any:
        if temp <= 0 or mirostat_mode:
            return build(temp=temp, top_k=top_k, top_p=top_p, min_p=min_p,
                         typical_p=typical_p, mirostat_mode=mirostat_mode, **kwargs)
        sampler = build(temp=-1.0, top_k=top_k, top_p=top_p, min_p=min_p,
                        typical_p=typical_p, mirostat_mode=mirostat_mode, **kwargs)
        chain = sampler.sampler
        dist = lc.llama_sampler_chain_remove(chain, lc.llama_sampler_chain_n(chain) - 1)
        sampler.add_temp(temp)
        sampler.add_top_k(top_k)
        sampler.add_typical(typical_p, 1)
        sampler.add_top_p(top_p, 1)
        sampler.add_min_p(min_p, 1)
        lc.llama_sampler_chain_add(chain, dist)
        return sampler

    llm._init_sampler = init_sampler


def _token_text(model: Any, token: int) -> str:
    if token < 0:
        return ""
    try:
        return str(model.token_get_text(token))
    except Exception:  # some vocabularies have no text for BOS/EOS
        return ""


class LlamaCppBackend:
    name = "llama.cpp"

    def load(self, request: LoadRequest) -> Session:
        return LlamaCppSession(request)


BACKEND = LlamaCppBackend()
