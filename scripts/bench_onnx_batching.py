"""Does ONNX Runtime GenAI batch on a CPU well enough for localrun to use it? (issue 15)

Three checks on the onnx-int4 fixture (SmolLM2-135M), engine calls only:

* **one Generator, batch_size 4**: chat prompts of different lengths, left-padded with
  ``pad_token_id`` as the engine requires; are the greedy replies those of each prompt
  alone? (The engine's attention mask hides every pad token, and SmolLM2's pad token is
  its EOS, ``<|im_end|>``, which every chat prompt holds.)
* **og.Engine, 4 requests at once** (0.18's Request/TurnOptions API; on CPU its static
  batching path): tokens/s against the one-at-a-time Generator loop localrun runs, at
  three session lengths (``RequestOptions.set_max_session_tokens``).
* **a late request**: added while 3 of the engine's 4 rows run; at which step does it
  get its first token?

    .venv/bin/python scripts/bench_onnx_batching.py
    .venv/bin/python scripts/bench_onnx_batching.py --tokens 32

Not a test: numbers depend on the machine and what else runs on it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

QUESTIONS = ["Tell me a story about a lighthouse.", "Explain how rain forms, step by step.",
             "Write a poem about the autumn woods.", "Describe a busy market in the morning."]


def main() -> None:
    import numpy as np
    import onnxruntime_genai as og

    from tests.models import read_manifest

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=64, help="greedy tokens per request")
    args = ap.parse_args()
    n = args.tokens
    path = (read_manifest() or {}).get("models", {}).get("onnx-int4")
    if not path:
        sys.exit("no onnx-int4 fixture: run python scripts/make_test_models.py")
    model = og.Model(path)
    tok = og.Tokenizer(model)
    token_flag = int(og.EngineEventFlags.TOKEN.value)

    def chat(question: str) -> list[int]:
        text = tok.apply_chat_template(json.dumps([{"role": "user", "content": question}]),
                                       add_generation_prompt=True)
        return [int(t) for t in tok.encode(text)]

    prompts = [chat(q) for q in QUESTIONS]

    def alone(p: list[int]) -> list[int]:
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=len(p) + n, min_length=len(p) + n,
                                  do_sample=False)
        gen = og.Generator(model, params)
        gen.append_tokens(p)
        out: list[int] = []
        while len(out) < n:
            gen.generate_next_token()
            out.append(int(gen.get_next_tokens()[0]))
        return out

    print(f"load average {os.getloadavg()[0]:.1f}; {len(prompts)} chat prompts, "
          f"{n} greedy tokens each")
    t0 = time.perf_counter()
    single = [alone(p) for p in prompts]
    t_loop = time.perf_counter() - t0
    total = n * len(prompts)
    print(f"| Generator loop, one at a time (localrun) | {t_loop:.2f} s | "
          f"{total / t_loop:.1f} tok/s | 1.00x |")

    # one Generator, four rows
    width = max(map(len, prompts))
    pad = int(json.loads((Path(path) / "genai_config.json").read_text())["model"]
              ["pad_token_id"])
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=width + n, do_sample=False, batch_size=len(prompts))
    gen = og.Generator(model, params)
    gen.append_tokens(np.array([[pad] * (width - len(p)) + p for p in prompts], dtype=np.int32))
    rows: list[list[int]] = [[] for _ in prompts]
    for _ in range(n):
        gen.generate_next_token()
        for i, t in enumerate(gen.get_next_tokens()):
            rows[i].append(int(t))
    same = sum(r[:len(s)] == s for r, s in zip(rows, single, strict=True))
    print(f"one Generator, batch_size {len(prompts)}, padded with token {pad}: "
          f"{same}/{len(prompts)} replies equal to the prompt alone")

    engine = og.Engine(model)
    events = engine.create_event_buffer(64)
    print(f"og.Engine: configured_max_batch_size "
          f"{engine.get_capabilities().configured_max_batch_size}")

    def request(p: list[int], session: int, tokens: int) -> Any:
        options = og.RequestOptions()
        options.set_max_session_tokens(session)
        req = engine.create_request(options=options)
        turn = og.TurnOptions(req)
        turn.set_do_sample(False)
        turn.set_max_generated_tokens(tokens)
        turn.set_min_generated_tokens(tokens)
        req.begin_turn(np.array(p, dtype=np.int32), turn)
        return req

    def drain(reqs: list[Any], late: Any = None) -> tuple[list[list[int]], list[list[int]]]:
        """Every request's tokens, and which requests got one at each step."""
        out: list[list[int]] = [[] for _ in reqs]
        steps: list[list[int]] = []
        while engine.has_pending_requests():
            if late is not None and len(steps) == 3:
                reqs.append(late())
                out.append([])
                late = None
            batch = engine.run(events)
            got = []
            for k in range(len(batch)):
                e = batch[k]
                if int(e.flags.value) & token_flag:
                    i = next(i for i, r in enumerate(reqs) if r == e.request)
                    out[i].append(e.token)
                    got.append(i)
            steps.append(got)
        for r in reqs:
            r.close()
        return out, steps

    for label, extra in (("prompt + tokens", n), ("prompt + 1024", 1024),
                         ("0: the default (the context)", None)):
        reqs = [request(p, len(p) + extra if extra else 0, n) for p in prompts]
        t0 = time.perf_counter()
        out, _ = drain(reqs)
        dt = time.perf_counter() - t0
        same = sum(o[:n] == s for o, s in zip(out, single, strict=True))
        print(f"| og.Engine, {len(prompts)} at once, max_session_tokens {label} | {dt:.2f} s | "
              f"{total / dt:.1f} tok/s | {t_loop / dt:.2f}x | greedy replies equal to alone: "
              f"{same}/{len(prompts)}")

    reqs = [request(p, len(p) + 64, t) for p, t in zip(prompts[:3], (4, 8, 32), strict=True)]
    _, steps = drain(reqs, late=lambda: request(prompts[3], len(prompts[3]) + 64, 8))
    first = next(i for i, got in enumerate(steps) if 3 in got) + 1
    busy = max(i for i, got in enumerate(steps) if any(r < 3 for r in got)) + 1
    print(f"late request (added before step 4, 3 of 4 rows busy): first token at step {first}; "
          f"the batch's last row ended at step {busy}")


if __name__ == "__main__":
    main()
