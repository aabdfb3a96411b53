"""Bounds that keep a constrained reply finite: numbers of sensible length.

JSON Schema lets ``{"type": "integer"}`` be any integer, so a grammar built from it
lets a model write digits until ``max_tokens`` (SmolLM2-135M, greedy, asked to
"Describe Paris." as ``City(name, country, population: int)``, writes
``"population": 1111111...`` for as long as it may). Before a schema becomes a grammar,
:func:`bounded_schema` gives every number what real data fits in:

* ``integer``: a signed 64-bit value, [:data:`INT_MIN`, :data:`INT_MAX`] (at most 19
  digits);
* ``number``: at most :data:`NUMBER_LIMIT` in magnitude, as a plain decimal of at most
  :data:`FRACTION_DIGITS` fraction digits (no exponent; at most 26 characters) — the
  precision a double carries, which is what a JSON parser reads it into anyway;
* free-form values (``{}``, ``{"type": "object"}`` without ``properties``, arrays
  without ``items``, ``additionalProperties: true``): a JSON value of those bounded
  numbers, strings, booleans, null, and arrays and objects of the same (one ``$defs``
  entry, :data:`ANY_DEF`).

A schema's own bounds are kept: ``minimum``/``maximum`` (or ``exclusive…``) on one side
leave that side alone and only the missing side gets the default (or, when the given
bound lies beyond the default, a bound one power of ten past it, so the range is never
empty); a ``multipleOf`` of its own replaces the fraction limit (it already fixes the
digits). The bounds are part of the grammar only: what is validated (``parsed``, the
pydantic model) is the caller's schema.

Whitespace needs no bound here: llguidance writes compact JSON (``grammar.JSON_OPTIONS``:
no free whitespace, ``", "`` and ``": "`` between tokens), and OpenVINO's layout
(``engines.openvino_layout``) does the same outside the XGrammar leaves it cannot lay
out, where :mod:`localrun.structured.watch` stops a run of blanks.
"""

from __future__ import annotations

from typing import Any

#: The integer range: int64 (llguidance reads bounds as doubles, and the double nearest
#: -2**63 overflows its range code, so the lowest 1024 values are left out).
INT_MIN = -(2**63) + 1024
INT_MAX = 2**63 - 1
#: The magnitude of a number (a double's 15-16 significant digits of integer part).
NUMBER_LIMIT = 10**15
#: Fraction digits of a number (a ``multipleOf`` of 10**-FRACTION_DIGITS: llguidance
#: then allows that many fraction digits and refuses a longer tail, zeros included).
FRACTION_DIGITS = 9
#: The ``$defs`` key of the bounded free-form value.
ANY_DEF = "localrun_any_json"
ANY_REF = {"$ref": f"#/$defs/{ANY_DEF}"}

#: Keywords that only annotate: a schema of these alone allows any value.
_ANNOTATIONS = frozenset({"title", "description", "default", "examples", "$comment",
                          "deprecated", "readOnly", "writeOnly", "$id", "$schema",
                          "$anchor"})
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties",
                   "dependentSchemas")
_SUBSCHEMAS = ("items", "additionalProperties", "not", "if", "then", "else", "contains",
               "propertyNames", "additionalItems", "unevaluatedItems",
               "unevaluatedProperties")
_LOWER = ("minimum", "exclusiveMinimum")
_UPPER = ("maximum", "exclusiveMaximum")


def _types(schema: dict[str, Any]) -> set[str]:
    kind = schema.get("type")
    if isinstance(kind, str):
        return {kind}
    if isinstance(kind, list):
        return {k for k in kind if isinstance(k, str)}
    return set()


def _numeric(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def _given(schema: dict[str, Any], keys: tuple[str, ...]) -> float | None:
    """The schema's own bound on one side (draft-4 boolean ``exclusive…`` are flags on
    ``minimum``/``maximum``, not bounds)."""
    values = [v for v in (_numeric(schema.get(k)) for k in keys) if v is not None]
    if not values:
        return None
    return max(values) if keys is _LOWER else min(values)


def _past(bound: float, default: float, up: bool) -> float:
    """The default bound on the missing side, or one power of ten past the given bound
    where that lies beyond the default (the range then stays non-empty)."""
    if (bound <= default) if up else (bound >= default):
        return default
    scale = max(abs(bound) * 10, 10.0)
    return scale if up else -scale


def _bound_numbers(out: dict[str, Any], decimals: bool) -> None:
    types = _types(out)
    if "integer" in types and "number" not in types:
        lo_default, hi_default = float(INT_MIN), float(INT_MAX)
        exact_lo, exact_hi = INT_MIN, INT_MAX
    elif "number" in types:
        lo_default, hi_default = -float(NUMBER_LIMIT), float(NUMBER_LIMIT)
        exact_lo, exact_hi = -NUMBER_LIMIT, NUMBER_LIMIT
    else:
        return
    lo, hi = _given(out, _LOWER), _given(out, _UPPER)
    if lo is None:
        low = _past(hi, lo_default, up=False) if hi is not None else lo_default
        out["minimum"] = exact_lo if low == lo_default else _whole(low)
    if hi is None:
        high = _past(lo, hi_default, up=True) if lo is not None else hi_default
        out["maximum"] = exact_hi if high == hi_default else _whole(high)
    if decimals and "number" in types and "multipleOf" not in out:
        out["multipleOf"] = 10.0 ** -FRACTION_DIGITS


def _whole(value: float) -> int | float:
    return int(value) if abs(value) < 2**63 else value


def _is_any(schema: object) -> bool:
    return schema is True or (isinstance(schema, dict) and set(schema) <= _ANNOTATIONS)


def _bound(schema: Any, decimals: bool, used: list[bool]) -> Any:
    if isinstance(schema, list):
        return [_bound(s, decimals, used) for s in schema]
    if _is_any(schema):
        used[0] = True
        return dict(ANY_REF)
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {k: _bound(v, decimals, used) for k, v in out[key].items()}
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [_bound(v, decimals, used) for v in out[key]]
    for key in _SUBSCHEMAS:
        if key in out and (isinstance(out[key], dict) or out[key] is True):
            out[key] = _bound(out[key], decimals, used)
    if isinstance(out.get("items"), list):  # draft-4 tuple form
        out["items"] = [_bound(v, decimals, used) for v in out["items"]]
    types = _types(out)
    if "object" in types and not ({"properties", "patternProperties",
                                   "additionalProperties"} & set(out)):
        used[0] = True
        out["additionalProperties"] = dict(ANY_REF)
    if "array" in types and not ({"items", "prefixItems"} & set(out)):
        used[0] = True
        out["items"] = dict(ANY_REF)
    _bound_numbers(out, decimals)
    return out


def any_value(decimals: bool = True) -> dict[str, Any]:
    """The bounded free-form JSON value (:data:`ANY_DEF`)."""
    number: dict[str, Any] = {"type": "number", "minimum": -NUMBER_LIMIT,
                              "maximum": NUMBER_LIMIT}
    if decimals:
        number["multipleOf"] = 10.0 ** -FRACTION_DIGITS
    return {"anyOf": [
        {"type": "null"}, {"type": "boolean"},
        {"type": "integer", "minimum": INT_MIN, "maximum": INT_MAX}, number,
        {"type": "string"},
        {"type": "array", "items": dict(ANY_REF)},
        {"type": "object", "additionalProperties": dict(ANY_REF)},
    ]}


def bounded_schema(schema: dict[str, Any], decimals: bool = True) -> dict[str, Any]:
    """``schema`` with every number bounded and every free-form value made one of
    bounded numbers (module docstring). ``decimals=False`` leaves the fraction digits
    to the caller (OpenVINO's layout writes bounded numbers with its own regex)."""
    used = [False]
    out: dict[str, Any] = _bound(schema, decimals, used)
    if used[0]:
        defs = out.get("$defs")
        out["$defs"] = {**(defs if isinstance(defs, dict) else {}),
                        ANY_DEF: any_value(decimals)}
    return out
