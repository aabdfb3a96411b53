"""What the ExLlamaV2 and ExLlamaV3 backends share, without importing either engine.

Both engines need CUDA to import at all (``import exllamav2`` raises ``OSError:
CUDA_HOME environment variable is not set`` on a host without it), so everything that
can be decided without the engine lives here and is tested on any machine:

- the load options (``kv_cache``, ``gpu_split``, ``tensor_parallel``, ``paged``) and
  their validation (``gpu_split`` means the same on both engines: see
  :func:`v2_weights_split`);
- the sampler settings, every field set (the engines' defaults are not neutral);
- the model folder's chat template, BOS/EOS tokens and every end-of-sequence id;
- the context that fits the free VRAM, and how the model is split across GPUs;
- the job driver: both engines' dynamic generators share ``enqueue / iterate /
  cancel`` and the result dicts they return, which become :class:`GenerationStats`.

How localrun's sampling options map onto the engines:

====================  ==============================  ==================================
localrun              ExLlamaV2Sampler.Settings       exllamav3 ComboSampler
====================  ==============================  ==================================
temperature 0         temperature 1, top_k 1,         temperature 0 (argmax)
                      top_p 0 (the engine's greedy)
temperature > 0       temperature (< 0.01 is greedy   temperature
                      in the engine's kernel)
top_p (1 = off)       top_p                           top_p
top_k (0 = off)       top_k                           top_k
min_p (0 = off)       min_p                           min_p
repetition_penalty    token_repetition_penalty over   rep_p over the whole sequence
                      the whole sequence (range -1)
seed                  job seed (None: a fresh RNG)    job seed
every other filter    off (DRY, XTC, mirostat, ...)   off
EOS                   stop_conditions = every id of generation_config.json, config.json
                      and the tokenizer (``stop_conditions=None`` never stops on EOS)
stop strings          localrun's API layer (the engine gets token ids only)
====================  ==============================  ==================================
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from localrun.backends.base import GenerationStats, Prompt, Session
from localrun.backends.hf_config import eos_ids, read_json
from localrun.errors import (
    ConstrainedDecodingUnavailableError,
    EngineNotInstalledError,
    EngineUnavailableError,
    GenerationError,
    InvalidOptionError,
    LocalrunError,
    ModelFileError,
    ModelTooLargeError,
)
from localrun.hardware import GPUInfo, HardwareProfile
from localrun.memory import CONTEXT_STEP, DEFAULT_CONTEXT_CAP, ModelShape, overhead_bytes
from localrun.sampling import ResolvedSampling
from localrun.structured.constraint import Constraint
from localrun.structured.engines import LazyGrammar
from localrun.structured.grammar import tokenizer_from_json
from localrun.types import CancelToken, FinishReason

Engine = Literal["exllamav2", "exllamav3"]
KVCache = Literal["fp16", "q8", "q6", "q4"]

GiB = 1024**3
MiB = 1024**2

#: Both engines allocate the KV cache in pages of this many tokens, and assert that the
#: cache size is a multiple of it (exllamav2 generator/dynamic.py PAGED_PAGE_SIZE,
#: exllamav3 constants.py PAGE_SIZE).
PAGE_SIZE = 256
assert PAGE_SIZE == CONTEXT_STEP

ENGINE_TITLES: dict[str, str] = {"exllamav2": "ExLlamaV2", "exllamav3": "ExLlamaV3"}

# -- load options ----------------------------------------------------------------------

KV_CACHE_CHOICES: tuple[KVCache, ...] = ("fp16", "q8", "q6", "q4")
KV_CACHE_ALIASES: dict[str, KVCache] = {
    "fp16": "fp16", "f16": "fp16", "float16": "fp16", "16": "fp16",
    "q8": "q8", "8": "q8", "int8": "q8",
    "q6": "q6", "6": "q6",
    "q4": "q4", "4": "q4", "int4": "q4",
}
#: ExLlamaV2 cache class per choice (exllamav2/cache.py). The FP8 ``ExLlamaV2Cache_8bit``
#: is left out: the dynamic generator refuses it (generator/dynamic.py __init__).
V2_CACHE_CLASS: dict[KVCache, str] = {
    "fp16": "ExLlamaV2Cache", "q8": "ExLlamaV2Cache_Q8", "q6": "ExLlamaV2Cache_Q6",
    "q4": "ExLlamaV2Cache_Q4",
}
#: ExLlamaV3 ``Cache(layer_type=CacheLayer_quant, k_bits=, v_bits=)``; None: CacheLayer_fp16.
V3_CACHE_BITS: dict[KVCache, int | None] = {"fp16": None, "q8": 8, "q6": 6, "q4": 4}
#: Bytes one cached K or V element takes. Quantized caches keep an fp16 scale per 32
#: elements (+1/16 byte). ExLlamaV2's Q6 stores K in one byte and V in half a byte
#: (weights_per_byte 1 and 2 in cache.py); ExLlamaV3 packs k_bits/8 bytes (cache/quant.py).
KV_ELEMENT_BYTES: dict[str, dict[KVCache, float]] = {
    "exllamav2": {"fp16": 2.0, "q8": 1 + 1 / 16, "q6": 0.75 + 1 / 16, "q4": 0.5 + 1 / 16},
    "exllamav3": {"fp16": 2.0, "q8": 1 + 1 / 16, "q6": 0.75 + 1 / 16, "q4": 0.5 + 1 / 16},
}
#: VRAM each engine keeps free on every GPU it loads onto: ExLlamaV2's autosplit reserves
#: at least 256 MiB (model.py load_autosplit_gen), ExLlamaV3's loader 0.5 GB by default
#: (model/model.py load_gen reserve_per_device).
ENGINE_RESERVE: dict[str, int] = {"exllamav2": 256 * MiB, "exllamav3": 512 * MiB}

#: ``gpu_split`` on both engines: the most VRAM, in GiB (the engines' "GB"), the model may
#: take on each GPU for everything (weights, KV cache, working buffers).
GPU_SPLIT_HELP = ("a list of GiB per GPU for weights + KV cache, e.g. [20, 24] "
                  "(default: autosplit)")

#: The options each backend accepts through ``localrun.load(..., **options)``.
OPTIONS: dict[str, dict[str, str]] = {
    "exllamav2": {
        "kv_cache": "fp16, q8, q6 or q4",
        "gpu_split": GPU_SPLIT_HELP,
        "paged": "True/False (default: True when flash-attn >= 2.5.7 is installed)",
        "tensor_parallel": "True/False (default: False; the engine's tensor-parallel mode "
                           "covers Llama, Mistral, Qwen2/3 and GLM-4)",
    },
    "exllamav3": {
        "kv_cache": "fp16, q8, q6 or q4",
        "gpu_split": GPU_SPLIT_HELP,
        "tensor_parallel": "True/False (default: True on two or more GPUs when the "
                           "architecture supports it)",
    },
}


@dataclass(frozen=True)
class LoadOptions:
    kv_cache: KVCache = "fp16"
    gpu_split: tuple[float, ...] | None = None
    tensor_parallel: bool | None = None  # None: decide from the GPUs (exllamav3)
    paged: bool | None = None  # None: decide from flash-attn (exllamav2)


def parse_kv_cache(engine: str, value: object) -> KVCache:
    """``fp16 | q8 | q6 | q4`` (also 16/8/6/4); raise InvalidOptionError otherwise."""
    key = str(value).strip().lower() if isinstance(value, (str, int)) and \
        not isinstance(value, bool) else None
    if key is None or key not in KV_CACHE_ALIASES:
        raise InvalidOptionError(ENGINE_TITLES.get(engine, engine), "kv_cache", value,
                                 ", ".join(KV_CACHE_CHOICES))
    return KV_CACHE_ALIASES[key]


def parse_options(engine: str, options: Mapping[str, Any]) -> LoadOptions:
    """Validate ``LoadRequest.options`` against :data:`OPTIONS`; unknown names are errors."""
    title = ENGINE_TITLES.get(engine, engine)
    known = OPTIONS[engine]
    for name, value in options.items():
        if name not in known:
            raise InvalidOptionError(title, name, value,
                                     "options " + ", ".join(sorted(known)))
    kv: KVCache = parse_kv_cache(engine, options["kv_cache"]) if "kv_cache" in options \
        else "fp16"
    split: tuple[float, ...] | None = None
    if options.get("gpu_split") is not None:
        raw = options["gpu_split"]
        if isinstance(raw, str):
            raw = [p for p in re.split(r"[,\s]+", raw.strip()) if p]
        try:
            split = tuple(float(x) for x in raw)
        except (TypeError, ValueError):
            split = None
        if not split or any(not math.isfinite(x) or x < 0 for x in split) or \
                not any(x > 0 for x in split):
            raise InvalidOptionError(title, "gpu_split", options["gpu_split"], known["gpu_split"])
    flags: dict[str, bool | None] = {}
    for name in ("tensor_parallel", "paged"):
        value = options.get(name)
        if value is not None and not isinstance(value, bool):
            raise InvalidOptionError(title, name, value, "True or False")
        flags[name] = value
    return LoadOptions(kv, split, flags["tensor_parallel"], flags["paged"])


# -- engine import ---------------------------------------------------------------------

def engine_import_error(engine: str, error: BaseException) -> LocalrunError:
    """What a failed ``import exllamav2`` / ``import exllamav3`` means for the user.

    On a host without CUDA both raise ``OSError: CUDA_HOME environment variable is not
    set`` (their extension is built on first import); a missing torch is an ImportError
    (exllamav3 raises RuntimeError with its own message).
    """
    title = ENGINE_TITLES.get(engine, engine)
    text = str(error).strip().splitlines()[0][:200] if str(error).strip() else \
        type(error).__name__
    if isinstance(error, ModuleNotFoundError) or (
            isinstance(error, RuntimeError) and "PyTorch is required" in text):
        return EngineNotInstalledError(title, engine, reason=text)
    return EngineUnavailableError(
        engine,
        f"needs an NVIDIA GPU with CUDA (or an AMD GPU with ROCm), and importing "
        f"{engine} failed: {text}",
        hint="on a GPU host install the CUDA toolkit and a CUDA build of torch (set CUDA_HOME); "
             "without a GPU use a GGUF variant with --backend llama.cpp",
    )


def no_gpu_error(engine: str, detail: str) -> EngineUnavailableError:
    return EngineUnavailableError(
        engine,
        f"needs an NVIDIA GPU with CUDA (or an AMD GPU with ROCm); {detail}",
        hint="run it on a host with a supported GPU (localrun doctor shows what was found), "
             "or use a GGUF variant with --backend llama.cpp",
    )


# -- model folder ------------------------------------------------------------------------

@dataclass(frozen=True)
class ChatTemplate:
    template: str | None  # None: the model ships none (localrun falls back to ChatML)
    bos_token: str = ""
    eos_token: str = ""
    add_bos_token: bool | None = None  # None: not said; see :func:`adds_bos`


def _token_text(value: object) -> str:
    """tokenizer_config.json keeps special tokens as a string or as an AddedToken dict."""
    if isinstance(value, str):
        return value
    content = value.get("content") if isinstance(value, dict) else None
    if isinstance(content, str):
        return content
    return ""


def _pick_template(value: object) -> str | None:
    """``chat_template`` is a string, or a list of ``{"name", "template"}`` (use "default")."""
    if isinstance(value, str) and value.strip():
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        chosen = named.get("default")
        if isinstance(chosen, str):
            return chosen
    return None


def read_chat_template(folder: Path) -> ChatTemplate:
    """The model's chat template and special tokens, as transformers would find them.

    transformers >= 4.43 may save the template as ``chat_template.jinja`` (and older
    releases as ``chat_template.json``) rather than inside ``tokenizer_config.json``;
    the first one found wins, in that order. Both engines' converters copy every
    non-tensor file to the quantized folder, so these survive quantization.
    """
    tc = read_json(folder / "tokenizer_config.json")
    template: str | None = None
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        try:
            template = jinja.read_text(encoding="utf-8") or None
        except (OSError, UnicodeDecodeError) as e:
            raise ModelFileError(str(jinja), f"unreadable ({e})") from e
    if template is None:
        template = _pick_template(read_json(folder / "chat_template.json").get("chat_template"))
    if template is None:
        template = _pick_template(tc.get("chat_template"))
    add_bos = tc.get("add_bos_token")
    return ChatTemplate(template, _token_text(tc.get("bos_token")),
                        _token_text(tc.get("eos_token")),
                        add_bos if isinstance(add_bos, bool) else None)


def adds_bos(template: ChatTemplate, tokenizer_json: Mapping[str, Any]) -> bool:
    """Whether raw text (no chat template) starts with BOS, as ``tokenizer(text)`` does.

    tokenizer_config.json's ``add_bos_token`` decides when present; else the fast
    tokenizer's post-processor adds it (Llama 3 style ``TemplateProcessing``).
    """
    if template.add_bos_token is not None:
        return template.add_bos_token
    post = tokenizer_json.get("post_processor")
    if not isinstance(post, dict) or not template.bos_token:
        return False
    processors = post.get("processors") if post.get("type") == "Sequence" else [post]
    for proc in processors if isinstance(processors, list) else []:
        if not isinstance(proc, dict) or proc.get("type") != "TemplateProcessing":
            continue
        for item in proc.get("single") or []:
            special = item.get("SpecialToken") if isinstance(item, dict) else None
            if isinstance(special, dict) and special.get("id") == template.bos_token:
                return True
    return False


def stop_token_ids(generation_config: Mapping[str, Any], config: Mapping[str, Any],
                   tokenizer_eos: int | None) -> list[int]:
    """Every end-of-sequence id: generation_config.json and config.json (an int or a
    list in either) plus the tokenizer's own EOS. The engines keep only one of them
    (``cfg.eos_token_id`` is the list's first entry), and a job without
    ``stop_conditions`` never stops on EOS."""
    ids = eos_ids(generation_config, config)
    text = config.get("text_config")
    if isinstance(text, dict):
        ids |= eos_ids({}, text)
    if isinstance(tokenizer_eos, int) and not isinstance(tokenizer_eos, bool) \
            and tokenizer_eos >= 0:
        ids.add(tokenizer_eos)
    return sorted(ids)


def quant_label(config: Mapping[str, Any]) -> str | None:
    """``4.0bpw`` for EXL2/EXL3 (``quantization_config.bits``), ``4bit`` for GPTQ."""
    qc = config.get("quantization_config")
    if not isinstance(qc, dict):
        return None
    bits = qc.get("bits")
    if isinstance(bits, bool) or not isinstance(bits, (int, float)):
        return None
    if str(qc.get("quant_method", "")).lower() in ("exl2", "exl3"):
        return f"{float(bits):.2f}bpw".replace(".00bpw", ".0bpw")
    return f"{int(bits)}bit"


def weights_bytes(folder: Path) -> int:
    """Size of the model's safetensors files (what has to go to VRAM)."""
    return sum(f.stat().st_size for f in folder.glob("*.safetensors") if f.is_file())


# -- context and GPU split -----------------------------------------------------------------

@dataclass(frozen=True)
class ContextChoice:
    context: int  # tokens a prompt plus its reply may use (what ModelInfo reports)
    cache_tokens: int  # tokens the KV cache is allocated for: context rounded up to a page
    reason: str
    kv_cache_bytes: int | None = None  # None when the model's shape or the VRAM is unknown
    budget_bytes: int | None = None


def kv_bytes_per_token(engine: str, shape: ModelShape, kv_cache: KVCache, n_gpus: int) -> float:
    """KV-cache bytes per token of context. ExLlamaV2's quantized caches also keep one
    layer's fp16 K/V per device to (de)quantize into (cache.py ExLlamaV2Cache_Q)."""
    per_elem = KV_ELEMENT_BYTES[engine][kv_cache]
    row = shape.n_kv_heads * shape.head_dim
    total = shape.n_layers * 2 * row * per_elem
    if engine == "exllamav2" and kv_cache != "fp16":
        total += max(n_gpus, 1) * 2 * row * 2
    return total


def _round_up(n: int) -> int:
    return max(-(-n // PAGE_SIZE) * PAGE_SIZE, PAGE_SIZE)


def _round_down(n: int) -> int:
    return n // PAGE_SIZE * PAGE_SIZE


def choose_context(
    engine: str,
    *,
    model: str,
    requested: int | None,
    trained: int | None,
    weights: int,
    shape: ModelShape | None,
    free_vram: Sequence[int],
    kv_cache: KVCache = "fp16",
    cap: int = DEFAULT_CONTEXT_CAP,
) -> ContextChoice:
    """The context window, and the KV cache (whole 256-token pages) that holds it.

    The caller's context capped at the trained context; without one, the trained context
    capped at ``cap``, shrunk to what the free VRAM holds. ``free_vram`` is the free bytes
    of each GPU the model will use; the weights, the engine's per-GPU reserve and
    localrun's usual overhead come off it first. A requested context that does not fit,
    or weights that leave no room for even one page, raise ModelTooLargeError (with the
    largest context that fits) before anything is loaded.
    """
    if requested is not None:
        context = min(requested, trained) if trained else requested
        reason = f"requested {requested}" + (f", capped at the trained {trained}"
                                             if context < requested else "")
    else:
        context = min(trained, cap) if trained else cap
        reason = (f"trained context {trained}" if trained and trained <= cap
                  else f"default cap {cap}")
    cache = _round_up(context)
    if shape is None or not free_vram:
        return ContextChoice(context, cache,
                             reason + " (free VRAM or model shape unknown: not checked)")
    per_token = kv_bytes_per_token(engine, shape, kv_cache, len(free_vram))
    reserve = ENGINE_RESERVE.get(engine, 256 * MiB)
    budget = sum(max(f - reserve, 0) for f in free_vram) - weights - overhead_bytes(weights)
    fits = _round_down(int(budget / per_token)) if budget > 0 and per_token > 0 else 0
    if fits >= cache:
        return ContextChoice(context, cache, reason, int(per_token * cache), budget)
    if requested is None and fits >= PAGE_SIZE:
        return ContextChoice(fits, fits, f"largest context the free VRAM holds ({reason} "
                             "did not fit)", int(per_token * fits), budget)
    title = ENGINE_TITLES.get(engine, engine)
    needed = weights + overhead_bytes(weights) + reserve * len(free_vram) + \
        int(per_token * cache)
    smaller = [k for k in KV_CACHE_CHOICES
               if KV_ELEMENT_BYTES[engine][k] < KV_ELEMENT_BYTES[engine][kv_cache]]
    if fits >= PAGE_SIZE:
        hint = f"the largest context that fits is {fits:,} tokens (context={fits})"
        if smaller:
            hint += f", or quantize the KV cache (kv_cache='{smaller[-1]}')"
    else:
        hint = ("even the weights do not fit in the free VRAM: free GPU memory, use a "
                "smaller quant, or add a GPU")
    raise ModelTooLargeError(
        model, quant=None, needed_bytes=needed, available_bytes=sum(free_vram),
        context=context, max_context=fits,
        breakdown=f"{title}: weights {weights / GiB:.2f} GiB + KV cache ({kv_cache}) "
                  f"{per_token * cache / GiB:.2f} GiB",
        hint=hint)


SplitMode = Literal["single", "autosplit", "manual", "tensor_parallel"]


@dataclass(frozen=True)
class SplitPlan:
    mode: SplitMode
    devices: tuple[int, ...]  # CUDA device indices the model goes on
    gpu_split: tuple[float, ...] | None = None  # GB per device index ("manual", "single")
    reason: str = ""


_DEVICE = re.compile(r"^(?:cuda|gpu)(?::(\d+))?$|^(\d+)$")
#: The plan's form for a split over GPUs (selection: "cuda:0,1").
_DEVICES = re.compile(r"^(?:cuda|gpu):(\d+(?:,\d+)+)$")


def parse_device(engine: str, device: str | None, n_gpus: int) -> int | None:
    """``cuda:N`` / ``gpu:N`` / ``N`` -> N; ``cuda`` / ``gpu`` / None -> None (all GPUs)."""
    if device is None:
        return None
    title = ENGINE_TITLES.get(engine, engine)
    many = _DEVICES.match(device.strip().lower())
    if many:  # the plan names every GPU it found usable: split over them all
        if sorted({int(i) for i in many.group(1).split(",")}) == list(range(n_gpus)):
            return None
        raise InvalidOptionError(title, "device", device,
                                 "cuda (all GPUs) or cuda:N; leave GPUs out with gpu_split")
    m = _DEVICE.match(device.strip().lower())
    if not m:
        raise InvalidOptionError(title, "device", device, "cuda, cuda:N (GPUs only)")
    index = m.group(1) or m.group(2)
    if index is None:
        return None
    n = int(index)
    if n >= n_gpus:
        raise InvalidOptionError(title, "device", device,
                                 f"cuda:0 to cuda:{n_gpus - 1} ({n_gpus} GPU(s) visible)")
    return n


def plan_split(engine: str, n_gpus: int, *, device: str | None, options: LoadOptions,
               supports_tp: bool = True) -> SplitPlan:
    """How the weights and the cache are spread over the visible GPUs.

    ``device="cuda:N"`` pins everything to GPU N; a ``gpu_split`` (GiB per GPU, weights and
    KV cache together: :data:`GPU_SPLIT_HELP`) is used as given; otherwise the model fills
    the GPUs in turn (autosplit), or is split tensor by tensor across them: ExLlamaV3 does
    that by default on two or more GPUs when the architecture supports it (its
    successor's point), ExLlamaV2 only when asked (``tensor_parallel=True``: the engine's
    ``load_tp`` and ``ExLlamaV2Cache_TP``, which its own loader calls "not fully supported
    for all models"). ``supports_tp`` is the architecture's own flag (ExLlamaV2
    ``cfg.arch.lm.supports_tp``, ExLlamaV3 ``model.caps["supports_tp"]``).
    """
    if n_gpus < 1:
        raise no_gpu_error(engine, "the engine sees no GPU")
    pinned = parse_device(engine, device, n_gpus)
    title = ENGINE_TITLES.get(engine, engine)
    if pinned is not None:
        if options.tensor_parallel:
            raise InvalidOptionError(title, "tensor_parallel", True,
                                     "False when a single device is named")
        split = tuple([0.0] * pinned + [1e6])
        return SplitPlan("single", (pinned,), split, f"device {device} named")
    if options.tensor_parallel and not supports_tp:
        raise InvalidOptionError(title, "tensor_parallel", True,
                                 f"False ({title} has no tensor-parallel support for this "
                                 "model's architecture)")
    if options.gpu_split is not None:
        split = options.gpu_split
        if len(split) > n_gpus:
            raise InvalidOptionError(title, "gpu_split", list(split),
                                     f"at most {n_gpus} values ({n_gpus} GPU(s) visible)")
        devices = tuple(i for i, gb in enumerate(split) if gb > 0)
        mode: SplitMode = "tensor_parallel" if options.tensor_parallel else "manual"
        return SplitPlan(mode, devices, split, "gpu_split given")
    devices = tuple(range(n_gpus))
    by_default = supports_tp and engine == "exllamav3"
    wanted = options.tensor_parallel if options.tensor_parallel is not None else by_default
    if wanted and n_gpus >= 2:
        return SplitPlan("tensor_parallel", devices, None, f"tensor-parallel across {n_gpus} GPUs")
    why = "one GPU" if n_gpus == 1 else f"layers filled across {n_gpus} GPUs in turn"
    if wanted and n_gpus == 1:
        why += " (tensor parallel needs two or more)"
    return SplitPlan("autosplit", devices, None, why)


def v2_weights_split(split: SplitPlan, weights: int, cache_bytes: int | None) -> list[float]:
    """The ``gpu_split`` to hand ExLlamaV2's ``model.load()``, from localrun's.

    localrun's ``gpu_split`` (and ExLlamaV3's ``use_per_device``, and ExLlamaV2's own
    ``load_tp``) is what the model may take on each GPU, KV cache included. ExLlamaV2's
    ``load(gpu_split)`` budgets weights and fixed buffers only ("Does not account for the
    size of the cache", model.py); the cache then goes on top, on whichever GPU holds each
    layer. Every layer brings the same share of the cache as of the weights, so a GPU
    given ``w`` GiB of weights ends up holding ``w * (W + C) / W``: it gets
    ``g * W / (W + C)`` of its ``g`` GiB for weights. (Embeddings and the output head
    carry no cache, so this errs on the safe side.) Only "manual" plans are converted;
    "single" already gives its GPU everything.
    """
    assert split.gpu_split is not None
    if split.mode != "manual" or not cache_bytes or weights <= 0:
        return list(split.gpu_split)
    share = weights / (weights + cache_bytes)
    return [gb * share for gb in split.gpu_split]


# -- sampling ---------------------------------------------------------------------------------

#: Every ``ExLlamaV2Sampler.Settings`` field that changes sampling, set to "off"
#: (exllamav2 generator/sampler.py). The class defaults are not neutral: temperature 0.8,
#: top_k 50, top_p 0.8, token_repetition_penalty 1.025.
V2_NEUTRAL: dict[str, Any] = {
    "token_repetition_penalty": 1.0,
    "token_repetition_range": -1,  # -1: the whole sequence, as transformers does
    "token_repetition_decay": 0,
    "token_frequency_penalty": 0.0,
    "token_presence_penalty": 0.0,
    "temperature": 1.0,
    "smoothing_factor": 0.0,
    "min_temp": 0.0,
    "max_temp": 0.0,
    "temp_exponent": 1.0,
    "top_k": 0,
    "top_p": 1.0,
    "top_a": 0.0,
    "min_p": 0.0,
    "tfs": 0.0,
    "typical": 0.0,
    "skew": 0.0,
    "temperature_last": False,
    "mirostat": False,
    "mirostat_tau": 1.5,
    "mirostat_eta": 0.1,
    "mirostat_mu": None,
    "token_bias": None,
    "cfg_scale": None,
    "dry_allowed_length": 2,
    "dry_base": 1.75,
    "dry_multiplier": 0.0,
    "dry_sequence_breakers": None,
    "dry_range": 0,
    "dry_max_ngram": 20,
    "xtc_probability": 0.0,
    "xtc_threshold": 0.1,
    "xtc_ignore_tokens": None,
}


def v2_sampler_settings(s: ResolvedSampling) -> dict[str, Any]:
    """Keyword arguments for ``ExLlamaV2Sampler.Settings(**kw)``: every field explicit."""
    kw = dict(V2_NEUTRAL)
    kw["token_repetition_penalty"] = s.repetition_penalty
    if s.greedy:
        # The engine's own greedy settings (Settings.greedy): top_k 1 is argmax.
        kw.update(temperature=1.0, top_k=1, top_p=0.0, min_p=0.0)
    else:
        kw.update(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, min_p=s.min_p)
    return kw


#: ``exllamav3.ComboSampler`` arguments that are "off" (generator/sampler/presets.py).
V3_NEUTRAL: dict[str, Any] = {
    "rep_p": 1.0,
    "freq_p": 0.0,
    "pres_p": 0.0,
    "rep_sustain_range": int(10e7),  # the whole sequence
    "rep_decay_range": 0,
    "dry_multiplier": 0.0,
    "dry_base": 1.75,
    "dry_allowed_length": 2,
    "dry_range": 0,
    "dry_sequence_breakers": None,
    "temperature": 1.0,
    "min_p": 0.0,
    "top_k": 0,
    "top_p": 1.0,
    "temp_last": False,
    "adaptive_target": 1.0,
    "adaptive_decay": 0.9,
    "logit_bias": None,
}


def v3_sampler_kwargs(s: ResolvedSampling) -> dict[str, Any]:
    """Keyword arguments for ``exllamav3.ComboSampler(**kw)`` (a job without a sampler
    gets DefaultSampler: min_p 0.08, temperature 0.8)."""
    kw = dict(V3_NEUTRAL)
    kw["rep_p"] = s.repetition_penalty
    if s.greedy:
        kw.update(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0)  # ComboSampler: argmax
    else:
        kw.update(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, min_p=s.min_p)
    return kw


# -- job results ---------------------------------------------------------------------------------

#: A finished job's ``eos_reason`` -> localrun's finish reason.
EOS_REASONS: dict[str, FinishReason] = {
    "stop_token": "stop",
    "stop_string": "stop",
    "end_filter": "stop",
    "max_new_tokens": "length",
}


def token_count(ids: object) -> int:
    """Tokens in a result's ``token_ids`` (a (1, n) tensor) or a plain sequence."""
    shape = getattr(ids, "shape", None)
    if shape is not None:
        return int(shape[-1]) if len(shape) else 1
    if isinstance(ids, Sequence):
        inner = ids[0] if ids and isinstance(ids[0], Sequence) else ids
        return len(inner)
    return 0


def apply_final_result(result: Mapping[str, Any], stats: GenerationStats) -> None:
    """Fill ``stats`` from a job's last result (``"eos": True``).

    ``new_tokens`` counts the stop token that ended the job; localrun does not (as on
    every other engine). ``time_prefill`` runs from the first prefill to the first
    sampled token, ``time_generate`` from there to the last one, so decode covers
    ``new_tokens - 1`` steps. Pages the engine found in its prefix cache were not
    prefilled again: they are left out of the prefill count.
    """
    reason = result.get("eos_reason")
    new = int(result.get("new_tokens", stats.completion_tokens))
    stats.finish_reason = EOS_REASONS.get(str(reason), "length")
    stats.completion_tokens = max(new - 1, 0) if reason == "stop_token" else new
    prompt = int(result.get("prompt_tokens", 0))
    cached = int(result.get("cached_tokens", 0))
    stats.prefill_tokens = max(prompt - cached, 1) if prompt else 0
    stats.prefill_seconds = max(float(result.get("time_prefill", 0.0)), 0.0)
    stats.decode_tokens = max(new - 1, 0)
    stats.decode_seconds = max(float(result.get("time_generate", 0.0)), 0.0)


class EngineJobError(GenerationError):
    """Sequences the engine gave up on: exllamav3 reports a job that failed in page
    allocation or prefill with an ``"stage": "error"`` result (``Generator.reap_failed_job``)
    and keeps serving the others; a job that leaves the engine's queues without a final
    result is reported the same way rather than waited for."""

    def __init__(self, engine: str, failures: Mapping[int, object]) -> None:
        self.failures = dict(failures)
        first = self.failures[min(self.failures)]
        what = f"{type(first).__name__}: {first}" if isinstance(first, BaseException) else \
            "the job left the engine's queue without a result"
        which = ", ".join(str(i) for i in sorted(self.failures))
        noun = "sequence" if len(self.failures) == 1 else "sequences"
        super().__init__(ENGINE_TITLES.get(engine, engine or "ExLlama"),
                         f"{noun} {which}: {what}")


#: Builds one engine job: (prompt, sampling, max_new_tokens, identifier) -> job object.
MakeJob = Callable[[Prompt, ResolvedSampling, int, int], Any]


def run_jobs(
    generator: Any,
    make_job: MakeJob,
    prompts: Sequence[Prompt],
    samplings: Sequence[ResolvedSampling],
    cancels: Sequence[CancelToken],
    stats: Sequence[GenerationStats],
    limits: Sequence[int],
    max_concurrency: int | None,
    engine: str = "",
) -> Iterator[tuple[int, str | None]]:
    """Drive a dynamic generator (ExLlamaV2DynamicGenerator or exllamav3 Generator).

    Yields ``(index, text)`` as the engine streams, then ``(index, None)`` once a
    sequence is done (finished, cancelled, or given no room). At most
    ``max_concurrency`` jobs are queued at once; the generator batches those it can
    fit. A cancel token set between iterations cancels that job in the engine
    (``generator.cancel(job)``); closing this iterator cancels every job still queued.

    Results are matched to sequences by their ``"job"`` object (``"serial"`` as a
    fallback): every result of both engines carries those, while ``"identifier"`` is
    missing from exllamav3's failed-job results. A failed job ends only its own sequence;
    the others run on, and :class:`EngineJobError` is raised once they are done. An
    exception out of ``iterate()`` itself (ExLlamaV2 contains no failures, nor does
    exllamav3 in the forward pass) ends the whole call.

    Text the engine still holds back when a stop token ends a job (the result's
    ``"held"``: the stop token's own piece, and any incomplete UTF-8 before it) is not
    part of the reply. A requeued job (exllamav3 ``"requeue"``) is the same job object
    with the same serial; its second ``"started"`` does not restart the clock.
    """
    n = len(prompts)
    waiting = list(range(n))
    active: dict[int, Any] = {}  # index -> the engine's job
    by_job: dict[int, int] = {}  # id(job) -> index, while the job is active
    by_serial: dict[int, int] = {}
    failed: dict[int, object] = {}  # index -> the engine's error (None: the job vanished)
    cap = max_concurrency or n

    def forget(i: int) -> Any:
        job = active.pop(i)
        by_job.pop(id(job), None)
        for serial in [k for k, v in by_serial.items() if v == i]:
            del by_serial[serial]
        return job

    def index_of(r: Mapping[str, Any]) -> int | None:
        job = r.get("job")
        i = by_job.get(id(job)) if job is not None else None
        if i is not None and active.get(i) is job:
            return i
        serial = r.get("serial")
        return by_serial.get(serial) if isinstance(serial, int) else None

    try:
        while waiting or active:
            for i in [i for i in active if cancels[i].cancelled]:
                generator.cancel(forget(i))
                yield i, None
            while waiting and len(active) < cap:
                i = waiting.pop(0)
                if cancels[i].cancelled or limits[i] <= 0:
                    if limits[i] <= 0:
                        stats[i].finish_reason = "length"
                    yield i, None
                    continue
                job = make_job(prompts[i], samplings[i], limits[i], i)
                serial = generator.enqueue(job)
                active[i] = job
                by_job[id(job)] = i
                if isinstance(serial, int) and not isinstance(serial, bool):
                    by_serial[serial] = i
            if not active:
                continue
            for r in generator.iterate():
                found = index_of(r)
                if found is None:
                    continue
                i = found
                stage = r.get("stage")
                if stage == "error":
                    forget(i)
                    failed[i] = r.get("error")
                    continue
                if stage == "started":
                    if not stats[i].started:  # a requeued job starts again
                        stats[i].started = time.perf_counter()
                    continue
                if stage != "streaming":
                    continue  # "prefill": progress through the prompt
                count = token_count(r["token_ids"]) if "token_ids" in r else 0
                text = r.get("text", "")
                if count or text:
                    stats[i].completion_tokens += count
                    yield i, text
                if r.get("eos"):
                    forget(i)
                    apply_final_result(r, stats[i])
                    yield i, None
            remaining = getattr(generator, "num_remaining_jobs", None)
            if active and remaining is not None and remaining() == 0:
                # The engine holds none of them: waiting would spin forever on empty results.
                for i in list(active):
                    forget(i)
                    failed[i] = None
    finally:
        for job in active.values():
            with contextlib.suppress(Exception):  # the engine may be gone (closed session)
                generator.cancel(job)
    if failed:
        error = EngineJobError(engine, failed)
        first = failed[min(failed)]
        raise error from (first if isinstance(first, BaseException) else None)


class ExLlamaSession(Session):
    """The engine-independent half of both sessions: generation over :func:`run_jobs`."""

    generator: Any
    context: int
    _grammar: LazyGrammar | None = None

    def _structured_setup(self, folder: Path, template: ChatTemplate, bos: str, eos: str,
                          stop: Sequence[int], vocab: object) -> None:
        """The chat template for tool rendering, and llguidance from tokenizer.json."""
        self.chat_template, self.bos_token, self.eos_token = template.template, bos, eos
        width = vocab if isinstance(vocab, int) else None

        def tokenizer() -> Any:
            source = folder / "tokenizer.json"
            if not source.is_file():
                raise ConstrainedDecodingUnavailableError(
                    ENGINE_TITLES.get(self.info.backend, "ExLlama"),
                    f"{folder} has no tokenizer.json for llguidance",
                    hint="structured output needs a Hugging Face fast tokenizer")
            return tokenizer_from_json(source.read_text(encoding="utf-8"), list(stop), width)

        self._grammar = LazyGrammar(self.info.backend, tokenizer, width)

    def _encode(self, text: str, *, add_bos: bool, special: bool) -> list[int]:
        raise NotImplementedError  # pragma: no cover - engine-specific

    def encode_rendered(self, text: str) -> Prompt:
        return Prompt(self._encode(text, add_bos=False, special=True), text)

    def check_constraint(self, constraint: Constraint) -> None:
        if self._grammar is None:
            super().check_constraint(constraint)
        else:
            self._grammar.check(constraint)

    def make_job(self, prompt: Prompt, sampling: ResolvedSampling, limit: int,
                 identifier: int) -> Any:  # pragma: no cover - engine-specific
        raise NotImplementedError

    def _limit(self, prompt: Prompt, sampling: ResolvedSampling) -> int:
        return min(sampling.max_tokens, self.context - len(prompt.tokens))

    def generate(
        self,
        prompt: Prompt,
        sampling: ResolvedSampling,
        cancel: CancelToken,
        stats: GenerationStats,
    ) -> Iterator[str]:
        for _, piece in run_jobs(self.generator, self.make_job, [prompt], [sampling],
                                 [cancel], [stats], [self._limit(prompt, sampling)], 1,
                                 self.info.backend):
            if piece is not None:
                yield piece

    def generate_batch(
        self,
        prompts: Sequence[Prompt],
        samplings: Sequence[ResolvedSampling],
        cancels: Sequence[CancelToken],
        stats: Sequence[GenerationStats],
        max_concurrency: int | None,
    ) -> Iterator[tuple[int, str | None]]:
        limits = [self._limit(p, s) for p, s in zip(prompts, samplings, strict=True)]
        return run_jobs(self.generator, self.make_job, prompts, samplings, cancels, stats,
                        limits, max_concurrency, self.info.backend)


def read_model_json(folder: Path) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """config.json (required), generation_config.json and tokenizer.json (optional)."""
    config = read_json(folder / "config.json", required=True)
    gen = read_json(folder / "generation_config.json")
    tok_path = folder / "tokenizer.json"
    tok: dict[str, Any] = {}
    if tok_path.is_file():
        try:
            data = json.loads(tok_path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ModelFileError(str(tok_path), f"unreadable JSON ({e})") from e
        tok = data if isinstance(data, dict) else {}
    return config, gen, tok


# -- what a load needs from the host ---------------------------------------------------------

#: GPU vendors each engine has kernels for (both build for CUDA and ROCm).
ENGINE_VENDORS: dict[str, tuple[str, ...]] = {
    "exllamav2": ("nvidia", "amd"), "exllamav3": ("nvidia", "amd"),
}


def detected_gpus(engine: str, profile: HardwareProfile | None = None) -> list[GPUInfo]:
    """The GPUs this host has that the engine has kernels for (NVML / nvidia-smi / sysfs)."""
    if profile is None:
        from localrun.hardware import detect_hardware

        profile = detect_hardware()
    return [g for g in profile.gpus if g.vendor in ENGINE_VENDORS.get(engine, ("nvidia",))
            and not g.integrated]


def probe_cuda(engine: str, profile: HardwareProfile | None = None) -> list[int]:
    """Free bytes of each CUDA device torch sees, or raise before the engine is imported.

    A host where neither NVML, ``nvidia-smi`` nor sysfs shows a GPU and no torch is
    installed is refused at once: importing the engine there would try to build its
    CUDA extension first. Otherwise torch decides (``torch.cuda.is_available()``), and
    ``torch.cuda.mem_get_info`` gives the free memory right now.
    """
    import importlib
    import importlib.util

    gpus = detected_gpus(engine, profile)
    if not gpus and importlib.util.find_spec("torch") is None:
        raise no_gpu_error(engine, "no GPU was found on this host (NVML, nvidia-smi and sysfs "
                           "show none)")
    try:
        torch: Any = importlib.import_module("torch")
    except ImportError as e:
        raise EngineNotInstalledError(ENGINE_TITLES.get(engine, engine), engine,
                                      reason=f"torch is missing ({e})") from e
    if not torch.cuda.is_available():
        detail = ("torch sees no CUDA device (a CPU-only torch build, or the driver is not "
                  "loaded)") if gpus else "no GPU was found on this host"
        raise no_gpu_error(engine, detail)
    return [int(torch.cuda.mem_get_info(i)[0]) for i in range(torch.cuda.device_count())]


def free_for_split(free: Sequence[int], split: SplitPlan) -> list[int]:
    """The free bytes the model may use on each of its devices (capped by gpu_split GB)."""
    out = []
    for i in split.devices:
        cap = int(split.gpu_split[i] * GiB) if split.gpu_split is not None and \
            i < len(split.gpu_split) else None
        out.append(min(free[i], cap) if cap is not None else free[i])
    return out


def load_failure(engine: str, path: str, error: BaseException) -> LocalrunError:
    """An exception from the engine's config/model/cache/tokenizer constructors, mapped."""
    title = ENGINE_TITLES.get(engine, engine)
    text = str(error).strip().splitlines()[0][:300] if str(error).strip() else \
        type(error).__name__
    if "out of memory" in text.lower():
        return LocalrunError(f"{title} ran out of GPU memory while loading {path}: {text}",
                             hint="load with a smaller context (context=...), a quantized KV "
                                  "cache (kv_cache='q4'), or a smaller quant")
    return ModelFileError(path, f"{title} could not load it ({type(error).__name__}: {text})",
                          hint=f"check that it is a complete {title} model folder; "
                               "re-download or re-quantize it")


def model_name(config: Mapping[str, Any], folder: Path) -> str:
    name = config.get("_name_or_path")
    return name if isinstance(name, str) and name else folder.name
