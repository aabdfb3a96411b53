"""The loaded OpenVINO GenAI pipeline as the session and its batcher both drive it: the
module, the pipeline, every end-of-sequence id, the tokenizer's batch decode, and the
``GenerationConfig`` a request's sampling becomes. The session makes one at load and
hands it to the batcher, which reads nothing else of the session's.

How localrun's sampling options map onto ``GenerationConfig`` (:meth:`Engine.config`):

=====================  =========================================================
localrun               OpenVINO GenAI
=====================  =========================================================
temperature 0          ``do_sample=False`` (greedy; sampling fields are ignored)
temperature > 0        ``do_sample=True``, ``temperature``
top_p (1 = off)        ``top_p``
top_k (0 = off)        ``top_k``; 0 maps to the engine's "off" (the max size_t)
min_p (0 = off)        ``min_p``
repetition_penalty     ``repetition_penalty`` (applies to greedy decoding too); gap:
                       the engine's window (not configurable), where llama.cpp and
                       MLX look back over the last 64 tokens
seed                   ``rng_seed``, always set (the driver draws one when the caller
                       gives none: the engine's default is a fixed 0, which would
                       repeat the same "random" reply)
max_tokens             ``max_new_tokens`` (its default is unlimited: always set; the
                       driver keeps it within the context)
stop strings           handled by localrun's API layer (``stop_strings`` left empty)
EOS                    ``stop_token_ids`` = every id in generation_config.json plus
                       the tokenizer's EOS
=====================  =========================================================
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from localrun.backends.openvino.constraints import openvino_structured_config
from localrun.backends.openvino.speculative import configure
from localrun.backends.openvino.text import DecodeMany
from localrun.sampling import ResolvedSampling
from localrun.types import SpeculativeMode

#: Tokens the scheduler may process in one step (prefill chunks + one per decoding
#: sequence). The engine default (256) splits the prefill of a batch of short chat
#: prompts over many steps; 1024 keeps a 16-prompt batch's prefill to a step or two.
MAX_BATCHED_TOKENS = 1024
#: Tokens per KV block: the engine's own choice per device (kv_cache_manager.hpp).
KV_BLOCK_TOKENS = {"CPU": 32, "GPU": 16}
SIZE_MAX = 2**64 - 1  # GenerationConfig's "no limit" for top_k, and its "no id"


def kv_blocks(context: int, device: str) -> int:
    """KV blocks for ``context`` tokens: the cache memory planning counts (one full
    context). Sequences in flight share it (the scheduler admits what fits and
    preempts when decoding outgrows it); what they leave holds earlier prompts'
    prefixes until new tokens need the room, least recently used first. The engine's
    own default instead grows the cache only as far as the sequences in flight need,
    so the next prompt overwrote the last one's blocks and the KV of an alternated
    system prompt was gone by its next turn."""
    block = KV_BLOCK_TOKENS["GPU" if device.startswith("GPU") else "CPU"]
    return -(-context // block) + 1


def open_pipeline(path: str, device: str, properties: dict[str, Any], *, context: int,
                  prefix_caching: bool = True) -> Any:
    """A ContinuousBatchingPipeline over a model folder (or GGUF file)."""
    import openvino_genai as og

    scheduler = og.SchedulerConfig()
    scheduler.max_num_batched_tokens = MAX_BATCHED_TOKENS
    scheduler.dynamic_split_fuse = True
    scheduler.enable_prefix_caching = prefix_caching
    scheduler.num_kv_blocks = kv_blocks(context, device)
    return og.ContinuousBatchingPipeline(path, scheduler, device, properties)


@dataclass(frozen=True)
class Engine:
    """One loaded pipeline (``pipe``) and the openvino_genai module (``og``)."""

    og: Any
    pipe: Any
    eos: frozenset[int]  # every end-of-sequence id
    decode_many: DecodeMany  # the tokenizer's batch decode
    #: the pipeline's own speculative decoding (.speculative), None: none
    speculative: SpeculativeMode | None = None

    def config(self, sampling: ResolvedSampling) -> Any:
        """The ``GenerationConfig`` of one sequence (the module docstring's table)."""
        cfg = self.og.GenerationConfig()
        cfg.max_new_tokens = sampling.max_tokens
        cfg.min_new_tokens = 0
        cfg.ignore_eos = False
        cfg.stop_token_ids = set(self.eos)
        cfg.num_beams = 1
        cfg.num_return_sequences = 1
        cfg.repetition_penalty = sampling.repetition_penalty
        cfg.presence_penalty = 0.0
        cfg.frequency_penalty = 0.0
        cfg.do_sample = not sampling.greedy
        if not sampling.greedy:
            cfg.temperature = sampling.temperature
            cfg.top_p = sampling.top_p
            cfg.top_k = sampling.top_k or SIZE_MAX
            cfg.min_p = sampling.min_p
            cfg.rng_seed = sampling.seed
        if sampling.constraint is not None:
            so = openvino_structured_config(self.og, sampling.constraint)
            if so is not None:
                cfg.structured_output_config = so
        configure(cfg, self.speculative)
        return cfg
