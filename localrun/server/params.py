"""Reading request bodies: every field checked, named in the error when it is wrong, and
every field localrun cannot honour refused with 400 (never silently dropped)."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from localrun.server.errors import APIError, bad_request, unsupported

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


async def read_model_request(request: Any) -> tuple[Fields, str]:
    """The body's fields and its required ``model``."""
    f = Fields(await read_json(request))
    return f, f.text("model", required=True) or ""


def each_message(raw: list[Any] | None) -> Iterator[tuple[str, Fields]]:
    """Each entry of a ``messages`` array, checked to be an object: (its name, its fields)."""
    if not raw:
        raise bad_request("'messages' must be a non-empty array", "messages")
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad_request(f"'{where}' must be an object with 'role' and 'content'", where)
        yield where, Fields(m, f"{where}.")


class Fields:
    """Typed access to a body's fields; tracks which were read so the rest can be refused."""

    def __init__(self, body: Mapping[str, Any], prefix: str = "") -> None:
        self.body = body
        self.prefix = prefix
        self.seen: set[str] = set()

    def _name(self, key: str) -> str:
        return f"{self.prefix}{key}"

    def raw(self, key: str) -> Any:
        self.seen.add(key)
        return self.body.get(key)

    def _typed(self, key: str, kind: type | tuple[type, ...], want: str) -> Any:
        """The field, None when absent or null, 400 when not of ``kind``."""
        v = self.raw(key)
        # JSON's true/false are Python ints: a bool is only ever a flag
        if v is not None and (isinstance(v, bool) is not (kind is bool)
                              or not isinstance(v, kind)):
            raise self._type(key, want, v)
        return v

    def text(self, key: str, *, required: bool = False) -> str | None:
        v: str | None = self._typed(key, str, "a string")
        if v is None and required:
            raise bad_request(f"Missing required parameter '{self._name(key)}'",
                              self._name(key))
        return v

    def flag(self, key: str) -> bool | None:
        v: bool | None = self._typed(key, bool, "true or false")
        return v

    def integer(self, key: str, *, minimum: int | None = None) -> int | None:
        v: int | None = self.raw(key)
        if isinstance(v, float) and v.is_integer():
            v = int(v)  # 2.0 from a client that writes every number as a float
        elif v is not None and (isinstance(v, bool) or not isinstance(v, int)):
            raise self._type(key, "an integer", v)
        if v is not None and minimum is not None and v < minimum:
            raise bad_request(f"Invalid '{self._name(key)}': {v} (must be >= {minimum})",
                              self._name(key), code="invalid_value")
        return v

    def number(self, key: str) -> float | None:
        v = self._typed(key, (int, float), "a number")
        if v is not None and not math.isfinite(v):
            raise self._type(key, "a number", v)
        return None if v is None else float(v)

    def obj(self, key: str) -> dict[str, Any] | None:
        v: dict[str, Any] | None = self._typed(key, dict, "an object")
        return v

    def array(self, key: str) -> list[Any] | None:
        v: list[Any] | None = self._typed(key, list, "an array")
        return v

    def stop(self, key: str = "stop") -> list[str] | None:
        v = self.raw(key)
        if v is None:
            return None
        if isinstance(v, str):
            return [v] if v else None
        if isinstance(v, list) and all(isinstance(s, str) for s in v):
            return [s for s in v if s] or None
        raise self._type(key, "a string or an array of strings", v)

    def _type(self, key: str, want: str, got: Any) -> APIError:
        return bad_request(f"Invalid type for '{self._name(key)}': expected {want}, got "
                           f"{json.dumps(got)[:80]}", self._name(key), code="invalid_type")

    def refuse_unread(self, ignored: Iterable[str] = ()) -> None:
        """400 for the first field nobody read (``ignored``: accepted, no effect)."""
        skip = set(ignored)
        for key, value in self.body.items():
            if key in self.seen or key in skip:
                continue
            if value is None:
                continue  # clients send null for "unset"
            raise unsupported(self._name(key), "localrun does not implement it")

    def refuse_if(self, key: str, ok: Any, why: str) -> None:
        """Accept ``key`` only when absent, null or equal to ``ok`` (e.g. n=1)."""
        v = self.raw(key)
        if v is None or v == ok:
            return
        if isinstance(ok, (list, dict)) and not v:
            return
        raise unsupported(self._name(key), why)


def sampling_kwargs(*, max_tokens: int | None = None, temperature: float | None = None,
                    top_p: float | None = None, top_k: int | None = None,
                    min_p: float | None = None, repetition_penalty: float | None = None,
                    seed: int | None = None, stop: list[str] | None = None) -> dict[str, Any]:
    """Only what the request set: unset options take the model's own defaults."""
    out: dict[str, Any] = {"max_tokens": max_tokens, "temperature": temperature,
                           "top_p": top_p, "top_k": top_k, "min_p": min_p,
                           "repetition_penalty": repetition_penalty, "seed": seed,
                           "stop": tuple(stop) if stop else None}
    return {k: v for k, v in out.items() if v is not None}


def check_sampling(kwargs: Mapping[str, Any], param_names: Mapping[str, str]) -> None:
    """Validate sampling before any model loads (a typo must not cost a load)."""
    from localrun.api import make_sampling
    from localrun.errors import InvalidSamplingError
    from localrun.server.errors import from_localrun

    try:
        make_sampling(**kwargs)
    except InvalidSamplingError as e:
        raise from_localrun(e, param=param_names.get(e.option, e.option)) from None
