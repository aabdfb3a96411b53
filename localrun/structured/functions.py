"""``tools=`` and ``tool_choice=``: tools as OpenAI function dicts, Python functions or
pydantic models, normalised to one :class:`Tool` each.

A Python function becomes a tool from its signature, type hints and docstring::

    def get_weather(city: str, unit: Literal["C", "F"] = "C") -> str:
        '''Current weather in a city.

        Args:
            city: The city, e.g. "Oslo".
            unit: Celsius or Fahrenheit.
        '''

gives ``{"name": "get_weather", "description": "Current weather in a city.",
"parameters": {"type": "object", "properties": {"city": {"type": "string",
"description": "The city, e.g. \\"Oslo\\"."}, "unit": {"type": "string", "enum": ["C",
"F"], "default": "C", ...}}, "required": ["city"], "additionalProperties": false}}``.
Type hints map to JSON Schema: str, int, float, bool, None, list[X], tuple[X, ...],
dict[str, X], Literal[...], Enum subclasses, Optional/unions, TypedDict, dataclasses and
pydantic models; a parameter without a hint takes any JSON value. Docstrings in the
Google (``Args:``), Sphinx (``:param x:``) and NumPy (``Parameters``) styles are read.
"""

from __future__ import annotations

import dataclasses
import enum
import inspect
import json
import re
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Union

from localrun.errors import InvalidToolError
from localrun.structured.schema import MAX_SCHEMA_DEPTH, is_pydantic_model, schema_depth

TOOLS_HELP = ('tools=[{"type": "function", "function": {"name": ..., "description": ..., '
              '"parameters": {JSON Schema}}}, a Python function, or a pydantic model class]')
TOOL_CHOICE_HELP = ('tool_choice="auto" | "none" | "required" | {"type": "function", '
                    '"function": {"name": ...}}')
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")

ToolChoice = Literal["auto", "none", "required"] | str  # a str other than those: a tool name


@dataclass(frozen=True)
class Tool:
    """One tool the model may call."""

    name: str
    description: str
    parameters: dict[str, Any]
    strict: bool | None = None
    function: Callable[..., Any] | None = None  # the Python function it came from
    model: Any = None  # the pydantic model class it came from (parses the arguments)

    def to_openai(self) -> dict[str, Any]:
        """OpenAI's shape, which transformers-style chat templates also take."""
        fn: dict[str, Any] = {"name": self.name}
        if self.description:
            fn["description"] = self.description
        fn["parameters"] = self.parameters
        return {"type": "function", "function": fn}

    def parse_arguments(self, arguments: str) -> Any:
        """The arguments JSON as a dict (or as the pydantic model the tool came from)."""
        if self.model is not None:
            return self.model.model_validate_json(arguments)
        return json.loads(arguments)


# -- Python type hints -> JSON Schema ----------------------------------------------------


def _is_typeddict(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, dict) and hasattr(tp, "__annotations__") \
        and hasattr(tp, "__total__")


def type_schema(tp: Any) -> dict[str, Any]:
    """JSON Schema of a Python type hint."""
    if tp is inspect.Parameter.empty or tp is Any or tp is object:
        return {}
    if tp is None or tp is type(None):
        return {"type": "null"}
    if tp is str:
        return {"type": "string"}
    if tp is bool:
        return {"type": "boolean"}
    if tp is int:
        return {"type": "integer"}
    if tp is float:
        return {"type": "number"}
    if is_pydantic_model(tp):
        return dict(tp.model_json_schema())
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        values = [m.value for m in tp]
        return {"enum": values}
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is typing.Annotated:
        schema = type_schema(args[0])
        for extra in args[1:]:
            if isinstance(extra, str):
                schema.setdefault("description", extra)
        return schema
    if origin is Literal:
        return {"enum": list(args)}
    if origin is Union or (hasattr(types, "UnionType") and origin is types.UnionType):
        options = [type_schema(a) for a in args]
        return options[0] if len(options) == 1 else {"anyOf": options}
    if origin in (list, Sequence, set, frozenset) or tp in (list, set, frozenset):
        schema = {"type": "array"}
        if args:
            schema["items"] = type_schema(args[0])
        return schema
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return {"type": "array", "items": type_schema(args[0])}
        if args:
            return {"type": "array", "prefixItems": [type_schema(a) for a in args],
                    "minItems": len(args), "maxItems": len(args)}
        return {"type": "array"}
    if origin in (dict, Mapping) or tp is dict:
        schema = {"type": "object"}
        if len(args) == 2:
            schema["additionalProperties"] = type_schema(args[1])
        return schema
    if _is_typeddict(tp):
        hints = typing.get_type_hints(tp)
        required = sorted(getattr(tp, "__required_keys__", hints.keys()))
        return {"type": "object", "properties": {k: type_schema(v) for k, v in hints.items()},
                "required": [k for k in hints if k in required],
                "additionalProperties": False}
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        hints = typing.get_type_hints(tp)
        fields = dataclasses.fields(tp)
        return {"type": "object",
                "properties": {f.name: type_schema(hints.get(f.name, Any)) for f in fields},
                "required": [f.name for f in fields
                             if f.default is dataclasses.MISSING
                             and f.default_factory is dataclasses.MISSING],
                "additionalProperties": False}
    raise InvalidToolError(f"Cannot describe the type {tp!r} as JSON Schema",
                           hint="annotate the parameter with str, int, float, bool, list[...], "
                           "dict[str, ...], Literal[...], an Enum, a TypedDict, a dataclass or "
                           "a pydantic model, or pass the tool as an OpenAI function dict")


# -- docstrings ---------------------------------------------------------------------------

_PARAM_SECTIONS = ("args", "arguments", "parameters", "params", "keyword args",
                   "keyword arguments")
_HEADER = re.compile(r"^([A-Za-z][A-Za-z ]*?)\s*:?\s*$")
_PARAM = re.compile(r"^\*{0,2}(\w+)\s*(?:\(([^)]*)\))?\s*(?::\s*(.*))?$")
_SPHINX = re.compile(r"^:param\s+(?:[^:]*\s)?(\w+)\s*:\s*(.*)$")


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def parse_docstring(doc: str | None) -> tuple[str, dict[str, str]]:
    """(summary, {parameter: description}) from a Google (``Args:``), Sphinx
    (``:param x:``) or NumPy (``Parameters`` + dashes) docstring."""
    if not doc:
        return "", {}
    lines = inspect.cleandoc(doc).splitlines()
    params: dict[str, str] = {}
    summary: list[str] = []
    current: str | None = None
    section: str | None = None  # "google", "numpy", "sphinx", "other"
    base = 0
    i = 0
    while i < len(lines):
        line = lines[i]
        text = line.strip()
        dashes = i + 1 < len(lines) and set(lines[i + 1].strip()) == {"-"}
        header = _HEADER.match(text) if _indent(line) == 0 else None
        sphinx = _SPHINX.match(text)
        if sphinx:
            section, current = "sphinx", sphinx.group(1)
            params[current] = sphinx.group(2).strip()
        elif text.startswith(":"):
            section, current = "other", None
        elif header and (text.endswith(":") or dashes):
            name = header.group(1).strip().lower()
            section = ("numpy" if dashes else "google") if name in _PARAM_SECTIONS \
                else "other"
            current, base = None, -1
            i += 2 if dashes else 1
            continue
        elif section in ("google", "numpy") and text:
            if base < 0:
                base = _indent(line)
            m = _PARAM.match(text) if _indent(line) == base else None
            if m:
                current = m.group(1)
                params[current] = "" if section == "numpy" else (m.group(3) or "").strip()
            elif current is not None:
                params[current] = (params[current] + " " + text).strip()
        elif section == "sphinx" and current is not None and text:
            params[current] = (params[current] + " " + text).strip()
        elif section is None:
            summary.append(line)
        i += 1
    first = "\n".join(summary).strip().split("\n\n")[0]
    return " ".join(first.split()), params


def function_tool(fn: Callable[..., Any]) -> Tool:
    """A :class:`Tool` from a Python function's signature, type hints and docstring."""
    name = getattr(fn, "__name__", None)
    if not isinstance(name, str) or not _NAME.match(name):
        raise InvalidToolError(f"Cannot use {fn!r} as a tool: it has no usable name",
                               hint="use a def-defined function, or an OpenAI function dict")
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError) as e:
        raise InvalidToolError(f"Cannot read the signature of {name}: {e}",
                               hint=TOOLS_HELP) from e
    try:
        hints = typing.get_type_hints(fn, include_extras=True)
    except Exception as e:  # a forward reference that does not resolve
        raise InvalidToolError(f"Cannot resolve the type hints of {name}: {e}",
                               hint="import every type its annotations name") from e
    description, docs = parse_docstring(inspect.getdoc(fn))
    properties: dict[str, Any] = {}
    required: list[str] = []
    for pname, p in sig.parameters.items():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) or pname in ("self", "cls"):
            continue
        try:
            schema = type_schema(hints.get(pname, p.annotation))
        except InvalidToolError as e:
            raise InvalidToolError(f"Tool {name}, parameter {pname}: {e.message}",
                                   hint=e.hint) from e
        if docs.get(pname):
            schema.setdefault("description", docs[pname])
        if p.default is p.empty:
            required.append(pname)
        else:
            try:
                json.dumps(p.default)
                schema.setdefault("default", p.default.value if isinstance(p.default, enum.Enum)
                                  else p.default)
            except (TypeError, ValueError):
                pass  # a default JSON cannot show (an object): the model just omits it
        properties[pname] = schema
    parameters = {"type": "object", "properties": properties, "required": required,
                  "additionalProperties": False}
    return Tool(name, description, parameters, function=fn)


def model_tool(model: Any) -> Tool:
    """A :class:`Tool` from a pydantic model class: its name, docstring and fields."""
    schema = dict(model.model_json_schema())
    description = str(schema.pop("description", "") or "")
    schema.pop("title", None)
    schema.setdefault("type", "object")
    return Tool(model.__name__, description, schema, model=model)


def dict_tool(spec: Mapping[str, Any], index: int) -> Tool:
    """A :class:`Tool` from OpenAI's ``{"type": "function", "function": {...}}`` (or the
    bare function object, as the Responses API and some clients send it)."""
    fn = spec.get("function", spec) if spec.get("type", "function") == "function" else None
    if not isinstance(fn, Mapping):
        raise InvalidToolError(f"tools[{index}] is not a function tool: {dict(spec)!r}"[:200],
                               hint=TOOLS_HELP)
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise InvalidToolError(f"tools[{index}] has no valid name (letters, digits, _ . -; "
                               f"at most 64): {name!r}", hint=TOOLS_HELP)
    params = fn.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(params, Mapping):
        raise InvalidToolError(f"tools[{index}] ({name}): parameters must be a JSON Schema "
                               "dict", hint=TOOLS_HELP)
    desc = fn.get("description") or ""
    strict = fn.get("strict")
    if schema_depth(params) > MAX_SCHEMA_DEPTH:
        raise InvalidToolError(f"tools[{index}] ({name}): parameters are nested deeper than "
                               f"{MAX_SCHEMA_DEPTH} levels of objects and arrays",
                               hint="flatten the schema ($defs and $ref for repeated parts)")
    try:
        params = json.loads(json.dumps(params))
    except (TypeError, ValueError) as e:
        raise InvalidToolError(f"tools[{index}] ({name}): parameters are not JSON: {e}",
                               hint=TOOLS_HELP) from e
    return Tool(name, str(desc), dict(params), strict if isinstance(strict, bool) else None)


def normalize_tools(tools: object) -> tuple[Tool, ...]:
    """Every accepted tool shape as :class:`Tool`; duplicate names are an error."""
    if tools is None:
        return ()
    if isinstance(tools, (str, bytes, Mapping)) or not isinstance(tools, (list, tuple)):
        raise InvalidToolError("tools must be a list", hint=TOOLS_HELP)
    out: list[Tool] = []
    for i, t in enumerate(tools):
        if isinstance(t, Tool):
            out.append(t)
        elif is_pydantic_model(t):
            out.append(model_tool(t))
        elif isinstance(t, Mapping):
            out.append(dict_tool(t, i))
        elif callable(t):
            out.append(function_tool(t))
        else:
            raise InvalidToolError(f"tools[{i}] is a {type(t).__name__}, not a tool",
                                   hint=TOOLS_HELP)
    names = [t.name for t in out]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise InvalidToolError(f"Two tools share the name {dupes[0]!r}",
                               hint="give every tool its own name")
    return tuple(out)


def normalize_tool_choice(choice: object, tools: Sequence[Tool]) -> str:
    """"auto", "none", "required", or the name of the one tool that must be called."""
    if choice is None:
        return "auto" if tools else "none"
    name: object = None
    if isinstance(choice, str):
        if choice in ("auto", "none", "required"):
            if choice == "required" and not tools:
                raise InvalidToolError('tool_choice="required" needs tools=[...]',
                                       hint=TOOLS_HELP)
            return choice
        name = choice
    elif isinstance(choice, Mapping):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, Mapping) else choice.get("name")
    elif callable(choice) or is_pydantic_model(choice):
        name = getattr(choice, "__name__", None)
    if not isinstance(name, str):
        raise InvalidToolError(f"Unknown tool_choice {choice!r}"[:200], hint=TOOL_CHOICE_HELP)
    known = [t.name for t in tools]
    if name not in known:
        raise InvalidToolError(f"tool_choice names {name!r}, which is not among the tools "
                               f"({', '.join(known) or 'none given'})", hint=TOOL_CHOICE_HELP)
    return name
