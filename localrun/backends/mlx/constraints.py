"""MLX's hook for a structured-output constraint: a ``logits_processors`` entry for
mlx-lm, which sees every token so far (the prompt too) with the next token's logits."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from localrun.structured.grammar import TokenMask


def mlx_processor(mask: TokenMask, n_prompt: int) -> Callable[[Any, Any], Any]:
    """A ``logits_processors`` entry for mlx-lm's ``generate_step``.

    mlx-lm passes every token so far (the prompt too) with the logits of the next one;
    the tokens past ``n_prompt`` the matcher has not seen yet are the ones sampled since
    the last call. (Asking for them waits for the previous step: a grammar makes mlx's
    look-ahead pipelining wait one step, as every constrained decoder must.)
    """
    import mlx.core as mx

    seen = n_prompt
    neg_inf = mx.array(float("-inf"))

    def process(tokens: Any, logits: Any) -> Any:
        nonlocal seen
        n = int(tokens.shape[-1])
        if n > seen:
            mask.consume_all([int(t) for t in tokens[seen:].tolist()])
            seen = n
        allowed = mask.allowed()
        width = int(logits.shape[-1])
        if allowed.shape[0] != width:
            import numpy as np

            fit = np.zeros(width, dtype=bool)
            fit[:min(width, allowed.shape[0])] = allowed[:width]
            allowed = fit
        return mx.where(mx.array(allowed), logits, neg_inf.astype(logits.dtype))

    return process
