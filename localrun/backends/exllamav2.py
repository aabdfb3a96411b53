"""ExLlamaV2: EXL2 models (and 4-bit GPTQ, unoptimized) on NVIDIA (CUDA) or AMD (ROCm) GPUs.

Loading follows the engine's own recipe: ``ExLlamaV2Config(dir)`` with ``max_seq_len``
set to the context localrun chose for the free VRAM, ``ExLlamaV2(cfg)``, a lazy cache
(FP16 or Q8/Q6/Q4: ``kv_cache=``) that ``model.load_autosplit(cache)`` spreads over the
visible GPUs with the weights, and ``ExLlamaV2Tokenizer(cfg)``. A ``gpu_split`` (GiB per
GPU, KV cache included, as on ExLlamaV3) goes to ``model.load()`` converted to the
weights-only budget that call takes (:func:`localrun.backends._exllama.v2_weights_split`);
``tensor_parallel=True`` loads with ``model.load_tp(gpu_split, expect_cache_tokens=,
expect_cache_base=)`` and an ``ExLlamaV2Cache_TP`` over the chosen cache class.
Generation runs as jobs on ``ExLlamaV2DynamicGenerator``: streaming, batching (paged
mode, which needs flash-attn >= 2.5.7; without it ``paged=False`` and one sequence at a
time) and cancellation (``generator.cancel(job)``).

The engine has no chat templates and keeps only one EOS id; localrun renders the
model's template and passes every EOS id as the job's ``stop_conditions``. Every
sampler field is set (:func:`localrun.backends._exllama.v2_sampler_settings`). The
engine-free parts live in :mod:`localrun.backends._exllama`; the engine is imported
only inside :meth:`ExLlamaV2Backend.load`.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from localrun.backends import engine_version
from localrun.backends._exllama import (
    V2_CACHE_CLASS,
    ExLlamaSession,
    KVCache,
    adds_bos,
    choose_context,
    engine_import_error,
    free_for_split,
    kv_bytes_per_token,
    load_failure,
    model_name,
    parse_options,
    plan_split,
    probe_cuda,
    quant_label,
    read_chat_template,
    read_model_json,
    stop_token_ids,
    v2_sampler_settings,
    v2_weights_split,
    weights_bytes,
)
from localrun.backends.base import LoadRequest, Prompt, Session
from localrun.backends.hf_config import architecture, sampling_defaults, trained_context
from localrun.errors import InvalidOptionError, LocalrunError, ModelFileError
from localrun.memory import ModelShape, shape_from_config
from localrun.sampling import ResolvedSampling
from localrun.structured.engines import exllamav2_filter
from localrun.templates import render_chat
from localrun.types import Message, ModelInfo

ENGINE = "exllamav2"


def v2_cache_bytes(cfg: Any, kv_cache: KVCache, tokens: int, n_gpus: int) -> int:
    """The KV cache's size from the engine's config, when config.json gave no shape."""
    shape = ModelShape(n_layers=int(cfg.num_hidden_layers),
                       n_kv_heads=int(cfg.num_key_value_heads), head_dim=int(cfg.head_dim))
    return int(kv_bytes_per_token(ENGINE, shape, kv_cache, n_gpus) * tokens)


class ExLlamaV2Session(ExLlamaSession):
    def __init__(self, request: LoadRequest) -> None:
        folder = Path(request.path).expanduser()
        if not folder.is_dir():
            raise ModelFileError(str(folder), "EXL2 models are folders (config.json and "
                                 "*.safetensors), not single files" if folder.exists()
                                 else "no such folder")
        options = parse_options(ENGINE, request.options)
        config, gen_config, tokenizer_json = read_model_json(folder)
        template = read_chat_template(folder)
        shape = shape_from_config(config)
        trained = trained_context(config)
        free = probe_cuda(ENGINE)  # EngineUnavailableError on hosts without a GPU
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
        self._torch = torch
        self._job_cls = ExLlamaV2DynamicJob
        self._settings_cls = ExLlamaV2Sampler.Settings
        self._model: Any = None
        try:
            cfg = ExLlamaV2Config(str(folder))
            cfg.arch_compat_overrides(quiet=True)
            # TPContext asserts both (exllamav2 tensor_p.py): refuse before loading.
            supports_tp = bool(getattr(getattr(getattr(cfg, "arch", None), "lm", None),
                                       "supports_tp", False)) and \
                int(getattr(cfg, "intermediate_size", 0) or 0) % 128 == 0
            split = plan_split(ENGINE, len(free), device=request.device, options=options,
                               supports_tp=supports_tp)
            choice = choose_context(ENGINE, model=str(folder), requested=request.context,
                                    trained=trained, weights=weights_bytes(folder),
                                    shape=shape, free_vram=free_for_split(free, split),
                                    kv_cache=options.kv_cache)
            cfg.max_seq_len = choice.cache_tokens
            cfg.max_input_len = min(cfg.max_input_len, choice.cache_tokens)
            cfg.max_attention_size = min(cfg.max_attention_size, cfg.max_input_len ** 2)
            paged = bool(has_flash_attn_with_paged) and not cfg.no_flash_attn
            if options.paged and not paged:
                raise InvalidOptionError("ExLlamaV2", "paged", True, "False (paged attention "
                                         "needs flash-attn >= 2.5.7, which is not installed)")
            if options.paged is False:
                paged = False
            model = ExLlamaV2(cfg)
            self._model = model
            cache_cls = getattr(ex_cache, V2_CACHE_CLASS[options.kv_cache])
            if split.mode == "autosplit":
                cache = cache_cls(model, max_seq_len=choice.cache_tokens, lazy=True)
                model.load_autosplit(cache, progress=False)
            elif split.mode == "tensor_parallel":
                # load_tp's gpu_split already counts the cache it is told to expect.
                model.load_tp(list(split.gpu_split) if split.gpu_split is not None else None,
                              progress=False, expect_cache_tokens=choice.cache_tokens,
                              expect_cache_base=cache_cls)
                cache = ex_cache.ExLlamaV2Cache_TP(model, base=cache_cls,
                                                   max_seq_len=choice.cache_tokens,
                                                   batch_size=1)
            else:
                cache_bytes = choice.kv_cache_bytes if choice.kv_cache_bytes is not None \
                    else v2_cache_bytes(cfg, options.kv_cache, choice.cache_tokens,
                                        len(split.devices))
                model.load(gpu_split=v2_weights_split(split, weights_bytes(folder),
                                                      cache_bytes), progress=False)
                cache = cache_cls(model, max_seq_len=choice.cache_tokens, lazy=False)
            tokenizer = ExLlamaV2Tokenizer(cfg)
            self.generator = ExLlamaV2DynamicGenerator(
                model=model, cache=cache, tokenizer=tokenizer, paged=paged)
        except LocalrunError:
            self.close()
            raise
        except (AssertionError, ValueError, KeyError, OSError, RuntimeError) as e:
            self.close()
            raise load_failure(ENGINE, str(folder), e) from e
        self._cache = cache
        self._tokenizer = tokenizer
        self.context = choice.context
        self.supports_batch = paged  # unpaged: the generator runs one sequence at a time
        self.paged = paged
        self.split = split
        self.kv_cache = options.kv_cache
        self._template = template
        self._bos = template.bos_token or (tokenizer.bos_token or "")
        self._eos_text = template.eos_token or (tokenizer.eos_token or "")
        self._add_bos = adds_bos(template, tokenizer_json)
        self._stop = stop_token_ids(gen_config, config, tokenizer.eos_token_id)
        self.sampling_defaults = sampling_defaults(gen_config)
        self.info = ModelInfo(
            backend=ENGINE,
            engine_version=engine_version(ENGINE) or "unknown",
            format=request.format,
            quantization=quant_label(config),
            path=str(folder),
            context_length=choice.context,
            trained_context_length=trained,
            architecture=architecture(config),
            name=model_name(config, folder),
        )
        self._structured_setup(folder, template, self._bos, self._eos_text, self._stop,
                               config.get("vocab_size"))

    # -- encoding ---------------------------------------------------------------------

    def _encode(self, text: str, *, add_bos: bool, special: bool) -> list[int]:
        ids = self._tokenizer.encode(text, add_bos=add_bos, encode_special_tokens=special)
        return [int(t) for t in ids[0].tolist()]

    def encode_chat(self, messages: Sequence[Message]) -> Prompt:
        text = render_chat(self._template.template, messages, bos_token=self._bos,
                           eos_token=self._eos_text)
        # The rendered template holds the special tokens it wants (BOS included), as
        # transformers' apply_chat_template(tokenize=True) assumes.
        return Prompt(self._encode(text, add_bos=False, special=True), text)

    def encode_text(self, text: str) -> Prompt:
        return Prompt(self._encode(text, add_bos=self._add_bos, special=False), text)

    # -- generation -------------------------------------------------------------------

    def make_job(self, prompt: Prompt, sampling: ResolvedSampling, limit: int,
                 identifier: int) -> Any:
        ids = self._torch.tensor([list(prompt.tokens)], dtype=self._torch.long)
        return self._job_cls(
            input_ids=ids,
            max_new_tokens=limit,
            min_new_tokens=0,
            gen_settings=self._settings_cls(**v2_sampler_settings(sampling)),
            seed=sampling.seed,
            stop_conditions=list(self._stop),
            decode_special_tokens=False,
            token_healing=False,
            identifier=identifier,
            **self._filters(sampling),
        )

    def _filters(self, sampling: ResolvedSampling) -> dict[str, Any]:
        """The llguidance filter of a constrained request (``filters=`` of the job)."""
        if sampling.constraint is None or self._grammar is None:
            return {}
        mask = self._grammar.mask(sampling.constraint)
        return {"filters": [exllamav2_filter(self._model, self._tokenizer, mask)]}

    def close(self) -> None:
        gen = getattr(self, "generator", None)
        if gen is not None:
            with contextlib.suppress(Exception):
                gen.clear_queue()
            # The generator has no close() in 0.3.2; its two thread pools (16 workers each
            # by default) would otherwise live until it is garbage collected.
            for name in ("sampling_pool", "filter_pool"):
                pool = getattr(gen, name, None)
                if pool is not None:
                    with contextlib.suppress(Exception):
                        pool.shutdown(wait=False)
        self.generator = None
        model = getattr(self, "_model", None)
        if model is not None:
            with contextlib.suppress(Exception):
                model.unload()
            self._model = None
            self._cache = None
            torch = getattr(self, "_torch", None)
            if torch is not None:
                with contextlib.suppress(Exception):
                    torch.cuda.empty_cache()


class ExLlamaV2Backend:
    name = ENGINE

    def load(self, request: LoadRequest) -> Session:
        return ExLlamaV2Session(request)


BACKEND = ExLlamaV2Backend()
