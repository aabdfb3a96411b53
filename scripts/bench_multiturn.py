"""KV reuse across calls: what an agent's repeated prefixes cost on each CPU engine.

Two measurements per engine, through ``localrun`` (``Model.stream``, greedy):

* **multi-turn chat** — a system prompt and six user turns, each reply (``--reply``
  tokens) appended to the conversation before the next turn; prints "prompt tokens :
  TTFT" per turn. Without KV reuse TTFT grows with the whole conversation; with it, only
  the new turn is prefilled. Target (issue 15): turn 6 TTFT <= 1.5x turn 2 TTFT.
* **shared system prompt** — two calls with the same ``--system-tokens``-token system
  prompt and different questions. Target: the second call's TTFT <= 25% of the first's.

The conversation is the issue's: a short system prompt, so that every reply runs its
``--reply`` tokens (turn 1 ~26 prompt tokens, then ~112 more a turn, as in the issue's
table). ``--system`` changes it; one asking for short answers ("Answer in a few plain
sentences.") makes some replies end early, and then turn 2 prefills fewer tokens than
turn 6 on the engines that prefill the last reply again (llama.cpp; ONNX back to back).

``--think SECONDS`` pauses that long between a reply and the next call (a user reading
the reply, an agent running a tool); the default, 0, asks back to back. TTFT then leaves
out what localrun does during the pause (ONNX Runtime GenAI settles the previous reply's
KV rows then: localrun/backends/onnx/session.py), as a user who paused would see it.

    .venv/bin/python scripts/bench_multiturn.py                       # every CPU engine
    .venv/bin/python scripts/bench_multiturn.py --backends onnx --reply 32
    .venv/bin/python scripts/bench_multiturn.py --backends onnx --think 1
    .venv/bin/python scripts/bench_multiturn.py --json docs/results/multiturn.json
    .venv/bin/python scripts/bench_multiturn.py --exact     # load(exact=True): issue 30
    .venv/bin/python scripts/bench_multiturn.py --backends llama.cpp --system-tokens 0 \
        --runs 5 --engine --flash-attn off    # medians of 5; llama-cpp-python alone too

``--runs N`` asks the conversation N times and prints each turn's median TTFT (one run's
turns swing by 2x on a busy machine). ``--engine`` (llama.cpp) also times llama-cpp-python
alone on the same tokens: a context holding the cells localrun held before turns 2 and 6,
``Llama.eval`` of only the tokens localrun fed, then one sample (medians of 5 a run,
turns alternating): the engine's own turn 6 / turn 2, apart from localrun's costs.
``--flash-attn off`` loads llama.cpp without flash attention (docs/results/multiturn_fast.md:
its CPU kernel for under 64 new tokens costs more the more cells they attend to).

Models load in localrun's default mode (fast: every cached KV cell reused, the engine's
own precision) unless ``--exact``; scripts/bench_multiturn_server.py asks the same
conversation over HTTP of ``localrun serve`` and llama-server.

Models: the fixtures of scripts/make_test_models.py (llama.cpp: the Q8_0 GGUF).
Not a test: numbers depend on the machine and what else runs on it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

#: backend -> fixture format of tests/models.py
FIXTURES = {"llama.cpp": "gguf-q8_0", "openvino": "openvino-int4", "onnx": "onnx-int4",
            "mlx": "mlx-4bit"}
SYSTEM = "You are a helpful assistant."
TURNS = ["Tell me about the sea.", "Why is it salty?", "What lives at the bottom?",
         "How deep is the deepest part?", "Who first went down there?",
         "What did they see?"]
GREEDY: dict[str, Any] = {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0,
                          "repetition_penalty": 1.0}


def fixture(backend: str) -> str | None:
    from tests.models import read_manifest

    path = (read_manifest() or {}).get("models", {}).get(FIXTURES[backend])
    return str(path) if path and Path(path).exists() else None


def ask(model: Any, messages: list[dict[str, str]], max_tokens: int) -> tuple[str, int, float]:
    c = model.chat(messages, max_tokens=max_tokens, **GREEDY)
    return c.text, c.usage.prompt_tokens, c.timings.ttft


def multi_turn(model: Any, reply: int, think: float, system: str,
               cells: list[tuple[list[int], list[int]]] | None = None
               ) -> list[tuple[int, float]]:
    """The conversation's "prompt tokens, TTFT" per turn; ``cells`` (llama.cpp): gets
    each turn's prompt tokens and the cells the context held before it."""
    messages = [{"role": "system", "content": system}]
    rows = []
    for turn in TURNS:
        time.sleep(think)  # after the warm-up's reply, then after each turn's
        messages.append({"role": "user", "content": turn})
        if cells is not None:
            session = model._session
            llm = session.engine.llm
            cells.append((list(session.encode_chat(messages).tokens),
                          llm.input_ids[:llm.n_tokens].tolist()))
        text, n, ttft = ask(model, messages, reply)
        messages.append({"role": "assistant", "content": text})
        rows.append((n, ttft))
    return rows


def engine_turns(model: Any, cells: list[tuple[list[int], list[int]]], reps: int = 5
                 ) -> tuple[tuple[int, float], tuple[int, float]]:
    """llama-cpp-python alone, loaded as localrun loaded it: for turns 2 and 6, a context
    holding the cells localrun kept, ``Llama.eval`` of the tokens it fed, one sample;
    "tokens fed, median seconds" of ``reps`` tries, the two turns alternating."""
    import llama_cpp

    from localrun.backends.llama_cpp.reuse import fast_prefix
    from localrun.backends.prefix import common_prefix

    llm = model._session.engine.llm
    params = llm.context_params
    flash = params.flash_attn_type != llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
    setups: list[tuple[Any, list[int], int, list[float]]] = []
    for prompt, held in (cells[1], cells[5]):
        raw = llama_cpp.Llama(model_path=llm.model_path, n_ctx=llm.n_ctx(),
                              n_threads=params.n_threads,
                              n_threads_batch=params.n_threads_batch, flash_attn=flash,
                              verbose=False)
        keep = fast_prefix(len(prompt), common_prefix(held, prompt))
        raw.eval(prompt[:keep])
        setups.append((raw, prompt, keep, []))
    for _ in range(reps):
        for raw, prompt, keep, times in setups:
            raw._ctx.kv_cache_seq_rm(-1, keep, -1)
            raw.n_tokens = keep
            t = time.perf_counter()
            raw.eval(prompt[keep:])
            raw.sample(temp=0.0)
            times.append(time.perf_counter() - t)
    out = []
    for raw, prompt, keep, times in setups:
        out.append((len(prompt) - keep, statistics.median(times)))
        raw.close()
    return out[0], out[1]


def shared_system(model: Any, n_tokens: int, think: float) -> tuple[int, float, float]:
    from localrun.bench import exact_prompt

    system = exact_prompt(model.count_tokens, n_tokens, seed=int(time.time()))
    time.sleep(think)
    _, n, first = ask(model, [{"role": "system", "content": system},
                              {"role": "user", "content": "Summarise the text above."}], 8)
    time.sleep(think)
    _, _, second = ask(model, [{"role": "system", "content": system},
                               {"role": "user", "content": "Which word comes first?"}], 8)
    return n, first, second


def bench(backend: str, reply: int, system_tokens: int, think: float, system: str,
          exact: bool = False, runs: int = 1, engine: bool = False,
          flash_attn: str = "auto") -> dict[str, Any] | None:
    import localrun
    from localrun.backends import is_installed

    if not is_installed(backend):
        print(f"{backend:10} not installed")
        return None
    path = fixture(backend)
    if path is None:
        print(f"{backend:10} no fixture model (run python scripts/make_test_models.py)")
        return None
    llama = backend == "llama.cpp"
    options: dict[str, Any] = {"flash_attn": False} if llama and flash_attn == "off" else {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = localrun.load(path, backend=backend, context=4096, exact=exact, **options)
    load = [os.getloadavg()[0]]
    every: list[list[tuple[int, float]]] = []
    raw: list[tuple[tuple[int, float], tuple[int, float]]] = []
    with model:
        ask(model, [{"role": "user", "content": "Hello."}], 4)  # warm-up
        for _ in range(runs):
            cells: list[tuple[list[int], list[int]]] | None = \
                [] if llama and engine and not exact else None  # (exact keeps fewer)
            every.append(multi_turn(model, reply, think, system, cells))
            if cells:
                raw.append(engine_turns(model, cells))
        load.append(os.getloadavg()[0])
        n, first, second = (shared_system(model, system_tokens, think) if system_tokens
                            else (0, 0.0, 0.0))
    turns = [(every[0][i][0], statistics.median(r[i][1] for r in every))
             for i in range(len(TURNS))]
    cells_text = " | ".join(f"{p} : {t * 1000:.0f} ms" for p, t in turns)
    ratio = turns[-1][1] / turns[1][1] if turns[1][1] else float("inf")
    name = f"{backend} {Path(path).name}" + (" (flash_attn off)" if options else "")
    print(f"| {name} | {cells_text} | {ratio:.2f} |", flush=True)
    print(f"{backend:10} load average {load[0]:.1f} at the start, {load[1]:.1f} at the end"
          + (f"; medians of {runs} runs" if runs > 1 else ""), flush=True)
    result: dict[str, Any] = {
        "backend": backend, "model": Path(path).name, "reply": reply, "think": think,
        "exact": exact, "system": system, "runs": runs, "load": load, **options,
        "turns": [{"prompt_tokens": p, "ttft": t} for p, t in turns],
        "turn6_over_turn2": ratio}
    if raw:
        two = statistics.median(r[0][1] for r in raw)
        six = statistics.median(r[1][1] for r in raw)
        print(f"{backend:10} llama-cpp-python alone, the same tokens: turn 2 {raw[0][0][0]} "
              f"fed : {two * 1000:.0f} ms, turn 6 {raw[0][1][0]} fed : {six * 1000:.0f} ms, "
              f"turn 6 / turn 2 {six / two:.2f}", flush=True)
        result["engine"] = {"turn2": {"fed": raw[0][0][0], "seconds": two},
                            "turn6": {"fed": raw[0][1][0], "seconds": six},
                            "turn6_over_turn2": six / two}
    if system_tokens:
        print(f"{backend:10} shared {n}-token system prompt: first {first * 1000:.0f} ms, "
              f"second {second * 1000:.0f} ms ({second / first:.0%})", flush=True)
        result["shared_system"] = {"prompt_tokens": n, "first_ttft": first,
                                   "second_ttft": second,
                                   "ratio": second / first if first else None}
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backends", nargs="*", default=list(FIXTURES), choices=list(FIXTURES))
    ap.add_argument("--reply", type=int, default=96, help="greedy tokens per reply")
    ap.add_argument("--system", default=SYSTEM,
                    help=f"the multi-turn chat's system prompt (default: {SYSTEM!r})")
    ap.add_argument("--system-tokens", type=int, default=1500,
                    help="the shared system prompt's length (second measurement; 0: skip it)")
    ap.add_argument("--think", type=float, default=0.0, metavar="SECONDS",
                    help="pause between a reply and the next call (a user reading it, an "
                    "agent running a tool; default 0: back to back); TTFT then excludes "
                    "work localrun does during the pause")
    ap.add_argument("--exact", action="store_true", help="load with exact=True")
    ap.add_argument("--runs", type=int, default=1,
                    help="ask the conversation this many times; each turn's median TTFT")
    ap.add_argument("--engine", action="store_true",
                    help="llama.cpp: also time llama-cpp-python alone on the same tokens")
    ap.add_argument("--flash-attn", choices=("auto", "off"), default="auto",
                    help="llama.cpp's flash attention (default: auto, as llama-server)")
    ap.add_argument("--json", help="also write the results to this file")
    args = ap.parse_args()
    print(f"load average {os.getloadavg()[0]:.1f}; {args.reply} greedy tokens a reply; "
          f"{args.think:g} s between a reply and the next call; "
          f"{'exact' if args.exact else 'default (fast)'} mode")
    print("| engine | " + " | ".join(f"turn {i + 1}" for i in range(len(TURNS)))
          + " | turn 6 / turn 2 |")
    print("|---" * (len(TURNS) + 2) + "|")
    results = [r for b in args.backends
               if (r := bench(b, args.reply, args.system_tokens, args.think, args.system,
                              args.exact, args.runs, args.engine, args.flash_attn))]
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
