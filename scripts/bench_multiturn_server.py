#!/usr/bin/env python3
"""A multi-turn chat's time to first token through ``localrun serve`` and llama-server.

The conversation of issue 30 (and of scripts/bench_multiturn.py): a short system prompt,
six user turns, 96-token greedy replies, each reply appended before the next turn, streamed
over HTTP (OpenAI ``/v1/chat/completions``, ``stream: true``) as a chat client sends it.
TTFT is from sending the request to the first content delta. The two servers run the same
GGUF file with the same threads and context, side by side (each idle while the other is
asked), and the conversation alternates between them run by run (A B, B A, A B, ...), so
that drift on a busy machine hits both alike. Every run starts its system prompt with its
own number, so that no server reuses an earlier run's cells.

llama-server is llama.cpp's own, built from the source vendored in the installed
llama-cpp-python with the project's flags (scripts/build_llama_tools.py): the engine's own
anchor. It runs one slot of the whole context (``--parallel 1``) and ``cache_prompt``
(its default: the cells of the previous turn, its reply's included, are reused).

Printed: per run and server, TTFT per turn (and the tokens each turn prefilled, where the
server says: llama-server's ``timings.prompt_n``), turn 6 / turn 2; then the medians and
localrun's turn-6 TTFT over llama-server's in each run (target: <= 1.1).

    .venv/bin/python scripts/build_llama_tools.py           # once (minutes)
    .venv/bin/python scripts/bench_multiturn_server.py --runs 3
    .venv/bin/python scripts/bench_multiturn_server.py --runs 3 --exact   # localrun --exact
    .venv/bin/python scripts/bench_multiturn_server.py --json docs/results/multiturn_fast.json

Model: the gguf-q8_0 fixture of scripts/make_test_models.py (``--model`` for another).
Not a test: numbers depend on the machine and what else runs on it.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SYSTEM = "You are a helpful assistant."
TURNS = ["Tell me about the sea.", "Why is it salty?", "What lives at the bottom?",
         "How deep is the deepest part?", "Who first went down there?",
         "What did they see?"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_ready(port: int, proc: subprocess.Popen[bytes], path: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server on port {port} exited with {proc.returncode}")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("GET", path)
            if conn.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"the server on port {port} was not ready in {timeout:.0f} s")


class Server:
    """One server process: its name, port and how to ask it."""

    def __init__(self, name: str, cmd: list[str], port: int, ready: str, model: str,
                 log: Path) -> None:
        self.name, self.port, self.model = name, port, model
        self.log = log.open("wb")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self.ready = ready

    def wait(self, timeout: float = 300) -> None:
        wait_ready(self.port, self.proc, self.ready, timeout)

    def chat(self, messages: list[dict[str, str]], max_tokens: int
             ) -> tuple[str, float, dict[str, Any]]:
        """The reply, its TTFT (s) and what the last chunk said (usage, timings)."""
        body = json.dumps({"model": self.model, "messages": messages, "stream": True,
                           "max_tokens": max_tokens, "temperature": 0, "top_p": 1.0,
                           "stream_options": {"include_usage": True}}).encode()
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)
        t0 = time.perf_counter()
        conn.request("POST", "/v1/chat/completions", body=body,
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise SystemExit(f"{self.name}: HTTP {resp.status}: {resp.read()[:300]!r}")
        ttft = 0.0
        text: list[str] = []
        extra: dict[str, Any] = {}
        for raw in resp:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            chunk = json.loads(data)
            for choice in chunk.get("choices") or ():
                piece = (choice.get("delta") or {}).get("content") or ""
                if piece and not ttft:
                    ttft = time.perf_counter() - t0
                text.append(piece)
            for key in ("usage", "timings"):
                if chunk.get(key):
                    extra[key] = chunk[key]
        conn.close()
        return "".join(text), ttft, extra

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()


def conversation(server: Server, run: int, reply: int) -> list[dict[str, Any]]:
    messages = [{"role": "system", "content": f"Session {run}. {SYSTEM}"}]
    rows = []
    for turn in TURNS:
        messages.append({"role": "user", "content": turn})
        text, ttft, extra = server.chat(messages, reply)
        messages.append({"role": "assistant", "content": text})
        usage, timings = extra.get("usage") or {}, extra.get("timings") or {}
        rows.append({"ttft": ttft, "prompt_tokens": usage.get("prompt_tokens"),
                     "completion_tokens": usage.get("completion_tokens"),
                     "prefilled": timings.get("prompt_n")})
    return rows


def show(name: str, run: int, rows: list[dict[str, Any]]) -> float:
    ratio = rows[5]["ttft"] / rows[1]["ttft"]
    cells = " | ".join(
        f"{r['prompt_tokens']} : {r['ttft'] * 1000:.0f} ms"
        + (f" ({r['prefilled']})" if r["prefilled"] is not None else "") for r in rows)
    print(f"| {run} | {name} | {cells} | {ratio:.2f} |", flush=True)
    return ratio


def main() -> None:
    sys.path.insert(0, str(ROOT / "scripts"))
    from build_llama_tools import installed_version, tools_root

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="GGUF file (default: the gguf-q8_0 test fixture)")
    ap.add_argument("--runs", type=int, default=3, help="alternating runs of each server")
    ap.add_argument("--reply", type=int, default=96, help="greedy tokens per reply")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=None,
                    help="llama-server's -t/-tb (default: localrun's own default)")
    ap.add_argument("--exact", action="store_true", help="serve localrun with --exact")
    ap.add_argument("--llama-server", help="the llama-server binary (default: "
                    "build_llama_tools.py's for the installed llama-cpp-python)")
    ap.add_argument("--json", help="also write the results to this file")
    ap.add_argument("--logs", default=str(ROOT / ".scratch"), help="folder for server logs")
    args = ap.parse_args()

    from localrun.backends.llama_cpp.devices import default_threads
    from tests.models import test_model

    model = args.model or str(test_model("gguf-q8_0"))
    threads = args.threads or default_threads()
    binary = Path(args.llama_server or tools_root(installed_version()) / "bin" /
                  "llama-server")
    if not binary.is_file():
        raise SystemExit(f"no llama-server at {binary}: run scripts/build_llama_tools.py")
    logs = Path(args.logs)
    logs.mkdir(parents=True, exist_ok=True)
    lp, sp = free_port(), free_port()
    env_cmd = [sys.executable, "-m", "localrun", "serve", model, "--port", str(lp),
               "--backend", "llama.cpp", "--context", str(args.context),
               *(["--exact"] if args.exact else [])]
    ours = Server("localrun serve" + (" --exact" if args.exact else ""), env_cmd, lp,
                  "/health", model, logs / "bench_localrun_serve.log")
    theirs = Server("llama-server", [str(binary), "-m", model, "--host", "127.0.0.1",
                                     "--port", str(sp), "-c", str(args.context),
                                     "-t", str(threads), "-tb", str(threads),
                                     "--parallel", "1"],
                    sp, "/health", model, logs / "bench_llama_server.log")
    load_start = os.getloadavg()
    results: dict[str, list[list[dict[str, Any]]]] = {ours.name: [], theirs.name: []}
    try:
        ours.wait()
        theirs.wait()
        for s in (ours, theirs):  # warm-up: the first request's one-time costs
            s.chat([{"role": "user", "content": "Hello."}], 4)
        print(f"load average {load_start[0]:.2f} {load_start[1]:.2f} {load_start[2]:.2f}; "
              f"{Path(model).name}, context {args.context}, {threads} threads, "
              f"{args.reply}-token replies; 'prompt tokens : TTFT (tokens prefilled)'")
        print("| run | server | " + " | ".join(f"turn {i + 1}" for i in range(len(TURNS)))
              + " | turn 6 / turn 2 |")
        print("|---" * (len(TURNS) + 3) + "|")
        for run in range(1, args.runs + 1):
            order = (ours, theirs) if run % 2 else (theirs, ours)
            for s in order:
                rows = conversation(s, run, args.reply)
                results[s.name].append(rows)
                show(s.name, run, rows)
    finally:
        ours.close()
        theirs.close()
    load_end = os.getloadavg()
    per_run = [a[5]["ttft"] / b[5]["ttft"]
               for a, b in zip(results[ours.name], results[theirs.name], strict=True)]
    print(f"\nload average at the end {load_end[0]:.2f} {load_end[1]:.2f} {load_end[2]:.2f}")
    for name, runs in results.items():
        t6 = statistics.median(r[5]["ttft"] for r in runs) * 1000
        t2 = statistics.median(r[1]["ttft"] for r in runs) * 1000
        ratios = ", ".join(f"{r[5]['ttft'] / r[1]['ttft']:.2f}" for r in runs)
        print(f"{name:24} turn 6 median {t6:.0f} ms, turn 2 median {t2:.0f} ms; "
              f"turn 6 / turn 2 per run: {ratios}")
    print("localrun turn 6 / llama-server turn 6, per run: "
          + ", ".join(f"{r:.2f}" for r in per_run)
          + f" (median {statistics.median(per_run):.2f}; target <= 1.1)")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "model": Path(model).name, "context": args.context, "threads": threads,
            "reply": args.reply, "exact": args.exact, "load_start": load_start,
            "load_end": load_end, "runs": results, "turn6_ratio_per_run": per_run},
            indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
