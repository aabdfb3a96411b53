"""Speculative decoding (issue 30), against the engines' own tools on the same prompt and file.

Workloads (chat prompts through SmolLM2's template, temperature 0): ``copy`` (a ~277-token
passage with two small edits), ``json`` (a JSON record quoting its source), ``code`` (a
Python file with a function renamed), ``chat`` (open-ended: little to copy).

Paths, each decode tok/s = generated tokens / decode seconds (prompt excluded):

- llama.cpp: localrun with ``speculative`` off / auto / prompt-lookup (and a draft model),
  and llama.cpp's own ``llama-lookup`` and ``llama-speculative`` on the same rendered
  prompt (``-f``) and the same GGUF (``--spec-draft-n-max`` = localrun's draft length;
  ``--spec-draft-n-max 0`` is the tools' own plain decode, the baseline of their gain).
  The tools come from ~/.cache/localrun/llama-tools/<version>/bin (built from the vendored
  llama.cpp by the multi-turn helper's script); without them only localrun's rows print.
- OpenVINO GenAI: localrun with speculative prompt-lookup vs off, and the raw
  ``LLMPipeline(prompt_lookup=True)`` vs ``LLMPipeline`` on the same token ids.

    .venv/bin/python scripts/bench_speculative.py                       # every path
    .venv/bin/python scripts/bench_speculative.py --only llama --reps 3
    .venv/bin/python scripts/bench_speculative.py --json out.json

Targets: (a) prompt lookup on the F32 GGUF >= 1.5x and >= 85% of llama-lookup's gain;
OpenVINO's >= 1.3x or within 10% of the raw pipeline's gain; (b) draft model >= 90% of
llama-speculative's gain; (c) auto >= 0.97x of off where speculation loses (Q8_0, chat).
Prints the load average with the numbers. Not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PASSAGE = (
    "The old harbour town of Kestrel Bay sits where the river meets the sea, and for "
    "three hundred years its people have lived by the tides. Fishing boats leave before "
    "dawn and return in the late afternoon, their holds full of mackerel, cod and crab. "
    "Along the quay stand the warehouses, built of grey stone, where salt and rope and "
    "barrels were once stored; today most of them are cafes, galleries and small shops "
    "that sell hand-knitted jumpers to visitors. On the hill above the town is the "
    "church of Saint Brendan, whose bell has rung every evening at six o'clock since "
    "1782, except for one winter when the rope froze. The lighthouse on the northern "
    "point was built in 1851 and automated in 1987; its last keeper, Thomas Pell, still "
    "lives in the cottage at its foot and gives tours on Sundays. Every August the town "
    "holds a regatta, with rowing races across the bay, a parade of decorated boats and "
    "a supper of grilled fish on the beach that lasts until midnight. The railway "
    "arrived in 1879 and closed in 1964, but the old station building now houses a "
    "museum of local history, with photographs, nets, model ships and the logbooks of "
    "the harbour master going back to 1803."
)
CODE = '''import json
from pathlib import Path


def load_records(path):
    """Read one JSON record per line from path."""
    records = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if line:
                records.append(json.loads(line))
    return records


def total_by_key(records, key):
    """Sum the amount field of records, grouped by key."""
    totals = {}
    for record in records:
        name = record.get(key, "unknown")
        totals[name] = totals.get(name, 0) + record.get("amount", 0)
    return totals


def write_report(totals, out):
    """Write totals as sorted lines of name and amount."""
    lines = [f"{name}: {amount}" for name, amount in sorted(totals.items())]
    Path(out).write_text("\\n".join(lines) + "\\n", encoding="utf-8")


if __name__ == "__main__":
    recs = load_records("sales.jsonl")
    write_report(total_by_key(recs, "region"), "report.txt")
'''
WORKLOADS: dict[str, str] = {
    "copy": "Copy the following passage exactly, but write 'Kestrel Bay' as 'Kestrel "
            "Cove' and 'Thomas Pell' as 'Thomas Bell'. Output only the passage.\n\n"
            + PASSAGE,
    "json": "From the passage below, write one JSON object with the keys town, church, "
            "lighthouse_built, keeper, regatta_month, railway_opened, railway_closed and "
            "quote (the sentence about the lighthouse, copied word for word).\n\n" + PASSAGE,
    "code": "Rename the function total_by_key to totals_by_field everywhere in this file "
            "and output the whole file:\n\n" + CODE,
    "chat": "Write a short story about a fox who learns to play the violin.",
}
MAX_TOKENS = 256


def tools_bin() -> Path | None:
    from localrun.backends.installed import installed_version
    from localrun.backends.llama_cpp.facts import SPEC

    base = Path.home() / ".cache" / "localrun" / "llama-tools" / (installed_version(SPEC) or "")
    return base / "bin" if (base / ".done").exists() else None


def fixture(fmt: str) -> str:
    data = json.loads((Path.home() / ".cache/localrun/test-models/manifest.json").read_text())
    return str(data["models"][fmt])


def rendered(model: Any, prompt: str) -> tuple[str, int]:
    """The chat-templated prompt text localrun feeds, and its token count."""
    session = model._session
    p = session.encode_chat([{"role": "user", "content": prompt}])
    return p.text, len(p.tokens)


def localrun_rate(model: Any, prompt: str, mode: str, max_tokens: int) -> dict[str, Any]:
    c = model.chat(prompt, temperature=0.0, max_tokens=max_tokens, speculative=mode)
    t, n = c.timings, c.usage.completion_tokens
    decode_s = max(t.total - t.ttft, 1e-9)
    return {"tok_s": (n - 1) / decode_s, "tokens": n, "drafted": t.drafted_tokens,
            "accepted": t.accepted_tokens, "text": c.text}


_DECODED = re.compile(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds, speed:\s+([\d.]+) t/s")


def tool_rate(binary: Path, args: list[str]) -> dict[str, Any]:
    out = subprocess.run([str(binary), *args], capture_output=True, text=True, timeout=600)
    log = out.stdout + out.stderr
    m = _DECODED.search(log)
    if out.returncode != 0 or m is None:
        raise RuntimeError(f"{binary.name} failed ({out.returncode}): {log[-800:]}")
    drafted = re.search(r"n_drafted\s*=\s*(\d+)", log)
    accepted = re.search(r"n_accept\s*=\s*(\d+)", log)
    return {"tok_s": float(m.group(3)), "tokens": int(m.group(1)),
            "drafted": int(drafted.group(1)) if drafted else 0,
            "accepted": int(accepted.group(1)) if accepted else 0}


def median_of(runs: list[dict[str, Any]]) -> dict[str, Any]:
    best = sorted(runs, key=lambda r: r["tok_s"])[len(runs) // 2]
    return {**best, "runs": [round(r["tok_s"], 1) for r in runs]}


def bench_llama(args: argparse.Namespace, rows: list[dict[str, Any]]) -> None:
    import localrun
    from localrun.backends.speculative import DRAFT_MAX

    tools = tools_bin()
    threads = args.threads
    common = ["-t", str(threads), "-tb", str(threads), "-c", "4096", "-n",
              str(args.max_tokens), "--temp", "0", "--top-k", "1", "--seed", "1", "-fa", "auto"]
    for fmt in args.gguf:
        path = fixture(fmt)
        draft = fixture("gguf-q4_1") if fmt == "gguf-f32" else None
        model = localrun.load(path, backend="llama.cpp", context=4096, threads=threads,
                              draft_model=draft)
        modes = ["off", "auto", "prompt-lookup"] + (["draft"] if draft else [])
        for name in args.workloads:
            prompt = WORKLOADS[name]
            text, n_prompt = rendered(model, prompt)
            localrun_rate(model, prompt, "off", 16)  # warm
            results: dict[str, list[dict[str, Any]]] = {}
            for _ in range(args.reps):  # the paths alternate, rep by rep
                for mode in modes:
                    results.setdefault(f"localrun {mode}", []).append(
                        localrun_rate(model, prompt, mode, args.max_tokens))
                if tools is None:
                    continue
                with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
                    f.write(text)
                lookup = tools / "llama-lookup"
                base = ["-m", path, "-f", f.name, *common]
                results.setdefault("llama-lookup n-max 0 (plain)", []).append(
                    tool_rate(lookup, [*base, "--spec-draft-n-max", "0"]))
                results.setdefault(f"llama-lookup n-max {DRAFT_MAX}", []).append(
                    tool_rate(lookup, [*base, "--spec-draft-n-max", str(DRAFT_MAX)]))
                results.setdefault("llama-lookup n-max 3 (default)", []).append(
                    tool_rate(lookup, base))
                if draft:
                    results.setdefault("llama-speculative", []).append(tool_rate(
                        tools / "llama-speculative", [*base, "-md", draft,
                                                      "--spec-draft-n-max", "3"]))
                os.unlink(f.name)
            for path_name, runs in results.items():
                m = median_of(runs)
                rows.append({"engine": "llama.cpp", "file": Path(path).name, "workload": name,
                             "prompt_tokens": n_prompt, "path": path_name, **{
                                 k: v for k, v in m.items() if k != "text"}})
                print(f"  {Path(path).name} {name} {path_name}: {m['tok_s']:.1f} tok/s "
                      f"{m['accepted']}/{m['drafted']} {m['runs']}", flush=True)
            same = {r["text"] for k, v in results.items() if k.startswith("localrun")
                    for r in v}
            rows.append({"engine": "llama.cpp", "file": Path(path).name, "workload": name,
                         "note": f"{len(same)} distinct greedy replies over localrun's modes"})
        model.close()


def bench_openvino(args: argparse.Namespace, rows: list[dict[str, Any]]) -> None:
    import numpy as np
    import openvino
    import openvino_genai as og

    import localrun
    from localrun.backends.openvino.speculative import MAX_NGRAM_SIZE, NUM_ASSISTANT_TOKENS

    path = fixture("openvino-int4")
    props = {"INFERENCE_PRECISION_HINT": "f32", "INFERENCE_NUM_THREADS": args.threads}
    for name in args.workloads:
        prompt = WORKLOADS[name]
        results: dict[str, list[dict[str, Any]]] = {}
        for _ in range(args.reps):
            for mode in ("off", "prompt-lookup"):
                model = localrun.load(path, backend="openvino", threads=args.threads,
                                      speculative=None if mode == "off" else mode)
                localrun_rate(model, prompt, mode if mode == "off" else "auto", 16)
                results.setdefault(f"localrun {mode}", []).append(localrun_rate(
                    model, prompt, "auto", args.max_tokens))
                ids = model._session.encode_chat([{"role": "user", "content": prompt}]).tokens
                model.close()
                pipe = og.LLMPipeline(path, "CPU", **props,
                                      **({"prompt_lookup": True} if mode != "off" else {}))
                cfg = pipe.get_generation_config()
                cfg.max_new_tokens, cfg.do_sample = args.max_tokens, False
                if mode != "off":
                    cfg.num_assistant_tokens, cfg.max_ngram_size = \
                        NUM_ASSISTANT_TOKENS, MAX_NGRAM_SIZE
                arr = np.asarray([list(ids)], dtype=np.int64)
                inputs = og.TokenizedInputs(openvino.Tensor(arr),
                                            openvino.Tensor(np.ones_like(arr)))
                pipe.generate(inputs, cfg)  # warm
                t0 = time.perf_counter()
                res = pipe.generate(inputs, cfg)
                wall = time.perf_counter() - t0
                pm = res.perf_metrics
                n = int(pm.get_num_generated_tokens())
                ttft = float(pm.get_ttft().mean) / 1000
                results.setdefault(f"raw LLMPipeline {mode}", []).append(
                    {"tok_s": (n - 1) / max(wall - ttft, 1e-9), "tokens": n,
                     "drafted": 0, "accepted": 0})
                del pipe
        for path_name, runs in results.items():
            m = median_of(runs)
            print(f"  openvino {name} {path_name}: {m['tok_s']:.1f} tok/s {m['runs']}",
                  flush=True)
            rows.append({"engine": "openvino", "file": "openvino-int4", "workload": name,
                         "prompt_tokens": len(ids), "path": path_name,
                         **{k: v for k, v in m.items() if k != "text"}})


def print_table(rows: list[dict[str, Any]]) -> None:
    print(f"{'engine':9} {'file':34} {'workload':8} {'path':32} {'tok/s':>7} "
          f"{'vs off':>7} {'kept':>9}  runs")
    base: dict[tuple[str, str, str], float] = {}
    for r in rows:
        if "path" in r and r["path"] in ("localrun off", "llama-lookup n-max 0 (plain)",
                                         "raw LLMPipeline off"):
            base[(r["file"], r["workload"], r["path"].split()[0])] = r["tok_s"]
    for r in rows:
        if "note" in r:
            print(f"{r['engine']:9} {r['file']:34} {r['workload']:8} note: {r['note']}")
            continue
        family = r["path"].split()[0]
        b = base.get((r["file"], r["workload"], "llama-lookup" if family ==
                      "llama-speculative" else family))
        gain = f"{r['tok_s'] / b:.2f}x" if b else "-"
        kept = f"{r['accepted']}/{r['drafted']}" if r["drafted"] else "-"
        print(f"{r['engine']:9} {r['file']:34} {r['workload']:8} {r['path']:32} "
              f"{r['tok_s']:7.1f} {gain:>7} {kept:>9}  {r.get('runs')}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=("llama", "openvino"), default=None)
    ap.add_argument("--gguf", default="gguf-f32,gguf-q8_0",
                    help="fixtures (make_test_models.py keys), comma-separated")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=MAX_TOKENS)
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    args.gguf = [g for g in args.gguf.split(",") if g]
    args.workloads = [w for w in args.workloads.split(",") if w]
    load = os.getloadavg()
    print(f"command: {' '.join(sys.argv)}")
    print(f"load average at start: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; "
          f"{os.cpu_count()} CPUs; threads {args.threads}; tools: {tools_bin()}")
    rows: list[dict[str, Any]] = []
    if args.only in (None, "llama"):
        bench_llama(args, rows)
    if args.only in (None, "openvino"):
        bench_openvino(args, rows)
    print_table(rows)
    end = os.getloadavg()
    print(f"load average at end: {end[0]:.2f} {end[1]:.2f} {end[2]:.2f}")
    if args.json:
        args.json.write_text(json.dumps({"command": sys.argv, "load_start": load,
                                         "load_end": end, "rows": rows}, indent=1))
    print(f"medians of {args.reps} runs; decode tok/s excludes the prompt; 'vs off': over "
          "the same family's plain decode (localrun off, llama-lookup n-max 0, raw "
          "LLMPipeline off); kept: accepted/drafted tokens")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
