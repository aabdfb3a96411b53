"""Which engine runs which format: the table, and the check that refuses mismatches.

"native": the engine has optimized kernels for the format. "loads": it works, but it
is not the engine's fast path; localrun requires an explicit opt-in and warns.
Anything absent is "no": refuse, and say which engine runs it.
"""

from __future__ import annotations

from typing import Literal

from localrun.backends import BACKENDS
from localrun.errors import FormatMismatchError

Support = Literal["native", "loads", "no"]

#: format -> {backend: support}; a backend not listed cannot load the format.
COMPAT: dict[str, dict[str, Support]] = {
    "gguf": {"llama.cpp": "native", "openvino": "loads"},
    "mlx": {"mlx": "native"},
    "exl2": {"exllamav2": "native"},
    "exl3": {"exllamav3": "native"},
    "openvino": {"openvino": "native"},
    "onnx": {"onnx": "native"},
    "gptq": {"exllamav2": "loads", "mlx": "loads"},
    "awq": {"mlx": "loads"},
    "hf": {"mlx": "loads", "exllamav3": "loads"},
    "fp8": {},
    "compressed-tensors": {},
    "bitsandbytes": {},
}

#: How to get each format, for refusal hints.
FORMAT_TITLES: dict[str, str] = {
    "gguf": "GGUF", "mlx": "MLX", "exl2": "EXL2", "exl3": "EXL3", "openvino": "OpenVINO IR",
    "onnx": "ONNX Runtime GenAI", "gptq": "GPTQ", "awq": "AWQ", "hf": "safetensors (fp16/bf16)",
    "fp8": "FP8", "compressed-tensors": "compressed-tensors", "bitsandbytes": "bitsandbytes",
}

#: The format each backend wants: what to ask for instead of a mismatching file.
NATIVE_FORMAT: dict[str, str] = {b: spec.formats[0] for b, spec in BACKENDS.items()}


def support(format: str, backend: str) -> Support:
    return COMPAT.get(format, {}).get(backend, "no")


def native_backends(format: str) -> list[str]:
    return [b for b, s in COMPAT.get(format, {}).items() if s == "native"]


def check(
    format: str, backend: str, *, model: str, allow_unoptimized: bool = False
) -> Support:
    """Raise FormatMismatchError unless ``backend`` may run ``format``.

    Happens before any engine is imported or any weight is read.
    """
    level = support(format, backend)
    if level == "native" or (level == "loads" and allow_unoptimized):
        return level
    natives = native_backends(format)
    fmt = FORMAT_TITLES.get(format, format)
    want = FORMAT_TITLES.get(NATIVE_FORMAT.get(backend, ""), "its own format")
    fixes = []
    if natives:
        fixes.append(f"localrun run {model} --backend {natives[0]}")
    fixes.append(f"or get the {want} variant for {backend}: localrun pull <base model repo> "
                 f"--backend {backend}")
    hint = "; ".join(fixes)
    if level == "loads":
        message = (f"{backend} can load {fmt} models but has no optimized kernels for them "
                   f"(engines that run {fmt} natively: {', '.join(natives) or 'none'})")
        hint = (hint + "; or accept the slow path with --allow-unoptimized "
                "(allow_unoptimized=True)")
        return _raise(format, backend, natives, hint, message)
    return _raise(format, backend, natives, hint, None)


def _raise(format: str, backend: str, natives: list[str], hint: str, message: str | None) -> Support:
    raise FormatMismatchError(
        format=FORMAT_TITLES.get(format, format),
        backend=backend,
        native_backends=natives,
        hint=hint,
        message=message,
    )
