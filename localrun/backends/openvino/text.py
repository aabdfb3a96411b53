"""Text pieces for new tokens of many sequences at once, one detokenizer call per window
length: a step yields one token for up to ``CAPACITY`` sequences, and one call per
token took a measurable share of a batch's engine thread (docs/results/kv_reuse.md).
The single path (LLMPipeline) uses it for one sequence."""

from __future__ import annotations

from collections.abc import Callable, Sequence

#: Tokens decoded together before a sequence's detokenizer window restarts.
DETOKENIZE_WINDOW = 8

#: The tokenizer's batch decode: token lists in, one text per list out.
DecodeMany = Callable[[list[list[int]]], list[str]]


class TextWindow:
    """One sequence's detokenizer state: the recent tokens decoded together.

    A token's text is what decoding the window adds to the window's previous text; a
    byte-level token that ends mid-character adds nothing until the character is whole.
    After DETOKENIZE_WINDOW tokens the window restarts from the last token (one token
    of context keeps SentencePiece's leading spaces right) once a token has added text;
    the text of that one-token window is decoded with the next token's window, in the
    same call.
    """

    __slots__ = ("text", "tokens")

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.text: str | None = ""  # None: the window restarted; decode it again


class Detokenizer:
    """Text pieces for new tokens of many sequences, one decode call per window length.

    Windows of the same length go to the tokenizer together; lengths are not mixed
    because a batch decode pads the shorter lists with the pad token, which some
    tokenizers do not skip."""

    def __init__(self, decode_many: DecodeMany) -> None:
        self._decode = decode_many

    def pieces(self, new: Sequence[tuple[TextWindow, int]]) -> list[str]:
        """The piece each (window, token) adds; one token per window per call."""
        jobs: list[list[int]] = []
        for window, token in new:
            if window.text is None:
                jobs.append(list(window.tokens))
            window.tokens.append(token)
            jobs.append(list(window.tokens))
        texts = iter(self._decode_grouped(jobs))
        out: list[str] = []
        for window, _ in new:
            if window.text is None:
                window.text = next(texts)
            full = next(texts)
            if full.endswith("\ufffd"):  # a character still incomplete
                out.append("")
                continue
            piece = full[len(window.text):]
            out.append(piece)
            window.text = full
            # Restart only after a token that added text: OpenVINO's detokenizers drop
            # the bytes of a character still incomplete (no "\ufffd" to see), and a
            # restart then would lose them for good.
            n = len(window.tokens)
            if (piece and n >= DETOKENIZE_WINDOW) or n >= 4 * DETOKENIZE_WINDOW:
                del window.tokens[:-1]
                window.text = None
        return out

    def _decode_grouped(self, jobs: list[list[int]]) -> list[str]:
        groups: dict[int, list[int]] = {}
        for i, job in enumerate(jobs):
            groups.setdefault(len(job), []).append(i)
        out = [""] * len(jobs)
        for idx in groups.values():
            for i, text in zip(idx, self._decode([jobs[i] for i in idx]), strict=True):
                out[i] = text
        return out
