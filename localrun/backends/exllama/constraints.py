"""The ExLlamas' hooks for a structured-output constraint: ExLlamaV2 masks the logits
with an ``ExLlamaV2Filter`` over llguidance's mask, fed each token by the generator;
ExLlamaV3 takes a compiled llguidance grammar in its own ``LLGuidanceFilter``
(exllamav3 >= 1.6)."""

from __future__ import annotations

import importlib
from typing import Any

from localrun.errors import ConstrainedDecodingUnavailableError
from localrun.structured.grammar import TokenMask


def exllamav2_filter(model: Any, tokenizer: Any, mask: TokenMask) -> Any:
    """An ``ExLlamaV2Filter`` over a llguidance mask, for ``ExLlamaV2DynamicJob(filters=)``.

    It masks the logits itself (``can_mask_logits``; the generator then skips its
    pass/end token sets) and computes the next mask on the generator's filter thread
    (``use_background_worker``) while the GPU runs the forward pass. Completion needs no
    end-token set: once the grammar is complete only the stop tokens remain allowed, and
    sampling one ends the job as usual.
    """
    from exllamav2.generator.filters import ExLlamaV2Filter

    class LLGuidanceV2Filter(ExLlamaV2Filter):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__(model, tokenizer)
            self.mask = mask
            self._allowed: Any = None

        def clone(self, c: Any = None) -> Any:
            raise NotImplementedError("llguidance filters are per job")

        def begin(self, prefix_str: str = "") -> None:
            self.mask.matcher.reset()
            self.mask.consumed = 0
            self._allowed = None

        def feed(self, token: Any) -> None:
            value = token.item() if hasattr(token, "item") else token
            self.mask.consume(int(value))

        def next(self) -> Any:
            # The sampler asks for token sets only where it cannot mask (CFG, several
            # positions at once): the allowed ids then, and no end set (the stop
            # tokens the grammar allows at its end end the job as usual).
            import numpy as np

            return set(np.flatnonzero(self.mask.allowed()).tolist()), set()

        def use_background_worker(self) -> bool:
            return True

        def can_mask_logits(self) -> bool:
            return True

        def prepare_logit_mask(self) -> bool:
            self._allowed = self.mask.allowed()
            return True

        def mask_logits(self, logits: Any) -> Any:
            torch: Any = importlib.import_module("torch")

            allowed = self._allowed if self._allowed is not None else self.mask.allowed()
            self._allowed = None
            width = int(logits.shape[-1])
            if allowed.shape[0] != width:
                import numpy as np

                fit = np.zeros(width, dtype=bool)
                fit[:min(width, allowed.shape[0])] = allowed[:width]
                allowed = fit
            logits[torch.from_numpy(~allowed)] = float("-inf")
            return logits

    return LLGuidanceV2Filter()


def exllamav3_filter(tokenizer: Any, grammar: str) -> Any:
    """exllamav3's own ``LLGuidanceFilter`` for a compiled llguidance grammar.

    ``eos_after_completed``: without it the filter switches itself off once the grammar
    is complete and the reply would go on unconstrained.
    """
    try:
        from exllamav3.generator.filter import LLGuidanceFilter
    except ImportError as e:
        raise ConstrainedDecodingUnavailableError(
            "ExLlamaV3", f"this exllamav3 has no LLGuidanceFilter ({e})",
            hint="pip install -U 'exllamav3>=1.6'") from e
    return LLGuidanceFilter(tokenizer, llg_grammar=grammar, eos_after_completed=True)
