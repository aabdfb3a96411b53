"""What each dialect's layer costs over Chat Completions: the same chat, greedy, the same
number of tokens, streamed through ``POST /v1/chat/completions`` and through each other
dialect's streaming route, on one llama.cpp model served in process (uvicorn in a thread,
as ``localrun serve`` runs it).

The dialects run in turn for each prompt, the order rotating, so drift on a busy machine
hits all alike; each prompt starts with a different word so no request reuses the
previous one's KV cache. Printed per dialect: TTFT (median) and what it adds over Chat
Completions (median of the back-to-back differences), decode tokens/s (tokens after the
first / time after the first) and its ratio to Chat Completions (median of the ratios).

Targets (issue 27): a streamed Messages or Responses request adds at most 5 ms TTFT and
3% decode over Chat Completions (Responses stores each response, as by default, in a
temporary LOCALRUN_HOME: the write comes before its last event, after the decode). On a
busy machine the HTTP numbers are noisy, so the layer's own work is timed too, in process
and without a model (``--layer``): reading and checking a request (its shape, then the
library's checks) and writing one streamed piece in the dialect's events.

    .venv/bin/python scripts/bench_dialects.py                    # 9 rounds x 48 tokens
    .venv/bin/python scripts/bench_dialects.py --runs 15 --tokens 64 --json out.json

A dialect is one row of DIALECTS: its route, its request body, and how to read a stream
event (its text, and whether it is the end).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from scripts.bench_server import Run, prompt  # noqa: E402

Body = Callable[[str, str, int], dict[str, Any]]


@dataclass(frozen=True)
class Dialect:
    name: str
    path: str
    body: Body
    text: Callable[[dict[str, Any]], str]  # the reply text one event carries
    tokens: Callable[[dict[str, Any]], int | None]  # the completion tokens, where told


def _chat(model: str, text: str, n: int) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": n,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}


def _messages(model: str, text: str, n: int) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": n,
            "temperature": 0, "stream": True}


def _responses(model: str, text: str, n: int) -> dict[str, Any]:
    return {"model": model, "input": text, "max_output_tokens": n, "temperature": 0,
            "stream": True}  # stored, as by default: the write is timed too


def _responses_done(e: dict[str, Any]) -> int | None:
    if e.get("type") not in ("response.completed", "response.incomplete"):
        return None
    return int(e["response"]["usage"]["output_tokens"])


def _ollama(model: str, text: str, n: int) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": text}], "stream": True,
            "options": {"num_predict": n, "temperature": 0}}


DIALECTS = (
    Dialect("chat.completions", "/v1/chat/completions", _chat,
            lambda e: (e.get("choices") or [{}])[0].get("delta", {}).get("content") or "",
            lambda e: (e.get("usage") or {}).get("completion_tokens")),
    Dialect("messages", "/v1/messages", _messages,
            lambda e: e.get("delta", {}).get("text", "") if e.get("type") ==
            "content_block_delta" else "",
            lambda e: e["usage"]["output_tokens"] if e.get("type") == "message_delta" else None),
    Dialect("responses", "/v1/responses", _responses,
            lambda e: e.get("delta", "") if e.get("type") == "response.output_text.delta"
            else "", _responses_done),
    Dialect("ollama.chat", "/api/chat", _ollama,
            lambda e: (e.get("message") or {}).get("content") or "",
            lambda e: e.get("eval_count") if e.get("done") else None),
)


def stream(port: int, d: Dialect, model: str, text: str, n: int) -> Run:
    """One streamed request: when the first text came, when it ended, tokens made."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    t0 = time.perf_counter()
    conn.request("POST", d.path, body=json.dumps(d.body(model, text, n)),
                 headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    if r.status != 200:
        raise RuntimeError(f"{d.name}: HTTP {r.status}: {r.read()[:200]!r}")
    first, used = 0.0, 0
    for raw in r:
        line = raw.strip()
        if line.startswith(b"data: "):
            line = line[6:]
        if not line.startswith(b"{"):
            continue
        event = json.loads(line)
        if not first and d.text(event):
            first = time.perf_counter()
        got = d.tokens(event)
        if got is not None:
            used = got
    end = time.perf_counter()
    conn.close()
    return Run((first or end) - t0, end - t0, used)


def bench(path: str, runs: int, tokens: int, threads: int | None) -> dict[str, Any]:
    import localrun
    from localrun.server.app import bind, create_app, make_server, tune_process
    from localrun.server.config import ServerConfig
    from localrun.server.manager import ModelManager
    from localrun.server.metrics import Metrics

    tune_process()
    # stored responses (/v1/responses) go to a folder of this run's own
    home = tempfile.TemporaryDirectory(prefix="bench-dialects-")
    os.environ["LOCALRUN_HOME"] = home.name
    model = localrun.load(path, backend="llama.cpp", context=1024, threads=threads)
    sock = bind("127.0.0.1", 0)
    config = replace(ServerConfig(max_queue=64), port=sock.getsockname()[1])
    manager = ModelManager(config, Metrics())
    manager._register("bench", "chat", None, model, 0.0, pinned=True, size=0)
    server = make_server(create_app(config, manager=manager), config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    got: dict[str, list[Run]] = {d.name: [] for d in DIALECTS}
    try:
        for k, d in enumerate(DIALECTS):  # warm every path up
            stream(config.port, d, "bench", prompt(90 + k), 4)
        for i in range(runs):
            order = DIALECTS[i % len(DIALECTS):] + DIALECTS[:i % len(DIALECTS)]
            for k, d in enumerate(order):
                got[d.name].append(stream(config.port, d, "bench",
                                          prompt(i * len(DIALECTS) + k), tokens))
    finally:
        server.should_exit = True
        thread.join(60)
        model.close()
        home.cleanup()
    base = got[DIALECTS[0].name]
    out: dict[str, Any] = {}
    for d in DIALECTS:
        runs_ = got[d.name]
        pairs = list(zip(base, runs_, strict=True))
        out[d.name] = {
            "ttft_ms": statistics.median(r.ttft for r in runs_) * 1000,
            "ttft_added_ms": statistics.median(y.ttft - x.ttft for x, y in pairs) * 1000,
            "decode_tps": statistics.median(r.decode_tps for r in runs_),
            "decode_ratio": statistics.median(y.decode_tps / x.decode_tps for x, y in pairs
                                              if x.decode_tps),
            "tokens": statistics.median(r.tokens for r in runs_)}
    return out


def layer_costs(n: int = 5000) -> dict[str, dict[str, float]]:
    """Microseconds the protocol layer spends, per request (shape + checks) and per
    streamed piece (its events), for each dialect: no model, no HTTP."""
    from localrun.server.protocol import anthropic as an
    from localrun.server.protocol import ollama as ol
    from localrun.server.protocol import openai as oa
    from localrun.server.protocol import responses as rq
    from localrun.server.protocol import responses_out as ro
    from localrun.types import Chunk

    class Job:  # what a Wire reads of its job
        stream = None
        t0 = 0.0

    def per(f: Callable[[], Any]) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            f()
        return (time.perf_counter() - t0) / n * 1e6

    piece = Chunk(" word")
    messages = an.MessagesSSE(Job(), "msg_x", "m")
    list(messages.begin())
    req = rq.ResponsesRequest.model_validate(_responses("m", "x", 48))
    responses = ro.ResponsesSSE(ro.head("resp_x", req), frozenset())
    list(responses.begin())
    list(responses.chunk(Chunk("First")))  # its text item announced: pieces from here on
    wires: dict[str, Any] = {"chat.completions": oa.ChatSSE("c", "m", True),
                             "messages": messages, "responses": responses,
                             "ollama.chat": ol.NDJSON(Job(), "m", True)}
    by_name = {d.name: d for d in DIALECTS}
    shapes: dict[str, tuple[Any, Dialect]] = {
        "chat.completions": (oa.ChatCompletionRequest, by_name["chat.completions"]),
        "messages": (an.MessagesRequest, by_name["messages"]),
        "responses": (rq.ResponsesRequest, by_name["responses"]),
        "ollama.chat": (ol.ChatRequest, by_name["ollama.chat"])}
    out = {}
    for name, (shape, d) in shapes.items():
        body = d.body("m", prompt(1), 48)
        out[name] = {"request_us": per(lambda s=shape, b=body: s.model_validate(b)
                                       .generation()),
                     "piece_us": per(lambda w=wires[name]: list(w.chunk(piece)))}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=9)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, help="engine threads (default: the engine's)")
    ap.add_argument("--json", help="write the results here too")
    ap.add_argument("--layer", action="store_true", help="only the layer's own work")
    args = ap.parse_args()

    layer = layer_costs()
    for name, c in layer.items():
        print(f"{name:18} layer: {c['request_us']:6.1f} us per request (shape + checks), "
              f"{c['piece_us']:5.1f} us per streamed piece", flush=True)
    if args.layer:
        return 0
    from localrun.naming.stores import default_model_path

    path = str(default_model_path())
    load = os.getloadavg()[0]
    print(f"load average {load:.1f} on {os.cpu_count()} CPUs; llama.cpp {Path(path).name}; "
          f"{args.runs} rounds x {args.tokens} tokens, greedy, streamed", flush=True)
    res = bench(path, args.runs, args.tokens, args.threads)
    for name, r in res.items():
        print(f"{name:18} TTFT {r['ttft_ms']:7.1f} ms ({r['ttft_added_ms']:+6.1f} ms over "
              f"chat.completions); decode {r['decode_tps']:6.1f} tok/s "
              f"(x{r['decode_ratio']:.3f}); {r['tokens']:.0f} tokens", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({
            "load_average": load, "cpus": os.cpu_count(), "threads": args.threads,
            "runs": args.runs, "tokens": args.tokens, "results": res, "layer": layer},
            indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
