"""One engine, one model, measured once through localrun: load time, TTFT, tokens/s, VRAM.

    python bench.py --backend llama.cpp --model tiny-q8_0.gguf --json out.json

Greedy raw completions of --tokens tokens, --runs times after one warm-up; medians. The
VRAM figure is this process's own, from NVML (the whole card's used memory, before and
after loading, where NVML lists no processes). For the GPU kit's record of what ran,
not a benchmark of the tiny random model's speed against anything.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def vram_mib() -> tuple[float | None, float | None]:
    """(this process's VRAM, the card's used VRAM) in MiB from NVML, None where unknown."""
    try:
        import pynvml
    except ImportError:
        return None, None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return None, None
    try:
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        used = pynvml.nvmlDeviceGetMemoryInfo(h).used / 2**20
        mine = None
        try:
            for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h):
                if p.pid == os.getpid() and p.usedGpuMemory is not None:
                    mine = p.usedGpuMemory / 2**20
        except pynvml.NVMLError:
            pass
        return mine, used
    finally:
        pynvml.nvmlShutdown()


def torch_cuda_mib() -> float | None:
    """What torch's allocator holds on the GPU (the ExLlamas load through torch), or None
    where torch was not imported or never touched CUDA."""
    torch = sys.modules.get("torch")
    try:
        if torch is None or not torch.cuda.is_initialized():
            return None
        return float(torch.cuda.memory_reserved()) / 2**20
    except Exception:  # a reading only: never fail the bench over it
        return None


def bench(backend: str, model: str, tokens: int, runs: int) -> dict[str, Any]:
    import localrun

    _, used0 = vram_mib()
    t0 = time.perf_counter()
    m = localrun.load(model, backend=backend, context=2048)
    load_s = time.perf_counter() - t0
    try:
        mine, used1 = vram_mib()
        prompt = "Once upon a time, in a small village by the sea, there lived"
        m.complete(prompt, temperature=0, max_tokens=8)  # warm-up
        done = [m.complete(prompt, temperature=0, max_tokens=tokens) for _ in range(runs)]
        info = m.info
        out: dict[str, Any] = {
            "backend": backend, "engine_version": info.engine_version,
            "quantization": info.quantization, "device": getattr(info, "device", None),
            "load_s": round(load_s, 3), "runs": runs,
            "prompt_tokens": done[0].usage.prompt_tokens,
            "completion_tokens": [c.usage.completion_tokens for c in done],
            "ttft_ms": round(statistics.median(c.timings.ttft for c in done) * 1000, 2),
            "decode_tps": round(statistics.median(c.timings.decode_tps for c in done), 1),
            "prefill_tps": round(statistics.median(c.timings.prefill_tps for c in done), 1),
        }
        held = torch_cuda_mib()
        if held is not None:
            out["torch_cuda_mib"] = round(held, 1)
        if mine is not None:
            out["vram_mib"] = round(mine, 1)
        elif used0 is not None and used1 is not None:
            out["vram_mib"] = round(used1 - used0, 1)
            out["vram_note"] = "the card's used memory before and after loading"
        elif held is not None:
            out["vram_mib"] = out["torch_cuda_mib"]
            out["vram_note"] = "torch's reserved memory (NVML gave no reading)"
        return out
    finally:
        m.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--json", type=Path, required=True)
    args = ap.parse_args(argv)
    data = bench(args.backend, args.model, args.tokens, args.runs)
    args.json.write_text(json.dumps(data, indent=1) + "\n")
    print(json.dumps(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
