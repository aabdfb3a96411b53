"""llama.cpp sequences decoded together (localrun's Batcher) vs in turn, and against
llama.cpp's own ``llama-batched-bench`` at the same batch sizes (issue 15).

    .venv/bin/python scripts/bench_llama_batch.py
    .venv/bin/python scripts/bench_llama_batch.py --batched-bench PATH/llama-batched-bench \\
        --levels 1 2 4 8 --repeats 3 --json docs/results/llama_batch.json

For each batch size N: N sequences of ``--prompt`` tokens each (a story's opening, so
that greedy decoding runs on rather than stopping), ``--tokens`` generated each, greedy.

- **in turn**: the N sequences one after another through ``Session.generate`` (the
  single path, llama-cpp-python's ``Llama.generate``); output tokens / wall time.
- **batched**: the N added to the session's Batcher together and stepped until all end.
  ``all``: output tokens / wall time, prefill included; ``tg``: the steps in which every
  sequence was generating (one token each), which is what llama-batched-bench's S_TG
  measures (its TG steps feed random tokens and sample nothing).
- **api**: ``Model.batch(prompts, max_concurrency=N)`` through localrun's driver (chat
  prompts of about the same length, greedy), against ``max_concurrency=1``.
- **llama-batched-bench** ``-npp P -ntg T -npl N`` with the session's threads, batch and
  ubatch sizes and flash attention, ``-c`` = 8 x the context: one KV stream of the
  session's context per sequence (non-unified), as the Batcher has.

Every figure is the best of ``--repeats`` rounds, the modes interleaved within a round:
the machine this was written on is shared, and the best run is the one least disturbed.
Not a test: numbers depend on the machine and what else runs on it.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TOPICS = ["a lighthouse keeper", "a lost dog", "a clockmaker", "two sisters", "a baker",
          "a young pilot", "an old map", "a river town"]
STORY = ("Chapter one. This is the story of {}. It begins on a cold morning in late "
         "autumn, when the wind came down from the hills and the whole valley smelled of "
         "rain and wood smoke. Nobody in the village expected anything to happen that day. ")


def greedy(tokens: int) -> Any:
    from localrun.sampling import ResolvedSampling

    return ResolvedSampling(max_tokens=tokens, temperature=0.0, top_p=1.0, top_k=0,
                            min_p=0.0, repetition_penalty=1.0, seed=0, stop=())


def story_prompts(session: Any, n: int, length: int) -> list[Any]:
    """``n`` prompts of exactly ``length`` tokens (different stories)."""
    from localrun.backends.base import Prompt

    out = []
    for i in range(n):
        text = STORY.format(TOPICS[i % len(TOPICS)]) * 8
        tokens = list(session.encode_text(text).tokens)[:length]
        if len(tokens) < length:
            raise SystemExit(f"--prompt {length} is longer than the story text allows")
        out.append(Prompt(tokens))
    return out


def in_turn(session: Any, prompts: list[Any], tokens: int) -> dict[str, float]:
    from localrun.backends.base import GenerationStats
    from localrun.types import CancelToken

    made = 0
    t0 = time.perf_counter()
    for p in prompts:
        session._llm.reset()  # no prefix reuse between the stories
        stats = GenerationStats()
        for _ in session.generate(p, greedy(tokens), CancelToken(), stats):
            pass
        made += stats.completion_tokens
    wall = time.perf_counter() - t0
    return {"tokens": made, "seconds": wall, "tps": made / wall}


def batched(batcher: Any, prompts: list[Any], tokens: int) -> dict[str, float]:
    from localrun.backends.base import GenerationStats

    for slot in batcher._slots:  # no prefix reuse from the previous round
        slot.cells = []
    stats = [GenerationStats() for _ in prompts]
    t0 = time.perf_counter()
    for k, p in enumerate(prompts):
        batcher.add(k, p, greedy(tokens), stats[k])
    live = set(range(len(prompts)))
    tg_seconds, tg_tokens = 0.0, 0
    while live:
        generating = all(stats[k].completion_tokens > 0 for k in live)
        ts = time.perf_counter()
        events = batcher.step()
        dt = time.perf_counter() - ts
        if generating:
            tg_seconds += dt
            tg_tokens += sum(1 for _, piece in events if piece is not None)
        live -= {k for k, piece in events if piece is None}
    wall = time.perf_counter() - t0
    made = sum(s.completion_tokens for s in stats)
    return {"tokens": made, "seconds": wall, "tps": made / wall,
            "tg_tps": tg_tokens / tg_seconds if tg_seconds else 0.0}


def api(model: Any, n: int, concurrency: int, tokens: int) -> dict[str, float]:
    items = [f"Write a long story about {TOPICS[i % len(TOPICS)]}. " + STORY.format(
        TOPICS[i % len(TOPICS)]) for i in range(n)]
    t0 = time.perf_counter()
    out = model.batch(items, max_concurrency=concurrency, temperature=0.0,
                      max_tokens=tokens)
    wall = time.perf_counter() - t0
    made = sum(c.usage.completion_tokens for c in out)
    return {"tokens": made, "seconds": wall, "tps": made / wall}


def batched_bench(exe: str, path: str, args: argparse.Namespace, ctx: int, threads: int,
                  n_batch: int, n_ubatch: int, flash: str) -> tuple[list[str], dict[int, Any]]:
    cmd = [exe, "-m", path, "-c", str(8 * ctx), "-b", str(n_batch), "-ub", str(n_ubatch),
           "-npp", str(args.prompt), "-ntg", str(args.tokens),
           "-npl", ",".join(map(str, args.levels)), "-t", str(threads), "-fa", flash,
           "--output-format", "jsonl"]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return cmd, {int(r["pl"]): r for r in rows}


def main() -> None:
    from localrun.backends.llama_cpp import default_threads

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="a GGUF (default: the SmolLM2 Q8_0 test fixture)")
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=default_threads())
    ap.add_argument("--prompt", type=int, default=128, help="prompt tokens per sequence")
    ap.add_argument("--tokens", type=int, default=64, help="tokens generated per sequence")
    ap.add_argument("--levels", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batched-bench", help="llama.cpp's llama-batched-bench executable")
    ap.add_argument("--no-api", action="store_true", help="skip the Model.batch figures")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()

    import localrun
    from localrun.backends.base import LoadRequest
    from localrun.backends.llama_cpp import LlamaCppSession
    from localrun.backends.llama_cpp_batch import LlamaCppBatcher

    path = args.model
    if path is None:
        from tests.models import read_manifest

        path = (read_manifest() or {}).get("models", {}).get("gguf-q8_0")
        if not path:
            raise SystemExit("no Q8_0 fixture: run python scripts/make_test_models.py")
    request = LoadRequest(path=path, format="gguf", context=args.context,
                          threads=args.threads)
    session = LlamaCppSession(request)
    params = session._llm.context_params
    n_batch, n_ubatch = int(params.n_batch), int(params.n_ubatch)
    flash = {-1: "auto", 0: "off", 1: "on"}.get(int(params.flash_attn_type), "auto")
    batcher = LlamaCppBatcher(session, max(args.levels), args.context)
    model = None if args.no_api else localrun.load(path, backend="llama.cpp",
                                                   context=args.context,
                                                   threads=args.threads)
    best: dict[str, dict[int, dict[str, float]]] = {}

    def keep(mode: str, level: int, result: dict[str, float]) -> None:
        old = best.setdefault(mode, {}).get(level)
        if old is None or result["tps"] > old["tps"]:
            best[mode][level] = result

    command: list[str] = []
    for r in range(args.repeats):
        for n in args.levels:
            prompts = story_prompts(session, n, args.prompt)
            keep("in_turn", n, in_turn(session, prompts, args.tokens))
            b = batched(batcher, prompts, args.tokens)
            keep("batched", n, b)
            tg = dict(b, tps=b["tg_tps"])
            keep("batched_tg", n, tg)
            if model is not None:
                keep("api_in_turn", n, api(model, n, 1, args.tokens))
                keep("api", n, api(model, n, n, args.tokens))
        if args.batched_bench:
            command, rows = batched_bench(args.batched_bench, path, args, args.context,
                                          args.threads, n_batch, n_ubatch, flash)
            for n, row in rows.items():
                keep("llama_batched_bench_tg", n, {"tps": float(row["speed_tg"])})
                keep("llama_batched_bench_all", n,
                     {"tps": float(row["pl"] * row["tg"] / row["t"])})
        print(f"round {r + 1}/{args.repeats} done", file=sys.stderr)
    batcher.close()
    session.close()
    if model is not None:
        model.close()

    cols = [("in_turn", "in turn"), ("batched", "batched"), ("batched_tg", "batched tg"),
            ("llama_batched_bench_tg", "l-b-b tg"), ("api_in_turn", "api in turn"),
            ("api", "api")]
    cols = [(k, t) for k, t in cols if k in best]
    print(f"model {Path(path).name}, context {args.context}, threads {args.threads}, "
          f"prompt {args.prompt}, tokens {args.tokens}, best of {args.repeats}; tok/s")
    print("| N | " + " | ".join(t for _, t in cols) + " | batched / in turn |"
          + (" batched tg / l-b-b tg |" if "llama_batched_bench_tg" in best else "")
          + (" api / api in turn |" if "api" in best else ""))
    for n in args.levels:
        row = [f"{best[k][n]['tps']:.1f}" for k, _ in cols]
        ratio = best["batched"][n]["tps"] / best["in_turn"][n]["tps"]
        line = f"| {n} | " + " | ".join(row) + f" | {ratio:.2f}x |"
        if "llama_batched_bench_tg" in best:
            anchor = best["llama_batched_bench_tg"][n]["tps"]
            line += f" {best['batched_tg'][n]['tps'] / anchor:.2f} |"
        if "api" in best:
            line += f" {best['api'][n]['tps'] / best['api_in_turn'][n]['tps']:.2f}x |"
        print(line)
    if command:
        print("llama-batched-bench:", " ".join(command))
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"model": Path(path).name, "context": args.context, "threads": args.threads,
             "prompt": args.prompt, "tokens": args.tokens, "repeats": args.repeats,
             "llama_batched_bench": command, "best": best}, indent=1) + "\n")


if __name__ == "__main__":
    main()
