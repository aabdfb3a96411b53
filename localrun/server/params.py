"""Reading request bodies, the first step of every route that takes one: the bytes as a
JSON object within the limits that keep what reads it afterwards safe (nesting depth,
integer length, text that is Unicode), each refusal a 400 that says which limit and
where. The body's shape is checked next, by the dialect's models
(:mod:`localrun.server.protocol`); :func:`check_sampling` is the library's own check of
the sampling values, run before any model loads."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from localrun.server.errors import bad_request

#: How deep a request body's arrays and objects may nest. A chat request with tools and
#: a JSON Schema nests a few dozen levels at most; Python's parser gives up near 1000,
#: and what walks the body afterwards (schemas, grammars) recurses per level too.
MAX_DEPTH = 128
#: The most digits an integer in a body may have: seeds and token ids fit in 20; the
#: cap also keeps Python's own 4300-digit limit (a ValueError) from being reached.
MAX_INT_DIGITS = 100


class _Refused(Exception):
    """A body the parser's hooks refuse (an integer too long to be anything)."""


def _int(text: str) -> int:
    digits = len(text.lstrip("-"))
    if digits > MAX_INT_DIGITS:
        raise _Refused(f"The request body holds an integer of {digits} digits; "
                       f"numbers may have at most {MAX_INT_DIGITS}")
    return int(text)


def parse_body(raw: bytes) -> Any:
    """``raw`` as JSON, or a 400 that says what is wrong with it: not JSON, nested more
    than MAX_DEPTH levels, an integer past MAX_INT_DIGITS digits, or a string holding a
    lone surrogate escape ("\\ud800": valid JSON, but no Unicode text an engine takes)."""
    try:
        body = json.loads(raw, parse_int=_int)
    except _Refused as e:
        raise bad_request(str(e), code="invalid_value") from None
    except RecursionError:
        raise bad_request(f"The request body is nested more than {MAX_DEPTH} levels deep",
                          code="invalid_value") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise bad_request(f"The request body is not valid JSON: {e}") from None
    _check_tree(body)
    return body


def _check_tree(body: Any) -> None:
    """Depth and text of every value, without recursion (the depth is what is checked).
    Paths are built for containers only: a body of many numbers or strings costs a loop."""
    if isinstance(body, str) and not _is_text(body):
        _refuse_text(body, "the request body", None)
    stack: list[tuple[Any, str, int]] = [(body, "", 1)] if isinstance(body, (dict, list)) \
        else []
    while stack:
        value, where, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise bad_request(f"The request body is nested more than {MAX_DEPTH} levels deep "
                              f"(at '{_short(where)}')", _short(where), code="invalid_value")
        items = enumerate(value) if isinstance(value, list) else value.items()
        for k, v in items:
            if isinstance(k, str) and not _is_text(k):
                _refuse_text(k, f"a key of '{_short(where)}'" if where else
                             "a key of the request body", None)
            if isinstance(v, str):
                if not _is_text(v):
                    path = _short(_join(where, k))
                    _refuse_text(v, f"'{path}'", path)
            elif isinstance(v, (dict, list)):
                stack.append((v, _join(where, k), depth + 1))


def _join(where: str, key: int | str) -> str:
    if isinstance(key, int):
        return f"{where}[{key}]"
    return f"{where}.{key}" if where else key


def _short(where: str) -> str:
    return where if len(where) <= 120 else where[:60] + "..." + where[-57:]


def _is_text(text: str) -> bool:
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _refuse_text(text: str, name: str, param: str | None) -> None:
    """400 for a string holding a lone surrogate (valid JSON, no Unicode text)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise bad_request(
            f"Invalid text in {name}: {e.object[e.start:e.end]!r} at character {e.start} is "
            "a lone surrogate escape, not a Unicode character (send UTF-8 text; a character "
            "beyond U+FFFF escapes as a pair, e.g. \\ud83d\\ude00)", param,
            code="invalid_value") from None


async def read_json(request: Any) -> dict[str, Any]:
    """The body as a JSON object (413 past the size limit comes from the middleware)."""
    raw = await request.body()
    if not raw.strip():
        raise bad_request("The request body is empty: send a JSON object")
    body = parse_body(raw)
    if not isinstance(body, dict):
        raise bad_request(f"The request body must be a JSON object, not {type(body).__name__}")
    return body


def check_sampling(kwargs: Mapping[str, Any], param_names: Mapping[str, str]) -> None:
    """Validate sampling before any model loads (a typo must not cost a load)."""
    from localrun.api import make_sampling
    from localrun.errors import InvalidSamplingError
    from localrun.server.errors import from_localrun

    try:
        make_sampling(**kwargs)
    except InvalidSamplingError as e:
        raise from_localrun(e, param=param_names.get(e.option, e.option)) from None
