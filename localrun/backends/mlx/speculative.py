"""Speculative decoding on MLX: mlx-lm's own ``speculative_generate_step`` with a draft
model (``load(draft_model=...)``, an MLX folder with the target's tokenizer), which drafts
``num_draft_tokens`` a round and verifies them in one forward pass of the target.

It runs only when asked (``speculative="draft"``, or a draft model with "auto"), greedy
or sampled, without constraints or log probabilities; its cache is its own (target and
draft layers together), so a speculative call does not reuse another call's prefix.
Greedy replies are the target's own where the verify pass's logits round as a one-token
step's do; sampled ones follow mlx-lm's path, which draws the draft with the same sampler.
"""

from __future__ import annotations

from collections.abc import Generator
from pathlib import Path
from typing import Any

from localrun.backends.speculative import IncompatibleDraftError
from localrun.errors import ModelFileError

#: Tokens the draft proposes per round (mlx-lm's default is 2; a same-family draft a
#: tenth of the target's size keeps most of 3).
NUM_DRAFT = 3


def load_draft(worker: Any, path: str, target_tokenizer: Any, target: str) -> Any:
    """The draft model (on the mlx thread), refused unless its vocabulary is the target's."""
    import mlx_lm

    folder = Path(path).expanduser()
    if not (folder / "config.json").is_file():
        raise ModelFileError(path, "not an MLX model folder (no config.json)",
                             hint="pass draft_model= an MLX folder of the same family")
    try:
        loaded: Any = worker.call(lambda: mlx_lm.load(str(folder)))
    except Exception as e:
        raise ModelFileError(path, f"mlx-lm could not load the draft model "
                             f"({type(e).__name__}: {str(e).strip()[:300]})") from e
    model, tok = loaded[0], loaded[1]
    check_vocab(tok, target_tokenizer, path, target)
    return model


def check_vocab(draft: Any, target: Any, draft_name: str, target_name: str) -> None:
    """Both tokenizers must map the same text to the same ids (and share EOS)."""
    a, b = draft.get_vocab(), target.get_vocab()
    if a != b:
        only = sorted(set(a) ^ set(b))[:3]
        differ = only or [t for t in a if a[t] != b.get(t)][:3]
        raise IncompatibleDraftError(
            draft_name, target_name,
            f"their vocabularies differ ({len(a):,} vs {len(b):,} tokens; e.g. "
            f"{', '.join(repr(t) for t in differ)})")
    if set(draft.eos_token_ids) != set(target.eos_token_ids):
        raise IncompatibleDraftError(draft_name, target_name,
                                     "their end-of-sequence tokens differ")


def speculative_steps(model: Any, draft: Any, prompt: Any, *, max_tokens: int,
                      sampler: Any, processors: Any, counts: list[int]
                      ) -> Generator[tuple[Any, Any], None, None]:
    """``generate_step``'s (token, logprobs) pairs through mlx-lm's speculative path;
    ``counts`` becomes [drafted, accepted] as it goes."""
    from mlx_lm.generate import speculative_generate_step

    steps = speculative_generate_step(
        prompt, model, draft, num_draft_tokens=NUM_DRAFT, max_tokens=max_tokens,
        sampler=sampler, logits_processors=processors or None)
    pending = 0  # tokens of the round so far that came from the draft
    try:
        for token, logprobs, from_draft in steps:
            if from_draft:
                pending += 1
            else:  # the target's own token ends a round of NUM_DRAFT drafts
                counts[0] += NUM_DRAFT
                counts[1] += pending
                pending = 0
            yield token, logprobs
    finally:
        steps.close()
