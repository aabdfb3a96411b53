"""OpenVINO GenAI's hook for a structured-output constraint:
``GenerationConfig.structured_output_config`` (XGrammar; ``LLMPipeline`` has no logits
hook): ``json_schema=`` and, for ``tool_choice="auto"``, ``TriggeredTags`` (2025.3+).

Every schema is checked with llguidance before the engine sees it, as on every engine:
XGrammar silently ignores some keywords llguidance refuses (``uniqueItems``; it also
ignores ``multipleOf``, seen with 2026.4), and refuses some llguidance takes (a
``pattern`` with ``\\p{L}``): those raise :class:`UnsupportedSchemaError` naming
OpenVINO. (It refused ``minProperties`` on a free-form object too, until localrun gave
such objects a bounded ``additionalProperties``: :mod:`localrun.structured.bounds`.)
"""

from __future__ import annotations

import json
from typing import Any

from localrun.errors import ConstrainedDecodingUnavailableError, UnsupportedSchemaError
from localrun.structured.bounds import bounded_schema
from localrun.structured.constraint import Constraint

OPENVINO_HINT = "pip install -U 'openvino-genai>=2025.3' (StructuredOutputConfig)"


#: An array whose length may vary by more than this is one XGrammar JSON Schema leaf.
OV_MAX_ARRAY_SPAN = 6
#: $ref chains deeper than this (recursive schemas) end in a JSON Schema leaf.
OV_MAX_REF_DEPTH = 8


def _ref_target(schema: dict[str, Any], root: dict[str, Any]) -> dict[str, Any] | None:
    ref = schema.get("$ref")
    if not isinstance(ref, str):
        return None
    for key in ("$defs", "definitions"):
        prefix = f"#/{key}/"
        if ref.startswith(prefix):
            target = root.get(key, {}).get(ref[len(prefix):])
            return target if isinstance(target, dict) else None
    return root if ref == "#" else None


def openvino_layout(so: Any, schema: dict[str, Any], root: dict[str, Any] | None = None,
                    depth: int = 0) -> Any:
    """A compact-JSON grammar for XGrammar, from OpenVINO's structural-tag elements.

    XGrammar's JSON Schema grammar (all ``json_schema=`` offers) allows any whitespace
    between tokens: a small model sampling at temperature 1 then sometimes writes
    newlines until ``max_tokens`` (measured here: 3 of 60 replies on three schemas). So
    objects and short arrays are laid out here, ``{"key": value, ...}``, and only their
    values (strings, numbers, enums, anything else) are XGrammar JSON Schema leaves.
    Every property is written, optional ones too (a subset of what the schema allows,
    so still valid); arrays whose length may vary by more than
    :data:`OV_MAX_ARRAY_SPAN`, free-form objects and ``allOf`` stay XGrammar leaves.
    """
    root = root if root is not None else schema

    def leaf(s: dict[str, Any]) -> Any:
        defs = {k: root[k] for k in ("$defs", "definitions") if k in root}
        return so.JSONSchema(json.dumps({**defs, **s} if "$ref" in json.dumps(s) else s))

    def const(text: str) -> Any:
        return so.ConstString(text)

    target = _ref_target(schema, root)
    if target is not None:
        if depth >= OV_MAX_REF_DEPTH:
            return leaf(schema)
        return openvino_layout(so, target, root, depth + 1)
    options = schema.get("anyOf") or schema.get("oneOf")
    if isinstance(options, list) and options and \
            not ({"type", "properties", "items"} & set(schema)):
        elems = [openvino_layout(so, o, root, depth + 1) for o in options if isinstance(o, dict)]
        return elems[0] if len(elems) == 1 else so.Union(*elems)
    kind = schema.get("type")
    if kind == "number" and set(schema) & {"minimum", "maximum", "exclusiveMinimum",
                                           "exclusiveMaximum"}:
        number = _ov_bounded_number(so, schema)
        if number is not None:
            return number
    props = schema.get("properties")
    simple = not ({"enum", "const", "allOf", "minProperties", "maxProperties",
                   "patternProperties", "propertyNames", "prefixItems", "contains"}
                  & set(schema))
    if kind == "object" and isinstance(props, dict) and props and simple:
        parts: list[Any] = []
        for i, (name, sub) in enumerate(props.items()):
            parts.append(const(("{" if i == 0 else ", ") + json.dumps(name) + ": "))
            parts.append(openvino_layout(so, sub if isinstance(sub, dict) else {}, root,
                                         depth))
        parts.append(const("}"))
        return so.Concat(*parts)
    items = schema.get("items")
    lo, hi = schema.get("minItems", 0), schema.get("maxItems")
    if kind == "array" and isinstance(items, dict) and simple and isinstance(lo, int) and \
            isinstance(hi, int) and 0 <= hi - lo <= OV_MAX_ARRAY_SPAN and hi >= lo:
        item = openvino_layout(so, items, root, depth)
        alts = [const("[]")] if lo == 0 else []
        for n in range(max(lo, 1), hi + 1):
            seq: list[Any] = [const("["), item]
            for _ in range(n - 1):
                seq += [const(", "), item]
            alts.append(so.Concat(*seq, const("]")))
        return alts[0] if len(alts) == 1 else so.Union(*alts)
    return leaf(schema)


#: Fraction digits of a bounded number on OpenVINO (more are valid, and never needed).
OV_FRACTION = r"\.[0-9]{1,4}"


def _ov_bounded_number(so: Any, schema: dict[str, Any]) -> Any | None:
    """A number within its bounds, which XGrammar checks on the integer part only (seen
    with 2026.4: 60.5 for a maximum of 60). Written as an integer in range, or an integer
    part and up to four fraction digits that cannot leave the range: the bounds rounded
    inward to whole numbers, then one step further in for the fraction. Bounds beyond
    what an integer schema takes (inf, non-numbers) keep the XGrammar leaf (None)."""
    import math

    lo: float = -math.inf
    hi: float = math.inf
    for key, inclusive, is_min in (("minimum", True, True), ("maximum", True, False),
                                   ("exclusiveMinimum", False, True),
                                   ("exclusiveMaximum", False, False)):
        v = schema.get(key)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            continue
        if is_min:
            bound = math.ceil(v) if inclusive else math.floor(v) + 1
            lo = max(lo, bound)
        else:
            bound = math.floor(v) if inclusive else math.ceil(v) - 1
            hi = min(hi, bound)
    if lo > hi:
        return None
    whole: dict[str, Any] = {"type": "integer"}
    if lo > -math.inf:
        whole["minimum"] = int(lo)
    if hi < math.inf:
        whole["maximum"] = int(hi)
    alts = [so.JSONSchema(json.dumps(whole))]
    # non-negative integer part k with a fraction: k + f <= hi needs k <= hi - 1
    k_lo = max(0, lo) if lo > -math.inf else 0
    k_hi = hi - 1
    if k_hi >= k_lo:
        part: dict[str, Any] = {"type": "integer", "minimum": int(k_lo)}
        if k_hi < math.inf:
            part["maximum"] = int(k_hi)
        alts.append(so.Concat(so.JSONSchema(json.dumps(part)), so.Regex(OV_FRACTION)))
    # negative: -(k + f) >= lo needs k <= -lo - 1; "-0.x" needs lo <= -1
    if lo <= -1:
        alts.append(so.Concat(so.ConstString("-0"), so.Regex(OV_FRACTION)))
        if lo <= -2 or lo == -math.inf:
            neg: dict[str, Any] = {"type": "integer", "minimum": 1}
            if lo > -math.inf:
                neg["maximum"] = int(-lo - 1)
            alts.append(so.Concat(so.ConstString("-"), so.JSONSchema(json.dumps(neg)),
                                  so.Regex(OV_FRACTION)))
    return alts[0] if len(alts) == 1 else so.Union(*alts)


def openvino_structured_config(og: Any, constraint: Constraint) -> Any | None:
    """The ``StructuredOutputConfig`` for a constraint (None: an auto tool call this
    version cannot constrain, parsed as written)."""
    so = getattr(og, "StructuredOutputConfig", None)
    if so is None:
        version = getattr(og, "__version__", None) or "this version"
        raise ConstrainedDecodingUnavailableError(
            "OpenVINO GenAI", f"{version} has no StructuredOutputConfig", hint=OPENVINO_HINT)
    # numbers bounded as on llguidance; their fraction digits are the layout's
    # (OV_FRACTION), which XGrammar's own number grammar would leave open
    schema = bounded_schema(constraint.schema_dict, decimals=False)
    text = json.dumps(schema, ensure_ascii=False)
    layout = openvino_layout(so, schema) if hasattr(so, "Concat") else None
    tag = constraint.tag
    repeat = constraint.repeat
    if tag is None and repeat is not None and hasattr(so, "TagsWithSeparator"):
        # forced calls, one or more: the first one's opening is in the prompt already
        item = so.Tag(begin="", content=layout if layout is not None else so.JSONSchema(text),
                      end=repeat.end)
        return so(structural_tags_config=so.TagsWithSeparator(
            tags=[item], separator="\n" + repeat.trigger + repeat.begin, at_least_one=True,
            stop_after_first=False))
    if tag is None:
        if layout is None or isinstance(layout, so.JSONSchema):
            return so(json_schema=text)
        return so(structural_tags_config=layout)
    triggered = getattr(so, "TriggeredTags", None)
    if triggered is None:
        return None  # "auto" only may constrain: this version parses the calls as written
    item = so.Tag(begin=tag.trigger + tag.begin,
                  content=layout if layout is not None else so.JSONSchema(text),
                  end=tag.end)
    return so(structural_tags_config=triggered(triggers=[tag.trigger], tags=[item],
                                               at_least_one=False,
                                               stop_after_first=tag.single))


def is_openvino_grammar_error(error: BaseException) -> bool:
    """An error XGrammar raised compiling a schema (its C++ path is in the message)."""
    text = str(error).lower()
    return isinstance(error, RuntimeError) and ("xgrammar" in text or "json_schema" in text
                                                or "grammar" in text)


def openvino_schema_error(constraint: Constraint, error: BaseException) -> UnsupportedSchemaError:
    """XGrammar's refusal as localrun's typed error: the reason, without the C++ paths
    ("[21:04:45] /home/.../json_schema_converter.cc:3231: minProperties is ...")."""
    import re

    text = " ".join(str(error).split())
    parts = re.split(r"\.(?:cc|cpp|h):\d+:\s*", text)
    return UnsupportedSchemaError(constraint.label, parts[-1] or text, backend="openvino")


def mapped_error(error: Exception, constraint: Constraint | None) -> Exception:
    """An engine error as the caller should see it: XGrammar refusing ``constraint``'s
    schema as :func:`openvino_schema_error`, anything else as it is."""
    if constraint is not None and is_openvino_grammar_error(error):
        return openvino_schema_error(constraint, error)
    return error
