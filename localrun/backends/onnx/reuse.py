"""Which of a kept Generator's rows a new prompt reuses: by default every row of the
common prefix (:func:`fast_reusable`); with ``exact``, those that let prefilling the
rest give bit for bit the rows and logits of a fresh prefill of the whole prompt
(:func:`reusable`).

ONNX Runtime's CPU kernels (MLAS) multiply the int4 weights in tiles of
:data:`ROW_TILE` prompt rows, counted from the first row of each ``append_tokens``, and
a tile of one row takes the single-row kernel, whose sums differ from a larger tile's
(docs/results/kv_reuse.md). On GPUs the kernels may tile otherwise: the rule is kept
there, bit-exactness is untested.
"""

from __future__ import annotations

from typing import Any

from localrun.backends.prefix import common_prefix

#: Prompt rows per tile of ONNX Runtime's CPU int4 matmul (MLAS ``StrideM``).
ROW_TILE = 128


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
    n = len(prompt)
    limit = min(len(cached), n - 1)
    if limit <= 0:
        return 0
    common = common_prefix(cached[:limit], prompt[:limit])
    if n % ROW_TILE == 1:
        return common - common % ROW_TILE
    if (n - common) % ROW_TILE == 1:
        return common - 1
    return common


def fast_reusable(cached: Any, prompt: Any) -> int:
    """The default mode's rows to keep: every row of the common prefix (a reply's rows
    included, computed a token at a time: a reply may then differ from a cold cache's),
    less the last prompt token, which always runs again for its logits."""
    limit = min(len(cached), len(prompt) - 1)
    return common_prefix(cached[:limit], prompt[:limit]) if limit > 0 else 0
