"""The kit's results: gpu_kit.json and gpu_kit.log, the closing table, the Markdown.

The JSON is rewritten after every step and each finished step's log is appended to the
log at once, so a run cut short (the device command's 600 s) still brings back what it
did. ``render_markdown`` turns the JSON into the tables docs/results/gpu.md keeps.
"""

from __future__ import annotations

import json
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from gpu_kit import spec
from gpu_kit.runner import OK, StepResult, overall_ok


def now_iso() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def parse_junit(path: Path) -> list[dict[str, Any]]:
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return []
    cases = []
    for tc in root.iter("testcase"):
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            el = tc.find(tag)
            if el is not None:
                outcome = {"failure": "failed", "error": "error"}.get(tag, "skipped")
                lines = (el.get("message") or el.text or "").strip().splitlines()
                message = lines[0][:300] if lines else ""
                break
        cls = tc.get("classname", "")
        cases.append({"id": f"{cls.replace('.', '/')}.py::{tc.get('name')}"
                      if cls.startswith("tests.") else f"{cls}::{tc.get('name')}",
                      "outcome": outcome, "seconds": round(float(tc.get("time") or 0), 3),
                      **({"message": message} if message else {})})
    return cases


def count_outcomes(cases: Sequence[dict[str, Any]]) -> dict[str, int]:
    out = {"passed": 0, "failed": 0, "error": 0, "skipped": 0}
    for c in cases:
        out[c["outcome"]] = out.get(c["outcome"], 0) + 1
    return out


# -- results -----------------------------------------------------------------------------

def cap_log(text: str, head: int = 100_000, tail: int = 400_000) -> str:
    if len(text) <= head + tail:
        return text
    return text[:head] + f"\n[... {len(text) - head - tail} characters left out ...]\n" + \
        text[-tail:]


class Report:
    """Writes gpu_kit.json after every step (a run cut short still leaves results) and
    appends each finished step's log to gpu_kit.log."""

    def __init__(self, out: Path, gpu: bool, budget_s: float, argv: Sequence[str]) -> None:
        self.out = out
        self.gpu = gpu
        self.budget_s = budget_s
        self.argv = list(argv)
        self.started = now_iso()
        self.t0 = time.monotonic()
        self.timeline: list[str] = []
        self.logged: set[str] = set()
        #: written as top-level keys: the machine's facts, the options, why it stopped
        self.extra: dict[str, Any] = {}
        #: the builds' ninja-log summaries, read again at every update
        self.builds: Callable[[], dict[str, Any]] = dict
        out.mkdir(parents=True, exist_ok=True)
        (out / spec.RESULT_LOG).write_text(
            f"localrun GPU kit, {'GPU run' if gpu else 'CPU rehearsal'}, {self.started}\n",
            encoding="utf-8")

    def echo(self, line: str) -> None:
        self.timeline.append(line)
        print(line, flush=True)

    def update(self, results: list[StepResult], finished: bool = False) -> None:
        for r in results:
            if r.name in self.logged or not r.log:
                continue
            self.logged.add(r.name)
            try:
                text = Path(r.log).read_text(encoding="utf-8", errors="replace")
            except OSError:
                text = ""
            with (self.out / spec.RESULT_LOG).open("a", encoding="utf-8") as fh:
                fh.write(f"\n\n######## {r.name}: {r.status} in {r.seconds:.1f} s "
                         f"(limit {r.limit_s:.0f} s)\n{cap_log(text)}")
        counts: dict[str, int] = {}
        for r in results:
            counts[r.status] = counts.get(r.status, 0) + 1
        try:
            builds = self.builds()
        except Exception as e:  # a reading only: the results must still be written
            builds = {"error": f"{type(e).__name__}: {e}"}
        data = {
            "kit_version": spec.KIT_VERSION,
            "mode": "gpu" if self.gpu else "rehearsal",
            "started": self.started,
            "finished": now_iso() if finished else None,
            "wall_s": round(time.monotonic() - self.t0, 1),
            "budget_s": self.budget_s,
            "argv": self.argv,
            "ok": overall_ok(results) if finished else None,
            "counts": counts,
            **self.extra,
            "builds": builds,
            "steps": [r.to_dict() for r in results],
            "timeline": self.timeline,
        }
        tmp = self.out / (spec.RESULT_JSON + ".tmp")
        tmp.write_text(json.dumps(data, indent=1, default=str) + "\n", encoding="utf-8")
        tmp.replace(self.out / spec.RESULT_JSON)


def table(results: Sequence[StepResult]) -> str:
    rows = [f"{'step':16} {'status':8} {'time':>8} {'limit':>6}  detail"]
    for r in results:
        t = f"{r.seconds:.1f}s" if r.started_at_s is not None else "-"
        lim = f"{r.limit_s:.0f}s" if r.limit_s else "-"
        rows.append(f"{r.name:16} {r.status:8} {t:>8} {lim:>6}  {r.detail[:110]}")
    return "\n".join(rows)


def render_markdown(data: dict[str, Any]) -> str:
    """gpu_kit.json as the tables docs/results/gpu.md keeps: steps, tests, numbers."""
    env: dict[str, Any] = next((s for s in data["steps"] if s["name"] == "env"),
                               {"facts": {}})
    f = env.get("facts", {})
    torch = f.get("torch") or {}
    out = [f"Run {data['started']} ({data['mode']}), {data['wall_s']} s of a "
           f"{data['budget_s']:.0f} s budget: **{'OK' if data.get('ok') else 'NOT OK'}** "
           f"({', '.join(f'{n} {k}' for k, n in sorted(data['counts'].items()))}).", "",
           f"Machine: {'; '.join(f.get('nvidia_smi') or ['no GPU'])}; torch "
           f"{torch.get('torch')} (CUDA {torch.get('torch_cuda')}); nvcc {f.get('nvcc')}; "
           f"{f.get('machine')}.", "", *machine_line(data.get("machine") or {}),
           "| step | status | time | limit | detail |", "|---|---|---|---|---|"]
    for s in data["steps"]:
        t = f"{s['seconds']:.1f} s" if s.get("started_at_s") is not None else "-"
        lim = f"{s['limit_s']:.0f} s" if s.get("limit_s") else "-"
        detail = s.get("detail", "").replace("|", "\\|")
        out.append(f"| {s['name']} | {s['status']}{' (optional)' if s.get('optional') else ''}"
                   f" | {t} | {lim} | {detail} |")
    tested = [s for s in data["steps"] if s.get("tests")]
    if tested:
        out += ["", "| test | outcome | time | message |", "|---|---|---|---|"]
        for s in tested:
            for c in s["tests"]["cases"]:
                msg = c.get("message", "").replace("|", "\\|")
                out.append(f"| `{c['id'].split('/')[-1]}` | {c['outcome']} | "
                           f"{c['seconds']:.2f} s | {msg} |")
    benches = [s for s in data["steps"] if s["name"].startswith("bench_") and s["status"] == OK]
    if benches:
        out += ["", "| engine | version | quant | device | load | TTFT | prefill | decode | VRAM |",
                "|---|---|---|---|---|---|---|---|---|"]
        for s in benches:
            b = s["facts"]
            out.append(f"| {b.get('backend')} | {b.get('engine_version')} | "
                       f"{b.get('quantization')} | {b.get('device')} | {b.get('load_s')} s | "
                       f"{b.get('ttft_ms')} ms | {b.get('prefill_tps')} tok/s | "
                       f"{b.get('decode_tps')} tok/s | {b.get('vram_mib', '-')} MiB |")
    out += builds_table(data.get("builds") or {})
    return "\n".join(out) + "\n"


def machine_line(m: dict[str, Any]) -> list[str]:
    if not m:
        return []
    ag = m.get("sched_autogroup_enabled")
    return [f"CPU: {m.get('cpu_model')}, {m.get('cores')} cores ({m.get('cores_allowed')} "
            f"allowed); kernel {m.get('kernel')}; autogroup "
            f"{'on' if ag else 'off' if ag is False else 'absent'}; driver {m.get('driver')} "
            f"(CUDA {m.get('driver_cuda')}); nvcc {m.get('nvcc')}.", ""]


def builds_table(builds: dict[str, Any]) -> list[str]:
    """Per build: units, core-seconds, wall span, parallelism, per kind, slowest units."""
    rows = [(n, b) for n, b in builds.items() if isinstance(b, dict) and "units" in b]
    if not rows:
        return []
    out = ["", "| build | units | core-s | wall | parallel | per kind (units, mean s) | "
           "slowest |", "|---|---|---|---|---|---|---|"]
    for name, b in rows:
        kinds = ", ".join(f"{k} {v['units']}×{v['mean_s']}" for k, v in b["by_kind"].items())
        slow = ", ".join(f"{n} {s}" for n, s in b["slowest"][:3])
        out.append(f"| {name} | {b['units']} | {b['core_s']} | {b.get('wall_s', '-')} s | "
                   f"{b.get('parallelism', '-')} | {kinds} | {slow} |")
    return out
