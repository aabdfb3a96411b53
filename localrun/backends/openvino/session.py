"""OpenVINO GenAI: OpenVINO IR folders (and, unoptimized, some GGUF files) on CPU/GPU/NPU.

Two pipelines, one per session:

* CPU and GPUs: ``ContinuousBatchingPipeline`` (paged attention) runs every sequence,
  alone or batched, as the session's :class:`~localrun.backends.base.Batcher`
  (:mod:`.batcher`, given the loaded pipeline as an :class:`~.engine.Engine`), with
  prefix caching: a prompt that starts like an earlier one
  (the next turn of a chat, an agent's system prompt) prefills only what differs.
* NPU, or ``ATTENTION_BACKEND="SDPA"``: ``LLMPipeline``, one sequence at a time, no KV
  reuse across calls. ``generate`` blocks until the reply is done and reports tokens
  through a streamer callback, so a thread of its own runs each call and hands text
  pieces to the caller's generator through a :class:`~localrun.backends._worker.Relay`;
  the streamer answers ``CANCEL`` as soon as the caller cancels or closes the stream.

We always pass a token tensor, never text: the pipeline then neither re-tokenizes nor
re-applies a template, and ``prompt_tokens`` is exactly what we counted.

How localrun's sampling options map onto ``GenerationConfig``: :mod:`.engine`.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from localrun.backends._worker import Relay
from localrun.backends.base import (
    Batcher,
    GenerationStats,
    LoadRequest,
    Prompt,
    Session,
    SessionBackend,
)
from localrun.backends.hf_config import (
    architecture,
    eos_ids,
    read_json,
    require_files,
    sampling_defaults,
    trained_context,
)
from localrun.backends.installed import installed_version, missing
from localrun.backends.logprobs import openvino_features
from localrun.backends.openvino import batcher as openvino_batch
from localrun.backends.openvino.constraints import mapped_error, openvino_structured_config
from localrun.backends.openvino.devices import cpu_kv_precision, npu_lengths, ov_device
from localrun.backends.openvino.engine import SIZE_MAX, Engine, open_pipeline
from localrun.backends.openvino.facts import SPEC
from localrun.backends.openvino.speculative import pipeline_properties
from localrun.backends.openvino.text import Detokenizer, TextWindow
from localrun.backends.openvino.vision import OpenVINOVisionSession, is_vlm
from localrun.backends.options import check_options
from localrun.errors import (
    ChatTemplateError,
    ContextOverflowError,
    LocalrunError,
    ModelFileError,
)
from localrun.formats.integrity import check_openvino_ir
from localrun.memory import context_window
from localrun.sampling import ResolvedSampling
from localrun.structured.constraint import Constraint
from localrun.types import CancelToken, FinishReason, Message, ModelInfo

#: Files an OpenVINO GenAI LLM folder must have. A Tokenizer without its IRs
#: constructs fine and fails only at the first encode, so we check up front.
REQUIRED_FILES = ("openvino_model.xml", "openvino_model.bin",
                  "openvino_tokenizer.xml", "openvino_tokenizer.bin",
                  "openvino_detokenizer.xml", "openvino_detokenizer.bin")
TOKENIZER_HINT = ("re-export the model with its tokenizer (optimum-cli export openvino ...), "
                  "or make the IRs: convert_tokenizer MODEL --with-detokenizer -o FOLDER")

#: Weight element types in the IR -> the quantization users know.
IR_WEIGHT_TYPES: tuple[tuple[str, str], ...] = (
    ("u4", "int4"), ("i4", "int4"), ("nf4", "nf4"), ("u8", "int8"), ("i8", "int8"),
    ("f16", "fp16"), ("bf16", "bf16"),
)

class OpenVINOSession(Session):
    #: True (set at load) with the batching pipeline (CPU, GPU): a sequence alone runs
    #: through it too, so its prefix cache serves every call and one pipeline is loaded.
    batch_alone = False
    _batcher: Batcher | None = None
    #: footprint: the batcher's sequences share the KV cache pages of the context (it
    #: reserves nothing: per_slot 0); its prefix cache's cells are in those pages too
    memory_facts = SPEC

    def batcher(self) -> Batcher | None:
        """The ContinuousBatchingPipeline every sequence runs through (openvino_batch.py);
        None with LLMPipeline (NPU, ATTENTION_BACKEND="SDPA"): calls run in turn."""
        return self._batcher

    def __init__(self, request: LoadRequest) -> None:
        path = Path(request.path).expanduser()
        gguf = path.is_file() and path.suffix.lower() == ".gguf"
        config: dict[str, Any] = {}
        gen_config: dict[str, Any] = {}
        if gguf:
            from localrun.formats.gguf import read_gguf

            meta = read_gguf(path)  # ModelFileError for a damaged file
            trained = meta.context_length
            quant: str | None = meta.quantization
            arch: str | None = meta.architecture
            name = meta.name
            self.sampling_defaults = dict(meta.sampling_defaults)
        else:
            require_files(path, REQUIRED_FILES, what="OpenVINO IR", hint=TOKENIZER_HINT)
            check_openvino_ir(path)  # each .bin against its IR's Const layers
            config = read_json(path / "config.json")
            gen_config = read_json(path / "generation_config.json")
            trained = trained_context(config)
            quant = _ir_quantization(path)
            arch = architecture(config)
            name = config.get("_name_or_path") or path.name
            self.sampling_defaults = sampling_defaults(gen_config)
        try:
            import openvino_genai as ov_genai
        except ImportError as e:  # installed per metadata but broken
            raise missing(SPEC, reason=str(e)) from e
        self._og = ov_genai
        device = ov_device(request.device)
        options = check_options(SPEC, request.options)
        context = context_window(request.context, trained)
        props: dict[str, Any] = {}
        self.max_prompt: int | None = None  # the NPU's prompt limit
        npu_only = [k for k in ("MAX_PROMPT_LEN", "MIN_RESPONSE_LEN", "GENERATE_HINT",
                                "PREFILL_HINT") if k in options]
        if npu_only and device != "NPU":
            raise LocalrunError(f"{', '.join(npu_only)} applies to the NPU only, not {device}",
                                hint="load with device='NPU', or leave the option out")
        if device == "NPU":
            self.max_prompt, response = npu_lengths(context, options)
            props.update(MAX_PROMPT_LEN=self.max_prompt, MIN_RESPONSE_LEN=response)
            context = self.max_prompt + response
        prefix_caching = bool(options.pop("PREFIX_CACHING", True))
        paged = device.startswith(("CPU", "GPU")) and options.get("ATTENTION_BACKEND") != "SDPA"
        if request.threads:
            props["INFERENCE_NUM_THREADS"] = request.threads
        props.update(options)
        if device.startswith("CPU"):
            if request.exact:
                # f32 unless told otherwise. Where the plugin computes in bf16 (AVX-512
                # BF16, AMX) a prompt's reply depended on where its keys and values came
                # from: the same seed sampled differently on a prompt's first call than
                # on later ones (its prefix then from the cache), and greedy replies
                # changed with reuse and with batching. In f32 they are the same token
                # for token, at some prefill and batch throughput on such a CPU
                # (docs/results/kv_reuse.md). By default: the plugin's own precision.
                props.setdefault("INFERENCE_PRECISION_HINT", "f32")
            props["KV_CACHE_PRECISION"] = cpu_kv_precision(props, paged)
        self.load_properties = dict(props)
        # its own speculative decoding (.speculative): prompt lookup or a draft model
        spec_mode, spec_props = pipeline_properties(ov_genai, request, device,
                                                    ov_genai.Tokenizer)
        self._pipe: Any
        try:
            if paged:
                # the CPU plugin refuses ATTENTION_BACKEND: it is LLMPipeline's
                self._pipe = open_pipeline(str(path), device, {
                    k: v for k, v in props.items() if k != "ATTENTION_BACKEND"}
                    | spec_props, context=context, prefix_caching=prefix_caching)
                engine_cfg = self._pipe.get_config()
            else:
                self._pipe = ov_genai.LLMPipeline(str(path), device, **props, **spec_props)
                engine_cfg = self._pipe.get_generation_config()
            self._tok = self._pipe.get_tokenizer()
        except RuntimeError as e:
            raise ModelFileError(str(path), f"OpenVINO GenAI could not load it "
                                 f"({_first_line(e)})", hint=(
                                     "load with the engine option ATTENTION_BACKEND='SDPA' "
                                     "(one sequence at a time, no KV reuse), or re-download "
                                     "the model" if paged else None)) from e
        eos = eos_ids(gen_config, config) | set(engine_cfg.stop_token_ids)
        tok_eos = self._tok.get_eos_token_id()
        if 0 <= tok_eos < SIZE_MAX:
            eos.add(tok_eos)
        if 0 <= engine_cfg.eos_token_id < SIZE_MAX:
            eos.add(engine_cfg.eos_token_id)
        self._eos = frozenset(eos)
        self._engine = Engine(ov_genai, self._pipe, self._eos, self._tok.decode,
                              speculative=spec_mode)
        if paged:
            self._batcher = openvino_batch.ContinuousBatcher(self._engine)
            self.batch_alone = True
            self.features = openvino_features(installed_version(SPEC))  # logprobs.py
        self.chat_template = getattr(self._tok, "chat_template", None) or None
        self.bos_token, self.eos_token = self._tok.get_bos_token(), self._tok.get_eos_token()
        self.info = ModelInfo(
            backend="openvino",
            engine_version=installed_version(SPEC) or "unknown",
            format="gguf" if gguf else "openvino",
            quantization=quant,
            path=str(path),
            context_length=context,
            trained_context_length=trained,
            architecture=arch,
            name=str(name) if name else None,
            device=device,
        )
        self.device = device

    # -- encoding ---------------------------------------------------------------------

    def _encode(self, text: str, special: bool) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=special).input_ids.data
        return [int(t) for t in ids[0]]

    def encode_chat(self, messages: Sequence[Message]) -> Prompt:
        try:
            text = self._tok.apply_chat_template(list(messages), add_generation_prompt=True)
        except RuntimeError as e:  # Minja's error, e.g. the template's raise_exception
            raise ChatTemplateError(str(e), messages) from e
        # The rendered template already holds the special tokens it wants (as
        # transformers' apply_chat_template(tokenize=True) does, add none).
        return Prompt(self._encode(text, special=False), text)

    def encode_text(self, text: str) -> Prompt:
        return Prompt(self._encode(text, special=True), text)

    def encode_rendered(self, text: str) -> Prompt:
        return Prompt(self._encode(text, special=False), text)

    def check_constraint(self, constraint: Constraint) -> None:
        # XGrammar compiles the schema inside generate(): its refusals surface there
        openvino_structured_config(self._og, constraint)

    # -- generation -------------------------------------------------------------------

    def generate(self, prompt: Prompt, sampling: ResolvedSampling, cancel: CancelToken,
                 stats: GenerationStats) -> Iterator[str]:
        if self._batcher is not None:
            return self._generate_batched(self._batcher, prompt, sampling, cancel, stats)
        return self._generate_llm(prompt, sampling, cancel, stats)

    @staticmethod
    def _generate_batched(batcher: Batcher, prompt: Prompt, sampling: ResolvedSampling,
                          cancel: CancelToken, stats: GenerationStats) -> Iterator[str]:
        """One sequence through the batcher, on the caller's thread (the driver sends
        sequences to its engine thread instead; this serves direct callers)."""
        key = 0  # the driver numbers its sequences from 1
        batcher.add(key, prompt, sampling, stats)
        ended = False
        try:
            while not ended:
                if cancel.cancelled:
                    batcher.cancel(key)
                for k, piece in batcher.step():
                    if k != key:
                        continue
                    if piece is None:
                        ended = True
                    else:
                        yield piece
        finally:
            while not ended:  # closed early: free its KV blocks before returning
                batcher.cancel(key)
                ended = any(k == key and p is None for k, p in batcher.step())

    def _generate_llm(self, prompt: Prompt, sampling: ResolvedSampling, cancel: CancelToken,
                      stats: GenerationStats) -> Iterator[str]:
        if self.max_prompt is not None and len(prompt.tokens) > self.max_prompt:
            # The NPU's prefill has a static shape: the engine would raise mid-call.
            raise ContextOverflowError(len(prompt.tokens), self.max_prompt,
                                       trained_context=self.info.trained_context_length)
        import numpy as np
        import openvino

        og = self._og
        cfg = self._engine.config(sampling)
        ids = openvino.Tensor(np.asarray([list(prompt.tokens)], dtype=np.int64))
        relay: Relay[Any] = Relay()
        eos = self._eos
        # Detokenize on the engine's thread, between tokens: the CPU plugin's results
        # depend on what else runs in the process, so decoding concurrently with
        # inference made seeded samples differ from run to run.
        detok, window = Detokenizer(self._tok.decode), TextWindow()
        running, stop, cancelled = (og.StreamingStatus.RUNNING, og.StreamingStatus.STOP,
                                    og.StreamingStatus.CANCEL)

        class Streamer(og.StreamerBase):  # type: ignore[misc, name-defined]
            ended: FinishReason | None = None

            def write(self, token: int | list[int]) -> Any:
                for t in (token if isinstance(token, list) else (token,)):
                    if t in eos:
                        self.ended = "stop"
                        return stop
                    relay.put(detok.pieces([(window, t)])[0])
                if relay.halted or cancel.cancelled:
                    return cancelled
                return running

            def end(self) -> None:
                pass

        streamer = Streamer()

        def work() -> Any:
            try:
                return self._pipe.generate(ids, cfg, streamer)
            except Exception as e:
                mapped = mapped_error(e, sampling.constraint)
                if mapped is e:
                    raise
                raise mapped from e

        relay.start(work, name="localrun-openvino")
        try:
            for piece in relay:
                stats.completion_tokens += 1
                yield piece
            relay.result()  # the engine's exception, if it raised
            stats.finish_reason = streamer.ended or "length"
        finally:
            result = relay.close()  # closed early: the thread ends before we return
            if result is not None:
                _fill_stats(stats, result.perf_metrics)

    def close(self) -> None:
        if self._batcher is not None:
            self._batcher.close()
            self._batcher = None
        self._pipe = None
        self._tok = None


def _fill_stats(stats: GenerationStats, pm: Any) -> None:
    stats.prefill_tokens = int(pm.get_num_input_tokens())
    stats.prefill_seconds = float(pm.get_ttft().mean) / 1000.0
    durations = list(pm.raw_metrics.m_durations)  # microseconds, one per decoded token
    stats.decode_tokens = len(durations)
    stats.decode_seconds = sum(durations) / 1e6


def _ir_quantization(folder: Path) -> str | None:
    qc = read_json(folder / "openvino_config.json").get("quantization_config")
    if isinstance(qc, dict) and isinstance(qc.get("bits"), int):
        return f"int{qc['bits']}"
    try:
        xml = (folder / "openvino_model.xml").read_text(encoding="utf-8", errors="replace")
    except OSError as e:
        raise ModelFileError(str(folder / "openvino_model.xml"), str(e)) from e
    types = set(re.findall(r'element_type="([a-z0-9]+)"', xml))
    return next((q for t, q in IR_WEIGHT_TYPES if t in types), None)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:300] if text else type(e).__name__


def open_session(request: LoadRequest) -> Session:
    """A vision-language model's folder on VLMPipeline (:mod:`.vision`), else the LLM
    pipelines."""
    if is_vlm(request.path):
        return OpenVINOVisionSession(request)
    return OpenVINOSession(request)


BACKEND = SessionBackend("openvino", open_session)
