"""Speculative decoding on ExLlamaV2, its own: the dynamic generator's draft model
(``ExLlamaV2DynamicGenerator(draft_model=, draft_cache=, num_draft_tokens=)``), an EXL2
folder of the same family loaded beside the target, with a cache as long as the
target's. A draft whose tokenizer is not the target's is refused at load. Written against
exllamav2's documented generator arguments; not run here (it needs a CUDA GPU).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from localrun.backends.speculative import IncompatibleDraftError
from localrun.errors import ModelFileError

#: Tokens drafted per step (exllamav2's own default).
NUM_DRAFT_TOKENS = 4


def draft_arguments(ex: Any, path: str, target_tokenizer: Any, target: str, *,
                    cache_cls: Any, cache_tokens: int) -> dict[str, Any]:
    """The generator's draft arguments for the EXL2 folder at ``path`` (loaded now)."""
    folder = Path(path).expanduser()
    if not (folder / "config.json").is_file():
        raise ModelFileError(path, "not an EXL2 model folder (no config.json)",
                             hint="pass draft_model= an EXL2 folder of the same family")
    cfg = ex.Config(str(folder))
    cfg.arch_compat_overrides(quiet=True)
    cfg.max_seq_len = cache_tokens
    tokenizer = ex.Tokenizer(cfg)
    check_vocab(tokenizer, target_tokenizer, path, target)
    model = ex.Model(cfg)
    cache = cache_cls(model, max_seq_len=cache_tokens, lazy=True)
    model.load_autosplit(cache, progress=False)
    return {"draft_model": model, "draft_cache": cache, "num_draft_tokens": NUM_DRAFT_TOKENS}


def check_vocab(draft: Any, target: Any, draft_name: str, target_name: str) -> None:
    a, b = draft.get_piece_to_id_dict(), target.get_piece_to_id_dict()
    if a != b:
        raise IncompatibleDraftError(draft_name, target_name,
                                     f"their vocabularies differ ({len(a):,} vs "
                                     f"{len(b):,} tokens)")
    if draft.eos_token_id != target.eos_token_id:
        raise IncompatibleDraftError(draft_name, target_name,
                                     "their end-of-sequence tokens differ")
