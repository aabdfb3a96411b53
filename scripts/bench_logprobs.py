"""What log probabilities cost on each engine (issue 28 item 2).

For every engine that reports them and is installed with its SmolLM2-135M fixture here,
this measures decode speed (tokens/s from the first token to the last, wall clock as the
caller of ``Model.stream`` sees it) of the same greedy reply three ways: without log
probabilities, with ``logprobs=True`` (the chosen token's) and with ``top_logprobs=5``;
and, on engines that batch, the same for a batch of 4 replies (tokens/s of all of them
together, through the engine's batcher). Greedy replies are the same tokens either way,
so the runs compare like with like.

Target: top_logprobs=5 costs at most 10% of decode speed.

``--server``: the same over ``localrun serve`` (an in-process server, as
scripts/bench_server.py runs it, llama.cpp): streamed ``POST /v1/completions``
(``logprobs`` null, 0, 5) and ``POST /v1/chat/completions`` (``logprobs`` off, on,
``top_logprobs`` 5), decode tokens/s as the client reads the events (first text to last),
so what the server adds per token — the entries in each event, their JSON — is counted.

    .venv/bin/python scripts/bench_logprobs.py                       # every engine
    .venv/bin/python scripts/bench_logprobs.py --backend llama.cpp --runs 7
    .venv/bin/python scripts/bench_logprobs.py --json docs/results/logprobs.json \\
        --markdown docs/results/logprobs.md
    .venv/bin/python scripts/bench_logprobs.py --server --runs 5

Models come from ~/.cache/localrun/test-models/manifest.json (scripts/make_test_models.py
makes them; llama.cpp uses the embedded GGUF). The three modes alternate run by run, so a
busy machine slows them alike; the load average is recorded with the results.
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
FIXTURES = {"llama.cpp": "gguf-q4_1", "onnx": "onnx-int4", "mlx": "mlx-4bit"}
PROMPT = "Once upon a time, in a small village by the sea, there lived"
PROMPTS = [PROMPT, "The history of the printing press begins", "Here is a recipe for bread:",
           "The rules of chess are simple."]
MODES: dict[str, dict[str, Any]] = {"off": {}, "logprobs": {"logprobs": True},
                                    "top5": {"logprobs": True, "top_logprobs": 5}}


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


def per_token_cost(vocab: int = 49152, repeats: int = 2000) -> dict[str, float]:
    """Microseconds Scorer.entry takes for one token over a ``vocab``-sized row of
    logits (the work logprobs add per token, whatever the machine's load)."""
    import numpy as np

    from localrun.backends.logprobs import Scorer

    rng = np.random.default_rng(0)
    row = (rng.standard_normal(vocab) * 3).astype(np.float32)
    scorer = Scorer(lambda t: b"x")
    out = {}
    for top in (0, 5, 20):
        scorer.entry(row, 7, top)
        t0 = time.perf_counter()
        for i in range(repeats):
            scorer.entry(row, i % vocab, top)
        out[f"top{top}_us"] = round(1e6 * (time.perf_counter() - t0) / repeats, 1)
    return out


def one(model: Any, tokens: int, options: dict[str, Any]) -> tuple[float, float]:
    """Decode tokens/s of one greedy reply, first token to last: by the wall clock, and
    by this process's CPU time (less moved by other processes on a shared machine)."""
    first = last = cpu0 = cpu1 = 0.0
    n = 0
    for chunk in model.stream(PROMPT, raw=True, max_tokens=tokens, temperature=0, **options):
        now, cpu = time.perf_counter(), time.process_time()
        if chunk.text:
            if not first:
                first, cpu0 = now, cpu
            last, cpu1 = now, cpu
        if chunk.usage is not None:
            n = chunk.usage.completion_tokens
    if n < 2 or last <= first:
        return 0.0, 0.0
    return (n - 1) / (last - first), (n - 1) / max(cpu1 - cpu0, 1e-9)


def batched(model: Any, tokens: int, options: dict[str, Any]) -> float:
    """Tokens/s of 4 greedy replies run together (the engine's batcher)."""
    from localrun.batch import BatchItem

    t0 = time.perf_counter()
    out = model.batch([BatchItem(p, raw=True) for p in PROMPTS], max_tokens=tokens,
                      temperature=0, **options)
    return sum(c.usage.completion_tokens for c in out) / (time.perf_counter() - t0)


def bench(backend: str, path: str, runs: int, tokens: int) -> dict[str, Any]:
    import localrun

    with localrun.load(path, backend=backend, context=1024) as model:
        for options in MODES.values():  # warm: tokenizer tables, first calls
            one(model, 8, options)
        alone: dict[str, list[float]] = {m: [] for m in MODES}
        cpu: dict[str, list[float]] = {m: [] for m in MODES}
        together: dict[str, list[float]] = {m: [] for m in MODES}
        batches = model.max_concurrency > 1
        for _ in range(runs):
            for mode, options in MODES.items():
                wall, by_cpu = one(model, tokens, options)
                alone[mode].append(wall)
                cpu[mode].append(by_cpu)
                if batches:
                    together[mode].append(batched(model, tokens, options))
    out: dict[str, Any] = {"backend": backend, "runs": runs, "tokens": tokens}
    for label, table in (("alone", alone), ("alone_cpu", cpu), ("batch4", together)):
        if not table["off"]:
            continue
        med = {m: statistics.median(v) for m, v in table.items()}
        out[label] = {m: {"tok_s": round(med[m], 2),
                          "cost_pct": round(100 * (1 - med[m] / med["off"]), 1)
                          if med["off"] else None, "all": [round(x, 2) for x in v]}
                      for m, v in table.items()}
    return out


#: the server's modes: what each endpoint's request adds
SERVER_MODES: dict[str, dict[str, dict[str, Any]]] = {
    "completions": {"off": {}, "logprobs": {"logprobs": 0}, "top5": {"logprobs": 5}},
    "chat": {"off": {}, "logprobs": {"logprobs": True},
             "top5": {"logprobs": True, "top_logprobs": 5}}}


def over_http(port: int, endpoint: str, tokens: int, options: dict[str, Any]) -> float:
    """Decode tokens/s of one greedy streamed reply, as the client reads its events."""
    import http.client

    body: dict[str, Any] = {"model": "bench", "max_tokens": tokens, "temperature": 0,
                            "stream": True, "stream_options": {"include_usage": True},
                            **options}
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": PROMPT}]
        path = "/v1/chat/completions"
    else:
        body["prompt"] = PROMPT
        path = "/v1/completions"
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    conn.request("POST", path, body=json.dumps(body),
                 headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    if r.status != 200:
        raise RuntimeError(f"HTTP {r.status}: {r.read()[:200]!r}")
    first = last = 0.0
    n = 0
    for raw in r:
        line = raw.strip()
        if not line.startswith(b"data: {"):
            continue
        data = json.loads(line[6:])
        choices = data["choices"]
        text = choices and (choices[0].get("text") or (choices[0].get("delta") or {}).get(
            "content"))
        if text:
            now = time.perf_counter()
            first = first or now
            last = now
        if data.get("usage"):
            n = data["usage"]["completion_tokens"]
    conn.close()
    return (n - 1) / (last - first) if n > 1 and last > first else 0.0


def bench_server(path: str, runs: int, tokens: int) -> dict[str, Any]:
    """llama.cpp behind an in-process ``localrun serve`` (see the module's docstring)."""
    import threading
    from dataclasses import replace

    import localrun
    from localrun.server.app import bind, create_app, make_server, tune_process
    from localrun.server.config import ServerConfig
    from localrun.server.manager import ModelManager
    from localrun.server.metrics import Metrics

    tune_process()
    model = localrun.load(path, backend="llama.cpp", context=1024)
    sock = bind("127.0.0.1", 0)
    config = replace(ServerConfig(), port=sock.getsockname()[1])
    manager = ModelManager(config, Metrics())
    manager._register("bench", "chat", None, model, 0.0, pinned=True, size=0)
    server = make_server(create_app(config, manager=manager), config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    out: dict[str, Any] = {"backend": "llama.cpp (served)", "runs": runs, "tokens": tokens}
    try:
        for endpoint, modes in SERVER_MODES.items():
            for options in modes.values():
                over_http(config.port, endpoint, 8, options)  # warm
            table: dict[str, list[float]] = {m: [] for m in modes}
            for _ in range(runs):
                for mode, options in modes.items():
                    table[mode].append(over_http(config.port, endpoint, tokens, options))
            med = {m: statistics.median(v) for m, v in table.items()}
            out[endpoint] = {m: {"tok_s": round(med[m], 2),
                                 "cost_pct": round(100 * (1 - med[m] / med["off"]), 1)
                                 if med["off"] else None, "all": [round(x, 2) for x in v]}
                             for m, v in table.items()}
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()
        model.close()
    return out


def markdown(results: list[dict[str, Any]], load: tuple[float, float, float]) -> str:
    lines = ["| engine | run | off tok/s | logprobs tok/s (cost) | top_logprobs=5 tok/s (cost) |",
             "|---|---|---|---|---|"]
    for r in results:
        for label in ("alone", "alone_cpu", "batch4", "completions", "chat"):
            t = r.get(label)
            if t is None:
                continue
            cells = [f"{t['off']['tok_s']}"] + [
                f"{t[m]['tok_s']} ({t[m]['cost_pct']}%)" for m in ("logprobs", "top5")]
            lines.append(f"| {r['backend']} | {label} | " + " | ".join(cells) + " |")
    lines.append("")
    lines.append("alone: wall clock, one reply; alone_cpu: the same replies by this process's "
                 "CPU time; batch4: 4 replies together, wall clock; completions, chat: one "
                 "streamed reply over localrun serve, as the client reads it.")
    lines.append(f"Load average at the end: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} "
                 f"on {os.cpu_count()} CPUs; median of {results[0]['runs'] if results else 0} "
                 "runs each, modes alternating.")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", action="append", choices=sorted(FIXTURES),
                    help="engine to measure (repeatable; default: every one installed)")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=128, help="tokens per reply")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--markdown", type=Path)
    ap.add_argument("--server", action="store_true",
                    help="measure over localrun serve (llama.cpp) instead")
    args = ap.parse_args()
    from localrun.backends import installed_backends

    have = set(installed_backends())
    results = []
    for backend in [] if args.server else args.backend or list(FIXTURES):
        path = fixture(backend)
        if backend not in have or path is None:
            print(f"{backend}: skipped (engine or fixture missing)", file=sys.stderr)
            continue
        print(f"{backend}: {path}", file=sys.stderr)
        results.append(bench(backend, path, args.runs, args.tokens))
        print(json.dumps(results[-1]), file=sys.stderr)
    if args.server:
        path = fixture("llama.cpp")
        if "llama.cpp" not in have or path is None:
            print("llama.cpp: engine or fixture missing", file=sys.stderr)
            return 1
        results.append(bench_server(path, args.runs, args.tokens))
        print(json.dumps(results[-1]), file=sys.stderr)
    load = os.getloadavg()
    micro = per_token_cost()
    text = markdown(results, load) + (
        f"\nScorer.entry per token, 49152-token vocabulary: {micro['top0_us']} us (logprobs), "
        f"{micro['top5_us']} us (top 5), {micro['top20_us']} us (top 20).\n")
    print(text)
    if args.json:
        args.json.write_text(json.dumps({"results": results, "loadavg": load,
                                         "per_token_us": micro}, indent=1) + "\n",
                             encoding="utf-8")
    if args.markdown:
        args.markdown.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
