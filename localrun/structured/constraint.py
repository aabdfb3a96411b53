"""What a reply must match, in a form every engine can apply (no engine, no llguidance here).

A :class:`Constraint` travels with the resolved sampling of one request
(``ResolvedSampling.constraint``), as guided-decoding settings do in vLLM's
``SamplingParams`` and OpenVINO's ``GenerationConfig``. Each backend applies it with its
own hook: a per-token mask from llguidance where the engine exposes logits (llama.cpp,
MLX, ONNX Runtime GenAI, ExLlamaV2/V3), the engine's built-in grammar otherwise
(OpenVINO GenAI's ``StructuredOutputConfig``, XGrammar inside): each engine's hook is
in its own package (``backends/<engine>/constraints.py``, the table in
:mod:`localrun.structured`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ToolTag:
    """``tool_choice="auto"``: free text, in which each tool call starts with ``trigger``.

    After the trigger the reply must be ``begin``, one JSON value of the constraint's
    schema, then ``end``; then free text again (more calls may follow).
    """

    trigger: str  # e.g. "<tool_call>" or "[TOOL_CALLS]"
    begin: str = ""  # text between the trigger and the JSON, e.g. "\n"
    end: str = ""  # e.g. "\n</tool_call>"
    #: at most one call, which ends the reply (``parallel_tool_calls=False``)
    single: bool = False


@dataclass(frozen=True)
class Constraint:
    """The reply is one JSON value matching ``schema`` (JSON text), or, with ``tag``,
    free text whose tool calls each match ``schema`` (constrained only after the trigger).

    ``repeat`` (forced calls that may be parallel, ``tool_choice="required"``): after the
    first JSON value (its trigger is already in the prompt) more calls may follow, each
    ``end``, a newline, ``trigger`` and ``begin`` before its JSON; the last one's ``end``
    may be left out.

    ``label`` names the constraint in messages ("JSON Schema 'Person'").
    """

    schema: str
    tag: ToolTag | None = None
    label: str = "JSON"
    repeat: ToolTag | None = None

    @classmethod
    def json(cls, schema: dict[str, Any], label: str = "JSON", tag: ToolTag | None = None,
             repeat: ToolTag | None = None) -> Constraint:
        return cls(json.dumps(schema, ensure_ascii=False, sort_keys=False), tag, label,
                   repeat)

    @property
    def schema_dict(self) -> dict[str, Any]:
        value = json.loads(self.schema)
        assert isinstance(value, dict)
        return value
