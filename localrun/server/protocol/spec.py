"""The served contract: every route with the shapes it reads and writes, as
``GET /openapi.json`` gives it (behind the API key like every route but /health), and the
list of endpoints an unknown path's 404 names.

A route registers itself with :func:`operation` (its decorator's keyword arguments);
:func:`openapi` builds the document from FastAPI's own (paths, methods, parameters) and
the registered pydantic models (request bodies, JSON answers, stream events).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel

Dialect = Literal["OpenAI", "Anthropic", "Ollama", "localrun"]


@dataclass(frozen=True)
class Operation:
    method: str
    path: str
    dialect: Dialect
    request: type[BaseModel] | None = None
    response: type[BaseModel] | None = None
    stream: type[BaseModel] | None = None  # one event of its stream (SSE or NDJSON)
    stream_type: str = "text/event-stream"


#: every registered route, in registration order
OPERATIONS: list[Operation] = []


def operation(method: str, path: str, dialect: Dialect, *,
              request: type[BaseModel] | None = None, response: type[BaseModel] | None = None,
              stream: type[BaseModel] | None = None, stream_type: str = "text/event-stream",
              summary: str = "") -> dict[str, Any]:
    """Register a route's shapes (once: an app made again registers nothing new);
    returns its decorator's keyword arguments."""
    if not any(op.method == method.upper() and op.path == path for op in OPERATIONS):
        OPERATIONS.append(Operation(method.upper(), path, dialect, request, response, stream,
                                    stream_type))
    return {"summary": summary or None, "tags": [dialect]}


def endpoints() -> str:
    """The routes this server serves, by dialect, in one line (for the 404)."""
    by: dict[str, list[str]] = {d: [] for d in ("OpenAI", "Anthropic", "Ollama", "localrun")}
    for op in OPERATIONS:
        by.setdefault(op.dialect, []).append(f"{op.method} {op.path}")
    return "; ".join(f"{d}: {', '.join(routes)}" for d, routes in by.items() if routes)


def _ref(name: str) -> dict[str, Any]:
    return {"$ref": f"#/components/schemas/{name}"}


def openapi(app: Any) -> dict[str, Any]:
    """The OpenAPI 3.1 document of ``app``'s routes and their registered shapes."""
    from fastapi.openapi.utils import get_openapi
    from pydantic.json_schema import models_json_schema

    from localrun import __version__

    doc = get_openapi(title="localrun", version=__version__, routes=app.routes,
                      description="localrun serve: the OpenAI, Anthropic and Ollama APIs "
                      "over local engines. Every route but /health takes the API key (when "
                      "one is set) as 'Authorization: Bearer KEY' or 'x-api-key: KEY'.")
    keys: list[tuple[type[BaseModel], Literal["validation", "serialization"]]] = []
    for op in OPERATIONS:
        if op.request is not None:
            keys.append((op.request, "validation"))
        for m in (op.response, op.stream):
            if m is not None:
                keys.append((m, "serialization"))
    keys = list(dict.fromkeys(keys))
    refs, top = models_json_schema(keys, ref_template="#/components/schemas/{model}")
    names = {k: v["$ref"].rsplit("/", 1)[-1] for k, v in refs.items()}
    components = doc.setdefault("components", {})
    components.setdefault("schemas", {}).update(top.get("$defs", {}))
    components["securitySchemes"] = {
        "bearer": {"type": "http", "scheme": "bearer"},
        "x-api-key": {"type": "apiKey", "in": "header", "name": "x-api-key"}}
    for op in OPERATIONS:
        entry = doc.get("paths", {}).get(op.path, {}).get(op.method.lower())
        if entry is None:
            continue
        if op.path != "/health":
            entry["security"] = [{"bearer": []}, {"x-api-key": []}]
        if op.request is not None:
            entry["requestBody"] = {"required": True, "content": {"application/json": {
                "schema": _ref(names[(op.request, "validation")])}}}
        content: dict[str, Any] = {}
        if op.response is not None:
            content["application/json"] = {"schema": _ref(names[(op.response, "serialization")])}
        if op.stream is not None:
            content[op.stream_type] = {"schema": _ref(names[(op.stream, "serialization")])}
        if content:
            entry.setdefault("responses", {})["200"] = {"description": "OK",
                                                        "content": content}
        entry.get("responses", {}).pop("422", None)  # FastAPI's own: never answered here
    for name in ("HTTPValidationError", "ValidationError"):  # FastAPI's, for that 422
        components["schemas"].pop(name, None)
    return doc
