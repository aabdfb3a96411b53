"""ONNX Runtime GenAI: GenAI model folders (genai_config.json + model.onnx) on CPU, CUDA, DML.

The engine is driven token by token on the caller's thread: ``append_tokens`` runs the
model, ``get_logits`` gives the next token's scores, and localrun's sampler
(:mod:`localrun.backends.logits_sampler`, its table says what each option does) picks
the token, which is appended in turn. Plain greedy calls (no repetition penalty, no
constraint) let the engine pick (``generate_next_token`` on a greedy Generator: the
engine's own loop, the same tokens). The engine's sampler is never used:

* **KV reuse across calls.** The session keeps one ``og.Generator`` (one KV cache) from
  call to call; a call ``rewind_to``-s the longest prefix it shares with the previous
  prompt and prefills only the rest, so a conversation or an agent's long system prompt
  is not prefilled again each turn. A Generator's search options (sampling, seed,
  ``max_length``) are fixed when it is made, so a kept one cannot sample with each
  call's own options and seed; localrun's sampler can (numpy PCG64 seeded per call: the
  same seed gives the same text whether or not the cache was reused).
* **Speed.** Per token on a 2-core x86 CPU, SmolLM2-135M int4: greedy is the engine's
  loop; top_p 0.9 without top_k costs 19 ms through localrun's sampler, 30 ms through
  the engine's (it sorts the vocabulary).

What is reused: the rows of the previous **prompt** only (not the previous reply's,
whose KV came from one-token decode steps), and only rows that a fresh prefill of the
new prompt computes bit for bit the same (:func:`reusable`): ONNX Runtime's CPU kernels
(MLAS) multiply the int4 weights in tiles of :data:`ROW_TILE` prompt rows, and a tile of
one row takes the single-row kernel, whose sums differ (up to 0.7 logit on
SmolLM2-135M). So greedy output with reuse is the output without, token for token
(tests/test_onnx_kv_reuse.py): a turn prefills the previous reply and the new message.
``stats.prefill_tokens`` counts the tokens prefilled. Checked on CPU only (GPU kernels
may tile otherwise: there the rule is kept, bit-exactness is untested).

One cached prefix per Model: a Generator is one KV cache with no snapshot to go back
to, so an agent alternating two system prompts prefills each again on every switch
(several prefixes would take a Generator, and a whole KV buffer, each).

Memory: the kept Generator holds its KV buffer between calls (``past_present_share_buffer``
allocates it for ``max_length`` tokens up front): ``max_length`` x layers x 2 x KV heads
x head size x 4 bytes (float32 on CPU), 45 KiB a token for SmolLM2-135M. It starts at
:data:`KEPT_TOKENS` tokens and doubles when a call needs more (prompt + max_tokens), up
to the context (SmolLM2-135M at 8192: 360 MiB); growing starts a new, empty Generator.
``close()`` frees it.

Batching: none; the driver runs calls one at a time. One Generator with ``batch_size`` >
1 fixes its rows when it is made (none joins or leaves early), shares one set of search
options, and needs prompts padded with ``pad_token_id``, which the engine's attention
mask hides wherever it occurs: SmolLM2's pad is its EOS ``<|im_end|>``, in every chat
prompt (3 of 4 padded replies differed from the same prompts alone). 0.18's ``og.Engine``
batches on CPU through its static path: 4 greedy requests started together ran 1.3-2.2x
the tokens/s of this loop with each session sized to prompt + max_tokens (0.8-1.9x at
its default, the context); but a request arriving while a batch runs waits until every
row of it ends, and it shows no logits (no min_p, no llguidance mask; a seed would give
other text than alone) and keeps no prefix across requests: a Batcher on it would help
only greedy requests that arrive together. scripts/bench_onnx_batching.py measures it
(docs/results/kv_reuse.md).

Other engine facts: EOS is ``Tokenizer.eos_token_ids`` plus genai_config /
generation_config ids (the engine reports no finish reason); stop strings are the
driver's; ``max_tokens`` arrives clamped to the context and is counted here.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from localrun.backends import engine_version
from localrun.backends.base import (
    GenerationStats,
    LoadRequest,
    Prompt,
    Session,
    check_options,
)
from localrun.backends.hf_config import (
    eos_ids,
    read_chat_template,
    read_json,
    require_files,
    sampling_defaults,
    token_ids,
)
from localrun.backends.logits_sampler import LogitsSampler
from localrun.errors import (
    ChatTemplateError,
    ConstrainedDecodingUnavailableError,
    EngineNotInstalledError,
    EngineUnavailableError,
    GenerationError,
    LocalrunError,
    ModelFileError,
)
from localrun.formats.integrity import check_onnx_genai
from localrun.memory import context_window
from localrun.sampling import ResolvedSampling
from localrun.structured.constraint import Constraint
from localrun.structured.engines import LazyGrammar
from localrun.structured.grammar import tokenizer_from_json
from localrun.types import CancelToken, Message, ModelInfo

#: localrun device names -> ONNX Runtime GenAI execution providers. ``cuda:1`` / ``dml:1``
#: pick a GPU by index (the provider option ``device_id``).
PROVIDERS: dict[str, str] = {"cpu": "cpu", "cuda": "cuda", "gpu": "cuda", "dml": "dml",
                             "directml": "dml"}
_DEVICE = re.compile(r"^([a-z]+)(?::(\d+))?$")

#: Prompt rows per tile of ONNX Runtime's CPU int4 matmul (MLAS ``StrideM``), counted
#: from the first row of each ``append_tokens``; a tile of one row takes the single-row
#: kernel, whose sums differ from a larger tile's (see :func:`reusable`).
ROW_TILE = 128

#: Tokens the kept Generator's KV buffer holds at first; it doubles when a call needs more.
KEPT_TOKENS = 1024

BUILD_HINT = ("re-download the model, or build one: python -m onnxruntime_genai.models.builder "
              "-i MODEL_DIR -o OUT -p int4 -e cpu")


def _check_files(folder: Path) -> dict[str, Any]:
    """genai_config.json and the decoder it names, checked before the engine is touched."""
    require_files(folder, ("genai_config.json",), what="ONNX Runtime GenAI", hint=BUILD_HINT)
    cfg = read_json(folder / "genai_config.json", required=True)
    model = cfg.get("model")
    decoder = model.get("decoder") if isinstance(model, dict) else None
    filename = decoder.get("filename") if isinstance(decoder, dict) else None
    if not isinstance(filename, str):
        raise ModelFileError(str(folder / "genai_config.json"), "no model.decoder.filename",
                             hint=BUILD_HINT)
    require_files(folder, (filename,), what="ONNX Runtime GenAI", hint=BUILD_HINT)
    check_onnx_genai(folder)  # the external data against the .onnx files' own entries
    names = {p.name for p in folder.iterdir()}
    if not names & {"tokenizer.json", "tokenizer.model", "tokenizer_config.json"}:
        raise ModelFileError(str(folder), "ONNX Runtime GenAI model has no tokenizer "
                             "(tokenizer.json)", hint=BUILD_HINT)
    return cfg


def parse_device(device: str) -> tuple[str, int | None]:
    """``(provider, GPU index or None)`` for a device string."""
    m = _DEVICE.match(device.strip().lower())
    provider = PROVIDERS.get(m.group(1)) if m else None
    if m is None or provider is None or (provider == "cpu" and m.group(2)):
        raise LocalrunError(f"Unknown device {device!r} for ONNX Runtime GenAI",
                            hint="use one of: cpu, cuda, cuda:N, dml, dml:N")
    return provider, int(m.group(2)) if m.group(2) else None


def config_device(genai_config: dict[str, Any]) -> str:
    """Where genai_config.json runs the model: its first execution provider (and the
    device_id it names), "cpu" when it names none."""
    model = genai_config.get("model")
    decoder = model.get("decoder") if isinstance(model, dict) else None
    session = decoder.get("session_options") if isinstance(decoder, dict) else None
    entries = session.get("provider_options") if isinstance(session, dict) else None
    for entry in entries if isinstance(entries, list) else []:
        if isinstance(entry, dict) and entry:
            name, options = next(iter(entry.items()))
            provider = PROVIDERS.get(str(name).lower(), str(name).lower())
            index = options.get("device_id") if isinstance(options, dict) else None
            return f"{provider}:{index}" if index not in (None, "") else provider
    return "cpu"


def require_build(provider: str, device: str) -> None:
    """Refuse a GPU provider the installed distribution was not built with (the engine's
    own error would say only that the provider failed), naming what to install."""
    if provider == "cpu":
        return
    from localrun.backends import BACKENDS, installed_build

    spec = BACKENDS["onnx"]
    needed = next((b for b in spec.builds if b.device == provider), None)
    have = installed_build("onnx")
    if needed is None or (have is not None and have.device == provider):
        return
    current = have.dist if have is not None else spec.dists[0]
    raise EngineUnavailableError(
        "ONNX Runtime GenAI",
        f"device {device} needs the {needed.dist} build, and {current} is installed"
        + (" (CPU only)" if have is None else ""),
        hint=f"pip uninstall -y {current} && pip install 'localrun[{needed.extra}]', "
        "or load with device='cpu'")


class OnnxGenAISession(Session):
    def __init__(self, request: LoadRequest) -> None:
        path = Path(request.path).expanduser()
        genai_cfg = _check_files(path)
        model_cfg: dict[str, Any] = genai_cfg["model"]
        search = genai_cfg.get("search")
        gen_config = read_json(path / "generation_config.json")
        config = read_json(path / "config.json")
        try:
            import onnxruntime_genai as og
        except ImportError as e:  # installed per metadata but broken
            raise EngineNotInstalledError("ONNX Runtime GenAI", "onnx", reason=str(e)) from e
        self._og = og
        self._gen: Any = None  # the kept og.Generator (module docstring)
        self._gen_tokens = 0  # the tokens its KV buffer holds
        self._cached: Any = _NOTHING  # its reusable rows' tokens (an int32 array)
        self._calls = 0  # generate() calls so far: a stale stream sees a newer one
        check_options("onnx", request.options)
        if request.device:
            provider, index = parse_device(request.device)
            device = provider + (f":{index}" if index is not None else "")
        else:  # genai_config.json decides, and is left as it is
            device = config_device(genai_cfg)
            provider, index = device.split(":")[0], None
        require_build(provider, device)
        try:
            og_config = og.Config(str(path))
            if request.device:
                og_config.clear_providers()
                if provider != "cpu":
                    og_config.append_provider(provider)
                    if index is not None:
                        og_config.set_provider_option(provider, "device_id", str(index))
            self._model = og.Model(og_config)
            self._tok = og.Tokenizer(self._model)
            # a second tokenizer for chat prompts: the rendered template already holds
            # the special tokens it wants (transformers' apply_chat_template does the same)
            self._chat_tok = og.Tokenizer(self._model)
            self._chat_tok.update_options(add_special_tokens="false")
        except LocalrunError:
            raise
        except Exception as e:  # onnxruntime_genai raises RuntimeError / OrtException
            raise ModelFileError(str(path), "ONNX Runtime GenAI could not load it "
                                 f"({str(e).strip().splitlines()[0][:300] if str(e) else e!r})",
                                 hint=BUILD_HINT) from e
        self._eos = frozenset(set(int(t) for t in self._tok.eos_token_ids)
                              | token_ids(model_cfg.get("eos_token_id"))
                              | eos_ids(gen_config, config))
        self.sampling_defaults = sampling_defaults(gen_config) if gen_config else (
            sampling_defaults(search) if isinstance(search, dict) else {})
        template = read_chat_template(path)
        self.chat_template, self.bos_token, self.eos_token = \
            template.template, template.bos_token, template.eos_token
        vocab = model_cfg.get("vocab_size")
        self._grammar = LazyGrammar("onnx", lambda: self._llg_tokenizer(path),
                                    vocab if isinstance(vocab, int) else None)
        trained = model_cfg.get("context_length")
        trained = trained if isinstance(trained, int) and trained > 0 else None
        self.info = ModelInfo(
            backend="onnx",
            engine_version=engine_version("onnx") or "unknown",
            format="onnx",
            quantization=_quantization(path),
            path=str(path),
            context_length=context_window(request.context, trained),
            trained_context_length=trained,
            architecture=str(model_cfg.get("type")) if model_cfg.get("type") else None,
            name=path.name,
            device=device,
        )

    # -- encoding ---------------------------------------------------------------------

    def encode_chat(self, messages: Sequence[Message]) -> Prompt:
        try:
            text = self._chat_tok.apply_chat_template(json.dumps(list(messages)),
                                                      add_generation_prompt=True)
        except Exception as e:  # ort-extensions' Minja error, e.g. the raise_exception
            raise ChatTemplateError(str(e), messages) from e
        return Prompt([int(t) for t in self._chat_tok.encode(text)], text)

    def encode_text(self, text: str) -> Prompt:
        return Prompt([int(t) for t in self._tok.encode(text)], text)

    def encode_rendered(self, text: str) -> Prompt:
        return Prompt([int(t) for t in self._chat_tok.encode(text)], text)

    # -- constrained decoding (llguidance through get_logits/set_logits) ----------------

    def _llg_tokenizer(self, folder: Path) -> Any:
        source = folder / "tokenizer.json"
        if not source.is_file():
            raise ConstrainedDecodingUnavailableError(
                "ONNX Runtime GenAI", f"{folder} has no tokenizer.json for llguidance",
                hint="structured output needs a Hugging Face fast tokenizer (tokenizer.json)")
        return tokenizer_from_json(source.read_text(encoding="utf-8"), sorted(self._eos))

    def check_constraint(self, constraint: Constraint) -> None:
        self._grammar.check(constraint)

    # -- generation -------------------------------------------------------------------

    def _generator(self, need: int) -> Any:
        """The kept Generator, made (again, empty) when there is none or its KV buffer
        holds fewer than ``need`` tokens."""
        if self._gen is not None and self._gen_tokens >= need:
            return self._gen
        size = max(need, min(max(KEPT_TOKENS, 2 * self._gen_tokens), self.info.context_length))
        self._drop_generator()  # the old buffer goes before the new one is allocated
        params = self._og.GeneratorParams(self._model)
        # greedy and neutral: the engine only runs the model, localrun chooses the tokens
        params.set_search_options(max_length=size, min_length=0, num_beams=1,
                                  num_return_sequences=1, no_repeat_ngram_size=0,
                                  repetition_penalty=1.0, do_sample=False)
        self._gen = self._og.Generator(self._model, params)
        self._gen_tokens = size
        return self._gen

    def _drop_generator(self) -> None:
        self._gen = None
        self._gen_tokens = 0
        self._cached = _NOTHING

    def generate(
        self,
        prompt: Prompt,
        sampling: ResolvedSampling,
        cancel: CancelToken,
        stats: GenerationStats,
    ) -> Iterator[str]:
        import numpy as np

        limit = sampling.max_tokens  # the driver keeps it within the context
        tokens = np.asarray(prompt.tokens, dtype=np.int32)
        n = int(tokens.shape[0])
        # the last generated token is chosen, never appended: prompt + limit - 1 rows
        generator = self._generator(n + limit)
        self._calls += 1
        call = self._calls
        keep = reusable(self._cached, tokens)
        sampler = LogitsSampler(sampling, tokens)
        mask = self._grammar.mask(sampling.constraint) if sampling.constraint else None
        decode = self._tok.create_stream().decode
        eos = self._eos
        t0 = time.perf_counter()
        self._cached = _NOTHING  # until the prefill below has succeeded
        try:
            generator.rewind_to(keep)
            generator.append_tokens(tokens[keep:])
        except Exception:
            self._drop_generator()  # its state is unknown now: the next call makes one
            raise
        t1 = time.perf_counter()
        # the prompt's rows are reusable, less a last row that ran alone in its tile (a
        # longer prompt's fresh prefill computes it in a larger one)
        self._cached = tokens if (n - keep) % ROW_TILE != 1 else tokens[:-1]
        stats.prefill_tokens = n - keep
        stats.prefill_seconds = t1 - t0
        # plain greedy: the kept Generator's own search (greedy, no penalty) picks the
        # token, as the engine's loop does; anything else reads the logits
        engine_picks = sampler.plain and mask is None
        t_first = t_last = 0.0
        try:
            while True:
                if engine_picks:
                    generator.generate_next_token()  # runs the last token, picks the best
                    token = int(generator.get_next_tokens()[0])
                else:
                    scores = generator.get_logits().reshape(-1)  # a copy, ours to change
                    if mask is not None:  # first: the filters then see allowed tokens only
                        scores = mask.apply(scores)
                    token = sampler.choose(scores)
                t_last = time.perf_counter()
                if not t_first:
                    t_first = t_last
                if token in eos:
                    stats.finish_reason = "stop"
                    return
                if mask is not None:
                    mask.consume(token)
                stats.completion_tokens += 1
                yield decode(token)
                if stats.completion_tokens >= limit or cancel.cancelled:
                    break
                if self._calls != call:  # a stream left open while a newer call ran
                    raise GenerationError("onnx", "a newer call on this model took over its "
                                          "generator; finish or close a stream before the next")
                if not engine_picks:
                    generator.append_tokens(np.array((token,), dtype=np.int32))
            stats.finish_reason = "length"
        except LocalrunError:
            raise
        except Exception:
            if self._calls == call:
                self._drop_generator()
            raise
        finally:
            # the first token's time is the end of prefill: choosing it reads the
            # logits append_tokens computed
            stats.prefill_seconds += (t_first - t1) if t_first else 0.0
            stats.decode_tokens = max(stats.completion_tokens - 1, 0)
            stats.decode_seconds = t_last - t_first if stats.decode_tokens else 0.0

    def close(self) -> None:
        self._drop_generator()  # its KV buffer first, while the model is still alive
        self._tok = None
        self._chat_tok = None
        self._model = None


#: An empty token array, without importing numpy at import time.
_NOTHING: Sequence[int] = ()


def reusable(cached: Any, prompt: Any) -> int:
    """How many leading tokens of ``prompt`` to keep from a Generator whose first
    ``len(cached)`` rows hold ``cached`` (computed as a fresh prefill computes them), so
    that prefilling the rest gives bit for bit the rows and logits of a fresh prefill of
    the whole prompt (token ids: sequences or int arrays).

    At most the common prefix less one token: the last prompt token always runs again,
    for its logits. Then the appended rest must end in a one-row tile exactly when a
    fresh prefill does (prompt length = 1 mod :data:`ROW_TILE`): such a prompt keeps a
    whole number of tiles (its rest then tiles as the fresh prefill does); any other
    keeps one token fewer where its rest would end in a tile of one.
    """
    import numpy as np

    n = len(prompt)
    limit = min(len(cached), n - 1)
    if limit <= 0:
        return 0
    differ = np.flatnonzero(np.asarray(cached[:limit]) != np.asarray(prompt[:limit]))
    common = int(differ[0]) if differ.shape[0] else limit
    if n % ROW_TILE == 1:
        return common - common % ROW_TILE
    if (n - common) % ROW_TILE == 1:
        return common - 1
    return common


def _quantization(folder: Path) -> str | None:
    """From the builder's name for the variant (cpu-int4-rtn-block-32, onnx-int4)."""
    m = re.search(r"(int4|int8|fp16|fp32|bf16)", str(folder).lower())
    if m:
        return m.group(1)
    return None


class OnnxGenAIBackend:
    name = "onnx"

    def load(self, request: LoadRequest) -> Session:
        return OnnxGenAISession(request)


BACKEND = OnnxGenAIBackend()
