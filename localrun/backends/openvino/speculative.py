"""Speculative decoding on OpenVINO GenAI, its own: the pipeline is built for it at load
(``prompt_lookup=True``, or ``draft_model=openvino_genai.draft_model(folder, device)``)
and each request's ``GenerationConfig`` says how far to draft (``num_assistant_tokens``,
and for prompt lookup ``max_ngram_size``). Asked for by name (``speculative=
"prompt-lookup"``, or a draft model): "auto" leaves the pipeline as it is, since which
pipeline to build cannot wait for a request's measurements. A draft whose vocabulary is
not the target's is refused at load.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from localrun.backends.base import LoadRequest
from localrun.backends.speculative import IncompatibleDraftError
from localrun.errors import ModelFileError
from localrun.sampling import check_speculative
from localrun.types import SpeculativeMode

#: Tokens drafted per step, and the longest n-gram prompt lookup matches (OpenVINO
#: GenAI's prompt-lookup sample uses 5 and 3).
NUM_ASSISTANT_TOKENS = 5
MAX_NGRAM_SIZE = 3


def pipeline_properties(og: Any, request: LoadRequest, device: str, tokenizer_of: Any
                        ) -> tuple[SpeculativeMode | None, dict[str, Any]]:
    """The speculative mode the pipeline runs (None: none) and the properties that build
    it. ``tokenizer_of(folder)`` opens a folder's tokenizer (the draft's check)."""
    mode = check_speculative(request.speculative)
    if request.draft_model:
        folder = Path(request.draft_model).expanduser()
        if not folder.is_dir():
            raise ModelFileError(request.draft_model, "not an OpenVINO IR folder",
                                 hint="pass draft_model= an OpenVINO IR folder of the "
                                      "same family")
        check_vocab(tokenizer_of(str(folder)), tokenizer_of(request.path),
                    request.draft_model, request.path)
        return "draft", {"draft_model": og.draft_model(str(folder), device)}
    if mode == "prompt-lookup":
        return mode, {"prompt_lookup": True}
    return None, {}


def configure(cfg: Any, mode: SpeculativeMode | None) -> None:
    """One request's GenerationConfig, for the pipeline's speculative mode."""
    if mode is None:
        return
    cfg.num_assistant_tokens = NUM_ASSISTANT_TOKENS
    if mode == "prompt-lookup":
        cfg.max_ngram_size = MAX_NGRAM_SIZE


def check_vocab(draft: Any, target: Any, draft_name: str, target_name: str) -> None:
    a, b = dict(draft.get_vocab()), dict(target.get_vocab())
    if a != b:
        differ = sorted(set(a) ^ set(b))[:3] or [t for t in a if a[t] != b.get(t)][:3]
        raise IncompatibleDraftError(
            draft_name, target_name,
            f"their vocabularies differ ({len(a):,} vs {len(b):,} tokens; e.g. "
            f"{', '.join(repr(t) for t in differ)})")
    if draft.get_eos_token_id() != target.get_eos_token_id():
        raise IncompatibleDraftError(draft_name, target_name,
                                     "their end-of-sequence tokens differ")
