"""What ``localrun serve`` adds over calling the same Model in process, and its throughput
with several clients.

For each CPU engine that is installed and has a test model here, one Model is loaded
and served by an in-process server on 127.0.0.1 (uvicorn in a thread, as
``localrun serve`` runs it). The same raw prompts, greedy, the same number of tokens,
go through ``Model.stream`` and through ``POST /v1/completions`` (stream, usage),
alternating the two so drift on a busy machine hits both alike. Each prompt starts with
a different word so no engine reuses the previous request's KV cache.

Printed per engine: TTFT both ways (median) and the difference (median of the
back-to-back pairs); decode throughput (tokens after the first / time after the first)
both ways and the ratio (median of the pairs); then output
tokens/s with 1, 4 and 8 concurrent clients (each model runs one sequence at a time in
the server, so this measures the queue's overhead, not batching).

Targets: the server adds at most 15 ms to TTFT, and throughput stays within 5%.

    .venv/bin/python scripts/bench_server.py                      # every engine available
    .venv/bin/python scripts/bench_server.py --backend llama.cpp --tokens 64 --runs 7
    .venv/bin/python scripts/bench_server.py --json docs/results/server.json
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

WORDS = ("Once", "Today", "Yesterday", "Long", "Every", "Sometimes", "Before", "After",
         "When", "Because", "Although", "Maybe", "Suddenly", "Later", "Often", "Never")
#: (backend, fixture) for each CPU engine
ENGINES = (("llama.cpp", "gguf-q4_1"), ("openvino", "openvino-int4"), ("onnx", "onnx-int4"),
           ("mlx", "mlx-4bit"))


def prompt(i: int) -> str:
    """A different first word for consecutive i (no engine reuses the last KV cache)."""
    n = len(WORDS)
    return (f"{WORDS[i % n]} {WORDS[(i // n) % n].lower()} upon a time, in a small village "
            "by the sea, there lived")


@dataclass
class Run:
    ttft: float
    total: float
    tokens: int

    @property
    def decode_tps(self) -> float:
        span = self.total - self.ttft
        return (self.tokens - 1) / span if self.tokens > 1 and span > 0 else 0.0


def in_process(model: Any, text: str, tokens: int) -> Run:
    """``Model.stream`` on a new thread, as the server runs each request. Measured here
    (docs/results/server.md): llama.cpp with 2 threads on a busy 2-core machine decodes
    3-30x slower when called again and again from one long-lived thread than from a
    fresh one, so calling from the same thread every time would flatter the server."""
    out: list[Run] = []
    t = threading.Thread(target=lambda: out.append(_in_process(model, text, tokens)))
    t.start()
    t.join()
    return out[0]


def _in_process(model: Any, text: str, tokens: int) -> Run:
    t0 = time.perf_counter()
    first = 0.0
    with model.stream(text, raw=True, max_tokens=tokens, temperature=0) as s:
        for chunk in s:
            if chunk.text and not first:
                first = time.perf_counter()
        c = s.completion
    end = time.perf_counter()
    return Run((first or end) - t0, end - t0, c.usage.completion_tokens)


def over_http(port: int, name: str, text: str, tokens: int) -> Run:
    body = json.dumps({"model": name, "prompt": text, "max_tokens": tokens, "temperature": 0,
                       "stream": True, "stream_options": {"include_usage": True}})
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", body=body,
                 headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    if r.status != 200:
        raise RuntimeError(f"HTTP {r.status}: {r.read()[:200]!r}")
    first = 0.0
    used = 0
    for raw in r:
        line = raw.strip()
        if not line.startswith(b"data: {"):
            continue
        data = json.loads(line[6:])
        if data["choices"] and data["choices"][0]["text"] and not first:
            first = time.perf_counter()
        if data.get("usage"):
            used = data["usage"]["completion_tokens"]
    end = time.perf_counter()
    conn.close()
    return Run((first or end) - t0, end - t0, used)


@dataclass
class Result:
    backend: str
    model: str
    runs: int
    tokens: int
    ttft_inproc_ms: float = 0.0
    ttft_server_ms: float = 0.0
    ttft_added_ms: float = 0.0
    decode_tps_inproc: float = 0.0
    decode_tps_server: float = 0.0
    decode_ratio: float = 0.0
    concurrency: dict[str, float] = field(default_factory=dict)


def bench_engine(backend: str, path: str, runs: int, tokens: int, clients: list[int],
                 requests_per_client: int, threads: int | None = None) -> Result:
    import localrun
    from localrun.server.app import bind, create_app, make_server, tune_process
    from localrun.server.config import ServerConfig
    from localrun.server.manager import ModelManager
    from localrun.server.metrics import Metrics

    tune_process()  # what `localrun serve` does to its process
    res = Result(backend, path, runs, tokens)
    model = localrun.load(path, backend=backend, context=1024, threads=threads)
    sock = bind("127.0.0.1", 0)
    config = replace(ServerConfig(max_queue=64), port=sock.getsockname()[1])
    manager = ModelManager(config, Metrics())
    manager._register("bench", "chat", None, model, 0.0, pinned=True, size=0)
    server = make_server(create_app(config, manager=manager), config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    try:
        in_process(model, prompt(99), 4)  # warm both paths up
        over_http(config.port, "bench", prompt(98), 4)
        a, b = [], []
        for i in range(runs):  # alternate which path goes first
            if i % 2:
                b.append(over_http(config.port, "bench", prompt(2 * i), tokens))
                a.append(in_process(model, prompt(2 * i + 1), tokens))
            else:
                a.append(in_process(model, prompt(2 * i), tokens))
                b.append(over_http(config.port, "bench", prompt(2 * i + 1), tokens))
        res.ttft_inproc_ms = statistics.median(r.ttft for r in a) * 1000
        res.ttft_server_ms = statistics.median(r.ttft for r in b) * 1000
        # per pair (the two ran back to back), so drift between pairs cancels out
        pairs = list(zip(a, b, strict=True))
        res.ttft_added_ms = statistics.median(y.ttft - x.ttft for x, y in pairs) * 1000
        res.decode_tps_inproc = statistics.median(r.decode_tps for r in a)
        res.decode_tps_server = statistics.median(r.decode_tps for r in b)
        res.decode_ratio = statistics.median(y.decode_tps / x.decode_tps
                                             for x, y in pairs if x.decode_tps)
        for n in clients:
            done: list[int] = []
            lock = threading.Lock()

            def client(k: int, n: int = n, done: list[int] = done,
                       lock: threading.Lock = lock) -> None:
                for j in range(requests_per_client):
                    run = over_http(config.port, "bench", prompt(100 + k * 7 + j), tokens)
                    with lock:
                        done.append(run.tokens)

            t0 = time.perf_counter()
            threads = [threading.Thread(target=client, args=(k,)) for k in range(n)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            res.concurrency[str(n)] = sum(done) / (time.perf_counter() - t0)
    finally:
        server.should_exit = True
        thread.join(60)
        model.close()
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", action="append", help="only these engines (repeatable)")
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--clients", default="1,4,8")
    ap.add_argument("--requests-per-client", type=int, default=2)
    ap.add_argument("--threads", type=int, help="engine threads (default: the engine's)")
    ap.add_argument("--json", help="write the results here too")
    args = ap.parse_args()

    from localrun.backends import is_installed
    from localrun.naming.stores import default_model_path
    from tests.models import read_manifest

    manifest = (read_manifest() or {}).get("models", {})
    clients = [int(c) for c in args.clients.split(",")]
    out = []
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs; "
          f"{args.runs} runs x {args.tokens} tokens, greedy, raw prompts", flush=True)
    for backend, fixture in ENGINES:
        if args.backend and backend not in args.backend:
            continue
        path = str(default_model_path()) if fixture == "gguf-q4_1" else manifest.get(fixture)
        if not is_installed(backend) or not path:
            print(f"{backend}: skipped (engine not installed or {fixture} not built)")
            continue
        try:
            r = bench_engine(backend, path, args.runs, args.tokens, clients,
                             args.requests_per_client, args.threads)
        except Exception as e:  # one engine failing must not hide the others
            print(f"{backend}: failed: {type(e).__name__}: {e}", flush=True)
            continue
        out.append(r)
        conc = ", ".join(f"{k} clients {v:.1f} tok/s" for k, v in r.concurrency.items())
        print(f"{backend:10} TTFT {r.ttft_inproc_ms:6.1f} ms in process, "
              f"{r.ttft_server_ms:6.1f} ms served (+{r.ttft_added_ms:.1f} ms); decode "
              f"{r.decode_tps_inproc:6.1f} vs {r.decode_tps_server:6.1f} tok/s "
              f"(x{r.decode_ratio:.3f}); {conc}", flush=True)
    if args.json:
        from dataclasses import asdict

        Path(args.json).write_text(json.dumps({
            "load_average": os.getloadavg()[0], "cpus": os.cpu_count(),
            "threads": args.threads, "runs": args.runs, "tokens": args.tokens,
            "results": [asdict(r) for r in out]}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
