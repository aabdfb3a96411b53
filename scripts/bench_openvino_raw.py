"""OpenVINO GenAI batch: the engine's own ContinuousBatchingPipeline.generate() vs Model.batch.

The same prompts (chat-templated, the same token ids), greedy, the same number of new
tokens each, all at once, on the same pipeline (the one localrun builds for the model:
its scheduler settings, prefix caching, KV precision), so that only what localrun adds
differs: the driver's engine thread, per-step handle reads, detokenization, stop-string
matching, the Completions. ``--engine-default`` adds a third path: generate() on a
ContinuousBatchingPipeline with the engine's default SchedulerConfig.

Each measurement runs in a process of its own (the paths alternate, rep by rep): in one
process, generate() called from the main thread after localrun's engine thread had run
the model took up to twice as long in wall time at the same CPU time. Each process runs
a warm-up batch first. Wall time and the process's CPU time are both printed: on a
shared machine CPU time is the steadier of the two.

    .venv/bin/python scripts/bench_openvino_raw.py                     # 32 x 64, 3 reps
    .venv/bin/python scripts/bench_openvino_raw.py --prompts 32 --max-tokens 64 --reps 5
    .venv/bin/python scripts/bench_openvino_raw.py --threads 1 --engine-default

Target (issue 15): Model.batch within 10% of generate(). Not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

PATHS = ("generate", "localrun")


def child(path: str, n: int, max_tokens: int, threads: int | None) -> dict[str, Any]:
    """One timed batch through ``path`` (after a warm-up), in this process."""
    import numpy as np
    import openvino
    import openvino_genai as og
    from bench_batch import prompts

    import localrun
    from tests.models import test_model

    items = prompts(n)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = localrun.load(str(test_model("openvino-int4")), backend="openvino",
                              threads=threads)
    with model:
        session = model._session
        pipe = session.batcher().pipe
        if path == "engine-default":
            pipe = og.ContinuousBatchingPipeline(session.info.path, og.SchedulerConfig(),
                                                 session.device, session.load_properties)
        ids = [openvino.Tensor(np.asarray(
            [list(session.encode_chat([{"role": "user", "content": p}]).tokens)],
            dtype=np.int64)) for p in items]

        def configs(k: int) -> list[Any]:
            out = []
            for _ in range(k):
                g = og.GenerationConfig()
                g.max_new_tokens = max_tokens
                g.do_sample = False
                g.stop_token_ids = set(session._eos)
                out.append(g)
            return out

        def run(k: int) -> int:
            if path == "localrun":
                done = model.batch(items[:k], max_concurrency=k, temperature=0.0,
                                   max_tokens=max_tokens)
                return sum(c.usage.completion_tokens for c in done)
            results = pipe.generate(ids[:k], configs(k))
            eos = session._eos
            return sum(sum(t not in eos for t in r.m_generation_ids[0]) for r in results)

        run(min(4, n))  # warm-up: first-call costs off the clock
        c0, t0 = time.process_time(), time.perf_counter()
        tokens = run(n)
        return {"path": path, "wall": time.perf_counter() - t0,
                "cpu": time.process_time() - c0, "tokens": tokens}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="INFERENCE_NUM_THREADS")
    ap.add_argument("--engine-default", action="store_true",
                    help="also time generate() with the engine's default SchedulerConfig")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.prompts, args.max_tokens, args.threads)))
        return
    paths = [*PATHS, "engine-default"] if args.engine_default else list(PATHS)
    print(f"load average {os.getloadavg()[0]:.1f}; {args.prompts} chat prompts x "
          f"{args.max_tokens} greedy tokens, all at once; threads {args.threads or 'default'}")
    runs: dict[str, list[dict[str, Any]]] = {p: [] for p in paths}
    for rep in range(args.reps):
        order = paths if rep % 2 == 0 else paths[::-1]
        for path in order:
            cmd = [sys.executable, __file__, "--child", path, "--prompts", str(args.prompts),
                   "--max-tokens", str(args.max_tokens)]
            if args.threads:
                cmd += ["--threads", str(args.threads)]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=ROOT)
            r = json.loads(out.stdout.strip().splitlines()[-1])
            runs[path].append(r)
            print(f"rep {rep + 1} {path:14} {r['wall']:6.2f} s wall  {r['cpu']:6.2f} s CPU  "
                  f"{r['tokens']} tokens", flush=True)
    print("\n| path | wall median (min) | CPU median | tokens | wall / generate | "
          "CPU / generate |\n|---|---|---|---|---|---|")
    base = runs["generate"]
    bw = statistics.median(r["wall"] for r in base)
    bc = statistics.median(r["cpu"] for r in base)
    for path in paths:
        rs = runs[path]
        w = statistics.median(r["wall"] for r in rs)
        c = statistics.median(r["cpu"] for r in rs)
        print(f"| {path} | {w:.2f} s ({min(r['wall'] for r in rs):.2f}) | {c:.2f} s | "
              f"{rs[-1]['tokens']} | {w / bw:.2f} | {c / bc:.2f} |")


if __name__ == "__main__":
    main()
