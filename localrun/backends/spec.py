"""Every fact localrun keeps about each engine, in one table: :data:`BACKENDS`.

Each engine is one :class:`BackendSpec`; the other per-engine tables are derived from it
(``localrun.backends.ENGINE_OPTIONS`` and ``BACKEND_ALIASES``, ``formats.compat.CONVERT``
and ``NATIVE_FORMAT``, ``hosts.MIN_COMPUTE``, ``selection.QUANT_PREFERENCE``,
``hub.fit.DEFAULT_TARGET`` and ``DEFAULT_TARGET_NAMES``, ``backends.exllama.options``'
``ENGINE_TITLES`` and ``OPTIONS``), and tests/test_backend_spec.py fails when one drifts. What
depends on a pairing or a host rather than on one engine stays in its own table: which
engine runs which format (``formats.compat.COMPAT``) and which engine each kind of host
tries first (``selection.RULES``).

Pure data: importing this module imports no engine and nothing else of localrun's.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

BackendName = Literal["llama.cpp", "mlx", "exllamav2", "exllamav3", "openvino", "onnx",
                      "vllm", "remote"]

#: How an engine option's value is checked (``backends.base.check_options``): "int",
#: "bool", "number", "numbers" (a list), "text", "switch" ("auto", True or False), or a
#: tuple of the accepted words.
OptionKind = str | tuple[str, ...]
#: An engine option: (kind of value, what it does, shown in errors and --help).
Option = tuple[OptionKind, str]

#: Where an engine is installed. "here": in this Python environment, from the pip extra;
#: "own-env": in an environment of its own that localrun runs as a server (vLLM pins its
#: torch); "nowhere": a server elsewhere, nothing to install or plan.
Home = Literal["here", "own-env", "nowhere"]


@dataclass(frozen=True)
class Build:
    """Another distribution of an engine's main package, built for a GPU API.

    It installs the same module as the plain distribution (``import onnxruntime_genai``
    either way), so it is recognised from package metadata, never by importing.
    """

    dist: str  # e.g. "onnxruntime-genai-cuda"
    device: str  # the device kind it adds: "cuda", "dml"
    extra: str  # the localrun extra that installs it


@dataclass(frozen=True, kw_only=True)
class BackendSpec:
    """One engine. Every field is required, so a new engine cannot leave a fact out."""

    name: BackendName
    title: str  # how users know the engine
    module: str  # localrun module with the Backend class, imported only in load()
    dists: tuple[str, ...]  # distributions that must be installed
    extra: str | None  # the pip extra that installs it (None: not pip-installed here)
    home: Home
    #: formats it runs with its optimized kernels; the first is the one it asks for
    formats: tuple[str, ...]
    #: the variant a plan names when the model is not a file yet (None: nothing to choose)
    quant: str | None
    #: bits per weight the Hub's variant choice aims for in ``formats[0]``; the nearest
    #: variant that fits wins (inf: the largest that fits; None: the Hub is not asked)
    target_bpw: float | None
    #: one command that makes ``formats[0]`` from a Hugging Face model (for hints)
    convert: str
    #: lowest NVIDIA compute capability its CUDA kernels run on (None: no CUDA kernels,
    #: or none known)
    min_compute: tuple[int, int] | None
    #: engine options taken through ``localrun.load(..., name=value)``; anything else is
    #: refused with this list, so a misspelt option never passes silently
    options: Mapping[str, Option]
    #: other spellings users type for --backend
    aliases: tuple[str, ...]
    #: GPU builds that stand in for ``dists[0]`` (the plain one runs on the CPU only)
    builds: tuple[Build, ...]


#: ``gpu_split`` on both ExLlamas: the most VRAM, in GiB (the engines' "GB"), the model
#: may take on each GPU for everything (weights, KV cache, working buffers).
GPU_SPLIT_HELP = ("a list of GiB per GPU for weights + KV cache, e.g. [20, 24] "
                  "(default: autosplit)")
#: The options both ExLlamas take. They parse their options themselves
#: (backends.exllama.options.parse_options also takes 16/8/int8 for kv_cache and "20,24"
#: for gpu_split); the kinds here are what those spellings normalize to.
EXLLAMA_OPTIONS: dict[str, Option] = {
    "kv_cache": (("fp16", "q8", "q6", "q4"), "fp16, q8, q6 or q4"),
    "gpu_split": ("numbers", GPU_SPLIT_HELP),
}

#: Bits per weight of llama.cpp's Q4_K_M (hub.GGUF_BPW; a test keeps the two equal).
Q4_K_M_BPW = 4.85

BACKENDS: dict[str, BackendSpec] = {s.name: s for s in (
    BackendSpec(
        name="llama.cpp", title="llama.cpp (llama-cpp-python)",
        module="localrun.backends.llama_cpp.session", dists=("llama-cpp-python",),
        extra="llama-cpp",
        home="here", formats=("gguf",), quant="Q4_K_M", target_bpw=Q4_K_M_BPW,
        convert="convert_hf_to_gguf.py MODEL_DIR --outtype q8_0 (from llama.cpp)",
        # The ggml CUDA backend's oldest default target is sm 5.0 (Ollama also needs 5.0).
        min_compute=(5, 0),
        options={
            "n_gpu_layers": ("int", "layers on the GPU, -1 = all (default: all that fit in "
                                    "the free VRAM, 0 with device='cpu')"),
            "flash_attn": ("switch", "flash attention: 'auto' (default, as llama-server), "
                                     "True or False"),
            "kv_cache": (("f16", "q8_0", "q4_0"), "KV cache type (quantized needs flash "
                                                  "attention; default f16)"),
            "tensor_split": ("numbers", "share of the model per GPU, e.g. [3, 1] (default: "
                                        "by free VRAM)"),
            "n_batch": ("int", "prompt tokens per decode call (default 512)"),
            "n_ubatch": ("int", "physical batch size (default 512)"),
            "offload_kqv": ("bool", "keep the KV cache on the GPU (default True)"),
            "use_mmap": ("bool", "map the file instead of reading it (default True)"),
            "use_mlock": ("bool", "lock the weights in RAM (default False)"),
            "rope_freq_base": ("number", "RoPE base frequency (default: the model's)"),
            "rope_freq_scale": ("number", "RoPE frequency scale (default: the model's)"),
        },
        aliases=("llama-cpp", "llamacpp", "llama_cpp", "llama-cpp-python", "gguf"),
        builds=()),
    BackendSpec(
        name="mlx", title="MLX (mlx-lm)", module="localrun.backends.mlx.session",
        dists=("mlx-lm", "mlx"), extra="mlx", home="here", formats=("mlx",), quant="4bit",
        target_bpw=4.0, convert="mlx_lm.convert --hf-path MODEL -q",
        min_compute=None,  # Metal or the CPU
        options={}, aliases=("mlx-lm", "mlx_lm"), builds=()),
    BackendSpec(
        name="exllamav2", title="ExLlamaV2", module="localrun.backends.exllama.v2",
        dists=("exllamav2",), extra="exllamav2", home="here", formats=("exl2",),
        # These engines keep every weight on the GPU, whose memory should be used: the
        # Hub picks the largest bpw that fits; a plan without a file names 4.0bpw.
        quant="4.0bpw", target_bpw=math.inf,
        convert="python exllamav2/convert.py -i MODEL_DIR -o WORK -cf OUT -b 4.0",
        # Its release wheels are built for sm 6.0 and newer (cudaarch "6.0 6.1 7.0 7.5
        # 8.0 ..." in turboderp-org/exllamav2 .github/workflows/build-wheels-release*.yml).
        min_compute=(6, 0),
        options={
            **EXLLAMA_OPTIONS,
            "paged": ("bool", "True/False (default: True when flash-attn >= 2.5.7 is "
                              "installed)"),
            "tensor_parallel": ("bool", "True/False (default: False; the engine's "
                                        "tensor-parallel mode covers Llama, Mistral, "
                                        "Qwen2/3 and GLM-4)"),
        },
        aliases=("exl2", "exllama"), builds=()),
    BackendSpec(
        name="exllamav3", title="ExLlamaV3", module="localrun.backends.exllama.v3",
        dists=("exllamav3",), extra="exllamav3", home="here", formats=("exl3",),
        quant="4.0bpw", target_bpw=math.inf,
        convert="python exllamav3/convert.py -i MODEL_DIR -o OUT -w WORK -b 4.0",
        # Its kernels use cp.async and mma.m16n8k16 (sm_80+); tabbyAPI rejects < 8.0
        # (common/hardware.py, discussed in theroyallab/tabbyAPI#463).
        min_compute=(8, 0),
        options={
            **EXLLAMA_OPTIONS,
            "tensor_parallel": ("bool", "True/False (default: True on two or more GPUs when "
                                        "the architecture supports it)"),
        },
        aliases=("exl3",), builds=()),
    BackendSpec(
        name="openvino", title="OpenVINO GenAI", module="localrun.backends.openvino.session",
        dists=("openvino-genai",), extra="openvino", home="here", formats=("openvino",),
        quant="int4", target_bpw=4.0,
        convert="optimum-cli export openvino --model MODEL --weight-format int4 OUT",
        min_compute=None,  # Intel CPUs, GPUs and NPUs
        options={
            "KV_CACHE_PRECISION": ("text", "KV cache element type, e.g. u8, f16, f32 (CPU "
                                           "default: the compute precision)"),
            "INFERENCE_PRECISION_HINT": ("text", "compute precision, e.g. f32, bf16, f16"),
            "PERFORMANCE_HINT": (("LATENCY", "THROUGHPUT", "CUMULATIVE_THROUGHPUT"),
                                 "what the plugin optimizes for"),
            "NUM_STREAMS": ("text", "parallel inference streams (a number or AUTO)"),
            "CACHE_DIR": ("text", "folder for compiled-model blobs (faster second load)"),
            "DYNAMIC_QUANTIZATION_GROUP_SIZE": ("int", "activation quantization group "
                                                       "(0 = off)"),
            "ATTENTION_BACKEND": (("PA", "SDPA"), "paged attention (default: batching, KV "
                                                  "reuse) or SDPA (one sequence at a time)"),
            "PREFIX_CACHING": ("bool", "reuse the KV cache of earlier prompts' shared "
                                       "prefixes (default true)"),
            "MAX_PROMPT_LEN": ("int", "NPU: longest prompt (default: the context minus "
                                      "MIN_RESPONSE_LEN)"),
            "MIN_RESPONSE_LEN": ("int", "NPU: tokens kept for the reply (default: a quarter "
                                        "of the context, at most 1024)"),
            "GENERATE_HINT": (("FAST_COMPILE", "BEST_PERF"), "NPU: decode-stage compilation"),
            "PREFILL_HINT": (("DYNAMIC", "STATIC"), "NPU: prefill-stage shapes"),
        },
        aliases=("openvino-genai", "openvino_genai", "ov"), builds=()),
    BackendSpec(
        name="onnx", title="ONNX Runtime GenAI", module="localrun.backends.onnx.session",
        dists=("onnxruntime-genai",), extra="onnx", home="here", formats=("onnx",),
        quant="int4", target_bpw=4.0,
        convert="python -m onnxruntime_genai.models.builder -i MODEL_DIR -o OUT -p int4 "
                "-e cpu",
        min_compute=None,  # the CUDA build follows ONNX Runtime's; localrun checks none
        options={
            "SETTLE": ("bool", "recompute a finished reply's KV rows as a prefill in the "
                               "background, so that the next turn reuses them with exact "
                               "output (default true)"),
        },
        aliases=("onnxruntime-genai", "onnxruntime_genai", "ort", "onnx-genai"),
        builds=(Build("onnxruntime-genai-cuda", "cuda", "onnx-cuda"),
                Build("onnxruntime-genai-directml", "dml", "onnx-directml"))),
    # vLLM lives in its own environment (it pins torch): localrun runs `vllm serve` from
    # it and speaks HTTP, so only the HTTP client is needed here; whether a vLLM is there
    # is asked of localrun.backends.vllm.env, never by importing vllm.
    BackendSpec(
        name="vllm", title="vLLM", module="localrun.backends.vllm.session", dists=("httpx2",),
        extra=None, home="own-env",
        formats=("hf", "awq", "gptq", "fp8", "compressed-tensors"),
        quant="bf16", target_bpw=16.0,
        convert="none needed: vLLM runs the Hub's safetensors (bf16/fp16, AWQ, GPTQ, FP8)",
        # "GPU: compute capability 7.0 or higher" (docs.vllm.ai, installation/gpu).
        min_compute=(7, 0),
        options={
            "vllm_python": ("text", "the Python of the environment vLLM is installed in "
                                    "(default: LOCALRUN_VLLM_PYTHON, else `vllm` on PATH)"),
            "tensor_parallel_size": ("int", "GPUs one copy of the model is split over "
                                            "(default: the plan's)"),
            "pipeline_parallel_size": ("int", "pipeline stages (nodes, with Ray; "
                                              "default 1)"),
            "gpu_memory_utilization": ("number", "share of each GPU's memory vLLM takes "
                                                 "(default 0.9)"),
            "max_model_len": ("int", "context window (default: context=, else the "
                                     "model's)"),
            "quantization": ("text", "vLLM's --quantization (default: from the "
                                     "checkpoint)"),
            "dtype": ("text", "weights' dtype: auto, bfloat16, float16 (default auto)"),
            "enforce_eager": ("bool", "no CUDA graphs: faster start, slower decode"),
            "port": ("int", "port for the vLLM server (default: a free one)"),
            "startup_timeout": ("number", "seconds to wait for /health (default 900)"),
            "extra_args": ("text", "more `vllm serve` arguments, as one shell-quoted "
                                   "string"),
        },
        aliases=(), builds=()),
    # An OpenAI-compatible server elsewhere (vLLM, SGLang, localrun serve).
    BackendSpec(
        name="remote", title="remote OpenAI-compatible server",
        module="localrun.backends.remote.session", dists=("httpx2",), extra=None,
        home="nowhere", formats=("remote",), quant=None, target_bpw=None,
        convert="none: the server has the model", min_compute=None,
        options={
            "base_url": ("text", "the server's address, e.g. http://127.0.0.1:8000/v1"),
            "api_key": ("text", "sent as 'Authorization: Bearer KEY'"),
            "timeout": ("number", "seconds to wait for the next byte of a reply "
                                  "(default 600)"),
        },
        aliases=("openai", "sglang"), builds=()),
)}
