"""Structured output and tool calling, enforced by constrained decoding on every engine.

Nothing here imports an engine or llguidance at import time (``import localrun`` stays
light); see :mod:`localrun.structured.output` for how a request is run. Each engine
applies a constraint with its own documented hook, in its own package:

==================  ==========================================================  ==========
engine              hook                                                        grammar
==================  ==========================================================  ==========
llama.cpp           the mask as the first sampler of the chain, before the      llguidance
                    penalties and temperature (``llama_cpp/constraints.py``)
MLX                 a ``logits_processors`` entry that sees every token so far  llguidance
                    (``mlx/constraints.py``)
ONNX Runtime GenAI  ``get_logits``/``set_logits`` before each token (its        llguidance
                    session), the same llguidance as llama.cpp and MLX
ExLlamaV2 / V3      an ``ExLlamaV2Filter`` that masks the logits; the engine's  llguidance
                    own ``LLGuidanceFilter`` (``exllama/constraints.py``)
OpenVINO GenAI      ``GenerationConfig.structured_output_config``: no logits    XGrammar
                    hook in ``LLMPipeline`` (``openvino/constraints.py``)
==================  ==========================================================  ==========
"""

from __future__ import annotations

from localrun.structured.calls import ToolCall, ToolCallDelta
from localrun.structured.constraint import Constraint, ToolTag

__all__ = ["Constraint", "ToolCall", "ToolCallDelta", "ToolTag"]
