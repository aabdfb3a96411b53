"""The KV cache types llama.cpp takes: shared by llama_cpp.py (placement, memory) and
llama_cpp_batch.py (its context's size), which must not import each other."""

from __future__ import annotations

#: KV cache choices: the ggml type llama-cpp-python names, and bytes per element
#: (q8_0 / q4_0 blocks hold 32 values in 34 / 18 bytes).
KV_TYPES: dict[str, tuple[str, float]] = {
    "f16": ("GGML_TYPE_F16", 2.0),
    "q8_0": ("GGML_TYPE_Q8_0", 34 / 32),
    "q4_0": ("GGML_TYPE_Q4_0", 18 / 32),
}
