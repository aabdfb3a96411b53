"""vLLM's facts: its entry in the engine table, which formats it runs, its options.
vLLM lives in its own environment (it pins torch): localrun runs ``vllm serve`` from it
and speaks HTTP, so only the HTTP client is needed here; whether a vLLM is there is
asked of :mod:`localrun.backends.vllm.env`, never by importing vllm. Pure data."""

from __future__ import annotations

from localrun.backends.spec import BackendSpec

SPEC = BackendSpec(
    name="vllm", title="vLLM", module="localrun.backends.vllm.session", dists=("httpx2",),
    extra=None, home="own-env",
    formats=("hf", "awq", "gptq", "fp8", "compressed-tensors"), loads=(), conditions={},
    quant="bf16", target_bpw=16.0,
    convert="none needed: vLLM runs the Hub's safetensors (bf16/fp16, AWQ, GPTQ, FP8)",
    # "GPU: compute capability 7.0 or higher" (docs.vllm.ai, installation/gpu).
    min_compute=(7, 0),
    options={
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
    aliases=(), builds=(),
    memory={},  # vLLM sizes itself (gpu_memory_utilization): the planner's default
    default_device="*",
    embedder=None,
)
