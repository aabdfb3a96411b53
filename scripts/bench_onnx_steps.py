"""Per decode step, what ONNX Runtime GenAI's sampled path costs through localrun.

Each path decodes its own Generator over the same prompts, and the paths take turns
step by step in one process (a different one first at each step), so a busy shared
machine slows them alike; the decoding thread's CPU time is the measure (waiting for a
core is not counted):

* ``engine``: ``generate_next_token`` with the engine's own sampler (the options given);
* ``greedy``: ``generate_next_token`` on a greedy Generator (no sampler);
* ``argmax``: localrun's reads without a sampler: ``get_logits``, ``np.argmax``,
  ``append_tokens``;
* ``localrun``: the same with localrun's sampler (localrun/backends/logits_sampler.py)
  choosing the token, as the backend's loop does;
* ``other``: with ``--other FILE``, the same with another version of that module, e.g.
  ``git show HEAD:localrun/backends/logits_sampler.py > /path/old.py``.

Prints each path's median and mean step (the mean is what a decode's total time
follows), each with its ratio to the engine's.

    .venv/bin/python scripts/bench_onnx_steps.py --temperature 1 --top-p 0.9 --top-k 40
    .venv/bin/python scripts/bench_onnx_steps.py --temperature 0.7 --other /path/old.py
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

MANIFEST = Path(os.environ.get("LOCALRUN_TEST_MODELS") or "~/.cache/localrun/test-models"
                ).expanduser() / "manifest.json"
PROMPTS = ["Tell me about cats and their history in ancient Egypt.",
           "Write a short story about a robot learning to paint.",
           "Explain how a bicycle works, step by step.",
           "What are the main causes of the French Revolution?"]
SEED = 1234


def main() -> int:
    import numpy as np
    import onnxruntime_genai as og

    from localrun.backends import logits_sampler
    from localrun.sampling import ResolvedSampling

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--steps", type=int, default=128, help="tokens per prompt (default 128)")
    ap.add_argument("--prompts", type=int, default=4, help="prompts, each a Generator (4)")
    ap.add_argument("--other", default=None, help="another logits_sampler.py to compare")
    args = ap.parse_args()
    try:
        path = json.loads(MANIFEST.read_text())["models"]["onnx-int4"]
    except (OSError, ValueError, KeyError):
        print(f"no onnx-int4 fixture in {MANIFEST}: run scripts/make_test_models.py")
        return 2
    samplers: dict[str, Any] = {"localrun": logits_sampler}
    if args.other:
        spec = importlib.util.spec_from_file_location("other_sampler", args.other)
        assert spec is not None and spec.loader is not None
        samplers["other"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(samplers["other"])
    sampling = ResolvedSampling(max_tokens=args.steps, temperature=args.temperature,
                                top_p=args.top_p, top_k=args.top_k, min_p=0.0,
                                repetition_penalty=1.0, seed=SEED, stop=())
    model = og.Model(path)
    tokenizer = og.Tokenizer(model)
    names = ["engine", "greedy", "argmax", *samplers]
    cpu: dict[str, list[float]] = {n: [] for n in names}
    load = [os.getloadavg()[0]]
    for i in range(args.prompts):
        ids = np.asarray(tokenizer.encode(PROMPTS[i % len(PROMPTS)]), dtype=np.int32)
        gens: dict[str, Any] = {}
        for n in names:
            params = og.GeneratorParams(model)
            params.set_search_options(max_length=len(ids) + args.steps + 1, **(
                {"do_sample": True, "temperature": args.temperature, "top_p": args.top_p,
                 "top_k": args.top_k, "random_seed": SEED} if n == "engine"
                else {"do_sample": False}))
            gens[n] = og.Generator(model, params)
            gens[n].append_tokens(ids)
        choosers = {n: m.LogitsSampler(sampling, ids) for n, m in samplers.items()}
        for step in range(args.steps):
            turn = names[step % len(names):] + names[:step % len(names)]
            for n in turn:
                g = gens[n]
                t0 = time.thread_time()
                if n in ("engine", "greedy"):
                    g.generate_next_token()
                    int(g.get_next_tokens()[0])
                else:
                    scores = g.get_logits().reshape(-1)
                    token = int(np.argmax(scores)) if n == "argmax" else \
                        choosers[n].choose(scores)
                    g.append_tokens(np.array((token,), dtype=np.int32))
                cpu[n].append(time.thread_time() - t0)
        load.append(os.getloadavg()[0])
    engine = statistics.median(cpu["engine"])
    engine_mean = statistics.fmean(cpu["engine"])
    print(f"temperature {args.temperature}, top_p {args.top_p}, top_k {args.top_k}; "
          f"{args.prompts} x {args.steps} steps a path; load average "
          f"{min(load):.2f}-{max(load):.2f} on {os.cpu_count()} CPUs")
    for n in names:
        m = statistics.median(cpu[n])
        mean = statistics.fmean(cpu[n])
        print(f"  {n:9s} median step {m * 1e3:6.3f} ms CPU  {m / engine:.3f} x engine's;"
              f"  mean {mean * 1e3:6.3f} ms  {mean / engine_mean:.3f} x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
