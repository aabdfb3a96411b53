"""Speculative decoding on vLLM, its own: ``vllm serve --speculative-config`` with its
n-gram prompt lookup (``"method": "ngram"``) or a draft model (``"model"``), decided at
load (the server is started for it). Asked for by name; "auto" leaves the server as it
is. vLLM checks the draft's vocabulary itself (the server then fails to start, and the
startup error says why). Written against vLLM's documented ``speculative_config``
keys; not run here (vLLM needs a GPU and its own environment).
"""

from __future__ import annotations

import json

from localrun.sampling import check_speculative

#: Tokens drafted per step, and the n-gram lengths prompt lookup matches (vLLM's
#: documented example values).
NUM_SPECULATIVE_TOKENS = 5
PROMPT_LOOKUP = (2, 4)


def speculative_args(speculative: str | None, draft_model: str | None) -> list[str]:
    """The ``vllm serve`` flags for the load's speculative mode (none: [])."""
    mode = check_speculative(speculative)
    config: dict[str, object]
    if draft_model:
        config = {"model": draft_model, "num_speculative_tokens": NUM_SPECULATIVE_TOKENS}
    elif mode == "prompt-lookup":
        config = {"method": "ngram", "num_speculative_tokens": NUM_SPECULATIVE_TOKENS,
                  "prompt_lookup_min": PROMPT_LOOKUP[0],
                  "prompt_lookup_max": PROMPT_LOOKUP[1]}
    else:
        return []
    return ["--speculative-config", json.dumps(config)]
