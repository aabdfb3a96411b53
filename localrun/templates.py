"""Chat templates for engines that have none of their own (llama.cpp, ExLlama).

Templates are the model's own Jinja (GGUF ``tokenizer.chat_template`` or
tokenizer_config.json), rendered in a sandbox the way transformers renders them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

from localrun.errors import ChatTemplateError, LocalrunError
from localrun.types import Message

#: Used only when a model ships no template at all.
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _raise(message: str) -> None:
    raise ChatTemplateError(message)  # render_chat adds the conversation's roles


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # transformers' tojson: Jinja's own sorts keys and escapes <, >, & for HTML, which
    # would change the tool schemas a template renders.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


@lru_cache(maxsize=16)
def _compile(source: str) -> Any:
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def check_template(source: str) -> None:
    """Raise ChatTemplateError if ``source`` is no Jinja template localrun can render."""
    try:
        _compile(source)
    except Exception as e:  # jinja2's TemplateSyntaxError
        raise ChatTemplateError(f"the chat template does not compile: {e}") from e


def render_chat(
    template: str | None,
    messages: Sequence[Message] | Sequence[Mapping[str, Any]],
    *,
    bos_token: str = "",
    eos_token: str = "",
    add_generation_prompt: bool = True,
    tools: Sequence[Mapping[str, Any]] | None = None,
    variables: Mapping[str, Any] | None = None,
) -> str:
    """Render ``messages`` with the model's template (ChatML when it has none).

    ``tools`` (OpenAI function dicts) go to templates that render them, as transformers'
    ``apply_chat_template(tools=...)`` passes them; ``variables`` are more template
    variables, as its other keyword arguments (``enable_thinking=False``).
    """
    extra: dict[str, Any] = dict(variables or {})
    if tools is not None:
        extra["tools"] = list(tools)
    try:
        return str(
            _compile(template or CHATML).render(
                messages=list(messages),
                bos_token=bos_token,
                eos_token=eos_token,
                add_generation_prompt=add_generation_prompt,
                **extra,
            )
        )
    except ChatTemplateError as e:  # the template's raise_exception
        raise ChatTemplateError(e.reason, messages) from None
    except Exception as e:  # jinja2's TemplateError, or e.g. a TypeError inside the template
        raise ChatTemplateError(str(e) or type(e).__name__, messages) from e


#: Message keys kept besides role, content and tool_calls (each a string), and what each is.
_STRING_KEYS = {
    "tool_call_id": "pass the id of the tool call this result answers (ToolCall.id)",
    "name": "pass the name of the tool whose result this is",
    # an earlier reply's thinking (Completion.reasoning): templates that show it in the
    # turn being built (Qwen3, between tool calls) read it
    "reasoning_content": "pass the thinking of that reply (Completion.reasoning), or leave "
                         "it out",
}


def normalize_messages(messages: object) -> list[Message]:
    """Accept a string or a list of {role, content} dicts; reject anything else clearly."""
    if isinstance(messages, str):
        return [{"role": "user", "content": messages}]
    if not isinstance(messages, (list, tuple)) or not messages:
        raise LocalrunError(
            "Messages must be a non-empty list of {'role', 'content'} dicts or a string",
            hint='e.g. model.chat([{"role": "user", "content": "Hi"}])',
        )
    out: list[Message] = []
    for i, m in enumerate(messages):
        calls = m.get("tool_calls") if isinstance(m, dict) else None
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(m, dict) and m.get("role") == "tool" and \
                isinstance(content, (dict, list)):
            content = json.dumps(content, ensure_ascii=False)  # a tool result as data
        images = None
        if isinstance(m, dict) and (isinstance(content, list) or m.get("images")):
            from localrun.images import normalized_content  # localrun reads each image

            content, images = normalized_content(i, content, m.get("images"))
        if (
            not isinstance(m, dict)
            or not isinstance(m.get("role"), str)
            or not (isinstance(content, str) or (content is None and calls))
        ):
            raise LocalrunError(
                f"Message {i} is not a {{'role': str, 'content': str}} dict: {m!r}"[:200],
                hint="every message needs a string 'role' (system/user/assistant/tool) and "
                "'content' (None only for an assistant turn with tool_calls)",
            )
        msg: Message = {"role": m["role"], "content": content}  # type: ignore[typeddict-item]
        if calls:
            msg["tool_calls"] = _tool_calls(i, calls)
        if images:
            msg["images"] = images
        for key, what in _STRING_KEYS.items():
            if key in m and not (key == "reasoning_content" and m[key] is None):
                if not isinstance(m[key], str):
                    raise LocalrunError(f"Message {i}: {key} must be a string, got {m[key]!r}",
                                        hint=what)
                msg[key] = m[key]  # type: ignore[literal-required]
        out.append(msg)
    return out


def _tool_calls(i: int, calls: object) -> list[dict[str, Any]]:
    """An assistant turn's tool calls in OpenAI's shape (ToolCall objects accepted)."""
    if not isinstance(calls, (list, tuple)):
        raise LocalrunError(f"Message {i}: tool_calls must be a list",
                            hint="pass completion.tool_calls (or their .to_dict())")
    out: list[dict[str, Any]] = []
    for c in calls:
        if hasattr(c, "to_dict"):
            c = c.to_dict()
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise LocalrunError(f"Message {i}: a tool call is not {{'id', 'function': "
                                f"{{'name', 'arguments'}}}}: {c!r}"[:200],
                                hint="pass completion.tool_calls (or their .to_dict())")
        out.append(dict(c))
    return out
