"""The loaded mlx-lm model as the session and its batcher both drive it, and the one mlx
thread of the process they both run on. The session makes an :class:`Engine` at load and
hands it to the batcher, which reads nothing else of the session's."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from localrun.backends._worker import Worker
from localrun.backends.logprobs import Scorer
from localrun.backends.mlx.reuse import PrefixCache
from localrun.structured.grammar import LazyGrammar

_SHARED: Worker | None = None
_SHARED_LOCK = threading.Lock()


def shared_worker() -> Worker:
    """The one mlx thread of this process, shared by every MLX session.

    mlx streams are thread-local, and a thread that used them must not end before the
    process does: ending one worker per closed session sometimes aborted the process
    at exit ("terminate called without an active exception", seen in CI here).
    """
    global _SHARED
    with _SHARED_LOCK:
        if _SHARED is None:
            _SHARED = Worker("localrun-mlx")
        return _SHARED


@dataclass(frozen=True)
class Engine:
    """One loaded model: every mlx call on it runs on ``worker``."""

    worker: Worker
    model: Any
    tokenizer: Any  # mlx-lm's TokenizerWrapper
    eos: frozenset[int]  # every end-of-sequence id
    prefixes: PrefixCache  # the prompt caches kept between calls (mlx thread only)
    grammar: LazyGrammar  # structured output (llguidance, off the mlx thread)
    scorer: Scorer  # log probabilities

    def detokenizer(self) -> Any:
        """A new streaming detokenizer that keeps the reply's first space."""
        return keep_first_space(self.tokenizer.detokenizer)


def keep_first_space(detok: Any) -> Any:
    """mlx-lm's streaming detokenizer with the first space of the text kept.

    The BPE and SentencePiece detokenizers drop a leading space of their text
    (``_maybe_trim_space``, ``trim_space``): the reply to "The cat is" would read
    "the" where llama.cpp, OpenVINO and ONNX give " the". The naive detokenizer (models
    without tokenizer.json) decodes with the tokenizer itself and is left as it is.
    """
    if hasattr(detok, "trim_space"):  # SPMStreamingDetokenizer
        detok.trim_space = False
    if hasattr(detok, "_maybe_trim_space"):  # BPEStreamingDetokenizer

        def keep(text: str) -> str:
            return text

        detok._maybe_trim_space = keep
    return detok
