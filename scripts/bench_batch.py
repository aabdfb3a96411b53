"""Throughput of batch generation: output tokens/s at concurrency 1 vs 8, per CPU backend.

    .venv/bin/python scripts/bench_batch.py                    # every installed CPU backend
    .venv/bin/python scripts/bench_batch.py --backends llama.cpp openvino --prompts 16

Each backend runs its native fixture model (scripts/make_test_models.py; the GGUF is
the embedded default and always there) through ``Model.batch`` over the same prompts,
greedy, a fixed number of new tokens each. Concurrency 1 runs the prompts one after
another; higher ones use the engine's batching where localrun has it (engines without
it run in turn, so their ratio stays ~1). A warm-up batch runs first at each
concurrency, so one-time costs (compiling a batching pipeline) are not counted.
Not a test: numbers depend on the machine and what else runs on it.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

#: backend -> fixture format of tests/models.py (None: the embedded default GGUF)
NATIVE: dict[str, str | None] = {"llama.cpp": None, "openvino": "openvino-int4",
                                 "mlx": "mlx-4bit", "onnx": "onnx-int4"}
TOPICS = ["the sea", "mountains", "bread", "rain", "trains", "cats", "the moon", "coffee",
          "libraries", "bicycles", "winter", "music", "gardens", "bees", "maps", "clocks",
          "rivers", "chess", "volcanoes", "owls", "paper", "bridges", "tea", "snow",
          "deserts", "lighthouses", "apples", "stars", "boats", "forests", "glass", "wind"]
FORMS = ["Write two sentences about {}.", "Describe {} to a child."]


def prompts(n: int) -> list[str]:
    every = [f.format(t) for f in FORMS for t in TOPICS]
    return [every[i % len(every)] for i in range(n)]


def model_path(backend: str) -> str | None:
    fmt = NATIVE[backend]
    if fmt is None:
        from localrun.naming.stores import default_model_path

        return str(default_model_path())
    from tests.models import read_manifest

    manifest = read_manifest() or {}
    path = manifest.get("models", {}).get(fmt)
    return str(path) if path and Path(path).exists() else None


def fixture_or_exit(backend: str) -> str:
    """:func:`model_path`, or exit saying how to build the fixture."""
    path = model_path(backend)
    if path is None:
        sys.exit(f"no {NATIVE[backend]} fixture (or its engine is missing): run python "
                 "scripts/make_test_models.py")
    return path


def run(model: Any, items: list[str], concurrency: int, max_tokens: int) -> tuple[float, int]:
    t0 = time.perf_counter()
    out = model.batch(items, max_concurrency=concurrency, temperature=0.0,
                      max_tokens=max_tokens)
    wall = time.perf_counter() - t0
    tokens = sum(c.usage.completion_tokens for c in out)
    return tokens / wall, tokens


def bench(backend: str, items: list[str], levels: list[int], max_tokens: int) -> None:
    import localrun
    from localrun.backends import is_installed

    if not is_installed(backend):
        print(f"{backend:10} not installed")
        return
    path = model_path(backend)
    if path is None:
        print(f"{backend:10} no fixture model (run python scripts/make_test_models.py)")
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = localrun.load(path, backend=backend)
    with model:
        note = ""
        if model._session.batcher() is None:
            note = " (no engine batching: runs in turn)"
        speeds = []
        for level in levels:
            run(model, items[: max(2, level)], level, 4)  # warm-up
            tps, tokens = run(model, items, level, max_tokens)
            speeds.append(tps)
            print(f"{backend:10} concurrency {level:2}: {tps:7.1f} tok/s "
                  f"({tokens} tokens){note}", flush=True)
        base = speeds[0]
        ratios = "  ".join(f"c{lv}/c{levels[0]} = {s / base:.2f}x"
                           for lv, s in zip(levels[1:], speeds[1:], strict=True))
        print(f"{backend:10} {Path(path).name}: {ratios}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backends", nargs="*", default=list(NATIVE), choices=list(NATIVE))
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    args = ap.parse_args()
    items = prompts(args.prompts)
    print(f"{args.prompts} prompts, greedy, max {args.max_tokens} new tokens each")
    for backend in args.backends:
        bench(backend, items, args.concurrency, args.max_tokens)


if __name__ == "__main__":
    main()
