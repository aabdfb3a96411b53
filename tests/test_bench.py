"""localrun bench: statistics with known answers, a real tiny bench, the JSON schema, the CLI."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from localrun.bench import (
    SCHEMA_VERSION,
    BenchConfig,
    BenchReport,
    RequestSample,
    Summary,
    config_parameters,
    exact_prompt,
    gguf_facts,
    overlapped,
    parse_int_list,
    percentile,
    roofline_share,
    summarize_workload,
    tokens_per_second,
    tpot,
)
from localrun.errors import BenchError
from tests.conftest import ROOT, localrun_cmd, requires_llama

DOCS = ROOT / "docs" / "bench.md"

# -- statistics on synthetic timings ----------------------------------------------------


def test_percentile_known_answers() -> None:
    assert percentile([4, 1, 3, 2], 50) == 2.5  # unsorted input, interpolated
    assert percentile([1, 2, 3, 4], 0) == 1 and percentile([1, 2, 3, 4], 100) == 4
    hundred = [float(i) for i in range(1, 101)]
    assert percentile(hundred, 95) == pytest.approx(95.05)
    assert percentile(hundred, 99) == pytest.approx(99.01)
    assert percentile([7.0], 99) == 7.0
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_summary() -> None:
    s = Summary.of([0.3, 0.1, 0.2, 0.4])
    assert (s.n, s.min, s.max) == (4, 0.1, 0.4)
    assert s.mean == pytest.approx(0.25) and s.p50 == pytest.approx(0.25)
    assert s.p95 == pytest.approx(0.385) and s.p99 == pytest.approx(0.397)
    assert s.p50 <= s.p95 <= s.p99 <= s.max


def test_tpot_and_rates() -> None:
    # 10 tokens: first at 0.1 s, last at 1.0 s -> 9 intervals of 0.1 s
    assert tpot(1.0, 0.1, 10) == pytest.approx(0.1)
    assert tpot(1.0, 0.1, 1) is None and tpot(1.0, 0.1, 0) is None
    assert tokens_per_second(128, 2.0) == 64.0
    assert tokens_per_second(5, 0.0) == 0.0
    # 1 GB of weights at 10 tokens/s reads 10 GB/s: half of a 20 GB/s roofline
    assert roofline_share(10**9, 10.0, 20e9) == pytest.approx(0.5)
    assert roofline_share(None, 10.0, 20e9) is None


def _sample(ttft: float, e2e: float, n: int, *, prompt: int = 16, start: float = 0.0,
            service_ttft: float | None = None) -> RequestSample:
    return RequestSample(prompt, n, ttft, e2e, tpot(e2e, ttft, n),
                         service_ttft if service_ttft is not None else ttft, 0.0, 0.0,
                         "length" if n == 8 else "stop", start)


def test_summarize_workload_known_answers() -> None:
    samples = [_sample(0.1, 0.8, 8), _sample(0.2, 0.9, 8), _sample(0.3, 0.5, 3)]
    w = summarize_workload(samples, prompt_tokens=16, gen_tokens=8, concurrency=1,
                           wall_s=2.0, mode="stream", weight_bytes=10**8,
                           bandwidth_bytes_per_s=1e10)
    assert w.requests == 3 and w.ttft.p50 == pytest.approx(0.2)
    assert w.e2e.max == pytest.approx(0.9)
    assert w.tpot is not None and w.tpot.p50 == pytest.approx(0.1)  # 0.7/7, 0.7/7, 0.2/2
    assert w.decode_tokens_per_s == pytest.approx(10.0)
    assert w.prefill_tokens_per_s == pytest.approx(16 / 0.2)  # median of 160, 80, 53.3
    assert w.requests_per_s == pytest.approx(1.5)
    assert w.output_tokens_per_s == pytest.approx(19 / 2.0)
    assert (w.output_tokens_min, w.output_tokens_max, w.short_requests) == (3, 8, 1)
    assert w.prompt_tokens_exact
    assert w.roofline_share == pytest.approx(10**8 * 10.0 / 1e10)
    off = summarize_workload([_sample(0.1, 0.5, 8, prompt=17)], prompt_tokens=16,
                             gen_tokens=8, concurrency=1, wall_s=0.5, mode="stream")
    assert not off.prompt_tokens_exact and off.roofline_share is None


def test_overlap_tells_batched_from_queued() -> None:
    queued = [_sample(0.1, 1.0, 8, start=0.0), _sample(1.1, 2.0, 8, start=1.0)]
    batched = [_sample(0.1, 1.0, 8, start=0.0), _sample(0.2, 1.1, 8, start=0.05)]
    assert not overlapped(queued)
    assert overlapped(batched)


# -- prompts exact in tokens -------------------------------------------------------------


def test_exact_prompt_with_a_known_tokenizer() -> None:
    def count(text: str) -> int:  # BOS + one token per word or punctuation mark
        return 1 + len(re.findall(r"\w+|[^\w\s]", text))

    for n in (1, 2, 5, 64, 300):
        text = exact_prompt(count, n, seed=3)
        assert count(text) == n
    assert exact_prompt(count, 32, seed=1) != exact_prompt(count, 32, seed=2)
    shared = exact_prompt(count, 20, seed=1, head="alpha beta gamma")
    assert shared.startswith("alpha beta gamma ") and count(shared) == 20


def test_exact_prompt_refuses_what_it_cannot_build() -> None:
    def two_per_word(text: str) -> int:
        return 2 * len(text.split())

    with pytest.raises(BenchError, match="exactly 7 tokens"):
        exact_prompt(two_per_word, 7, seed=0)
    with pytest.raises(BenchError, match="shortest"):
        exact_prompt(lambda t: 5 + len(t.split()), 3, seed=0)


@requires_llama
def test_exact_prompt_real_tokenizer(llama_model: Any) -> None:
    for n in (1, 16, 100, 700):
        text = exact_prompt(llama_model.count_tokens, n, seed=n)
        assert llama_model.count_tokens(text) == n
        c = llama_model.complete(text, max_tokens=1, temperature=0)
        assert c.usage.prompt_tokens == n


# -- flags and model facts --------------------------------------------------------------


def test_parse_int_list() -> None:
    assert parse_int_list("128, 512,2048", "--prompt-tokens") == (128, 512, 2048)
    assert parse_int_list("4,1,4", "--concurrency") == (4, 1)
    for bad in ("", "12x", "0", "1,,2", "-3"):
        with pytest.raises(BenchError, match="--concurrency"):
            parse_int_list(bad, "--concurrency")


def test_config_validation() -> None:
    BenchConfig().validate()
    for bad in (BenchConfig(runs=0), BenchConfig(gen_tokens=0), BenchConfig(warmup=-1),
                BenchConfig(concurrency=()), BenchConfig(models=()),
                BenchConfig(prompt_tokens=(0,))):
        with pytest.raises(BenchError):
            bad.validate()


SMOLLM2_CONFIG = {"hidden_size": 576, "num_hidden_layers": 30, "vocab_size": 49152,
                  "intermediate_size": 1536, "num_attention_heads": 9,
                  "num_key_value_heads": 3, "tie_word_embeddings": True,
                  "model_type": "llama"}


def test_parameter_count_two_ways(default_gguf: Path) -> None:
    # The GGUF tensor table and the config.json formula agree on SmolLM2-135M.
    params, group = gguf_facts(str(default_gguf))
    assert params == config_parameters(SMOLLM2_CONFIG) == 134_515_008
    assert group == 32  # Q4_1 blocks
    assert config_parameters({"hidden_size": 8}) is None


# -- a real tiny bench -----------------------------------------------------------------

TINY = BenchConfig(models=("smollm2:135m",), backend="all", prompt_tokens=(16,),
                   gen_tokens=8, concurrency=(1, 2), runs=2, warmup=1, shared_prefix=True,
                   bandwidth_bytes=64 * 2**20)


@pytest.fixture(scope="module")
def tiny_report() -> Iterator[BenchReport]:
    if importlib.util.find_spec("llama_cpp") is None:
        pytest.skip("llama-cpp-python is not installed (pip install -e '.[llama-cpp]')")
    from localrun.bench import run_bench

    messages: list[str] = []
    report = run_bench(TINY, progress=messages.append)
    assert any("concurrency 2" in m for m in messages)
    yield report


def _summary_ok(s: dict[str, Any], n: int) -> None:
    assert s["n"] == n
    assert 0 < s["min"] <= s["p50"] <= s["p95"] <= s["p99"] <= s["max"]


@pytest.mark.slow
def test_tiny_bench_every_field(tiny_report: BenchReport) -> None:
    d = json.loads(json.dumps(tiny_report.to_dict()))  # JSON-serializable as is
    assert d["schema_version"] == SCHEMA_VERSION
    assert re.match(r"\d{4}-\d\d-\d\dT", d["date"]) and d["localrun_version"]
    host = d["host"]
    assert host["os"] and host["cpu_model"] and host["usable_cores"] >= 1
    assert host["ram_total_bytes"] > 0 and isinstance(host["gpus"], list)
    assert d["bandwidth"]["read_gb_per_s"] > 0 and d["bandwidth"]["copy_gb_per_s"] > 0
    assert d["workload"]["prompt_tokens"] == [16] and d["workload"]["concurrency"] == [1, 2]
    assert d["skipped"] == []
    [run] = d["results"]
    m = run["model"]
    assert (m["backend"], m["format"], m["quantization"]) == ("llama.cpp", "gguf", "Q4_1")
    assert m["architecture"] == "llama" and m["parameters"] == 134_515_008
    assert m["group_size"] == 32 and m["weight_bytes"] > 50 * 2**20
    assert m["engine_version"] and m["context_length"] >= 16 + 8 and m["load_s"] > 0
    mem = run["memory"]
    assert mem["peak_rss_bytes"] >= mem["rss_after_load_bytes"] > 0
    assert mem["peak_rss_scope"] in ("model", "process")
    assert mem["vram_bytes"] is None or mem["vram_bytes"] >= 0
    w1, w2 = run["workloads"]
    assert (w1["concurrency"], w1["requests"], w1["mode"]) == (1, 2, "stream")
    # llama.cpp decodes concurrent requests together in one context (README: "Engines
    # that batch (llama.cpp, several sequences in one context; ...)")
    assert (w2["concurrency"], w2["requests"], w2["mode"]) == (2, 4, "batched")
    for w, n in ((w1, 2), (w2, 4)):
        assert w["prompt_tokens_exact"] and w["prompt_tokens"] == 16
        _summary_ok(w["ttft"], n)
        _summary_ok(w["e2e"], n)
        assert w["ttft"]["p50"] < w["e2e"]["p50"]
        assert 1 <= w["output_tokens_min"] <= w["output_tokens_max"] <= 8
        assert w["requests_per_s"] > 0 and w["output_tokens_per_s"] > 0
        assert w["prefill_tokens_per_s"] > 0
        assert w["reported_prefill_tokens_per_s"] > 0
        if w["output_tokens_max"] >= 2:
            assert w["decode_tokens_per_s"] > 0 and w["roofline_share"] > 0
            assert w["reported_decode_tokens_per_s"] > 0
        assert len(w["samples"]) == n
        for s in w["samples"]:
            assert s["prompt_tokens"] == 16 and s["ttft_s"] <= s["e2e_s"]
    [pc] = run["prefix_cache"]
    assert pc["prompt_tokens"] == 16 and 0 < pc["shared_prefix_tokens"] < 16
    # the cold side is the concurrency-1 workload itself; the gain is cold / warm p50
    assert pc["cold_ttft"] == w1["ttft"] and pc["warm_ttft"]["n"] == 2
    _summary_ok(pc["warm_ttft"], 2)
    assert pc["ttft_gain"] == pytest.approx(pc["cold_ttft"]["p50"] / pc["warm_ttft"]["p50"])


@requires_llama
@pytest.mark.slow
def test_prefix_cache_gain_is_real_on_llama_cpp() -> None:
    """llama.cpp keeps the previous prompt's KV cache and evaluates only the new tail:
    with 224 of 256 prompt tokens shared, TTFT drops several-fold."""
    from localrun.bench import run_bench

    report = run_bench(BenchConfig(models=("smollm2:135m",), backend="llama.cpp",
                                   prompt_tokens=(256,), gen_tokens=2, concurrency=(1,),
                                   runs=2, warmup=0, shared_prefix=True,
                                   bandwidth_bytes=16 * 2**20))
    [pc] = report.to_dict()["results"][0]["prefix_cache"]
    assert (pc["prompt_tokens"], pc["shared_prefix_tokens"]) == (256, 224)
    assert pc["warm_ttft"]["p50"] < pc["cold_ttft"]["p50"]
    assert pc["ttft_gain"] > 1.5, pc


#: README: "Engines that batch (llama.cpp, ...; OpenVINO GenAI's continuous batching;
#: MLX's BatchGenerator; ...) run up to --concurrency sequences at once; ONNX Runtime
#: GenAI runs them in turn." (llama.cpp: test_tiny_bench_every_field)
MODES = (("openvino", "openvino-int4", "batched"), ("onnx", "onnx-int4", "queued"),
         ("mlx", "mlx-4bit", "batched"))


@pytest.mark.slow
@pytest.mark.parametrize(("backend", "fixture", "mode"), MODES, ids=[m[0] for m in MODES])
def test_concurrency_mode_by_engine(backend: str, fixture: str, mode: str) -> None:
    from localrun.backends import BACKENDS, is_installed
    from localrun.bench import run_bench
    from tests.models import test_model

    if not is_installed(backend):
        pytest.skip(f"{BACKENDS[backend].title} is not installed "
                    f"(pip install -e '.[{BACKENDS[backend].extra}]')")
    report = run_bench(BenchConfig(models=(str(test_model(fixture)),), backend=backend,
                                   prompt_tokens=(16,), gen_tokens=4, concurrency=(2,),
                                   runs=1, warmup=0, bandwidth_bytes=16 * 2**20))
    [w] = report.to_dict()["results"][0]["workloads"]
    assert (w["concurrency"], w["requests"], w["mode"]) == (2, 2, mode)


def _documented_fields() -> set[str]:
    return set(re.findall(r"^\|\s*`([a-z0-9_]+)`", DOCS.read_text(encoding="utf-8"), re.M))


def _keys(value: Any) -> set[str]:
    out: set[str] = set()
    if isinstance(value, dict):
        for k, v in value.items():
            out.add(k)
            out |= _keys(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            out |= _keys(v)
    return out


@pytest.mark.slow
def test_json_schema_is_documented(tiny_report: BenchReport) -> None:
    """Every field the report has is in docs/bench.md's schema, and nothing else is."""
    from dataclasses import fields

    from localrun.bench import Skipped
    from localrun.bench.report import ImageResult

    keys = _keys(tiny_report.to_dict())
    # Item fields of lists that are empty on this host (no GPU, nothing skipped) or in
    # this run (no --image):
    keys |= {f.name for f in fields(Skipped)} | {"name", "vendor", "memory_total_bytes"}
    keys |= {f.name for f in fields(ImageResult)}
    documented = _documented_fields()
    assert keys - documented == set(), "fields missing from docs/bench.md"
    assert documented - keys == set(), "docs/bench.md documents fields the report lacks"
    assert f"schema_version` | {SCHEMA_VERSION}" in DOCS.read_text(encoding="utf-8")


@pytest.mark.slow
def test_plot_is_self_contained_html(tiny_report: BenchReport, tmp_path: Path) -> None:
    from localrun.bench import write_plot

    out = write_plot(tiny_report, tmp_path / "b.html")
    html = out.read_text(encoding="utf-8")
    assert html.startswith("<!doctype html>") and html.count("<svg") == 5
    assert "llama.cpp" in html and "TTFT" in html and "tokens/s vs concurrency" in html
    assert "<script" not in html and "http" not in html.replace("http://www.w3.org", "")
    with pytest.raises(BenchError, match="html"):
        write_plot(tiny_report, tmp_path / "b.png")


# -- the CLI -----------------------------------------------------------------------------


def cli(*args: str, env: dict[str, str] | None = None,
        timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*localrun_cmd(), *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


@requires_llama
@pytest.mark.slow
def test_cli_bench(tmp_path: Path, clean_env: dict[str, str]) -> None:
    js, plot = tmp_path / "b.json", tmp_path / "b.html"
    r = cli("bench", "smollm2:135m", "--prompt-tokens", "16", "--gen-tokens", "8",
            "--concurrency", "1,2", "--runs", "2", "--warmup", "1", "--json", str(js),
            "--plot", str(plot), env=clean_env)
    assert r.returncode == 0, r.stderr
    for text in ("TTFT ms", "TPOT ms", "prefill tok/s", "decode tok/s", "out tok/s",
                 "roofline", "llama.cpp 0.3", "Q4_1", "Memory bandwidth", "135M params",
                 "stream", "batched"):
        assert text in r.stdout, text
    data = json.loads(js.read_text())
    assert data["schema_version"] == SCHEMA_VERSION
    assert [w["concurrency"] for w in data["results"][0]["workloads"]] == [1, 2]
    assert plot.read_text().startswith("<!doctype html>")


@pytest.mark.parametrize(("args", "needle"), [
    (("--prompt-tokens", "12x"), "--prompt-tokens"),
    (("--concurrency", "1,0"), "--concurrency"),
    (("--runs", "0"), "--runs"),
    (("--plot", "b.png"), "b.png"),
    (("--backend", "nosuch"), "nosuch"),
])
def test_cli_bad_flag_one_line_error(args: tuple[str, ...], needle: str,
                                     clean_env: dict[str, str]) -> None:
    r = cli("bench", "smollm2:135m", *args, env=clean_env, timeout=120)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert lines[0].startswith("error: ") and needle in lines[0]
    assert len(lines) == 2 and lines[1].strip().startswith("hint: ")


def test_cli_unknown_model_one_line_error(clean_env: dict[str, str]) -> None:
    r = cli("bench", "smollm2:13m", "--runs", "1", env=clean_env, timeout=120)
    assert r.returncode != 0 and r.stderr.startswith("error: Unknown model 'smollm2:13m'")
    assert "Traceback" not in r.stderr


# -- engines side by side ----------------------------------------------------------------

SIDE_BY_SIDE = {"llama.cpp": "gguf-q4_1", "mlx": "mlx-4bit", "openvino": "openvino-int4",
                "onnx": "onnx-int4"}


def _fixture_here(fmt: str) -> Path | None:
    """The fixture model of this environment (tests/models.py), or None if not built."""
    from tests.models import test_model

    try:
        return test_model(fmt)
    except pytest.skip.Exception:
        return None


@pytest.mark.slow
def test_cli_bench_engines_side_by_side(tmp_path: Path, clean_env: dict[str, str]) -> None:
    """The same model in each CPU engine's native format, compared in one run."""
    from localrun.backends import BACKENDS, installed_backends

    installed = installed_backends()
    models = {b: path for b, fmt in SIDE_BY_SIDE.items()
              if b in installed and importlib.util.find_spec(BACKENDS[b].module) is not None
              and (path := _fixture_here(fmt)) is not None}
    if len(models) < 2:
        pytest.skip(f"fewer than two engines with a backend and a fixture model here "
                    f"({', '.join(models) or 'none'}; fixtures: python "
                    f"scripts/make_test_models.py)")
    js = tmp_path / "b.json"
    r = cli("bench", *map(str, models.values()), "--backend", "all", "--prompt-tokens", "16",
            "--gen-tokens", "8", "--concurrency", "1,2", "--runs", "2", "--warmup", "1",
            "--json", str(js), "--plot", str(tmp_path / "b.html"), env=clean_env,
            timeout=1200)
    assert r.returncode == 0, r.stderr
    assert "Side by side" in r.stdout
    data = json.loads(js.read_text())
    ran = {res["model"]["backend"]: Path(res["model"]["path"]) for res in data["results"]}
    assert ran == models, data["skipped"]
    for res in data["results"]:
        assert all(w["prompt_tokens_exact"] for w in res["workloads"]), res["model"]


# -- localrun's own overhead (scripts/bench_overhead.py) ---------------------------------


@requires_llama
@pytest.mark.slow
def test_bench_overhead_script_reports_ratio_and_ttft(tmp_path: Path) -> None:
    """The script behind README's overhead claim runs and reports what the claim is
    about: the decode-time ratio and the TTFT difference, localrun vs the engine's own
    API. (The numbers themselves are a benchmark's, in docs/results/README.md.)"""
    import math
    import sys

    out = tmp_path / "overhead.json"
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_overhead.py"),
                        "--backend", "llama.cpp", "--tokens", "8", "--prompt-tokens", "16",
                        "--runs", "2", "--warmup", "1", "--json", str(out)],
                       capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    [row] = json.loads(out.read_text())
    assert (row["backend"], row["runs"], row["tokens"], row["prompt_tokens"]) == (
        "llama.cpp", 2, 8, 16)
    # the same greedy generation both ways, so the same number of tokens each run
    assert row["tokens_engine"] == row["tokens_localrun"]
    assert all(n >= 2 for n in row["tokens_engine"])
    for key in ("decode_ratio", "decode_ratio_min"):
        assert math.isfinite(row[key]) and row[key] > 0, key
    for key in ("ttft_engine_ms", "ttft_localrun_ms", "decode_engine_ms", "decode_localrun_ms"):
        assert row[key] > 0, key
    assert row["ttft_added_ms"] == pytest.approx(row["ttft_localrun_ms"] - row["ttft_engine_ms"])
    [line] = [x for x in r.stdout.splitlines() if x.startswith("llama.cpp")]
    assert f"ratio {row['decode_ratio']:.4f}" in line
    assert f"added {row['ttft_added_ms']:+6.2f} ms" in line
    within = row["decode_ratio"] < 1.03 and row["ttft_added_ms"] < 10
    assert ("within target" if within else "OVER TARGET") in line
