"""ONNX Runtime GenAI: GenAI model folders (genai_config.json + model.onnx) on CPU, CUDA, DML.

The engine is driven token by token on the caller's thread: ``append_tokens`` runs the
model, ``get_logits`` gives the next token's scores, and localrun's sampler
(:mod:`localrun.backends.logits_sampler`, its table says what each option does) picks
the token, which is appended in turn. Plain greedy calls (no repetition penalty, no
constraint, no logprobs) let the engine pick (``generate_next_token`` on a greedy
Generator: the engine's own loop, the same tokens). The engine's sampler is never used:
a Generator's search options (sampling, seed, ``max_length``) are fixed when it is made,
so the one kept across calls could not sample with each call's own options and seed;
localrun's sampler can (numpy PCG64 seeded per call: the same seed gives the same text
whether or not the cache was reused), and costs less than the engine's at top_p alone.

**KV reuse across calls.** The session keeps one ``og.Generator`` (one KV cache) from
call to call; a call ``rewind_to``-s the longest prefix it shares with the previous
prompt and prefills only the rest. By default every row it holds is reused, the
previous reply's included (:func:`~.reuse.fast_reusable`): the next turn of a chat
prefills only its new message. With ``exact`` only rows that a fresh prefill of the new
prompt computes bit for bit the same are reused (:func:`~.reuse.reusable`: the CPU
kernels tile prompt rows, and a tile of one row takes another kernel), so greedy output
with reuse is the output without, token for token (tests/test_onnx_kv_reuse.py; checked
on CPU only); then:

* The previous **prompt**'s rows, always.
* The previous **reply**'s rows once they are *settled*: a reply's rows come from
  one-token decode steps, so they are not reusable as they are. When a call's reply
  ends and the call is still the newest, a thread waits :data:`SETTLE_DELAY` idle, then
  recomputes the reply's rows as a prefill, in pieces of :data:`SETTLE_MIN_ROWS` to
  :data:`SETTLE_MAX_ROWS` rows sized to take about :data:`SETTLE_PIECE_SECONDS`, so the
  next turn prefills only its new message. A new call, ``close()`` or a Generator
  regrow stops the settle between pieces and keeps the rows settled so far; a call
  within the delay finds nothing started. The settle is CPU work done while the caller
  reads or runs a tool, wasted when the next prompt does not continue the conversation,
  and ``append_tokens`` holds the GIL for a piece at a time. A failed settle raises
  nothing: the next call drops the Generator. ``SETTLE=False`` turns it off.

One cached prefix per Model: a Generator is one KV cache with no snapshot to go back
to, so an agent alternating two system prompts prefills each again on every switch.

Memory: the kept Generator holds its KV buffer between calls (``max_length`` x layers x
2 x KV heads x head size x the I/O type's bytes, allocated up front). It starts at
:data:`KEPT_TOKENS` tokens and doubles when a call needs more, up to the context;
growing starts a new, empty Generator. ``close()`` frees it.

Batching: none; the driver runs calls one at a time (a batched Generator fixes its rows
when made and needs padded prompts; ``og.Engine`` batches only requests that start
together and keeps no prefix). The measurements behind all of this:
docs/results/kv_reuse.md, "ONNX Runtime GenAI".

Other engine facts: EOS is ``Tokenizer.eos_token_ids`` plus genai_config /
generation_config ids (the engine reports no finish reason); stop strings are the
driver's; ``max_tokens`` arrives clamped to the context and is counted here.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from localrun.backends.base import (
    GenerationStats,
    LoadRequest,
    Prompt,
    Session,
    SessionBackend,
)
from localrun.backends.hf_config import (
    eos_ids,
    read_chat_template,
    read_json,
    require_files,
    sampling_defaults,
    token_ids,
)
from localrun.backends.installed import installed_version, missing
from localrun.backends.logits_sampler import LogitsSampler
from localrun.backends.logprobs import Scorer, TokenBytes, check_ids, onnx_prompt
from localrun.backends.onnx.devices import config_device, parse_device, require_build
from localrun.backends.onnx.facts import SPEC
from localrun.backends.onnx.reuse import ROW_TILE, fast_reusable, reusable
from localrun.backends.options import check_options
from localrun.errors import (
    ChatTemplateError,
    GenerationError,
    LocalrunError,
    ModelFileError,
)
from localrun.formats.integrity import check_onnx_genai
from localrun.memory import context_window
from localrun.sampling import ResolvedSampling
from localrun.structured.constraint import Constraint
from localrun.structured.grammar import LazyGrammar, tokenizer_in_folder
from localrun.types import CancelToken, Message, ModelInfo, TokenLogprob

#: Tokens the kept Generator's KV buffer holds at first; it doubles when a call needs more.
KEPT_TOKENS = 1024

#: Seconds a reply's rows wait, idle, before they are settled (module docstring): a call
#: that comes sooner (a script's next call) finds nothing started, and nothing is wasted.
SETTLE_DELAY = 0.05
#: Rows in a settle's first piece. The next pieces are sized to take about
#: SETTLE_PIECE_SECONDS (a new call waits for the piece running; other Python threads,
#: since append_tokens holds the GIL), SETTLE_MIN_ROWS to SETTLE_MAX_ROWS rows: a call
#: has a fixed cost of a few rows' time, so smaller pieces would mostly pay that
#: (docs/results/kv_reuse.md). Each piece is one row tile (less than ROW_TILE) of 2 rows
#: or more, never a tile of one row.
SETTLE_FIRST_ROWS = 16
SETTLE_MIN_ROWS = 8
SETTLE_MAX_ROWS = 32
SETTLE_PIECE_SECONDS = 0.04

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
            raise missing(SPEC, reason=str(e)) from e
        self._og = og
        self._gen: Any = None  # the kept og.Generator (module docstring)
        self._gen_tokens = 0  # the tokens its KV buffer holds
        self._cached: Any = _NOTHING  # its reusable rows' tokens (an int32 array)
        self._calls = 0  # generate() calls so far: a stale stream sees a newer one
        # one thread at a time touches the Generator (a call, or a reply's settle);
        # re-entrant: a stale stream's cleanup may run inside a call (garbage collection)
        self._lock = threading.RLock()
        self._settle: _Settle | None = None  # the settle running now
        self._last_settle: _Settle | None = None  # the latest one (tests, benchmarks)
        self._settled = threading.Event()  # set while no settle runs
        self._settled.set()
        self._broken = False  # a settle failed: the next call drops the Generator
        settle = check_options(SPEC, request.options).get("SETTLE", True)
        self.exact = request.exact  # False: every row is reused, nothing to settle
        self._settle_delay: float | None = (SETTLE_DELAY if settle and self.exact
                                            else None)  # None: off
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
        self._grammar = LazyGrammar("onnx", lambda: tokenizer_in_folder(
            path, sorted(self._eos), "ONNX Runtime GenAI"),
            vocab if isinstance(vocab, int) else None)
        self._vocab = vocab if isinstance(vocab, int) else 2**31 - 1
        self._scorer = Scorer(TokenBytes(path / "tokenizer.json",
                                         lambda t: str(self._tok.decode([t]))))
        outputs = model_cfg["decoder"].get("outputs")  # echo reads every row's logits there
        self._logits = str(outputs.get("logits", "logits")) if isinstance(outputs, dict) \
            else "logits"
        trained = model_cfg.get("context_length")
        trained = trained if isinstance(trained, int) and trained > 0 else None
        self.info = ModelInfo(
            backend="onnx",
            engine_version=installed_version(SPEC) or "unknown",
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

    def encode_ids(self, tokens: Sequence[int]) -> Prompt:
        return Prompt(check_ids("onnx", tokens, self._vocab))

    features = frozenset({"logprobs", "top", "echo", "tokens"})  # backends/logprobs.py
    #: footprint: one sequence at a time (no batcher), in its one KV cache of the context
    memory_facts = SPEC

    def prompt_logprobs(self, prompt: Prompt, top: int) -> list[TokenLogprob]:
        """A fresh prefill in the kept Generator (logprobs.onnx_prompt): its rows then
        serve the reply that follows as a previous call's prompt's would."""
        import numpy as np

        tokens = np.asarray(prompt.tokens, dtype=np.int32)
        self._take_over()
        with self._lock:
            if self._broken:
                self._drop_generator()
            generator = self._generator(len(tokens) + 1)
            self._cached = _NOTHING
            try:
                generator.rewind_to(0)
                out = onnx_prompt(generator, tokens, self._scorer, top, self._logits)
            except Exception:
                self._drop_generator()  # its state is unknown now: the next call makes one
                raise
            self._cached = tokens if len(tokens) % ROW_TILE != 1 else tokens[:-1]
        return out

    # -- constrained decoding (llguidance through get_logits/set_logits) ----------------
    # ONNX Runtime GenAI has its own llguidance build (GeneratorParams.set_guidance);
    # masking the logits here keeps one llguidance version and JSON layout for llama.cpp,
    # MLX and ONNX alike (its cost: docs/results/structured.md)

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
        self._broken = False

    def generate(self, prompt: Prompt, sampling: ResolvedSampling, cancel: CancelToken,
                 stats: GenerationStats) -> Iterator[str]:
        import numpy as np

        limit = sampling.max_tokens  # the driver keeps it within the context
        tokens = np.asarray(prompt.tokens, dtype=np.int32)
        n = int(tokens.shape[0])
        call = self._take_over()  # the previous reply's settle stops: its rows are exact
        with self._lock:
            if self._broken:  # a settle failed: the Generator's state is unknown
                self._drop_generator()
            # the last generated token is chosen, never appended: prompt + limit - 1 rows
            generator = self._generator(n + limit)
            keep = (reusable if self.exact else fast_reusable)(self._cached, tokens)
            self._cached = _NOTHING  # until the prefill below has succeeded
            t0 = time.perf_counter()
            try:
                generator.rewind_to(keep)
                generator.append_tokens(tokens[keep:])
            except Exception:
                self._drop_generator()  # its state is unknown now: the next call makes one
                raise
            t1 = time.perf_counter()
            # the prompt's rows are reusable, less a last row that ran alone in its tile
            # (a longer prompt's fresh prefill computes it in a larger one)
            self._cached = tokens if (n - keep) % ROW_TILE != 1 else tokens[:-1]
        sampler = LogitsSampler(sampling, tokens)
        mask = self._grammar.mask(sampling.constraint) if sampling.constraint else None
        decode = self._tok.create_stream().decode
        eos = self._eos
        lock = self._lock
        stats.prefill_tokens = n - keep
        stats.prefill_seconds = t1 - t0
        # plain greedy: the kept Generator's own search (greedy, no penalty) picks the
        # token, as the engine's loop does; anything else reads the logits
        entries, top = stats.logprobs, sampling.logprobs or 0  # None: not asked
        engine_picks = sampler.plain and mask is None and entries is None
        raw = None
        t_first = t_last = 0.0
        reply: list[int] = []  # the tokens the Generator holds after the prompt
        healthy = True
        try:
            while True:
                with lock:
                    self._check_newest(call)
                    if engine_picks:
                        generator.generate_next_token()  # runs the last token, picks the best
                        token = int(generator.get_next_tokens()[0])
                    else:
                        scores = generator.get_logits().reshape(-1)  # a copy, ours to change
                if not engine_picks:
                    if entries is not None:  # the raw logits: the penalty and mask change them
                        raw = scores.copy() if mask is not None or sampler.seen else scores
                    if mask is not None:  # first: the filters then see allowed tokens only
                        scores = mask.apply(scores)
                    token = sampler.choose(scores)
                    if entries is not None:
                        entries.append(self._scorer.entry(raw, token, top))
                t_last = time.perf_counter()
                if not t_first:
                    t_first = t_last
                reply.append(token)
                if token in eos:
                    stats.finish_reason = "stop"
                    return
                if mask is not None:
                    mask.consume(token)
                stats.completion_tokens += 1
                yield decode(token)
                if stats.completion_tokens >= limit or cancel.cancelled:
                    break
                if not engine_picks:
                    with lock:
                        self._check_newest(call)
                        generator.append_tokens(np.array((token,), dtype=np.int32))
            stats.finish_reason = "length"
        except LocalrunError:
            raise
        except Exception:
            healthy = False
            with lock:
                if self._calls == call:
                    self._drop_generator()
            raise
        finally:
            # the first token's time is the end of prefill: choosing it reads the
            # logits append_tokens computed
            stats.prefill_seconds += (t_first - t1) if t_first else 0.0
            stats.decode_tokens = max(stats.completion_tokens - 1, 0)
            stats.decode_seconds = t_last - t_first if stats.decode_tokens else 0.0
            if healthy and reply:
                if self.exact:
                    self._start_settle(call, generator, tokens, reply)
                else:
                    self._keep_reply(call, generator, tokens, reply)

    def _check_newest(self, call: int) -> None:
        """Refuse a stream left open while a newer call ran (it took the Generator)."""
        if self._calls != call:
            raise GenerationError("onnx", "a newer call on this model took over its "
                                  "generator; finish or close a stream before the next")

    def _keep_reply(self, call: int, generator: Any, tokens: Any, reply: list[int]) -> None:
        """The default mode: the rows the reply left (every reply token but the last,
        which was chosen, never appended) are reused as they are by the next call."""
        import numpy as np

        with self._lock:
            if self._calls == call and self._gen is generator and len(reply) > 1:
                self._cached = np.concatenate(
                    (tokens, np.asarray(reply[:-1], dtype=np.int32)))

    # -- settling: the reply's rows recomputed as a prefill, off the critical path -------

    def _take_over(self) -> int:
        """A new call (or close) owns the Generator from now: it stops the settle (which
        ends after the piece it is running) and waits for it; the rows settled so far
        stay (each piece is exact). Returns the new call's number."""
        running = self._settle
        if running is not None:
            # before waiting for the lock: the settle then stops at its next check
            # instead of racing this call for the lock between pieces
            running.abort.set()
        with self._lock:
            self._calls += 1
            call = self._calls
            settle, self._settle = self._settle, None
        if settle is not None:
            settle.abort.set()
            if settle.thread is not threading.current_thread():
                settle.thread.join()
        return call

    def _start_settle(self, call: int, generator: Any, tokens: Any, reply: list[int]) -> None:
        """After call ``call``'s reply ends (it is still the newest, its Generator
        healthy): recompute the reply's rows as a prefill on a thread (module docstring)."""
        import numpy as np

        with self._lock:
            if (self._calls != call or self._gen is not generator or self._settle is not None
                    or self._settle_delay is None):
                return
            full = np.concatenate((tokens, np.asarray(reply, dtype=np.int32)))
            start = len(self._cached)  # the prompt's exact rows (all of them, or all but one)
            if len(full) - start < 2:
                return
            settle = _Settle(call, start, len(full))
            settle.thread = threading.Thread(
                target=self._settle_rows, args=(settle, generator, full),
                name="localrun-onnx-settle")  # not a daemon: see _settle_rows
            self._settle = settle
            self._last_settle = settle
            self._settled.clear()
            try:
                settle.thread.start()
            except RuntimeError:  # interpreter shutdown: no new threads
                self._settle = None
                self._settled.set()

    def _settle_rows(self, settle: _Settle, generator: Any, full: Any) -> None:
        """The settle thread: after :data:`SETTLE_DELAY` idle, ``rewind_to`` the prompt's
        exact rows and ``append_tokens`` the rest of ``full`` in pieces (one tile of 2+
        rows each: none is a one-row tile), each under the lock, sized to take about
        :data:`SETTLE_PIECE_SECONDS`; stops between pieces when a call takes over
        or the main thread has ended (interpreter exit). Raises nothing: a failure
        leaves the Generator in an unknown state, which the next call drops."""
        abort = settle.abort
        main = threading.main_thread()
        rows = SETTLE_FIRST_ROWS
        try:
            if abort.wait(self._settle_delay or 0.0):
                return
            while True:
                left = settle.total - settle.done
                if left < 2 or abort.is_set() or not main.is_alive():
                    return
                piece = left if left - rows < 2 else rows  # never leave one row alone
                with self._lock:
                    if abort.is_set() or self._calls != settle.call or self._gen is not generator:
                        return
                    t0 = time.perf_counter()
                    try:
                        if settle.done == settle.start:
                            generator.rewind_to(settle.start)
                        generator.append_tokens(full[settle.done:settle.done + piece])
                    except Exception:
                        self._broken = True
                        self._cached = _NOTHING
                        settle.failed = True
                        return
                    spent = time.perf_counter() - t0
                    settle.done += piece
                    settle.seconds += spent
                    settle.pieces += 1
                    self._cached = full[:settle.done]
                # the next piece takes about SETTLE_PIECE_SECONDS (a call waits for one)
                rows = max(SETTLE_MIN_ROWS, min(SETTLE_MAX_ROWS, int(
                    piece * SETTLE_PIECE_SECONDS / max(spent, 1e-4))))
        except Exception:  # nothing may escape a thread; the state is unknown
            with self._lock:
                self._broken = True
                self._cached = _NOTHING
            settle.failed = True
        finally:
            with self._lock:
                if self._settle is settle:
                    self._settle = None
                self._settled.set()

    def close(self) -> None:
        self._take_over()  # a settle stops after its current piece, first
        with self._lock:
            self._drop_generator()  # its KV buffer first, while the model is still alive
            self._tok = None
            self._chat_tok = None
            self._model = None


class _Settle:
    """One reply's settle: its rows ``start`` .. ``total`` of the prompt + reply tokens,
    how far it got (``done``), and the flag that stops it between pieces."""

    def __init__(self, call: int, start: int, total: int) -> None:
        self.call = call
        self.start = start
        self.done = start  # rows recomputed so far: the Generator holds full[:done] exactly
        self.total = total
        self.pieces = 0
        self.seconds = 0.0  # in append_tokens
        self.failed = False
        self.abort = threading.Event()
        self.thread: threading.Thread = threading.Thread()


#: An empty token array, without importing numpy at import time.
_NOTHING: Sequence[int] = ()


def _quantization(folder: Path) -> str | None:
    """From the builder's name for the variant (cpu-int4-rtn-block-32, onnx-int4)."""
    m = re.search(r"(int4|int8|fp16|fp32|bf16)", str(folder).lower())
    if m:
        return m.group(1)
    return None


BACKEND = SessionBackend("onnx", OnnxGenAISession)
