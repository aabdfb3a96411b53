"""llama.cpp's facts: its entry in the engine table, which formats it runs, what it
allocates, its options. Pure data: importing it imports no engine."""

from __future__ import annotations

from localrun.backends.spec import BackendSpec, Condition, EngineMemory, MiB

#: KV cache choices: the ggml type llama-cpp-python names, and bytes per element
#: (q8_0 / q4_0 blocks hold 32 values in 34 / 18 bytes).
KV_TYPES: dict[str, tuple[str, float]] = {
    "f16": ("GGML_TYPE_F16", 2.0),
    "q8_0": ("GGML_TYPE_Q8_0", 34 / 32),
    "q4_0": ("GGML_TYPE_Q4_0", 18 / 32),
}

#: Bits per weight of llama.cpp's Q4_K_M (hub.GGUF_BPW; a test keeps the two equal).
Q4_K_M_BPW = 4.85

SPEC = BackendSpec(
    name="llama.cpp", title="llama.cpp (llama-cpp-python)",
    module="localrun.backends.llama_cpp.session", dists=("llama-cpp-python",),
    extra="llama-cpp", home="here",
    formats=("gguf",), loads=(),
    conditions={"gguf": Condition(
        "every GGUF architecture llama.cpp knows; new architectures need a recent "
        "llama-cpp-python")},
    quant="Q4_K_M", target_bpw=Q4_K_M_BPW,
    convert="convert_hf_to_gguf.py MODEL_DIR --outtype q8_0 (from llama.cpp)",
    # The ggml CUDA backend's oldest default target is sm 5.0 (Ollama also needs 5.0).
    min_compute=(5, 0),
    options={
        "n_gpu_layers": ("int", "layers on the GPU, -1 = all (default: all that fit in "
                                "the free VRAM, 0 with device='cpu')"),
        "flash_attn": ("switch", "flash attention: 'auto' (default, as llama-server), "
                                 "True or False"),
        "kv_cache": (tuple(KV_TYPES), "KV cache type (quantized needs flash attention; "
                                      "default f16)"),
        "tensor_split": ("numbers", "share of the model per GPU, e.g. [3, 1] (default: "
                                    "by free VRAM)"),
        "n_batch": ("int", "prompt tokens per decode call (default 512)"),
        "n_ubatch": ("int", "physical batch size (default 512)"),
        "offload_kqv": ("bool", "keep the KV cache on the GPU (default True)"),
        "use_mmap": ("bool", "map the file instead of reading it (default True)"),
        "use_mlock": ("bool", "lock the weights in RAM (default False)"),
        "rope_freq_base": ("number", "RoPE base frequency (default: the model's)"),
        "rope_freq_scale": ("number", "RoPE frequency scale (default: the model's)"),
        "mmproj": ("text", "the vision projector GGUF for images (default: the "
                           "mmproj*.gguf beside the model, if any)"),
        "image_tokens": ("int", "most image tokens one image takes; larger images are "
                                "scaled down (default 1024)"),
    },
    aliases=("llama-cpp", "llamacpp", "llama_cpp", "llama-cpp-python", "gguf"),
    builds=(),
    # an f16 KV cache (type_k/type_v); the CPU overhead measured with the SmolLM2-135M
    # fixture (RSS after a filled context, less weights and KV cache:
    # tests/test_memory_rss.py); GPUs keep the unmeasured default (CUDA/Metal runtimes)
    memory={"cpu": EngineMemory(2, 64 * MiB), "*": EngineMemory(2)},
    default_device="*",
    embedder="localrun.backends.llama_cpp.embeddings",
)
