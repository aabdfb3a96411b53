"""The loaded llama.cpp model as the session and its batcher both drive it: the binding,
the ``Llama``, each token's bytes, the grammar compiler, the log-probability scorer, and
what its KV cache is sized by. The session makes one at load and hands it to the batcher,
which reads nothing else of the session's."""

from __future__ import annotations

import ctypes
from typing import Any

from localrun.backends.llama_cpp.adapters import Loras
from localrun.backends.llama_cpp.replies import Replies
from localrun.backends.logprobs import Scorer
from localrun.memory import ModelShape
from localrun.structured.grammar import LazyGrammar, tokenizer_from_llama


class Engine:
    """One loaded ``llama_cpp.Llama`` (``llm``) and the llama-cpp-python module (``lc``)."""

    def __init__(self, lc: Any, llm: Any, *, shape: ModelShape | None,
                 kv_element_bytes: float, loras: Loras | None = None) -> None:
        self.lc = lc
        self.llm = llm
        self.ctx = llm._ctx.ctx  # the llama_context pointer of llm's own context
        self.vocab = llm._model.vocab
        self.n_vocab = int(llm.n_vocab())
        #: the GGUF's shape (its own key/value length: Gemma's differs from n_embd/n_head)
        self.shape = shape
        #: bytes per K or V element of its KV cache type (KV_TYPES)
        self.kv_element_bytes = kv_element_bytes
        # llama-cpp-python's token_to_piece returns its whole 32-byte buffer, NULs and
        # all; we call the C function ourselves and keep each token's bytes.
        self._piece_buf = ctypes.create_string_buffer(64)
        self._pieces: dict[int, bytes] = {}
        self.scorer = Scorer(self.piece)  # log probabilities (backends/logprobs.py)
        self.grammar = LazyGrammar("llama.cpp", self._llg_tokenizer, self.n_vocab)
        #: the LoRA adapters loaded on the model (adapters.py), None without any
        self.loras = loras
        #: recent sequences' texts with their token ids (replies.py: fast mode)
        self.replies = Replies()

    def piece(self, token: int) -> bytes:
        """The bytes of one token (special tokens render as nothing), memoized."""
        piece = self._pieces.get(token)
        if piece is None:
            buf = self._piece_buf
            n = self.lc.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, False)
            if n < 0:  # longer than the buffer: -n bytes are needed
                buf = ctypes.create_string_buffer(-n)
                n = self.lc.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, False)
            piece = buf.raw[: max(n, 0)]
            self._pieces[token] = piece
        return piece

    def is_special(self, token: int) -> bool:
        """A control token (a template's markers) or an end of generation."""
        return bool(self.lc.llama_vocab_is_control(self.vocab, token)) or self.is_eog(token)

    def remember(self, text: str | None, tokens: list[int], reply: list[int]) -> None:
        """A finished sequence: its prompt's text and tokens and its reply's tokens."""
        if text is not None and reply:
            said = b"".join(self.piece(t) for t in reply).decode("utf-8", errors="replace")
            self.replies.remember(text + said, [*tokens, *reply])

    def is_eog(self, token: int) -> bool:
        """Whether ``token`` ends a generation (EOS, EOT and the like)."""
        return bool(self.lc.llama_vocab_is_eog(self.vocab, token))

    def _llg_tokenizer(self) -> Any:
        eog = [t for t in range(self.n_vocab) if self.is_eog(t)]
        return tokenizer_from_llama(self.vocab, eog)
