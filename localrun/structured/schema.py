"""``response_format=`` and ``schema=``: what the reply must be, as one JSON Schema.

Accepted shapes (OpenAI's, and the common variants of other servers)::

    response_format={"type": "text"}                                   # no constraint
    response_format={"type": "json_object"}                            # any JSON object
    response_format={"type": "json_object", "schema": {...}}           # llama.cpp's variant
    response_format={"type": "json_schema",
                     "json_schema": {"name": "person", "schema": {...}, "strict": True}}
    response_format=Person             # a pydantic model class (as openai's .parse() takes)
    schema={...}                       # a JSON Schema dict
    schema=Person                      # a pydantic model class: the reply's ``parsed`` is a Person

``strict`` is accepted and changes nothing: localrun always enforces the schema.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from localrun.errors import InvalidToolError, StructuredOutputError

RESPONSE_FORMAT_HELP = ('response_format={"type": "json_object"} or {"type": "json_schema", '
                        '"json_schema": {"name": ..., "schema": {...}}}, or schema=dict or '
                        'a pydantic model class')


def is_pydantic_model(obj: object) -> bool:
    """A pydantic (v2) model class, recognised without importing pydantic."""
    return isinstance(obj, type) and callable(getattr(obj, "model_json_schema", None)) \
        and callable(getattr(obj, "model_validate_json", None))


@dataclass(frozen=True)
class OutputSpec:
    """The reply is one JSON value matching ``schema``; ``model`` (a pydantic class)
    parses it when given."""

    schema: dict[str, Any]
    name: str
    model: Any = None  # pydantic model class, or None: json.loads

    @property
    def label(self) -> str:
        return f"JSON Schema {self.name!r}"

    def parse(self, text: str) -> Any:
        """The reply as Python data (or a ``model`` instance); StructuredOutputError when
        it does not parse (the reply was cut short) or the model's validators refuse it."""
        if self.model is not None:
            try:
                return self.model.model_validate_json(text)
            except Exception as e:  # pydantic.ValidationError, without importing pydantic
                raise StructuredOutputError(
                    f"The reply does not validate as {self.model.__name__}: "
                    f"{str(e).strip().splitlines()[0][:300]}",
                    hint="the grammar enforces the JSON Schema; pydantic validators beyond "
                    "it (custom checks) can still refuse a reply: ask again or relax them"
                ) from e
        return json.loads(text)


_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")
_SUBSCHEMAS = ("items", "additionalProperties", "not", "if", "then", "else", "contains")


def closed_objects(schema: Any) -> Any:
    """``schema`` with ``additionalProperties: false`` on every object that lists its
    ``properties`` and says nothing about others.

    JSON Schema allows unlisted properties by default; a small model sampling freely then
    invents some (seen here: a ``country`` and a ``state`` in a ``Person``). OpenAI's
    strict mode and XGrammar (OpenVINO) close such objects; so does localrun, on every
    engine. An object schema without ``properties`` (``{"type": "object"}``) stays open.
    """
    if isinstance(schema, list):
        return [closed_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {k: closed_objects(v) for k, v in out[key].items()}
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed_objects(v) for v in out[key]]
    for key in _SUBSCHEMAS:
        if isinstance(out.get(key), dict):
            out[key] = closed_objects(out[key])
    if isinstance(out.get("properties"), dict) and "additionalProperties" not in out \
            and "patternProperties" not in out:
        out["additionalProperties"] = False
    return out


#: How deep a schema's objects and arrays may nest (each object level of ``properties``
#: is two: the schema and its ``properties``). Real schemas nest a few levels (OpenAI
#: allows 10 object levels); what reads a schema (closed_objects, the grammar
#: compilers) recurses per level, and Python stops near 1000.
MAX_SCHEMA_DEPTH = 64


def schema_depth(schema: object, limit: int = MAX_SCHEMA_DEPTH) -> int:
    """How deep ``schema``'s dicts and lists nest (1 for a flat dict), counted without
    recursion and only up to ``limit + 1``: the answer past the limit is ``limit + 1``."""
    deepest = 0
    stack: list[tuple[object, int]] = [(schema, 1)]
    while stack:
        value, depth = stack.pop()
        if not isinstance(value, (Mapping, list, tuple)):
            continue
        deepest = max(deepest, depth)
        if depth > limit:
            return depth
        children = value.values() if isinstance(value, Mapping) else value
        stack.extend((v, depth + 1) for v in children)
    return deepest


def _check_schema_shape(schema: object, where: str) -> dict[str, Any]:
    if schema is True:  # JSON Schema's "anything"
        return {}
    if not isinstance(schema, Mapping):
        raise InvalidToolError(f"{where} must be a JSON Schema dict, got "
                               f"{type(schema).__name__}", hint=RESPONSE_FORMAT_HELP)
    if schema_depth(schema) > MAX_SCHEMA_DEPTH:
        raise InvalidToolError(
            f"{where} is nested deeper than {MAX_SCHEMA_DEPTH} levels of objects and arrays "
            f"(each object's 'properties' is one)",
            hint="flatten the schema: move repeated parts into $defs and refer to them with "
            "$ref, or validate the deepest parts yourself")
    try:
        return dict(closed_objects(json.loads(json.dumps(schema))))
    except (TypeError, ValueError) as e:
        raise InvalidToolError(f"{where} is not JSON-serializable: {e}",
                               hint=RESPONSE_FORMAT_HELP) from e


def _from_model(model: Any) -> OutputSpec:
    schema = model.model_json_schema()
    return OutputSpec(_check_schema_shape(schema, model.__name__), model.__name__, model)


def output_spec(response_format: object = None, schema: object = None) -> OutputSpec | None:
    """Normalise ``response_format``/``schema`` (None: free text)."""
    if response_format is not None and schema is not None:
        raise InvalidToolError("Pass response_format= or schema=, not both",
                               hint="schema=X is the shortcut for a json_schema "
                               "response_format")
    if schema is not None:
        if is_pydantic_model(schema):
            return _from_model(schema)
        return OutputSpec(_check_schema_shape(schema, "schema"), "schema")
    rf = response_format
    if rf is None:
        return None
    if is_pydantic_model(rf):
        return _from_model(rf)
    if not isinstance(rf, Mapping) or not isinstance(rf.get("type"), str):
        raise InvalidToolError(f"Unknown response_format {rf!r}"[:200], hint=RESPONSE_FORMAT_HELP)
    kind = rf["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        inner = rf.get("schema")
        if inner is not None:
            return OutputSpec(_check_schema_shape(inner, "response_format.schema"), "schema")
        return OutputSpec({"type": "object"}, "json_object")
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, Mapping):
            # some clients put the schema next to type, as llama-server accepts
            if "schema" in rf:
                js = {"name": rf.get("name", "schema"), "schema": rf["schema"]}
            else:
                raise InvalidToolError("response_format json_schema needs a json_schema "
                                       "object with a schema", hint=RESPONSE_FORMAT_HELP)
        if "schema" not in js:
            raise InvalidToolError("response_format.json_schema has no schema",
                                   hint=RESPONSE_FORMAT_HELP)
        name = js.get("name") if isinstance(js.get("name"), str) else "schema"
        return OutputSpec(_check_schema_shape(js["schema"], "response_format.json_schema"
                                              ".schema"), str(name))
    raise InvalidToolError(f"Unknown response_format type {kind!r}",
                           hint="use 'text', 'json_object' or 'json_schema'")
