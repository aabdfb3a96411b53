"""ONNX Runtime GenAI: what settling a finished reply's KV rows costs the caller.

After a reply, localrun's ONNX backend recomputes the reply's rows in the background
(``SETTLE_DELAY`` idle, then pieces of ``append_tokens``; docs/results/kv_reuse.md,
"Settling"). Two measurements of its side effects, on the ``onnx-int4`` fixture
(scripts/make_test_models.py):

``stall``: the GIL. After each 96-token reply to a 300-token raw prompt the main thread
sleeps 1 ms in a loop for 1.5 s while the reply settles on its thread (or, alternated,
with settling off) and records the gaps between its wake-ups: a long gap is a piece of
``append_tokens`` holding the GIL.

``b2b``: back-to-back calls. Blocks of two calls in a row (64-token raw prompts, 64
tokens each); the second call's TTFT and CPU time after a first whose settle was off,
delayed 0.05 s (the default) or started at once, modes alternated round by round; "new"
blocks send a different second prompt, "same" blocks the first one again.

    .venv/bin/python scripts/bench_onnx_settle.py stall
    .venv/bin/python scripts/bench_onnx_settle.py b2b --rounds 10

Not a test: the numbers depend on the machine and what else runs on it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

GREEDY: dict[str, Any] = {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0,
                          "repetition_penalty": 1.0}
#: settle modes of the b2b blocks: the session's ``_settle_delay`` (None: no settling)
B2B_MODES: tuple[float | None, ...] = (None, 0.05, 0.0)


def load() -> Any:
    """The onnx-int4 fixture through localrun, or exit saying how to get it."""
    from bench_batch import fixture_or_exit

    import localrun
    from localrun.backends import install_hint, is_installed

    if not is_installed("onnx"):
        sys.exit(f"ONNX Runtime GenAI is not installed: {install_hint('onnx')}")
    path = fixture_or_exit("onnx")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return localrun.load(path, backend="onnx", context=4096)


def call(model: Any, text: str, max_tokens: int) -> tuple[float, float]:
    """One raw greedy call: (TTFT, the process's CPU time for the whole call), seconds."""
    c0, t0 = time.process_time(), time.perf_counter()
    first = 0.0
    with model.stream(text, raw=True, max_tokens=max_tokens, **GREEDY) as stream:
        for chunk in stream:
            if chunk.text and not first:
                first = time.perf_counter()
    return first - t0, time.process_time() - c0


def stall(model: Any, rounds: int, reply: int, watch: float) -> None:
    from localrun.bench import exact_prompt

    session = model._session
    print("| settle | rows | pieces | ms in append_tokens | gap median ms | gap p99 ms | "
          "gap max ms | ms in gaps over 5 ms |\n|---|---|---|---|---|---|---|---|")
    for i in range(2 * rounds):
        settle = i % 2 == 1
        session._settle_delay = 0.05 if settle else None
        call(model, exact_prompt(model.count_tokens, 300, seed=i), reply)
        gaps = []
        last = time.perf_counter()
        end = last + watch
        while last < end:
            time.sleep(0.001)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now
        session._settled.wait(30)
        st = session._last_settle if settle else None
        g = sorted(gaps)
        rows = (f"{st.done - st.start} | {st.pieces} | {st.seconds * 1000:.0f}" if st
                else "- | - | -")
        print(f"| {'on' if settle else 'off'} | {rows} | {statistics.median(g) * 1000:.2f} | "
              f"{g[int(len(g) * 0.99)] * 1000:.1f} | {g[-1] * 1000:.1f} | "
              f"{sum(x for x in g if x > 0.005) * 1000:.0f} |", flush=True)


def b2b(model: Any, rounds: int, tokens: int) -> None:
    from localrun.bench import exact_prompt

    session = model._session
    prompts = iter([exact_prompt(model.count_tokens, 64, seed=1000 + i)
                    for i in range(4 * len(B2B_MODES) * rounds + 1)])
    call(model, next(prompts), tokens)  # warm-up
    seen: dict[tuple[str, float | None], list[tuple[float, float]]] = {}
    for _ in range(rounds):
        for kind in ("new", "same"):
            for mode in B2B_MODES:
                session._settle_delay = mode
                a = next(prompts)
                b = next(prompts) if kind == "new" else a
                call(model, a, tokens)  # its reply's settle (per mode) meets the next call
                seen.setdefault((kind, mode), []).append(call(model, b, tokens))
    print("| second prompt | settle delay | TTFT median ms (min) | CPU median ms |\n"
          "|---|---|---|---|")
    for (kind, mode), got in seen.items():
        ttft = [t for t, _ in got]
        print(f"| {kind} | {'off' if mode is None else f'{mode:g} s'} | "
              f"{statistics.median(ttft) * 1000:.1f} ({min(ttft) * 1000:.1f}) | "
              f"{statistics.median(c for _, c in got) * 1000:.0f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=("stall", "b2b"))
    ap.add_argument("--rounds", type=int, default=None,
                    help="stall: pairs of replies, off then on (default 2); b2b: rounds of "
                         "every block (default 8)")
    ap.add_argument("--tokens", type=int, default=None,
                    help="tokens a reply (default: stall 96, b2b 64)")
    ap.add_argument("--watch", type=float, default=1.5,
                    help="stall: seconds the main thread watches after each reply")
    args = ap.parse_args()
    print(f"load average {os.getloadavg()[0]:.1f}", flush=True)
    model = load()
    with model:
        if args.what == "stall":
            stall(model, args.rounds or 2, args.tokens or 96, args.watch)
        else:
            b2b(model, args.rounds or 8, args.tokens or 64)


if __name__ == "__main__":
    main()
