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
top_p (1 = off)        ``top_p``
top_k (0 = off)        ``top_k=0`` (checked: 0 samples from the whole vocabulary,
                       as top_k=vocab_size does; the engine's default is 50)
min_p (0 = off)        **not in the engine**: localrun masks logits below
                       ``max_logit + ln(min_p)`` (p < min_p * p_max) through
                       ``get_logits/set_logits`` before each token, only when > 0
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
    EngineNotInstalledError,
    EngineUnavailableError,
    LocalrunError,
    ModelFileError,
)
from localrun.formats.integrity import check_onnx_genai
from localrun.memory import context_window
from localrun.sampling import ResolvedSampling
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
                top_p=sampling.top_p,
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
        min_p_logit = math.log(sampling.min_p) if sampling.min_p > 0 and not sampling.greedy \
            else None
        t0 = time.perf_counter()
        generator.append_tokens(list(prompt.tokens))
        t1 = time.perf_counter()
        stats.prefill_tokens = len(prompt.tokens)
        stats.prefill_seconds = t1 - t0
        t_first = t_last = 0.0
        try:
            while not generator.is_done():
                if min_p_logit is not None:
                    _mask_min_p(generator, min_p_logit)
                generator.generate_next_token()
                token = int(generator.get_next_tokens()[0])
                t_last = time.perf_counter()
                if not t_first:
                    t_first = t_last
                if token in eos:
                    stats.finish_reason = "stop"
                    return
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


def _mask_min_p(generator: Any, min_p_logit: float) -> None:
    """Drop tokens with p < min_p * p_max (the engine has no min_p)."""
    import numpy as np

    logits = generator.get_logits()
    cut = logits.max(axis=-1, keepdims=True) + min_p_logit
    generator.set_logits(np.where(logits < cut, np.float32(-np.inf), logits)
                         .astype(np.float32, copy=False))


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
