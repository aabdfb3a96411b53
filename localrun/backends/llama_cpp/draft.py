"""A draft model for llama.cpp speculative decoding: a second, smaller GGUF that shares
the target's vocabulary, in a context of its own, drafting greedily a token at a time
(``llama-speculative``'s draft side). Its cells follow the sequence: each round keeps
what it computed for tokens the target kept and feeds only the rest.

A draft whose vocabulary differs (size, any token's text, BOS/EOS) is refused at load
with the reason, as llama.cpp's ``common_speculative_are_compatible`` refuses it: its
token ids would mean other text to the target.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from localrun.backends.llama_cpp.engine import Engine
from localrun.backends.prefix import common_prefix
from localrun.backends.speculative import IncompatibleDraftError
from localrun.errors import LocalrunError, ModelFileError


class DraftModel:
    """A loaded draft GGUF (its own ``Llama``), checked against the target's vocabulary."""

    def __init__(self, lc: Any, path: str, target: Engine, *, n_ctx: int,
                 opts: dict[str, Any]) -> None:
        import numpy as np

        self._np = np
        try:
            llm = lc.Llama(model_path=path, n_ctx=n_ctx, **opts)
        except (ValueError, RuntimeError) as e:
            raise ModelFileError(path, f"llama.cpp could not load the draft model ({e})") from e
        self.llm = llm
        self.path = path
        self.lc = lc
        self.engine = Engine(lc, llm, shape=None, kv_element_bytes=2.0)
        try:
            check_vocab(self.engine, target, path, str(target.llm.model_path))
        except LocalrunError:
            llm.close()
            raise
        self.n_vocab = self.engine.n_vocab

    def prefill(self, tokens: Sequence[int]) -> None:
        """Give the draft's context cells for ``tokens`` (what it kept of them, and the
        rest fed now), so that the first round drafts at once."""
        llm = self.llm
        held = int(llm.n_tokens)
        keep = min(common_prefix(llm.input_ids[:held].tolist(), tokens), len(tokens) - 1)
        llm.n_tokens = keep
        llm.eval(list(tokens[keep:]))

    def propose(self, tokens: Sequence[int], n: int) -> list[int]:
        """Up to ``n`` tokens the draft model would write after ``tokens`` (greedy)."""
        llm, np = self.llm, self._np
        held = int(llm.n_tokens)
        keep = min(common_prefix(llm.input_ids[:held].tolist(), tokens), len(tokens) - 1)
        n = min(n, int(llm.n_ctx()) - len(tokens))
        if n <= 0:
            return []
        llm.n_tokens = keep
        llm.eval(list(tokens[keep:]))  # the tokens the target kept since, and its own
        out: list[int] = []
        ctx, lc = self.engine.ctx, self.lc
        while True:
            logits = np.ctypeslib.as_array(lc.llama_get_logits_ith(ctx, -1),
                                           shape=(self.n_vocab,))
            token = int(logits.argmax())
            out.append(token)
            if len(out) >= n or self.engine.is_eog(token):
                return out
            llm.eval([token])

    def close(self) -> None:
        self.llm.close()


#: Tokens two vocabularies may differ by at their end (padding to a multiple of the
#: embedding's width: Qwen2.5 7B has 152,064, 0.5B 151,936): llama.cpp's limit.
VOCAB_SLACK = 128


def check_vocab(draft: Engine, target: Engine, draft_name: str, target_name: str) -> None:
    """Raise IncompatibleDraftError unless both models speak the same tokens: sizes within
    :data:`VOCAB_SLACK`, the same BOS and EOS, and every shared id the same bytes
    (llama.cpp's ``common_speculative_are_compatible``)."""
    def refuse(reason: str) -> IncompatibleDraftError:
        return IncompatibleDraftError(draft_name, target_name, reason)

    if abs(draft.n_vocab - target.n_vocab) > VOCAB_SLACK:
        raise refuse(f"its vocabulary has {draft.n_vocab:,} tokens, the target's "
                     f"{target.n_vocab:,}")
    for what in ("token_bos", "token_eos"):
        a, b = int(getattr(draft.llm, what)()), int(getattr(target.llm, what)())
        if a != b:
            raise refuse(f"its {what[6:].upper()} token is {a}, the target's {b}")
    for token in range(min(target.n_vocab, draft.n_vocab)):
        if draft.piece(token) != target.piece(token):
            raise refuse(f"token {token} is {draft.piece(token)!r} to it, "
                         f"{target.piece(token)!r} to the target")
