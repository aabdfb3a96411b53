"""The structured-output layer the API runs around every engine.

1. :func:`prepare` checks ``response_format``/``schema``/``tools``/``tool_choice`` once,
   before any engine is touched (bad shapes and unenforceable schemas fail here).
2. :func:`prepare_chat` decides, for one model's chat template, how the conversation is
   rendered (the template's own tool support, or the fallback prompt), what the
   assistant turn is pre-filled with (a forced call's opening marker) and the
   :class:`Constraint` the engine enforces.
3. :class:`OutputProcessor` turns the engine's text into content, tool-call deltas,
   and at the end the Completion's ``tool_calls``/``parsed``. It watches each JSON value
   as it streams (:class:`~localrun.structured.watch.JsonWatch`): one that runs away (a
   looping string) ends the reply, and the call raises
   :class:`~localrun.structured.watch.RunawayOutputError` naming the field.

Combinations: a schema with ``tools`` needs ``tool_choice="none"`` (the reply is then the
schema's JSON, the tools only describe earlier turns); "auto"/"required"/named with a
schema are refused rather than silently dropping one of them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from localrun.errors import IncompleteOutputError, InvalidToolError, StructuredOutputError
from localrun.structured.calls import ToolCall, ToolCallDelta
from localrun.structured.constraint import Constraint
from localrun.structured.formats import (
    ToolFormat,
    detect_format,
    fallback_messages,
    forced_prefill,
    has_tool_turns,
    native_messages,
    tool_constraint,
)
from localrun.structured.functions import Tool, normalize_tool_choice, normalize_tools
from localrun.structured.parsers import ToolCallParser
from localrun.structured.schema import OutputSpec, output_spec
from localrun.structured.watch import JsonWatch, Runaway, RunawayOutputError


@dataclass(frozen=True)
class StructuredRequest:
    """What a call asked for, normalised and checked."""

    output: OutputSpec | None = None
    tools: tuple[Tool, ...] = ()
    tool_choice: str = "none"
    #: ``parallel_tool_calls``: False, one call at most; True, a forced call
    #: (``tool_choice="required"``) may be several; None (unset), one forced call, any
    #: number of calls with "auto" (llama-server's default)
    parallel: bool | None = None

    @property
    def calls_tools(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"


def prepare(response_format: object = None, schema: object = None, tools: object = None,
            tool_choice: object = None, parallel_tool_calls: object = None
            ) -> StructuredRequest | None:
    """Normalise and check the structured-output arguments of one call (None: plain).

    ``parallel_tool_calls=False``: at most one tool call per reply, enforced by the
    grammar where calls are constrained (the first call ends the reply; a forced call is
    one call) and, where they are parsed as written, by keeping only the first (the text
    of later ones is dropped). ``True``: ``tool_choice="required"`` may make several
    calls too (OpenAI's "required" with parallel calls). Unset: "auto" may make several,
    "required" makes one."""
    from localrun.structured.grammar import check_schema

    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise InvalidToolError(f"parallel_tool_calls must be True or False, not "
                               f"{parallel_tool_calls!r}"[:200],
                               hint="pass parallel_tool_calls=False for at most one call "
                               "per reply, or leave it out")
    output = output_spec(response_format, schema)
    tool_list = normalize_tools(tools)
    if tool_choice is not None and not tool_list and tool_choice != "none":
        raise InvalidToolError(f"tool_choice={tool_choice!r} without tools",
                               hint="pass tools=[...] too, or leave tool_choice out")
    choice = normalize_tool_choice(tool_choice, tool_list)
    if output is not None and tool_list and choice != "none":
        raise InvalidToolError(
            f"A reply cannot be both a tool call (tool_choice={choice!r}) and "
            f"{output.label}",
            hint="ask for the tool call first; pass schema= (with tool_choice='none') on "
            "the call that gives the final answer")
    if output is not None:
        check_schema(output.schema, output.label)
    if choice != "none":
        for t in tool_list:
            check_schema(t.parameters, f"the parameters of tool {t.name!r}")
    if output is None and not tool_list:
        return None
    return StructuredRequest(output, tool_list, choice, parallel_tool_calls)


@dataclass(frozen=True)
class PreparedChat:
    """How one request is run on one model."""

    messages: list[dict[str, Any]]  # to render (converted for the fallback when needed)
    template_tools: list[dict[str, Any]] | None  # for the model's own template, or None
    render_here: bool  # True: localrun renders the template (tools or tool turns in it)
    prefill: str  # text that starts the assistant turn (a forced call's marker)
    constraint: Constraint | None
    fmt: ToolFormat | None
    request: StructuredRequest | None = None


def prepare_chat(request: StructuredRequest | None, messages: Sequence[Mapping[str, Any]],
              template: str | None) -> PreparedChat:
    """Rendering, prefill and constraint for ``request`` on a model with ``template``."""
    msgs = [dict(m) for m in messages]
    tool_turns = has_tool_turns(msgs)
    calls_tools = request is not None and request.calls_tools
    fmt = detect_format(template) if (calls_tools or tool_turns) else None
    constraint: Constraint | None = None
    prefill = ""
    template_tools: list[dict[str, Any]] | None = None
    render_here = False
    tools = request.tools if request is not None and calls_tools else ()
    if fmt is not None:
        if fmt.native:
            msgs = native_messages(msgs, fmt)
            template_tools = [t.to_openai() for t in tools] or None
            render_here = True
        else:
            msgs = fallback_messages(msgs, tools)
    if request is not None and calls_tools and fmt is not None:
        constraint = tool_constraint(fmt, request.tools, request.tool_choice,
                                     request.parallel)
        if request.tool_choice != "auto":
            prefill = forced_prefill(fmt)
    elif request is not None and request.output is not None:
        constraint = Constraint.json(request.output.schema, request.output.label)
    return PreparedChat(msgs, template_tools, render_here, prefill, constraint,
                    fmt if calls_tools else None, request)


def raw_plan(request: StructuredRequest | None) -> PreparedChat:
    """``complete()`` (no chat template): a schema constrains the continuation; tools
    need a chat turn."""
    if request is not None and request.calls_tools:
        raise InvalidToolError("Tool calls need a chat turn: raw=True/complete() takes no "
                               "tools", hint="use model.chat(..., tools=[...])")
    constraint = Constraint.json(request.output.schema, request.output.label) \
        if request is not None and request.output is not None else None
    return PreparedChat([], None, False, "", constraint, None, request)


@dataclass
class Result:
    """What the output processor adds to a Completion."""

    tool_calls: tuple[ToolCall, ...] = ()
    parsed: Any = None
    error: StructuredOutputError | None = None  # raised by Stream.join / chat()
    finish_reason: str | None = None  # "tool_calls" when calls were made


@dataclass
class OutputProcessor:
    """Engine text in; content, tool-call deltas and the final Result out.

    ``runaway`` is set once a JSON value (the reply's, or a tool call's arguments) ran
    away; :attr:`halt` then, or once the one call ``parallel_tool_calls=False`` allows is
    complete, and the driver ends the reply as it does at a stop string.
    """

    plan: PreparedChat
    runaway: Runaway | None = field(default=None, init=False)
    _parser: ToolCallParser | None = field(default=None, init=False)
    _text: list[str] = field(default_factory=list, init=False)
    _watches: dict[int, JsonWatch] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        fmt, req = self.plan.fmt, self.plan.request
        if fmt is not None and req is not None:
            by_name = {t.name: t for t in req.tools}

            def parse_args(name: str, arguments: str) -> Any:
                tool = by_name.get(name)
                return tool.parse_arguments(arguments) if tool else json.loads(arguments)

            self._parser = ToolCallParser(fmt, parse_args)
            if self.plan.prefill:
                self._parser.prime(self.plan.prefill)  # the marker the prompt already holds

    @property
    def _limit(self) -> int | None:
        """Most calls the reply may make (None: any number)."""
        req = self.plan.request
        return 1 if req is not None and req.parallel is False else None

    @property
    def halt(self) -> object:
        """Truthy when the reply must end now: a value ran away, or no more calls may
        come."""
        if self.runaway is not None:
            return self.runaway
        limit = self._limit
        return limit is not None and self._parser is not None and \
            len(self._parser.calls) >= limit

    def _kept(self, deltas: list[ToolCallDelta]) -> list[ToolCallDelta]:
        limit = self._limit
        return deltas if limit is None else [d for d in deltas if d.index < limit]

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        if self._parser is None:
            self._text.append(text)
            if self.plan.constraint is not None:
                self._watch(0, text)
            return text, []
        content, deltas = self._parser.feed(text)
        deltas = self._kept(deltas)
        self._watch_calls(deltas)
        return content, deltas

    def _watch(self, index: int, text: str) -> None:
        watch = self._watches.get(index)
        if watch is None:
            watch = self._watches[index] = JsonWatch()
        found = watch.feed(text)
        if found is not None and self.runaway is None:
            where = found.path if self._parser is None else \
                f"tool_calls[{index}].arguments{found.path[1:]}"
            self.runaway = Runaway(where, found.detail)

    def _watch_calls(self, deltas: list[ToolCallDelta]) -> None:
        for d in deltas:
            if d.arguments:
                self._watch(d.index, d.arguments)

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        if self._parser is None:
            return "", []
        content, deltas = self._parser.finish()
        deltas = self._kept(deltas)
        self._watch_calls(deltas)
        return content, deltas

    def result(self, finish_reason: str) -> Result:
        """Call after :meth:`finish`: the calls, the parsed object, and any error."""
        req = self.plan.request
        if self.runaway is not None:
            return Result(error=RunawayOutputError(None, self.runaway.path,
                                                   self.runaway.detail),
                          finish_reason="length")
        if self._parser is not None:
            calls = tuple(self._parser.calls)[:self._limit]
            if calls:
                return Result(calls, None, None,
                              "tool_calls" if finish_reason == "stop" else None)
            if self.plan.prefill and finish_reason != "cancelled":
                return Result(error=IncompleteOutputError(
                    None, finish_reason, "the forced tool call is incomplete"))
            return Result()
        if req is None or req.output is None:
            return Result()
        text = "".join(self._text)
        try:
            json.loads(text)
        except ValueError as e:  # the reply was cut short (max_tokens, a stop string)
            if finish_reason == "cancelled":
                return Result()
            return Result(error=IncompleteOutputError(None, finish_reason, str(e)))
        try:
            return Result(parsed=req.output.parse(text))
        except StructuredOutputError as e:
            return Result(error=e)
