"""A request's prompt tokens: the engine's chat rendering or localrun's, a forced call's
prefill or the caller's (a conversation that ends with an assistant message), images
where their markers are; or the caller's own token ids."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from localrun.backends.base import Prompt, Session
from localrun.driver.reasoning import ChatSetup
from localrun.errors import LocalrunError, StructuredOutputError, UnsupportedFeatureError
from localrun.images import message_images
from localrun.structured.output import PreparedChat, StructuredRequest
from localrun.types import Message


def assistant_prefill(messages: list[Message] | None) -> tuple[list[Message] | None, str]:
    """A conversation that ends with an assistant message of text (no tool calls, no
    images): the messages before it, and that text, which the reply continues (the
    assistant prefill of Anthropic's Messages API, llama-server and Ollama). Any other
    conversation: itself, and "". An empty final assistant message is dropped."""
    if not messages:
        return messages, ""
    last = messages[-1]
    content = last.get("content")
    if last.get("role") != "assistant" or last.get("tool_calls") or last.get("images") \
            or not isinstance(content, str):
        return messages, ""
    return messages[:-1], content


def check_prefill(session: Session, prefix: str, structured: StructuredRequest | None,
                  chat: ChatSetup | None) -> None:
    """Refuse, before anything runs, what an assistant prefill cannot be combined with."""
    if not prefix:
        return
    if structured is not None:
        raise LocalrunError("The conversation ends with an assistant message (a prefill) "
                            "and asks for a schema or tools: a constrained reply starts "
                            "at its first token, not halfway",
                            hint="end the conversation with a user message, or drop "
                            "schema/response_format/tools")
    if chat is not None and chat.reasoning is not None:
        raise LocalrunError("The conversation ends with an assistant message (a prefill) "
                            f"for a thinking model ({session.info.name}): its reply "
                            "opens with a thinking block the prefill would have to follow",
                            hint="end the conversation with a user message")


def encode_prompt(session: Session, messages: list[Message] | None, text: str | None,
                  plan: PreparedChat | None, tokens: Sequence[int] | None = None,
                  chat: ChatSetup | None = None, prefix: str = "") -> Prompt:
    """The prompt tokens of one request: the engine's own chat rendering, or localrun's
    (a conversation with tools, or a chat template the caller gave), plus the
    assistant-turn prefill of a forced call, or the caller's (``prefix``: the text of
    the final assistant message that :func:`assistant_prefill` took off ``messages``);
    or the caller's own token ids, as they are. A conversation's images join the prompt
    where their markers are (the engine's)."""
    images = message_images(messages)
    if images and not session.accepts_images:
        session.attach_images(Prompt(()), images)  # raises: no vision path, nothing ran
    prompt = _encode_prompt(session, messages, text, plan, tokens, chat, prefix)
    return session.attach_images(prompt, images) if images else prompt


def _encode_prompt(session: Session, messages: list[Message] | None, text: str | None,
                   plan: PreparedChat | None, tokens: Sequence[int] | None = None,
                   chat: ChatSetup | None = None, prefix: str = "") -> Prompt:
    if tokens is not None:
        return session.encode_ids(tokens)
    if messages is None:
        return session.encode_text(text or "")
    if chat is not None and chat.override and (plan is None or not plan.render_here):
        msgs = plan.messages if plan is not None else messages
        return session.encode_rendered(render(session, chat, msgs, plan)
                                       + (plan.prefill if plan is not None else "") + prefix)
    if plan is None and not prefix:
        return session.encode_chat(messages)
    if plan is not None and plan.render_here:
        return session.encode_rendered(render(session, chat, plan.messages, plan)
                                       + plan.prefill + prefix)
    prompt = session.encode_chat(plan.messages if plan is not None  # type: ignore[arg-type]
                                 else messages)
    start = (plan.prefill if plan is not None else "") + prefix
    if start:
        if prompt.text is None:
            if prefix:
                raise UnsupportedFeatureError(
                    session.info.backend, "an assistant prefill",
                    "the engine renders the conversation itself and gives localrun no "
                    "text to continue (end the conversation with a user message)",
                    supported_by=("llama.cpp", "openvino", "onnx", "mlx"))
            raise StructuredOutputError(f"{session.info.backend} gave no rendered prompt to "
                                        "start a forced tool call from",
                                        hint="use tool_choice='auto'")
        return session.encode_rendered(prompt.text + start)
    return prompt


def render(session: Session, chat: ChatSetup | None, messages: Sequence[Any],
           plan: PreparedChat | None) -> str:
    """A conversation rendered by localrun with the model's template (or the caller's)."""
    from localrun.templates import render_chat

    return render_chat(chat.template if chat is not None else session.chat_template,
                       messages, bos_token=session.bos_token, eos_token=session.eos_token,
                       tools=plan.template_tools if plan is not None else None)
