"""An image request through localrun against the engine's own path, same fixture, image,
prompt, token count and engine settings (issue 32's bench).

- llama.cpp: localrun's mtmd path against llama-cpp-python's own ``MTMDChatHandler``
  (wall and CPU time of a whole request), and against ``llama-mtmd-cli`` (llama.cpp's
  own tool, where ~/.cache/localrun/llama-tools/<version>/bin holds it) phase by phase:
  image encode, prompt eval (text and the image's embeddings) and eval, each side's own
  counters (localrun: llama.cpp's perf counters, reset before each request, and mtmd's
  encode time; the CLI's ``-lv 4 --perf`` lines, read by :func:`mtmd_timings`). A
  request by those counters is prompt eval + eval; prompt eval spans the image's
  encode on both sides (llama.cpp times from a prompt's first decode to its first read
  of logits, and mtmd encodes the image in between). The CLI loads the model in every
  process, so its figures are a request's on a context that ran before: a chat-mode
  process's totals less those of one that ran only its first turn (:func:`mtmd_cli`).
  ``--jinja`` makes it render the GGUF's own chat template (with its system prompt), as
  localrun does: the same 281 prompt tokens and the same greedy reply.
- OpenVINO GenAI: localrun against the raw ``VLMPipeline`` loaded with the same
  properties (``INFERENCE_NUM_THREADS`` only: precision and KV cache at the engine's
  defaults on both sides), the same ``GenerationConfig`` (greedy, the same max tokens and
  stop ids), and the same work per request: both decode the image from the same data URI
  (base64, then PNG with Pillow) inside the timed request. localrun streams every
  reply internally (a Python streamer detokenizes each token); the raw call without a
  streamer decodes once at the end, so the raw call with OpenVINO GenAI's own
  ``TextStreamer`` is measured too (``raw_streaming``).

The two paths alternate, so drift on a busy machine hits both; it prints per engine the
median wall time and CPU time (every thread of the process: steadier than wall time on a
shared machine) of a whole greedy request both ways and their ratios, and the load
average (a shared machine: say so with the numbers).

    .venv/bin/python scripts/bench_images.py --runs 7 --tokens 16 --size 448 --json out.json
"""

from __future__ import annotations

import argparse
import base64
import glob
import io
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.imageutil import data_uri, png
from tests.models import test_model

TEXT = "Describe this."


class Timer:
    """Wall and CPU (process) seconds of each call, and what ``after`` reads after it."""

    def __init__(self, after: Callable[[], dict[str, float]] | None = None) -> None:
        self.wall: list[float] = []
        self.cpu: list[float] = []
        self.after = after
        self.extra: dict[str, list[float]] = {}

    def __call__(self, fn: Callable[[], Any]) -> Any:
        t, c = time.perf_counter(), time.process_time()
        out = fn()
        self.cpu.append(time.process_time() - c)
        self.wall.append(time.perf_counter() - t)
        for k, v in (self.after() if self.after else {}).items():
            self.extra.setdefault(k, []).append(v)
        return out

    def summary(self) -> dict[str, float]:
        out = {"wall_s": statistics.median(self.wall), "cpu_s": statistics.median(self.cpu)}
        out.update({k: statistics.median(v) for k, v in self.extra.items()})
        return out


def compare(ours: Timer, raw: Timer) -> dict[str, Any]:
    a, b = ours.summary(), raw.summary()
    return {"localrun": a, "raw": b, "ratio": a["wall_s"] / b["wall_s"],
            "cpu_ratio": a["cpu_s"] / b["cpu_s"]}


def bench_llama(image: bytes, tokens: int, runs: int, threads: int) -> dict[str, Any]:
    import llama_cpp
    from llama_cpp import Llama
    from llama_cpp.llama_chat_format import MTMDChatHandler

    import localrun

    folder = test_model("vl-gguf")
    text, proj = folder / "Tiny-Qwen2.5-VL.F16.gguf", folder / "mmproj-Tiny-Qwen2.5-VL.F16.gguf"
    msgs = [{"role": "user", "content": [{"type": "image_url", "image_url": {
        "url": data_uri(image)}}, {"type": "text", "text": TEXT}]}]
    model = localrun.load(str(text), backend="llama.cpp", context=2048, threads=threads)
    llm = Llama(str(text), chat_handler=MTMDChatHandler(clip_model_path=str(proj),
                                                          verbose=False),
                n_ctx=2048, n_threads=threads, n_threads_batch=threads, verbose=False, seed=0)
    session = model._session
    ctx = session.engine.llm._ctx.ctx

    def counters() -> dict[str, float]:  # localrun's request, by llama.cpp's own counters
        perf = llama_cpp.llama_perf_context(ctx)
        llama_cpp.llama_perf_context_reset(ctx)
        return {"encode_ms": session.image_encode_seconds * 1000,
                "prompt_eval_ms": perf.t_p_eval_ms, "eval_ms": perf.t_eval_ms,
                "prompt_eval_tokens": perf.n_p_eval, "eval_runs": perf.n_eval}

    ours, raw = Timer(counters), Timer()
    replies: dict[str, str] = {}
    try:
        def lr() -> None:
            replies["localrun"] = model.chat(msgs, temperature=0, max_tokens=tokens,
                                             repetition_penalty=1.0).text

        def rw() -> None:
            llm.reset()
            r = llm.create_chat_completion(msgs, temperature=0.0, max_tokens=tokens)  # type: ignore[arg-type]
            replies["raw"] = r["choices"][0]["message"]["content"] or ""  # type: ignore[index]

        lr(), rw()  # warm-up
        llama_cpp.llama_perf_context_reset(ctx)
        for _ in range(runs):
            ours(lr)
            raw(rw)
    finally:
        llm.close()
        model.close()
    out: dict[str, Any] = {
        "engine": "llama.cpp", "raw_path": "llama-cpp-python MTMDChatHandler",
        **compare(ours, raw), "same_reply": replies["localrun"] == replies["raw"],
        "reply": replies["localrun"]}
    cli = sorted(glob.glob(os.path.expanduser("~/.cache/localrun/llama-tools/*/bin/"
                                              "llama-mtmd-cli")))
    if not cli:
        out["mtmd_cli"] = "not found under ~/.cache/localrun/llama-tools/*/bin"
        return out
    mine = ours.summary()
    cli_out = mtmd_cli(cli[-1], text, image, proj, tokens, threads, runs)
    out["mtmd_cli"] = cli_out
    warm = cli_out.get("warm")
    if warm:
        # prompt eval spans the image's encode on both sides: llama.cpp times from a
        # prompt's first decode to the first read of logits, and the encode runs between
        ours_ms = mine["prompt_eval_ms"] + mine["eval_ms"]
        cli_ms = warm["prompt_eval_ms"] + warm["eval_ms"]
        out["vs_mtmd_cli"] = {
            "localrun_ms": {k: mine[k] for k in ("encode_ms", "prompt_eval_ms", "eval_ms",
                                                 "prompt_eval_tokens", "eval_runs")},
            "mtmd_cli_ms": warm, "localrun_request_ms": ours_ms,
            "mtmd_cli_request_ms": cli_ms, "ratio": ours_ms / cli_ms,
            "localrun_wall_ms": mine["wall_s"] * 1000,
            "same_reply": cli_out.get("reply", "").strip() == replies["localrun"].strip()}
    return out


# -- llama-mtmd-cli ---------------------------------------------------------------------

#: llama-mtmd-cli's timing lines (-lv 4 --perf; each line after a log prefix)
_ENCODE = re.compile(r"mtmd batch encoding done in (\d+(?:\.\d+)?) ms")
_IMAGE_DECODE = re.compile(r"image decoded \(batch \d+/\d+\) in (\d+(?:\.\d+)?) ms")
_PROMPT = re.compile(r"prompt eval time =\s*([\d.]+) ms /\s*(\d+) tokens")
_EVAL = re.compile(r"(?<!prompt )eval time =\s*([\d.]+) ms /\s*(\d+) runs")
_TOTAL = re.compile(r"total time =\s*([\d.]+) ms /\s*(\d+) tokens")


def mtmd_timings(log: str) -> dict[str, Any]:
    """What one llama-mtmd-cli process reports (run with ``-lv 4 --perf``): each image's
    encode and decode-into-the-context milliseconds, in order, and the context's totals
    (prompt eval, eval, total: milliseconds and tokens). Fields it did not print are
    left out."""
    out: dict[str, Any] = {
        "encode_ms": [float(m) for m in _ENCODE.findall(log)],
        "image_decode_ms": [float(m) for m in _IMAGE_DECODE.findall(log)]}
    for key, rx, unit in (("prompt_eval", _PROMPT, "tokens"), ("eval", _EVAL, "runs"),
                          ("total", _TOTAL, "tokens")):
        m = rx.search(log)
        if m:
            out[f"{key}_ms"], out[f"{key}_{unit}"] = float(m.group(1)), int(m.group(2))
    return out


def mtmd_cli(exe: str, text: Path, image: bytes, proj: Path, tokens: int, threads: int,
             runs: int) -> dict[str, Any]:
    """llama-mtmd-cli on the same fixture, image and prompt (``--jinja``: the GGUF's own
    chat template, as localrun renders it): one one-shot process (its reply, and its
    figures as a fresh process has them), then ``runs`` pairs of chat-mode processes:
    one answers the prompt without the image, the other that and then (``/clear``
    between) the prompt with the image; the second's totals less the first's are one
    image request on a context that has run before, and its encode line that request's
    encode. The text turn first, not an image turn: this build's chat mode aborts on an
    image turn after an image turn ("invalid chunk type", mtmd.cpp:2355, or an assert at
    mtmd.cpp:2170: it looks the new image up in the previous turn's freed batch)."""
    base = [exe, "-m", str(text), "--mmproj", str(proj), "-n", str(tokens), "--temp", "0",
            "-t", str(threads), "-c", "2048", "--jinja", "--perf", "-lv", "4"]

    def run(args: list[str], stdin: str | None = None) -> tuple[str, str]:
        r = subprocess.run(base + args, input=stdin, capture_output=True, text=True,
                           errors="replace", timeout=300)
        if r.returncode != 0:
            raise RuntimeError(f"llama-mtmd-cli exited {r.returncode}: {r.stderr[-400:]}")
        return r.stdout, r.stderr

    with tempfile.TemporaryDirectory() as d:
        f = Path(d) / "img.png"
        f.write_bytes(image)
        stdout, log = run(["--image", str(f), "-p", TEXT])
        text_turn, image_turn = f"{TEXT}\n/clear\n", f"/image {f}\n{TEXT}\n/clear\n"
        pairs = [(mtmd_timings(run([], text_turn)[1]),
                  mtmd_timings(run([], text_turn + image_turn)[1])) for _ in range(runs)]
    out: dict[str, Any] = {"exe": exe, "reply": stdout.strip(), "one_shot": mtmd_timings(log),
                           "chat_pair": pairs[0]}
    keys = ("prompt_eval_ms", "eval_ms", "prompt_eval_tokens", "eval_runs")
    whole = [(a, b) for a, b in pairs if all(k in a and k in b for k in keys)
             and len(b["encode_ms"]) == len(b["image_decode_ms"]) == 1]
    out["incomplete_pairs"] = [p for p in pairs if p not in whole]  # kept, to look at
    pairs = whole
    if not pairs:
        out["warm"] = None
        out["why"] = "its output lacked the timing lines (see one_shot, incomplete_pairs)"
        return out
    # The first turn's last token is decoded but its time is read (synchronized) only
    # with the next prompt's: the second turn's prompt eval holds it; one decode of one
    # token (the first turn's eval time per run) comes off, as the token does.
    warm = {k: statistics.median(b[k] - a[k] for a, b in pairs) for k in keys}
    warm["prompt_eval_ms"] -= statistics.median(a["eval_ms"] / a["eval_runs"]
                                                for a, _ in pairs)
    warm["prompt_eval_tokens"] -= 1
    out["warm"] = {"encode_ms": statistics.median(b["encode_ms"][0] for _, b in pairs),
                   "image_decode_ms": statistics.median(b["image_decode_ms"][0]
                                                        for _, b in pairs),
                   **warm, "requests": len(pairs)}
    return out


def bench_openvino(image: bytes, tokens: int, runs: int, threads: int) -> dict[str, Any]:
    import numpy as np
    import openvino as ov
    import openvino_genai
    from PIL import Image as PILImage

    import localrun

    folder = test_model("vl-openvino")
    uri = data_uri(image)
    msgs = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": uri}},
                                         {"type": "text", "text": TEXT}]}]
    props = {"INFERENCE_NUM_THREADS": threads}  # both sides; nothing else (the docstring)
    model = localrun.load(str(folder), backend="openvino", context=2048, threads=threads)
    session = model._session
    pipe = openvino_genai.VLMPipeline(str(folder), "CPU", **props)
    cfg = pipe.get_generation_config()  # the model's own, as localrun's: greedy, its stops
    cfg.max_new_tokens = tokens
    cfg.do_sample = False
    cfg.repetition_penalty = 1.0
    cfg.stop_token_ids = set(session._eos)

    def metrics(pm: Any) -> dict[str, float]:
        return {"encode_ms": float(pm.get_prepare_embeddings_duration().mean),
                "ttft_ms": float(pm.get_ttft().mean), "tpot_ms": float(pm.get_tpot().mean),
                "prompt_tokens": int(pm.get_num_input_tokens()),
                "generated_tokens": int(pm.get_num_generated_tokens())}

    last: dict[str, Any] = {}
    ours = Timer(lambda: metrics(session.last_perf))
    raw = Timer(lambda: metrics(last["raw"].perf_metrics))
    raw_streaming = Timer(lambda: metrics(last["raw"].perf_metrics))
    replies: dict[str, str] = {}
    try:
        def lr() -> None:
            replies["localrun"] = model.chat(msgs, temperature=0, max_tokens=tokens,
                                             repetition_penalty=1.0).text

        def rw(streaming: bool = False) -> None:  # a raw caller, from the same data URI
            data = base64.b64decode(uri.partition(",")[2], validate=True)
            rgb = np.asarray(PILImage.open(io.BytesIO(data)).convert("RGB"))[None]
            pieces: list[str] = []
            streamer = openvino_genai.TextStreamer(session._tok, lambda p: (
                pieces.append(p), openvino_genai.StreamingStatus.RUNNING)[1]) \
                if streaming else None
            last["raw"] = r = pipe.generate(TEXT, images=[ov.Tensor(rgb)],
                                            generation_config=cfg, streamer=streamer)
            replies["raw_streaming" if streaming else "raw"] = "".join(pieces) \
                if streaming else r.texts[0]

        lr(), rw(), rw(True)
        for _ in range(runs):
            ours(lr)
            raw(rw)
            raw_streaming(lambda: rw(True))
    finally:
        model.close()
    return {"engine": "openvino", "raw_path": "openvino_genai.VLMPipeline.generate",
            "properties": props, **compare(ours, raw),
            "raw_streaming": {**raw_streaming.summary(), "ratio": ours.summary()["wall_s"]
                              / raw_streaming.summary()["wall_s"],
                              "cpu_ratio": ours.summary()["cpu_s"]
                              / raw_streaming.summary()["cpu_s"]},
            "same_reply": replies["localrun"] == replies["raw"] == replies["raw_streaming"],
            "reply": replies["localrun"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--size", type=int, default=448, help="the square image's side")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--engine", choices=("llama.cpp", "openvino", "all"), default="all")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    image = png(a.size, a.size)
    results: list[dict[str, Any]] = []
    load0 = os.getloadavg()
    if a.engine in ("llama.cpp", "all"):
        results.append({**bench_llama(image, a.tokens, a.runs, a.threads),
                        "loadavg_after": os.getloadavg()})
    if a.engine in ("openvino", "all"):
        results.append({**bench_openvino(image, a.tokens, a.runs, a.threads),
                        "loadavg_after": os.getloadavg()})
    report = {"image": f"{a.size}x{a.size} PNG", "tokens": a.tokens, "runs": a.runs,
              "threads": a.threads, "loadavg_start": load0, "loadavg_end": os.getloadavg(),
              "results": results}
    out = io.StringIO()
    json.dump(report, out, indent=2)
    print(out.getvalue())
    if a.json:
        a.json.write_text(out.getvalue() + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
