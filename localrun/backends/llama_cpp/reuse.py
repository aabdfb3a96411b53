"""Which cached KV cells of a llama.cpp context a new prompt keeps: by default every cell
of the common prefix (:func:`fast_prefix`); with ``exact``, only those that let its
tokens come out as ``Llama.generate`` computes them for the whole prompt
(:func:`reusable_prefix`). The rule of both the single path (the session) and the
batcher. llama.cpp's CPU kernels are not batch-invariant; :func:`reusable_prefix` says
why and what that keeps (docs/results/llama_batch.md)."""

from __future__ import annotations

#: Query rows from which llama.cpp's CPU flash attention takes its tiled kernel
#: (GGML_FA_TILE_Q in ggml-cpu/common.h); see reusable_prefix.
TILE = 64


def reusable_prefix(n_prompt: int, common: int, chunk: int, cached_prompt: int) -> int:
    """How many of a prompt's first ``common`` tokens may keep the cells a slot has for
    them, so that feeding the rest in ``chunk``-aligned pieces computes every token as
    ``Llama.generate`` does for the whole prompt (pieces of ``chunk`` tokens from 0).

    llama.cpp's CPU flash attention computes a ubatch of :data:`TILE` or more tokens of a
    stream with its tiled kernel and a shorter one row by row, which rounds differently
    (logits apart by up to 1.1 on SmolLM2), and every layer's cells carry that. So only
    the cells of the slot's own prompt count (its ``cached_prompt`` first tokens; a reply
    was computed a token at a time), only in pieces computed with the kernel this
    prompt's piece takes, a piece's tokens are recomputed in a ubatch of TILE or more if
    the piece has that many, and of two or more if it has (a lone token of a stream
    past 256 cells takes a split-KV kernel). The last prompt token is always fed (its
    logits are drawn from)."""

    def tiled(length: int, piece: int) -> bool:
        return min(chunk, length - piece * chunk) >= TILE

    keep = max(min(common, cached_prompt, n_prompt - 1), 0)
    for piece in range(-(-keep // chunk)):
        if tiled(cached_prompt, piece) != tiled(n_prompt, piece):
            keep = piece * chunk
            break
    start = keep - keep % chunk  # the piece of the whole prompt that keep falls in
    end = min(start + chunk, n_prompt)
    if end - start >= TILE and end - keep < TILE:
        keep = end - TILE
    elif end - keep == 1 < end - start:  # one token alone takes a split-KV kernel
        keep = end - 2
    return keep


def fast_prefix(n_prompt: int, common: int) -> int:
    """The default mode's cells to keep: every cell of the ``common`` prefix, the
    previous reply's included (computed a token at a time: a reply may then differ from
    a cold cache's, as llama-server's ``cache_prompt`` makes it), less the last prompt
    token, which is always fed (its logits are drawn from)."""
    return max(min(common, n_prompt - 1), 0)
