"""llama.cpp's hook for a structured-output constraint: llguidance's mask as the first
sampler of the chain, over the whole vocabulary in token-id order, before the penalties
and the temperature; each sampled token is fed to the matcher."""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any

from localrun.structured.grammar import TokenMask


def llama_cpp_processors(mask: TokenMask) -> Any:
    """``logits_processor=`` for ``Llama.generate``: llama-cpp-python runs it as the first
    sampler of the chain over the whole vocabulary, in token-id order."""
    import llama_cpp

    def process(_input_ids: Any, logits: Any) -> Any:
        return mask.apply(logits)

    return llama_cpp.LogitsProcessorList([process])


def masking_sampler(lc: Any, mask: TokenMask) -> Callable[[Any], None]:
    """The mask as a custom sampler for a sequence's own chain (the batcher's): what
    llama-cpp-python's ``logits_processor`` wrapper in ``Llama._init_sampler`` does with
    :func:`llama_cpp_processors`: first in the chain, it sees the whole vocabulary in
    token-id order."""
    import numpy as np

    dtype = np.dtype([("id", np.intc), ("logit", np.single), ("p", np.single)], align=True)

    def apply(cur_p: Any) -> None:
        size = cur_p.contents.size
        data = (lc.llama_token_data * size).from_address(
            ctypes.addressof(cur_p.contents.data.contents))
        rec = np.recarray(shape=(size,), dtype=dtype, buf=data)
        rec.logit[:] = mask.apply(rec.logit)

    return apply
