"""llama.cpp's sampler chains in transformers' order: penalties, temperature, top_k,
top_p, min_p, then the seeded draw, for the single path (:func:`temperature_first`, over
``Llama.generate``) and for each of the batcher's sequences (:func:`sequence_chain`),
from the same llama.cpp samplers in the same order, so both draw the same tokens. All
samplers are llama.cpp's, in C: no cost per token."""

from __future__ import annotations

from typing import Any

from localrun.backends.llama_cpp.constraints import masking_sampler
from localrun.backends.llama_cpp.engine import Engine
from localrun.sampling import ResolvedSampling
from localrun.structured.grammar import TokenMask


def temperature_first(llm: Any, lc: Any) -> None:
    """Make ``llm`` sample as transformers does: temperature before top_k, top_p, min_p.

    ``Llama.generate`` builds its sampler chain with ``Llama._init_sampler`` on every
    call: [logits processors], penalties, top_k, typical, top_p, min_p, temp, dist, so
    top_p=0.05 at temperature 50 keeps only the most likely token. This wraps it: the
    same chain is built with a negative temperature (llama-cpp-python then adds only
    ``dist`` after the penalties), ``dist`` is taken off the end, and temp, top_k, top_p
    and min_p go in before it is put back. The logits processors (structured output)
    stay first and the seed stays the one ``dist`` was made with. Greedy (temp 0) and
    mirostat chains are left as they are.
    """
    build = llm._init_sampler

    def init_sampler(*, temp: float, top_k: int, top_p: float, min_p: float,
                     typical_p: float = 1.0, mirostat_mode: int = 0, **kwargs: Any) -> Any:
        if temp <= 0 or mirostat_mode:
            return build(temp=temp, top_k=top_k, top_p=top_p, min_p=min_p,
                         typical_p=typical_p, mirostat_mode=mirostat_mode, **kwargs)
        sampler = build(temp=-1.0, top_k=top_k, top_p=top_p, min_p=min_p,
                        typical_p=typical_p, mirostat_mode=mirostat_mode, **kwargs)
        chain = sampler.sampler
        dist = lc.llama_sampler_chain_remove(chain, lc.llama_sampler_chain_n(chain) - 1)
        sampler.add_temp(temp)
        sampler.add_top_k(top_k)
        sampler.add_typical(typical_p, 1)
        sampler.add_top_p(top_p, 1)
        sampler.add_min_p(min_p, 1)
        lc.llama_sampler_chain_add(chain, dist)
        return sampler

    llm._init_sampler = init_sampler


def sequence_chain(engine: Engine, sampling: ResolvedSampling, mask: TokenMask | None
                   ) -> Any:
    """One sequence's own chain, as :func:`temperature_first` builds the single path's
    (``Llama._init_sampler``): the same samplers, in the same order, with the same seed."""
    from llama_cpp import _internals

    lc = engine.lc
    chain: Any = getattr(_internals, "LlamaSampler")()  # noqa: B009 - untyped upstream
    if mask is not None:
        chain.add_custom(masking_sampler(lc, mask))
    chain.add_penalties(engine.n_vocab, int(engine.llm.last_n_tokens_size),
                        sampling.repetition_penalty, 0.0, 0.0)
    if sampling.temperature <= 0:
        chain.add_greedy()
        return chain
    assert sampling.seed is not None, "the driver sets the seed"
    chain.add_temp(sampling.temperature)
    chain.add_top_k(sampling.top_k)
    chain.add_typical(1.0, 1)
    chain.add_top_p(sampling.top_p, 1)
    chain.add_min_p(sampling.min_p, 1)
    # as the single path: 2**32 - 1 means "random" to llama.cpp, so it goes in as 0
    chain.add_dist(sampling.seed % lc.LLAMA_DEFAULT_SEED)
    return chain
