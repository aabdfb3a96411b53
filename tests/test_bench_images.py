"""scripts/bench_images.py: how it reads llama-mtmd-cli's timing lines, and that the CLI
it compares localrun with runs the same request (the same prompt tokens and greedy reply
on the vl-gguf fixture). The CLI is llama.cpp's own, built by
scripts/build_llama_tools.py into ~/.cache/localrun/llama-tools/<version>/bin."""

from __future__ import annotations

import glob
import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

import pytest

from tests.conftest import HAVE_LLAMA
from tests.imageutil import data_uri, png
from tests.models import test_model

ROOT = Path(__file__).resolve().parent.parent

#: llama-mtmd-cli's own lines (0.3.36's llama.cpp, ``-lv 4 --perf``), as it printed them
LOG = """\
0.00.464.599 W WARN: This is an experimental CLI for testing multimodal capability.
0.00.473.935 I encoding mtmd batch, n_chunks = 1 (done = 1, total = 3)
0.00.520.519 I mtmd batch encoding done in 47 ms
0.00.520.571 I decoding image batch 1/1, n_tokens_batch = 256
0.00.531.228 I image decoded (batch 1/1) in 11 ms
0.00.551.515 I llama_perf_context_print:        load time =     150.83 ms
0.00.551.518 I llama_perf_context_print: prompt eval time =      58.77 ms /   270 tokens (\
    0.22 ms per token,  4593.95 tokens per second)
0.00.551.519 I llama_perf_context_print:        eval time =      17.63 ms /    15 runs   (\
    1.18 ms per token,   850.63 tokens per second)
0.00.551.519 I llama_perf_context_print:       total time =     128.47 ms /   285 tokens
0.00.551.520 I llama_perf_context_print:    graphs reused =         15
"""


def _script() -> ModuleType:
    """scripts/ is no package: load the script as a module (once)."""
    if "bench_images" not in sys.modules:
        spec = importlib.util.spec_from_file_location("bench_images",
                                                      ROOT / "scripts" / "bench_images.py")
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules["bench_images"] = mod
        spec.loader.exec_module(mod)
    return sys.modules["bench_images"]


def test_mtmd_cli_timing_lines_are_read() -> None:
    """Before: the script kept the lines with "time" in them and read no number."""
    assert _script().mtmd_timings(LOG) == {
        "encode_ms": [47.0], "image_decode_ms": [11.0],
        "prompt_eval_ms": 58.77, "prompt_eval_tokens": 270,
        "eval_ms": 17.63, "eval_runs": 15, "total_ms": 128.47, "total_tokens": 285}
    assert _script().mtmd_timings("no timings here") == {"encode_ms": [],
                                                         "image_decode_ms": []}


def _cli() -> str:
    found = sorted(glob.glob(os.path.expanduser(
        "~/.cache/localrun/llama-tools/*/bin/llama-mtmd-cli")))
    if not found:
        pytest.skip("llama-mtmd-cli is not built (python scripts/build_llama_tools.py)")
    return found[-1]


@pytest.mark.skipif(not HAVE_LLAMA, reason="llama-cpp-python is not installed "
                    "(pip install -e '.[llama-cpp]')")
def test_mtmd_cli_runs_localruns_request_and_its_timings_are_read() -> None:
    """The CLI as the script runs it (``--jinja``: the GGUF's own template) answers the
    same prompt tokens with the same greedy reply as localrun, and every figure the
    comparison uses is read, a warm request's among them."""
    import localrun

    exe = _cli()
    pytest.importorskip("PIL", reason="Pillow is not installed")
    folder = test_model("vl-gguf")
    text, proj = folder / "Tiny-Qwen2.5-VL.F16.gguf", folder / "mmproj-Tiny-Qwen2.5-VL.F16.gguf"
    image = png(112, 84)
    with localrun.load(str(text), backend="llama.cpp", context=2048, threads=1) as m:
        want = m.chat([{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": data_uri(image)}},
            {"type": "text", "text": "Describe this."}]}], temperature=0, max_tokens=8,
            repetition_penalty=1.0)
    got = _script().mtmd_cli(exe, text, image, proj, 8, 1, 1)
    assert got["reply"] == want.text.strip()
    assert got["one_shot"]["prompt_eval_tokens"] == want.usage.prompt_tokens
    warm = got["warm"]
    assert warm is not None, got.get("why")
    assert warm["prompt_eval_tokens"] == want.usage.prompt_tokens
    assert warm["eval_runs"] == 7  # the first token comes from the prompt's logits
    assert warm["encode_ms"] > 0 and warm["prompt_eval_ms"] > 0 and warm["eval_ms"] > 0
