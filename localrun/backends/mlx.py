"""MLX through mlx-lm: MLX-quantized folders on Apple Silicon (Metal) or Linux (CPU).

mlx streams are thread-local since mlx 0.31, and a Model is called from whichever
thread the user has: so every mlx call (load, seeding, prefill, decode) runs on one
dedicated worker thread per Session. ``generate`` hands the worker a job and reads
text pieces back from a queue; closing the generator early (stop string, cancel,
abandoned stream) sets a flag the worker checks between tokens, and waits for the
job to end, so the Session is ready for the next call.

We drive ``generate_step`` (not ``stream_generate``) so that we count exactly: EOS
is never counted as a completion token and ``max_tokens`` tokens are all yielded.

How localrun's sampling options map onto mlx-lm:

=====================  =========================================================
localrun               mlx-lm
=====================  =========================================================
temperature 0          ``make_sampler(temp=0)``: argmax (greedy)
temperature > 0        **first**, then top_k, top_p, min_p (transformers' order), from
                       mlx-lm's ``apply_top_k/apply_top_p/apply_min_p`` and
                       ``categorical_sampling``: ``make_sampler`` applies the
                       temperature last, and top_p before top_k
                       (:func:`temperature_first_sampler`)
top_p (1 = off)        ``apply_top_p`` (only when 0 < top_p < 1)
top_k (0 = off)        ``apply_top_k`` (0 = off, the same convention)
min_p (0 = off)        ``apply_min_p`` (0 = off)
repetition_penalty     ``make_logits_processors(repetition_penalty=...)`` over the
                       last :data:`REPETITION_CONTEXT` tokens (llama.cpp's window);
                       not installed at 1.0
seed                   ``mx.random.seed`` on the worker thread before each request;
                       unset draws a fresh seed
max_tokens             ``generate_step(max_tokens=...)`` and our own count
stop strings           handled by localrun's API layer (mlx-lm has none)
EOS                    the tokenizer's ``eos_token_ids`` plus every id in
                       generation_config.json
=====================  =========================================================

Text comes from mlx-lm's streaming detokenizer with its trimming of the reply's first
space turned off (:func:`keep_first_space`): a completion is the text that follows the
prompt, " the" after "The cat is", as on every other engine.
"""

from __future__ import annotations

import queue
import secrets
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

from localrun.backends import engine_version
from localrun.backends.base import (
    GenerationStats,
    LoadRequest,
    Prompt,
    Session,
    check_options,
)
from localrun.backends.hf_config import (
    architecture,
    eos_ids,
    read_json,
    require_files,
    sampling_defaults,
    trained_context,
)
from localrun.errors import (
    ConstrainedDecodingUnavailableError,
    EngineNotInstalledError,
    LocalrunError,
    ModelFileError,
)
from localrun.memory import context_window
from localrun.sampling import ResolvedSampling
from localrun.structured.constraint import Constraint
from localrun.structured.engines import LazyGrammar, mlx_processor
from localrun.structured.grammar import TokenMask, tokenizer_from_json
from localrun.types import CancelToken, FinishReason, Message, ModelInfo

#: Tokens the repetition penalty looks back over (llama.cpp's default repeat_last_n).
REPETITION_CONTEXT = 64

#: Tokenizer files of which an MLX folder needs one.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")

T = TypeVar("T")


class _Done:
    """The end of one request: why, the detokenizer's held-back text, or the error."""

    __slots__ = ("error", "reason", "tail")

    def __init__(self, reason: FinishReason | None, tail: str = "",
                 error: BaseException | None = None) -> None:
        self.reason = reason
        self.tail = tail
        self.error = error


class _Worker:
    """One thread that runs every mlx call of a Session, in order."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name="localrun-mlx", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            job()

    def submit(self, job: Callable[[], None]) -> None:
        self._jobs.put(job)

    def call(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the worker and wait for its result (or its exception)."""
        box: list[Any] = []
        done = threading.Event()

        def job() -> None:
            try:
                box.append((True, fn()))
            except BaseException as e:  # re-raised on the caller's thread
                box.append((False, e))
            done.set()

        self.submit(job)
        done.wait()
        ok, value = box[0]
        if not ok:
            raise value
        return value  # type: ignore[no-any-return]

    def stop(self) -> None:
        self._jobs.put(None)
        self._thread.join()


_SHARED: _Worker | None = None
_SHARED_LOCK = threading.Lock()


def _shared_worker() -> _Worker:
    """The one mlx thread of this process, shared by every MLX session.

    mlx streams are thread-local, and a thread that used them must not end before the
    process does: ending one worker per closed session sometimes aborted the process
    at exit ("terminate called without an active exception", seen in CI here).
    """
    global _SHARED
    with _SHARED_LOCK:
        if _SHARED is None:
            _SHARED = _Worker()
        return _SHARED


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
        check_options("mlx", request.options)
        device = _device(request.device)
        # mlx_lm.load treats a path that does not exist as a Hub repo id and downloads
        # it: the checks come first.
        _check_files(path)
        config = read_json(path / "config.json", required=True)
        gen_config = read_json(path / "generation_config.json")
        try:
            import mlx.core as mx
            import mlx_lm
            from mlx_lm import sample_utils
            from mlx_lm.generate import generate_step
            from mlx_lm.sample_utils import make_logits_processors, make_sampler
        except ImportError as e:  # installed per metadata but broken
            raise EngineNotInstalledError("MLX", "mlx", reason=str(e)) from e
        self._mx = mx
        self._generate_step = generate_step
        self._make_sampler = make_sampler
        self._sample_utils = sample_utils
        self._make_logits_processors = make_logits_processors
        self._worker: _Worker | None = _shared_worker()
        try:
            loaded: Any = self._worker.call(lambda: mlx_lm.load(str(path)))
            self._model, self._tok = loaded[0], loaded[1]
        except Exception as e:
            self._worker = None
            raise ModelFileError(str(path), f"mlx-lm could not load it "
                                 f"({type(e).__name__}: {str(e).strip()[:300]})") from e
        self._eos = frozenset(set(self._tok.eos_token_ids) | eos_ids(gen_config, config))
        self.chat_template = getattr(self._tok, "chat_template", None)
        self.bos_token = str(getattr(self._tok, "bos_token", None) or "")
        self.eos_token = str(getattr(self._tok, "eos_token", None) or "")
        vocab = config.get("vocab_size")
        self._grammar = LazyGrammar("mlx", lambda: self._llg_tokenizer(path),
                                    vocab if isinstance(vocab, int) else None)
        self.sampling_defaults = sampling_defaults(gen_config)
        quant = config.get("quantization")
        bits = quant.get("bits") if isinstance(quant, dict) else None
        trained = trained_context(config)
        self.info = ModelInfo(
            backend="mlx",
            engine_version=engine_version("mlx") or "unknown",
            format="mlx",
            quantization=f"{bits}bit" if bits else None,
            path=str(path),
            context_length=context_window(request.context, trained),
            trained_context_length=trained,
            architecture=architecture(config),
            name=str(config.get("_name_or_path") or path.name),
            device=device,
        )

    # -- encoding ---------------------------------------------------------------------

    def encode_chat(self, messages: Sequence[Message]) -> Prompt:
        try:
            text = self._tok.apply_chat_template(list(messages), add_generation_prompt=True,
                                                 tokenize=False)
        except Exception as e:  # jinja2 TemplateError, or the template's raise_exception
            raise LocalrunError(
                f"The model's chat template refused the conversation: {e}",
                hint="check the roles and their order (many templates require user/assistant "
                "turns to alternate)") from e
        # The rendered template holds the special tokens it wants: add none
        # (as transformers' apply_chat_template(tokenize=True) does).
        return Prompt(list(self._tok.encode(str(text), add_special_tokens=False)), str(text))

    def encode_text(self, text: str) -> Prompt:
        return Prompt(list(self._tok.encode(text, add_special_tokens=True)), text)

    def encode_rendered(self, text: str) -> Prompt:
        return Prompt(list(self._tok.encode(text, add_special_tokens=False)), text)

    # -- constrained decoding (llguidance as a logits processor) ------------------------

    def _llg_tokenizer(self, folder: Path) -> Any:
        source = folder / "tokenizer.json"
        if not source.is_file():
            raise ConstrainedDecodingUnavailableError(
                "MLX", f"{folder} has no tokenizer.json for llguidance",
                hint="structured output needs a Hugging Face fast tokenizer (tokenizer.json)")
        return tokenizer_from_json(source.read_text(encoding="utf-8"), sorted(self._eos))

    def check_constraint(self, constraint: Constraint) -> None:
        self._grammar.check(constraint)

    # -- generation -------------------------------------------------------------------

    def _run(self, prompt: Prompt, sampling: ResolvedSampling, limit: int, cancel: CancelToken,
             halt: threading.Event, out: queue.SimpleQueue[str | _Done],
             stats: GenerationStats, mask: TokenMask | None = None) -> None:
        """One request, on the worker thread."""
        mx = self._mx
        try:
            mx.random.seed(sampling.seed if sampling.seed is not None else secrets.randbits(32))
            sampler = self._make_sampler(temp=0.0) if sampling.greedy else \
                temperature_first_sampler(self._sample_utils, sampling)
            processors = self._make_logits_processors(
                repetition_penalty=sampling.repetition_penalty,
                repetition_context_size=REPETITION_CONTEXT,
            ) if sampling.repetition_penalty != 1.0 else None
            if mask is not None:  # first: the penalties then see only allowed tokens
                processors = [mlx_processor(mask, len(prompt.tokens)), *(processors or [])]
            detok = keep_first_space(self._tok.detokenizer)
            detok.reset()
            eos = self._eos
            steps = self._generate_step(mx.array(list(prompt.tokens)), self._model,
                                        max_tokens=limit, sampler=sampler,
                                        logits_processors=processors)
            reason: FinishReason = "length"
            t0 = time.perf_counter()
            t_first = t_last = 0.0
            n = 0
            try:
                for token, _logprobs in steps:
                    t_last = time.perf_counter()
                    if not n:
                        t_first = t_last
                    if token in eos:
                        reason = "stop"
                        break
                    n += 1
                    detok.add_token(token)
                    out.put(detok.last_segment)
                    if n >= limit or halt.is_set() or cancel.cancelled:
                        break
                detok.finalize()
                tail = detok.last_segment
            finally:
                steps.close()
                stats.prefill_tokens = len(prompt.tokens) if t_first else 0
                stats.prefill_seconds = t_first - t0 if t_first else 0.0
                stats.decode_tokens = max(n - 1, 0)
                stats.decode_seconds = t_last - t_first if n > 1 else 0.0
            out.put(_Done(reason, tail))
        except BaseException as e:  # handed to the caller's thread
            out.put(_Done(None, error=e))

    def generate(
        self,
        prompt: Prompt,
        sampling: ResolvedSampling,
        cancel: CancelToken,
        stats: GenerationStats,
    ) -> Iterator[str]:
        worker = self._worker
        if worker is None:
            raise LocalrunError("This MLX session is closed", hint="load the model again")
        limit = min(sampling.max_tokens, self.info.context_length - len(prompt.tokens))
        if limit <= 0:
            stats.finish_reason = "length"
            return
        out: queue.SimpleQueue[str | _Done] = queue.SimpleQueue()
        halt = threading.Event()
        # The worker fills the engine timings into its own stats object; we count
        # the pieces the caller actually received.
        engine_stats = GenerationStats()
        mask = self._grammar.mask(sampling.constraint) if sampling.constraint else None
        worker.submit(lambda: self._run(prompt, sampling, limit, cancel, halt, out,
                                        engine_stats, mask))
        done: _Done | None = None
        try:
            while True:
                item = out.get()
                if isinstance(item, _Done):
                    done = item
                    break
                stats.completion_tokens += 1
                yield item
            if done.error is not None:
                raise done.error
            if done.tail:
                yield done.tail
            stats.finish_reason = done.reason
        finally:
            halt.set()
            while done is None:  # closed early: wait for the worker to finish the job
                item = out.get()
                if isinstance(item, _Done):
                    done = item
            stats.prefill_tokens = engine_stats.prefill_tokens
            stats.prefill_seconds = engine_stats.prefill_seconds
            stats.decode_tokens = engine_stats.decode_tokens
            stats.decode_seconds = engine_stats.decode_seconds

    def close(self) -> None:
        worker, self._worker = self._worker, None
        if worker is not None:
            self._model = None


def temperature_first_sampler(su: Any, sampling: ResolvedSampling) -> Callable[[Any], Any]:
    """A ``generate_step`` sampler that filters the distribution at the call's temperature.

    mlx-lm's ``make_sampler`` runs top_p, min_p, then top_k on the temperature-1
    log-probabilities and divides by the temperature only to draw, so top_p=0.05 at
    temperature 50 keeps only the most likely token. Here the log-probabilities are
    divided by the temperature and renormalized first (so a low temperature cannot
    underflow top_p's probabilities to 0), then top_k, top_p and min_p act in
    transformers' order. mlx-lm's ``logits_processors`` (repetition penalty, structured
    output) run before any sampler, as transformers' processors run before its warpers.
    """
    import mlx.core as mx

    inv_t = 1.0 / sampling.temperature
    top_k, top_p, min_p = sampling.top_k, sampling.top_p, sampling.min_p

    def sample(logprobs: Any) -> Any:
        x = logprobs * inv_t
        x = x - mx.logsumexp(x, axis=-1, keepdims=True)
        if 0 < top_k < x.shape[-1]:
            x = su.apply_top_k(x, top_k)
        if 0 < top_p < 1.0:
            x = su.apply_top_p(x, top_p)
        if min_p > 0:
            x = su.apply_min_p(x, min_p, 1)
        return su.categorical_sampling(x, 1.0)

    return sample


def keep_first_space(detok: Any) -> Any:
    """mlx-lm's streaming detokenizer with the first space of the text kept.

    The BPE and SentencePiece detokenizers drop a leading space of their text
    (``_maybe_trim_space``, ``trim_space``): the reply to "The cat is" would read
    "the" where llama.cpp, OpenVINO and ONNX give " the". The naive detokenizer (models
    without tokenizer.json) decodes with the tokenizer itself and is left as it is.
    """
    if hasattr(detok, "trim_space"):  # SPMStreamingDetokenizer
        detok.trim_space = False
    if hasattr(detok, "_maybe_trim_space"):  # BPEStreamingDetokenizer

        def keep(text: str) -> str:
            return text

        detok._maybe_trim_space = keep
    return detok


class MLXBackend:
    name = "mlx"

    def load(self, request: LoadRequest) -> Session:
        return MLXSession(request)


BACKEND = MLXBackend()
