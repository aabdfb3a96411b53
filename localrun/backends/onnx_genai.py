"""ONNX Runtime GenAI: GenAI model folders (genai_config.json + model.onnx) on CPU, CUDA, DML.

The engine is driven token by token on the caller's thread (``append_tokens`` for
the prompt, then ``generate_next_token``), so cancellation and early close need no
extra machinery: the API stops asking for tokens and the Generator is dropped.

How localrun's sampling options map onto ``GeneratorParams.set_search_options``:

=====================  =========================================================
localrun               ONNX Runtime GenAI
=====================  =========================================================
temperature 0          ``do_sample=False`` (greedy)
temperature > 0        ``do_sample=True``, ``temperature``
top_p (1 = off)        with top_k > 1: ``top_p`` (checked: the engine's top-k-then-
                       top-p sampler keeps exactly transformers' nucleus, at the
                       temperature). With top_k 0, or with min_p: **computed by
                       localrun** (:func:`own_nucleus`), the exact nucleus of the
                       penalized, tempered, top-k-limited distribution, masked
                       through ``get_logits/set_logits``, and the engine gets
                       ``top_p=1``: its top-p-only sampler bounds the tail loosely
                       (top_p=0.01 at temperature 1 sampled almost freely), and
                       min_p masked before its nucleus would shrink the mass it
                       measures against
top_k (0 = off)        ``top_k=0`` (checked: 0 samples from the whole vocabulary,
                       as top_k=vocab_size does; the engine's default is 50)
min_p (0 = off)        **not in the engine**: localrun masks logits below
                       ``max_logit + T * ln(min_p)`` (p < min_p * p_max at the
                       temperature T, as transformers' MinPLogitsWarper) in the
                       same pass, only when > 0
repetition_penalty     ``repetition_penalty``; gap: the engine's window (not
                       configurable), where llama.cpp and MLX use the last 64 tokens
seed                   ``random_seed``; unset draws a fresh seed
max_tokens             ``max_length`` = prompt + max_tokens (it is the TOTAL length)
stop strings           handled by localrun's API layer (the engine has none)
EOS                    ``Tokenizer.eos_token_ids`` plus genai_config / generation_config
                       ids; the engine reports no finish reason, so "stop" is
                       inferred from the last token
=====================  =========================================================
"""

from __future__ import annotations

import json
import math
import re
import secrets
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from localrun.backends import engine_version
from localrun.backends._exllama import read_chat_template
from localrun.backends.base import (
    GenerationStats,
    LoadRequest,
    Prompt,
    Session,
    check_options,
)
from localrun.backends.hf_config import (
    eos_ids,
    read_json,
    require_files,
    sampling_defaults,
    token_ids,
)
from localrun.errors import (
    ConstrainedDecodingUnavailableError,
    EngineNotInstalledError,
    EngineUnavailableError,
    LocalrunError,
    ModelFileError,
)
from localrun.formats.integrity import check_onnx_genai
from localrun.memory import context_window
from localrun.sampling import ResolvedSampling
from localrun.structured.constraint import Constraint
from localrun.structured.engines import LazyGrammar, onnx_mask_logits
from localrun.structured.grammar import tokenizer_from_json
from localrun.types import CancelToken, Message, ModelInfo

#: localrun device names -> ONNX Runtime GenAI execution providers. ``cuda:1`` / ``dml:1``
#: pick a GPU by index (the provider option ``device_id``).
PROVIDERS: dict[str, str] = {"cpu": "cpu", "cuda": "cuda", "gpu": "cuda", "dml": "dml",
                             "directml": "dml"}
_DEVICE = re.compile(r"^([a-z]+)(?::(\d+))?$")

BUILD_HINT = ("re-download the model, or build one: python -m onnxruntime_genai.models.builder "
              "-i MODEL_DIR -o OUT -p int4 -e cpu")


def _check_files(folder: Path) -> dict[str, Any]:
    """genai_config.json and the decoder it names, checked before the engine is touched."""
    require_files(folder, ("genai_config.json",), what="ONNX Runtime GenAI", hint=BUILD_HINT)
    cfg = read_json(folder / "genai_config.json", required=True)
    model = cfg.get("model")
    decoder = model.get("decoder") if isinstance(model, dict) else None
    filename = decoder.get("filename") if isinstance(decoder, dict) else None
    if not isinstance(filename, str):
        raise ModelFileError(str(folder / "genai_config.json"), "no model.decoder.filename",
                             hint=BUILD_HINT)
    require_files(folder, (filename,), what="ONNX Runtime GenAI", hint=BUILD_HINT)
    check_onnx_genai(folder)  # the external data against the .onnx files' own entries
    names = {p.name for p in folder.iterdir()}
    if not names & {"tokenizer.json", "tokenizer.model", "tokenizer_config.json"}:
        raise ModelFileError(str(folder), "ONNX Runtime GenAI model has no tokenizer "
                             "(tokenizer.json)", hint=BUILD_HINT)
    return cfg


def parse_device(device: str) -> tuple[str, int | None]:
    """``(provider, GPU index or None)`` for a device string."""
    m = _DEVICE.match(device.strip().lower())
    provider = PROVIDERS.get(m.group(1)) if m else None
    if m is None or provider is None or (provider == "cpu" and m.group(2)):
        raise LocalrunError(f"Unknown device {device!r} for ONNX Runtime GenAI",
                            hint="use one of: cpu, cuda, cuda:N, dml, dml:N")
    return provider, int(m.group(2)) if m.group(2) else None


def config_device(genai_config: dict[str, Any]) -> str:
    """Where genai_config.json runs the model: its first execution provider (and the
    device_id it names), "cpu" when it names none."""
    model = genai_config.get("model")
    decoder = model.get("decoder") if isinstance(model, dict) else None
    session = decoder.get("session_options") if isinstance(decoder, dict) else None
    entries = session.get("provider_options") if isinstance(session, dict) else None
    for entry in entries if isinstance(entries, list) else []:
        if isinstance(entry, dict) and entry:
            name, options = next(iter(entry.items()))
            provider = PROVIDERS.get(str(name).lower(), str(name).lower())
            index = options.get("device_id") if isinstance(options, dict) else None
            return f"{provider}:{index}" if index not in (None, "") else provider
    return "cpu"


def require_build(provider: str, device: str) -> None:
    """Refuse a GPU provider the installed distribution was not built with (the engine's
    own error would say only that the provider failed), naming what to install."""
    if provider == "cpu":
        return
    from localrun.backends import BACKENDS, installed_build

    spec = BACKENDS["onnx"]
    needed = next((b for b in spec.builds if b.device == provider), None)
    have = installed_build("onnx")
    if needed is None or (have is not None and have.device == provider):
        return
    current = have.dist if have is not None else spec.dists[0]
    raise EngineUnavailableError(
        "ONNX Runtime GenAI",
        f"device {device} needs the {needed.dist} build, and {current} is installed"
        + (" (CPU only)" if have is None else ""),
        hint=f"pip uninstall -y {current} && pip install 'localrun[{needed.extra}]', "
        "or load with device='cpu'")


class OnnxGenAISession(Session):
    def __init__(self, request: LoadRequest) -> None:
        path = Path(request.path).expanduser()
        genai_cfg = _check_files(path)
        model_cfg: dict[str, Any] = genai_cfg["model"]
        search = genai_cfg.get("search")
        gen_config = read_json(path / "generation_config.json")
        config = read_json(path / "config.json")
        try:
            import onnxruntime_genai as og
        except ImportError as e:  # installed per metadata but broken
            raise EngineNotInstalledError("ONNX Runtime GenAI", "onnx", reason=str(e)) from e
        self._og = og
        check_options("onnx", request.options)
        if request.device:
            provider, index = parse_device(request.device)
            device = provider + (f":{index}" if index is not None else "")
        else:  # genai_config.json decides, and is left as it is
            device = config_device(genai_cfg)
            provider, index = device.split(":")[0], None
        require_build(provider, device)
        try:
            og_config = og.Config(str(path))
            if request.device:
                og_config.clear_providers()
                if provider != "cpu":
                    og_config.append_provider(provider)
                    if index is not None:
                        og_config.set_provider_option(provider, "device_id", str(index))
            self._model = og.Model(og_config)
            self._tok = og.Tokenizer(self._model)
            # a second tokenizer for chat prompts: the rendered template already holds
            # the special tokens it wants (transformers' apply_chat_template does the same)
            self._chat_tok = og.Tokenizer(self._model)
            self._chat_tok.update_options(add_special_tokens="false")
        except LocalrunError:
            raise
        except Exception as e:  # onnxruntime_genai raises RuntimeError / OrtException
            raise ModelFileError(str(path), "ONNX Runtime GenAI could not load it "
                                 f"({str(e).strip().splitlines()[0][:300] if str(e) else e!r})",
                                 hint=BUILD_HINT) from e
        self._eos = frozenset(set(int(t) for t in self._tok.eos_token_ids)
                              | token_ids(model_cfg.get("eos_token_id"))
                              | eos_ids(gen_config, config))
        self.sampling_defaults = sampling_defaults(gen_config) if gen_config else (
            sampling_defaults(search) if isinstance(search, dict) else {})
        template = read_chat_template(path)
        self.chat_template, self.bos_token, self.eos_token = \
            template.template, template.bos_token, template.eos_token
        vocab = model_cfg.get("vocab_size")
        self._grammar = LazyGrammar("onnx", lambda: self._llg_tokenizer(path),
                                    vocab if isinstance(vocab, int) else None)
        trained = model_cfg.get("context_length")
        trained = trained if isinstance(trained, int) and trained > 0 else None
        self.info = ModelInfo(
            backend="onnx",
            engine_version=engine_version("onnx") or "unknown",
            format="onnx",
            quantization=_quantization(path),
            path=str(path),
            context_length=context_window(request.context, trained),
            trained_context_length=trained,
            architecture=str(model_cfg.get("type")) if model_cfg.get("type") else None,
            name=path.name,
            device=device,
        )

    # -- encoding ---------------------------------------------------------------------

    def encode_chat(self, messages: Sequence[Message]) -> Prompt:
        try:
            text = self._chat_tok.apply_chat_template(json.dumps(list(messages)),
                                                      add_generation_prompt=True)
        except Exception as e:
            raise LocalrunError(
                f"The model's chat template refused the conversation: {e}",
                hint="check the roles and their order (many templates require user/assistant "
                "turns to alternate)") from e
        return Prompt([int(t) for t in self._chat_tok.encode(text)], text)

    def encode_text(self, text: str) -> Prompt:
        return Prompt([int(t) for t in self._tok.encode(text)], text)

    def encode_rendered(self, text: str) -> Prompt:
        return Prompt([int(t) for t in self._chat_tok.encode(text)], text)

    # -- constrained decoding (llguidance through get_logits/set_logits) ----------------

    def _llg_tokenizer(self, folder: Path) -> Any:
        source = folder / "tokenizer.json"
        if not source.is_file():
            raise ConstrainedDecodingUnavailableError(
                "ONNX Runtime GenAI", f"{folder} has no tokenizer.json for llguidance",
                hint="structured output needs a Hugging Face fast tokenizer (tokenizer.json)")
        return tokenizer_from_json(source.read_text(encoding="utf-8"), sorted(self._eos))

    def check_constraint(self, constraint: Constraint) -> None:
        self._grammar.check(constraint)

    # -- generation -------------------------------------------------------------------

    def _params(self, sampling: ResolvedSampling, total: int) -> Any:
        params = self._og.GeneratorParams(self._model)
        options: dict[str, Any] = {
            "max_length": total,
            "min_length": 0,
            "num_beams": 1,
            "num_return_sequences": 1,
            "no_repeat_ngram_size": 0,
            "repetition_penalty": sampling.repetition_penalty,
            "do_sample": not sampling.greedy,
        }
        if not sampling.greedy:
            options.update(
                temperature=sampling.temperature,
                top_p=1.0 if own_nucleus(sampling) else sampling.top_p,
                top_k=sampling.top_k,
                random_seed=sampling.seed if sampling.seed is not None
                else secrets.randbits(31),
            )
        params.set_search_options(**options)
        return params

    def generate(
        self,
        prompt: Prompt,
        sampling: ResolvedSampling,
        cancel: CancelToken,
        stats: GenerationStats,
    ) -> Iterator[str]:
        limit = min(sampling.max_tokens, self.info.context_length - len(prompt.tokens))
        if limit <= 0:
            stats.finish_reason = "length"
            return
        generator = self._og.Generator(self._model,
                                       self._params(sampling, len(prompt.tokens) + limit))
        decode = self._tok.create_stream().decode
        eos = self._eos
        filters = not sampling.greedy and sampling.top_k != 1 and (
            sampling.min_p > 0 or own_nucleus(sampling))
        mask = self._grammar.mask(sampling.constraint) if sampling.constraint else None
        t0 = time.perf_counter()
        generator.append_tokens(list(prompt.tokens))
        t1 = time.perf_counter()
        stats.prefill_tokens = len(prompt.tokens)
        stats.prefill_seconds = t1 - t0
        t_first = t_last = 0.0
        try:
            while not generator.is_done():
                if mask is not None:  # first: min_p then measures against allowed tokens
                    onnx_mask_logits(generator, mask)
                if filters:
                    _mask_filters(generator, sampling)
                generator.generate_next_token()
                token = int(generator.get_next_tokens()[0])
                t_last = time.perf_counter()
                if not t_first:
                    t_first = t_last
                if token in eos:
                    stats.finish_reason = "stop"
                    return
                if mask is not None:
                    mask.consume(token)
                stats.completion_tokens += 1
                yield decode(token)
                if stats.completion_tokens >= limit or cancel.cancelled:
                    break
            stats.finish_reason = "length"
        finally:
            # the first token's time is the end of prefill: sampling it reads the
            # logits append_tokens computed
            stats.prefill_seconds += (t_first - t1) if t_first else 0.0
            stats.decode_tokens = max(stats.completion_tokens - 1, 0)
            stats.decode_seconds = t_last - t_first if stats.decode_tokens else 0.0
            del generator

    def close(self) -> None:
        self._tok = None
        self._chat_tok = None
        self._model = None


def own_nucleus(sampling: ResolvedSampling) -> bool:
    """Whether localrun computes top_p (see the table above) rather than the engine."""
    return sampling.top_p < 1.0 and (sampling.top_k == 0 or sampling.min_p > 0)


def _mask_filters(generator: Any, sampling: ResolvedSampling) -> None:
    """Drop the tokens top_p and min_p exclude, on the distribution transformers filters:
    repetition penalty, then temperature, then top_k (the engine applies its penalty and
    top_k after this mask: a masked token stays masked, and the kept ones are the same).
    min_p drops p < min_p * p_max (the engine has none); top_p keeps the smallest set of
    most likely tokens, among the top_k, whose probability reaches top_p. min_p is
    relative to p_max, which the nucleus always keeps, so the two sets intersect."""
    import numpy as np

    logits = generator.get_logits()  # (1, 1, vocab) float32
    row = logits.reshape(-1)
    scores = row
    if sampling.repetition_penalty != 1.0:  # the engine's: every token of the sequence
        seen = np.unique(np.asarray(generator.get_sequence(0)))
        seen = seen[(seen >= 0) & (seen < row.shape[0])]
        scores = row.copy()
        hit = scores[seen]
        scores[seen] = np.where(hit < 0, hit * sampling.repetition_penalty,
                                hit / sampling.repetition_penalty)
    kept = _nucleus(scores, sampling) if own_nucleus(sampling) else None
    if sampling.min_p > 0:
        cut = scores.max() + sampling.temperature * math.log(sampling.min_p)
        kept = np.flatnonzero(scores >= cut) if kept is None else kept[scores[kept] >= cut]
    if kept is None:
        return
    out = np.full(row.shape, -np.inf, dtype=np.float32)
    out[kept] = row[kept]
    generator.set_logits(out.reshape(logits.shape))


def _nucleus(scores: Any, sampling: ResolvedSampling) -> Any:
    """The token ids of the top_p nucleus of softmax(scores / T) over the top_k.

    Sorting the whole vocabulary costs ~3-8 ms a token on a 2-core CPU (as much as a
    SmolLM2-135M step), so only the most likely tokens are sorted: the top_k (ties
    included, as transformers' TopK keeps them), found among the tokens within a few
    logits of the best; without top_k, the tokens at least 1e-3 times as likely as the
    best, then eight times more tokens while their mass stays short of top_p."""
    import numpy as np

    size = scores.shape[0]
    best = scores.max()
    inv_t = np.float32(1.0 / sampling.temperature)
    if 0 < sampling.top_k < size:
        # the top_k lie among the tokens near the best: widen until there are enough
        width = 8.0
        pool = np.flatnonzero(scores >= best - width)
        while pool.shape[0] < sampling.top_k:
            width = width * 4 if width < 1e4 else math.inf
            pool = np.flatnonzero(scores >= best - width)
        if pool.shape[0] > sampling.top_k:
            near = scores[pool]
            cut = np.partition(near, near.shape[0] - sampling.top_k)[
                near.shape[0] - sampling.top_k]
            pool = pool[near >= cut]
        pool = pool[np.argsort(-scores[pool], kind="stable")]
        mass = np.cumsum(np.exp((scores[pool] - best) * inv_t), dtype=np.float64)
        n = int(np.searchsorted(mass, sampling.top_p * mass[-1])) + 1
        return pool[:min(n, pool.shape[0])]
    probs = np.subtract(scores, best, dtype=np.float32)
    probs *= inv_t
    np.exp(probs, out=probs)  # relative to the best token's: 1 for it
    target = sampling.top_p * float(probs.sum(dtype=np.float64))
    # first the tokens at least 1e-3 times as likely as the best (a few hundred), unless
    # the distribution is flat (a high temperature): then the k most likely
    top = np.flatnonzero(probs >= 1e-3)
    k = 0 if top.shape[0] <= 2048 else 64
    while True:
        if k:  # the k most likely, ties included
            top = np.flatnonzero(scores >= np.partition(scores, size - k)[size - k]) \
                if k < size else np.arange(size)
        top = top[np.argsort(-scores[top], kind="stable")]  # by id among equals
        mass = np.cumsum(probs[top], dtype=np.float64)
        if mass[-1] >= target or top.shape[0] >= size:
            n = int(np.searchsorted(mass, target)) + 1
            return top[:min(n, top.shape[0])]
        k = min(max(k, top.shape[0], 8) * 8, size)


def _quantization(folder: Path) -> str | None:
    """From the builder's name for the variant (cpu-int4-rtn-block-32, onnx-int4)."""
    m = re.search(r"(int4|int8|fp16|fp32|bf16)", str(folder).lower())
    if m:
        return m.group(1)
    return None


class OnnxGenAIBackend:
    name = "onnx"

    def load(self, request: LoadRequest) -> Session:
        return OnnxGenAISession(request)


BACKEND = OnnxGenAIBackend()
