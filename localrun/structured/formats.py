"""Tool-call formats: which one a model speaks (read from its chat template), how its
tools and tool turns are rendered, and what a forced call is constrained to.

=============  ===============================================  ==========================
format         what the model writes                            models (template marker)
=============  ===============================================  ==========================
hermes         ``<tool_call>{"name": …, "arguments": {…}}``     Qwen2.5/3, Hermes 2/3
               ``</tool_call>``, one block per call             (``<tool_call>``)
mistral        ``[TOOL_CALLS][{"name": …, "arguments": {…}}]``  Mistral 7B v0.3, Nemo,
               (or ``[TOOL_CALLS]name[ARGS]{…}``); call ids     Small (``[TOOL_CALLS]``)
               are 9 alphanumerics
llama3_json    ``{"name": …, "parameters": {…}}`` (maybe        Llama 3.1/3.2/3.3
               after ``<|python_tag|>``)                        (``"parameters": dictionary``)
pythonic       ``[get_weather(city="Oslo"), …]``                Llama 3.2 pythonic, Llama 4
                                                                (``[func_name1(``)
=============  ===============================================  ==========================

A template that does not render ``tools`` (SmolLM2, most base chat templates) gets the
**fallback**: localrun adds a system prompt (:data:`FALLBACK_PROMPT`) listing the tools
and asking for ``<tool_call>`` blocks (the hermes format), turns earlier tool calls into
such blocks in the assistant turns, and tool results into user turns of
``<tool_response>`` blocks. A template that renders tools in a format not listed here is
treated the same way (its own format could not be parsed).
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from localrun.structured.constraint import Constraint, ToolTag
from localrun.structured.functions import Tool
from localrun.structured.schema import closed_objects

FormatName = Literal["hermes", "mistral", "llama3_json", "pythonic"]


@dataclass(frozen=True)
class ToolFormat:
    name: FormatName
    native: bool  # the model's template renders the tools (else: the fallback prompt)
    open: str  # the marker a call starts with ("" when calls have none)
    begin: str  # what follows the marker before the JSON
    close: str  # the marker a call ends with
    args_key: str  # "arguments" or "parameters"
    array: bool = False  # calls come as one JSON array after the marker (Mistral)
    id_length: int | None = None  # call ids the template insists on (Mistral: 9)

    def with_native(self, native: bool) -> ToolFormat:
        from dataclasses import replace

        return replace(self, native=native)


FORMATS: dict[FormatName, ToolFormat] = {
    "hermes": ToolFormat("hermes", True, "<tool_call>", "\n", "</tool_call>", "arguments"),
    "mistral": ToolFormat("mistral", True, "[TOOL_CALLS]", "", "", "arguments", array=True,
                          id_length=9),
    "llama3_json": ToolFormat("llama3_json", True, "", "", "", "parameters"),
    "pythonic": ToolFormat("pythonic", True, "", "", "", "parameters"),
}

#: Markers in a chat template's source, most specific first, and the format they mean.
TEMPLATE_MARKERS: tuple[tuple[str, FormatName], ...] = (
    ("[TOOL_CALLS]", "mistral"),
    ("<tool_call>", "hermes"),
    ("[func_name1(", "pythonic"),
    ('"parameters": dictionary of argument name', "llama3_json"),
    ("<|python_tag|>", "llama3_json"),
)

FALLBACK = FORMATS["hermes"].with_native(False)

#: The system prompt a template without tool support gets (the tools follow, one JSON
#: object per line). Qwen2.5's own wording, which small models have often seen.
FALLBACK_PROMPT = (
    "# Tools\n\n"
    "You may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n"
    "<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\n"
    "<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n'
    "</tool_call>"
)

_TOOLS_VAR = re.compile(r"\btools\b")


def takes_tools(template: str | None) -> bool:
    """Whether a chat template renders a ``tools`` list (transformers' convention)."""
    return bool(template) and bool(_TOOLS_VAR.search(template or ""))


def detect_format(template: str | None) -> ToolFormat:
    """The tool-call format of a model, from its chat template."""
    if not takes_tools(template):
        return FALLBACK
    for marker, name in TEMPLATE_MARKERS:
        if marker in (template or ""):
            return FORMATS[name]
    return FALLBACK


# -- JSON Schemas of calls ------------------------------------------------------------------


def _rewrite_refs(node: Any, mapping: Mapping[str, str]) -> Any:
    if isinstance(node, dict):
        out = {}
        for k, v in node.items():
            if k == "$ref" and isinstance(v, str) and v in mapping:
                out[k] = mapping[v]
            else:
                out[k] = _rewrite_refs(v, mapping)
        return out
    if isinstance(node, list):
        return [_rewrite_refs(v, mapping) for v in node]
    return node


def call_schema(fmt: ToolFormat, tools: Sequence[Tool], choice: str,
                parallel: bool | None = None) -> dict[str, Any]:
    """JSON Schema of one call (an array of calls for Mistral, of one call when not
    ``parallel``) to the tools ``choice`` allows: all of them ("auto", "required") or the
    one it names."""
    chosen = [t for t in tools if choice in ("auto", "required") or t.name == choice]
    defs: dict[str, Any] = {}
    options = []
    for i, t in enumerate(chosen):
        params = closed_objects(copy.deepcopy(t.parameters))
        prefix = f"t{i}_"
        local: dict[str, Any] = {}
        for key in ("$defs", "definitions"):
            block = params.pop(key, None)
            if isinstance(block, dict):
                local.update({f"#/{key}/{n}": (n, s) for n, s in block.items()})
        mapping = {ref: f"#/$defs/{prefix}{name}" for ref, (name, _) in local.items()}
        uses_root = '"$ref": "#"' in json.dumps(params)
        if uses_root:
            mapping["#"] = f"#/$defs/{prefix}root"
        params = _rewrite_refs(params, mapping)
        for _ref, (name, sub) in local.items():
            defs[prefix + name] = _rewrite_refs(sub, mapping)
        if uses_root:
            defs[prefix + "root"] = params
        options.append({
            "type": "object",
            "properties": {"name": {"const": t.name}, fmt.args_key: params},
            "required": ["name", fmt.args_key],
            "additionalProperties": False,
        })
    schema: dict[str, Any] = options[0] if len(options) == 1 else {"anyOf": options}
    if fmt.array:
        schema = {"type": "array", "items": schema, "minItems": 1}
        if choice not in ("auto", "required") or parallel is False:
            schema["maxItems"] = 1
    if defs:
        schema = {**schema, "$defs": defs}
    return schema


def forced_prefill(fmt: ToolFormat) -> str:
    """What localrun writes at the start of the assistant turn when a call is forced
    (``tool_choice="required"`` or a named tool): the call's opening marker, so that the
    model continues in its own format and the grammar only has the JSON to enforce."""
    return fmt.open + fmt.begin if fmt.open else ""


def tool_constraint(fmt: ToolFormat, tools: Sequence[Tool], choice: str,
                    parallel: bool | None = None) -> Constraint | None:
    """The grammar for a tool-calling request, or None when nothing is constrained.

    Forced calls: the JSON after :func:`forced_prefill`; with "required" and ``parallel``
    True, more calls may follow in the model's format (OpenAI's "required" with parallel
    calls), where the format marks each call (hermes; Mistral's array takes several
    unless ``parallel`` is False). "auto": free text, each call constrained from its
    opening marker on (formats without one are not constrained: their calls are parsed as
    written); ``parallel`` False, the first call ends the reply. "none": nothing.
    """
    if choice == "none" or not tools:
        return None
    schema = call_schema(fmt, tools, choice, parallel)
    end = ("\n" + fmt.close) if fmt.close else ""
    if choice != "auto":
        label = f"a call of {choice}" if choice != "required" else "a tool call"
        several = choice == "required" and parallel is True and bool(fmt.open and end) \
            and not fmt.array
        return Constraint.json(schema, label,
                               repeat=ToolTag(fmt.open, fmt.begin, end) if several else None)
    if not fmt.open:
        return None
    return Constraint.json(schema, "a tool call",
                           ToolTag(fmt.open, fmt.begin, end, single=parallel is False))


# -- messages -------------------------------------------------------------------------------


def mistral_id(call_id: str) -> str:
    """A 9-character alphanumeric id for any call id (Mistral's templates refuse others);
    the same id always maps to the same one."""
    if len(call_id) == 9 and call_id.isalnum():
        return call_id
    digest = hashlib.sha256(call_id.encode("utf-8")).hexdigest()
    return digest[:9]


def _arguments_dict(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments


def _call_parts(call: Mapping[str, Any]) -> tuple[str, str, Any]:
    inner = call.get("function")
    fn: Mapping[str, Any] = inner if isinstance(inner, Mapping) else call
    return str(call.get("id") or ""), str(fn.get("name", "")), _arguments_dict(
        fn.get("arguments", {}))


def has_tool_turns(messages: Sequence[Mapping[str, Any]]) -> bool:
    return any(m.get("role") == "tool" or m.get("tool_calls") for m in messages)


def native_messages(messages: Sequence[Mapping[str, Any]], fmt: ToolFormat
                    ) -> list[dict[str, Any]]:
    """Messages for a template that renders tool turns itself (transformers' convention):
    call arguments as dicts, tool results with the called function's ``name``, and
    Mistral's 9-character ids."""
    names: dict[str, str] = {}
    out: list[dict[str, Any]] = []
    for m in messages:
        msg = dict(m)
        if m.get("tool_calls"):
            calls = []
            for c in m["tool_calls"]:
                cid, name, args = _call_parts(c)
                names[cid] = name
                if fmt.id_length:
                    cid = mistral_id(cid)
                calls.append({"id": cid, "type": "function",
                              "function": {"name": name, "arguments": args}})
            msg["tool_calls"] = calls
            if msg.get("content") is None:
                msg["content"] = ""
        elif m.get("role") == "tool":
            cid = str(m.get("tool_call_id") or "")
            if "name" not in msg and cid in names:
                msg["name"] = names[cid]
            if fmt.id_length and cid:
                msg["tool_call_id"] = mistral_id(cid)
        out.append(msg)
    return out


def fallback_messages(messages: Sequence[Mapping[str, Any]], tools: Sequence[Tool]
                      ) -> list[dict[str, Any]]:
    """Messages for a template without tool support: the tool list in the system turn
    (:data:`FALLBACK_PROMPT`), earlier calls as ``<tool_call>`` blocks of the assistant
    turn, and each run of tool results as one user turn of ``<tool_response>`` blocks."""
    out: list[dict[str, Any]] = []
    names: dict[str, str] = {}
    if tools:
        listing = "\n".join(json.dumps(t.to_openai(), ensure_ascii=False) for t in tools)
        prompt = FALLBACK_PROMPT.format(tools=listing)
        if messages and messages[0].get("role") == "system":
            first = str(messages[0].get("content") or "")
            out.append({"role": "system", "content": (first + "\n\n" + prompt).strip()})
            messages = messages[1:]
        else:
            out.append({"role": "system", "content": prompt})
    for m in messages:
        role = m.get("role")
        if m.get("tool_calls"):
            blocks = []
            for c in m["tool_calls"]:
                cid, name, args = _call_parts(c)
                names[cid] = name
                blocks.append("<tool_call>\n" + json.dumps(
                    {"name": name, "arguments": args}, ensure_ascii=False) + "\n</tool_call>")
            text = str(m.get("content") or "")
            out.append({"role": "assistant",
                        "content": (text + "\n" if text else "") + "\n".join(blocks)})
        elif role == "tool":
            name = m.get("name") or names.get(str(m.get("tool_call_id") or ""), "")
            block = "<tool_response>\n" + json.dumps(
                {"name": name, "content": m.get("content")}, ensure_ascii=False) + \
                "\n</tool_response>"
            if out and out[-1].get("_tool_results"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool_results": True})
        else:
            out.append({"role": str(role), "content": str(m.get("content") or "")})
    for m in out:
        m.pop("_tool_results", None)
    return out
