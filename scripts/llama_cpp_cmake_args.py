#!/usr/bin/env python3
"""Print CMAKE_ARGS for building llama-cpp-python on this CPU, without AMX.

llama.cpp's default build (-march=native) turns on the AMX kernels wherever the CPU
advertises AMX. In many VMs and sandboxes the CPU advertises it but the kernel never
grants the tile state, and the first batched matmul dies with SIGILL ("Illegal
instruction") - seen on the Xeon machines this project is built on. So on x86-64
we build for the CPU's own vector extensions (read from /proc/cpuinfo) minus AMX.
Elsewhere (Apple Silicon, ARM, Windows) this prints nothing: the native build is right.

Usage:  CMAKE_ARGS="$(python3 scripts/llama_cpp_cmake_args.py)" pip install llama-cpp-python
"""

from __future__ import annotations

import platform
import sys
from pathlib import Path

# /proc/cpuinfo flag -> ggml CMake option
FLAGS = {
    "sse4_2": "GGML_SSE42", "avx": "GGML_AVX", "avx2": "GGML_AVX2", "fma": "GGML_FMA",
    "f16c": "GGML_F16C", "bmi2": "GGML_BMI2", "avx_vnni": "GGML_AVX_VNNI",
    "avx512f": "GGML_AVX512", "avx512vbmi": "GGML_AVX512_VBMI",
    "avx512_vnni": "GGML_AVX512_VNNI", "avx512_bf16": "GGML_AVX512_BF16",
}
NEVER = ("GGML_AMX_TILE", "GGML_AMX_INT8", "GGML_AMX_BF16")


def cmake_args() -> str:
    if sys.platform != "linux" or platform.machine().lower() not in ("x86_64", "amd64"):
        return ""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    have: set[str] = set()
    for line in text.splitlines():
        if line.startswith("flags"):
            have = set(line.split(":", 1)[1].split())
            break
    args = ["-DGGML_NATIVE=OFF"]
    args += [f"-D{opt}={'ON' if flag in have else 'OFF'}" for flag, opt in FLAGS.items()]
    args += [f"-D{opt}=OFF" for opt in NEVER]
    return " ".join(args)


if __name__ == "__main__":
    print(cmake_args())
