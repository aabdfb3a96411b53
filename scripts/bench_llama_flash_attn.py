#!/usr/bin/env python3
"""llama.cpp's prefill with and without flash attention: N new tokens on P cached cells.

A chat's next turn, with the last prompt and reply kept, feeds llama.cpp only its new
message (17-19 tokens in scripts/bench_multiturn.py's conversation) on a context that
grows by ~112 cells a turn. ggml's CPU flash attention computes fewer than 64 query rows
one row at a time over every cached cell (``flash_attn_ext_f16_one_chunk``), 64 or more
with its tiled kernel; without flash attention the same rows go through matrix products.
This prints, for P cached cells and N new tokens, the median thread CPU time of
``Llama.eval`` of the N tokens with flash attention on and off (llama-cpp-python alone,
one thread, so that the time is this thread's CPU time: less swayed by other work on a
busy machine than wall-clock time). docs/results/multiturn_fast.md has the results.

    .venv/bin/python scripts/bench_llama_flash_attn.py
    .venv/bin/python scripts/bench_llama_flash_attn.py --cached 121 573 2000 --new 17 64 200
    .venv/bin/python scripts/bench_llama_flash_attn.py --threads 2 --n-ctx 8192 --new 17

Model: scripts/make_test_models.py's Q8_0 GGUF (SmolLM2-135M-Instruct). Not a test.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> None:
    import llama_cpp

    from scripts.bench_multiturn import fixture

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cached", type=int, nargs="+", default=[121, 573, 2000])
    ap.add_argument("--new", type=int, nargs="+", default=[17, 64, 200])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1,
                    help="llama.cpp's threads; above 1 the times are wall-clock (one thread's "
                    "CPU time no longer holds the work)")
    ap.add_argument("--n-ctx", type=int, default=4096, help="the context (at least what "
                    "the largest case needs)")
    args = ap.parse_args()
    path = fixture("llama.cpp")
    if path is None:
        sys.exit("no Q8_0 fixture (run python scripts/make_test_models.py)")
    text = (ROOT / "README.md").read_text(encoding="utf-8") * 4
    need = max(args.cached) + max(args.new)
    res: dict[tuple[bool, int, int], float] = {}
    load = [os.getloadavg()[0]]
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    for flash in (True, False):
        llm = llama_cpp.Llama(model_path=path, n_ctx=max(args.n_ctx, need),
                              n_threads=args.threads, n_threads_batch=args.threads,
                              flash_attn=flash, verbose=False)
        tokens = llm.tokenize(text.encode(), add_bos=True)[:need]
        for cached in args.cached:
            llm._ctx.kv_cache_seq_rm(-1, 0, -1)
            llm.n_tokens = 0
            llm.eval(tokens[:cached])
            for new in args.new:
                times = []
                for _ in range(args.reps):
                    llm._ctx.kv_cache_seq_rm(-1, cached, -1)
                    llm.n_tokens = cached
                    start = clock()
                    llm.eval(tokens[cached:cached + new])
                    times.append(clock() - start)
                res[(flash, cached, new)] = statistics.median(times)
        llm.close()
    load.append(os.getloadavg()[0])
    print(f"load average {load[0]:.1f} at the start, {load[1]:.1f} at the end; "
          f"{args.threads} thread(s), n_ctx {max(args.n_ctx, need)}, "
          f"{'thread CPU' if args.threads == 1 else 'wall-clock'} time")
    print("| cells cached | new tokens | flash attention on | off | off / on |")
    print("|---|---|---|---|---|")
    for cached in args.cached:
        for new in args.new:
            on, off = res[(True, cached, new)], res[(False, cached, new)]
            print(f"| {cached} | {new} | {on * 1000:.1f} ms | {off * 1000:.1f} ms | "
                  f"{off / on:.2f} |")


if __name__ == "__main__":
    main()
