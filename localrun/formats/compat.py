"""Which engine runs which format: the table, and the check that refuses mismatches.

"native": the engine has optimized kernels for the format. "loads": it works, but it
is not the engine's fast path; localrun requires an explicit opt-in and warns.
Anything absent is "no": refuse, and say which engine runs it and how to get the
variant the chosen engine wants. The check runs before any engine is imported.
"""

from __future__ import annotations

from dataclasses import dataclass
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
    "gptq": {"exllamav2": "loads", "mlx": "loads", "vllm": "native"},
    "awq": {"mlx": "loads", "vllm": "native"},
    "hf": {"mlx": "loads", "exllamav3": "loads", "vllm": "native"},
    "fp8": {"vllm": "native"},
    "compressed-tensors": {"vllm": "native"},
    "bitsandbytes": {},
    "mxfp4": {},
}


@dataclass(frozen=True)
class Condition:
    """What a "loads" (or "native") pairing depends on; outside it, the pairing is "no"."""

    note: str
    architectures: tuple[str, ...] | None = None  # GGUF general.architecture values
    quantizations: tuple[str, ...] | None = None  # detected quantization names
    min_version: str | None = None  # engine version where this started to work


def _needs_cc(backend: str) -> str:
    major, minor = BACKENDS[backend].min_compute or (0, 0)
    return f"NVIDIA GPU with compute capability >= {major}.{minor}"


#: (format, backend) -> the engine versions / architectures the pairing depends on.
CONDITIONS: dict[tuple[str, str], Condition] = {
    ("gguf", "llama.cpp"): Condition(
        "every GGUF architecture llama.cpp knows; new architectures need a recent "
        "llama-cpp-python"),
    ("gguf", "openvino"): Condition(
        "preview GGUF reader: llama, qwen2 and qwen3 architectures with F16/Q4_0/Q4_1/Q8_0/"
        "Q4_K/Q6_K weights only (openvino-genai >= 2025.2); it rounds the block minimums "
        "of Q4_1 and Q4_K weights (SmolLM2 Q4_1: KL 0.79 from llama.cpp's logits), so "
        "prefer llama.cpp for those files, or Q8_0, or an IR from optimum-cli",
        architectures=("llama", "qwen2", "qwen3"),
        quantizations=("F16", "Q4_0", "Q4_1", "Q8_0", "Q4_K_S", "Q4_K_M", "Q6_K"),
        min_version="2025.2"),
    ("mlx", "mlx"): Condition("Metal on Apple Silicon; CPU only (slow) on Linux with mlx[cpu]"),
    ("exl2", "exllamav2"): Condition(f"{_needs_cc('exllamav2')} (or ROCm)"),
    ("exl3", "exllamav3"): Condition(f"{_needs_cc('exllamav3')} (Ampere+)"),
    ("openvino", "openvino"): Condition(
        "needs openvino_tokenizer.xml and openvino_detokenizer.xml beside the model"),
    ("onnx", "onnx"): Condition(
        "the execution provider the model was built for (cpu, cuda, dml) must be in the "
        "installed onnxruntime-genai build"),
    ("gptq", "exllamav2"): Condition("4-bit GPTQ only", quantizations=("4bit",)),
    ("gptq", "mlx"): Condition("mlx-lm converts some GPTQ checkpoints on load"),
    ("awq", "mlx"): Condition("mlx-lm converts some AWQ checkpoints on load"),
    ("hf", "mlx"): Condition("runs unquantized; the MLX 4-bit/8-bit variant is much faster"),
    ("hf", "exllamav3"): Condition("runs unquantized; an EXL3 quant is its optimized path"),
}

#: Format names users know.
FORMAT_TITLES: dict[str, str] = {
    "gguf": "GGUF", "mlx": "MLX", "exl2": "EXL2", "exl3": "EXL3", "openvino": "OpenVINO IR",
    "onnx": "ONNX Runtime GenAI", "gptq": "GPTQ", "awq": "AWQ", "hf": "safetensors (fp16/bf16)",
    "fp8": "FP8", "compressed-tensors": "compressed-tensors", "bitsandbytes": "bitsandbytes",
    "mxfp4": "MXFP4 safetensors",
}

#: For formats no engine here runs natively: what does run them, and the way out.
NOT_SERVED: dict[str, str] = {
    "gptq": "GPTQ is a GPU serving format (vLLM, SGLang, transformers)",
    "awq": "AWQ is a GPU serving format (vLLM, SGLang, transformers)",
    "fp8": "FP8 checkpoints are for vLLM/SGLang/TensorRT-LLM on Hopper-class GPUs",
    "compressed-tensors": "compressed-tensors checkpoints are for vLLM",
    "bitsandbytes": "bitsandbytes checkpoints are for transformers with CUDA",
    "mxfp4": "MXFP4 safetensors checkpoints are for vLLM/transformers (GGUF MXFP4 runs on "
             "llama.cpp)",
    "hf": "plain fp16/bf16 weights are the source other formats are made from",
}

#: The format each backend wants: what to ask for instead of a mismatching file.
NATIVE_FORMAT: dict[str, str] = {b: spec.formats[0] for b, spec in BACKENDS.items()}

#: How to turn a model into each backend's format yourself (one command, for hints).
CONVERT: dict[str, str] = {b: spec.convert for b, spec in BACKENDS.items()}


def support(format: str, backend: str, *, architecture: str | None = None,
            quantization: str | None = None) -> Support:
    """The table's verdict, narrowed by the pairing's conditions when the facts are known."""
    level = COMPAT.get(format, {}).get(backend, "no")
    cond = CONDITIONS.get((format, backend))
    if level != "no" and cond is not None:
        if architecture and cond.architectures and architecture not in cond.architectures:
            return "no"
        if quantization and cond.quantizations and quantization not in cond.quantizations:
            return "no"
    return level


def native_backends(format: str) -> list[str]:
    return [b for b, s in COMPAT.get(format, {}).items() if s == "native"]


def title(format: str) -> str:
    return FORMAT_TITLES.get(format, format)


def check(
    format: str,
    backend: str,
    *,
    model: str,
    allow_unoptimized: bool = False,
    architecture: str | None = None,
    quantization: str | None = None,
) -> Support:
    """Return the support level, or raise FormatMismatchError unless ``backend`` may run it.

    Every refusal names the format, the engine, the engines that run it natively and
    the exact command or argument that fixes it. Happens before any engine import.
    """
    level = support(format, backend, architecture=architecture, quantization=quantization)
    if level == "native" or (level == "loads" and allow_unoptimized):
        return level
    natives = native_backends(format)
    fmt = title(format)
    cond = CONDITIONS.get((format, backend))
    hint = refusal_hint(format, backend, model=model)
    if level == "loads":
        loads_msg = (f"{backend} can load {fmt} models but has no optimized kernels for them "
                     f"(engines that run {fmt} natively: {', '.join(natives) or 'none'})")
        if cond is not None:
            loads_msg += f"; {backend} + {fmt}: {cond.note}"
        hint += "; or accept the slow path with --allow-unoptimized (allow_unoptimized=True)"
        raise FormatMismatchError(format=fmt, backend=backend, native_backends=natives,
                                  hint=hint, message=loads_msg)
    message: str | None = None
    if COMPAT.get(format, {}).get(backend, "no") != "no" and cond is not None:
        facts = ", ".join(f for f in (architecture, quantization) if f)
        message = (f"{backend} cannot run this {fmt} model ({facts}): {cond.note} "
                   f"(engines that run {fmt} natively: {', '.join(natives) or 'none'})")
    elif not natives:
        message = (f"{backend} cannot run {fmt} models and no engine localrun drives runs "
                   f"them natively: {NOT_SERVED.get(format, 'localrun does not serve it')}")
    raise FormatMismatchError(format=fmt, backend=backend, native_backends=natives,
                              hint=hint, message=message)


def refusal_hint(format: str, backend: str, *, model: str) -> str:
    """The ways out of a mismatch, as commands and arguments."""
    natives = native_backends(format)
    want = title(NATIVE_FORMAT.get(backend, ""))
    fixes = []
    if natives:
        fixes.append(f"run it with {natives[0]}: localrun run {model} --backend {natives[0]} "
                     f"(Python: backend=\"{natives[0]}\")")
    if backend in NATIVE_FORMAT:
        fixes.append(f"or, for {backend}, use the {want} variant of this model: "
                     f"localrun plan <model name> --backend {backend} shows which one; "
                     f"to convert it yourself: {CONVERT[backend]}")
    return "; ".join(fixes)
