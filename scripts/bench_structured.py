"""What constrained decoding costs on each engine (issue 13 item 5).

For every engine that is installed and has its SmolLM2-135M fixture here, this measures:

- decode speed (tokens/s, first token to last, wall clock as the caller sees it) of the
  same greedy chat reply without a schema, with a schema whose reply is mostly one long
  string (the grammar checks every token but rarely narrows it), and with a
  30-property schema (the grammar forces most of the text: keys, separators, enums);
- the cost of a new schema: the time to first token with a 30-property schema never
  used before, minus the time to first token without one (llguidance engines also
  report their two parts: the tokenizer bridge, built once per model, and the grammar
  compile, once per schema; OpenVINO compiles inside its generate call).

Target: decode with a schema at most 10% slower than without.

    .venv/bin/python scripts/bench_structured.py                       # every engine
    .venv/bin/python scripts/bench_structured.py --backend onnx --runs 5
    .venv/bin/python scripts/bench_structured.py --json docs/results/structured.json \\
        --markdown docs/results/structured.md

Models come from ~/.cache/localrun/test-models/manifest.json (scripts/make_test_models.py
makes them; llama.cpp uses the embedded GGUF). Wall-clock numbers on a shared machine
drift: the runs alternate between the three replies, and the load average is recorded.
"""

from __future__ import annotations

import argparse
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
FIXTURES = {"llama.cpp": "gguf-q4_1", "mlx": "mlx-4bit", "openvino": "openvino-int4",
            "onnx": "onnx-int4"}

PROMPT = "Write a long story about a cat who sails around the world."
STORY = {"type": "object", "properties": {"story": {"type": "string", "minLength": 2000}},
         "required": ["story"]}
ENUMS = ["low", "medium", "high"]


def wide_schema(n: int = 30, salt: str = "") -> dict[str, Any]:
    """A flat object of ``n`` required properties: strings, integers, enums, booleans."""
    kinds = [{"type": "string", "maxLength": 12}, {"type": "integer", "minimum": 0,
                                                   "maximum": 999},
             {"enum": ENUMS}, {"type": "boolean"}]
    props = {f"field_{salt}{i}": kinds[i % len(kinds)] for i in range(n)}
    return {"type": "object", "properties": props, "required": list(props)}


def fixture(backend: str) -> str | None:
    if backend == "llama.cpp":
        from localrun.naming.stores import default_model_path

        try:
            return str(default_model_path())
        except Exception:
            return None
    try:
        models = json.loads(MANIFEST.read_text(encoding="utf-8"))["models"]
    except (OSError, ValueError, KeyError):
        return None
    path = models.get(FIXTURES[backend])
    return path if path and Path(path).exists() else None


def timed_reply(model: Any, schema: dict[str, Any] | None, tokens: int) -> dict[str, float]:
    """One greedy reply: time to first token, and decode tokens/s by the wall clock."""
    kw: dict[str, Any] = {"temperature": 0, "max_tokens": tokens}
    if schema is not None:
        kw["schema"] = schema
    t0 = time.perf_counter()
    t_first = t_last = 0.0
    stream = model.stream(PROMPT, **kw)
    for chunk in stream:
        now = time.perf_counter()
        if chunk.text and not t_first:
            t_first = now
        if chunk.text:
            t_last = now
    c = stream.completion
    assert c is not None
    n = c.usage.completion_tokens
    decode = (n - 1) / (t_last - t_first) if n > 1 and t_last > t_first else 0.0
    return {"ttft": (t_first or time.perf_counter()) - t0, "decode_tps": decode, "tokens": n}


def compile_parts(model: Any) -> dict[str, float]:
    """llguidance engines: the tokenizer bridge and one 30-property grammar compile (ms)."""
    from localrun.structured.constraint import Constraint

    session = model._live()
    grammar = getattr(session, "_grammar", None)
    if grammar is None or not hasattr(grammar, "compiler"):
        return {}
    t0 = time.perf_counter()
    compiler = grammar.compiler()
    t1 = time.perf_counter()
    compiler.grammar(Constraint.json(wide_schema(salt="c"), "bench"))
    t2 = time.perf_counter()
    return {"tokenizer_ms": (t1 - t0) * 1e3, "compile_ms": (t2 - t1) * 1e3}


def bench(backend: str, path: str, runs: int, tokens: int) -> dict[str, Any]:
    import localrun

    with localrun.load(path, backend=backend, context=4096) as model:
        parts = compile_parts(model)
        timed_reply(model, None, 8)  # warm up the engine
        # a new schema each run: its compile lands in this reply's time to first token
        fresh = [timed_reply(model, wide_schema(salt=f"r{i}_"), 1)["ttft"]
                 for i in range(runs)]
        plain_ttft = [timed_reply(model, None, 1)["ttft"] for _ in range(runs)]
        rows: dict[str, list[dict[str, float]]] = {"none": [], "story": [], "wide": []}
        wide = wide_schema()
        for _ in range(runs):  # interleaved, so that drift hits all three alike
            rows["none"].append(timed_reply(model, None, tokens))
            rows["story"].append(timed_reply(model, STORY, tokens))
            rows["wide"].append(timed_reply(model, wide, tokens))
        out: dict[str, Any] = {
            "backend": backend, "engine_version": model.info.engine_version,
            "format": model.info.format, "quantization": model.info.quantization,
            "first_use_ms": (statistics.median(fresh) - statistics.median(plain_ttft)) * 1e3,
            **parts,
        }
        for name, rs in rows.items():
            out[f"{name}_tps"] = statistics.median(r["decode_tps"] for r in rs)
            out[f"{name}_tokens"] = statistics.median(r["tokens"] for r in rs)
        out["story_slowdown"] = 1 - out["story_tps"] / out["none_tps"]
        out["wide_slowdown"] = 1 - out["wide_tps"] / out["none_tps"]
        return out


def markdown(results: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = [
        "# Constrained decoding cost (`scripts/bench_structured.py`)",
        "",
        f"{meta['when']}, load average {meta['load']:.1f} on a 2-core machine shared with "
        "other work (treat single numbers as ±15%). SmolLM2-135M-Instruct fixtures, "
        f"greedy, {meta['tokens']} tokens per reply, medians of {meta['runs']} runs.",
        "",
        "Decode tokens/s by the wall clock (first token to last): no schema, a schema whose "
        "reply is one long string, and a 30-property object (strings, integers, enums, "
        "booleans: the grammar writes most of it). Slowdown is against no schema.",
        "",
        "| engine | no schema | long-string schema | slowdown | 30-property schema | "
        "slowdown | new schema: added TTFT | tokenizer bridge (once) | grammar compile |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        tok = f"{r['tokenizer_ms']:.0f} ms" if "tokenizer_ms" in r else "— (XGrammar)"
        comp = f"{r['compile_ms']:.1f} ms" if "compile_ms" in r else "in generate"
        lines.append(
            f"| {r['backend']} {r['engine_version']} | {r['none_tps']:.1f} | "
            f"{r['story_tps']:.1f} | {r['story_slowdown'] * 100:+.0f}% | {r['wide_tps']:.1f} | "
            f"{r['wide_slowdown'] * 100:+.0f}% | {r['first_use_ms']:.0f} ms | {tok} | {comp} |")
    lines += [
        "",
        "Notes:",
        "",
        "- \"New schema: added TTFT\" is the first reply with a 30-property schema never used",
        "  before, against a reply without one (the tokenizer bridge was built already). The",
        "  llguidance engines compile in about a millisecond; OpenVINO compiles inside its",
        "  generate call (XGrammar), so its whole cost shows there; it keeps compiled",
        "  grammars, so the same schema again costs nothing measurable (814 ms, then 109 and",
        "  45 ms against 37-96 ms without a schema, in one check). The tokenizer bridge is",
        "  built once per loaded model, on its first constrained request.",
        "- The per-token hook costs well under a millisecond (llguidance's mask about 0.03 ms;",
        "  applying it about 0.3 ms on llama.cpp and 0.5 ms on ONNX Runtime GenAI, measured",
        "  separately): a few percent of a 135M model's ~10 ms per token on this CPU, less on",
        "  a larger model. Differences under ~10% between columns are within this machine's",
        "  noise (see the load average).",
        "- Validity (tests/test_structured_engines.py): 20 replies per schema at temperature",
        "  1.0 for three schemas all parse and validate on llama.cpp, OpenVINO and ONNX",
        "  Runtime GenAI (5 on MLX). With OpenVINO's plain `json_schema=` 3 of 60 such replies",
        "  ran into XGrammar's free whitespace until max_tokens, and its number bounds let",
        "  60.5 through a maximum of 60 (1 of 20); localrun's compact layout fixes both.",
    ]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--backend", action="append", choices=sorted(FIXTURES),
                    help="engine to measure (repeat; default: every one available)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--markdown", type=Path, help="write the results table here")
    ap.add_argument("--from-json", type=Path, help="only write --markdown from a JSON report")
    args = ap.parse_args()
    if args.from_json:
        report = json.loads(args.from_json.read_text(encoding="utf-8"))
        text = markdown(report["results"], report["meta"])
        if args.markdown:
            args.markdown.write_text(text, encoding="utf-8")
        else:
            sys.stdout.write(text)
        return 0
    from localrun.backends import is_installed

    results = []
    for backend in args.backend or list(FIXTURES):
        path = fixture(backend)
        if path is None or not is_installed(backend):
            print(f"{backend}: skipped (engine or fixture missing; "
                  "run scripts/make_test_models.py)", file=sys.stderr)
            continue
        tokens = min(args.tokens, 24) if backend == "mlx" else args.tokens
        r = bench(backend, path, args.runs, tokens)
        results.append(r)
        print(json.dumps(r), flush=True)
    meta = {"when": time.strftime("%Y-%m-%d"), "load": os.getloadavg()[0], "runs": args.runs,
            "tokens": args.tokens}
    if args.json:
        args.json.write_text(json.dumps({"meta": meta, "results": results}, indent=1) + "\n",
                             encoding="utf-8")
    if args.markdown:
        args.markdown.write_text(markdown(results, meta), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
