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

Models: the fixtures of scripts/make_test_models.py (llama.cpp: the Q8_0 GGUF).
Not a test: numbers depend on the machine and what else runs on it.
"""

from __future__ import annotations

import argparse
import json
import os
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


def multi_turn(model: Any, reply: int, think: float, system: str
               ) -> list[tuple[int, float]]:
    messages = [{"role": "system", "content": system}]
    rows = []
    for turn in TURNS:
        time.sleep(think)  # after the warm-up's reply, then after each turn's
        messages.append({"role": "user", "content": turn})
        text, n, ttft = ask(model, messages, reply)
        messages.append({"role": "assistant", "content": text})
        rows.append((n, ttft))
    return rows


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


def bench(backend: str, reply: int, system_tokens: int, think: float, system: str
          ) -> dict[str, Any] | None:
    import localrun
    from localrun.backends import is_installed

    if not is_installed(backend):
        print(f"{backend:10} not installed")
        return None
    path = fixture(backend)
    if path is None:
        print(f"{backend:10} no fixture model (run python scripts/make_test_models.py)")
        return None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = localrun.load(path, backend=backend, context=4096)
    with model:
        ask(model, [{"role": "user", "content": "Hello."}], 4)  # warm-up
        turns = multi_turn(model, reply, think, system)
        n, first, second = shared_system(model, system_tokens, think)
    cells = " | ".join(f"{p} : {t * 1000:.0f} ms" for p, t in turns)
    ratio = turns[-1][1] / turns[1][1] if turns[1][1] else float("inf")
    print(f"| {backend} {Path(path).name} | {cells} | {ratio:.2f} |", flush=True)
    print(f"{backend:10} shared {n}-token system prompt: first {first * 1000:.0f} ms, "
          f"second {second * 1000:.0f} ms ({second / first:.0%})", flush=True)
    return {"backend": backend, "model": Path(path).name, "reply": reply, "think": think,
            "system": system,
            "turns": [{"prompt_tokens": p, "ttft": t} for p, t in turns],
            "turn6_over_turn2": ratio,
            "shared_system": {"prompt_tokens": n, "first_ttft": first, "second_ttft": second,
                              "ratio": second / first}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backends", nargs="*", default=list(FIXTURES), choices=list(FIXTURES))
    ap.add_argument("--reply", type=int, default=96, help="greedy tokens per reply")
    ap.add_argument("--system", default=SYSTEM,
                    help=f"the multi-turn chat's system prompt (default: {SYSTEM!r})")
    ap.add_argument("--system-tokens", type=int, default=1500,
                    help="the shared system prompt's length (second measurement)")
    ap.add_argument("--think", type=float, default=0.0, metavar="SECONDS",
                    help="pause between a reply and the next call (a user reading it, an "
                    "agent running a tool; default 0: back to back); TTFT then excludes "
                    "work localrun does during the pause")
    ap.add_argument("--json", help="also write the results to this file")
    args = ap.parse_args()
    print(f"load average {os.getloadavg()[0]:.1f}; {args.reply} greedy tokens a reply; "
          f"{args.think:g} s between a reply and the next call")
    print("| engine | " + " | ".join(f"turn {i + 1}" for i in range(len(TURNS)))
          + " | turn 6 / turn 2 |")
    print("|---" * (len(TURNS) + 2) + "|")
    results = [r for b in args.backends
               if (r := bench(b, args.reply, args.system_tokens, args.think, args.system))]
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
