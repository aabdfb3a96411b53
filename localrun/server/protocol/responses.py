"""OpenAI's Responses API: ``POST /v1/responses`` — the request (checked, then translated
into a :class:`~.common.Generation`) and the items it carries. The answer, its stream
and the stored objects are in :mod:`.responses_out`.

Supported: ``input`` as a string or a list of items — messages (``input_text`` /
``output_text`` parts, ``input_image`` ones with a data: URI; roles user, assistant,
system, developer), ``function_call`` and
``function_call_output``, Codex's ``custom_tool_call`` and ``custom_tool_call_output``,
and ``reasoning`` items sent back (accepted, left out of the prompt) — ``instructions``,
``previous_response_id``, ``store``, function ``tools`` (the flat shape) and ``custom``
tools, ``tool_choice``, ``parallel_tool_calls``, ``text.format`` (text, json_object,
json_schema), ``max_output_tokens``, ``temperature``/``top_p`` (and localrun's
``top_k``/``min_p``/``repetition_penalty``/``seed``), ``stream``.

A custom (freeform) tool is a function with one string argument, ``input``: its calls
come back as ``custom_tool_call`` items whose ``input`` is that string, and a
``custom_tool_call`` sent back is that function call again. A ``regex`` grammar is
enforced (the string's JSON Schema ``pattern``); a ``lark`` grammar is not (the string is
free; the tool checks its own input, as Codex's apply_patch does).

``reasoning.effort`` bounds a thinking model's thinking (a model that does not think
ignores it); the thinking itself is not returned (no reasoning items; its tokens are
``usage.output_tokens_details.reasoning_tokens``).

Accepted with no effect: ``include``, ``reasoning.summary``, ``truncation``,
``text.verbosity``, ``user``, ``metadata`` (echoed back), ``prompt_cache_key``,
``prompt_cache_retention``, ``safety_identifier``, ``client_metadata``,
``stream_options``, ``service_tier`` auto or default. Refused with a 400 that says why:
built-in tools (web search, file search, computer use, code interpreter, image
generation, MCP, shells), files, ``background``, ``conversation``,
``prompt``, ``max_tool_calls``, ``allowed_tools``, log probabilities, item references.

``parallel_tool_calls`` goes to the library as given: false, one call at most; true, a
required call may be several; left out, the library's default (a required call is one,
"auto" may make several) — the response says true, OpenAI's default.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Annotated, Any, ClassVar, Literal

from pydantic import ConfigDict, Discriminator, Field, Tag

from localrun.server.errors import bad_request
from localrun.server.protocol.common import (
    Generation,
    Int,
    Shape,
    invalid,
    never,
    refused,
    takes_only,
)
from localrun.server.protocol.images import InputImage

#: the library's names → the Responses API's (errors name the field the client sent)
NAMES = {"max_tokens": "max_output_tokens", "response_format": "text.format",
         "messages": "input"}
#: a custom tool's one argument
CUSTOM_ARG = "input"
SUPPORTED_TOOLS = ("function tools ({\"type\": \"function\", \"name\", \"parameters\"}) "
                   "and custom tools ({\"type\": \"custom\", \"name\"})")
BUILT_IN = {
    "web_search": "web search", "web_search_preview": "web search",
    "web_search_2025_08_26": "web search", "web_search_preview_2025_03_11": "web search",
    "file_search": "file search", "computer_use_preview": "computer use",
    "computer_use": "computer use", "computer": "computer use",
    "code_interpreter": "a code interpreter", "image_generation": "image generation",
    "mcp": "MCP servers", "local_shell": "a shell", "shell": "a shell",
    "apply_patch": "the built-in apply_patch"}
ITEM_TYPES = ("message, function_call, function_call_output, custom_tool_call, "
              "custom_tool_call_output and reasoning")
PART_REASONS = {
    "input_file": "files are not supported yet: send their text in an input_text part",
    "input_audio": "audio is not supported yet: localrun's engines take text"}
LOGPROBS_LATER = "log probabilities are not available in the Responses API yet"


def _tag(value: Any) -> Any:
    return value.get("type") if isinstance(value, dict) else getattr(value, "type", None)


# -- content parts ---------------------------------------------------------------------------

class TextPart(Shape):
    """Text in a message: ``input_text`` (user, system, developer turns) or
    ``output_text`` (an assistant turn sent back; ``refusal`` parts read as its text)."""

    type: Literal["input_text", "output_text", "text"]
    text: str

    IGNORED: ClassVar = ("annotations", "logprobs")


class RefusalPart(Shape):
    type: Literal["refusal"]
    refusal: str

    @property
    def text(self) -> str:
        return self.refusal


class OtherPart(Shape):
    """A content part of a type localrun does not take (files, audio)."""

    model_config = ConfigDict(json_schema_extra=never)
    type: str

    def refuse(self) -> None:
        raise refused("", PART_REASONS.get(self.type, f"content parts of type {self.type!r} "
                                           "(localrun takes input_text, output_text and "
                                           "input_image)"))


def _part_tag(value: Any) -> str:
    kind = _tag(value)
    if kind in ("input_text", "output_text", "text"):
        return "text"
    return kind if kind in ("refusal", "input_image") else "other"


ContentPart = Annotated[
    Annotated[TextPart, Tag("text")] | Annotated[RefusalPart, Tag("refusal")]
    | Annotated[InputImage, Tag("input_image")]
    | Annotated[OtherPart, Tag("other")], Discriminator(_part_tag)]


def _text(content: str | list[Any]) -> str:
    if isinstance(content, str):
        return content
    if any(isinstance(p, InputImage) for p in content):
        raise refused("", "images in a tool call's output (send them in a user message)")
    return "".join(p.text for p in content)


# -- input items -----------------------------------------------------------------------------

class MessageItem(Shape):
    """A message: a user, system or developer turn, or an assistant turn sent back."""

    type: Literal["message"] | None = None
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ContentPart]
    id: str | None = None
    status: str | None = None

    IGNORED: ClassVar = ("phase",)

    def to_library(self) -> dict[str, Any]:
        role = "system" if self.role == "developer" else self.role
        if isinstance(self.content, list) and any(isinstance(p, InputImage)
                                                  for p in self.content):
            return {"role": role, "content": [
                p.to_library() if isinstance(p, InputImage) else {"type": "text",
                                                                  "text": p.text}
                for p in self.content if isinstance(p, (InputImage, TextPart, RefusalPart))]}
        return {"role": role, "content": _text(self.content)}


class FunctionCallItem(Shape):
    """A function call the model made, sent back."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None

    IGNORED: ClassVar = ("namespace", "caller", "async")

    def call(self) -> dict[str, Any]:
        return {"id": self.call_id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


class CustomToolCallItem(Shape):
    """A custom tool's call the model made, sent back: its function call again."""

    type: Literal["custom_tool_call"]
    call_id: str
    name: str
    input: str
    id: str | None = None
    status: str | None = None

    IGNORED: ClassVar = ("namespace", "caller", "async")

    def call(self) -> dict[str, Any]:
        args = json.dumps({CUSTOM_ARG: self.input}, ensure_ascii=False)
        return {"id": self.call_id, "type": "function",
                "function": {"name": self.name, "arguments": args}}


class CallOutputItem(Shape):
    """What a function (or custom tool) call returned."""

    type: Literal["function_call_output", "custom_tool_call_output"]
    call_id: str
    output: str | list[ContentPart]
    id: str | None = None
    status: str | None = None

    IGNORED: ClassVar = ("caller",)

    def to_library(self) -> dict[str, Any]:
        return {"role": "tool", "tool_call_id": self.call_id, "content": _text(self.output)}


class ReasoningItem(Shape):
    """A reasoning item sent back (Codex, the Agents SDK): accepted and left out of the
    prompt (the model's thinking is its own, and its encrypted content is OpenAI's)."""

    type: Literal["reasoning"]
    id: str | None = None

    IGNORED: ClassVar = ("summary", "content", "encrypted_content", "status")


class OtherItem(Shape):
    """An item of a type localrun does not take."""

    model_config = ConfigDict(json_schema_extra=never)
    type: str

    def refuse(self) -> None:
        if self.type == "item_reference":
            raise refused("", "item references are not supported yet: send the item itself "
                          "(or continue with previous_response_id)")
        raise refused("", f"input items of type {self.type!r} (localrun takes {ITEM_TYPES} "
                      "items)")


def _item_tag(value: Any) -> str:
    kind = _tag(value)
    if kind is None and isinstance(value, dict) and "role" in value:
        return "message"
    if kind in ("function_call_output", "custom_tool_call_output"):
        return "output"
    return kind if kind in ("message", "function_call", "custom_tool_call", "reasoning") \
        else "other"


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[CustomToolCallItem, Tag("custom_tool_call")]
    | Annotated[CallOutputItem, Tag("output")] | Annotated[ReasoningItem, Tag("reasoning")]
    | Annotated[OtherItem, Tag("other")], Discriminator(_item_tag)]


def to_messages(items: list[Any]) -> list[dict[str, Any]]:
    """Input items as the library's messages: function calls join the assistant turn
    before them (or make one), their outputs are tool turns, reasoning items drop out."""
    out: list[dict[str, Any]] = []
    for item in items:
        if isinstance(item, MessageItem):
            out.append(item.to_library())
        elif isinstance(item, (FunctionCallItem, CustomToolCallItem)):
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(item.call())
                last["content"] = last["content"] or None
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [item.call()]})
        elif isinstance(item, CallOutputItem):
            out.append(item.to_library())
    return out


def stored_item(item: Any) -> dict[str, Any]:
    """An input item as ``input_items`` lists it: a message's text as parts, a status."""
    data: dict[str, Any] = item.model_dump(exclude_none=True, by_alias=True)
    if isinstance(item, MessageItem):
        data["type"] = "message"
        if isinstance(item.content, str):
            kind = "output_text" if item.role == "assistant" else "input_text"
            data["content"] = [{"type": kind, "text": item.content}]
    if not isinstance(item, ReasoningItem):
        data.setdefault("status", "completed")
    return data


# -- tools ---------------------------------------------------------------------------------

class FunctionTool(Shape):
    """A function tool, in the Responses API's flat shape."""

    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    IGNORED: ClassVar = ("defer_loading", "allowed_callers", "output_schema", "async")

    def to_library(self) -> dict[str, Any]:
        fn: dict[str, Any] = {"name": self.name, "parameters": self.parameters or {
            "type": "object", "properties": {}}}
        if self.description:
            fn["description"] = self.description
        if self.strict is not None:
            fn["strict"] = self.strict
        return {"type": "function", "function": fn}


class CustomFormat(Shape):
    type: Literal["text", "grammar"]
    syntax: Literal["lark", "regex"] | None = None
    definition: str | None = None

    def refuse(self) -> None:
        super().refuse()
        if self.type == "grammar" and (self.syntax is None or self.definition is None):
            raise invalid("a grammar format needs 'syntax' (lark or regex) and 'definition'",
                          "syntax" if self.syntax is None else "definition")


class CustomTool(Shape):
    """A custom (freeform) tool, as Codex sends apply_patch: a function whose one string
    argument is ``input`` (a regex grammar enforced as its pattern; lark not enforced)."""

    type: Literal["custom"]
    name: str
    description: str | None = None
    format: CustomFormat | None = None

    IGNORED: ClassVar = ("defer_loading", "allowed_callers", "async")

    def to_library(self) -> dict[str, Any]:
        arg: dict[str, Any] = {"type": "string"}
        fmt = self.format
        if fmt is not None and fmt.type == "grammar" and fmt.syntax == "regex":
            arg["pattern"] = f"^(?:{fmt.definition})$"  # the whole input, as OpenAI's
        fn: dict[str, Any] = {"name": self.name, "parameters": {
            "type": "object", "properties": {CUSTOM_ARG: arg}, "required": [CUSTOM_ARG],
            "additionalProperties": False}}
        if self.description:
            fn["description"] = self.description
        return {"type": "function", "function": fn}


class BuiltInTool(Shape):
    """A built-in (hosted) tool, or any other type: refused, naming what is supported."""

    model_config = ConfigDict(json_schema_extra=never)
    type: str

    def refuse(self) -> None:
        what = BUILT_IN.get(self.type)
        head = (f"the built-in tool {self.type!r} ({what}) is not run by localrun" if what
                else f"tools of type {self.type!r} are not supported")
        raise refused("", f"{head}: localrun takes {SUPPORTED_TOOLS}")


def _tool_tag(value: Any) -> str:
    kind = _tag(value)
    return kind if kind in ("function", "custom") else "other"


ToolParam = Annotated[
    Annotated[FunctionTool, Tag("function")] | Annotated[CustomTool, Tag("custom")]
    | Annotated[BuiltInTool, Tag("other")], Discriminator(_tool_tag)]


class ToolChoiceParam(Shape):
    """``{"type": "function" | "custom", "name": ...}``: that tool must be called."""

    type: str
    name: str | None = None
    mode: str | None = None
    tools: list[Any] | None = None

    def refuse(self) -> None:
        if self.type == "allowed_tools":
            raise refused("", "allowed_tools is not supported yet: send only the tools the "
                          "model may call")
        if self.type not in ("function", "custom"):
            raise refused("type", f"{self.type!r} names a tool localrun does not run "
                          "(send 'auto', 'none', 'required' or {\"type\": \"function\", "
                          "\"name\": ...})")
        super().refuse()
        if not self.name:
            raise invalid(f"a tool_choice of type {self.type!r} needs the tool's 'name'",
                          "name")


# -- text.format, reasoning ------------------------------------------------------------------

class TextFormat(Shape):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None

    def refuse(self) -> None:
        super().refuse()
        if self.type == "json_schema" and self.schema_ is None:
            raise invalid("a json_schema format needs 'schema' (a JSON Schema)", "schema")

    def to_library(self) -> dict[str, Any] | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return {"type": "json_object"}
        spec: dict[str, Any] = {"name": self.name or "output", "schema": self.schema_}
        if self.strict is not None:
            spec["strict"] = self.strict
        return {"type": "json_schema", "json_schema": spec}


class TextConfig(Shape):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


#: OpenAI's reasoning efforts → the library's (``xhigh`` is its most: "high", no budget)
EFFORTS = {"none": "none", "minimal": "minimal", "low": "low", "medium": "medium",
           "high": "high", "xhigh": "high"}


class ReasoningParam(Shape):
    """``effort`` bounds a thinking model's thinking (the library's ``reasoning_effort``);
    a model that does not think ignores it, as OpenAI's non-reasoning models do.
    ``summary`` changes nothing: the thinking is not returned as a reasoning item."""

    effort: str | None = Field(default=None, json_schema_extra=takes_only(
        {"anyOf": [{"enum": list(EFFORTS)}, {"type": "null"}]}))
    summary: str | None = None
    generate_summary: str | None = None

    def refuse(self) -> None:
        super().refuse()
        if self.effort is not None and self.effort not in EFFORTS:
            raise invalid(f"{self.effort!r} is not an effort: send one of "
                          f"{', '.join(EFFORTS)}", "effort")


class StreamOptions(Shape):
    include_obfuscation: bool | None = None


# -- the request -----------------------------------------------------------------------------

class ResponsesRequest(Shape):
    """``POST /v1/responses``."""

    model: str
    input: str | list[InputItem] | None = None
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    tools: list[ToolParam] | None = None
    tool_choice: Literal["auto", "none", "required"] | ToolChoiceParam | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    max_output_tokens: Int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    seed: Int | None = None
    reasoning: ReasoningParam | None = None
    include: list[str] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    user: str | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = Field(default=None, json_schema_extra=takes_only(
        {"anyOf": [{"enum": ["auto", "default"]}, {"type": "null"}]}))
    background: bool | None = None
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    max_tool_calls: Int | None = None
    top_logprobs: Int | None = None

    #: bookkeeping for OpenAI's own caches and abuse checks: accepted, no effect
    IGNORED: ClassVar = ("prompt_cache_key", "prompt_cache_retention", "prompt_cache_options",
                         "safety_identifier", "client_metadata")
    REFUSED: ClassVar = {
        "background": (False, "background responses are not supported: send the request "
                       "and wait (or stream it)"),
        "conversation": (None, "the Conversations API is not implemented: continue with "
                         "previous_response_id"),
        "prompt": (None, "reusable prompts are not implemented: send instructions and input"),
        "max_tool_calls": (None, "not enforced (parallel_tool_calls: false allows one call "
                           "per response)"),
        "top_logprobs": (0, LOGPROBS_LATER)}

    def refuse(self) -> None:
        super().refuse()
        if self.service_tier not in (None, "auto", "default"):
            raise refused("service_tier", "localrun has one tier: send auto or default")
        if "message.output_text.logprobs" in (self.include or ()):
            raise refused("include", LOGPROBS_LATER)
        if self.stream_options is not None and not self.stream:
            raise invalid("'stream_options' is only allowed when 'stream' is true",
                          "stream_options")

    @property
    def custom_tools(self) -> frozenset[str]:
        """The names of the custom tools (their calls are custom_tool_call items)."""
        return frozenset(t.name for t in self.tools or () if isinstance(t, CustomTool))

    def items(self) -> list[Any]:
        """The input as items (a string is one user message)."""
        if isinstance(self.input, str):
            return [MessageItem(type="message", role="user", content=self.input)]
        return list(self.input or [])

    def sampling(self) -> dict[str, Any]:
        out = {"max_tokens": self.max_output_tokens, "temperature": self.temperature,
               "top_p": self.top_p, "top_k": self.top_k, "min_p": self.min_p,
               "repetition_penalty": self.repetition_penalty, "seed": self.seed}
        return {k: v for k, v in out.items() if v is not None}

    def structured(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        fmt = self.text.format if self.text is not None else None
        if fmt is not None and fmt.to_library() is not None:
            out["response_format"] = fmt.to_library()
        tools = [t.to_library() for t in self.tools or ()
                 if isinstance(t, (FunctionTool, CustomTool))]  # others are refused
        if tools:
            out["tools"] = tools
            if self.parallel_tool_calls is not None:  # else the library's default
                out["parallel_tool_calls"] = self.parallel_tool_calls
        choice = self.tool_choice
        if isinstance(choice, ToolChoiceParam):
            out["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        elif choice == "required" or (choice is not None and tools):
            # "auto" and "none" need no tools (Codex sends "auto" with none)
            out["tool_choice"] = choice
        return out

    @property
    def effort(self) -> str | None:
        """The library's ``reasoning_effort``, for a model that thinks."""
        return EFFORTS.get(self.reasoning.effort or "") if self.reasoning else None

    def _instructions(self) -> list[dict[str, Any]]:
        return [{"role": "system", "content": self.instructions}] if self.instructions else []

    def generation(self) -> Generation:
        """The library's request, checked before any store is read or model loads:
        ``instructions``, then this input. A continuation adds the previous
        conversation with :meth:`continued` (it was checked when it was stored)."""
        continues = self.previous_response_id is not None
        if self.input is None and not continues:
            raise bad_request("Missing required parameter 'input' (or previous_response_id)",
                              "input")
        messages = self._instructions() + to_messages(self.items())
        if not messages and not continues:
            raise bad_request("'input' holds no message: send a string, or at least one "
                              "message or function_call_output item", "input")
        return Generation(self.model, messages=messages or None, sampling=self.sampling(),
                          structured=self.structured(), stream=bool(self.stream),
                          names=NAMES).check()

    def continued(self, gen: Generation, previous: list[dict[str, Any]]) -> Generation:
        """``gen`` on from ``previous``: instructions (never carried over from a previous
        response, as in OpenAI's API), the previous conversation, then this input."""
        messages = self._instructions() + [dict(m) for m in previous] + \
            to_messages(self.items())
        return replace(gen, messages=messages)
