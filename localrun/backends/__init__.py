"""The engines localrun drives, as data. Nothing here imports an engine."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from importlib import metadata
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from localrun.backends.base import Backend

BackendName = Literal["llama.cpp", "mlx", "exllamav2", "exllamav3", "openvino", "onnx",
                      "vllm", "remote"]


@dataclass(frozen=True)
class Build:
    """Another distribution of an engine's main package, built for a GPU API.

    It installs the same module as the plain distribution (``import onnxruntime_genai``
    either way), so it is recognised from package metadata, never by importing.
    """

    dist: str  # e.g. "onnxruntime-genai-cuda"
    device: str  # the device kind it adds: "cuda", "dml"
    extra: str  # the localrun extra that installs it


@dataclass(frozen=True)
class BackendSpec:
    name: BackendName
    title: str  # how users know the engine
    module: str  # localrun module with the Backend class, imported only in load()
    dists: tuple[str, ...]  # distributions that must be installed
    extra: str  # the pip extra that installs it
    formats: tuple[str, ...]  # formats it runs with its optimized kernels
    #: GPU builds that stand in for ``dists[0]`` (the plain one runs on the CPU only)
    builds: tuple[Build, ...] = ()


BACKENDS: dict[str, BackendSpec] = {
    s.name: s
    for s in (
        BackendSpec("llama.cpp", "llama.cpp (llama-cpp-python)", "localrun.backends.llama_cpp",
                    ("llama-cpp-python",), "llama-cpp", ("gguf",)),
        BackendSpec("mlx", "MLX (mlx-lm)", "localrun.backends.mlx",
                    ("mlx-lm", "mlx"), "mlx", ("mlx",)),
        BackendSpec("exllamav2", "ExLlamaV2", "localrun.backends.exllamav2",
                    ("exllamav2",), "exllamav2", ("exl2",)),
        BackendSpec("exllamav3", "ExLlamaV3", "localrun.backends.exllamav3",
                    ("exllamav3",), "exllamav3", ("exl3",)),
        BackendSpec("openvino", "OpenVINO GenAI", "localrun.backends.openvino_genai",
                    ("openvino-genai",), "openvino", ("openvino",)),
        BackendSpec("onnx", "ONNX Runtime GenAI", "localrun.backends.onnx_genai",
                    ("onnxruntime-genai",), "onnx", ("onnx",),
                    builds=(Build("onnxruntime-genai-cuda", "cuda", "onnx-cuda"),
                            Build("onnxruntime-genai-directml", "dml", "onnx-directml"))),
        # vLLM lives in its own environment (it pins torch): localrun runs `vllm serve`
        # from it and speaks HTTP, so only the HTTP client is needed here; whether a vLLM
        # is there is asked of localrun.backends.vllm_env, never by importing vllm.
        BackendSpec("vllm", "vLLM", "localrun.backends.vllm", ("httpx2",), "vllm",
                    ("hf", "awq", "gptq", "fp8", "compressed-tensors")),
        # An OpenAI-compatible server elsewhere (vLLM, SGLang, localrun serve).
        BackendSpec("remote", "remote OpenAI-compatible server", "localrun.backends.remote",
                    ("httpx2",), "remote", ("remote",)),
    )
}

#: Other spellings users type for --backend.
BACKEND_ALIASES: dict[str, str] = {
    "llama-cpp": "llama.cpp", "llamacpp": "llama.cpp", "llama_cpp": "llama.cpp",
    "llama-cpp-python": "llama.cpp", "gguf": "llama.cpp",
    "mlx-lm": "mlx", "mlx_lm": "mlx",
    "exl2": "exllamav2", "exllama": "exllamav2", "exl3": "exllamav3",
    "openvino-genai": "openvino", "openvino_genai": "openvino", "ov": "openvino",
    "onnxruntime-genai": "onnx", "onnxruntime_genai": "onnx", "ort": "onnx",
    "onnx-genai": "onnx",
    "openai": "remote", "sglang": "remote",
}


def canonical_backend(name: str) -> str:
    """Map any accepted spelling to a backend name; raise for unknown names."""
    from localrun.errors import LocalrunError

    key = name.strip().lower()
    if key in BACKENDS:
        return key
    if key in BACKEND_ALIASES:
        return BACKEND_ALIASES[key]
    raise LocalrunError(
        f"Unknown backend {name!r}",
        hint="use one of: auto, " + ", ".join(BACKENDS),
    )


#: Engine options each backend takes through ``localrun.load(..., name=value)``:
#: name -> (kind of value, what it does). Anything else is refused with this list, so a
#: misspelt option never passes silently. Kinds: "int", "bool", "number", "numbers"
#: (a list), "text", "switch" ("auto", True or False), or a tuple of the accepted words.
#: ExLlamaV2/V3 keep theirs beside their parser (localrun.backends._exllama.OPTIONS).
ENGINE_OPTIONS: dict[str, dict[str, tuple[str | tuple[str, ...], str]]] = {
    "llama.cpp": {
        "n_gpu_layers": ("int", "layers on the GPU, -1 = all (default: all that fit in "
                                "the free VRAM, 0 with device='cpu')"),
        "flash_attn": ("switch", "flash attention: 'auto' (default, as llama-server), True "
                                 "or False"),
        "kv_cache": (("f16", "q8_0", "q4_0"), "KV cache type (quantized needs flash "
                                              "attention; default f16)"),
        "tensor_split": ("numbers", "share of the model per GPU, e.g. [3, 1] (default: by "
                                    "free VRAM)"),
        "n_batch": ("int", "prompt tokens per decode call (default 512)"),
        "n_ubatch": ("int", "physical batch size (default 512)"),
        "offload_kqv": ("bool", "keep the KV cache on the GPU (default True)"),
        "use_mmap": ("bool", "map the file instead of reading it (default True)"),
        "use_mlock": ("bool", "lock the weights in RAM (default False)"),
        "rope_freq_base": ("number", "RoPE base frequency (default: the model's)"),
        "rope_freq_scale": ("number", "RoPE frequency scale (default: the model's)"),
    },
    "mlx": {},
    "openvino": {
        "KV_CACHE_PRECISION": ("text", "KV cache element type, e.g. u8, f16, f32 (CPU "
                                       "default here: f32)"),
        "INFERENCE_PRECISION_HINT": ("text", "compute precision, e.g. f32, bf16, f16"),
        "PERFORMANCE_HINT": (("LATENCY", "THROUGHPUT", "CUMULATIVE_THROUGHPUT"),
                             "what the plugin optimizes for"),
        "NUM_STREAMS": ("text", "parallel inference streams (a number or AUTO)"),
        "CACHE_DIR": ("text", "folder for compiled-model blobs (faster second load)"),
        "DYNAMIC_QUANTIZATION_GROUP_SIZE": ("int", "activation quantization group (0 = off)"),
        "ATTENTION_BACKEND": (("PA", "SDPA"), "paged or SDPA attention"),
        "MAX_PROMPT_LEN": ("int", "NPU: longest prompt (default: the context minus "
                                  "MIN_RESPONSE_LEN)"),
        "MIN_RESPONSE_LEN": ("int", "NPU: tokens kept for the reply (default: a quarter of "
                                    "the context, at most 1024)"),
        "GENERATE_HINT": (("FAST_COMPILE", "BEST_PERF"), "NPU: decode-stage compilation"),
        "PREFILL_HINT": (("DYNAMIC", "STATIC"), "NPU: prefill-stage shapes"),
    },
    "onnx": {},
    "remote": {
        "base_url": ("text", "the server's address, e.g. http://127.0.0.1:8000/v1"),
        "api_key": ("text", "sent as 'Authorization: Bearer KEY'"),
        "timeout": ("number", "seconds to wait for the next byte of a reply (default 600)"),
    },
    "vllm": {
        "vllm_python": ("text", "the Python of the environment vLLM is installed in "
                                "(default: LOCALRUN_VLLM_PYTHON, else `vllm` on PATH)"),
        "tensor_parallel_size": ("int", "GPUs one copy of the model is split over "
                                        "(default: the plan's)"),
        "pipeline_parallel_size": ("int", "pipeline stages (nodes, with Ray; default 1)"),
        "gpu_memory_utilization": ("number", "share of each GPU's memory vLLM takes "
                                             "(default 0.9)"),
        "max_model_len": ("int", "context window (default: context=, else the model's)"),
        "quantization": ("text", "vLLM's --quantization (default: from the checkpoint)"),
        "dtype": ("text", "weights' dtype: auto, bfloat16, float16 (default auto)"),
        "enforce_eager": ("bool", "no CUDA graphs: faster start, slower decode"),
        "port": ("int", "port for the vLLM server (default: a free one)"),
        "startup_timeout": ("number", "seconds to wait for /health (default 900)"),
        "extra_args": ("text", "more `vllm serve` arguments, as one shell-quoted string"),
    },
}


def engine_options(name: str) -> dict[str, str]:
    """{option: what it does} for a backend: the list its errors show."""
    key = canonical_backend(name)
    if key in ENGINE_OPTIONS:
        return {k: why for k, (_, why) in ENGINE_OPTIONS[key].items()}
    from localrun.backends._exllama import OPTIONS  # pure code: imports no engine

    return dict(OPTIONS[key])


def installed_build(name: str) -> Build | None:
    """The GPU build installed in place of the engine's plain distribution, if any."""
    for build in BACKENDS[canonical_backend(name)].builds:
        try:
            metadata.version(build.dist)
        except metadata.PackageNotFoundError:
            continue
        return build
    return None


def engine_version(name: str) -> str | None:
    """The installed version of the engine's main distribution, read from metadata only.

    A GPU build stands in for the plain distribution and is named as a local version
    label, as torch names its builds: ``0.8.0+cuda`` for onnxruntime-genai-cuda 0.8.0.
    """
    spec = BACKENDS[canonical_backend(name)]
    if spec.name == "vllm":  # installed in its own environment, not this one
        from localrun.backends.vllm_env import vllm_version

        return vllm_version()
    versions = []
    build = installed_build(spec.name)
    for i, dist in enumerate(spec.dists):
        if i == 0 and build is not None:
            versions.append(f"{metadata.version(build.dist)}+{build.device}")
            continue
        try:
            versions.append(metadata.version(dist))
        except metadata.PackageNotFoundError:
            return None
    return versions[0] if versions else None


def build_devices(version: str) -> tuple[str, ...]:
    """Device kinds an engine version string (from :func:`engine_version`) adds to the CPU."""
    _, _, label = version.partition("+")
    return (label,) if label else ()


def is_installed(name: str) -> bool:
    return engine_version(name) is not None


def installed_backends() -> dict[str, str]:
    """{backend name: engine version} for every installed engine (no imports)."""
    out = {}
    for name in BACKENDS:
        if name == "remote":  # a server elsewhere: nothing to install, never planned
            continue
        v = engine_version(name)
        if v is not None:
            out[name] = v
    return out


def get_backend(name: str) -> Backend:
    """Import and instantiate a backend. Raises EngineNotInstalledError with the extra."""
    from localrun.errors import EngineNotInstalledError

    spec = BACKENDS[canonical_backend(name)]
    if spec.name == "vllm":  # found at load time, in its own environment (vllm_env)
        return importlib.import_module(spec.module).BACKEND  # type: ignore[no-any-return]
    if not is_installed(spec.name):
        raise EngineNotInstalledError(spec.title, spec.extra)
    module = importlib.import_module(spec.module)
    backend: Backend = module.BACKEND
    return backend
