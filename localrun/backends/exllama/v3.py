"""ExLlamaV3: EXL3 models (and unquantized HF folders, unoptimized) on one or more GPUs.

ExLlamaV2's successor, made for several consumer GPUs: on two or more it loads
tensor-parallel (``model.load(tensor_p=True)``) when the architecture supports it
(``model.caps["supports_tp"]``), else it fills the GPUs in turn (autosplit); a
``gpu_split`` or ``device="cuda:N"`` overrides that. ``gpu_split`` is GiB per GPU for
weights and KV cache together, which is what ``model.load(use_per_device=)`` takes here
(the cache is attached before the load) and what it means on ExLlamaV2. The recipe is the
engine's: ``Config.from_directory(dir)``, ``Model.from_config(cfg)``, a ``Cache`` made
before ``model.load()`` so the split accounts for it (FP16 or quantized: ``kv_cache=``),
``Tokenizer.from_config(cfg)``, and jobs on the dynamic ``Generator`` for streaming,
batching and cancellation (``generator.cancel(job)``).

As with ExLlamaV2, localrun renders the chat template, passes every EOS id as
``stop_conditions`` and builds a ``ComboSampler`` with every step set
(a job without a sampler would get ``DefaultSampler``: min_p 0.08, temperature 0.8).
What both ExLlamas share lives in :mod:`localrun.backends.exllama`.
"""

from __future__ import annotations

import contextlib
import importlib
from types import SimpleNamespace
from typing import Any

from localrun.backends.base import SessionBackend
from localrun.backends.exllama.constraints import exllamav3_filter
from localrun.backends.exllama.errors import engine_import_error
from localrun.backends.exllama.options import KVCache
from localrun.backends.exllama.session import ExLlamaSession, LoadInputs
from localrun.backends.exllama.vram import PAGE_SIZE, ContextChoice
from localrun.sampling import ResolvedSampling

ENGINE = "exllamav3"

#: Prompt tokens per prefill pass (the engine's default), at most the cache size.
MAX_CHUNK = 2048

#: ``Cache(layer_type=CacheLayer_quant, k_bits=, v_bits=)`` per ``kv_cache`` choice;
#: None: CacheLayer_fp16.
V3_CACHE_BITS: dict[KVCache, int | None] = {"fp16": None, "q8": 8, "q6": 6, "q4": 4}

#: ``exllamav3.ComboSampler`` arguments that are "off" (generator/sampler/presets.py).
V3_NEUTRAL: dict[str, Any] = {
    "rep_p": 1.0,
    "freq_p": 0.0,
    "pres_p": 0.0,
    "rep_sustain_range": int(10e7),  # the whole sequence
    "rep_decay_range": 0,
    "dry_multiplier": 0.0,
    "dry_base": 1.75,
    "dry_allowed_length": 2,
    "dry_range": 0,
    "dry_sequence_breakers": None,
    "temperature": 1.0,
    "min_p": 0.0,
    "top_k": 0,
    "top_p": 1.0,
    "temp_last": False,
    "adaptive_target": 1.0,
    "adaptive_decay": 0.9,
    "logit_bias": None,
}


def v3_sampler_kwargs(s: ResolvedSampling) -> dict[str, Any]:
    """Keyword arguments for ``exllamav3.ComboSampler(**kw)`` (a job without a sampler
    gets DefaultSampler: min_p 0.08, temperature 0.8)."""
    kw = dict(V3_NEUTRAL)
    kw["rep_p"] = s.repetition_penalty
    if s.greedy:
        kw.update(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0)  # ComboSampler: argmax
    else:
        kw.update(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, min_p=s.min_p)
    return kw


class ExLlamaV3Session(ExLlamaSession):
    engine = ENGINE
    format_title = "EXL3"

    def _import_engine(self) -> Any:
        try:
            torch: Any = importlib.import_module("torch")
            from exllamav3 import (
                Cache,
                CacheLayer_fp16,
                CacheLayer_quant,
                ComboSampler,
                Config,
                Generator,
                Job,
                Model,
                Tokenizer,
            )
        except (ImportError, OSError, RuntimeError) as e:
            raise engine_import_error(ENGINE, e) from e
        self._ex = SimpleNamespace(Cache=Cache, CacheLayer_fp16=CacheLayer_fp16,
                                   CacheLayer_quant=CacheLayer_quant, Config=Config,
                                   Generator=Generator, Model=Model, Tokenizer=Tokenizer)
        self._job_cls = Job
        self._sampler_cls = ComboSampler
        return torch

    def _load(self, inputs: LoadInputs) -> tuple[Any, ContextChoice]:
        ex = self._ex
        cfg = ex.Config.from_directory(str(inputs.folder))
        model = ex.Model.from_config(cfg)
        self._model = model
        supports_tp = bool(getattr(model, "caps", {}).get("supports_tp"))
        split, choice = inputs.fit(ENGINE, supports_tp=supports_tp)
        bits = V3_CACHE_BITS[inputs.options.kv_cache]
        cache_kw: dict[str, Any] = {"layer_type": ex.CacheLayer_fp16} if bits is None else \
            {"layer_type": ex.CacheLayer_quant, "k_bits": bits, "v_bits": bits}
        # Made before load() so the split leaves room for it on each device.
        cache = ex.Cache(model, max_num_tokens=choice.cache_tokens, **cache_kw)
        self._cache = cache
        chunk = max(min(MAX_CHUNK, choice.cache_tokens) // PAGE_SIZE * PAGE_SIZE, PAGE_SIZE)
        load_kw: dict[str, Any] = {"progressbar": False, "max_chunk_size": chunk}
        if split.mode == "single":
            load_kw["device"] = f"cuda:{split.devices[0]}"
        elif split.mode == "manual":
            assert split.gpu_split is not None
            load_kw["use_per_device"] = list(split.gpu_split)
        elif split.mode == "tensor_parallel":
            load_kw["tensor_p"] = True
            if split.gpu_split is not None:
                load_kw["use_per_device"] = list(split.gpu_split)
        model.load(**load_kw)
        tokenizer = ex.Tokenizer.from_config(cfg)
        self.generator = ex.Generator(model=model, cache=cache, tokenizer=tokenizer,
                                      max_chunk_size=chunk)
        self._batching = True
        self.split = split
        return tokenizer, choice

    def _sampler(self, sampling: ResolvedSampling) -> dict[str, Any]:
        return {"sampler": self._sampler_cls(**v3_sampler_kwargs(sampling))}

    def _filters(self, sampling: ResolvedSampling) -> dict[str, Any]:
        """exllamav3's LLGuidanceFilter for a constrained request (``filters=``)."""
        if sampling.constraint is None or self._grammar is None:
            return {}
        grammar = self._grammar.compiler().grammar(sampling.constraint)
        return {"filters": [exllamav3_filter(self._tokenizer, grammar)]}

    def _close_generator(self, generator: Any) -> None:
        # Generator.close() frees what the model and cache do not: the recurrent-state
        # cache (up to 4 GiB of RAM by default), the CPU page cache, pinned staging
        # buffers and the filter thread pool. Older releases have no close().
        close = getattr(generator, "close", None)
        if close is not None:
            with contextlib.suppress(Exception):
                close()


BACKEND = SessionBackend(ENGINE, ExLlamaV3Session)
