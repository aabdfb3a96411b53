"""What every dialect shares: the base of its request shapes, the 400 a shape's
validation error becomes, the library's one generation request (:class:`Generation`),
checked before any model loads, and the one way a generation is answered
(:func:`respond`: one JSON body, or a stream in the dialect's :class:`~localrun.server.jobs.Wire`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any, ClassVar, TypeVar

from pydantic import BaseModel, BeforeValidator, ConfigDict, ValidationError, model_validator

from localrun.server.errors import APIError, bad_request, unsupported
from localrun.server.params import read_json

T = TypeVar("T", bound=BaseModel)

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def _integral(value: Any) -> Any:
    """2.0 from a client that writes every number as a float is the integer 2."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**63:
        return int(value)
    return value


#: An integer field: JSON integers, and floats with no fraction (never a bool or "5").
Int = Annotated[int, BeforeValidator(_integral)]


class Refusal(ValueError):
    """Raised inside a shape's validation: a field it refuses (``kind``
    "unsupported_parameter": declared but not supported yet, or not declared) or a value
    of the right type it cannot take ("invalid_value"). ``field`` is the sub-field's name
    ("" for the part itself), joined to the part's path in the 400."""

    def __init__(self, kind: str, field: str, text: str) -> None:
        super().__init__(text)
        self.kind = kind
        self.field = field
        self.text = text


def refused(name: str, why: str) -> Refusal:
    """A field a shape declares but localrun does not honour (yet), or one it does not
    declare: it becomes "Unsupported parameter 'PATH.name': why"."""
    return Refusal("unsupported_parameter", name, why)


def invalid(message: str, name: str | None = None) -> Refusal:
    """A value of the right type that the field cannot take (400, code invalid_value)."""
    return Refusal("invalid_value", name or "", message)


def _schema(schema: dict[str, Any], cls: type) -> None:
    """A shape's JSON Schema says what it takes: the fields it accepts and ignores are
    listed, a field not supported yet takes only null (or its one accepted value), and
    (but for a :class:`Passed` part) no other field is allowed."""
    props = schema.setdefault("properties", {})
    for name in getattr(cls, "IGNORED", ()):
        props.setdefault(name, {"description": "accepted; changes nothing"})
    for name, (ok, why) in getattr(cls, "REFUSED", {}).items():
        takes: list[dict[str, Any]] = [{"type": "null"}]
        if ok is not None:
            takes.append({"type": "object", "maxProperties": 0} if ok == {} else
                         {"type": "array", "maxItems": 0} if ok == [] else {"const": ok})
        props[name] = {"anyOf": takes, "description": f"not supported yet: {why}"}
    if not (isinstance(cls, type) and issubclass(cls, Passed)):
        schema["additionalProperties"] = False


def takes_only(replacement: dict[str, Any]) -> Callable[[dict[str, Any]], None]:
    """A field's JSON Schema replaced by ``replacement``: what it accepts, where its type
    is wider so that what it refuses gets a 400 that says why (token arrays, images)."""
    def apply(schema: dict[str, Any]) -> None:
        schema.clear()
        schema.update(replacement)

    return apply


def never(schema: dict[str, Any], cls: type) -> None:
    """The JSON Schema of a part that is always refused (an image block): no value."""
    schema.clear()
    schema["not"] = {}
    schema["description"] = str(cls.__doc__ or "").strip()


class Shape(BaseModel):
    """A request shape, or a part of one, as a dialect declares it.

    Types are JSON's own (``"5"`` is no integer, ``1`` no boolean; numbers finite). A
    field it does not declare is refused with 400 naming it (:data:`UNKNOWN` gives the
    reason where there is one), unless it is null (clients send null for "unset") or
    listed in :data:`IGNORED` (accepted, no effect). :data:`REFUSED` lists declared
    fields localrun does not honour yet: each is refused unless null, empty or the one
    value it names (``n`` = 1) — the place a later feature turns one on is removing
    its row and reading the field.
    """

    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False,
                              protected_namespaces=(), populate_by_name=True,
                              json_schema_extra=_schema)

    IGNORED: ClassVar[tuple[str, ...]] = ()
    REFUSED: ClassVar[Mapping[str, tuple[Any, str]]] = {}
    UNKNOWN: ClassVar[Mapping[str, str]] = {}

    @model_validator(mode="after")
    def _refuse(self) -> Shape:
        self.refuse()
        return self

    def refuse(self) -> None:
        extra = self.model_extra or {}
        for name, (ok, why) in self.REFUSED.items():
            value = getattr(self, name) if name in type(self).model_fields else extra.get(name)
            if value is None or value == ok or (isinstance(ok, (list, dict)) and not value):
                continue
            raise refused(name, why)
        self.refuse_extra(extra)

    def refuse_extra(self, extra: Mapping[str, Any]) -> None:
        for key, value in extra.items():
            if value is None or key in self.IGNORED:
                continue
            raise refused(key, self.UNKNOWN.get(key, "localrun does not implement it"))


class Passed(Shape):
    """A part the library reads itself (a tool, a response_format): what it does not
    declare is kept and left to the library, as the library's own API takes it."""

    def refuse_extra(self, extra: Mapping[str, Any]) -> None:
        pass


async def parse(request: Any, shape: type[T]) -> T:
    """The body, read by :func:`~localrun.server.params.read_json` (size, depth, digits
    and text limits first), as ``shape``; a 400 naming the field otherwise."""
    body = await read_json(request)
    try:
        return shape.model_validate(body)
    except ValidationError as e:
        raise from_validation(e, body) from None


# -- validation errors -> one 400 ------------------------------------------------------

#: pydantic's error types that say "not of that type" (the rest: "not that value")
_TYPE_ERRORS = frozenset({
    "string_type", "int_type", "float_type", "bool_type", "list_type", "dict_type",
    "model_type", "model_attributes_type", "none_required", "int_from_float", "is_instance_of",
    "union_tag_not_found", "union_tag_invalid", "dataclass_type", "tuple_type"})


def _path(body: Any, loc: tuple[Any, ...], kind: str, extra: str = "") -> tuple[str, int]:
    """``loc`` as the client's field path (``messages[0].content``) and its depth:
    pydantic's labels for union members and validators, which are no field, left out."""
    out, depth, here = "", 0, body
    for i, part in enumerate(loc):
        if isinstance(part, int) and isinstance(here, list) and 0 <= part < len(here):
            out, here = f"{out}[{part}]", here[part]
        elif isinstance(part, str) and isinstance(here, dict) and (
                part in here or (kind == "missing" and i == len(loc) - 1)):
            out, here = (f"{out}.{part}" if out else part), here.get(part)
        else:
            continue
        depth += 1
    if extra:
        out, depth = (f"{out}.{extra}" if out else extra), depth + 1
    return out, depth


def _expected(message: str) -> str:
    return message.removeprefix("Input should be ").removeprefix("Input should ")


def from_validation(e: ValidationError, body: Any, names: Mapping[str, str] | None = None
                    ) -> APIError:
    """One 400 for a shape's validation errors: the deepest one (the union member that
    came closest), ours first, in words that name the field, what it takes and what it
    got. ``names`` renames paths (a field the dialect spells otherwise)."""
    errors = e.errors(include_url=False)
    rows = []
    for err in errors:
        ours = (err.get("ctx") or {}).get("error")
        ours = ours if isinstance(ours, Refusal) else None
        path, depth = _path(body, tuple(err["loc"]), err["type"], ours.field if ours else "")
        rows.append((depth, ours is not None, path, err, ours))
    depth, _, path, err, ours = max(rows, key=lambda r: (r[0], r[1]))
    path = (names or {}).get(path, path)
    kind = err["type"]
    shown = path or "the request body"
    if ours is not None and ours.kind == "unsupported_parameter":
        return unsupported(path, ours.text)
    if ours is not None:
        return bad_request(ours.text, path or None, code="invalid_value")
    if kind == "missing":
        return bad_request(f"Missing required parameter '{shown}'", path or None)
    got = _shown_value(err.get("input"))
    if kind in _TYPE_ERRORS:
        wants = []
        for d, _, p, other, _ in rows:  # a union: every member's expectation at this path
            if d == depth and p == path and other["type"] in _TYPE_ERRORS:
                want = _expected(other["msg"])
                if want not in wants:
                    wants.append(want)
        return bad_request(f"Invalid type for '{shown}': expected {' or '.join(wants)}, got "
                           f"{got}", path or None, code="invalid_type")
    return bad_request(f"Invalid '{shown}': {got} ({_expected(err['msg'])})", path or None,
                       code="invalid_value")


def _shown_value(value: Any) -> str:
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


# -- the one generation request ----------------------------------------------------------

@dataclass
class Generation:
    """The library's one generation request, as every dialect translates into it: a
    chat (``messages``) or a raw prompt (``prompt``: text, or token ids), the sampling
    options set (log probabilities and ``echo`` among them), the structured-output
    options (``response_format``/``tools``/``tool_choice``/``parallel_tool_calls``, as
    ``Model.stream`` takes them), the thinking options (``reasoning``: ``think``,
    ``reasoning_effort``, ``thinking_budget``), and how the model is held (``context``,
    ``keep_alive``). ``names`` maps the library's option names to the dialect's (for
    its errors: ``max_tokens`` is Ollama's ``options.num_predict``).

    Several replies in one request (OpenAI's ``n``, a list of prompts): ``prompts``
    holds the raw prompts and ``n`` the replies to each; they run together through the
    model's driver (:class:`~localrun.server.jobs.ChoiceRun`), choice ``i * n + j``
    being prompt ``i``'s ``j``-th, each with its own seed (the request's seed + its
    index, so that choice 0 is what ``n`` = 1 gives). ``whole`` streams each choice whole
    as it ends (the route's Wire writes it), not piece by piece."""

    model: str
    messages: list[dict[str, Any]] | None = None
    prompt: str | list[int] | None = None
    sampling: dict[str, Any] = field(default_factory=dict)
    structured: dict[str, Any] = field(default_factory=dict)
    reasoning: dict[str, Any] = field(default_factory=dict)
    stream: bool = False
    context: int | None = None
    keep_alive: Any = "default"
    fill: bool = False  # Ollama's num_predict < 0: as many tokens as the context holds
    names: Mapping[str, str] = field(default_factory=dict)
    prompts: list[str | list[int]] | None = None
    n: int = 1
    whole: bool = False

    @property
    def several(self) -> bool:
        """Whether it runs as several choices (:class:`~localrun.server.jobs.ChoiceRun`)."""
        return self.n > 1 or self.prompts is not None or self.whole

    def check(self) -> Generation:
        """Everything the library would refuse, refused now, before any model loads: the
        sampling values, the thinking options, the tools' and response format's JSON
        Schemas (compiled as the engine will compile them), the messages."""
        from localrun.errors import LocalrunError
        from localrun.server.errors import from_localrun
        from localrun.server.params import check_sampling
        from localrun.templates import normalize_messages

        check_sampling(self.sampling, self.names)
        check_reasoning(self.reasoning, self.names)
        check_structured(self.structured, self.names)
        from localrun.server.imagefetch import has_image_urls

        if self.messages is not None and not has_image_urls(self.messages):  # else: later
            try:  # kept normalized: each image is decoded here once, not again by the model
                self.messages = normalize_messages(self.messages)  # type: ignore[assignment]
            except LocalrunError as e:
                raise from_localrun(e, param=self.names.get("messages", "messages")) from None
        return self

    def call(self, handle: Any, token: Any) -> Any:
        """Start it on a loaded model (a worker thread): a ``localrun.Stream``, or a
        :class:`~localrun.server.jobs.ChoiceRun` for several choices."""
        sampling = self.sampling
        if self.fill:
            sampling = {**sampling, "max_tokens": handle.info.context_length}
        if self.several:
            return self._choices(handle, token, sampling)
        if self.messages is not None:
            return handle.stream(self.messages, cancel=token, **self.structured,
                                 **self.reasoning, **sampling)
        return handle.stream(self.prompt or "", raw=True, cancel=token, **self.structured,
                             **self.reasoning, **sampling)

    def _choices(self, handle: Any, token: Any, sampling: dict[str, Any]) -> Any:
        from localrun.batch import BatchItem
        from localrun.sampling import MAX_SEED
        from localrun.server.jobs import ChoiceRun

        sampling = dict(sampling)
        seed = sampling.pop("seed", None)
        inputs: list[Any] = list(self.prompts) if self.prompts is not None else [
            self.messages if self.messages is not None else self.prompt]
        raw = self.messages is None
        items = []
        for value in inputs:
            for j in range(self.n):
                own = {} if seed is None else {"seed": (seed + j) % (MAX_SEED + 1)}
                items.append(BatchItem(value, own, raw=raw))
        return ChoiceRun(handle, items, token, self.n, **self.structured, **self.reasoning,
                         **sampling)


def check_reasoning(reasoning: Mapping[str, Any], names: Mapping[str, str]) -> None:
    """The library's own check of ``think``/``reasoning_effort``/``thinking_budget``,
    with the field named in the dialect's words (Anthropic's ``thinking.budget_tokens``)."""
    if not reasoning:
        return
    from localrun.errors import InvalidSamplingError
    from localrun.reasoning import reasoning_request
    from localrun.server.errors import from_localrun

    try:
        reasoning_request(**reasoning)
    except InvalidSamplingError as e:
        param = names.get(e.option, e.option)
        error = from_localrun(e, param=param)
        error.message = f"Invalid '{param}': {error.message}"
        raise error from None


def check_structured(structured: Mapping[str, Any], names: Mapping[str, str]) -> None:
    """The library's own check of ``response_format``/``tools``/``tool_choice``
    (:func:`localrun.structured.output.prepare`: shapes, names, each JSON Schema compiled
    by llguidance), with the field the error is about named in the dialect's words."""
    if not structured:
        return
    from localrun.errors import LocalrunError
    from localrun.server.errors import from_localrun
    from localrun.structured.output import prepare

    try:
        prepare(**structured)
    except LocalrunError as e:
        param = "tools"
        rf = structured.get("response_format")
        if rf is not None and _refuses(prepare, rf):
            param = "response_format"
        elif "tool_choice" in e.message and "tools[" not in e.message:
            param = "tool_choice"
        param = names.get(param, param)
        error = from_localrun(e, param=param)
        # named in the message too: not every dialect's error shape has a param field
        error.message = f"Invalid '{param}': {error.message}"
        raise error from None


def _refuses(prepare: Callable[..., Any], response_format: Any) -> bool:
    from localrun.errors import LocalrunError

    try:
        prepare(response_format=response_format)
    except LocalrunError:
        return True
    return False


# -- answering ---------------------------------------------------------------------------

def renamed(error: Any, names: Mapping[str, str]) -> Any:
    """``error`` (an APIError) about one of the library's options (``thinking_budget``,
    ``top_logprobs``) found once the model is known, naming the dialect's field instead
    (Anthropic's ``thinking.budget_tokens``, legacy Completions' ``logprobs``)."""
    name = names.get(error.param or "")
    if name and name != error.param:
        error.param = name
        error.message = f"Invalid '{name}': {error.message}"
    return error


def dump(value: Any) -> Any:
    """A response model as the JSON it sends (only the fields it was given)."""
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json", exclude_unset=True)
    return value


def event_json(value: BaseModel) -> str:
    return value.model_dump_json(exclude_unset=True)


async def respond(request: Any, endpoint: str, gen: Generation,
                  wire: Callable[[Any], Any], whole: Callable[[Any, Any], Any], *,
                  media_type: str = "text/event-stream") -> Any:
    """Run ``gen`` (loading its model if need be) and answer: a stream of
    ``wire(job)``'s bytes, or one JSON object ``whole(job, completion)``. A failure
    before the first token is the answer's status; after it, the wire's error event."""
    from fastapi.responses import JSONResponse, StreamingResponse

    from localrun.server.imagefetch import fetch_image_urls, has_image_urls
    from localrun.server.jobs import Job
    from localrun.server.state import state_of

    if has_image_urls(gen.messages):  # fetched here, or refused: the library never fetches
        assert gen.messages is not None
        gen.messages = await fetch_image_urls(
            gen.messages, state_of(request).config.allow_image_urls,
            gen.names.get("messages", "messages"))
    try:
        job, first = await Job.generate(request, endpoint, gen.model, gen.call,
                                        context=gen.context, keep_alive=gen.keep_alive,
                                        stream=gen.stream)
    except APIError as e:  # an option the model or engine lacks, named as the dialect does
        raise renamed(e, gen.names) from None
    if gen.stream:
        headers = SSE_HEADERS if media_type == "text/event-stream" else None
        return StreamingResponse(job.pump(first, wire(job)), media_type=media_type,
                                 headers=headers)
    completion = await job.collect(first)
    return JSONResponse(dump(whole(job, completion)))
