"""llama.cpp sequences decoded together (localrun's Batcher) vs in turn, and against
llama.cpp's own ``llama-batched-bench`` at the same batch sizes (issue 15).

    .venv/bin/python scripts/bench_llama_batch.py --batched-bench PATH/llama-batched-bench
    .venv/bin/python scripts/bench_llama_batch.py --threads 2 --levels 1 4 --repeats 5

For each batch size N: N sequences of ``--prompt`` tokens each (a story's opening, so
that greedy decoding runs on rather than stopping), ``--tokens`` generated each, greedy.

- **in turn**: the N sequences one after another through ``Session.generate`` (the
  single path, llama-cpp-python's ``Llama.generate``), prompts included.
- **batched**: the N added to the session's Batcher together and stepped until all end,
  prompts included, as localrun runs them: one decode for the step's tokens from
  ``together`` sequences on (``LlamaCppBatcher.calibrate``), a decode each below.
- **batched TG**: the Batcher with every step in one decode (``together=2``), only the
  decode steps of the second half of the reply (every sequence generating).
- **llama-batched-bench** ``-npp P -ntg T -npl N``, run with ``-ntg T`` and ``-ntg T/2``:
  the difference is the cost of the last T/2 decode steps, the window of batched TG.
  Same threads, batch and ubatch sizes, flash attention; ``-c`` = 8 x the context, so
  one KV stream of the session's context per sequence (non-unified), as the Batcher has.
- **api**: ``Model.batch(prompts, max_concurrency=N)`` through localrun's driver (chat
  prompts of about the same length, each call's new), against ``max_concurrency=1``.

Every mode runs on the same ``--threads`` for prompts and decoding (``-t``/``-tb``).
Figures are output tokens per second of **CPU time** (the process's, the engine
thread's included; llama-batched-bench's from its rusage), the median of ``--repeats``
rounds, modes interleaved: on a shared machine the wall clock mostly measures the
neighbours, while one thread's CPU time is what the work costs on a core of its own.
``--clock wall`` prints wall-clock figures instead (a quiet machine, several threads);
the JSON (``--json``) holds both for every run.
Not a test: numbers depend on the machine.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
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

Run = dict[str, float]


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


def pin_threads(session: Any, threads: int) -> None:
    """The session's context, and its batcher's, on ``threads`` for prompts too
    (llama-cpp-python's default for prompts is every CPU)."""
    session._engine.lc.llama_set_n_threads(session._engine.ctx, threads, threads)
    batcher = session.batcher()
    if batcher is not None:
        batcher._threads = dict.fromkeys(("decode", "prefill"), (threads, threads))
        batcher._mode = ""


def in_turn(session: Any, prompts: list[Any], tokens: int) -> Run:
    from localrun.backends.base import GenerationStats
    from localrun.types import CancelToken

    made = 0
    wall, cpu = time.perf_counter(), time.process_time()
    for p in prompts:
        session._engine.llm.reset()  # no prefix reuse between the stories
        stats = GenerationStats()
        for _ in session.generate(p, greedy(tokens), CancelToken(), stats):
            pass
        made += stats.completion_tokens
    return {"tokens": made, "wall": time.perf_counter() - wall,
            "cpu": time.process_time() - cpu}


def batched(batcher: Any, prompts: list[Any], tokens: int) -> tuple[Run, Run]:
    """The whole run, and its second half's decode steps (the TG window)."""
    from localrun.backends.base import GenerationStats

    for slot in batcher._slots:  # no prefix reuse from the previous round
        slot.cells = []
    stats = [GenerationStats() for _ in prompts]
    wall, cpu = time.perf_counter(), time.process_time()
    for k, p in enumerate(prompts):
        batcher.add(k, p, greedy(tokens), stats[k])
    live = set(range(len(prompts)))
    tg = {"tokens": 0.0, "wall": 0.0, "cpu": 0.0}
    while live:
        window = all(stats[k].completion_tokens >= tokens // 2 for k in live)
        w, c = time.perf_counter(), time.process_time()
        events = batcher.step()
        if window:
            tg["wall"] += time.perf_counter() - w
            tg["cpu"] += time.process_time() - c
            tg["tokens"] += sum(1 for _, piece in events if piece is not None)
        live -= {k for k, piece in events if piece is None}
    whole = {"tokens": float(sum(s.completion_tokens for s in stats)),
             "wall": time.perf_counter() - wall, "cpu": time.process_time() - cpu}
    return whole, tg


_calls = iter(range(1, 1 << 30))


def api(model: Any, n: int, concurrency: int, tokens: int) -> Run:
    call = next(_calls)  # a new opening each call: no prompt reused from an earlier call
    items = [f"Story {call}.{i}: write a long story about {TOPICS[i % len(TOPICS)]}. "
             + STORY.format(TOPICS[i % len(TOPICS)]) for i in range(n)]
    wall, cpu = time.perf_counter(), time.process_time()
    out = model.batch(items, max_concurrency=concurrency, temperature=0.0,
                      max_tokens=tokens)
    return {"tokens": sum(c.usage.completion_tokens for c in out),
            "wall": time.perf_counter() - wall, "cpu": time.process_time() - cpu}


def batched_bench(cmd: list[str], n: int, tokens: int) -> tuple[dict[str, Any], float]:
    """One llama-batched-bench run at N sequences: its JSON row, and its CPU seconds."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run([*cmd, "-npl", str(n), "-ntg", str(tokens)], capture_output=True,
                          text=True, check=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return rows[0], cpu


def tps(runs: list[Run], clock: str = "cpu") -> float:
    return statistics.median(r["tokens"] / r[clock] for r in runs if r[clock] > 0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="a GGUF (default: the SmolLM2 Q8_0 test fixture)")
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=1,
                    help="threads for prompts and decoding, in every mode (default 1)")
    ap.add_argument("--prompt", type=int, default=128, help="prompt tokens per sequence")
    ap.add_argument("--tokens", type=int, default=128, help="tokens generated per sequence")
    ap.add_argument("--levels", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batched-bench", help="llama.cpp's llama-batched-bench executable")
    ap.add_argument("--no-api", action="store_true", help="skip the Model.batch figures")
    ap.add_argument("--clock", choices=("cpu", "wall"), default="cpu",
                    help="the table's clock (cpu: one thread's cost on a shared machine; "
                    "wall: on a quiet one, with several threads); the JSON has both")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()

    import localrun
    from localrun.backends.base import LoadRequest
    from localrun.backends.llama_cpp.batcher import LlamaCppBatcher
    from localrun.backends.llama_cpp.openmp import release_pool
    from localrun.backends.llama_cpp.session import LlamaCppSession

    path = args.model
    if path is None:
        from tests.models import read_manifest

        path = (read_manifest() or {}).get("models", {}).get("gguf-q8_0")
        if not path:
            raise SystemExit("no Q8_0 fixture: run python scripts/make_test_models.py")
    t = args.threads
    session = LlamaCppSession(LoadRequest(path=path, format="gguf", context=args.context,
                                          threads=t))
    params = session._engine.llm.context_params
    flash = {-1: "auto", 0: "off", 1: "on"}.get(int(params.flash_attn_type), "auto")
    batcher = LlamaCppBatcher(session.engine, max(args.levels), args.context)
    session._batcher = batcher
    pin_threads(session, t)
    calibrated = batcher.calibrate(repeats=5)
    model = None
    if not args.no_api:
        model = localrun.load(path, backend="llama.cpp", context=args.context, threads=t)
        pin_threads(model._session, t)
    lbb = [] if not args.batched_bench else [
        args.batched_bench, "-m", path, "-c", str(8 * args.context),
        "-b", str(int(params.n_batch)), "-ub", str(int(params.n_ubatch)),
        "-npp", str(args.prompt), "-t", str(t), "-tb", str(t), "-fa", flash,
        "--output-format", "jsonl"]
    runs: dict[str, dict[int, list[Run]]] = {}

    def keep(mode: str, n: int, run: Run) -> None:
        runs.setdefault(mode, {}).setdefault(n, []).append(run)

    for r in range(args.repeats):
        for n in args.levels:
            prompts = story_prompts(session, n, args.prompt)
            if model is not None:  # its engine thread (and OpenMP pool) ends when idle
                while model._driver._thread is not None:
                    time.sleep(0.05)
            keep("in_turn", n, in_turn(session, prompts, args.tokens))
            batcher.together = calibrated
            keep("batched", n, batched(batcher, prompts, args.tokens)[0])
            batcher.together = 2
            keep("batched_tg", n, batched(batcher, prompts, args.tokens)[1])
            if lbb:
                half = args.tokens // 2
                row, cpu = batched_bench(lbb, n, args.tokens)
                row_half, cpu_half = batched_bench(lbb, n, half)
                keep("lbb_tg", n, {"tokens": n * (args.tokens - half),
                                   "cpu": cpu - cpu_half,
                                   "wall": row["t_tg"] - row_half["t_tg"]})
            if model is not None:
                # the engine modes decoded on this thread: its OpenMP pool goes, as
                # localrun's own calls give theirs back (localrun/backends/llama_cpp/openmp.py)
                release_pool()
                keep("api_in_turn", n, api(model, n, 1, args.tokens))
                keep("api", n, api(model, n, n, args.tokens))
        print(f"round {r + 1}/{args.repeats} done", file=sys.stderr)
    batcher.close()
    session.close()
    if model is not None:
        model.close()

    clock = args.clock
    unit = "CPU second" if clock == "cpu" else "second (wall clock)"
    print(f"{Path(path).name}: context {args.context}, {t} thread(s), prompt {args.prompt}, "
          f"{args.tokens} tokens each; output tokens per {unit}, median of "
          f"{args.repeats}; one decode per step from {calibrated} sequences on")
    head = "| N | in turn | batched | batched / in turn | batched TG |"
    if lbb:
        head += " llama-batched-bench TG | batched TG / l-b-b TG |"
    if model is not None:
        head += " api in turn | api | api / in turn |"
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for n in args.levels:
        a, b = tps(runs["in_turn"][n], clock), tps(runs["batched"][n], clock)
        tg = tps(runs["batched_tg"][n], clock)
        line = f"| {n} | {a:.1f} | {b:.1f} | {b / a:.2f}x | {tg:.1f} |"
        if lbb:
            anchor = tps(runs["lbb_tg"][n], clock)
            line += f" {anchor:.1f} | {tg / anchor:.2f} |"
        if model is not None:
            c, d = tps(runs["api_in_turn"][n], clock), tps(runs["api"][n], clock)
            line += f" {c:.1f} | {d:.1f} | {d / c:.2f}x |"
        print(line)
    if lbb:
        print("llama-batched-bench:", " ".join(lbb), "-npl N -ntg T (and T/2)")
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"model": Path(path).name, "context": args.context, "threads": t,
             "prompt": args.prompt, "tokens": args.tokens, "repeats": args.repeats,
             "together": calibrated, "llama_batched_bench": lbb, "runs": runs},
            indent=1) + "\n")


if __name__ == "__main__":
    main()
