"""Log probabilities from an engine's logits: the one place they are computed, for every
engine that shows its logits (llama.cpp, ONNX Runtime GenAI, MLX). OpenVINO GenAI's
ContinuousBatchingPipeline computes the chosen token's itself (raw from 2026.2: no
alternatives, no prompt); the other engines have none and refuse before generating.

**Which distribution.** Always the model's own: the log-softmax of the raw logits over
the whole vocabulary, before the repetition penalty, the temperature, top_k/top_p/min_p
and any structured-output mask. That is what OpenAI and vLLM report (vLLM's default
``logprobs_mode="raw_logprobs"``), and what a score must be: a sampled reply's logprobs
equal the greedy reply's at the same position, and lm-evaluation-harness's
loglikelihood does not depend on how a request samples. The chosen token is the one
the sampler drew, so at a temperature or under a mask it need not be the most likely.

**Cost.** Per token: a max, an exp and a sum over the vocabulary (float32, summed in
float64) and, with ``top_logprobs``, the k best found by :func:`~localrun.backends.
logits_sampler._top_k` (one strided pass, only a small pool sorted): a fraction of a
millisecond per token (scripts/bench_logprobs.py). Nothing runs when logprobs are not
asked for.

**Exactness.** A token's logprob and its place among the top ones come from the same
float32 logit minus the same float64 normaliser, so the chosen token's value equals the
best alternative's bit for bit exactly when it is the most likely (lm-evaluation-harness's
``is_greedy`` compares them with ``==``).
"""

from __future__ import annotations

import math
import re
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from localrun.errors import LocalrunError, UnsupportedFeatureError
from localrun.types import TokenLogprob, TopLogprob

if TYPE_CHECKING:
    from localrun.backends.base import Session
    from localrun.sampling import ResolvedSampling

#: Engines that report log probabilities, named in the error of those that do not.
SUPPORTED_BY = ("llama.cpp", "onnx", "mlx")

#: Prompt rows whose logits one forward pass keeps at once (echo): rows x vocabulary
#: float32 (512 x 49k: 96 MiB) at a time.
PROMPT_ROWS = 512


def check(session: Session, sampling: ResolvedSampling, token_prompt: bool) -> None:
    """UnsupportedFeatureError, before any token is generated, unless the session
    reports what ``sampling`` asks for (``Session.features``)."""
    have = session.features
    backend = session.info.backend
    asks = []
    if sampling.logprobs is not None:
        asks.append(("logprobs", "logprobs"))
        if sampling.logprobs > 0:
            asks.append(("top", "top_logprobs"))
    if sampling.echo:
        asks.append(("echo", "echo"))
    if token_prompt:
        asks.append(("tokens", "a token-id prompt"))
    for feature, option in asks:
        if feature not in have:
            engines = (*SUPPORTED_BY, "openvino") if feature == "logprobs" else SUPPORTED_BY
            raise UnsupportedFeatureError(backend, option, _WHY.get((backend, feature), _WHY[
                ("", feature)]), supported_by=engines)


#: Why an engine lacks a feature: (backend, feature), else ("", feature).
_WHY: dict[tuple[str, str], str] = {
    ("", "logprobs"): "the engine does not show localrun its logits",
    ("", "top"): "the engine does not show localrun its logits",
    ("", "echo"): "the engine does not show localrun the logits of the prompt's tokens",
    ("", "tokens"): "localrun passes this engine its prompt as text only",
    ("openvino", "top"): "OpenVINO GenAI reports the chosen token's log probability only",
    ("openvino", "echo"): "OpenVINO GenAI keeps no logits of the prompt's tokens",
    ("onnx", "echo"): "this ONNX model keeps the last position's logits only",
}


class Scorer:
    """One engine's log-probability entries: the math of the module docstring over a
    logits vector, and each token's bytes (``piece``, memoized by the engine or here)."""

    def __init__(self, piece: Callable[[int], bytes]) -> None:
        import numpy as np

        self._np = np
        self._piece = piece

    def entry(self, logits: Any, token: int, top: int) -> TokenLogprob:
        """The entry of ``token`` chosen from ``logits`` (raw, one per vocabulary entry;
        left unchanged), with its ``top`` most likely alternatives."""
        np = self._np
        row = logits if logits.dtype == np.float32 else logits.astype(np.float32)
        best = float(row.max())
        total = float(np.exp(row - np.float32(best)).sum(dtype=np.float64))
        norm = best + math.log(total) if total > 0 and math.isfinite(best) else best
        alts: tuple[TopLogprob, ...] = ()
        if top:
            alts = tuple(self._top(i, float(row[i]) - norm) for i in _best(row, top))
        text = self._piece(token)
        return TokenLogprob(_text(text), text, int(token), float(row[token]) - norm, alts)

    def _top(self, token: int, logprob: float) -> TopLogprob:
        text = self._piece(token)
        return TopLogprob(_text(text), text, token, logprob)

    def given(self, token: int, logprob: float) -> TokenLogprob:
        """The entry of ``token`` with a logprob the engine computed itself (OpenVINO
        GenAI: the chosen token's alone)."""
        text = self._piece(token)
        return TokenLogprob(_text(text), text, int(token), float(logprob))

    def first(self, token: int) -> TokenLogprob:
        """A prompt's first token: nothing before it, no logprob (OpenAI's None)."""
        text = self._piece(token)
        return TokenLogprob(_text(text), text, int(token), None)

    def prompt(self, rows: Any, tokens: Sequence[int], start: int, top: int
               ) -> list[TokenLogprob]:
        """Entries of ``tokens[start + 1 : start + 1 + len(rows)]``: row i holds the
        logits after ``tokens[start + i]``, the distribution of the next token."""
        return [self.entry(rows[i], int(tokens[start + 1 + i]), top)
                for i in range(min(len(rows), len(tokens) - start - 1))]


def _best(row: Any, k: int) -> list[int]:
    """The ``k`` best token ids of ``row``, best first, by id among equals."""
    from localrun.backends.logits_sampler import _top_k

    k = min(k, int(row.shape[0]))
    if k >= row.shape[0]:
        import numpy as np

        return [int(i) for i in np.argsort(-row, kind="stable")]
    ids, _ = _top_k(row, k)
    return [int(i) for i in ids[:k]]


def _text(piece: bytes) -> str:
    return piece.decode("utf-8", errors="replace")


class TokenBytes:
    """Each token id's bytes as a reply shows them (special tokens: ``b""``), from a
    Hugging Face ``tokenizer.json`` read by llguidance (exact bytes: byte-level BPE and
    SentencePiece byte fallback alike), built on first use (~0.5 s per 50k tokens);
    without one, the engine's own ``decode`` of the id alone."""

    def __init__(self, tokenizer_json: Path | None, decode: Callable[[int], str]) -> None:
        self._source = tokenizer_json
        self._decode = decode
        self._tok: Any = None
        self._tried = False
        self._lock = threading.Lock()
        self._memo: dict[int, bytes] = {}

    def __call__(self, token: int) -> bytes:
        piece = self._memo.get(token)
        if piece is None:
            piece = self._memo[token] = self._bytes(token)
        return piece

    def _bytes(self, token: int) -> bytes:
        tok = self._tokenizer()
        if tok is not None and 0 <= token < tok.vocab_size:
            if tok.is_special_token(token):
                return b""
            return bytes(tok.decode_bytes([token]))
        try:
            return self._decode(token).encode("utf-8", errors="replace")
        except Exception:  # an id the tokenizer does not know (a padded vocabulary)
            return b""

    def _tokenizer(self) -> Any:
        with self._lock:
            if not self._tried:
                self._tried = True
                if self._source is not None and self._source.is_file():
                    from localrun.structured.grammar import llguidance

                    try:
                        self._tok = llguidance().LLTokenizer(
                            self._source.read_text(encoding="utf-8"))
                    except Exception:  # a tokenizer.json llguidance cannot read
                        self._tok = None
            return self._tok


def check_ids(backend: str, tokens: Sequence[int], n_vocab: int) -> list[int]:
    """A token-id prompt as a list, each id within the vocabulary (an engine fed an id
    past it reads past its embedding table, or aborts the process)."""
    ids = [int(t) for t in tokens]
    if not ids:
        raise LocalrunError("The token-id prompt is empty",
                            hint="pass at least one token id, or a prompt string")
    bad = next((i for i, t in enumerate(ids) if not 0 <= t < n_vocab), None)
    if bad is not None:
        raise LocalrunError(
            f"Token id {ids[bad]} at position {bad} of the prompt is outside {backend}'s "
            f"vocabulary (0 to {n_vocab - 1})",
            hint="pass ids from this model's own tokenizer")
    return ids


def rows_of(logits: Any) -> Any:
    """An engine's logits output as (rows, vocabulary) float32."""
    import numpy as np

    out = np.asarray(logits)
    return out.reshape(-1, out.shape[-1]).astype(np.float32, copy=False)


def llama_row(lc: Any, ctx: Any, index: int | None, n_vocab: int, rows: int = 1) -> Any:
    """llama.cpp's logits, without a copy: output row ``index`` of the last decode
    (``llama_get_logits_ith``; -1: the last), or with ``index`` None its first ``rows``
    rows (rows x vocabulary). Valid until the context's next decode."""
    import numpy as np

    if index is None:
        return np.ctypeslib.as_array(lc.llama_get_logits(ctx), shape=(rows, n_vocab))
    return np.ctypeslib.as_array(lc.llama_get_logits_ith(ctx, index), shape=(n_vocab,))


def onnx_prompt(generator: Any, tokens: Any, scorer: Scorer, top: int, logits: str
                ) -> list[TokenLogprob]:
    """Echo on ONNX Runtime GenAI: ``tokens`` appended to an empty ``generator`` in
    pieces of :data:`PROMPT_ROWS` (a multiple of its row tiles, so its rows are those of
    one whole prefill), each piece's logits read from the model's ``logits`` output,
    which holds every row of the last run (``get_logits`` has the last only)."""
    out = [scorer.first(int(tokens[0]))]
    for start in range(0, len(tokens), PROMPT_ROWS):
        piece = tokens[start:start + PROMPT_ROWS]
        generator.append_tokens(piece)
        rows = rows_of(generator.get_output(logits))
        if rows.shape[0] != len(piece):
            raise UnsupportedFeatureError(
                "onnx", "echo", f"this model's {logits!r} output holds {rows.shape[0]} "
                f"row(s) for {len(piece)} prompt tokens (it was built to keep the last "
                "position's logits only)", supported_by=SUPPORTED_BY)
        out += scorer.prompt(rows, tokens, start, top)
    return out


#: OpenVINO GenAI's first release whose ``generated_log_probs`` are the raw model's
#: (its sampler keeps the logits as they came and their full-vocabulary log-sum-exp when
#: ``GenerationConfig.logprobs`` > 0); earlier ones report them after its processors.
OPENVINO_RAW = (2026, 2)


def openvino_features(version: str | None) -> frozenset[str]:
    """What OpenVINO GenAI's ContinuousBatchingPipeline reports: each chosen token's
    raw log probability, from :data:`OPENVINO_RAW` on (no alternatives, no prompt)."""
    parts = re.findall(r"\d+", version or "")
    release = tuple(int(x) for x in parts[:2])
    return frozenset({"logprobs"}) if len(release) == 2 and release >= OPENVINO_RAW \
        else frozenset()
