"""The context that fits the free VRAM, and how a model is split across GPUs.

The KV cache's size per token is :meth:`localrun.memory.ModelShape.kv_bytes_per_token`
at the element size of the chosen cache (:data:`KV_ELEMENT_BYTES`); the context rule is
:func:`localrun.memory.context_window` and the overhead the engine's memory row
(:mod:`localrun.backends.exllama.facts`), as for every other engine. What is ExLlama's
own: whole 256-token pages, each engine's per-GPU reserve, ExLlamaV2's dequantization
buffers, and the GPU split.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Literal

from localrun.backends.exllama.errors import no_gpu_error
from localrun.backends.exllama.facts import SPECS
from localrun.backends.exllama.options import KV_CACHE_CHOICES, KVCache, LoadOptions, title
from localrun.errors import InvalidOptionError, ModelTooLargeError
from localrun.memory import (
    CONTEXT_STEP,
    DEFAULT_CONTEXT_CAP,
    ModelShape,
    context_window,
    memory_row,
    overhead_bytes,
)

GiB = 1024**3
MiB = 1024**2

#: Both engines allocate the KV cache in pages of this many tokens, and assert that the
#: cache size is a multiple of it (exllamav2 generator/dynamic.py PAGED_PAGE_SIZE,
#: exllamav3 constants.py PAGE_SIZE).
PAGE_SIZE = 256
assert PAGE_SIZE == CONTEXT_STEP

#: Bytes one cached K or V element takes, on both engines. Quantized caches keep an fp16
#: scale per 32 elements (+1/16 byte). ExLlamaV2's Q6 stores K in one byte and V in half
#: a byte (weights_per_byte 1 and 2 in cache.py); ExLlamaV3 packs k_bits/8 bytes
#: (cache/quant.py).
KV_ELEMENT_BYTES: dict[KVCache, float] = {
    "fp16": 2.0, "q8": 1 + 1 / 16, "q6": 0.75 + 1 / 16, "q4": 0.5 + 1 / 16,
}
#: VRAM each engine keeps free on every GPU it loads onto: ExLlamaV2's autosplit reserves
#: at least 256 MiB (model.py load_autosplit_gen), ExLlamaV3's loader 0.5 GB by default
#: (model/model.py load_gen reserve_per_device).
ENGINE_RESERVE: dict[str, int] = {"exllamav2": 256 * MiB, "exllamav3": 512 * MiB}


@dataclass(frozen=True)
class ContextChoice:
    context: int  # tokens a prompt plus its reply may use (what ModelInfo reports)
    cache_tokens: int  # tokens the KV cache is allocated for: context rounded up to a page
    reason: str
    kv_cache_bytes: int | None = None  # None when the model's shape or the VRAM is unknown
    budget_bytes: int | None = None


def kv_bytes_per_token(engine: str, shape: ModelShape, kv_cache: KVCache, n_gpus: int) -> int:
    """KV-cache bytes per token of context. ExLlamaV2's quantized caches also keep one
    layer's fp16 K/V per device to (de)quantize into (cache.py ExLlamaV2Cache_Q)."""
    total = shape.kv_bytes_per_token(KV_ELEMENT_BYTES[kv_cache])
    if engine == "exllamav2" and kv_cache != "fp16":
        total += max(n_gpus, 1) * replace(shape, n_layers=1).kv_bytes_per_token(2)
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
) -> ContextChoice:
    """The context window, and the KV cache (whole 256-token pages) that holds it.

    The context every backend loads with (:func:`localrun.memory.context_window`),
    shrunk to what the free VRAM holds when the caller named none. ``free_vram`` is the
    free bytes of each GPU the model will use; the weights, the engine's per-GPU reserve
    and localrun's usual overhead come off it first. A requested context that does not
    fit, or weights that leave no room for even one page, raise ModelTooLargeError (with
    the largest context that fits) before anything is loaded.
    """
    context = context_window(requested, trained)
    if requested is not None:
        reason = f"requested {requested}" + (f", capped at the trained {trained}"
                                             if context < requested else "")
    else:
        reason = (f"trained context {trained}" if trained and trained <= DEFAULT_CONTEXT_CAP
                  else f"default cap {DEFAULT_CONTEXT_CAP}")
    cache = _round_up(context)
    if shape is None or not free_vram:
        return ContextChoice(context, cache,
                             reason + " (free VRAM or model shape unknown: not checked)")
    per_token = kv_bytes_per_token(engine, shape, kv_cache, len(free_vram))
    reserve = ENGINE_RESERVE.get(engine, 256 * MiB)
    overhead = overhead_bytes(weights, memory_row(SPECS[engine]).overhead_fixed)
    budget = sum(max(f - reserve, 0) for f in free_vram) - weights - overhead
    fits = _round_down(budget // per_token) if budget > 0 and per_token > 0 else 0
    if fits >= cache:
        return ContextChoice(context, cache, reason, per_token * cache, budget)
    if requested is None and fits >= PAGE_SIZE:
        return ContextChoice(fits, fits, f"largest context the free VRAM holds ({reason} "
                             "did not fit)", per_token * fits, budget)
    needed = weights + overhead + reserve * len(free_vram) + per_token * cache
    smaller = [k for k in KV_CACHE_CHOICES if KV_ELEMENT_BYTES[k] < KV_ELEMENT_BYTES[kv_cache]]
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
        breakdown=f"{title(engine)}: weights {weights / GiB:.2f} GiB + KV cache ({kv_cache}) "
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
    many = _DEVICES.match(device.strip().lower())
    if many:  # the plan names every GPU it found usable: split over them all
        if sorted({int(i) for i in many.group(1).split(",")}) == list(range(n_gpus)):
            return None
        raise InvalidOptionError(title(engine), "device", device,
                                 "cuda (all GPUs) or cuda:N; leave GPUs out with gpu_split")
    m = _DEVICE.match(device.strip().lower())
    if not m:
        raise InvalidOptionError(title(engine), "device", device, "cuda, cuda:N (GPUs only)")
    index = m.group(1) or m.group(2)
    if index is None:
        return None
    n = int(index)
    if n >= n_gpus:
        raise InvalidOptionError(title(engine), "device", device,
                                 f"cuda:0 to cuda:{n_gpus - 1} ({n_gpus} GPU(s) visible)")
    return n


def plan_split(engine: str, n_gpus: int, *, device: str | None, options: LoadOptions,
               supports_tp: bool = True) -> SplitPlan:
    """How the weights and the cache are spread over the visible GPUs.

    ``device="cuda:N"`` pins everything to GPU N; a ``gpu_split`` (GiB per GPU, weights and
    KV cache together: :data:`~localrun.backends.spec.GPU_SPLIT_HELP`) is used
    as given; otherwise the model fills the GPUs in turn (autosplit), or is split tensor by
    tensor across them: ExLlamaV3 does that by default on two or more GPUs when the
    architecture supports it (its successor's point), ExLlamaV2 only when asked
    (``tensor_parallel=True``: the engine's ``load_tp`` and ``ExLlamaV2Cache_TP``, which its
    own loader calls "not fully supported for all models"). ``supports_tp`` is the
    architecture's own flag (ExLlamaV2 ``cfg.arch.lm.supports_tp``, ExLlamaV3
    ``model.caps["supports_tp"]``).
    """
    if n_gpus < 1:
        raise no_gpu_error(engine, "the engine sees no GPU")
    pinned = parse_device(engine, device, n_gpus)
    name = title(engine)
    if pinned is not None:
        if options.tensor_parallel:
            raise InvalidOptionError(name, "tensor_parallel", True,
                                     "False when a single device is named")
        split = tuple([0.0] * pinned + [1e6])
        return SplitPlan("single", (pinned,), split, f"device {device} named")
    if options.tensor_parallel and not supports_tp:
        raise InvalidOptionError(name, "tensor_parallel", True,
                                 f"False ({name} has no tensor-parallel support for this "
                                 "model's architecture)")
    if options.gpu_split is not None:
        split = options.gpu_split
        if len(split) > n_gpus:
            raise InvalidOptionError(name, "gpu_split", list(split),
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


def free_for_split(free: Sequence[int], split: SplitPlan) -> list[int]:
    """The free bytes the model may use on each of its devices (capped by gpu_split GB)."""
    out = []
    for i in split.devices:
        cap = int(split.gpu_split[i] * GiB) if split.gpu_split is not None and \
            i < len(split.gpu_split) else None
        out.append(min(free[i], cap) if cap is not None else free[i])
    return out
