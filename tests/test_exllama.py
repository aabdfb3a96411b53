"""ExLlamaV2 / ExLlamaV3 backends.

Both engines need CUDA even to import, so the pure parts (localrun/backends/exllama/)
are tested on every host: sampler settings, templates, EOS ids, job results -> stats,
the job driver (against a generator rebuilt from the engines' source: results, held-back
text, failed jobs, requeues), context fitting, the KV-cache option and GPU splits; the
sessions' load and close calls run against fake engine modules with the engines'
signatures. The GPU tests at the end run
only where an NVIDIA GPU is detected (NVML / nvidia-smi, not torch) and the engine is
installed, on models named by LOCALRUN_EXL2_MODEL / LOCALRUN_EXL3_MODEL
(scripts/gpu_kit/run.py sets them).
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import threading
import types
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import fields, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

import localrun
from localrun.backends import hf_config as hf
from localrun.backends.base import GenerationStats, LoadRequest, Prompt
from localrun.backends.exllama import errors as ex_errors
from localrun.backends.exllama import folder as ex_folder
from localrun.backends.exllama import jobs as ex_jobs
from localrun.backends.exllama import options as ex_options
from localrun.backends.exllama import probe as ex_probe
from localrun.backends.exllama import session as ex_session
from localrun.backends.exllama import v2, v3
from localrun.backends.exllama import vram as ex_vram
from localrun.errors import (
    EngineNotInstalledError,
    EngineUnavailableError,
    GenerationError,
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
    kw = v2.v2_sampler_settings(FALLBACK)  # temperature 0.7, every filter off
    assert set(kw) == V2_SETTINGS_FIELDS
    assert kw["temperature"] == 0.7
    assert kw["top_k"] == 0 and kw["top_p"] == 1.0 and kw["min_p"] == 0.0
    assert kw["token_repetition_penalty"] == 1.0
    for name, engine_default in V2_ENGINE_DEFAULTS.items():
        assert kw[name] != engine_default, name
    assert kw["dry_multiplier"] == 0.0 and kw["xtc_probability"] == 0.0
    assert kw["mirostat"] is False and kw["smoothing_factor"] == 0.0


def test_v2_settings_sampled_values_pass_through() -> None:
    kw = v2.v2_sampler_settings(_sampling(temperature=1.3, top_p=0.9, top_k=40, min_p=0.05,
                                          repetition_penalty=1.1, seed=7))
    assert (kw["temperature"], kw["top_p"], kw["top_k"], kw["min_p"]) == (1.3, 0.9, 40, 0.05)
    assert kw["token_repetition_penalty"] == 1.1
    assert kw["token_repetition_range"] == -1  # the whole sequence, like transformers


def test_v2_settings_greedy_is_the_engines_argmax() -> None:
    kw = v2.v2_sampler_settings(_sampling(temperature=0.0, top_p=0.5, top_k=3, min_p=0.2,
                                          repetition_penalty=1.2))
    # ExLlamaV2Sampler.Settings.greedy(): temperature 1, top_k 1, top_p 0
    assert (kw["temperature"], kw["top_k"], kw["top_p"], kw["min_p"]) == (1.0, 1, 0.0, 0.0)
    assert kw["token_repetition_penalty"] == 1.2  # penalties still apply, as on llama.cpp


def test_v3_combo_sampler_kwargs() -> None:
    kw = v3.v3_sampler_kwargs(FALLBACK)
    assert set(kw) == V3_COMBO_PARAMS
    assert (kw["temperature"], kw["top_k"], kw["top_p"], kw["min_p"], kw["rep_p"]) == \
        (0.7, 0, 1.0, 0.0, 1.0)
    greedy = v3.v3_sampler_kwargs(_sampling(temperature=0.0, top_k=5, repetition_penalty=1.3))
    assert greedy["temperature"] == 0.0 and greedy["top_k"] == 0  # ComboSampler -> argmax
    assert greedy["rep_p"] == 1.3
    sampled = v3.v3_sampler_kwargs(_sampling(temperature=0.9, top_p=0.95, top_k=20, min_p=0.1))
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
    t = hf.read_chat_template(tmp_path)
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
    assert hf.read_chat_template(tmp_path).template == "DEFAULT"
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!")
    t = hf.read_chat_template(tmp_path)
    assert render_chat(t.template, [{"role": "user", "content": "yo"}]) == "yo!"


def test_template_absent_falls_back_to_chatml(tmp_path: Path) -> None:
    t = hf.read_chat_template(tmp_path)
    assert t.template is None
    assert render_chat(t.template, [{"role": "user", "content": "Hi"}]).endswith(
        "<|im_start|>assistant\n")


def test_raw_text_bos_rule(tmp_path: Path) -> None:
    llama3_post = {"type": "TemplateProcessing", "single": [
        {"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 0}},
        {"Sequence": {"id": "A", "type_id": 0}}]}
    t = hf.ChatTemplate(None, bos_token="<|begin_of_text|>")
    assert ex_folder.adds_bos(t, {"post_processor": llama3_post})
    assert ex_folder.adds_bos(t, {"post_processor": {"type": "Sequence",
                                                     "processors": [{"type": "ByteLevel"},
                                                                    llama3_post]}})
    smollm_post = {"type": "TemplateProcessing", "single": [{"Sequence": {"id": "A"}}]}
    assert not ex_folder.adds_bos(t, {"post_processor": smollm_post})
    assert not ex_folder.adds_bos(replace(t, add_bos_token=False), {"post_processor": llama3_post})
    assert ex_folder.adds_bos(replace(t, add_bos_token=True), {})


def test_eos_ids_from_int_and_list_forms() -> None:
    assert ex_folder.stop_token_ids({"eos_token_id": 2}, {"eos_token_id": 2}, 2) == [2]
    # Llama 3.1: a list in generation_config, an int in config.json
    assert ex_folder.stop_token_ids({"eos_token_id": [128001, 128008, 128009]},
                                    {"eos_token_id": 128001}, 128009) == [128001, 128008, 128009]
    assert ex_folder.stop_token_ids({}, {"text_config": {"eos_token_id": [1, 106]}},
                                    None) == [1, 106]
    assert ex_folder.stop_token_ids({"eos_token_id": True}, {}, -1) == []


def test_quant_label() -> None:
    label = ex_folder.quant_label
    assert label({"quantization_config": {"quant_method": "exl2", "bits": 4.0}}) == "4.0bpw"
    assert label({"quantization_config": {"quant_method": "exl3", "bits": 3.25}}) == "3.25bpw"
    assert label({"quantization_config": {"quant_method": "gptq", "bits": 4}}) == "4bit"
    assert label({}) is None


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
    ex_jobs.apply_final_result(_final_result(), stats)
    assert stats.finish_reason == "stop"
    assert stats.completion_tokens == 8  # the EOS the engine counted is not part of the reply
    assert (stats.prefill_tokens, stats.prefill_seconds) == (30, 0.0125)
    assert (stats.decode_tokens, stats.decode_seconds) == (8, 0.08)


def test_final_result_length_and_prefix_cache() -> None:
    stats = GenerationStats()
    ex_jobs.apply_final_result(_final_result(eos_reason="max_new_tokens", new_tokens=16,
                                             prompt_tokens=600, cached_tokens=512), stats)
    assert stats.finish_reason == "length" and stats.completion_tokens == 16
    assert stats.prefill_tokens == 88  # 512 tokens came from the prefix cache
    stats2 = GenerationStats()
    ex_jobs.apply_final_result(_final_result(prompt_tokens=256, cached_tokens=256), stats2)
    assert stats2.prefill_tokens == 1


# -- a generator that behaves as the engines' do ---------------------------------------------
#
# Rebuilt from the wheels' source (exllamav2 0.3.2 generator/dynamic.py, exllamav3 1.6.5
# generator/generator.py and generator/job.py); each rule below names where it comes from.
# What localrun never turns on (draft models, filters, banned and stop strings, token
# healing, logits/probs) is left out.

EOS = 2  # SmolLM2's <|im_end|>: the fixtures' config.json eos_token_id


class Ids:
    """The torch.Tensor API the engines and localrun use on token ids: a (1, n) tensor
    (``token_ids`` in results, ``input_ids`` in jobs). Like torch, ``len()`` is the size of
    the first dimension and a tensor of more than one element has no truth value."""

    def __init__(self, data: Any) -> None:
        self.data = data.data if isinstance(data, Ids) else json.loads(json.dumps(data))

    @property
    def shape(self) -> tuple[int, ...]:
        dims: list[int] = []
        d = self.data
        while isinstance(d, list):
            dims.append(len(d))
            d = d[0] if d else None
        return tuple(dims)

    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    def tolist(self) -> Any:
        return json.loads(json.dumps(self.data))

    def item(self) -> int:
        if self.numel() != 1:
            raise RuntimeError(f"a Tensor with {self.numel()} elements cannot be converted "
                               "to Scalar")
        d = self.data
        while isinstance(d, list):
            d = d[0]
        return int(d)

    def clone(self) -> Ids:
        return Ids(self)

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of a 0-d tensor")
        return self.shape[0]

    def __getitem__(self, k: int) -> Ids:
        return Ids(self.data[k])

    def __bool__(self) -> bool:
        if self.numel() != 1:
            raise RuntimeError("Boolean value of Tensor with more than one value is ambiguous")
        return bool(self.item())


class FakeTokenizer:
    """Byte-level pieces as both engines' ``get_id_to_piece_list`` hold them: a token that
    is part of a UTF-8 character decodes alone to U+FFFD, and ``decode`` of the tokens
    together gives the character. Special tokens keep their text in the list (exllamav3
    builds it with ``decode_batch(skip_special_tokens=False)``, tokenizer.py
    ``_get_fixed_vocab``). Text encodes one token per byte (ids 1000 + byte)."""

    bos_token = "<|im_start|>"
    eos_token = "<|im_end|>"
    bos_token_id = 1
    eos_token_id = EOS

    def __init__(self) -> None:
        self.vocab: dict[int, bytes] = {0: b"<|endoftext|>", 1: b"<|im_start|>",
                                        EOS: b"<|im_end|>"}
        self._ids: dict[bytes, int] = {v: k for k, v in self.vocab.items()}

    def ids(self, *pieces: str | bytes) -> list[int]:
        """Token ids for these pieces (bytes: one token each), adding them to the vocab."""
        out = []
        for p in pieces:
            b = p.encode() if isinstance(p, str) else p
            if b not in self._ids:
                self._ids[b] = 100 + len(self.vocab)
                self.vocab[self._ids[b]] = b
            out.append(self._ids[b])
        return out

    def piece(self, token: int) -> str:
        return self.vocab[token].decode("utf-8", errors="replace")

    def get_id_to_piece_list(self, include_special_tokens: bool = False) -> dict[int, str]:
        return {t: self.piece(t) for t in self.vocab}

    def decode(self, ids: Ids, decode_special_tokens: bool = False) -> list[str]:
        return [b"".join(self.vocab[t] for t in row).decode("utf-8", errors="replace")
                for row in ids.tolist()]

    def encode(self, text: str, add_bos: bool = False, encode_special_tokens: bool = False,
               **_: Any) -> Ids:
        ids = [1000 + b for b in text.encode()]
        return Ids([([self.bos_token_id] if add_bos else []) + ids])

    @staticmethod
    def text_of(ids: Sequence[int]) -> str:
        return bytes(i - 1000 for i in ids if 1000 <= i < 1256).decode(errors="replace")


class FakeJob:
    """What ExLlamaV2DynamicJob / exllamav3 Job keep: the arguments localrun passes, and the
    state their generators update. Jobs compare by identity, as the real ones do."""

    def __init__(self, input_ids: Ids, max_new_tokens: int,
                 stop_conditions: Sequence[int] | None = None, identifier: object = None,
                 max_rq_tokens: int | None = None, **kwargs: Any) -> None:
        self.input_ids = Ids(input_ids)
        self.prompt = [int(t) for t in self.input_ids.tolist()[0]]
        self.max_new_tokens = max_new_tokens
        self.stop_tokens = {int(t) for t in stop_conditions or []}
        self.identifier = identifier
        self.kwargs = kwargs
        self.max_rq_tokens = max_rq_tokens
        self.serial_number: int | None = None
        self.sequence = list(self.prompt)  # prompt + sampled tokens (the requeued prompt)
        self.prefilled = 0
        self.new_tokens = 0  # this segment's (exllamav3 restarts it on requeue)
        self.rq_new_tokens = 0
        self.held_text = ""
        self.held_tokens: list[int] = []
        self.full_completion = ""
        self.sampled = 0  # tokens of the script used so far


class FakeGenerator:
    """ExLlamaV2DynamicGenerator (``engine="exllamav2"``) or exllamav3 Generator.

    ``script`` maps a text found in the prompt to the tokens the "model" samples for it
    (EOS once they run out); ``fail`` maps such a text to where that job fails:
    "allocate" (page allocation at start), "prefill" or "forward" (the batched forward
    pass). exllamav3 contains the first two with ``reap_failed_job``; ExLlamaV2 contains
    nothing, and neither engine contains a failed forward pass: the exception leaves
    ``iterate()``.
    """

    def __init__(self, model: Any = None, cache: Any = None, tokenizer: Any = None, *,
                 engine: str = "exllamav3", script: Mapping[str, Sequence[int]] | None = None,
                 fail: Mapping[str, str] | None = None, max_batch_size: int = 8,
                 chunk: int = 4, max_rq_tokens: int | None = None, **kwargs: Any) -> None:
        if cache is not None:
            # ExLlamaV2DynamicGenerator.__init__ asserts both (dynamic.py)
            assert getattr(cache, "batch_size", 1) == 1, \
                "DynamicGenerator requires cache to have batch_size = 1"
            assert getattr(cache, "max_seq_len", 256) % 256 == 0, \
                "cache.max_seq_len must be multiple of 256"
        self.engine = engine
        self.model = model
        self.cache = cache
        self.tokenizer: FakeTokenizer = tokenizer if tokenizer is not None else TOK
        self.kwargs = kwargs
        self.script = dict(script or {})
        self.fail = dict(fail or {})
        self.max_batch_size = max_batch_size
        self.chunk = chunk
        self.max_rq_tokens = max_rq_tokens
        self.job_serial = 0
        self.pending_jobs: list[FakeJob] = []
        self.active_jobs: list[FakeJob] = []
        self.results: list[dict[str, Any]] = []  # every result iterate() returned
        self.cancelled: list[FakeJob] = []
        self.max_active = 0
        self.idle_calls = 0
        self.closed = False
        self.cleared = False
        if engine == "exllamav2":  # max_sampling_threads 16, filter_background_eval True
            self.sampling_pool = _Pool()
            self.filter_pool = _Pool()

    # -- the engines' public methods -------------------------------------------------------

    def num_remaining_jobs(self) -> int:
        return len(self.pending_jobs) + len(self.active_jobs)

    def enqueue(self, job: FakeJob) -> int:
        job.serial_number = self.job_serial
        self.job_serial += 1
        if self.max_rq_tokens is not None:
            job.max_rq_tokens = self.max_rq_tokens
        self.pending_jobs.append(job)
        return job.serial_number

    def cancel(self, job: FakeJob) -> None:
        """Both engines: remove the job from whichever queue holds it; an unknown job (one
        already finished or failed) is left alone, no error."""
        self.cancelled.append(job)
        if job in self.pending_jobs:
            self.pending_jobs.remove(job)
        elif job in self.active_jobs:
            self.active_jobs.remove(job)

    def clear_queue(self) -> None:
        self.cleared = True
        self.active_jobs.clear()
        self.pending_jobs.clear()

    def close(self) -> None:
        if self.engine != "exllamav3":  # ExLlamaV2DynamicGenerator has no close()
            raise AttributeError("'ExLlamaV2DynamicGenerator' object has no attribute 'close'")
        self.closed = True

    def reap_failed_job(self, job: FakeJob, error: BaseException,
                        results: list[dict[str, Any]]) -> None:
        """exllamav3 generator.py ``reap_failed_job``, as it is: no ``identifier``."""
        if job in self.active_jobs:
            self.active_jobs.remove(job)
        results.append({"job": job, "serial": job.serial_number, "stage": "error",
                        "eos": True, "error": error})

    def iterate(self) -> list[dict[str, Any]]:
        if not self.num_remaining_jobs():
            # The real one returns [] forever; stop a spinning caller well before a test's
            # time limit, so that a hung driver ends its thread.
            self.idle_calls += 1
            if self.idle_calls > 200_000:
                raise RuntimeError("iterate() called 200000 times with no job queued")
        results: list[dict[str, Any]] = []
        self._start_jobs(results)
        for job in list(self.active_jobs):
            if job.prefilled < len(job.sequence) - 1:
                self._guard(job, "prefill", results, lambda j=job: self._prefill(j, results))
        ready = [j for j in self.active_jobs if j.prefilled >= len(j.sequence) - 1]
        self.max_active = max(self.max_active, len(self.active_jobs))
        if ready and any(self._fails(j) == "forward" for j in ready):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        requeue = []
        for job in ready:
            if self._receive_sample(job, results):
                requeue.append(job)
        for job in requeue:  # generator.py: requeued jobs go to the front of the queue
            self.active_jobs.remove(job)
            self._prepare_for_requeue(job)
            self.pending_jobs.insert(0, job)
        self.results.extend(results)
        return results

    # -- inside the engines ------------------------------------------------------------------

    def _fails(self, job: FakeJob) -> str | None:
        text = self.tokenizer.text_of(job.prompt)
        return next((where for key, where in self.fail.items() if key in text), None)

    def _guard(self, job: FakeJob, stage: str, results: list[dict[str, Any]],
               step: Any) -> bool:
        if self._fails(job) != stage:
            step()
            return True
        error = RuntimeError(f"CUDA out of memory while {stage} (job {job.serial_number})")
        if self.engine == "exllamav2":
            raise error  # 0.3.2 has no reap_failed_job
        self.reap_failed_job(job, error, results)
        return False

    def _start_jobs(self, results: list[dict[str, Any]]) -> None:
        """iterate_start_jobs: move pending jobs in while the batch has room, allocate
        their pages, and report each as "started" (both engines)."""
        for job in list(self.pending_jobs):
            if len(self.active_jobs) >= self.max_batch_size:
                break
            self.pending_jobs.remove(job)
            self.active_jobs.append(job)
            if not self._guard(job, "allocate", results, lambda: None):
                continue
            r: dict[str, Any] = {"job": job, "stage": "started", "eos": False,
                                 "serial": job.serial_number}
            if job.identifier is not None:
                r["identifier"] = job.identifier
            results.append(r)

    def _prefill(self, job: FakeJob, results: list[dict[str, Any]]) -> None:
        """Job.prefill: one chunk of the prompt (all but its last token) per iteration."""
        total = len(job.sequence) - 1
        job.prefilled = min(job.prefilled + self.chunk, total)
        r: dict[str, Any] = {"job": job, "stage": "prefill", "eos": False,
                             "curr_progress": job.prefilled, "max_progress": total,
                             "serial": job.serial_number}
        if job.identifier is not None:
            r["identifier"] = job.identifier
        results.append(r)

    def _sample(self, job: FakeJob) -> int:
        text = self.tokenizer.text_of(job.prompt)
        reply = next((list(r) for key, r in self.script.items() if key in text), [])
        token = reply[job.sampled] if job.sampled < len(reply) else EOS
        job.sampled += 1
        return token

    def _receive_sample(self, job: FakeJob, results: list[dict[str, Any]]) -> bool:
        """Job.receive_sample (v2 dynamic.py, v3 job.py); True when the job requeues."""
        token = self._sample(job)
        job.new_tokens += 1
        job.sequence.append(token)
        job.prefilled = len(job.sequence) - 1
        # v3: requeue_now = new_tokens > max_rq_tokens - rq_margin (0 without drafting)
        requeue = self.engine == "exllamav3" and job.max_rq_tokens is not None and \
            job.new_tokens > job.max_rq_tokens
        job.held_text += self.tokenizer.piece(token)
        job.held_tokens.append(token)
        if token in job.stop_tokens:  # no emit_held: what is held goes out as "held"
            return self._emit(job, results, eos="stop_token", stop_token=token)
        if job.new_tokens >= job.max_new_tokens:
            return self._emit(job, results, eos="max_new_tokens", held=True)
        if self.engine == "exllamav2":
            # "Hold text if it contains an incomplete character"
            if 1 <= job.held_text.count("\ufffd") < 5:
                test = self.tokenizer.decode(Ids([job.held_tokens]))[0]
                if "\ufffd" in test:
                    return self._emit(job, results, requeue=requeue)
                job.held_text = test
        elif "\ufffd" in job.held_text:
            test = self.tokenizer.decode(Ids([job.held_tokens]))[0]
            # stop_string_max_length is 0 without stop strings
            if test.endswith("\ufffd") and len(test) <= 0 + 20:
                return self._emit(job, results, requeue=requeue)
            job.held_text = test
        return self._emit(job, results, held=True, requeue=requeue)

    def _emit(self, job: FakeJob, results: list[dict[str, Any]], *, eos: str | None = None,
              held: bool = False, stop_token: int | None = None, requeue: bool = False
              ) -> bool:
        """receive_sample's emit(): a "streaming" result."""
        r: dict[str, Any] = {"job": job, "stage": "streaming", "eos": eos is not None,
                             "serial": job.serial_number}
        if eos is not None:
            r["eos_reason"] = eos
            requeue = False  # v3: a finished job never requeues
            if eos == "stop_token":
                assert stop_token is not None
                r["eos_triggering_token_id"] = stop_token
                r["eos_triggering_token_str"] = self.tokenizer.piece(stop_token)
        if requeue:
            r["requeue"] = True
        if held:
            if self.engine == "exllamav3" and eos is not None and \
                    "\ufffd" in job.held_text and job.held_tokens:
                job.held_text = self.tokenizer.decode(Ids([job.held_tokens]))[0]
            if job.held_text:
                job.full_completion += job.held_text
                r["text"] = job.held_text
                job.held_text = ""
            if job.held_tokens:
                r["token_ids"] = Ids([job.held_tokens])
                job.held_tokens = []
        if eos is not None:
            new = job.new_tokens + (job.rq_new_tokens if self.engine == "exllamav3" else 0)
            r.update({
                "full_completion": job.full_completion,
                "new_tokens": new,
                "prompt_tokens": len(job.prompt),
                "time_enqueued": 0.0004,
                "time_prefill": 0.0125,
                "time_generate": 0.002 * max(new - 1, 0),
                "cached_pages": 0,
                "cached_tokens": 0,
            })
            rh: dict[str, Any] = {}
            if job.held_text:
                rh["text"] = job.held_text
            if job.held_tokens:
                rh["token_ids"] = Ids([job.held_tokens])
            if rh:
                r["held"] = rh
            self.active_jobs.remove(job)
        if job.identifier is not None:
            r["identifier"] = job.identifier
        results.append(r)
        return requeue

    def _prepare_for_requeue(self, job: FakeJob) -> None:
        """job.py prepare_for_requeue: the same job object, re-initialised with the sequence
        so far as its prompt; serial, held text and counts carry over."""
        job.rq_new_tokens += job.new_tokens
        job.max_new_tokens -= job.new_tokens
        job.new_tokens = 0
        job.prefilled = 0


class _Pool:
    def __init__(self) -> None:
        self.shut = False

    def shutdown(self, wait: bool = True) -> None:
        self.shut = True


TOK = FakeTokenizer()
HELLO = TOK.ids("Hel", "lo", "!")


def _prompt(text: str) -> Prompt:
    return Prompt(TOK.encode(text).tolist()[0], text)


def _make_job(prompt: Prompt, sampling: ResolvedSampling, ident: int) -> FakeJob:
    # What both sessions' make_job pass (exllama/session.py)
    return FakeJob(input_ids=Ids([list(prompt.tokens)]), max_new_tokens=sampling.max_tokens,
                   min_new_tokens=0, seed=sampling.seed, stop_conditions=[EOS],
                   decode_special_tokens=False, token_healing=False, identifier=ident)


def _drive(gen: FakeGenerator, prompts: Sequence[str], limits: Sequence[int] | None = None,
           cancels: Sequence[CancelToken] | None = None, max_concurrency: int | None = None
           ) -> tuple[Iterator[tuple[int, str | None]], list[GenerationStats]]:
    n = len(prompts)
    stats = [GenerationStats() for _ in range(n)]
    # the driver hands each sequence its limit already clamped, in sampling.max_tokens
    samplings = [replace(FALLBACK, max_tokens=limit) for limit in limits or [100] * n]
    it = ex_jobs.run_jobs(gen, _make_job, [_prompt(p) for p in prompts], samplings,
                          list(cancels or [CancelToken() for _ in range(n)]), stats,
                          max_concurrency, gen.engine)
    return it, stats


def _within(seconds: float, fn: Any) -> Any:
    """Run fn in a thread: a driver that waits forever on a job the engine dropped fails
    the test instead of hanging the suite (pytest-timeout is not a dependency)."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # re-raised in the test's thread
            box["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    if t.is_alive():
        pytest.fail(f"still running after {seconds} s: the driver hangs")
    if "error" in box:
        raise box["error"]
    return box.get("value")


ENGINES = ["exllamav2", "exllamav3"]


@pytest.mark.parametrize("engine", ENGINES)
def test_driver_streams_until_eos(engine: str) -> None:
    gen = FakeGenerator(engine=engine, script={"hi": HELLO})
    it, stats = _drive(gen, ["hi there"])
    events = list(it)
    assert events == [(0, "Hel"), (0, "lo"), (0, "!"), (0, None)]
    assert stats[0].finish_reason == "stop" and stats[0].completion_tokens == 3
    assert stats[0].prefill_tokens == len("hi there")
    assert stats[0].started > 0 and gen.num_remaining_jobs() == 0
    stages = [r["stage"] for r in gen.results]
    assert stages[:2] == ["started", "prefill"] and stages.count("prefill") == 2  # 7 / 4
    # the stop token's piece came back in "held"; it is not part of the reply
    assert gen.results[-1]["held"]["text"] == "<|im_end|>"


@pytest.mark.parametrize("engine", ENGINES)
def test_driver_held_back_utf8_counts_every_token(engine: str) -> None:
    # "é" and "🙂" arrive split across tokens: the engine holds the pieces back and sends
    # the character with all its tokens at once, token_ids a (1, n) tensor.
    reply = TOK.ids("caf", b"\xc3", b"\xa9", " ", b"\xf0", b"\x9f", b"\x99", b"\x82", "!")
    gen = FakeGenerator(engine=engine, script={"q": reply})
    it, stats = _drive(gen, ["q"])
    seen = []
    for i, piece in it:
        seen.append((piece, stats[i].completion_tokens))
    assert seen == [("caf", 1), ("é", 3), (" ", 4), ("🙂", 8), ("!", 9), (None, 9)]
    sizes = [r["token_ids"].shape for r in gen.results if "token_ids" in r]
    assert (1, 2) in sizes and (1, 4) in sizes


@pytest.mark.parametrize("engine", ENGINES)
def test_driver_stop_token_drops_what_the_engine_holds(engine: str) -> None:
    # A broken character right before EOS stays in "held" with the stop token.
    gen = FakeGenerator(engine=engine, script={"q": [*TOK.ids("Hi", b"\xc3"), EOS]})
    it, stats = _drive(gen, ["q"])
    assert [p for _, p in it] == ["Hi", None]
    final = gen.results[-1]
    assert final["eos_reason"] == "stop_token" and "text" not in final
    assert final["held"]["text"] == "\ufffd<|im_end|>"
    assert final["held"]["token_ids"].shape == (1, 2)
    assert stats[0].finish_reason == "stop" and stats[0].completion_tokens == 2


@pytest.mark.parametrize("engine", ENGINES)
def test_driver_length_limit(engine: str) -> None:
    gen = FakeGenerator(engine=engine, script={"q": TOK.ids("a", "b", "c", "d")})
    it, stats = _drive(gen, ["q"], [2])
    assert [p for _, p in it] == ["a", "b", None]
    assert stats[0].finish_reason == "length" and stats[0].completion_tokens == 2


def test_driver_length_limit_inside_a_character() -> None:
    # exllamav3 decodes what it still holds when max_new_tokens ends the job
    gen = FakeGenerator(engine="exllamav3", script={"q": TOK.ids("a", b"\xc3", b"\xa9")})
    it, stats = _drive(gen, ["q"], [2])
    assert [p for _, p in it] == ["a", "\ufffd", None]
    assert stats[0].completion_tokens == 2


@pytest.mark.parametrize("engine", ENGINES)
def test_driver_no_room_and_cancel(engine: str) -> None:
    gen = FakeGenerator(engine=engine, script={"long": TOK.ids(*"xxxxxxxxxx"),
                                               "short": TOK.ids("y")})
    cancels = [CancelToken(), CancelToken()]
    it, stats = _drive(gen, ["long", "short"], [10, 0], cancels)
    seen: list[tuple[int, str | None]] = []
    for i, piece in it:
        seen.append((i, piece))
        if piece == "x" and len([p for j, p in seen if j == 0]) == 2:
            cancels[0].cancel()
    assert (1, None) in seen and stats[1].finish_reason == "length"  # no room for a reply
    assert [j.prompt for j in gen.cancelled] == [_prompt("long").tokens]
    assert seen[-1] == (0, None) and gen.num_remaining_jobs() == 0
    assert stats[0].completion_tokens == 2 and stats[0].finish_reason is None


@pytest.mark.parametrize("engine", ENGINES)
def test_driver_batch_honours_max_concurrency(engine: str) -> None:
    script = {f"p{i}": TOK.ids(*[f"w{i}"] * (i + 1)) for i in range(5)}
    gen = FakeGenerator(engine=engine, script=script)
    it, stats = _drive(gen, [f"p{i}" for i in range(5)], max_concurrency=2)
    done = [i for i, p in it if p is None]
    assert sorted(done) == [0, 1, 2, 3, 4]
    assert gen.max_active == 2
    assert [s.completion_tokens for s in stats] == [1, 2, 3, 4, 5]


def test_driver_close_cancels_queued_jobs() -> None:
    gen = FakeGenerator(script={"a": TOK.ids(*"aaaaaaaaaa"), "b": TOK.ids(*"bbbbbbbbbb")})
    it, _ = _drive(gen, ["a", "b"])
    for _, piece in it:
        if piece:
            break
    it.close()  # type: ignore[attr-defined]
    assert len(gen.cancelled) == 2 and gen.num_remaining_jobs() == 0


def test_driver_requeued_job_is_one_sequence(monkeypatch: pytest.MonkeyPatch) -> None:
    # exllamav3 requeues a job past max_rq_tokens: "requeue" on a result, then the same job
    # object (same serial) is "started" and prefilled again.
    clock = iter(range(1, 1000))
    monkeypatch.setattr(ex_jobs, "time", SimpleNamespace(perf_counter=lambda: float(next(clock))))
    gen = FakeGenerator(engine="exllamav3", script={"q": TOK.ids(*"abcdef")},
                        max_rq_tokens=2)
    it, stats = _drive(gen, ["q"])
    assert "".join(p for _, p in it if p) == "abcdef"
    assert [r["stage"] for r in gen.results].count("started") == 3
    assert any(r.get("requeue") for r in gen.results)
    assert stats[0].started == 1.0  # the first start, not a requeue's
    assert stats[0].finish_reason == "stop" and stats[0].completion_tokens == 6


@pytest.mark.parametrize("where", ["allocate", "prefill"])
def test_failed_job_ends_only_its_sequence(where: str) -> None:
    """exllamav3 reports the failure without "identifier" (reap_failed_job); localrun used
    to skip it and wait forever on empty iterate() results."""
    gen = FakeGenerator(engine="exllamav3", fail={"bad": where},
                        script={"one": TOK.ids("A", "1"), "two": TOK.ids("B", "2")})
    it, stats = _drive(gen, ["one", "bad", "two"])
    events: list[tuple[int, str | None]] = []

    def consume() -> None:
        for event in it:
            events.append(event)

    with pytest.raises(ex_errors.EngineJobError) as e:
        _within(10, consume)
    assert "ExLlamaV3" in str(e.value) and "sequence 1:" in str(e.value)
    assert f"CUDA out of memory while {where}" in str(e.value)
    assert isinstance(e.value, GenerationError) and e.value.hint
    assert isinstance(e.value.__cause__, RuntimeError)
    assert "".join(p for i, p in events if i == 0 and p) == "A1"
    assert "".join(p for i, p in events if i == 2 and p) == "B2"
    assert (0, None) in events and (2, None) in events and (1, None) not in events
    assert stats[0].finish_reason == stats[2].finish_reason == "stop"
    assert gen.num_remaining_jobs() == 0


def test_job_the_engine_drops_is_reported_not_waited_for() -> None:
    class Dropping(FakeGenerator):
        """A job that leaves the queues with no result at all (any result shape localrun
        does not know would look the same to it)."""

        def iterate(self) -> list[dict[str, Any]]:
            results = super().iterate()
            for job in list(self.active_jobs):
                if "lost" in self.tokenizer.text_of(job.prompt):
                    self.active_jobs.remove(job)
            return [r for r in results if "lost" not in self.tokenizer.text_of(r["job"].prompt)]

    gen = Dropping(engine="exllamav3", script={"ok": TOK.ids("fine")})
    it, _ = _drive(gen, ["ok", "lost"])
    with pytest.raises(ex_errors.EngineJobError,
                       match="sequence 1: the job left the engine's queue"):
        _within(10, lambda: list(it))


@pytest.mark.parametrize("engine", ENGINES)
def test_failed_forward_pass_ends_the_call_and_frees_the_queue(engine: str) -> None:
    gen = FakeGenerator(engine=engine, fail={"bad": "forward"},
                        script={"ok": TOK.ids(*"abc")})
    it, _ = _drive(gen, ["ok", "bad"])
    with pytest.raises(RuntimeError, match="illegal memory access"):
        _within(10, lambda: list(it))
    assert gen.num_remaining_jobs() == 0  # both cancelled: the next call starts clean


def test_v2_unreaped_failure_raises_out_of_iterate() -> None:
    # ExLlamaV2 0.3.2 has no reap_failed_job: a failing prefill raises from iterate()
    gen = FakeGenerator(engine="exllamav2", fail={"bad": "prefill"}, script={"ok": HELLO})
    it, _ = _drive(gen, ["ok", "bad"])
    with pytest.raises(RuntimeError, match="CUDA out of memory while prefill"):
        _within(10, lambda: list(it))
    assert gen.num_remaining_jobs() == 0


# -- options, context fit, GPU split -----------------------------------------------------------

def test_kv_cache_option() -> None:
    assert ex_options.parse_options("exllamav2", {}).kv_cache == "fp16"
    assert ex_options.parse_options("exllamav2", {"kv_cache": "Q4"}).kv_cache == "q4"
    assert ex_options.parse_options("exllamav3", {"kv_cache": 8}).kv_cache == "q8"
    for bad in ("q5", "fp8", True, None, 4.5):
        with pytest.raises(InvalidOptionError) as e:
            ex_options.parse_options("exllamav2", {"kv_cache": bad})
        assert "kv_cache" in str(e.value) and "fp16, q8, q6, q4" in str(e.value)
        assert e.value.hint
    assert set(v2.V2_CACHE_CLASS) == set(v3.V3_CACHE_BITS) == set(ex_options.KV_CACHE_CHOICES)


def test_unknown_and_bad_options() -> None:
    with pytest.raises(InvalidOptionError, match="n_gpu_layers"):
        ex_options.parse_options("exllamav2", {"n_gpu_layers": -1})
    with pytest.raises(InvalidOptionError, match="tensor_parallel=1"):
        ex_options.parse_options("exllamav2", {"tensor_parallel": 1})
    # ExLlamaV2 0.3.2 has tensor parallel too (model.load_tp, ExLlamaV2Cache_TP)
    assert ex_options.parse_options("exllamav2", {"tensor_parallel": True}).tensor_parallel is True
    assert "tensor_parallel" in ex_options.OPTIONS["exllamav2"]
    with pytest.raises(InvalidOptionError, match="gpu_split"):
        ex_options.parse_options("exllamav3", {"gpu_split": [0, 0]})
    assert ex_options.parse_options("exllamav3", {"gpu_split": "20, 24"}).gpu_split == (20.0, 24.0)


SHAPE_8B = ModelShape(n_layers=32, n_kv_heads=8, head_dim=128, trained_context=131072)


def test_kv_bytes_are_memory_pys() -> None:
    """The loader's KV figure is the planner's (localrun.memory), at the cache's element
    size: fractional for quantized caches, a partial byte per token rounded up."""
    from localrun import memory
    from localrun.backends import engine_memory

    assert ModelShape(1, 1, 1).kv_bytes_per_token(0.5 + 1 / 16) == 2  # 1.125 bytes
    for engine in ENGINES:
        fp16 = ex_vram.kv_bytes_per_token(engine, SHAPE_8B, "fp16", 1)
        planned = memory.estimate(0, SHAPE_8B, 8192,
                                  engine=engine_memory(engine)).kv_cache_bytes
        assert fp16 * 8192 == planned == 1 * GiB
    q4 = SHAPE_8B.kv_bytes_per_token(0.5 + 1 / 16)
    assert ex_vram.kv_bytes_per_token("exllamav3", SHAPE_8B, "q4", 2) == q4
    # ExLlamaV2's quantized cache adds one layer's fp16 K/V per GPU to dequantize into
    layer = 2 * 8 * 128 * 2
    assert ex_vram.kv_bytes_per_token("exllamav2", SHAPE_8B, "q4", 2) == q4 + 2 * layer


def test_context_defaults_and_requests_without_vram_numbers() -> None:
    c = ex_vram.choose_context("exllamav2", model="m", requested=None, trained=131072, weights=0,
                               shape=SHAPE_8B, free_vram=[])
    assert (c.context, c.cache_tokens) == (8192, 8192)
    c = ex_vram.choose_context("exllamav2", model="m", requested=1000, trained=2048, weights=0,
                               shape=None, free_vram=[24 * GiB])
    assert (c.context, c.cache_tokens) == (1000, 1024)  # cache in whole 256-token pages
    c = ex_vram.choose_context("exllamav3", model="m", requested=4096, trained=2000, weights=0,
                               shape=None, free_vram=[])
    assert (c.context, c.cache_tokens) == (2000, 2048)


def test_context_shrinks_to_free_vram() -> None:
    # 8B at 4.0bpw (~5 GiB) on a 12 GB card with 6 GiB free: FP16 KV is 128 KiB per token.
    weights = 5 * GiB
    c = ex_vram.choose_context("exllamav2", model="m", requested=None, trained=131072,
                               weights=weights, shape=SHAPE_8B, free_vram=[6 * GiB])
    per_token = 32 * 2 * 8 * 128 * 2
    budget = 6 * GiB - 256 * 2**20 - weights - (256 * 2**20 + int(weights * 0.05))
    assert c.context == budget // per_token // 256 * 256 == 2048
    q4 = ex_vram.choose_context("exllamav2", model="m", requested=None, trained=131072,
                                weights=weights, shape=SHAPE_8B, free_vram=[6 * GiB],
                                kv_cache="q4")
    assert q4.context > 3 * c.context  # a Q4 cache holds ~3.5x the tokens
    roomy = ex_vram.choose_context("exllamav3", model="m", requested=None, trained=131072,
                                   weights=weights, shape=SHAPE_8B, free_vram=[20 * GiB, 20 * GiB])
    assert roomy.context == 8192 and "trained" not in roomy.reason


def test_context_refusals_say_what_fits() -> None:
    with pytest.raises(ModelTooLargeError) as e:
        ex_vram.choose_context("exllamav2", model="m", requested=32768, trained=131072,
                               weights=5 * GiB, shape=SHAPE_8B, free_vram=[6 * GiB])
    assert e.value.max_context == 2048 and "kv_cache='q4'" in (e.value.hint or "")
    with pytest.raises(ModelTooLargeError) as e2:
        ex_vram.choose_context("exllamav3", model="m", requested=None, trained=8192,
                               weights=40 * GiB, shape=SHAPE_8B, free_vram=[24 * GiB])
    assert e2.value.max_context == 0 and "weights do not fit" in (e2.value.hint or "")


def test_gpu_split_decisions() -> None:
    opts = ex_options.LoadOptions()
    assert ex_vram.plan_split("exllamav2", 1, device=None, options=opts).mode == "autosplit"
    two = ex_vram.plan_split("exllamav2", 2, device=None, options=opts)
    assert two.mode == "autosplit" and two.devices == (0, 1)
    tp = ex_vram.plan_split("exllamav3", 2, device=None, options=opts, supports_tp=True)
    assert tp.mode == "tensor_parallel"
    assert ex_vram.plan_split("exllamav3", 2, device=None, options=opts,
                              supports_tp=False).mode == "autosplit"
    no_tp = ex_options.LoadOptions(tensor_parallel=False)
    assert ex_vram.plan_split("exllamav3", 2, device=None, options=no_tp).mode == "autosplit"
    # ExLlamaV2: tensor parallel when asked, never by default
    tp_on = ex_options.LoadOptions(tensor_parallel=True)
    v2tp = ex_vram.plan_split("exllamav2", 2, device=None, options=tp_on)
    assert v2tp.mode == "tensor_parallel" and v2tp.devices == (0, 1)
    assert ex_vram.plan_split("exllamav2", 1, device=None, options=tp_on).mode == "autosplit"
    v2tp_split = ex_vram.plan_split("exllamav2", 2, device=None,
                                    options=ex_options.LoadOptions(gpu_split=(10.0, 12.0),
                                                                   tensor_parallel=True))
    assert (v2tp_split.mode, v2tp_split.gpu_split) == ("tensor_parallel", (10.0, 12.0))
    for engine in ("exllamav2", "exllamav3"):
        for opts_tp in (tp_on, ex_options.LoadOptions(gpu_split=(10.0, 12.0),
                                                      tensor_parallel=True)):
            with pytest.raises(InvalidOptionError, match="no tensor-parallel support"):
                ex_vram.plan_split(engine, 2, device=None, options=opts_tp, supports_tp=False)
    single = ex_vram.plan_split("exllamav2", 3, device="cuda:2", options=opts)
    assert single.mode == "single" and single.devices == (2,)
    assert single.gpu_split is not None and single.gpu_split[:2] == (0.0, 0.0)
    manual = ex_vram.plan_split("exllamav2", 2, device=None,
                                options=ex_options.LoadOptions(gpu_split=(0.0, 20.0)))
    assert manual.mode == "manual" and manual.devices == (1,)
    with pytest.raises(InvalidOptionError, match="cuda:0 to cuda:1"):
        ex_vram.plan_split("exllamav2", 2, device="cuda:5", options=opts)
    with pytest.raises(InvalidOptionError):
        ex_vram.plan_split("exllamav2", 1, device="cpu", options=opts)
    with pytest.raises(EngineUnavailableError):
        ex_vram.plan_split("exllamav3", 0, device=None, options=opts)
    assert ex_vram.free_for_split([10 * GiB, 30 * GiB], manual) == [20 * GiB]


def _v2_fill(weights_split: Sequence[float], layers: int, layer_weights: int,
             layer_cache: int, fixed: int) -> list[int]:
    """Bytes each GPU ends up holding when ExLlamaV2 loads with ``load(gpu_split)``:
    model.py set_device_map takes the fixed buffers off each GPU's allocation, then puts
    each layer on the first GPU with room left for its weights; the cache of a layer goes
    where the layer is (set_cache_map)."""
    room = [int(gb * GiB) - fixed for gb in weights_split]
    used = [fixed] * len(room)
    dev = 0
    for _ in range(layers):
        while layer_weights > room[dev]:
            dev += 1
            assert dev < len(room), "Insufficient space in device allocation"
        room[dev] -= layer_weights
        used[dev] += layer_weights + layer_cache
    return used


def test_gpu_split_means_weights_and_cache_on_both_engines() -> None:
    # 32 layers: 4 GiB of weights, 2 GiB of KV cache, 100 MiB of fixed buffers per GPU
    layers, fixed = 32, 100 * 2**20
    weights, cache = 4 * GiB, 2 * GiB
    split = ex_vram.plan_split("exllamav2", 2, device=None,
                               options=ex_options.LoadOptions(gpu_split=(4.0, 4.0)))
    given = _v2_fill(split.gpu_split or (), layers, weights // layers, cache // layers, fixed)
    assert given[0] > 5.5 * GiB  # handed over as is, GPU 0 takes 5.8 GiB of its "4"
    converted = v2.v2_weights_split(split, weights, cache)
    assert converted == pytest.approx([4 * 2 / 3, 4 * 2 / 3])
    used = _v2_fill(converted, layers, weights // layers, cache // layers, fixed)
    assert all(u <= 4 * GiB for u in used) and sum(used) == weights + cache + 2 * fixed
    # what localrun's context fit budgets is the same figure: min(free, gpu_split) per GPU
    assert ex_vram.free_for_split([24 * GiB, 24 * GiB], split) == [4 * GiB, 4 * GiB]
    # the other plans go to the engine as they are
    single = ex_vram.plan_split("exllamav2", 2, device="cuda:1", options=ex_options.LoadOptions())
    assert v2.v2_weights_split(single, weights, cache) == [0.0, 1e6]
    assert v2.v2_weights_split(split, weights, None) == [4.0, 4.0]


def test_import_errors_become_one_line_errors() -> None:
    e = ex_errors.engine_import_error(
        "exllamav2", OSError("CUDA_HOME environment variable is not set. Please set it to your "
                             "CUDA install root."))
    assert isinstance(e, EngineUnavailableError) and e.hint
    assert "NVIDIA GPU with CUDA" in str(e) and "CUDA_HOME" in str(e)
    missing = ex_errors.engine_import_error("exllamav3",
                                            ModuleNotFoundError("No module named 'torch'"))
    assert isinstance(missing, EngineNotInstalledError)
    assert "[exllamav3]'" in str(missing)


# -- the sessions' engine-facing calls, against fake engine modules ----------------------------
#
# Both engines need CUDA to import, so these modules stand in for them, with the
# signatures and the assertions of exllamav2 0.3.2 (config.py, model.py, cache.py,
# tensor_p.py) and exllamav3 1.6.5 (model/model.py, cache/cache.py) that localrun's
# calls can trip. The generator is FakeGenerator above.

#: exllamav2 0.3.2 architecture.py: the architectures with ``supports_tp = True`` (an
#: unknown one loads as Llama, with it).
V2_TP_ARCHS = {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
               "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Glm4ForCausalLM"}
V2_KNOWN_NO_TP = {"Gemma2ForCausalLM", "Phi3ForCausalLM", "CohereForCausalLM"}


class V2Config:
    def __init__(self, model_dir: str) -> None:
        c = json.loads((Path(model_dir) / "config.json").read_text())
        self.model_dir = model_dir
        self.max_seq_len = int(c.get("max_position_embeddings", 2048))
        self.max_input_len = 2048
        self.max_attention_size = 2048**2
        self.no_flash_attn = False
        self.num_hidden_layers = int(c["num_hidden_layers"])
        self.num_key_value_heads = int(c.get("num_key_value_heads", c["num_attention_heads"]))
        self.head_dim = int(c["hidden_size"]) // int(c["num_attention_heads"])
        self.intermediate_size = int(c.get("intermediate_size", 0))
        arch = c["architectures"][0]
        tp = arch in V2_TP_ARCHS or arch not in V2_KNOWN_NO_TP
        self.arch = SimpleNamespace(arch_string=arch, lm=SimpleNamespace(supports_tp=tp))

    def arch_compat_overrides(self, quiet: bool = False, warn_only: bool = False) -> None:
        pass


class V2Model:
    def __init__(self, config: V2Config) -> None:
        self.config = config
        self.calls: list[tuple[Any, ...]] = []
        self.loaded = False
        self.tp_context: object | None = None
        self.unloaded = False

    def load(self, gpu_split: list[float] | None = None, lazy: bool = False,
             stats: bool = False, callback: Any = None, callback_gen: Any = None,
             progress: bool = False) -> None:
        self.calls.append(("load", gpu_split))
        self.loaded = True

    def load_autosplit(self, cache: V2Cache, reserve_vram: Any = None,
                       last_id_only: bool = False, callback: Any = None,
                       callback_gen: Any = None, progress: bool = False) -> None:
        assert cache.lazy, "cache must be lazy for autosplit"
        self.calls.append(("load_autosplit", cache))
        self.loaded = True

    def load_tp(self, gpu_split: list[float] | None = None, callback: Any = None,
                callback_gen: Any = None, progress: bool = False,
                expect_cache_tokens: int = 0, expect_cache_base: type | None = None) -> None:
        cfg = self.config
        # tensor_p.py TPContext.__init__
        assert cfg.arch.lm.supports_tp, \
            f"Tensor-parallel is not supported for {cfg.arch.arch_string}"
        assert cfg.intermediate_size % 128 == 0, \
            "Model intermediate size must be divisible by 128"
        self.calls.append(("load_tp", gpu_split, expect_cache_tokens, expect_cache_base))
        self.tp_context = object()
        self.loaded = True

    def unload(self) -> None:
        self.unloaded = True


class V2Cache:
    def __init__(self, model: V2Model, batch_size: int = 1, max_seq_len: int = -1,
                 copy_from: Any = None, lazy: bool = False,
                 num_key_value_heads: int | None = None, fixed_device: int | None = None
                 ) -> None:
        # a non-lazy cache is allocated on the devices the loaded model's layers are on
        assert lazy or model.loaded, "model must be loaded before a non-lazy cache"
        self.model = model
        self.batch_size = batch_size
        self.max_seq_len = model.config.max_seq_len if max_seq_len == -1 else max_seq_len
        self.lazy = lazy


class V2Cache_Q8(V2Cache):
    pass


class V2Cache_Q6(V2Cache):
    pass


class V2Cache_Q4(V2Cache):
    pass


class V2Cache_TP:
    def __init__(self, model: V2Model, base: type = V2Cache, batch_size: int = 1,
                 max_seq_len: int = -1) -> None:
        assert model.tp_context is not None, \
            "Cannot create TP cache unless model is loaded with load_tp()"
        self.base = base
        self.batch_size = batch_size
        self.max_seq_len = model.config.max_seq_len if max_seq_len == -1 else max_seq_len


def _module(name: str, **attrs: Any) -> types.ModuleType:
    m = types.ModuleType(name)
    for k, v in attrs.items():
        setattr(m, k, v)
    return m


def _fake_torch() -> types.ModuleType:
    return _module("torch", long="int64",
                   tensor=lambda data, dtype=None: Ids(data),
                   cuda=SimpleNamespace(empty_cache=lambda: None))


def _install(monkeypatch: pytest.MonkeyPatch, modules: dict[str, types.ModuleType]) -> None:
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)


def fake_exllamav2(monkeypatch: pytest.MonkeyPatch, gen_kw: dict[str, Any]
                   ) -> dict[str, Any]:
    """Install the fake; return what the session made (model, cache, generator)."""
    made: dict[str, Any] = {}

    def model_cls(cfg: V2Config) -> V2Model:
        made["model"] = V2Model(cfg)
        return made["model"]

    def generator_cls(**kw: Any) -> FakeGenerator:
        made["cache"] = kw["cache"]
        made["generator"] = FakeGenerator(engine="exllamav2", **kw, **gen_kw)
        return made["generator"]

    cache_mod = _module("exllamav2.cache", ExLlamaV2Cache=V2Cache, ExLlamaV2Cache_Q8=V2Cache_Q8,
                        ExLlamaV2Cache_Q6=V2Cache_Q6, ExLlamaV2Cache_Q4=V2Cache_Q4,
                        ExLlamaV2Cache_TP=V2Cache_TP)
    _install(monkeypatch, {
        "torch": _fake_torch(),
        "exllamav2": _module("exllamav2", ExLlamaV2=model_cls, ExLlamaV2Config=V2Config,
                             ExLlamaV2Tokenizer=lambda cfg: TOK,
                             ExLlamaV2Cache_TP=V2Cache_TP, cache=cache_mod),
        "exllamav2.cache": cache_mod,
        "exllamav2.attn": _module("exllamav2.attn", has_flash_attn_with_paged=True),
        "exllamav2.generator": _module(
            "exllamav2.generator", ExLlamaV2DynamicGenerator=generator_cls,
            ExLlamaV2DynamicJob=FakeJob,
            ExLlamaV2Sampler=SimpleNamespace(Settings=lambda **kw: SimpleNamespace(**kw))),
    })
    return made


class V3Model:
    def __init__(self, cfg: SimpleNamespace) -> None:
        self.config = cfg
        self.caps = {"supports_tp": cfg.architecture in V2_TP_ARCHS}
        self.calls: list[dict[str, Any]] = []
        self.unloaded = False

    def load(self, device: Any = None, reserve_per_device: Any = None,
             use_per_device: Any = None, tensor_p: bool = False, **kw: Any) -> None:
        # model/model.py load_gen
        assert not (bool(reserve_per_device) and bool(use_per_device)), \
            "Cannot specify both memory usage and memory reserve."
        if device is not None:
            assert not use_per_device and not tensor_p
        elif tensor_p and not self.caps.get("supports_tp"):
            raise NotImplementedError("Tensor-parallel is not currently implemented for "
                                      f"{self.config.architecture}")
        self.calls.append({"device": device, "use_per_device": use_per_device,
                           "tensor_p": tensor_p, **kw})

    def unload(self) -> None:
        self.unloaded = True


def fake_exllamav3(monkeypatch: pytest.MonkeyPatch, gen_kw: dict[str, Any]
                   ) -> dict[str, Any]:
    made: dict[str, Any] = {}

    def from_directory(path: str) -> SimpleNamespace:
        c = json.loads((Path(path) / "config.json").read_text())
        return SimpleNamespace(directory=path, architecture=c["architectures"][0])

    def from_config(cfg: SimpleNamespace) -> V3Model:
        made["model"] = V3Model(cfg)
        return made["model"]

    def cache_cls(model: V3Model, max_num_tokens: int, **kw: Any) -> SimpleNamespace:
        assert max_num_tokens % 256 == 0
        made["cache"] = SimpleNamespace(max_num_tokens=max_num_tokens, **kw)
        return made["cache"]

    def generator_cls(**kw: Any) -> FakeGenerator:
        made["generator"] = FakeGenerator(engine="exllamav3", **kw, **gen_kw)
        return made["generator"]

    _install(monkeypatch, {
        "torch": _fake_torch(),
        "exllamav3": _module(
            "exllamav3", Cache=cache_cls, CacheLayer_fp16=object, CacheLayer_quant=int,
            ComboSampler=lambda **kw: SimpleNamespace(**kw),
            Config=SimpleNamespace(from_directory=from_directory),
            Generator=generator_cls, Job=FakeJob,
            Model=SimpleNamespace(from_config=from_config),
            Tokenizer=SimpleNamespace(from_config=lambda cfg: TOK)),
    })
    return made


def _model_folder(folder: Path, arch: str = "LlamaForCausalLM", *,
                  weights_gib: float = 0.0) -> Path:
    """A model folder with a real config; the weights file is sparse, so "4 GiB of
    weights" takes no disk."""
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "architectures": [arch], "model_type": "llama", "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096,
        "intermediate_size": 14336, "max_position_embeddings": 8192, "eos_token_id": EOS,
        "quantization_config": {"quant_method": "exl2", "bits": 4.0}}))
    with open(folder / "model.safetensors", "wb") as f:
        f.truncate(int(weights_gib * GiB) or 1024)
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    return folder


def _v2_session(monkeypatch: pytest.MonkeyPatch, folder: Path, free: list[int],
                gen_kw: dict[str, Any] | None = None, **options: Any
                ) -> tuple[Any, dict[str, Any]]:
    made = fake_exllamav2(monkeypatch, gen_kw or {})
    monkeypatch.setattr(ex_session, "probe_cuda", lambda engine: list(free))
    return v2.ExLlamaV2Session(LoadRequest(str(folder), "exl2", options=options)), made


def _v3_session(monkeypatch: pytest.MonkeyPatch, folder: Path, free: list[int],
                gen_kw: dict[str, Any] | None = None, **options: Any
                ) -> tuple[Any, dict[str, Any]]:
    made = fake_exllamav3(monkeypatch, gen_kw or {})
    monkeypatch.setattr(ex_session, "probe_cuda", lambda engine: list(free))
    return v3.ExLlamaV3Session(LoadRequest(str(folder), "exl3", options=options)), made


def test_v2_tensor_parallel_loads_with_load_tp(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    folder = _model_folder(tmp_path / "m", weights_gib=4)
    session, made = _v2_session(monkeypatch, folder, [20 * GiB, 20 * GiB],
                                gen_kw={"script": {"France": TOK.ids("Paris", ".")}},
                                tensor_parallel=True, kv_cache="q4")
    cache_tokens = session.context  # 8192: whole pages already
    assert session.split.mode == "tensor_parallel" and session.split.devices == (0, 1)
    # tabbyAPI's recipe: load_tp(split, expect_cache_tokens, expect_cache_base), then a
    # TP cache over the same cache class
    assert made["model"].calls == [("load_tp", None, cache_tokens, V2Cache_Q4)]
    cache = made["cache"]
    assert isinstance(cache, V2Cache_TP) and cache.base is V2Cache_Q4
    assert (cache.max_seq_len, cache.batch_size) == (cache_tokens, 1)
    with localrun.Model(session) as m:
        assert m.chat("What is the capital of France?").text == "Paris."
    assert made["model"].unloaded


def test_v2_tensor_parallel_with_gpu_split_passes_it_whole(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = _model_folder(tmp_path / "m", weights_gib=4)
    _, made = _v2_session(monkeypatch, folder, [20 * GiB, 20 * GiB],
                          tensor_parallel=True, gpu_split=[10, 12])
    # load_tp's gpu_split already counts the cache it expects: no conversion
    assert made["model"].calls[0][:2] == ("load_tp", [10.0, 12.0])


def test_v2_tensor_parallel_refused_where_the_engine_has_none(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = _model_folder(tmp_path / "m", arch="Gemma2ForCausalLM", weights_gib=4)
    with pytest.raises(InvalidOptionError, match="tensor_parallel") as e:
        _v2_session(monkeypatch, folder, [20 * GiB, 20 * GiB], tensor_parallel=True)
    assert "no tensor-parallel support" in str(e.value) and e.value.hint
    # without the option, two GPUs are filled in turn (ExLlamaV2's TP is opt-in)
    session, made = _v2_session(monkeypatch, folder, [20 * GiB, 20 * GiB])
    assert session.split.mode == "autosplit"
    assert made["model"].calls[0][0] == "load_autosplit"


def test_v2_gpu_split_reaches_load_as_a_weights_budget(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = _model_folder(tmp_path / "m", weights_gib=4)
    session, made = _v2_session(monkeypatch, folder, [20 * GiB, 20 * GiB],
                                gpu_split=[4, 4])
    assert session.context == 8192  # the trained context
    # 8192 tokens of FP16 cache for 32 layers x 8 KV heads x 128: 1 GiB, on top of the
    # weights wherever the layers go; load() gets the weights' share of each GPU's 4 GiB.
    cache = 8192 * 32 * 2 * 8 * 128 * 2
    weights = 4 * GiB
    expected = [4 * weights / (weights + cache)] * 2
    (name, split), = made["model"].calls
    assert name == "load" and split == pytest.approx(expected) and split[0] == pytest.approx(3.2)
    assert isinstance(made["cache"], V2Cache) and not made["cache"].lazy
    assert session.split.gpu_split == (4.0, 4.0)


@pytest.mark.parametrize("tp", [None, True])
def test_v3_gpu_split_is_use_per_device_unchanged(tmp_path: Path, tp: bool | None,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    folder = _model_folder(tmp_path / "m", weights_gib=4)
    options: dict[str, Any] = {"gpu_split": [6, 6]}
    if tp:
        options["tensor_parallel"] = True
    _, made = _v3_session(monkeypatch, folder, [20 * GiB, 20 * GiB], **options)
    call = made["model"].calls[0]
    assert call["use_per_device"] == [6.0, 6.0] and call["tensor_p"] is bool(tp)


def test_v3_option_errors_are_not_load_failures(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    # InvalidOptionError is a ValueError: it used to come out as "could not load it"
    folder = _model_folder(tmp_path / "m", arch="Gemma2ForCausalLM", weights_gib=4)
    with pytest.raises(InvalidOptionError, match="tensor_parallel"):
        _v3_session(monkeypatch, folder, [20 * GiB, 20 * GiB], tensor_parallel=True)
    with pytest.raises(InvalidOptionError, match="tensor_parallel"):
        _v3_session(monkeypatch, folder, [20 * GiB, 20 * GiB], tensor_parallel=True,
                    gpu_split=[6, 6])


def test_v3_close_closes_the_generator(tmp_path: Path,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    folder = _model_folder(tmp_path / "m", weights_gib=4)
    session, made = _v3_session(monkeypatch, folder, [20 * GiB])
    localrun.Model(session).close()
    gen = made["generator"]
    assert gen.cleared and gen.closed and made["model"].unloaded
    session.close()  # idempotent


def test_v2_close_stops_the_generators_thread_pools(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    folder = _model_folder(tmp_path / "m", weights_gib=4)
    session, made = _v2_session(monkeypatch, folder, [20 * GiB])
    session.close()
    gen = made["generator"]
    assert gen.cleared and gen.sampling_pool.shut and gen.filter_pool.shut
    assert made["model"].unloaded


def test_v3_failing_job_through_the_api(tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    folder = _model_folder(tmp_path / "m", weights_gib=4)
    session, made = _v3_session(
        monkeypatch, folder, [20 * GiB],
        gen_kw={"script": {"one": TOK.ids("A"), "two": TOK.ids("B")},
                "fail": {"boom": "prefill"}})
    with localrun.Model(session) as m:
        results = dict(_within(10, lambda: list(m.batch_iter(["one", "boom", "two"]))))
        assert results[0].text == "A" and results[2].text == "B"  # type: ignore[union-attr]
        assert isinstance(results[1], ex_errors.EngineJobError)
        # the driver's key for this item is no business of the caller's: no number
        assert "this sequence: RuntimeError: CUDA out of memory while prefill" in \
            str(results[1])
        with pytest.raises(GenerationError, match="CUDA out of memory while prefill") as e:
            _within(10, lambda: m.chat("boom"))
        assert "this sequence:" in str(e.value)  # one call: no number
        assert m.chat("one").text == "A"  # the generator serves on
    assert made["generator"].closed



# -- the session's Batcher (the driver steps it when sequences overlap) -----------------------

def _run_batcher(batcher: Any, limit: int = 100_000) -> list[tuple[int, str | None]]:
    """Step until nothing is in flight; every event, in order."""
    events: list[tuple[int, str | None]] = []
    for _ in range(limit):
        step = batcher.step()
        events += step
        if not batcher._jobs and not step:
            return events
    pytest.fail("the batcher never finished")


@pytest.mark.parametrize("engine", ENGINES)
def test_batcher_runs_the_drivers_keys_together(engine: str) -> None:
    gen = FakeGenerator(engine=engine, script={"one": HELLO, "two": TOK.ids("B", "y")})
    batcher = ex_jobs.JobBatcher(gen, _make_job, engine)
    assert batcher.capacity == gen.max_batch_size  # the engine's own batch size
    stats = {40: GenerationStats(), 7: GenerationStats()}
    batcher.add(40, _prompt("one"), FALLBACK, stats[40])
    batcher.add(7, _prompt("two"), FALLBACK, stats[7])
    assert stats[40].started > 0 and stats[7].prefill_tokens == len("two")
    events = _run_batcher(batcher)
    assert [p for k, p in events if k == 40] == ["Hel", "lo", "!", None]
    assert [p for k, p in events if k == 7] == ["B", "y", None]
    assert gen.max_active == 2  # in the engine at once
    assert stats[40].finish_reason == stats[7].finish_reason == "stop"
    assert (stats[40].completion_tokens, stats[7].completion_tokens) == (3, 2)
    assert stats[40].error is None and gen.num_remaining_jobs() == 0


def test_batcher_cancel_failure_and_no_room_end_only_that_sequence() -> None:
    gen = FakeGenerator(engine="exllamav3", fail={"boom": "allocate"},
                        script={"long": TOK.ids(*"xxxxxxxxxx"), "ok": TOK.ids("A", "1")})
    batcher = ex_jobs.JobBatcher(gen, _make_job, "exllamav3")
    stats = {k: GenerationStats() for k in (5, 9, 11, 13)}
    batcher.add(5, _prompt("long"), FALLBACK, stats[5])
    batcher.add(9, _prompt("boom"), FALLBACK, stats[9])
    batcher.add(11, _prompt("ok"), FALLBACK, stats[11])
    batcher.add(13, _prompt("ok"), replace(FALLBACK, max_tokens=0), stats[13])  # no room
    events: list[tuple[int, str | None]] = []
    while not any(k == 5 and p for k, p in events):
        events += batcher.step()
    batcher.cancel(5)
    batcher.cancel(5)  # twice: still one end
    events += _run_batcher(batcher)
    ends = [k for k, p in events if p is None]
    assert sorted(ends) == [5, 9, 11, 13] and len(ends) == 4
    assert [j.prompt for j in gen.cancelled] == [_prompt("long").tokens]
    assert stats[5].finish_reason is None and stats[5].error is None
    assert stats[13].finish_reason == "length" and gen.job_serial == 3  # never enqueued
    error = stats[9].error
    assert isinstance(error, ex_errors.EngineJobError) and error.hint
    # the key is the driver's, not a number the caller knows
    assert "this sequence: RuntimeError: CUDA out of memory while allocate" in str(error)
    assert "9" not in str(error).split(":")[1]
    assert isinstance(error.__cause__, RuntimeError)
    assert "".join(p or "" for k, p in events if k == 11) == "A1"
    assert stats[11].finish_reason == "stop" and stats[11].error is None
    # and the batcher serves on
    again = GenerationStats()
    batcher.add(14, _prompt("ok"), FALLBACK, again)
    assert [p for _, p in _run_batcher(batcher)] == ["A", "1", None]


def test_sessions_batcher_is_kept_and_closed(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    folder = _model_folder(tmp_path / "m", weights_gib=4)
    session, made = _v3_session(monkeypatch, folder, [20 * GiB],
                                gen_kw={"script": {"one": TOK.ids(*"aaaaaaaa")}})
    batcher = session.batcher()
    assert batcher is not None and session.batcher() is batcher
    batcher.add(1, _prompt("one"), FALLBACK, GenerationStats())
    batcher.step()
    session.close()  # cancels what is in flight, then frees the engine
    assert len(made["generator"].cancelled) == 1 and made["generator"].closed
    assert session.batcher() is None
    # ExLlamaV2 without paged attention runs one sequence at a time: no batcher
    unpaged, _ = _v2_session(monkeypatch, tmp_path / "m", [20 * GiB], paged=False)
    assert unpaged.batcher() is None
    paged, _ = _v2_session(monkeypatch, tmp_path / "m", [20 * GiB])
    assert paged.batcher() is not None


def test_batch_through_the_api_runs_in_the_engine_at_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = _model_folder(tmp_path / "m", weights_gib=4)
    script = {f"p{i}": TOK.ids(*[f"w{i}"] * (i + 2)) for i in range(4)}
    session, made = _v3_session(monkeypatch, folder, [20 * GiB], gen_kw={"script": script})
    with localrun.Model(session) as m:
        results = _within(10, lambda: m.batch([f"p{i}" for i in range(4)], temperature=0))
    assert [r.text for r in results] == [f"w{i}" * (i + 2) for i in range(4)]
    assert [r.usage.completion_tokens for r in results] == [2, 3, 4, 5]
    assert made["generator"].max_active >= 2  # batched by the engine, not one by one


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
        ex_probe.probe_cuda("exllamav2", bare)
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
        pytest.skip(f"{backend} is not installed (pip install -e '.[{backend}]')")
    path = os.environ.get(env)
    if not path or not Path(path).is_dir():
        pytest.skip(f"set {env} to a model folder (scripts/gpu_kit/run.py makes one)")
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


@pytest.mark.slow
@pytest.mark.parametrize(("backend", "env"), GPU_CASES)
def test_gpu_split_caps_weights_and_cache(backend: str, env: str) -> None:
    """gpu_split is GiB per GPU for weights + KV cache + buffers on both engines: what
    torch saw allocated on the GPU stays under it (ExLlamaV2 gets a weights-only budget
    from it, ExLlamaV3 takes it as use_per_device)."""
    path = _gpu_model(backend, env)
    import torch

    weights = sum(f.stat().st_size for f in path.glob("*.safetensors")) / GiB
    cap = round(weights * 1.3 + 1.0, 2)
    torch.cuda.reset_peak_memory_stats(0)
    before = torch.cuda.memory_allocated(0)
    with localrun.load(str(path), backend=backend, gpu_split=[cap], context=2048) as m:
        assert m.chat("Hi", temperature=0, max_tokens=8).usage.completion_tokens > 0
        peak = (torch.cuda.max_memory_allocated(0) - before) / GiB
    assert peak <= cap, f"{peak:.2f} GiB used with gpu_split=[{cap}]"


@pytest.mark.slow
def test_gpu_exllamav2_tensor_parallel() -> None:
    path = _gpu_model("exllamav2", "LOCALRUN_EXL2_MODEL")
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("tensor parallel needs two GPUs; this host has "
                    f"{torch.cuda.device_count()}")
    with localrun.load(str(path), backend="exllamav2", tensor_parallel=True,
                       context=2048) as m:
        a = m.chat("What is the capital of France?", temperature=0, max_tokens=16)
        assert a.text.strip() and a.usage.completion_tokens > 0
        assert len(m.batch(["Hi", "Name a colour."], temperature=0, max_tokens=8)) == 2


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
    ExLlamaV2Sampler.Settings(**v2.v2_sampler_settings(FALLBACK))
