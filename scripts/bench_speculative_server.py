"""Speculative decoding through a server: `localrun serve` against llama-server, each with
its own n-gram drafts and without, on the same GGUF and prompt (issue 30).

`localrun serve` runs every request in its engine's batch (`--parallel` > 1); its prompt
lookup drafts there for a sequence decoded in a step of its own (the lone request of an
agent loop). llama-server's own is `--spec-type ngram-cache` (llama-lookup's n-gram
cache), `--spec-draft-n-max` as localrun's draft length. Four servers, the copy and chat
prompts of scripts/bench_speculative.py, greedy, streamed; decode tok/s = (completion
tokens - 1) / (total - time to first token), the servers alternating rep by rep:

    .venv/bin/python scripts/bench_speculative_server.py                 # F32 fixture
    .venv/bin/python scripts/bench_speculative_server.py --gguf gguf-q8_0 --reps 3

Prints the load average with the numbers. Not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_multiturn_server import Server, free_port  # noqa: E402
from bench_speculative import WORKLOADS, fixture  # noqa: E402


def rate(server: Server, prompt: str, max_tokens: int) -> dict[str, Any]:
    import time

    t0 = time.perf_counter()
    text, ttft, extra = server.chat([{"role": "user", "content": prompt}], max_tokens)
    total = time.perf_counter() - t0
    usage = extra.get("usage") or {}
    n = int(usage.get("completion_tokens") or 0)
    timings = extra.get("timings") or {}
    return {"tok_s": (n - 1) / max(total - ttft, 1e-9), "tokens": n, "text": text,
            "drafted": timings.get("draft_n") or timings.get("drafted_tokens"),
            "accepted": timings.get("draft_n_accepted") or timings.get("accepted_tokens")}


def main() -> None:
    from build_llama_tools import installed_version, tools_root

    from localrun.backends.llama_cpp.devices import default_threads
    from localrun.backends.speculative import DRAFT_MAX

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", default="gguf-f32", help="fixture key (make_test_models.py)")
    ap.add_argument("--workloads", default="copy,chat")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=192)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--json", help="also write the results to this file")
    ap.add_argument("--logs", default=str(ROOT / ".scratch"), help="folder for server logs")
    args = ap.parse_args()
    model = fixture(args.gguf)
    threads = default_threads()
    binary = tools_root(installed_version()) / "bin" / "llama-server"
    if not binary.is_file():
        raise SystemExit(f"no llama-server at {binary}: run scripts/build_llama_tools.py")
    logs = Path(args.logs)
    logs.mkdir(parents=True, exist_ok=True)

    def ours(mode: str) -> Server:
        port = free_port()
        return Server(f"localrun serve --speculative {mode}", [
            sys.executable, "-m", "localrun", "serve", model, "--port", str(port),
            "--backend", "llama.cpp", "--context", str(args.context), "--speculative",
            mode], port, "/health", model, logs / f"bench_spec_localrun_{mode}.log")

    def theirs(spec: bool) -> Server:
        port = free_port()
        extra = ["--spec-type", "ngram-cache", "--spec-draft-n-max", str(DRAFT_MAX)] \
            if spec else []
        name = "llama-server" + (f" ngram-cache n-max {DRAFT_MAX}" if spec else "")
        return Server(name, [str(binary), "-m", model, "--host", "127.0.0.1", "--port",
                             str(port), "-c", str(args.context), "-t", str(threads), "-tb",
                             str(threads), *extra], port, "/health", model,
                      logs / f"bench_spec_llama_server_{int(spec)}.log")

    servers = [ours("off"), ours("auto"), theirs(False), theirs(True)]
    load_start = os.getloadavg()
    results: dict[tuple[str, str], list[dict[str, Any]]] = {}
    try:
        for s in servers:
            s.wait()
            s.chat([{"role": "user", "content": "Hello."}], 4)  # warm-up
        print(f"load average {load_start[0]:.2f} {load_start[1]:.2f} {load_start[2]:.2f}; "
              f"{Path(model).name}, context {args.context}, {threads} threads, "
              f"{args.max_tokens} greedy tokens", flush=True)
        for name in args.workloads.split(","):
            for rep in range(args.reps):
                order = servers if rep % 2 == 0 else servers[::-1]
                for s in order:
                    r = rate(s, WORKLOADS[name], args.max_tokens)
                    results.setdefault((name, s.name), []).append(r)
                    print(f"  {name} {s.name}: {r['tok_s']:.1f} tok/s ({r['tokens']} tokens;"
                          f" drafts {r['accepted']}/{r['drafted']})", flush=True)
    finally:
        for s in servers:
            s.close()
    load_end = os.getloadavg()
    print(f"\nload average at the end {load_end[0]:.2f} {load_end[1]:.2f} {load_end[2]:.2f}")
    print("| workload | server | decode tok/s (median) | vs its own plain | runs |")
    print("|---|---|---|---|---|")
    table = []
    for name in args.workloads.split(","):
        base = {"localrun": statistics.median(
                    r["tok_s"] for r in results[(name, servers[0].name)]),
                "llama-server": statistics.median(
                    r["tok_s"] for r in results[(name, servers[2].name)])}
        for s in servers:
            runs = results[(name, s.name)]
            med = statistics.median(r["tok_s"] for r in runs)
            own = base["localrun" if s.name.startswith("localrun") else "llama-server"]
            each = ", ".join(f"{r['tok_s']:.1f}" for r in runs)
            print(f"| {name} | {s.name} | {med:.1f} | {med / own:.2f}x | {each} |")
            table.append({"workload": name, "server": s.name, "tok_s": med,
                          "vs_plain": med / own, "runs": runs})
    if args.json:
        Path(args.json).write_text(json.dumps({
            "model": Path(model).name, "threads": threads, "load_start": load_start,
            "load_end": load_end, "rows": table}, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
