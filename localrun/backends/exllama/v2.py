"""ExLlamaV2: EXL2 models (and 4-bit GPTQ, unoptimized) on NVIDIA (CUDA) or AMD (ROCm) GPUs.

Loading follows the engine's own recipe: ``ExLlamaV2Config(dir)`` with ``max_seq_len``
set to the context localrun chose for the free VRAM, ``ExLlamaV2(cfg)``, a lazy cache
(FP16 or Q8/Q6/Q4: ``kv_cache=``) that ``model.load_autosplit(cache)`` spreads over the
visible GPUs with the weights, and ``ExLlamaV2Tokenizer(cfg)``. A ``gpu_split`` (GiB per
GPU, KV cache included, as on ExLlamaV3) goes to ``model.load()`` converted to the
weights-only budget that call takes (:func:`v2_weights_split`);
``tensor_parallel=True`` loads with ``model.load_tp(gpu_split, expect_cache_tokens=,
expect_cache_base=)`` and an ``ExLlamaV2Cache_TP`` over the chosen cache class.
Generation runs as jobs on ``ExLlamaV2DynamicGenerator``: streaming, batching (paged
mode, which needs flash-attn >= 2.5.7; without it ``paged=False`` and one sequence at a
time) and cancellation (``generator.cancel(job)``).

The engine has no chat templates and keeps only one EOS id; localrun renders the
model's template and passes every EOS id as the job's ``stop_conditions``. Every
sampler field is set (:func:`v2_sampler_settings`). What both ExLlamas share lives in
:mod:`localrun.backends.exllama` (:class:`~localrun.backends.exllama.session.ExLlamaSession`
is this session but for loading and the sampler); the engine is imported only when a
model loads.
"""

from __future__ import annotations

import contextlib
import importlib
from types import SimpleNamespace
from typing import Any

from localrun.backends.base import SessionBackend
from localrun.backends.exllama.constraints import exllamav2_filter
from localrun.backends.exllama.errors import engine_import_error
from localrun.backends.exllama.options import KVCache
from localrun.backends.exllama.session import ExLlamaSession, LoadInputs
from localrun.backends.exllama.speculative import draft_arguments
from localrun.backends.exllama.vram import ContextChoice, SplitPlan, kv_bytes_per_token
from localrun.errors import InvalidOptionError
from localrun.memory import ModelShape
from localrun.sampling import ResolvedSampling

ENGINE = "exllamav2"

#: ExLlamaV2 cache class per ``kv_cache`` choice (exllamav2/cache.py). The FP8
#: ``ExLlamaV2Cache_8bit`` is left out: the dynamic generator refuses it
#: (generator/dynamic.py __init__).
V2_CACHE_CLASS: dict[KVCache, str] = {
    "fp16": "ExLlamaV2Cache", "q8": "ExLlamaV2Cache_Q8", "q6": "ExLlamaV2Cache_Q6",
    "q4": "ExLlamaV2Cache_Q4",
}

#: Every ``ExLlamaV2Sampler.Settings`` field that changes sampling, set to "off"
#: (exllamav2 generator/sampler.py). The class defaults are not neutral: temperature 0.8,
#: top_k 50, top_p 0.8, token_repetition_penalty 1.025.
V2_NEUTRAL: dict[str, Any] = {
    "token_repetition_penalty": 1.0,
    "token_repetition_range": -1,  # -1: the whole sequence, as transformers does
    "token_repetition_decay": 0,
    "token_frequency_penalty": 0.0,
    "token_presence_penalty": 0.0,
    "temperature": 1.0,
    "smoothing_factor": 0.0,
    "min_temp": 0.0,
    "max_temp": 0.0,
    "temp_exponent": 1.0,
    "top_k": 0,
    "top_p": 1.0,
    "top_a": 0.0,
    "min_p": 0.0,
    "tfs": 0.0,
    "typical": 0.0,
    "skew": 0.0,
    "temperature_last": False,
    "mirostat": False,
    "mirostat_tau": 1.5,
    "mirostat_eta": 0.1,
    "mirostat_mu": None,
    "token_bias": None,
    "cfg_scale": None,
    "dry_allowed_length": 2,
    "dry_base": 1.75,
    "dry_multiplier": 0.0,
    "dry_sequence_breakers": None,
    "dry_range": 0,
    "dry_max_ngram": 20,
    "xtc_probability": 0.0,
    "xtc_threshold": 0.1,
    "xtc_ignore_tokens": None,
}


def v2_sampler_settings(s: ResolvedSampling) -> dict[str, Any]:
    """Keyword arguments for ``ExLlamaV2Sampler.Settings(**kw)``: every field explicit."""
    kw = dict(V2_NEUTRAL)
    kw["token_repetition_penalty"] = s.repetition_penalty
    if s.greedy:
        # The engine's own greedy settings (Settings.greedy): top_k 1 is argmax.
        kw.update(temperature=1.0, top_k=1, top_p=0.0, min_p=0.0)
    else:
        kw.update(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, min_p=s.min_p)
    return kw


def v2_weights_split(split: SplitPlan, weights: int, cache_bytes: int | None) -> list[float]:
    """The ``gpu_split`` to hand ExLlamaV2's ``model.load()``, from localrun's.

    localrun's ``gpu_split`` (and ExLlamaV3's ``use_per_device``, and ExLlamaV2's own
    ``load_tp``) is what the model may take on each GPU, KV cache included. ExLlamaV2's
    ``load(gpu_split)`` budgets weights and fixed buffers only ("Does not account for the
    size of the cache", model.py); the cache then goes on top, on whichever GPU holds each
    layer. Every layer brings the same share of the cache as of the weights, so a GPU
    given ``w`` GiB of weights ends up holding ``w * (W + C) / W``: it gets
    ``g * W / (W + C)`` of its ``g`` GiB for weights. (Embeddings and the output head
    carry no cache, so this errs on the safe side.) Only "manual" plans are converted;
    "single" already gives its GPU everything.
    """
    assert split.gpu_split is not None
    if split.mode != "manual" or not cache_bytes or weights <= 0:
        return list(split.gpu_split)
    share = weights / (weights + cache_bytes)
    return [gb * share for gb in split.gpu_split]


def v2_cache_bytes(cfg: Any, kv_cache: KVCache, tokens: int, n_gpus: int) -> int:
    """The KV cache's size from the engine's config, when config.json gave no shape."""
    shape = ModelShape(n_layers=int(cfg.num_hidden_layers),
                       n_kv_heads=int(cfg.num_key_value_heads), head_dim=int(cfg.head_dim))
    return kv_bytes_per_token(ENGINE, shape, kv_cache, n_gpus) * tokens


class ExLlamaV2Session(ExLlamaSession):
    engine = ENGINE
    format_title = "EXL2"
    paged: bool

    def _import_engine(self) -> Any:
        try:
            torch: Any = importlib.import_module("torch")
            from exllamav2 import ExLlamaV2, ExLlamaV2Config, ExLlamaV2Tokenizer
            from exllamav2 import cache as ex_cache
            from exllamav2.attn import has_flash_attn_with_paged
            from exllamav2.generator import (
                ExLlamaV2DynamicGenerator,
                ExLlamaV2DynamicJob,
                ExLlamaV2Sampler,
            )
        except (ImportError, OSError, RuntimeError) as e:
            raise engine_import_error(ENGINE, e) from e
        self._ex = SimpleNamespace(
            Model=ExLlamaV2, Config=ExLlamaV2Config, Tokenizer=ExLlamaV2Tokenizer,
            cache=ex_cache, paged_attention=has_flash_attn_with_paged,
            Generator=ExLlamaV2DynamicGenerator)
        self._job_cls = ExLlamaV2DynamicJob
        self._settings_cls = ExLlamaV2Sampler.Settings
        return torch

    def _load(self, inputs: LoadInputs) -> tuple[Any, ContextChoice]:
        ex, options = self._ex, inputs.options
        cfg = ex.Config(str(inputs.folder))
        cfg.arch_compat_overrides(quiet=True)
        # TPContext asserts both (exllamav2 tensor_p.py): refuse before loading.
        supports_tp = bool(getattr(getattr(getattr(cfg, "arch", None), "lm", None),
                                   "supports_tp", False)) and \
            int(getattr(cfg, "intermediate_size", 0) or 0) % 128 == 0
        split, choice = inputs.fit(ENGINE, supports_tp=supports_tp)
        cfg.max_seq_len = choice.cache_tokens
        cfg.max_input_len = min(cfg.max_input_len, choice.cache_tokens)
        cfg.max_attention_size = min(cfg.max_attention_size, cfg.max_input_len ** 2)
        paged = bool(ex.paged_attention) and not cfg.no_flash_attn
        if options.paged and not paged:
            raise InvalidOptionError("ExLlamaV2", "paged", True, "False (paged attention "
                                     "needs flash-attn >= 2.5.7, which is not installed)")
        if options.paged is False:
            paged = False
        model = ex.Model(cfg)
        self._model = model
        cache_cls = getattr(ex.cache, V2_CACHE_CLASS[options.kv_cache])
        if split.mode == "autosplit":
            cache = cache_cls(model, max_seq_len=choice.cache_tokens, lazy=True)
            model.load_autosplit(cache, progress=False)
        elif split.mode == "tensor_parallel":
            # load_tp's gpu_split already counts the cache it is told to expect.
            model.load_tp(list(split.gpu_split) if split.gpu_split is not None else None,
                          progress=False, expect_cache_tokens=choice.cache_tokens,
                          expect_cache_base=cache_cls)
            cache = ex.cache.ExLlamaV2Cache_TP(model, base=cache_cls,
                                               max_seq_len=choice.cache_tokens, batch_size=1)
        else:
            cache_bytes = choice.kv_cache_bytes if choice.kv_cache_bytes is not None \
                else v2_cache_bytes(cfg, options.kv_cache, choice.cache_tokens,
                                    len(split.devices))
            model.load(gpu_split=v2_weights_split(split, inputs.weights, cache_bytes),
                       progress=False)
            cache = cache_cls(model, max_seq_len=choice.cache_tokens, lazy=False)
        self._cache = cache
        tokenizer = ex.Tokenizer(cfg)
        draft: dict[str, Any] = {}
        if inputs.request.draft_model:  # speculative decoding (.speculative)
            draft = draft_arguments(ex, inputs.request.draft_model, tokenizer,
                                    str(inputs.folder), cache_cls=cache_cls,
                                    cache_tokens=choice.cache_tokens)
        self.generator = ex.Generator(model=model, cache=cache, tokenizer=tokenizer,
                                      paged=paged, **draft)
        self._batching = paged  # unpaged: the generator runs one sequence at a time
        self.paged = paged
        self.split = split
        return tokenizer, choice

    def _sampler(self, sampling: ResolvedSampling) -> dict[str, Any]:
        return {"gen_settings": self._settings_cls(**v2_sampler_settings(sampling))}

    def _filters(self, sampling: ResolvedSampling) -> dict[str, Any]:
        """The llguidance filter of a constrained request (``filters=`` of the job)."""
        if sampling.constraint is None or self._grammar is None:
            return {}
        mask = self._grammar.mask(sampling.constraint)
        return {"filters": [exllamav2_filter(self._model, self._tokenizer, mask)]}

    def _close_generator(self, generator: Any) -> None:
        # The generator has no close() in 0.3.2; its two thread pools (16 workers each
        # by default) would otherwise live until it is garbage collected.
        for name in ("sampling_pool", "filter_pool"):
            pool = getattr(generator, name, None)
            if pool is not None:
                with contextlib.suppress(Exception):
                    pool.shutdown(wait=False)


BACKEND = SessionBackend(ENGINE, ExLlamaV2Session)
