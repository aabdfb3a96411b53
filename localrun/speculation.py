"""The draft model a load names for speculative decoding, found like any model on the
target's engine. How each engine speculates (its table: ``backends/speculative.py``):

- llama.cpp: prompt lookup and a draft GGUF, through its batch API
  (:mod:`localrun.backends.llama_cpp.speculative`); "auto" by default.
- OpenVINO GenAI: its own prompt lookup (``LLMPipeline(prompt_lookup=True)``) and
  ``draft_model``; asked for by name ("auto" leaves it off: the pipeline is built for one).
- MLX: mlx-lm's ``draft_model``; vLLM: its ``speculative_config`` (n-gram or a draft
  model); ExLlamaV2: its dynamic generator's draft model. Asked for by name.

Elsewhere "auto" means off and an explicit mode is refused with the engines that have it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from localrun.backends.speculative import check_support
from localrun.types import SpeculativeMode

if TYPE_CHECKING:
    from localrun.hub import ProgressCallback


def draft_path(draft_model: str | None, backend: str, mode: SpeculativeMode | None, *,
               progress: ProgressCallback | None = None) -> str | None:
    """The draft model's path on disk for ``backend`` (a path, or a name planned and
    fetched like the target), after checking the engine drafts that way; None without."""
    from localrun.errors import LocalrunError
    from localrun.resolve import resolve

    check_support(backend, mode, draft_model is not None)
    if draft_model is None:
        if mode == "draft":
            raise LocalrunError(
                "speculative='draft' needs a draft model",
                hint="pass draft_model= a smaller model of the same family and tokenizer "
                     "(localrun plan shows the catalog's), or speculative='prompt-lookup'")
        return None
    if not isinstance(draft_model, str) or not draft_model.strip():
        raise LocalrunError(f"Invalid draft_model {draft_model!r}",
                            hint="pass a path or a model name, e.g. draft_model='qwen3:0.6b'")
    return resolve(draft_model, backend=backend, progress=progress).path
