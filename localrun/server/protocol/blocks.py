"""A reply as content blocks, whole or as it streams: the one tool-call assembly every
dialect whose reply is a list of blocks or items reads (Anthropic's ``content``, the
Responses API's ``output``).

The library streams text pieces and tool-call deltas (:class:`~localrun.types.Chunk`:
each call's first delta has its index, id and name; later ones argument fragments).
:class:`Blocks` turns them into blocks numbered in the order they begin — a run of
text, then a tool call, then perhaps text again — each opened, fed and closed (the
open one closes when another begins, and at the end). A thinking model's thinking
(chunks' ``reasoning``) is a "thinking" block before them, for a dialect that asks
(``Blocks(reasoning=True)``, ``blocks_of(c, reasoning=True)``); one that does not
never sees it. :class:`BlockWire` is the
:class:`~localrun.server.jobs.Wire` a dialect subclasses: it writes each
:class:`BlockEvent` and the end in its own events.
"""

from __future__ import annotations

import json
from abc import abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

from localrun.server.jobs import Wire
from localrun.types import Chunk, Completion

BlockKind = Literal["text", "tool_call", "thinking"]


@dataclass(frozen=True)
class BlockEvent:
    """``start`` (a tool call's carries ``call_id`` and ``name``), ``delta`` (``text``:
    reply text, thinking, or a fragment of the call's arguments JSON), ``stop`` (a tool
    call's carries its whole ``text``: the arguments JSON; a thinking block's, the whole
    thinking)."""

    kind: Literal["start", "delta", "stop"]
    index: int
    block: BlockKind
    text: str = ""
    call_id: str = ""
    name: str = ""


@dataclass(frozen=True)
class Block:
    """One block of a whole reply: text, thinking, or a tool call (``arguments`` JSON)."""

    kind: BlockKind
    text: str = ""
    call_id: str = ""
    name: str = ""
    arguments: str = ""

    @property
    def input(self) -> Any:
        """A tool call's arguments as data (an object unless the model wrote otherwise)."""
        try:
            return json.loads(self.arguments or "{}")
        except ValueError:
            return self.arguments


def blocks_of(c: Completion, reasoning: bool = False) -> list[Block]:
    """A whole reply's blocks: its thinking (with ``reasoning``, if it has any), its
    text (if any), then its tool calls."""
    out = [Block("thinking", text=c.reasoning)] if reasoning and c.reasoning else []
    out += [Block("text", text=c.text)] if c.text else []
    out += [Block("tool_call", call_id=t.id, name=t.name, arguments=t.arguments)
            for t in c.tool_calls]
    return out


class Blocks:
    """Streamed chunks → :class:`BlockEvent` s (see the module's docstring)."""

    def __init__(self, reasoning: bool = False) -> None:
        self.reasoning = reasoning  # thinking chunks make a "thinking" block
        self.thought: list[str] = []  # the thinking block's pieces
        self.count = 0  # blocks begun
        self.open: tuple[BlockKind, int] | None = None  # (kind, call index) of the open one
        self.calls: dict[int, tuple[int, str, str, list[str]]] = {}  # call → (block, id, ...)

    def _start(self, kind: BlockKind, call: int = -1, call_id: str = "", name: str = ""
               ) -> list[BlockEvent]:
        out = self._close()
        self.open = (kind, call)
        index = self.count
        self.count += 1
        if kind == "tool_call":
            self.calls[call] = (index, call_id, name, [])
        elif kind == "thinking":
            self.thought = []
        out.append(BlockEvent("start", index, kind, call_id=call_id, name=name))
        return out

    def _close(self) -> list[BlockEvent]:
        if self.open is None:
            return []
        kind, call = self.open
        self.open = None
        if kind == "text":
            return [BlockEvent("stop", self.count - 1, "text")]
        if kind == "thinking":
            return [BlockEvent("stop", self.count - 1, "thinking", "".join(self.thought))]
        index, call_id, name, parts = self.calls[call]
        return [BlockEvent("stop", index, "tool_call", "".join(parts), call_id, name)]

    def feed(self, chunk: Chunk) -> list[BlockEvent]:
        out: list[BlockEvent] = []
        if chunk.reasoning and self.reasoning:
            if self.open is None or self.open[0] != "thinking":
                out += self._start("thinking")
            self.thought.append(chunk.reasoning)
            out.append(BlockEvent("delta", self.count - 1, "thinking", chunk.reasoning))
        if chunk.text:
            if self.open is None or self.open[0] != "text":
                out += self._start("text")
            out.append(BlockEvent("delta", self.count - 1, "text", chunk.text))
        for d in chunk.tool_calls:
            if d.index not in self.calls:
                out += self._start("tool_call", d.index, d.id or "", d.name or "")
            elif self.open != ("tool_call", d.index):
                continue  # a fragment of a call already closed: the parser never sends one
            if d.arguments:
                index, _, _, parts = self.calls[d.index]
                parts.append(d.arguments)
                out.append(BlockEvent("delta", index, "tool_call", d.arguments))
        return out

    def close(self) -> list[BlockEvent]:
        """The end of the reply: the open block closes."""
        return self._close()


class BlockWire(Wire):
    """A dialect's stream over :class:`Blocks`: subclasses write :meth:`event` and
    :meth:`end` (and :meth:`begin`, :meth:`error`, as every Wire)."""

    def __init__(self, reasoning: bool = False) -> None:
        self.blocks = Blocks(reasoning)

    def chunk(self, chunk: Chunk) -> Iterable[bytes]:
        for event in self.blocks.feed(chunk):
            yield from self.event(event)

    def done(self, completion: Completion) -> Iterable[bytes]:
        for event in self.blocks.close():
            yield from self.event(event)
        yield from self.end(completion)

    @abstractmethod
    def event(self, event: BlockEvent) -> Iterable[bytes]:
        """One block opened, fed or closed."""

    @abstractmethod
    def end(self, completion: Completion) -> Iterable[bytes]:
        """After the last block: the finish, the usage, the stream's own end."""


def sse(data: str, event: str | None = None) -> bytes:
    """One server-sent event: ``data`` (JSON text), with an ``event:`` name if given."""
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {data}\n\n".encode()
