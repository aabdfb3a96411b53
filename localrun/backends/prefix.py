"""How many leading tokens two token lists share: where KV reuse starts on every engine
that keeps cells between calls (llama.cpp's slots, MLX's prompt caches, ONNX Runtime
GenAI's kept Generator)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

#: Tokens compared at once (C-speed slices), before the first differing slice is walked.
_CHUNK = 256


def common_prefix(a: Sequence[int] | Any, b: Sequence[int] | Any) -> int:
    """Length of the longest common prefix of two token lists (lists, tuples or numpy
    integer arrays: arrays are compared in one vectorized pass)."""
    n = min(len(a), len(b))
    if hasattr(a, "dtype") or hasattr(b, "dtype"):
        import numpy as np

        differ = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
        return int(differ[0]) if differ.shape[0] else n
    i = 0
    while i < n:  # whole chunks compared as slices, then a differing one token by token
        j = min(i + _CHUNK, n)
        if a[i:j] != b[i:j]:  # (a tuple's slice never equals a list's: walk it then)
            while i < j and a[i] == b[i]:
                i += 1
            if i < j:
                return i
        i = j
    return n
