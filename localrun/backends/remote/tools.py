"""Tools over an OpenAI-compatible server (backend "remote", and "vllm" on top of it):
the server's own tool support, seen through localrun's structured-output layer.

That layer (``structured.output.prepare_chat``) decides from a model's chat template how
tools are rendered and how calls are read back. A remote model's template lives on the
server, which renders it with the tools and parses (or, for a forced call, constrains)
the calls itself; so a remote session names :data:`ENVELOPE_TEMPLATE` as its template.
It renders ``tools`` and names ``<tool_call>``, so the layer takes it for a native hermes
template: it hands it the conversation (call arguments as dicts) and the OpenAI tool
list, which it "renders" as one JSON object, and the session's ``encode_rendered``
reads them back into the request with :func:`read_envelope` (a forced call's pre-filled
marker follows the JSON). The tool calls the server streams back are written out as
hermes ``<tool_call>`` text by :class:`CallWriter`, which the layer's parser turns into
ToolCall/ToolCallDelta as on every other backend. Call ids are localrun's own (the
server's are not kept); the server's tool-call format and parser are its business.
"""

from __future__ import annotations

import json
from typing import Any

from localrun.errors import LocalrunError
from localrun.structured.constraint import Constraint

ENVELOPE_TEMPLATE = (
    "{#- localrun's envelope for a server (backends/remote/tools.py): the server renders "
    "the model's own template with the tools and parses the calls, which come back as "
    "<tool_call> blocks -#}"
    "{{ {'messages': messages, 'tools': tools if tools is defined else none} | tojson }}")


def read_envelope(text: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None, str]:
    """(messages, tools, what follows) of a prompt rendered with ENVELOPE_TEMPLATE."""
    try:
        value, end = json.JSONDecoder().raw_decode(text)
        messages, tools = value["messages"], value.get("tools")
    except (ValueError, TypeError, KeyError) as e:
        raise LocalrunError("The remote backend was given a chat prompt it did not render "
                            f"({e})", hint="pass messages to Model.chat/stream") from e
    return [wire_message(m) for m in messages], tools, text[end:]


def wire_message(m: dict[str, Any]) -> dict[str, Any]:
    """A message as OpenAI's API takes it: call arguments as JSON text."""
    calls = m.get("tool_calls")
    if not calls:
        return m
    out = []
    for c in calls:
        fn = dict(c.get("function") or {})
        if not isinstance(fn.get("arguments"), str):
            fn["arguments"] = json.dumps(fn.get("arguments", {}), ensure_ascii=False)
        out.append({**c, "function": fn})
    return {**m, "tool_calls": out}


def strict_tool(tool: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI tool with ``"strict": true``: the server constrains its calls'
    arguments to the tool's schema."""
    fn = tool.get("function")
    if not isinstance(fn, dict):
        return tool
    return {**tool, "function": {**fn, "strict": True}}


def tool_choice(forced: bool, constraint: Constraint | None) -> Any:
    """OpenAI's ``tool_choice`` for a request: "auto", or, for a forced call, the tool
    the constraint's call schema allows (one: that tool; several: "required")."""
    if not forced:
        return "auto"
    schema = constraint.schema_dict if constraint is not None else {}
    name = ((schema.get("properties") or {}).get("name") or {}).get("const")
    if isinstance(name, str):
        return {"type": "function", "function": {"name": name}}
    return "required"


class CallWriter:
    """The tool calls a server streams (OpenAI's ``delta.tool_calls``), written as the
    hermes text localrun's parser reads (``<tool_call>``, a newline, ``{"name": …,
    "arguments": …}``, a newline, ``</tool_call>``), argument fragments passed on as
    they come."""

    def __init__(self, primed: bool) -> None:
        self._primed = primed  # the first call's marker is already in the prompt
        self._open: int | None = None  # index of the call being written
        self._args = False  # whether it has had argument text

    def feed(self, deltas: Any) -> str:
        out: list[str] = []
        for d in deltas if isinstance(deltas, list) else ():
            if not isinstance(d, dict):
                continue
            fn = d.get("function") or {}
            index = d.get("index", 0)
            if self._open is None or (index != self._open and fn.get("name")):
                out.append(self.close())
                head = "" if self._primed else "<tool_call>\n"
                self._primed = False
                out.append(head + '{"name": ' + json.dumps(str(fn.get("name") or ""),
                                                           ensure_ascii=False)
                           + ', "arguments": ')
                self._open, self._args = index, False
            args = fn.get("arguments")
            if isinstance(args, str) and args:
                out.append(args)
                self._args = True
        return "".join(out)

    def close(self) -> str:
        """The end of the call being written ("" when none is)."""
        if self._open is None:
            return ""
        self._open = None
        return ("" if self._args else "{}") + "}\n</tool_call>"
