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
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from localrun.backends import engine_version
from localrun.backends._exllama import (
    PAGE_SIZE,
    V3_CACHE_BITS,
    ExLlamaSession,
    adds_bos,
    choose_context,
    engine_import_error,
    free_for_split,
    load_failure,
    model_name,
    parse_options,
    plan_split,
    probe_cuda,
    quant_label,
    read_chat_template,
    read_model_json,
    stop_token_ids,
    v3_sampler_kwargs,
    weights_bytes,
)
from localrun.backends.base import LoadRequest, Prompt, Session
from localrun.backends.hf_config import architecture, sampling_defaults, trained_context
from localrun.errors import LocalrunError, ModelFileError
from localrun.memory import shape_from_config
from localrun.sampling import ResolvedSampling
from localrun.structured.engines import exllamav3_filter
from localrun.templates import render_chat
from localrun.types import Message, ModelInfo

ENGINE = "exllamav3"

#: Prompt tokens per prefill pass (the engine's default), at most the cache size.
MAX_CHUNK = 2048


class ExLlamaV3Session(ExLlamaSession):
    def __init__(self, request: LoadRequest) -> None:
        folder = Path(request.path).expanduser()
        if not folder.is_dir():
            raise ModelFileError(str(folder), "EXL3 models are folders (config.json and "
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
        self._torch = torch
        self._job_cls = Job
        self._sampler_cls = ComboSampler
        self._model: Any = None
        try:
            cfg = Config.from_directory(str(folder))
            model = Model.from_config(cfg)
            self._model = model
            supports_tp = bool(getattr(model, "caps", {}).get("supports_tp"))
            split = plan_split(ENGINE, len(free), device=request.device, options=options,
                               supports_tp=supports_tp)
            choice = choose_context(ENGINE, model=str(folder), requested=request.context,
                                    trained=trained, weights=weights_bytes(folder),
                                    shape=shape, free_vram=free_for_split(free, split),
                                    kv_cache=options.kv_cache)
            bits = V3_CACHE_BITS[options.kv_cache]
            cache_kw: dict[str, Any] = {"layer_type": CacheLayer_fp16} if bits is None else \
                {"layer_type": CacheLayer_quant, "k_bits": bits, "v_bits": bits}
            # Made before load() so the split leaves room for it on each device.
            cache = Cache(model, max_num_tokens=choice.cache_tokens, **cache_kw)
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
            tokenizer = Tokenizer.from_config(cfg)
            self.generator = Generator(model=model, cache=cache, tokenizer=tokenizer,
                                       max_chunk_size=chunk)
        except LocalrunError:  # InvalidOptionError is a ValueError: not a load failure
            self.close()
            raise
        except (AssertionError, ValueError, KeyError, OSError, RuntimeError,
                NotImplementedError) as e:
            self.close()
            raise load_failure(ENGINE, str(folder), e) from e
        self._cache = cache
        self._tokenizer = tokenizer
        self.context = choice.context
        self.supports_batch = True
        self.split = split
        self.kv_cache = options.kv_cache
        self._template = template
        self._bos = template.bos_token or (getattr(tokenizer, "bos_token", None) or "")
        self._eos_text = template.eos_token or (getattr(tokenizer, "eos_token", None) or "")
        self._add_bos = adds_bos(template, tokenizer_json)
        self._stop = stop_token_ids(gen_config, config, getattr(tokenizer, "eos_token_id", None))
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
            sampler=self._sampler_cls(**v3_sampler_kwargs(sampling)),
            seed=sampling.seed,
            stop_conditions=list(self._stop),
            decode_special_tokens=False,
            token_healing=False,
            identifier=identifier,
            **self._filters(sampling),
        )

    def _filters(self, sampling: ResolvedSampling) -> dict[str, Any]:
        """exllamav3's LLGuidanceFilter for a constrained request (``filters=``)."""
        if sampling.constraint is None or self._grammar is None:
            return {}
        grammar = self._grammar.compiler().grammar(sampling.constraint)
        return {"filters": [exllamav3_filter(self._tokenizer, grammar)]}

    def close(self) -> None:
        gen = getattr(self, "generator", None)
        if gen is not None:
            with contextlib.suppress(Exception):
                gen.clear_queue()
            # Generator.close() frees what the model and cache do not: the recurrent-state
            # cache (up to 4 GiB of RAM by default), the CPU page cache, pinned staging
            # buffers and the filter thread pool. Older releases have no close().
            close = getattr(gen, "close", None)
            if close is not None:
                with contextlib.suppress(Exception):
                    close()
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


class ExLlamaV3Backend:
    name = ENGINE

    def load(self, request: LoadRequest) -> Session:
        return ExLlamaV3Session(request)


BACKEND = ExLlamaV3Backend()
