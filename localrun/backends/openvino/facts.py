"""OpenVINO GenAI's facts: its entry in the engine table, which formats it runs, what it
allocates, its options. Pure data: importing it imports no engine."""

from __future__ import annotations

from localrun.backends.spec import BackendSpec, Condition, EngineMemory, MiB

SPEC = BackendSpec(
    name="openvino", title="OpenVINO GenAI", module="localrun.backends.openvino.session",
    dists=("openvino-genai",), extra="openvino", home="here",
    formats=("openvino",), loads=("gguf",),
    conditions={
        "openvino": Condition(
            "needs openvino_tokenizer.xml and openvino_detokenizer.xml beside the model"),
        "gguf": Condition(
            "preview GGUF reader: llama, qwen2 and qwen3 architectures with F16/Q4_0/Q4_1/"
            "Q8_0/Q4_K/Q6_K weights only (openvino-genai >= 2025.2); it rounds the block "
            "minimums of Q4_1 and Q4_K weights (SmolLM2 Q4_1: KL 0.79 from llama.cpp's "
            "logits), so prefer llama.cpp for those files, or Q8_0, or an IR from "
            "optimum-cli",
            architectures=("llama", "qwen2", "qwen3"),
            quantizations=("F16", "Q4_0", "Q4_1", "Q8_0", "Q4_K_S", "Q4_K_M", "Q6_K"),
            min_version="2025.2"),
    },
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
        "image_tokens": ("int", "a vision model (VLMPipeline): most image tokens one "
                                "image takes; larger images are scaled down (default 1024)"),
    },
    aliases=("openvino-genai", "openvino_genai", "ov"), builds=(),
    # f32 KV cache on the CPU, where the session sets it (the GPU and NPU plugins keep
    # f16); the CPU overhead measured as llama.cpp's (tests/test_memory_rss.py)
    memory={"cpu": EngineMemory(4, 320 * MiB), "*": EngineMemory(2)},
    default_device="cpu",
    embedder="localrun.backends.openvino.embeddings",
)
