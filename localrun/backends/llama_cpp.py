"""llama.cpp through llama-cpp-python: GGUF models on CPU, CUDA, Metal or Vulkan.

We drive ``Llama.generate`` token by token rather than ``create_chat_completion``:
its defaults are not neutral (min_p 0.05, top_k 40), its streams carry no usage, and
a token loop lets us count exactly, stop at the context's end and cancel between
tokens. The chat template is the GGUF's own, rendered by :mod:`localrun.templates`.
"""

from __future__ import annotations

import codecs
import ctypes
import os
from collections.abc import Iterator, Sequence
from typing import Any

from localrun.backends import engine_version
from localrun.backends.base import GenerationStats, LoadRequest, Prompt, Session
from localrun.errors import EngineNotInstalledError, ModelFileError
from localrun.formats.gguf import read_gguf
from localrun.sampling import ResolvedSampling
from localrun.templates import render_chat
from localrun.types import CancelToken, Message, ModelInfo

#: Context used when the caller gives none: the trained context, capped here so a
#: 128k-context model does not reserve gigabytes of KV cache by default.
DEFAULT_CONTEXT_CAP = 8192


def default_threads() -> int:
    # llama-cpp-python's own default (cpu_count // 2) leaves half of a small machine
    # idle; on bigger ones half the logical CPUs is about the physical core count.
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return n if n <= 4 else n // 2


class LlamaCppSession(Session):
    def __init__(self, request: LoadRequest) -> None:
        try:
            import llama_cpp
        except ImportError as e:  # installed per metadata but broken
            raise EngineNotInstalledError("llama.cpp", "llama-cpp", reason=str(e)) from e
        self._lc = llama_cpp
        gguf = read_gguf(request.path)
        trained = gguf.context_length
        n_ctx = request.context or min(trained or DEFAULT_CONTEXT_CAP, DEFAULT_CONTEXT_CAP)
        opts: dict[str, Any] = {
            "n_gpu_layers": -1,
            "n_threads": request.threads or default_threads(),
            "verbose": False,
        }
        opts.update(request.options)
        try:
            self._llm = llama_cpp.Llama(model_path=request.path, n_ctx=n_ctx, **opts)
        except (ValueError, RuntimeError) as e:
            raise ModelFileError(request.path, f"llama.cpp could not load it ({e})") from e
        self._vocab = self._llm._model.vocab
        # llama-cpp-python's token_to_piece returns its whole 32-byte buffer, NULs and
        # all; we call the C function ourselves and keep each token's bytes.
        self._piece_buf = ctypes.create_string_buffer(64)
        self._pieces: dict[int, bytes] = {}
        self._ctx_ptr = self._llm._ctx.ctx
        model = self._llm._model
        self._bos = _token_text(model, self._llm.token_bos())
        self._eos = _token_text(model, self._llm.token_eos())
        self._template = gguf.chat_template
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
            device="gpu" if llama_cpp.llama_supports_gpu_offload() and opts["n_gpu_layers"] != 0
            else "cpu",
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

    # -- generation -------------------------------------------------------------------

    def generate(
        self,
        prompt: Prompt,
        sampling: ResolvedSampling,
        cancel: CancelToken,
        stats: GenerationStats,
    ) -> Iterator[str]:
        lc, llm = self._lc, self._llm
        limit = min(sampling.max_tokens, llm.n_ctx() - len(prompt.tokens))
        llm.set_seed(sampling.seed if sampling.seed is not None else lc.LLAMA_DEFAULT_SEED)
        lc.llama_perf_context_reset(self._ctx_ptr)
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        to_piece = self._piece
        is_eog = lc.llama_vocab_is_eog
        vocab = self._vocab
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
        )
        try:
            for n, token in enumerate(tokens, 1):
                if is_eog(vocab, token):
                    stats.finish_reason = "stop"
                    break
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

    def close(self) -> None:
        llm = getattr(self, "_llm", None)
        if llm is not None:
            llm.close()
            self._llm = None  # type: ignore[assignment]


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
