"""The ExLlamas' facts: their entries in the engine table, which formats they run, what
they allocate, their options. Pure data: importing it imports no engine."""

from __future__ import annotations

import math

from localrun.backends.spec import BackendSpec, Condition, EngineMemory, Option, needs_compute

#: ``gpu_split`` on both ExLlamas: the most VRAM, in GiB (the engines' "GB"), the model
#: may take on each GPU for everything (weights, KV cache, working buffers).
GPU_SPLIT_HELP = ("a list of GiB per GPU for weights + KV cache, e.g. [20, 24] "
                  "(default: autosplit)")
#: The options both ExLlamas take. They parse their options themselves
#: (exllama.options.parse_options also takes 16/8/int8 for kv_cache and "20,24" for
#: gpu_split); the kinds here are what those spellings normalize to.
EXLLAMA_OPTIONS: dict[str, Option] = {
    "kv_cache": (("fp16", "q8", "q6", "q4"), "fp16, q8, q6 or q4"),
    "gpu_split": ("numbers", GPU_SPLIT_HELP),
}
#: Their KV cache is fp16 unless kv_cache= says otherwise; GPUs keep the unmeasured
#: default overhead (the CUDA runtime).
EXLLAMA_MEMORY = {"*": EngineMemory(2)}

# Its release wheels are built for sm 6.0 and newer (cudaarch "6.0 6.1 7.0 7.5 8.0 ..."
# in turboderp-org/exllamav2 .github/workflows/build-wheels-release*.yml).
V2_MIN_COMPUTE = (6, 0)
# Its kernels use cp.async and mma.m16n8k16 (sm_80+); tabbyAPI rejects < 8.0
# (common/hardware.py, discussed in theroyallab/tabbyAPI#463).
V3_MIN_COMPUTE = (8, 0)

EXLLAMAV2 = BackendSpec(
    name="exllamav2", title="ExLlamaV2", module="localrun.backends.exllama.v2",
    dists=("exllamav2",), extra="exllamav2", home="here",
    formats=("exl2",), loads=("gptq",),
    conditions={
        "exl2": Condition(f"{needs_compute(V2_MIN_COMPUTE)} (or ROCm)"),
        "gptq": Condition("4-bit GPTQ only", quantizations=("4bit",)),
    },
    # These engines keep every weight on the GPU, whose memory should be used: the Hub
    # picks the largest bpw that fits; a plan without a file names 4.0bpw.
    quant="4.0bpw", target_bpw=math.inf,
    convert="python exllamav2/convert.py -i MODEL_DIR -o WORK -cf OUT -b 4.0",
    min_compute=V2_MIN_COMPUTE,
    options={
        **EXLLAMA_OPTIONS,
        "paged": ("bool", "True/False (default: True when flash-attn >= 2.5.7 is "
                          "installed)"),
        "tensor_parallel": ("bool", "True/False (default: False; the engine's "
                                    "tensor-parallel mode covers Llama, Mistral, "
                                    "Qwen2/3 and GLM-4)"),
    },
    aliases=("exl2", "exllama"), builds=(),
    memory=EXLLAMA_MEMORY, default_device="*", embedder=None,
)

EXLLAMAV3 = BackendSpec(
    name="exllamav3", title="ExLlamaV3", module="localrun.backends.exllama.v3",
    dists=("exllamav3",), extra="exllamav3", home="here",
    formats=("exl3",), loads=("hf",),
    conditions={
        "exl3": Condition(f"{needs_compute(V3_MIN_COMPUTE)} (Ampere+)"),
        "hf": Condition("runs unquantized; an EXL3 quant is its optimized path"),
    },
    quant="4.0bpw", target_bpw=math.inf,
    convert="python exllamav3/convert.py -i MODEL_DIR -o OUT -w WORK -b 4.0",
    min_compute=V3_MIN_COMPUTE,
    options={
        **EXLLAMA_OPTIONS,
        "tensor_parallel": ("bool", "True/False (default: True on two or more GPUs when "
                                    "the architecture supports it)"),
    },
    aliases=("exl3",), builds=(),
    memory=EXLLAMA_MEMORY, default_device="*", embedder=None,
)

#: Both engines' facts, by name.
SPECS: dict[str, BackendSpec] = {s.name: s for s in (EXLLAMAV2, EXLLAMAV3)}
