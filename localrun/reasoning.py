"""Thinking models: which chat templates think and in what markers, and what a call may
ask of them (thinking on or off, an effort level, a hard thinking budget).

A model thinks when its chat template says so (:func:`detect`), or when the catalog
names its format (``catalog.json`` ``"reasoning"``). Its reply is then split in two:
the thinking between the markers (``Completion.reasoning``, chunks' ``reasoning``) and
the answer after them (``Completion.text``). The formats, as data:

==============  =========  ==========  ===============  ====================================
format          starts     ends        switch           template (what :func:`detect` reads)
==============  =========  ==========  ===============  ====================================
qwen3           <think>    </think>    enable_thinking  Qwen3, SmolLM3: ``</think>`` and
                                       (default on)     ``enable_thinking``
deepseek-v3.1   <think>    </think>    thinking         DeepSeek-V3.1: ``</think>`` and
                                       (default off)    ``thinking is defined``
deepseek-r1     <think>    </think>    none             DeepSeek-R1 and its distills, QwQ:
                                                        ``</think>`` (the generation prompt
                                                        ends with ``<think>\\n``)
==============  =========  ==========  ===============  ====================================

Controls (``Model.chat/stream/batch``; :func:`reasoning_request` checks them):

- ``think=False``: no thinking. Where the template has a switch, it is rendered with the
  switch off (``enable_thinking=False``); where it has none, localrun writes an empty
  thinking block at the start of the reply (``<think>\\n\\n</think>\\n\\n``), as Qwen3's
  own template does. ``think=True`` turns the switch on (DeepSeek-V3.1 thinks only so).
- ``reasoning_effort``: "none" (no thinking), "minimal", "low", "medium", "high", mapped
  to thinking budgets by :data:`EFFORT_BUDGETS` ("high" has no budget of its own).
- ``thinking_budget=N``: at most N tokens of thinking. At N, localrun closes the thinking
  with the model's own end marker (:attr:`ReasoningFormat.close`) and the answer
  follows; 0 means no thinking. A budget given with an effort wins over the effort's.

One rule for ``max_tokens``: it bounds the whole reply, thinking and answer together
(OpenAI's ``max_completion_tokens`` and Anthropic's ``max_tokens`` both count the
thinking inside), so the answer gets what the thinking leaves. ``usage.completion_tokens``
counts both; ``usage.reasoning_tokens`` the thinking alone.

gpt-oss's channels (``<|channel|>analysis``) are not split: their markers are special
tokens that several engines do not show in the text.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from localrun.errors import InvalidSamplingError, LocalrunError

Effort = Literal["none", "minimal", "low", "medium", "high"]


class ThinkingUnavailableError(InvalidSamplingError):
    """Thinking asked (``think``, ``thinking_budget``, ``reasoning_effort``) where there is
    none: a model whose chat template does not think, or a raw prompt."""

    def __init__(self, option: str, value: object, reason: str):
        LocalrunError.__init__(
            self, f"{option}={value!r} asks for thinking, but {reason}",
            hint=f"leave {option} unset, or use a thinking model (Qwen3, DeepSeek-R1), or "
            "give the model a thinking chat template (chat_template=, --chat-template)")
        self.option, self.value, self.allowed = option, value, "unset"


#: What each effort level means as a thinking budget in tokens (None: no budget of its
#: own, only max_tokens; 0: no thinking). OpenAI's reasoning_effort and Ollama's
#: think="low"/"medium"/"high" map here.
EFFORT_BUDGETS: dict[str, int | None] = {
    "none": 0,
    "minimal": 256,
    "low": 1024,
    "medium": 4096,
    "high": None,
}


@dataclass(frozen=True)
class ReasoningFormat:
    """How one family of models marks its thinking."""

    name: str
    start: str  # what opens the thinking ("<think>")
    end: str  # what closes it ("</think>")
    switch: str | None  # the template variable that turns thinking on and off
    #: template text that identifies the format: every pattern (a regex) must match
    requires: tuple[str, ...]

    @property
    def close(self) -> str:
        """What localrun writes to close the thinking (at a budget), after the thinking
        with its trailing blanks removed: the blank lines the model's own template puts
        around the end marker."""
        return "\n" + self.end + "\n\n"

    @property
    def after(self) -> str:
        """What localrun writes after the model's own end marker when it starts the
        answer itself (a constrained answer)."""
        return "\n\n"

    @property
    def empty(self) -> str:
        """An empty thinking block, as Qwen3's template writes it when thinking is off."""
        return self.start + "\n\n" + self.end + "\n\n"


_THINK, _END = "<think>", "</think>"

#: Every format, in the order :func:`detect` tries them (most specific first).
FORMATS: dict[str, ReasoningFormat] = {
    "qwen3": ReasoningFormat("qwen3", _THINK, _END, "enable_thinking",
                             (re.escape(_END), r"\benable_thinking\b")),
    "deepseek-v3.1": ReasoningFormat("deepseek-v3.1", _THINK, _END, "thinking",
                                     (re.escape(_END), r"\bthinking\s+is\s+defined\b")),
    "deepseek-r1": ReasoningFormat("deepseek-r1", _THINK, _END, None, (re.escape(_END),)),
}


def detect(template: str | None) -> ReasoningFormat | None:
    """The reasoning format a chat template speaks, or None when it does not think."""
    if not template:
        return None
    for fmt in FORMATS.values():
        if all(re.search(p, template) for p in fmt.requires):
            return fmt
    return None


def by_name(name: str | None) -> ReasoningFormat | None:
    """A format by its name (the catalog's ``"reasoning"``); None for None."""
    if name is None:
        return None
    fmt = FORMATS.get(name)
    if fmt is None:
        raise ValueError(f"unknown reasoning format {name!r} (known: {', '.join(FORMATS)})")
    return fmt


@dataclass(frozen=True)
class ReasoningRequest:
    """What a call asked of a thinking model, checked: ``think`` None leaves it to the
    template's default; ``budget`` None means no budget beyond ``max_tokens``."""

    think: bool | None = None
    budget: int | None = None
    #: the option that decided it, and its value, for messages ("thinking_budget", 16)
    option: str = "think"
    value: object = None


BUDGET_ALLOWED = "an integer >= 0 (tokens of thinking; 0 = no thinking)"
THINK_ALLOWED = "True, False, or unset (the model's own default)"


def reasoning_request(think: object = None, reasoning_effort: object = None,
                      thinking_budget: object = None) -> ReasoningRequest | None:
    """The reasoning options of one call, checked (None: none given). A bad value raises
    :class:`~localrun.errors.InvalidSamplingError` naming the option."""
    if think is None and reasoning_effort is None and thinking_budget is None:
        return None
    if think is not None and not isinstance(think, bool):
        raise InvalidSamplingError("think", think, THINK_ALLOWED)
    if reasoning_effort is not None and reasoning_effort not in EFFORT_BUDGETS:
        raise InvalidSamplingError("reasoning_effort", reasoning_effort,
                                   ", ".join(repr(e) for e in EFFORT_BUDGETS))
    if thinking_budget is not None and (isinstance(thinking_budget, bool)
                                        or not isinstance(thinking_budget, int)
                                        or thinking_budget < 0):
        raise InvalidSamplingError("thinking_budget", thinking_budget, BUDGET_ALLOWED)
    budget: int | None = None
    option: str = "think"
    value: object = think
    if reasoning_effort is not None:
        option, value = "reasoning_effort", reasoning_effort
        budget = EFFORT_BUDGETS[str(reasoning_effort)]
    if thinking_budget is not None:
        option, value = "thinking_budget", thinking_budget
        budget = int(thinking_budget)
    wants = None if option == "think" else budget != 0
    if think is False and wants:
        raise InvalidSamplingError("think", False, f"True or unset with {option}={value!r}")
    if think is True and wants is False:
        raise InvalidSamplingError("think", True, f"False or unset with {option}={value!r}")
    on = think if think is not None else wants
    if think is True:
        option, value = ("think", True) if budget is None else (option, value)
    return ReasoningRequest(on, budget if on else None, option, value)


def refuse(asked: ReasoningRequest, why: str) -> ThinkingUnavailableError:
    """The error for asking to think where nothing can (``why``: the reason)."""
    return ThinkingUnavailableError(asked.option, asked.value, why)
