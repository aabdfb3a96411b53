"""ExLlamaV2 / ExLlamaV3 backends.

Both engines need CUDA even to import, so the pure parts (localrun/backends/_exllama.py)
are tested on every host: sampler settings, templates, EOS ids, job results -> stats,
the job driver (against a generator double that returns the engines' result dicts),
context fitting, the KV-cache option and GPU splits. The GPU tests at the end run
only where an NVIDIA GPU is detected (NVML / nvidia-smi, not torch) and the engine is
installed, on models named by LOCALRUN_EXL2_MODEL / LOCALRUN_EXL3_MODEL
(scripts/gpu_verify.sh sets them).
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
from collections.abc import Iterator
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

import pytest

import localrun
from localrun.backends import _exllama as ex
from localrun.backends.base import GenerationStats, LoadRequest, Prompt
from localrun.errors import (
    EngineNotInstalledError,
    EngineUnavailableError,
    InvalidOptionError,
    LocalrunError,
    ModelTooLargeError,
)
from localrun.hardware import CPUInfo, GPUInfo, HardwareProfile
from localrun.memory import ModelShape
from localrun.sampling import FALLBACK, ResolvedSampling
from localrun.templates import render_chat
from localrun.types import CancelToken
from tests.conftest import localrun_cmd

GiB = 1024**3


def _nvidia_gpus() -> list[GPUInfo]:
    from localrun.hardware import detect_hardware

    return list(detect_hardware().nvidia_gpus)


HAVE_NVIDIA = bool(_nvidia_gpus())
NO_GPU_REASON = "no NVIDIA GPU on this host (NVML and nvidia-smi see none)"

# -- sampler settings --------------------------------------------------------------------------

#: ExLlamaV2Sampler.Settings fields (exllamav2 0.3.2 generator/sampler.py, class Settings,
#: line 52 on), except the n-gram bookkeeping (ngram_trie/index/history) and
#: post_sampling_hooks, which do not change how a token is drawn.
V2_SETTINGS_FIELDS = {
    "token_repetition_penalty", "token_repetition_range", "token_repetition_decay",
    "token_frequency_penalty", "token_presence_penalty", "temperature", "smoothing_factor",
    "min_temp", "max_temp", "temp_exponent", "top_k", "top_p", "top_a", "min_p", "tfs",
    "typical", "skew", "temperature_last", "mirostat", "mirostat_tau", "mirostat_eta",
    "mirostat_mu", "token_bias", "cfg_scale", "dry_allowed_length", "dry_base",
    "dry_multiplier", "dry_sequence_breakers", "dry_range", "dry_max_ngram",
    "xtc_probability", "xtc_threshold", "xtc_ignore_tokens",
}
#: The class defaults that are not neutral (same file).
V2_ENGINE_DEFAULTS = {"temperature": 0.8, "top_k": 50, "top_p": 0.8,
                      "token_repetition_penalty": 1.025}
#: exllamav3 1.6.5 ComboSampler.__init__ parameters (generator/sampler/presets.py line 82).
V3_COMBO_PARAMS = {
    "rep_p", "freq_p", "pres_p", "rep_sustain_range", "rep_decay_range", "dry_multiplier",
    "dry_base", "dry_allowed_length", "dry_range", "dry_sequence_breakers", "temperature",
    "min_p", "top_k", "top_p", "temp_last", "adaptive_target", "adaptive_decay", "logit_bias",
}


def _sampling(**kw: Any) -> ResolvedSampling:
    return replace(FALLBACK, **kw)


def test_v2_settings_set_every_field_and_no_engine_default_leaks() -> None:
    kw = ex.v2_sampler_settings(FALLBACK)  # temperature 0.7, every filter off
    assert set(kw) == V2_SETTINGS_FIELDS
    assert kw["temperature"] == 0.7
    assert kw["top_k"] == 0 and kw["top_p"] == 1.0 and kw["min_p"] == 0.0
    assert kw["token_repetition_penalty"] == 1.0
    for name, engine_default in V2_ENGINE_DEFAULTS.items():
        assert kw[name] != engine_default, name
    assert kw["dry_multiplier"] == 0.0 and kw["xtc_probability"] == 0.0
    assert kw["mirostat"] is False and kw["smoothing_factor"] == 0.0


def test_v2_settings_sampled_values_pass_through() -> None:
    kw = ex.v2_sampler_settings(_sampling(temperature=1.3, top_p=0.9, top_k=40, min_p=0.05,
                                          repetition_penalty=1.1, seed=7))
    assert (kw["temperature"], kw["top_p"], kw["top_k"], kw["min_p"]) == (1.3, 0.9, 40, 0.05)
    assert kw["token_repetition_penalty"] == 1.1
    assert kw["token_repetition_range"] == -1  # the whole sequence, like transformers


def test_v2_settings_greedy_is_the_engines_argmax() -> None:
    kw = ex.v2_sampler_settings(_sampling(temperature=0.0, top_p=0.5, top_k=3, min_p=0.2,
                                          repetition_penalty=1.2))
    # ExLlamaV2Sampler.Settings.greedy(): temperature 1, top_k 1, top_p 0
    assert (kw["temperature"], kw["top_k"], kw["top_p"], kw["min_p"]) == (1.0, 1, 0.0, 0.0)
    assert kw["token_repetition_penalty"] == 1.2  # penalties still apply, as on llama.cpp


def test_v3_combo_sampler_kwargs() -> None:
    kw = ex.v3_sampler_kwargs(FALLBACK)
    assert set(kw) == V3_COMBO_PARAMS
    assert (kw["temperature"], kw["top_k"], kw["top_p"], kw["min_p"], kw["rep_p"]) == \
        (0.7, 0, 1.0, 0.0, 1.0)
    greedy = ex.v3_sampler_kwargs(_sampling(temperature=0.0, top_k=5, repetition_penalty=1.3))
    assert greedy["temperature"] == 0.0 and greedy["top_k"] == 0  # ComboSampler -> argmax
    assert greedy["rep_p"] == 1.3
    sampled = ex.v3_sampler_kwargs(_sampling(temperature=0.9, top_p=0.95, top_k=20, min_p=0.1))
    assert (sampled["temperature"], sampled["top_p"], sampled["top_k"], sampled["min_p"]) == \
        (0.9, 0.95, 20, 0.1)
    assert sampled["adaptive_target"] == 1.0  # adaptive-P off: plain sampling


# -- model folder: template, BOS, EOS ----------------------------------------------------------

LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}"
    "<|end_header_id|>\n\n{{ m['content'] }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)


def test_template_from_tokenizer_config(tmp_path: Path) -> None:
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": LLAMA3_TEMPLATE,
        "bos_token": {"content": "<|begin_of_text|>", "lstrip": False},  # AddedToken form
        "eos_token": "<|eot_id|>",
    }))
    t = ex.read_chat_template(tmp_path)
    assert t.bos_token == "<|begin_of_text|>" and t.eos_token == "<|eot_id|>"
    text = render_chat(t.template, [{"role": "user", "content": "Hi"}],
                       bos_token=t.bos_token, eos_token=t.eos_token)
    assert text == ("<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
                    "<|start_header_id|>assistant<|end_header_id|>\n\n")


def test_template_file_wins_and_named_templates(tmp_path: Path) -> None:
    # transformers 5 saves the template beside tokenizer_config.json (the fixture hf
    # folder from scripts/make_test_models.py has chat_template.jinja only).
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": [{"name": "tool_use", "template": "TOOLS"},
                          {"name": "default", "template": "DEFAULT"}]}))
    assert ex.read_chat_template(tmp_path).template == "DEFAULT"
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!")
    t = ex.read_chat_template(tmp_path)
    assert render_chat(t.template, [{"role": "user", "content": "yo"}]) == "yo!"


def test_template_absent_falls_back_to_chatml(tmp_path: Path) -> None:
    t = ex.read_chat_template(tmp_path)
    assert t.template is None
    assert render_chat(t.template, [{"role": "user", "content": "Hi"}]).endswith(
        "<|im_start|>assistant\n")


def test_raw_text_bos_rule(tmp_path: Path) -> None:
    llama3_post = {"type": "TemplateProcessing", "single": [
        {"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 0}},
        {"Sequence": {"id": "A", "type_id": 0}}]}
    t = ex.ChatTemplate(None, bos_token="<|begin_of_text|>")
    assert ex.adds_bos(t, {"post_processor": llama3_post})
    assert ex.adds_bos(t, {"post_processor": {"type": "Sequence",
                                              "processors": [{"type": "ByteLevel"},
                                                             llama3_post]}})
    smollm_post = {"type": "TemplateProcessing", "single": [{"Sequence": {"id": "A"}}]}
    assert not ex.adds_bos(t, {"post_processor": smollm_post})
    assert not ex.adds_bos(replace(t, add_bos_token=False), {"post_processor": llama3_post})
    assert ex.adds_bos(replace(t, add_bos_token=True), {})


def test_eos_ids_from_int_and_list_forms() -> None:
    assert ex.stop_token_ids({"eos_token_id": 2}, {"eos_token_id": 2}, 2) == [2]
    # Llama 3.1: a list in generation_config, an int in config.json
    assert ex.stop_token_ids({"eos_token_id": [128001, 128008, 128009]},
                             {"eos_token_id": 128001}, 128009) == [128001, 128008, 128009]
    assert ex.stop_token_ids({}, {"text_config": {"eos_token_id": [1, 106]}}, None) == [1, 106]
    assert ex.stop_token_ids({"eos_token_id": True}, {}, -1) == []


def test_quant_label() -> None:
    assert ex.quant_label({"quantization_config": {"quant_method": "exl2", "bits": 4.0}}) == \
        "4.0bpw"
    assert ex.quant_label({"quantization_config": {"quant_method": "exl3", "bits": 3.25}}) == \
        "3.25bpw"
    assert ex.quant_label({"quantization_config": {"quant_method": "gptq", "bits": 4}}) == "4bit"
    assert ex.quant_label({}) is None


# -- job results -> stats ----------------------------------------------------------------------

def _final_result(**over: Any) -> dict[str, Any]:
    """A finished job's result as ExLlamaV2 emits it (exllamav2 0.3.2
    generator/dynamic.py, ExLlamaV2DynamicJob.receive_sample.emit, lines 2010-2087;
    exllamav3 1.6.5 generator/job.py lines 858-962 has the same keys)."""
    r: dict[str, Any] = {
        "job": object(),
        "stage": "streaming",
        "eos": True,
        "serial": 0,
        "eos_reason": "stop_token",
        "eos_triggering_token_id": 2,
        "eos_triggering_token_str": "<|im_end|>",
        "full_completion": "Paris is the capital of France.",
        "new_tokens": 9,
        "prompt_tokens": 30,
        "time_enqueued": 0.0004,
        "time_prefill": 0.0125,
        "time_generate": 0.08,
        "cached_pages": 0,
        "cached_tokens": 0,
        "identifier": 0,
    }
    r.update(over)
    return r


def test_final_result_stop_token() -> None:
    stats = GenerationStats()
    ex.apply_final_result(_final_result(), stats)
    assert stats.finish_reason == "stop"
    assert stats.completion_tokens == 8  # the EOS the engine counted is not part of the reply
    assert (stats.prefill_tokens, stats.prefill_seconds) == (30, 0.0125)
    assert (stats.decode_tokens, stats.decode_seconds) == (8, 0.08)


def test_final_result_length_and_prefix_cache() -> None:
    stats = GenerationStats()
    ex.apply_final_result(_final_result(eos_reason="max_new_tokens", new_tokens=16,
                                        prompt_tokens=600, cached_tokens=512), stats)
    assert stats.finish_reason == "length" and stats.completion_tokens == 16
    assert stats.prefill_tokens == 88  # 512 tokens came from the prefix cache
    stats2 = GenerationStats()
    ex.apply_final_result(_final_result(prompt_tokens=256, cached_tokens=256), stats2)
    assert stats2.prefill_tokens == 1


class FakeGenerator:
    """Stands in for ExLlamaV2DynamicGenerator / exllamav3 Generator: enqueue, iterate,
    cancel, and the result dicts of their iterate() (see _final_result)."""

    def __init__(self, replies: dict[int, list[str]], eos: str = "stop_token",
                 batch: int = 8) -> None:
        self.replies = replies
        self.eos = eos
        self.batch = batch
        self.queue: list[Any] = []
        self.cancelled: list[int] = []
        self.max_active = 0

    def enqueue(self, job: dict[str, Any]) -> int:
        job["step"] = -1
        self.queue.append(job)
        return len(self.queue)

    def cancel(self, job: dict[str, Any]) -> None:
        self.cancelled.append(job["identifier"])
        self.queue.remove(job)

    def iterate(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        running = self.queue[: self.batch]
        self.max_active = max(self.max_active, len(running))
        for job in list(running):
            i = job["identifier"]
            if job["step"] < 0:
                job["step"] = 0
                out.append({"job": job, "stage": "started", "eos": False, "serial": i,
                            "identifier": i})
                continue
            words = self.replies[i][: job["limit"]]
            k = job["step"]
            job["step"] += 1
            if k < len(words):
                r = {"job": job, "stage": "streaming", "eos": False, "serial": i,
                     "identifier": i, "text": words[k], "token_ids": [[100 + k]]}
                if k + 1 == job["limit"]:
                    r.update(_final_result(eos_reason="max_new_tokens", new_tokens=k + 1,
                                           identifier=i))
                    r.update(text=words[k], token_ids=[[100 + k]])
                    self.queue.remove(job)
                out.append(r)
            else:
                out.append(_final_result(eos_reason=self.eos, new_tokens=len(words) + 1,
                                         identifier=i))
                self.queue.remove(job)
        return out


def _make_job(prompt: Prompt, sampling: ResolvedSampling, limit: int, ident: int
              ) -> dict[str, Any]:
    return {"identifier": ident, "limit": limit, "seed": sampling.seed}


def _drive(gen: FakeGenerator, n: int, limits: list[int], cancels: list[CancelToken] | None
           = None, max_concurrency: int | None = None
           ) -> tuple[Iterator[tuple[int, str | None]], list[GenerationStats]]:
    stats = [GenerationStats() for _ in range(n)]
    it = ex.run_jobs(gen, _make_job, [Prompt([1, 2, 3])] * n, [FALLBACK] * n,
                     cancels or [CancelToken() for _ in range(n)], stats, limits,
                     max_concurrency)
    return it, stats


def test_driver_streams_until_eos() -> None:
    gen = FakeGenerator({0: ["Hel", "lo", "!"]})
    it, stats = _drive(gen, 1, [100])
    events = list(it)
    assert events == [(0, "Hel"), (0, "lo"), (0, "!"), (0, None)]
    assert stats[0].finish_reason == "stop" and stats[0].completion_tokens == 3
    assert stats[0].started > 0 and gen.queue == []


def test_driver_length_limit() -> None:
    gen = FakeGenerator({0: ["a", "b", "c", "d"]})
    it, stats = _drive(gen, 1, [2])
    assert [p for _, p in it] == ["a", "b", None]
    assert stats[0].finish_reason == "length" and stats[0].completion_tokens == 2


def test_driver_no_room_and_cancel() -> None:
    gen = FakeGenerator({0: ["x"] * 10, 1: ["y"]})
    cancels = [CancelToken(), CancelToken()]
    it, stats = _drive(gen, 2, [10, 0], cancels)
    seen: list[tuple[int, str | None]] = []
    for i, piece in it:
        seen.append((i, piece))
        if piece == "x" and len([p for j, p in seen if j == 0]) == 2:
            cancels[0].cancel()
    assert (1, None) in seen and stats[1].finish_reason == "length"  # no room for a reply
    assert gen.cancelled == [0] and seen[-1] == (0, None)
    assert stats[0].completion_tokens == 2 and stats[0].finish_reason is None


def test_driver_batch_honours_max_concurrency() -> None:
    replies = {i: [f"w{i}"] * (i + 1) for i in range(5)}
    gen = FakeGenerator(replies)
    it, stats = _drive(gen, 5, [50] * 5, max_concurrency=2)
    done = [i for i, p in it if p is None]
    assert sorted(done) == [0, 1, 2, 3, 4]
    assert gen.max_active == 2
    assert [s.completion_tokens for s in stats] == [1, 2, 3, 4, 5]


def test_driver_close_cancels_queued_jobs() -> None:
    gen = FakeGenerator({0: ["a"] * 10, 1: ["b"] * 10})
    it, _ = _drive(gen, 2, [10, 10])
    for _, piece in it:
        if piece:
            break
    it.close()  # type: ignore[attr-defined]
    assert sorted(gen.cancelled) == [0, 1] and gen.queue == []


def test_driver_raises_engine_errors() -> None:
    class Failing(FakeGenerator):
        def iterate(self) -> list[dict[str, Any]]:
            job = self.queue[0]
            return [{"job": job, "serial": 0, "stage": "error", "eos": True,
                     "error": RuntimeError("CUDA error: an illegal memory access"),
                     "identifier": 0}]

    it, _ = _drive(Failing({0: []}), 1, [5])
    with pytest.raises(ex.EngineJobError, match="illegal memory access"):
        list(it)


# -- options, context fit, GPU split -----------------------------------------------------------

def test_kv_cache_option() -> None:
    assert ex.parse_options("exllamav2", {}).kv_cache == "fp16"
    assert ex.parse_options("exllamav2", {"kv_cache": "Q4"}).kv_cache == "q4"
    assert ex.parse_options("exllamav3", {"kv_cache": 8}).kv_cache == "q8"
    for bad in ("q5", "fp8", True, None, 4.5):
        with pytest.raises(InvalidOptionError) as e:
            ex.parse_options("exllamav2", {"kv_cache": bad})
        assert "kv_cache" in str(e.value) and "fp16, q8, q6, q4" in str(e.value)
        assert e.value.hint
    assert set(ex.V2_CACHE_CLASS) == set(ex.V3_CACHE_BITS) == set(ex.KV_CACHE_CHOICES)


def test_unknown_and_bad_options() -> None:
    with pytest.raises(InvalidOptionError, match="n_gpu_layers"):
        ex.parse_options("exllamav2", {"n_gpu_layers": -1})
    with pytest.raises(InvalidOptionError, match="tensor_parallel"):
        ex.parse_options("exllamav2", {"tensor_parallel": True})  # an ExLlamaV3 option
    with pytest.raises(InvalidOptionError, match="gpu_split"):
        ex.parse_options("exllamav3", {"gpu_split": [0, 0]})
    assert ex.parse_options("exllamav3", {"gpu_split": "20, 24"}).gpu_split == (20.0, 24.0)


SHAPE_8B = ModelShape(n_layers=32, n_kv_heads=8, head_dim=128, trained_context=131072)


def test_context_defaults_and_requests_without_vram_numbers() -> None:
    c = ex.choose_context("exllamav2", model="m", requested=None, trained=131072, weights=0,
                          shape=SHAPE_8B, free_vram=[])
    assert (c.context, c.cache_tokens) == (8192, 8192)
    c = ex.choose_context("exllamav2", model="m", requested=1000, trained=2048, weights=0,
                          shape=None, free_vram=[24 * GiB])
    assert (c.context, c.cache_tokens) == (1000, 1024)  # cache in whole 256-token pages
    c = ex.choose_context("exllamav3", model="m", requested=4096, trained=2000, weights=0,
                          shape=None, free_vram=[])
    assert (c.context, c.cache_tokens) == (2000, 2048)


def test_context_shrinks_to_free_vram() -> None:
    # 8B at 4.0bpw (~5 GiB) on a 12 GB card with 6 GiB free: FP16 KV is 128 KiB per token.
    weights = 5 * GiB
    c = ex.choose_context("exllamav2", model="m", requested=None, trained=131072,
                          weights=weights, shape=SHAPE_8B, free_vram=[6 * GiB])
    per_token = 32 * 2 * 8 * 128 * 2
    budget = 6 * GiB - 256 * 2**20 - weights - (256 * 2**20 + int(weights * 0.05))
    assert c.context == budget // per_token // 256 * 256 == 2048
    q4 = ex.choose_context("exllamav2", model="m", requested=None, trained=131072,
                           weights=weights, shape=SHAPE_8B, free_vram=[6 * GiB],
                           kv_cache="q4")
    assert q4.context > 3 * c.context  # a Q4 cache holds ~3.5x the tokens
    roomy = ex.choose_context("exllamav3", model="m", requested=None, trained=131072,
                              weights=weights, shape=SHAPE_8B, free_vram=[20 * GiB, 20 * GiB])
    assert roomy.context == 8192 and "trained" not in roomy.reason


def test_context_refusals_say_what_fits() -> None:
    with pytest.raises(ModelTooLargeError) as e:
        ex.choose_context("exllamav2", model="m", requested=32768, trained=131072,
                          weights=5 * GiB, shape=SHAPE_8B, free_vram=[6 * GiB])
    assert e.value.max_context == 2048 and "kv_cache='q4'" in (e.value.hint or "")
    with pytest.raises(ModelTooLargeError) as e2:
        ex.choose_context("exllamav3", model="m", requested=None, trained=8192,
                          weights=40 * GiB, shape=SHAPE_8B, free_vram=[24 * GiB])
    assert e2.value.max_context == 0 and "weights do not fit" in (e2.value.hint or "")


def test_gpu_split_decisions() -> None:
    opts = ex.LoadOptions()
    assert ex.plan_split("exllamav2", 1, device=None, options=opts).mode == "autosplit"
    two = ex.plan_split("exllamav2", 2, device=None, options=opts)
    assert two.mode == "autosplit" and two.devices == (0, 1)
    tp = ex.plan_split("exllamav3", 2, device=None, options=opts, supports_tp=True)
    assert tp.mode == "tensor_parallel"
    assert ex.plan_split("exllamav3", 2, device=None, options=opts,
                         supports_tp=False).mode == "autosplit"
    assert ex.plan_split("exllamav3", 2, device=None,
                         options=ex.LoadOptions(tensor_parallel=False)).mode == "autosplit"
    single = ex.plan_split("exllamav2", 3, device="cuda:2", options=opts)
    assert single.mode == "single" and single.devices == (2,)
    assert single.gpu_split is not None and single.gpu_split[:2] == (0.0, 0.0)
    manual = ex.plan_split("exllamav2", 2, device=None,
                           options=ex.LoadOptions(gpu_split=(0.0, 20.0)))
    assert manual.mode == "manual" and manual.devices == (1,)
    with pytest.raises(InvalidOptionError, match="cuda:0 to cuda:1"):
        ex.plan_split("exllamav2", 2, device="cuda:5", options=opts)
    with pytest.raises(InvalidOptionError):
        ex.plan_split("exllamav2", 1, device="cpu", options=opts)
    with pytest.raises(EngineUnavailableError):
        ex.plan_split("exllamav3", 0, device=None, options=opts)
    assert ex.free_for_split([10 * GiB, 30 * GiB], manual) == [20 * GiB]


def test_import_errors_become_one_line_errors() -> None:
    e = ex.engine_import_error("exllamav2",
                               OSError("CUDA_HOME environment variable is not set. Please set "
                                       "it to your CUDA install root."))
    assert isinstance(e, EngineUnavailableError) and e.hint
    assert "NVIDIA GPU with CUDA" in str(e) and "CUDA_HOME" in str(e)
    missing = ex.engine_import_error("exllamav3", ModuleNotFoundError("No module named 'torch'"))
    assert isinstance(missing, EngineNotInstalledError)
    assert "localrun[exllamav3]" in str(missing)


# -- this host: refuse fast, one line, no traceback --------------------------------------------

def _write_exl2(folder: Path, method: str = "exl2") -> Path:
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 64,
        "max_position_embeddings": 2048, "eos_token_id": 2,
        "quantization_config": {"quant_method": method, "bits": 4.0}}))
    marker = ".q_weight" if method == "exl2" else ".trellis"
    header = json.dumps({f"model.layers.0.self_attn.q_proj{marker}": {
        "dtype": "I32", "shape": [1, 1], "data_offsets": [0, 4]}}).encode()
    (folder / "output.safetensors").write_bytes(struct.pack("<Q", len(header)) + header
                                                + b"\0" * 4)
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    return folder


def test_probe_refuses_a_host_without_gpu() -> None:
    if HAVE_NVIDIA:
        pytest.skip("this host has an NVIDIA GPU")
    bare = HardwareProfile(os="Linux", os_version="", arch="x86_64", cpu=CPUInfo())
    try:
        import torch
    except ImportError:
        torch = None
    if torch is not None and torch.cuda.is_available():
        pytest.skip("torch sees a GPU that NVML does not")
    with pytest.raises(EngineUnavailableError) as e:
        ex.probe_cuda("exllamav2", bare)
    assert "needs an NVIDIA GPU" in str(e.value) and e.value.hint


@pytest.mark.parametrize(("backend", "method"), [("exllamav2", "exl2"), ("exllamav3", "exl3")])
def test_load_fails_fast_without_gpu(tmp_path: Path, backend: str, method: str) -> None:
    if HAVE_NVIDIA:
        pytest.skip("this host has an NVIDIA GPU: loading would go further")
    model = _write_exl2(tmp_path / "m", method)
    with pytest.raises((EngineNotInstalledError, EngineUnavailableError)) as e:
        localrun.load(str(model), backend=backend)
    assert isinstance(e.value, LocalrunError) and e.value.hint


@pytest.mark.parametrize(("backend", "method"), [("exllamav2", "exl2"), ("exllamav3", "exl3")])
def test_backend_load_refuses_before_importing_engine(
        tmp_path: Path, backend: str, method: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Even with the engine's metadata present, no GPU means EngineUnavailableError, and
    the engine (which would try to build its CUDA extension) is never imported."""
    if HAVE_NVIDIA:
        pytest.skip("this host has an NVIDIA GPU")
    import importlib.util
    import sys

    if importlib.util.find_spec("torch") is not None:
        pytest.skip("torch is installed here: probe_cuda asks torch instead")
    import localrun.backends as backends

    monkeypatch.setattr(backends, "is_installed", lambda name: True)
    model = _write_exl2(tmp_path / "m", method)
    with pytest.raises(EngineUnavailableError, match="needs an NVIDIA GPU"):
        localrun.load(str(model), backend=backend, kv_cache="q4")
    assert not any(m.split(".")[0] in ("exllamav2", "exllamav3", "torch") for m in sys.modules)
    spec = backends.BACKENDS[backend]
    session_cls = __import__(spec.module, fromlist=["BACKEND"]).BACKEND
    with pytest.raises(InvalidOptionError, match="kv_cache"):
        session_cls.load(LoadRequest(str(model), method, options={"kv_cache": "q5"}))


def test_cli_says_one_line(tmp_path: Path, clean_env: dict[str, str]) -> None:
    if HAVE_NVIDIA:
        pytest.skip("this host has an NVIDIA GPU")
    model = _write_exl2(tmp_path / "m")
    proc = subprocess.run([*localrun_cmd(), "run", str(model), "Hi", "--backend", "exllamav2"],
                          capture_output=True, text=True, env=clean_env, timeout=120)
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr and "ExLlamaV2" in proc.stderr + proc.stdout
    assert "pip install" in proc.stderr or "GPU" in proc.stderr


# -- on a GPU ----------------------------------------------------------------------------------

def _gpu_model(backend: str, env: str) -> Path:
    if not HAVE_NVIDIA:
        pytest.skip(NO_GPU_REASON)
    from localrun.backends import is_installed

    if not is_installed(backend):
        pytest.skip(f"{backend} is not installed (pip install 'localrun[{backend}]')")
    path = os.environ.get(env)
    if not path or not Path(path).is_dir():
        pytest.skip(f"set {env} to a model folder (scripts/gpu_verify.sh makes one)")
    return Path(path)


GPU_CASES = [("exllamav2", "LOCALRUN_EXL2_MODEL"), ("exllamav3", "LOCALRUN_EXL3_MODEL")]


@pytest.mark.slow
@pytest.mark.parametrize(("backend", "env"), GPU_CASES)
def test_gpu_chat_greedy_stream_and_batch(backend: str, env: str) -> None:
    path = _gpu_model(backend, env)
    with localrun.load(str(path), backend=backend, context=2048) as m:
        assert m.info.backend == backend and m.info.context_length == 2048
        a = m.chat("What is the capital of France?", temperature=0, max_tokens=24)
        b = m.chat("What is the capital of France?", temperature=0, max_tokens=24)
        assert a.text == b.text and a.text.strip()
        assert a.usage.completion_tokens > 0 and a.timings.decode_tps > 0
        assert a.finish_reason in ("stop", "length")
        short = m.chat("Count from 1 to 100.", temperature=0, max_tokens=5)
        assert short.finish_reason == "length" and short.usage.completion_tokens == 5
        s1 = m.chat("Tell me a story.", temperature=1.0, seed=3, max_tokens=16)
        s2 = m.chat("Tell me a story.", temperature=1.0, seed=3, max_tokens=16)
        assert s1.text == s2.text
        stream = m.stream("Write a long poem about the sea.", temperature=0, max_tokens=200)
        for n, _chunk in enumerate(stream, 1):
            if n == 3:
                stream.cancel()
        assert stream.completion is not None
        assert stream.completion.finish_reason == "cancelled"
        results = m.batch(["Hi", "What is 2+2?", "Name a colour."], temperature=0,
                          max_tokens=12)
        assert len(results) == 3 and all(r.usage.completion_tokens > 0 for r in results)


@pytest.mark.slow
@pytest.mark.parametrize(("backend", "env"), GPU_CASES)
def test_gpu_quantized_kv_cache(backend: str, env: str) -> None:
    path = _gpu_model(backend, env)
    with localrun.load(str(path), backend=backend, kv_cache="q4", context=1024) as m:
        assert m.chat("Hi", temperature=0, max_tokens=8).usage.completion_tokens > 0


def test_settings_field_list_matches_the_dataclass_when_importable() -> None:
    """Where exllamav2 imports (a CUDA host), the field list above is checked against
    the real class."""
    if not HAVE_NVIDIA:
        pytest.skip(NO_GPU_REASON)
    try:
        from exllamav2.generator import ExLlamaV2Sampler
    except (ImportError, OSError) as e:
        pytest.skip(f"exllamav2 does not import here ({e})")
    names = {f.name for f in fields(ExLlamaV2Sampler.Settings)}
    skipped = {"post_sampling_hooks", "ngram_trie", "ngram_index", "ngram_history"}
    assert names - skipped == V2_SETTINGS_FIELDS
    ExLlamaV2Sampler.Settings(**ex.v2_sampler_settings(FALLBACK))
