"""OpenAI's request shapes: Chat Completions, Completions, Embeddings — checked, then
translated into a :class:`~.common.Generation`. The answers, the streams' chunks and
their :class:`~localrun.server.jobs.Wire` s are in :mod:`.openai_out` (and named here too).

Beyond the reference: thinking models (``reasoning_effort``; vLLM's
``chat_template_kwargs.enable_thinking``; DashScope's ``enable_thinking`` and
``thinking_budget``; an earlier turn's ``reasoning_content`` passed back to the
template), log probabilities (``logprobs``/``top_logprobs``; legacy ``logprobs: k`` and
``echo``), token-array prompts, lists of prompts and ``n`` (at most :data:`MAX_N`
replies per prompt, :data:`MAX_CHOICES` per request).
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import Discriminator, Field, Tag

from localrun.server.errors import bad_request
from localrun.server.protocol.common import (
    Generation,
    Int,
    Passed,
    Shape,
    invalid,
    refused,
    takes_only,
)
from localrun.server.protocol.images import OpenAIImagePart
from localrun.server.protocol.openai_out import (
    FINGERPRINT,
    FINISH,
    ChatCompletion,
    ChatCompletionChunk,
    ChatSSE,
    EmbeddingData,
    EmbeddingList,
    EmbeddingUsage,
    ModelEntry,
    ModelList,
    TextCompletion,
    TextSSE,
    chat_completion,
    text_completion,
)
from localrun.types import MAX_TOP_LOGPROBS

#: this dialect's answers (:mod:`.openai_out`), named here too
__all__ = ["FINGERPRINT", "FINISH", "ChatCompletion", "ChatCompletionChunk", "ChatSSE",
           "EmbeddingData", "EmbeddingList", "EmbeddingUsage", "ModelEntry", "ModelList",
           "TextCompletion", "TextSSE", "chat_completion", "text_completion"]
PENALTY = "use repetition_penalty (localrun's, the same on every engine)"
#: Most replies one request may ask for per prompt (``n``), and in all (prompts × ``n``).
#: Each is a whole sequence: they run at most the model's concurrency at once, the rest
#: waiting inside the request, which holds its place and every finished choice (with
#: its log probabilities) until the last ends. 16 covers sampling several answers to
#: pick from; 64 an evaluation harness's batch (lm-eval's ``batch_size``).
MAX_N = 16
MAX_CHOICES = 64
#: what an embedding input takes (token arrays are refused, saying so)
TEXT = {"type": "string", "minLength": 1}
TEXT_INPUTS = {"anyOf": [TEXT, {"type": "array", "items": TEXT, "minItems": 1}]}
_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
#: what /v1/completions' prompt takes: text, token ids, or a list of either
PROMPTS = {"anyOf": [TEXT, _IDS,
                     {"type": "array", "items": TEXT, "minItems": 1, "maxItems": MAX_CHOICES},
                     {"type": "array", "items": _IDS, "minItems": 1, "maxItems": MAX_CHOICES}]}


# -- requests ------------------------------------------------------------------------------

class StreamOptions(Shape):
    include_usage: bool | None = None


class FunctionCall(Passed):
    name: str
    arguments: str | dict[str, Any] | None = None


class ToolCallParam(Passed):
    """A tool call of an earlier assistant turn, sent back."""

    id: str | None = None
    type: str | None = None
    function: FunctionCall


class ContentPart(Shape):
    """A text part of a message's content (image parts: :class:`OpenAIImagePart`)."""

    type: str = Field(json_schema_extra=takes_only({"const": "text"}))
    text: str | None = Field(default=None, json_schema_extra=takes_only({"type": "string"}))

    def refuse(self) -> None:
        if self.type != "text":
            raise refused("", f"content parts of type {self.type!r} (localrun takes text and "
                          "image_url parts)")
        if self.text is None:
            raise invalid("a text part needs 'text' (a string)", "text")
        super().refuse()


def _part_tag(value: Any) -> str:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return "image_url" if kind == "image_url" else "text"


Part = Annotated[Annotated[ContentPart, Tag("text")]
                 | Annotated[OpenAIImagePart, Tag("image_url")], Discriminator(_part_tag)]


class ChatMessage(Shape):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[Part] | None = None
    tool_calls: list[ToolCallParam] | None = None
    tool_call_id: str | None = None
    name: str | None = None
    refusal: str | None = None
    #: an earlier reply's thinking, as vLLM and DeepSeek return it (``reasoning``: the
    #: newer spelling): given to the chat template, which shows or drops it
    reasoning_content: str | None = None
    reasoning: str | None = None

    REFUSED: ClassVar = {"refusal": (None, "a refusal cannot be sent back")}

    def refuse(self) -> None:
        super().refuse()
        if self.content is None and not self.tool_calls:
            raise invalid("'content' is missing (only an assistant turn with tool_calls may "
                          "omit it)", "content")

    def to_library(self) -> dict[str, Any]:
        content: Any = self.content
        if isinstance(content, list) and any(isinstance(p, OpenAIImagePart) for p in content):
            content = [p.to_library() if isinstance(p, OpenAIImagePart) else
                       {"type": "text", "text": p.text or ""} for p in content]
        elif isinstance(content, list):
            content = "".join(p.text or "" for p in content if isinstance(p, ContentPart))
        msg: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role,
                               "content": content}
        if self.tool_calls:
            msg["tool_calls"] = [c.model_dump(exclude_none=True) for c in self.tool_calls]
        for key in ("tool_call_id", "name"):
            value = getattr(self, key)
            if value is not None:
                msg[key] = value
        thought = self.reasoning_content if self.reasoning_content is not None \
            else self.reasoning
        if thought is not None and self.role == "assistant":
            msg["reasoning_content"] = thought
        return msg


class FunctionDef(Passed):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolParam(Passed):
    type: str = "function"
    function: FunctionDef | None = None


class NamedFunction(Passed):
    name: str


class ToolChoiceParam(Passed):
    type: str = "function"
    function: NamedFunction | None = None


class JSONSchemaSpec(Passed):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(Passed):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaSpec | None = None
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")


class LoraEntry(Shape):
    """One entry of llama-server's per-request ``lora``: a loaded adapter, by its index
    (``id``, in load order) or ``name``, and its ``scale`` (unset: its load-time one)."""

    id: Int | None = Field(default=None, ge=0)
    name: str | None = None
    scale: float | None = None


class Sampled(Shape):
    """The fields Chat Completions and Completions share."""

    model: str
    max_tokens: Int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    seed: Int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    n: Int | None = Field(default=None, ge=1)
    logit_bias: dict[str, Any] | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    store: bool | None = None
    service_tier: str | None = None
    user: str | None = None
    metadata: dict[str, Any] | None = None
    #: the LoRA adapters this reply runs under (llama-server's field): replaces the set
    #: the model loaded with, adapters not listed are off, [] is the base model
    lora: list[LoraEntry] | None = None

    #: OpenAI's bookkeeping, as ``user`` and ``metadata``: accepted, no effect
    IGNORED: ClassVar = ("prompt_cache_key", "safety_identifier")
    REFUSED: ClassVar = {
        "logit_bias": ({}, "logit bias is not implemented"),
        "frequency_penalty": (0, PENALTY), "presence_penalty": (0, PENALTY),
        "store": (False, "localrun keeps no record of requests")}

    def refuse(self) -> None:
        super().refuse()
        if self.service_tier not in (None, "auto", "default"):
            raise refused("service_tier", "localrun has one tier: send auto or default")
        if self.stream_options is not None and not self.stream:
            raise invalid("'stream_options' is only allowed when 'stream' is true",
                          "stream_options")
        if self.n is not None and self.n > MAX_N:
            raise invalid(f"n={self.n} asks for {self.n} replies; localrun makes at most "
                          f"{MAX_N} per prompt in one request (each is a whole sequence of "
                          f"the model's): send n <= {MAX_N}, or several requests", "n")

    def sampling(self, max_tokens: int | None = None) -> dict[str, Any]:
        stop = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        out = {"max_tokens": self.max_tokens if max_tokens is None else max_tokens,
               "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
               "min_p": self.min_p, "repetition_penalty": self.repetition_penalty,
               "seed": self.seed, "stop": tuple(s for s in stop if s) or None,
               "adapters": None if self.lora is None else [
                   e.model_dump(exclude_none=True) for e in self.lora]}
        return {k: v for k, v in out.items() if v is not None}

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class TemplateKwargs(Shape):
    """vLLM's and SGLang's ``chat_template_kwargs``: the thinking switch alone (the chat
    template's other variables are localrun's to set)."""

    enable_thinking: bool | None = None

    UNKNOWN: ClassVar = {"thinking": "send enable_thinking (localrun sets the switch each "
                         "template names, DeepSeek-V3.1's thinking too)"}


class ChatCompletionRequest(Sampled):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Int | None = Field(default=None, ge=1)
    response_format: ResponseFormat | None = None
    tools: list[ToolParam] | None = None
    tool_choice: str | ToolChoiceParam | None = None
    parallel_tool_calls: bool | None = None
    logprobs: bool | None = None
    top_logprobs: Int | None = None
    reasoning_effort: str | None = None
    chat_template_kwargs: TemplateKwargs | None = None
    enable_thinking: bool | None = None
    thinking_budget: Int | None = None

    def refuse(self) -> None:
        super().refuse()
        kwargs = self.chat_template_kwargs
        switch = kwargs.enable_thinking if kwargs is not None else None
        if switch is not None and self.enable_thinking is not None \
                and switch != self.enable_thinking:
            raise invalid(f"'enable_thinking' is {str(self.enable_thinking).lower()} but "
                          f"'chat_template_kwargs.enable_thinking' is "
                          f"{str(switch).lower()}: send one", "enable_thinking")

    def thinking(self) -> tuple[dict[str, Any], dict[str, str]]:
        """The thinking options (``think``, ``reasoning_effort``, ``thinking_budget``) and
        the names of the fields they came from."""
        kwargs = self.chat_template_kwargs
        switch = kwargs.enable_thinking if kwargs is not None else None
        names = {"think": "chat_template_kwargs.enable_thinking"}
        if switch is None and self.enable_thinking is not None:
            switch, names = self.enable_thinking, {"think": "enable_thinking"}
        out = {"think": switch, "reasoning_effort": self.reasoning_effort,
               "thinking_budget": self.thinking_budget}
        return {k: v for k, v in out.items() if v is not None}, names

    def generation(self) -> Generation:
        legacy, new = self.max_tokens, self.max_completion_tokens
        if legacy is not None and new is not None and legacy != new:
            raise bad_request("Both 'max_tokens' and 'max_completion_tokens' are set, to "
                              f"{legacy} and {new}: send one", "max_tokens")
        structured: dict[str, Any] = {}
        if self.response_format is not None and self.response_format.type != "text":
            structured["response_format"] = self.response_format.model_dump(
                by_alias=True, exclude_none=True)
        if self.tools:
            structured["tools"] = [t.model_dump(exclude_none=True) for t in self.tools]
        if self.tool_choice is not None:
            structured["tool_choice"] = self.tool_choice if isinstance(
                self.tool_choice, str) else self.tool_choice.model_dump(exclude_none=True)
        if self.parallel_tool_calls is not None:
            structured["parallel_tool_calls"] = self.parallel_tool_calls
        sampling = self.sampling(new if new is not None else legacy)
        if self.logprobs is not None:
            sampling["logprobs"] = self.logprobs
        if self.top_logprobs is not None:
            sampling["top_logprobs"] = self.top_logprobs
        reasoning, names = self.thinking()
        if new is not None:
            names["max_tokens"] = "max_completion_tokens"
        names["adapters"] = "lora"
        return Generation(self.model, messages=[m.to_library() for m in self.messages],
                          sampling=sampling, structured=structured, reasoning=reasoning,
                          stream=bool(self.stream), n=self.n or 1, names=names).check()


class CompletionRequest(Sampled):
    """``POST /v1/completions``: ``prompt`` is text, token ids, or a list of either (one
    choice each, ``n`` per prompt); ``logprobs: k`` gives each token's log probability and
    the ``k`` most likely at each position (``logprobs: 0``, the chosen tokens' alone);
    ``echo`` puts the prompt before the reply, with its tokens' log probabilities
    (``max_tokens: 0`` with ``echo`` scores the prompt alone)."""

    max_tokens: Int | None = Field(default=None, ge=0)
    prompt: str | list[str] | list[Int] | list[list[Int]] = Field(
        json_schema_extra=takes_only(PROMPTS))
    echo: bool | None = None
    best_of: Int | None = None
    suffix: str | None = None
    logprobs: Int | None = Field(default=None, ge=0)

    REFUSED: ClassVar = {
        **Sampled.REFUSED,
        "best_of": (1, "localrun does not rank replies: ask for n replies and pick one"),
        "suffix": ("", "fill-in-the-middle is not implemented")}

    def refuse(self) -> None:
        super().refuse()
        if self.logprobs is not None and self.logprobs > MAX_TOP_LOGPROBS:
            raise invalid(f"logprobs={self.logprobs}: at most {MAX_TOP_LOGPROBS} most "
                          f"likely tokens per position (send 0 to {MAX_TOP_LOGPROBS})",
                          "logprobs")

    def prompts(self) -> list[str | list[int]]:
        """The prompts, each text or token ids; a 400 naming the empty one."""
        value = self.prompt
        if isinstance(value, str) or (value and isinstance(value[0], int)):
            items: list[Any] = [value]
            where: list[str] = ["prompt"]
        else:
            items = list(value)
            where = [f"prompt[{i}]" for i in range(len(items))]
            if not items:
                raise bad_request("'prompt' is an empty list: send a prompt (text or token "
                                  "ids), or a list of them", "prompt")
        for item, name in zip(items, where, strict=True):
            if not item:
                raise bad_request(f"'{name}' is empty: send text or token ids", name)
        n = self.n or 1
        if len(items) * n > MAX_CHOICES:
            param = "prompt" if len(items) > MAX_CHOICES or n == 1 else "n"
            raise bad_request(f"{len(items)} prompts × n={n} asks for {len(items) * n} "
                              f"replies; localrun makes at most {MAX_CHOICES} in one request: "
                              f"send fewer prompts per request (lm-eval: a smaller "
                              f"batch_size)", param, code="invalid_value")
        return items

    def generation(self) -> Generation:
        prompts = self.prompts()
        sampling = self.sampling()
        if self.logprobs is not None:
            sampling.update(logprobs=True, top_logprobs=self.logprobs)
        if self.echo:
            sampling["echo"] = True
        whole = bool(self.stream and self.echo)  # the prompt's logprobs come at its end
        return Generation(self.model, prompt=prompts[0],
                          prompts=prompts if len(prompts) > 1 else None, n=self.n or 1,
                          whole=whole, sampling=sampling, stream=bool(self.stream),
                          names={"top_logprobs": "logprobs", "adapters": "lora"}).check()


class EmbeddingRequest(Shape):
    """``POST /v1/embeddings``."""

    model: str
    input: str | list[str] | list[Int] | list[list[Int]] = Field(
        json_schema_extra=takes_only(TEXT_INPUTS))
    encoding_format: Literal["float", "base64"] | None = None
    dimensions: Int | None = Field(default=None, ge=1)
    user: str | None = None


