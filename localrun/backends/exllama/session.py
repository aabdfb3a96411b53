"""One session class for both ExLlamas: the load recipe's common steps, encoding, jobs
and closing. An engine's session (:mod:`localrun.backends.exllama.v2`,
:mod:`localrun.backends.exllama.v3`) supplies only what differs: importing the engine,
loading the model, cache, tokenizer and generator (:meth:`ExLlamaSession._load`), the
sampler and grammar filter of a job, and closing its generator."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from localrun.backends.base import Batcher, GenerationStats, LoadRequest, Prompt, Session
from localrun.backends.exllama.errors import load_failure
from localrun.backends.exllama.facts import SPECS
from localrun.backends.exllama.folder import (
    adds_bos,
    model_name,
    quant_label,
    read_model_json,
    stop_token_ids,
    weights_bytes,
)
from localrun.backends.exllama.jobs import JobBatcher, run_jobs
from localrun.backends.exllama.options import LoadOptions, parse_options, title
from localrun.backends.exllama.probe import probe_cuda
from localrun.backends.exllama.vram import (
    ContextChoice,
    SplitPlan,
    choose_context,
    free_for_split,
    plan_split,
)
from localrun.backends.hf_config import (
    ChatTemplate,
    architecture,
    read_chat_template,
    sampling_defaults,
    trained_context,
)
from localrun.backends.installed import installed_version
from localrun.errors import LocalrunError, ModelFileError
from localrun.memory import ModelShape, shape_from_config
from localrun.sampling import ResolvedSampling
from localrun.structured.constraint import Constraint
from localrun.structured.grammar import LazyGrammar, tokenizer_in_folder
from localrun.templates import render_chat
from localrun.types import CancelToken, Message, ModelInfo


@dataclass(frozen=True)
class LoadInputs:
    """What the engine-free half of a load found, for the engine's :meth:`_load`."""

    folder: Path
    request: LoadRequest
    options: LoadOptions
    shape: ModelShape | None
    trained: int | None
    weights: int  # bytes of *.safetensors
    free: list[int]  # free bytes of each CUDA device

    def fit(self, engine: str, *, supports_tp: bool) -> tuple[SplitPlan, ContextChoice]:
        """Where the model goes, and the context (and cache size) that fits there."""
        split = plan_split(engine, len(self.free), device=self.request.device,
                           options=self.options, supports_tp=supports_tp)
        choice = choose_context(engine, model=str(self.folder), requested=self.request.context,
                                trained=self.trained, weights=self.weights, shape=self.shape,
                                free_vram=free_for_split(self.free, split),
                                kv_cache=self.options.kv_cache)
        return split, choice


class ExLlamaSession(Session):
    """A loaded EXL2/EXL3 model: generation runs as jobs on the engine's dynamic generator,
    one sequence alone through :meth:`generate`, overlapping ones through the
    :class:`~localrun.backends.exllama.jobs.JobBatcher` the driver steps."""

    #: the backend name ("exllamav2")
    engine: ClassVar[str]
    #: the format's name in messages ("EXL2")
    format_title: ClassVar[str]
    #: what the engine's constructors raise for a model they cannot load (mapped by
    #: :func:`~localrun.backends.exllama.errors.load_failure`; NotImplementedError is a
    #: RuntimeError: exllamav3's "Tensor-parallel is not currently implemented")
    load_errors: ClassVar[tuple[type[BaseException], ...]] = (
        AssertionError, ValueError, KeyError, OSError, RuntimeError)

    generator: Any = None
    context: int
    _job_cls: Any  # the engine's job class (_import_engine)
    _tokenizer: Any
    split: SplitPlan
    kv_cache: str
    _grammar: LazyGrammar | None = None
    #: whether the generator batches (set by _load)
    _batching: bool = False
    _batcher: JobBatcher | None = None

    def __init__(self, request: LoadRequest) -> None:
        folder = Path(request.path).expanduser()
        if not folder.is_dir():
            raise ModelFileError(str(folder), f"{self.format_title} models are folders "
                                 "(config.json and *.safetensors), not single files"
                                 if folder.exists() else "no such folder")
        options = parse_options(self.engine, request.options)
        config, gen_config, tokenizer_json = read_model_json(folder)
        template = read_chat_template(folder)
        inputs = LoadInputs(folder, request, options, shape_from_config(config),
                            trained_context(config), weights_bytes(folder),
                            probe_cuda(self.engine))  # EngineUnavailableError without a GPU
        self._torch: Any = self._import_engine()
        self._model: Any = None
        self._cache: Any = None
        try:
            self._tokenizer, choice = self._load(inputs)
        except LocalrunError:  # InvalidOptionError is a ValueError: not a load failure
            self.close()
            raise
        except self.load_errors as e:
            self.close()
            raise load_failure(self.engine, str(folder), e) from e
        tokenizer = self._tokenizer
        self.context = choice.context
        self.kv_cache = options.kv_cache
        self._template = template
        self._bos = template.bos_token or (getattr(tokenizer, "bos_token", None) or "")
        self._eos_text = template.eos_token or (getattr(tokenizer, "eos_token", None) or "")
        self._add_bos = adds_bos(template, tokenizer_json)
        self._stop = stop_token_ids(gen_config, config, getattr(tokenizer, "eos_token_id", None))
        self.sampling_defaults = sampling_defaults(gen_config)
        #: footprint: the generator's jobs share the one cache of the context (its
        #: batcher reserves nothing: per_slot 0)
        self.memory_facts = SPECS[self.engine]
        self.info = ModelInfo(
            backend=self.engine,
            engine_version=installed_version(SPECS[self.engine]) or "unknown",
            format=request.format,
            quantization=quant_label(config),
            path=str(folder),
            context_length=choice.context,
            trained_context_length=inputs.trained,
            architecture=architecture(config),
            name=model_name(config, folder),
        )
        self._structured_setup(folder, template, config.get("vocab_size"))

    # -- the engine's part -------------------------------------------------------------

    def _import_engine(self) -> Any:
        """Import the engine, keep the classes a job needs; return torch. A failed import
        raises :func:`~localrun.backends.exllama.errors.engine_import_error`'s error."""
        raise NotImplementedError  # pragma: no cover - engine-specific

    def _load(self, inputs: LoadInputs) -> tuple[Any, ContextChoice]:
        """Load the model, its cache, tokenizer and generator; return the tokenizer and
        the context chosen. Sets ``self._model`` as soon as there is one (so that
        :meth:`close` frees it if a later step fails), ``self._cache``,
        ``self.generator``, ``self.split`` and ``self._batching``."""
        raise NotImplementedError  # pragma: no cover - engine-specific

    def _sampler(self, sampling: ResolvedSampling) -> dict[str, Any]:
        """The job's sampler argument, every setting explicit."""
        raise NotImplementedError  # pragma: no cover - engine-specific

    def _filters(self, sampling: ResolvedSampling) -> dict[str, Any]:
        """The job's ``filters=`` for a constrained request (``{}`` otherwise)."""
        raise NotImplementedError  # pragma: no cover - engine-specific

    def _close_generator(self, generator: Any) -> None:
        """Free what the generator holds beyond the model and cache."""

    # -- encoding ---------------------------------------------------------------------

    def _structured_setup(self, folder: Path, template: ChatTemplate, vocab: object) -> None:
        """The chat template for tool rendering, and llguidance from tokenizer.json."""
        self.chat_template, self.bos_token, self.eos_token = \
            template.template, self._bos, self._eos_text
        width = vocab if isinstance(vocab, int) else None
        stop = list(self._stop)

        self._grammar = LazyGrammar(self.engine, lambda: tokenizer_in_folder(
            folder, stop, title(self.engine), width), width)

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

    def encode_rendered(self, text: str) -> Prompt:
        return Prompt(self._encode(text, add_bos=False, special=True), text)

    def check_constraint(self, constraint: Constraint) -> None:
        if self._grammar is None:
            super().check_constraint(constraint)
        else:
            self._grammar.check(constraint)

    # -- generation -------------------------------------------------------------------

    def make_job(self, prompt: Prompt, sampling: ResolvedSampling, identifier: int) -> Any:
        """One engine job. ``sampling.max_tokens`` (already clamped to the context by the
        driver) and ``sampling.seed`` (always set by the driver) go to the engine as they
        are; every EOS id is a stop condition."""
        ids = self._torch.tensor([list(prompt.tokens)], dtype=self._torch.long)
        return self._job_cls(
            input_ids=ids,
            max_new_tokens=sampling.max_tokens,
            min_new_tokens=0,
            seed=sampling.seed,
            stop_conditions=list(self._stop),
            decode_special_tokens=False,
            token_healing=False,
            identifier=identifier,
            **self._sampler(sampling),
            **self._filters(sampling),
        )

    def generate(self, prompt: Prompt, sampling: ResolvedSampling, cancel: CancelToken,
                 stats: GenerationStats) -> Iterator[str]:
        for _, piece in run_jobs(self.generator, self.make_job, [prompt], [sampling],
                                 [cancel], [stats], 1, self.engine):
            if piece is not None:
                yield piece

    def batcher(self) -> Batcher | None:
        """Jobs on the session's own generator, which batches them (ExLlamaV2 only in
        paged mode: unpaged, its generator runs one sequence at a time)."""
        if not self._batching or self.generator is None:
            return None
        if self._batcher is None:
            self._batcher = JobBatcher(self.generator, self.make_job, self.engine)
        return self._batcher

    def close(self) -> None:
        batcher, self._batcher = self._batcher, None
        if batcher is not None:
            batcher.close()
        gen = getattr(self, "generator", None)
        if gen is not None:
            with contextlib.suppress(Exception):
                gen.clear_queue()
            self._close_generator(gen)
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
