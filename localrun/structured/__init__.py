"""Structured output and tool calling, enforced by constrained decoding on every engine.

Nothing here imports an engine or llguidance at import time (``import localrun`` stays
light); see :mod:`localrun.structured.output` for how a request is run, and
:mod:`localrun.structured.engines` for each engine's hook.
"""

from __future__ import annotations

from localrun.structured.calls import ToolCall, ToolCallDelta
from localrun.structured.constraint import Constraint, ToolTag

__all__ = ["Constraint", "ToolCall", "ToolCallDelta", "ToolTag"]
