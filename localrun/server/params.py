"""Reading request bodies: every field checked, named in the error when it is wrong, and
every field localrun cannot honour refused with 400 (never silently dropped)."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from localrun.server.errors import APIError, bad_request, unsupported


async def read_json(request: Any) -> dict[str, Any]:
    """The body as a JSON object (413 past the size limit comes from the middleware)."""
    raw = await request.body()
    if not raw.strip():
        raise bad_request("The request body is empty: send a JSON object")
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise bad_request(f"The request body is not valid JSON: {e}") from None
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
