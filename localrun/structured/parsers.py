"""Tool calls out of a model's text, incrementally: one parser for every format.

:class:`ToolCallParser` is fed the reply piece by piece (as the engine streams it) and
returns the content to show and the :class:`ToolCallDelta` s to send. A call's first
delta (its ``index``, ``id`` and ``name``) goes out as soon as the name is complete;
its arguments follow as fragments of the JSON text as the model writes it, so the
fragments of one call concatenate to exactly its ``arguments`` (valid JSON once the call
is complete). :func:`parse_tool_calls` runs the same parser over a whole reply, so a
streamed reply and a whole one cannot disagree.

Formats with an opening marker (hermes ``<tool_call>``, mistral ``[TOOL_CALLS]``) stream
content up to the marker and calls after it. Formats without one (llama3_json,
pythonic) are recognised by how the reply starts (``{``, ``[`` or ``<|python_tag|>``):
such a reply is held back and parsed once complete; any other reply streams as content.

Limits: a call whose JSON does not parse (cut by ``max_tokens``, or malformed where
nothing constrained it) is not returned as a call: its text goes back into the content
(deltas already streamed for it stay sent; the reply's ``finish_reason`` says why).
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from localrun.structured.calls import ToolCall, ToolCallDelta, new_call_id
from localrun.structured.formats import ToolFormat

#: Prefixes some models put before marker-less calls (Llama 3.1's "python tag", Llama 4's
#: python_start/python_end around pythonic calls).
_RAW_PREFIXES = ("<|python_tag|>", "<|python_start|>")
_RAW_SUFFIXES = ("<|python_end|>", "<|eom_id|>", "<|eot_id|>")


@dataclass
class _Call:
    """One call being read from the JSON text."""

    start: int  # where its object starts in the scanner's buffer
    index: int
    id: str
    name: str | None = None
    args_start: int | None = None
    args_end: int | None = None
    args_is_string: bool = False
    sent_header: bool = False
    sent_args: int = 0  # characters of the argument text already sent
    valid: bool = True
    end: int = -1  # where its object ends in the buffer, once it has


@dataclass
class _Scanner:
    """An incremental JSON reader for calls: one object, or an array of them (Mistral).

    It tracks where each call object's ``name`` and ``arguments``/``parameters`` values
    lie in its buffer, character by character; it does not validate the JSON (each
    finished call is checked with ``json.loads``).
    """

    call_depth: int  # 1: the value is one call object; 2: an array of call objects
    args_keys: tuple[str, ...]
    buf: str = ""
    stack: list[str] = field(default_factory=list)
    in_string: bool = False
    escape: bool = False
    state: str = "value"  # inside the object at call depth: key, colon, value, after
    key_start: int = -1
    key: str | None = None
    value_start: int = -1
    value_kind: str = ""  # "container", "string", "primitive"
    current: _Call | None = None
    finished: list[_Call] = field(default_factory=list)
    done: bool = False
    broken: bool = False

    def feed(self, text: str, new_call: Callable[[int], _Call]) -> int:
        """Read ``text``; return how many of its characters belong to the JSON value
        (the rest follows it)."""
        for i, ch in enumerate(text):
            if self.done or self.broken:
                return i
            pos = len(self.buf)
            self.buf += ch
            self._char(ch, pos, new_call)
            if self.done:
                return i + 1
        return len(text)

    def _start_value(self, pos: int, kind: str) -> None:
        self.value_start, self.value_kind = pos, kind
        call = self.current
        if call is not None and self.key in self.args_keys:
            call.args_start, call.args_is_string = pos, kind != "container"

    def _end_value(self, end: int) -> None:
        call, key = self.current, self.key
        self.state = "after"
        if call is None or key is None:
            return
        if key == "name":
            try:
                name = json.loads(self.buf[self.value_start:end])
            except ValueError:
                call.valid = False
                return
            call.name = name if isinstance(name, str) else None
            if call.name is None:
                call.valid = False
        elif key in self.args_keys:
            call.args_start, call.args_end = self.value_start, end

    def _char(self, ch: str, pos: int, new_call: Callable[[int], _Call]) -> None:
        depth = len(self.stack)
        if self.in_string:
            if self.escape:
                self.escape = False
            elif ch == "\\":
                self.escape = True
            elif ch == '"':
                self.in_string = False
                if depth == self.call_depth and self.current is not None:
                    if self.state == "key":
                        try:
                            self.key = json.loads(self.buf[self.key_start:pos + 1])
                        except ValueError:
                            self.key = None
                        self.state = "colon"
                    elif self.state == "value" and self.value_kind == "string":
                        self._end_value(pos + 1)
            return
        if ch in " \t\r\n":
            if depth == self.call_depth and self.state == "value" and \
                    self.value_kind == "primitive":
                self._end_value(pos)
            return
        at_call = depth == self.call_depth and self.current is not None
        if at_call and self.state == "value" and self.value_kind == "primitive" and \
                ch in ",}":
            self._end_value(pos)
        if ch == '"':
            self.in_string = True
            if at_call and self.state == "key":
                self.key_start = pos
            elif at_call and self.state == "value" and not self.value_kind:
                self._start_value(pos, "string")
            return
        if ch in "{[":
            if at_call and self.state == "value" and not self.value_kind:
                self._start_value(pos, "container")
            self.stack.append(ch)
            if len(self.stack) == self.call_depth:
                if ch != "{":
                    self.broken = True
                    return
                self.current = new_call(pos)
                self.state, self.key = "key", None
            elif len(self.stack) == 1 and self.call_depth == 2 and ch != "[":
                self.broken = True
            return
        if ch in "}]":
            if not self.stack or {"}": "{", "]": "["}[ch] != self.stack[-1]:
                self.broken = True
                return
            self.stack.pop()
            new_depth = len(self.stack)
            if new_depth == self.call_depth and self.value_kind == "container":
                self._end_value(pos + 1)
            elif new_depth == self.call_depth - 1 and self.current is not None:
                call = self.current
                try:
                    obj = json.loads(self.buf[call.start:pos + 1])
                    call.valid = call.valid and isinstance(obj, dict)
                except ValueError:
                    call.valid = False
                call.end = pos + 1
                self.finished.append(call)
                self.current = None
            if new_depth == 0:
                self.done = True
            return
        if ch == ":" and at_call and self.state == "colon":
            self.state, self.value_kind, self.value_start = "value", "", -1
            return
        if ch == "," and at_call:
            self.state, self.key, self.value_kind = "key", None, ""
            return
        if at_call and self.state == "value" and not self.value_kind:
            self._start_value(pos, "primitive")


class ToolCallParser:
    """Content and tool calls out of streamed text, in one format."""

    def __init__(self, fmt: ToolFormat, parse_arguments: Callable[[str, str], Any] | None = None
                 ) -> None:
        self.fmt = fmt
        self._parse_args = parse_arguments
        self.calls: list[ToolCall] = []
        self.content = ""
        self._pending = ""  # text not yet classified
        self._state = "text" if fmt.open else "start"
        self._scanner: _Scanner | None = None
        self._raw = ""  # the text of the call being read (back into content if it fails)
        self._index = 0
        self._deltas: list[ToolCallDelta] = []
        self._out: list[str] = []
        self._mistral_name: str | None = None

    # -- public -----------------------------------------------------------------------------

    def prime(self, prefill: str) -> None:
        """Read the text the prompt already ends with (a forced call's opening marker):
        it is not part of the reply, so a call that then fails gives back only what the
        model wrote."""
        self.feed(prefill)
        self._raw = ""
        if self._state == "call_start":
            self._pending = ""  # only the whitespace after the marker is left

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        self._pending += text
        self._run(final=False)
        return self._take()

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """Flush at the end of the reply: parse what was held back, give up on a call that
        never completed (its text becomes content)."""
        self._run(final=True)
        if self._state == "raw":
            self._parse_raw(self._raw + self._pending)
            self._pending = self._raw = ""
        elif self._state in ("call", "call_start", "mistral_name"):
            self._abandon()
        elif self._pending:
            self._emit(self._pending)
            self._pending = ""
        self._state = "done"
        return self._take()

    # -- internals ----------------------------------------------------------------------------

    def _take(self) -> tuple[str, list[ToolCallDelta]]:
        text, deltas = "".join(self._out), self._deltas
        self._out, self._deltas = [], []
        return text, deltas

    def _emit(self, text: str) -> None:
        if text:
            self._out.append(text)
            self.content += text

    def _new_call(self, start: int) -> _Call:
        call = _Call(start, self._index, new_call_id(self.fmt.id_length))
        self._index += 1
        return call

    def _run(self, final: bool) -> None:
        while True:
            state = self._state
            if state == "start":
                self._start(final)
            elif state == "text":
                self._text(final)
            elif state == "call_start":
                self._call_start(final)
            elif state == "mistral_name":
                self._read_mistral_name(final)
            elif state == "call":
                self._read_call()
            elif state == "after_call":
                self._after_call(final)
            elif state in ("raw", "content_only"):
                if state == "content_only":
                    self._emit(self._pending)
                    self._pending = ""
                else:
                    self._raw += self._pending
                    self._pending = ""
            if self._state == state:  # no progress possible until more text comes
                return

    def _start(self, final: bool) -> None:
        """Marker-less formats: a reply that starts like a call is held back whole."""
        body = self._pending.lstrip()
        if not body:
            return
        if body[0] in "{[" or body.startswith(_RAW_PREFIXES):
            self._state = "raw"
        elif any(p.startswith(body) for p in _RAW_PREFIXES) and not final:
            return  # could still become "<|python_tag|>"
        else:
            self._state = "content_only"

    def _text(self, final: bool) -> None:
        marker = self.fmt.open
        at = self._pending.find(marker)
        if at >= 0:
            self._emit(self._pending[:at])
            self._raw = marker
            self._pending = self._pending[at + len(marker):]
            self._state = "call_start"
            return
        keep = 0 if final else _partial_suffix(self._pending, marker)
        self._emit(self._pending[:len(self._pending) - keep])
        self._pending = self._pending[len(self._pending) - keep:]

    def _call_start(self, final: bool) -> None:
        body = self._pending.lstrip()
        if not body:
            return
        first = body[0]
        self._raw += self._pending[:len(self._pending) - len(body)]
        self._pending = body
        args = ("arguments", "parameters")
        if first == "{":
            self._scanner = _Scanner(1, args)
            self._state = "call"
        elif first == "[" and self.fmt.array:
            self._scanner = _Scanner(2, args)
            self._state = "call"
        elif self.fmt.name == "mistral" and (first.isalpha() or first == "_"):
            self._state = "mistral_name"  # [TOOL_CALLS]name[ARGS]{...} (tekken v11+)
        else:
            self._abandon()

    def _read_mistral_name(self, final: bool) -> None:
        at = self._pending.find("[ARGS]")
        if at < 0:
            if final or not re.fullmatch(r"[\w.-]*(\[A?R?G?S?)?", self._pending):
                self._abandon()
            return
        name = self._pending[:at]
        if not re.fullmatch(r"[\w.-]+", name):
            self._abandon()
            return
        self._raw += self._pending[:at + len("[ARGS]")]
        self._pending = self._pending[at + len("[ARGS]"):].lstrip()
        self._mistral_name = name
        # the arguments object is read as if it were {"arguments": ...} of a named call
        self._scanner = _Scanner(0, ())
        call = self._new_call(0)
        call.name = name
        call.args_start = 0
        self._scanner.current = call
        self._state = "call"

    def _read_call(self) -> None:
        scanner = self._scanner
        assert scanner is not None
        if not self._pending:
            return
        used = scanner.feed(self._pending, self._new_call)
        self._raw += self._pending[:used]
        self._pending = self._pending[used:]
        if scanner.broken:
            self._abandon()
            return
        if scanner.call_depth == 0:  # mistral name[ARGS]{...}: the value is the arguments
            call = scanner.current
            assert call is not None
            if scanner.done:
                call.args_end = call.end = len(scanner.buf)
                try:
                    call.valid = isinstance(json.loads(scanner.buf), dict)
                except ValueError:
                    call.valid = False
                scanner.finished.append(call)
                scanner.current = None
        for call in [*scanner.finished, *([scanner.current] if scanner.current else [])]:
            self._stream(call, scanner.buf)
        for call in scanner.finished:
            self._complete(call, scanner.buf)
        scanner.finished.clear()
        if scanner.done:
            self._scanner = None
            self._raw = ""
            self._state = "after_call"

    def _stream(self, call: _Call, buf: str) -> None:
        if not call.valid:
            return
        if not call.sent_header:
            if call.name is None:
                return
            self._deltas.append(ToolCallDelta(call.index, call.id, call.name, ""))
            call.sent_header = True
        if call.args_start is None or call.args_is_string:
            return
        end = call.args_end if call.args_end is not None else len(buf)
        piece = buf[call.args_start + call.sent_args:end]
        if piece:
            self._deltas.append(ToolCallDelta(call.index, arguments=piece))
            call.sent_args += len(piece)

    def _complete(self, call: _Call, buf: str) -> None:
        if not call.valid or call.name is None:
            self._emit(buf[call.start:call.end if call.end >= 0 else len(buf)])  # keep its text
            return
        if call.args_start is None:
            arguments = "{}"
            self._deltas.append(ToolCallDelta(call.index, arguments=arguments))
        elif call.args_is_string:  # arguments as a JSON string holding the JSON (or null)
            value = json.loads(buf[call.args_start:call.args_end])
            arguments = "{}" if value is None else value if isinstance(value, str) else ""
            try:
                ok = isinstance(json.loads(arguments), dict)
            except ValueError:
                ok = False
            if not ok:
                self._emit(buf[call.start:call.end if call.end >= 0 else len(buf)])
                return
            self._deltas.append(ToolCallDelta(call.index, arguments=arguments))
        else:
            arguments = buf[call.args_start:call.args_end]
        self.calls.append(self._tool_call(call.id, call.name, arguments))

    def _tool_call(self, call_id: str, name: str, arguments: str) -> ToolCall:
        parsed: Any = None
        if self._parse_args is not None:
            try:
                parsed = self._parse_args(name, arguments)
            except Exception:  # a pydantic validator refusing: the JSON is still returned
                parsed = None
        else:
            try:
                parsed = json.loads(arguments)
            except ValueError:
                parsed = None
        return ToolCall(call_id, name, arguments, parsed)

    def _after_call(self, final: bool) -> None:
        close = self.fmt.close
        body = self._pending.lstrip()
        if close:
            if body.startswith(close):
                self._pending = body[len(close):]
            elif not final and close.startswith(body):
                return  # maybe "</tool_call>" is still coming
        self._state = "text" if self.fmt.open else "content_only"

    def _abandon(self) -> None:
        """What looked like a call is not one: its text (and what follows) is content."""
        self._emit(self._raw + self._pending)
        self._raw = self._pending = ""
        self._scanner = None
        self._state = "text" if self.fmt.open else "content_only"

    # -- marker-less formats, parsed whole ----------------------------------------------------

    def _parse_raw(self, text: str) -> None:
        body = text.strip()
        for p in _RAW_PREFIXES:
            if body.startswith(p):
                body = body[len(p):].strip()
        for s in _RAW_SUFFIXES:
            if body.endswith(s):
                body = body[:-len(s)].strip()
        found = _parse_pythonic(body) if body.startswith("[") else _parse_json_calls(body)
        if found is None and body.startswith("["):  # a JSON array of calls
            found = _parse_json_calls(body)
        if not found:
            self._emit(text)
            return
        for name, arguments in found:
            call_id = new_call_id(self.fmt.id_length)
            index = self._index
            self._index += 1
            self._deltas.append(ToolCallDelta(index, call_id, name, ""))
            self._deltas.append(ToolCallDelta(index, arguments=arguments))
            self.calls.append(self._tool_call(call_id, name, arguments))


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def _json_args(call: Any) -> tuple[str, str] | None:
    if not isinstance(call, dict):
        return None
    if isinstance(call.get("function"), dict):  # {"type": "function", "function": {...}}
        call = call["function"]
    name = call.get("name")
    args = call.get("parameters", call.get("arguments", {}))
    if not isinstance(name, str):
        return None
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return name, json.dumps(args, ensure_ascii=False)


def _parse_json_calls(body: str) -> list[tuple[str, str]] | None:
    """Llama 3.x: one JSON call object, several separated by ';' or newlines, or an array."""
    decoder = json.JSONDecoder()
    out: list[tuple[str, str]] = []
    i = 0
    while i < len(body):
        try:
            value, end = decoder.raw_decode(body, i)
        except ValueError:
            return None
        items = value if isinstance(value, list) else [value]
        for item in items:
            parsed = _json_args(item)
            if parsed is None:
                return None
            out.append(parsed)
        i = end
        while i < len(body) and body[i] in " \t\r\n;,":
            i += 1
    return out or None


def _literal(node: ast.expr) -> Any:
    return ast.literal_eval(node)


def _parse_pythonic(body: str) -> list[tuple[str, str]] | None:
    """``[f(a=1, b="x"), g()]``: calls with keyword arguments of Python literals."""
    try:
        tree = ast.parse(body, mode="eval")
    except SyntaxError:
        return None
    node = tree.body
    if not isinstance(node, ast.List):
        return None
    out: list[tuple[str, str]] = []
    for item in node.elts:
        if not isinstance(item, ast.Call) or item.args:
            return None
        func = item.func
        if isinstance(func, ast.Name):
            name = func.id
        elif isinstance(func, ast.Attribute):
            name = ast.unparse(func)
        else:
            return None
        args: dict[str, Any] = {}
        for kw in item.keywords:
            if kw.arg is None:
                return None
            try:
                args[kw.arg] = _literal(kw.value)
            except ValueError:
                return None
        try:
            out.append((name, json.dumps(args, ensure_ascii=False)))
        except (TypeError, ValueError):  # a set or bytes literal
            return None
    return out or None


def parse_tool_calls(text: str, fmt: ToolFormat) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a whole reply: the streaming parser fed all at once."""
    parser = ToolCallParser(fmt)
    parser.feed(text)
    parser.finish()
    return parser.content, parser.calls
