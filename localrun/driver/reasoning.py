"""A thinking model's reply, split and steered on every engine.

:func:`plan_thinking` renders a conversation for a model whose template thinks
(:mod:`localrun.reasoning`): the template's switch set as the call asked, an empty
thinking block written where thinking is off and the template has no switch. It says
whether the reply opens with thinking.

:class:`Splitter` reads the engine's pieces of the first phase: thinking
(``Completion.reasoning``) until the end marker, the answer after it. A phase ends
early, and the sequence goes on from a new prompt (the second phase, run by the
driver like any sequence), in two cases:

- the thinking budget is spent: the prompt is the conversation, the thinking so far
  and the model's own end marker (:attr:`~localrun.reasoning.ReasoningFormat.close`);
- the answer must be constrained (a schema, a tool call) or start with a prefill (a
  forced call's marker): the prompt is the conversation and the whole thinking, so
  that the grammar applies to the answer alone, on every engine.

Engines that keep the last prompt's KV cells (llama.cpp, MLX, OpenVINO) only feed the
thinking again for the second phase, not the conversation.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from localrun.backends.base import GenerationStats, Prompt, Session
from localrun.images import message_images
from localrun.reasoning import ReasoningFormat, ReasoningRequest, refuse
from localrun.structured.output import PreparedChat
from localrun.types import Message

#: How the rendered prompt leaves the reply: thinking already opened (a prefilled
#: ``<think>``), closed (thinking off), or up to the model ("maybe": it may open it).
Start = Literal["open", "closed", "maybe"]


@dataclass(frozen=True)
class ChatSetup:
    """What the driver knows about a model's chat template, once per Model."""

    template: str | None  # the template localrun renders (a caller's override, or the model's)
    override: bool  # the caller gave the template: localrun renders every conversation
    reasoning: ReasoningFormat | None  # how the model thinks, None: it does not


def chat_setup(session: Session, template: str | None = None,
               reasoning: str | None = None) -> ChatSetup:
    """What a Model renders with: ``template`` (the caller's, which then renders every
    conversation) or the model's own; the reasoning format that template speaks, else
    the one the catalog names for the model (``reasoning``; not for a caller's
    template, which says all there is)."""
    from localrun.backends.remote.tools import ENVELOPE_TEMPLATE
    from localrun.reasoning import by_name, detect

    source = template if template is not None else session.chat_template
    fmt = detect(source) or (by_name(reasoning) if template is None else None)
    if source == ENVELOPE_TEMPLATE:  # a server (remote, vLLM) renders its model's template
        fmt = None
    return ChatSetup(source, template is not None, fmt)


@dataclass(frozen=True)
class Thinking:
    """One request's thinking phase."""

    fmt: ReasoningFormat
    start: Start
    budget: int | None  # tokens of thinking at most (None: max_tokens alone bounds it)
    prompt: str  # the rendered prompt of the first phase
    prefill: str  # what the answer starts with (a forced call's marker)
    own_phase: bool  # the answer runs as a phase of its own (constrained or prefilled)


def start_of(rendered: str, fmt: ReasoningFormat) -> Start:
    """Whether a rendered prompt leaves the reply inside the thinking, after it, or
    before it (the model decides)."""
    tail = rendered.rstrip()
    if tail.endswith(fmt.start):
        return "open"
    if tail.endswith(fmt.end):
        return "closed"
    return "maybe"


def switched_off(rendered: str, fmt: ReasoningFormat) -> str:
    """The prompt with an empty thinking block written for the model (thinking off where
    the template has no switch, or ignored it)."""
    start = start_of(rendered, fmt)
    if start == "closed":
        return rendered
    if start == "open":
        return rendered.rstrip() + "\n\n" + fmt.end + "\n\n"
    return rendered + fmt.empty


def plan_thinking(fmt: ReasoningFormat, asked: ReasoningRequest | None,
                  messages: Sequence[Mapping[str, Any]], template: str | None,
                  *, bos_token: str, eos_token: str,
                  tools: Sequence[Mapping[str, Any]] | None, prefill: str,
                  own_phase: bool) -> tuple[str, Thinking | None]:
    """The first phase's prompt text, and its thinking (None: the reply has none)."""
    from localrun.templates import render_chat

    think = asked.think if asked is not None else None
    variables = {fmt.switch: think} if fmt.switch and think is not None else None
    rendered = render_chat(template, messages, bos_token=bos_token, eos_token=eos_token,
                           tools=tools, variables=variables)
    if think is False:
        rendered = switched_off(rendered, fmt)
    start = start_of(rendered, fmt)
    if start == "closed":
        if think and asked is not None:
            raise refuse(asked, "this model's chat template closes the thinking before the "
                         f"reply ({fmt.name} format: the prompt ends with {fmt.end})")
        return rendered + prefill, None
    budget = asked.budget if asked is not None else None
    return rendered, Thinking(fmt, start, budget, rendered, prefill, own_phase)


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that is a proper start of ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


_BLANKS = re.compile(r"\s*\Z")


class Splitter:
    """The first phase's pieces as (thinking, answer) text.

    The thinking loses the blank lines around it (after ``<think>``, before
    ``</think>``), the answer those after ``</think>``, as every reasoning parser does.
    Once ``switch`` is set the phase is over: the driver stops the engine and runs the
    answer phase from ``switch``, the prompt that goes on from the thinking;
    ``tokens`` then holds the first phase's tokens that count (those before the cut).
    """

    __slots__ = ("_lead", "_pending", "_raw", "_trim", "opened", "reasoning_tokens",
                 "state", "switch", "think", "tokens")

    def __init__(self, think: Thinking) -> None:
        self.think = think
        self.state: Literal["maybe", "thinking", "answer"] = \
            "thinking" if think.start == "open" else "maybe"
        self.opened = think.start == "open"  # the reply has a thinking part
        self._raw: list[str] = []  # the model's own text of this phase
        self._pending = ""  # text not given out yet (a marker may be starting)
        self._lead = True  # nothing of the thinking given out yet
        self._trim = False  # the answer's first blanks (after the end marker) go
        self.switch: str | None = None
        self.tokens = 0
        self.reasoning_tokens = 0

    @property
    def thinking(self) -> bool:
        return self.state == "thinking"

    def feed(self, piece: str, count: int) -> tuple[str, str]:
        """Read one engine piece; ``count`` is the phase's tokens as of it."""
        if self.switch is not None:
            return "", ""  # pieces the engine made before it stopped
        if self.state == "answer":
            return "", self._answer(piece)
        self._raw.append(piece)
        self._pending += piece
        reasoning, answer = self._run(count)
        fmt, budget = self.think.fmt, self.think.budget
        if self.switch is None and self._before_answer() and budget is not None \
                and count >= budget:
            # the budget is spent: the thinking ends here, whatever was held back with it
            # (blanks, the start of an end marker); localrun writes the end marker
            kept = "".join(self._raw)
            kept = kept[:len(kept) - len(self._pending)]
            if self.state == "maybe":  # it never opened: an empty block, as when off
                self.switch = switched_off(self.think.prompt + kept, fmt) + \
                    self.think.prefill
            else:
                self.switch = self.think.prompt + kept.rstrip() + fmt.close + \
                    self.think.prefill
            self._pending = ""
            self.tokens = self.reasoning_tokens = count
        return reasoning, answer

    def _before_answer(self) -> bool:
        return self.state != "answer"

    def _run(self, count: int) -> tuple[str, str]:
        fmt = self.think.fmt
        out: list[str] = []
        if self.state == "maybe":
            body = self._pending.lstrip()
            if not body or (fmt.start.startswith(body) and body != fmt.start):
                return "", ""  # maybe the start of the thinking: wait
            if not body.startswith(fmt.start):  # no thinking: all of it is the answer
                self.state = "answer"
                text, self._pending = self._pending, ""
                if self.think.own_phase:
                    self._switch_here(0, "")  # what it wrote is not kept
                    return "", ""
                return "", text
            self.state, self.opened = "thinking", True
            self._pending = body[len(fmt.start):]
        at = self._pending.find(fmt.end)
        if at >= 0:
            out.append(self._pending[:at])
            rest = self._pending[at + len(fmt.end):]
            self._pending = ""
            self.state = "answer"
            self.reasoning_tokens = count
            reasoning = self._give("".join(out), final=True)
            if self.think.own_phase:
                raw = "".join(self._raw)
                self._switch_here(count, raw[:len(raw) - len(rest)] + fmt.after)
                return reasoning, ""
            self._trim = True
            return reasoning, self._answer(rest)
        keep = _partial_suffix(self._pending, fmt.end)
        ready = self._pending[:len(self._pending) - keep]
        blanks = len(_BLANKS.search(ready).group())  # type: ignore[union-attr]
        given = ready[:len(ready) - blanks]
        self._pending = self._pending[len(given):]
        return self._give(given, final=False), ""

    def _switch_here(self, count: int, thought: str) -> None:
        self.switch = self.think.prompt + thought + self.think.prefill
        self.tokens = count

    def _give(self, text: str, final: bool) -> str:
        if self._lead:
            text = text.lstrip()
            if text:
                self._lead = False
        return text.rstrip() if final else text

    def _answer(self, text: str) -> str:
        if self._trim:
            text = text.lstrip()
            if text:
                self._trim = False
        return text

    def flush(self, count: int) -> tuple[str, str]:
        """At the end of the phase (the engine stopped): what was held back."""
        if self.switch is not None:
            return "", ""
        pending, self._pending = self._pending, ""
        if self.state == "thinking":
            self.reasoning_tokens = count
            return self._give(pending, final=True), ""
        if self.state == "maybe":  # only blanks, or a start of "<think>" that never came
            self.state = "answer"
            return "", pending
        return "", ""


def thinking_prompt(session: Session, chat: ChatSetup, messages: list[Message],
                    plan: PreparedChat | None, asked: ReasoningRequest | None
                    ) -> tuple[Prompt, Thinking | None]:
    """The first phase's prompt of a conversation with a thinking model, and its
    thinking (None: the reply has none, as with ``think=False``)."""
    assert chat.reasoning is not None
    own = plan is not None and (plan.constraint is not None or bool(plan.prefill))
    text, thinking = plan_thinking(
        chat.reasoning, asked, plan.messages if plan is not None else messages,
        chat.template, bos_token=session.bos_token, eos_token=session.eos_token,
        tools=plan.template_tools if plan is not None else None,
        prefill=plan.prefill if plan is not None else "", own_phase=own)
    prompt = session.encode_rendered(text)
    images = message_images(messages)
    return (session.attach_images(prompt, images) if images else prompt), thinking


def merged(prior: GenerationStats | None, stats: GenerationStats, kept: int
           ) -> GenerationStats:
    """The engine figures of the phases so far (``kept`` tokens of the last one)."""
    if prior is None:
        prior = GenerationStats()
    return GenerationStats(
        completion_tokens=prior.completion_tokens + kept,
        finish_reason=stats.finish_reason,
        prefill_tokens=prior.prefill_tokens + stats.prefill_tokens,
        prefill_seconds=prior.prefill_seconds + stats.prefill_seconds,
        decode_tokens=prior.decode_tokens + stats.decode_tokens,
        decode_seconds=prior.decode_seconds + stats.decode_seconds,
        started=prior.started or stats.started,
        drafted_tokens=prior.drafted_tokens + stats.drafted_tokens,
        accepted_tokens=prior.accepted_tokens + stats.accepted_tokens)
