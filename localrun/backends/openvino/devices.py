"""OpenVINO devices: the names it takes (CPU, GPU.N, NPU, AUTO...), the NPU's static
prompt and reply lengths, and the CPU's compute and KV cache precision."""

from __future__ import annotations

import re
from typing import Any

from localrun.errors import LocalrunError

#: OpenVINO device names: CPU, GPU, GPU.N, NPU, and the AUTO/HETERO/MULTI meta devices.
_OV_DEVICE = re.compile(r"^(CPU|GPU|GPU\.\d+|NPU|(AUTO|HETERO|MULTI)(:[A-Z0-9.,]+)?)$")
DEVICE_HELP = "CPU, GPU, GPU.N, NPU or AUTO"

#: The NPU compiles static shapes: prompts up to MAX_PROMPT_LEN tokens, and a KV cache of
#: MAX_PROMPT_LEN + MIN_RESPONSE_LEN (the engine's defaults, 1024 + 128, make longer
#: prompts fail). NPUW rounds both up to multiples of 64, and a prompt length above its
#: prefill chunk (1024) up to a multiple of the chunk (intel_npu llm_compiled_model.cpp).
NPU_ALIGN = 64
NPU_CHUNK = 1024
#: The reply's share of the context on the NPU: a quarter, at most this many tokens.
NPU_MAX_RESPONSE = 1024


def ov_device(device: str | None) -> str:
    """The OpenVINO device for a device string (``gpu:1`` and ``GPU.1`` alike)."""
    if device is None:
        return "CPU"
    d = device.strip().upper()
    if d.startswith("GPU:") and d[4:].isdigit():
        d = "GPU." + d[4:]
    if not _OV_DEVICE.match(d):
        raise LocalrunError(f"Unknown device {device!r} for OpenVINO GenAI",
                            hint=f"use one of: {DEVICE_HELP}")
    return d


def _down(n: int, step: int) -> int:
    return n // step * step


def _up(n: int, step: int) -> int:
    return -(-n // step) * step


def npu_lengths(context: int, options: dict[str, Any]) -> tuple[int, int]:
    """(MAX_PROMPT_LEN, MIN_RESPONSE_LEN) that fill ``context`` exactly as NPUW builds it.

    The reply keeps a quarter of the context (at most NPU_MAX_RESPONSE); the prompt gets
    the rest, in whole prefill chunks above NPU_CHUNK so that NPUW does not round it up;
    what rounding leaves goes back to the reply. Values given as engine options win
    (NPUW's rounding still applies to them).
    """
    if "MAX_PROMPT_LEN" in options or "MIN_RESPONSE_LEN" in options:
        prompt = int(options.get("MAX_PROMPT_LEN", 1024))
        response = int(options.get("MIN_RESPONSE_LEN", 128))
        prompt = _up(_up(prompt, NPU_ALIGN), NPU_CHUNK) if prompt > NPU_CHUNK \
            else _up(prompt, NPU_ALIGN)
        return prompt, _up(response, NPU_ALIGN)
    response = max(NPU_ALIGN, _down(min(NPU_MAX_RESPONSE, context // 4), NPU_ALIGN))
    rest = context - response
    prompt = _down(rest, NPU_CHUNK) if rest > NPU_CHUNK else _down(rest, NPU_ALIGN)
    if prompt < NPU_ALIGN:
        raise LocalrunError(f"A context of {context} tokens is too small for the NPU",
                            hint=f"load with context >= {2 * NPU_ALIGN}")
    return prompt, _down(context - prompt, NPU_ALIGN)


def cpu_kv_precision(props: dict[str, Any], paged: bool) -> str:
    """The KV cache's element type on the CPU.

    Not the plugin's default, u8: it quantizes with scales that depend on memory left
    over from earlier requests, so the same seed gave a different sample on a Model's
    first request than on later ones (2026.4), and greedy replies changed from the first
    token. LLMPipeline (SDPA) keeps f32. Paged attention takes only the compute
    precision or a quantized type ("expect kvcache type bf16" where the CPU computes in
    bf16: AVX-512 BF16, AMX), so it gets the compute precision, which keeps keys and
    values as computed.
    """
    given = props.get("KV_CACHE_PRECISION")
    if not paged:
        return str(given or "f32")
    compute = cpu_precision(props.get("INFERENCE_PRECISION_HINT"))
    if given is None:
        return compute
    if str(given).lower() == "f32" and compute != "f32":
        raise LocalrunError(
            f"KV_CACHE_PRECISION='f32' needs f32 compute, not {compute}: paged attention "
            f"keeps its cache in the compute precision or quantized",
            hint=f"add INFERENCE_PRECISION_HINT='f32' (or load with exact=True), use "
                 f"KV_CACHE_PRECISION='{compute}', or load with ATTENTION_BACKEND='SDPA' "
                 f"(one sequence at a time, no KV reuse)")
    return str(given)


def cpu_precision(hint: Any) -> str:
    """The CPU plugin's compute precision: the hint given, or its default on this CPU
    (bf16 where the CPU has AVX-512 BF16 or AMX, else f32)."""
    if hint:
        return str(hint).lower()
    import openvino

    return str(openvino.Core().get_property("CPU", "INFERENCE_PRECISION_HINT").get_type_name())
