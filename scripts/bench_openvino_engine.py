"""OpenVINO GenAI batching: the engine's own generate() at concurrency, and a profile.

Two measurements behind docs/results/batch.md (OpenVINO), on the ``openvino-int4``
fixture (scripts/make_test_models.py) and the chat prompts of scripts/bench_batch.py,
greedy, ``--max-tokens`` new tokens each:

``concurrency``: the engine's own ``ContinuousBatchingPipeline.generate()`` on the
pipeline localrun built, the prompts one per call (c1) vs ``--level`` per call, against
``Model.batch`` at ``max_concurrency`` 1 vs ``--level``, alternated, ``--reps`` rounds in
one process. ``--ticker`` then times generate() c1 alone and with a second thread
sleeping 1 ms in a loop (on some VMs the busy thread keeps idle vCPUs awake: generate()
runs faster with it).

``profile``: cProfile of localrun's engine thread (the driver's) over a warm-up batch and
one ``Model.batch`` of all prompts at once: seconds in ``step()``, in the tokenizer's
``decode`` (the detokenizer) and its calls per step, in lock waits, and in the rest of
the thread's Python (handle reads, dispatch, admission).

    .venv/bin/python scripts/bench_openvino_engine.py concurrency
    .venv/bin/python scripts/bench_openvino_engine.py concurrency --prompts 32 --level 8 --ticker
    .venv/bin/python scripts/bench_openvino_engine.py profile --threads 1

Not a test: the numbers depend on the machine and what else runs on it.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any, cast

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))


class Bench:
    """The fixture loaded through localrun, its pipeline, and the prompts as token ids."""

    def __init__(self, n: int, max_tokens: int, threads: int | None) -> None:
        import numpy as np
        import openvino
        from bench_batch import fixture_or_exit, prompts

        import localrun

        path = fixture_or_exit("openvino")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import openvino_genai

            self.model = localrun.load(path, backend="openvino", threads=threads)
        self.og: Any = openvino_genai
        self.session = cast(Any, self.model._session)  # the OpenVINO session's internals
        self.pipe = self.session.batcher().pipe
        self.eos: frozenset[int] = self.session._eos
        self.items = prompts(n)
        self.max_tokens = max_tokens
        self.ids = [openvino.Tensor(np.asarray(
            [list(self.session.encode_chat([{"role": "user", "content": p}]).tokens)],
            dtype=np.int64)) for p in self.items]

    def config(self) -> Any:
        g = self.og.GenerationConfig()
        g.max_new_tokens = self.max_tokens
        g.do_sample = False
        g.stop_token_ids = set(self.eos)
        return g

    def generate(self, level: int) -> float:
        """Output tokens/s of generate() over every prompt, ``level`` prompts a call."""
        t0 = time.perf_counter()
        tokens = 0
        for i in range(0, len(self.ids), level):
            part = self.ids[i:i + level]
            for r in self.pipe.generate(part, [self.config() for _ in part]):
                tokens += sum(t not in self.eos for t in r.m_generation_ids[0])
        return tokens / (time.perf_counter() - t0)

    def batch(self, level: int, items: list[str] | None = None) -> float:
        """Output tokens/s of Model.batch(max_concurrency=level) over every prompt."""
        t0 = time.perf_counter()
        done = self.model.batch(items or self.items, max_concurrency=level, temperature=0.0,
                                max_tokens=self.max_tokens)
        tokens: int = sum(c.usage.completion_tokens for c in done)
        return tokens / (time.perf_counter() - t0)


def concurrency(b: Bench, level: int, reps: int, ticker: bool) -> None:
    b.generate(level)  # warm-up: first-call costs off the clock
    b.batch(level)
    print(f"| round | generate c1 | generate c{level} | ratio | Model.batch c1 | "
          f"Model.batch c{level} | ratio | load |\n|---|---|---|---|---|---|---|---|")
    for rep in range(reps):
        g1, gn, l1, ln = b.generate(1), b.generate(level), b.batch(1), b.batch(level)
        print(f"| {rep + 1} | {g1:.1f} | {gn:.1f} | {gn / g1:.2f}x | {l1:.1f} | {ln:.1f} | "
              f"{ln / l1:.2f}x | {os.getloadavg()[0]:.1f} |", flush=True)
    if not ticker:
        return
    stop = threading.Event()

    def tick() -> None:
        while not stop.is_set():
            time.sleep(0.001)

    alone = b.generate(1)
    thread = threading.Thread(target=tick, daemon=True)
    thread.start()
    with_ticker = b.generate(1)
    stop.set()
    thread.join()
    print(f"generate c1: alone {alone:.1f} tok/s, with a 1 ms ticker thread {with_ticker:.1f}, "
          f"alone again {b.generate(1):.1f}")


def profile(b: Bench) -> None:
    from localrun.driver.scheduler import Driver

    profiles: list[cProfile.Profile] = []
    engine = Driver._engine

    def profiled(self: Driver) -> None:  # each run of the engine thread, profiled
        p = cProfile.Profile()
        profiles.append(p)
        p.enable()
        try:
            engine(self)
        finally:
            p.disable()

    Driver._engine = profiled  # type: ignore[method-assign]
    try:
        b.batch(4, b.items[:4])  # warm-up, profiled too (as the numbers in batch.md)
        tps = b.batch(len(b.items))
        b.model.close()  # ends the engine thread: its profile is complete
    finally:
        Driver._engine = engine  # type: ignore[method-assign]
    stats = pstats.Stats(profiles[0])
    for p in profiles[1:]:
        stats.add(p)
    table: dict[tuple[str, int, str], tuple[int, int, float, float, Any]] = \
        stats.stats  # type: ignore[attr-defined]

    def total(*words: str) -> tuple[float, int]:
        hits = [v for (_, _, name), v in table.items() if all(w in name for w in words)]
        return sum(v[2] for v in hits), sum(v[1] for v in hits)

    every = sum(v[2] for v in table.values())
    # the engine's calls show as "{built-in method openvino_genai.py_openvino_genai.step}"
    step, steps = total("py_openvino_genai.step")
    decode, decodes = total("py_openvino_genai.decode")
    waits = total("'acquire'")[0]  # Condition.wait blocks in lock.acquire
    print(f"Model.batch of {len(b.items)} x {b.max_tokens}: {tps:.1f} tok/s; engine thread "
          f"(batch and warm-up): step() {step:.2f} s ({steps} steps), detokenizer "
          f"{decode:.2f} s ({decodes} decode calls, {decodes / max(steps, 1):.1f} a step), "
          f"lock waits {waits:.2f} s, other Python {every - step - decode - waits:.2f} s")
    stats.sort_stats("tottime").print_stats(12)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=("concurrency", "profile"))
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--level", type=int, default=8, help="concurrency: prompts at once")
    ap.add_argument("--reps", type=int, default=2, help="concurrency: rounds")
    ap.add_argument("--ticker", action="store_true",
                    help="concurrency: also generate() c1 with a 1 ms ticker thread")
    ap.add_argument("--threads", type=int, default=None, help="INFERENCE_NUM_THREADS")
    args = ap.parse_args()
    print(f"load average {os.getloadavg()[0]:.1f}; {args.prompts} chat prompts x "
          f"{args.max_tokens} greedy tokens; threads {args.threads or 'default'}", flush=True)
    b = Bench(args.prompts, args.max_tokens, args.threads)
    with b.model:
        if args.what == "concurrency":
            concurrency(b, args.level, args.reps, args.ticker)
        else:
            profile(b)


if __name__ == "__main__":
    main()
