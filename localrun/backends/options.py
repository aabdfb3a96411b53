"""Engine options (``localrun.load(..., name=value)``) checked against the engine's own
table (its ``options`` fact): a misspelt name or a value of the wrong kind is an error
naming what the engine does take, never an option passed silently."""

from __future__ import annotations

import difflib
import math
from collections.abc import Mapping
from typing import Any

from localrun.backends.spec import BackendSpec


def check_options(spec: BackendSpec, options: Mapping[str, Any]) -> dict[str, Any]:
    """Engine options validated against the engine's table (its ``options`` fact).

    An unknown name, or a value of the wrong kind, raises InvalidOptionError with the
    options the backend does take; the values come back normalized (words as the table
    spells them, "switch" as "auto"/True/False, "numbers" as a list of floats).
    """
    from localrun.errors import UnknownOptionError

    title = spec.title
    table = spec.options
    out: dict[str, Any] = {}
    for name, value in options.items():
        if name not in table:
            near = difflib.get_close_matches(name, list(table), n=1, cutoff=0.6)
            raise UnknownOptionError(title, name, value, list(table), near[0] if near else None)
        kind, why = table[name]
        out[name] = _check_kind(title, name, value, kind, why)
    return out


def _check_kind(title: str, name: str, value: Any, kind: str | tuple[str, ...], why: str
                ) -> Any:
    from localrun.errors import InvalidOptionError

    def bad() -> InvalidOptionError:
        return InvalidOptionError(title, name, value, why)

    def number(v: Any) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

    if isinstance(kind, tuple):
        word = str(value).strip().upper() if isinstance(value, str) else None
        match = [k for k in kind if word is not None and k.upper() == word]
        if not match:
            raise bad()
        return match[0]
    if kind == "switch":
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in ("auto", "on", "off"):
            v = value.strip().lower()
            return "auto" if v == "auto" else v == "on"
        raise bad()
    if kind == "bool":
        if not isinstance(value, bool):
            raise bad()
        return value
    if kind == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad()
        return value
    if kind == "number":
        if not number(value):
            raise bad()
        return float(value)
    if kind == "numbers":
        if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
            raise bad()
        items = list(value)
        if not items or not all(number(v) and v >= 0 for v in items):
            raise bad()
        return [float(v) for v in items]
    if kind == "text":
        if isinstance(value, bool) or not isinstance(value, (str, int)):
            raise bad()
        return str(value)
    raise AssertionError(f"unknown option kind {kind!r}")
