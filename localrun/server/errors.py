"""HTTP errors: one exception, three wire shapes: Ollama's under /api, Anthropic's under
/v1/messages, OpenAI's elsewhere (:func:`shape_of`).

Every error a client sees is one of these, built from a LocalrunError's message and
hint, or from what the server itself refuses. Never a traceback.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from localrun import errors as E
from localrun.adapters import AdapterError


class APIError(Exception):
    """An error answer: HTTP status, OpenAI's ``type``/``param``/``code`` fields."""

    def __init__(self, status: int, message: str, *, type: str | None = None,
                 param: str | None = None, code: str | None = None,
                 headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or _default_type(status)
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def openai_body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def ollama_body(self) -> dict[str, Any]:
        return {"error": self.message}

    def anthropic_body(self) -> dict[str, Any]:
        """Anthropic's shape; its ``type`` by status, as Anthropic's API reference lists
        them (other 4xx: invalid_request_error)."""
        kind = ANTHROPIC_TYPES.get(self.status) or (
            "invalid_request_error" if self.status < 500 else "api_error")
        return {"type": "error", "error": {"type": kind, "message": self.message}}

    def body_for(self, path: str) -> dict[str, Any]:
        shape = shape_of(path)
        if shape == "ollama":
            return self.ollama_body()
        if shape == "anthropic":
            return self.anthropic_body()
        return self.openai_body()


ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                   403: "permission_error", 404: "not_found_error",
                   413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
                   503: "overloaded_error", 504: "timeout_error", 529: "overloaded_error"}

#: the error shape of each path prefix (the first that matches); OpenAI's elsewhere
SHAPES: tuple[tuple[str, str], ...] = (("/api/", "ollama"), ("/v1/messages", "anthropic"))


def shape_of(path: str) -> str:
    """Which dialect's error shape a path answers in: "ollama", "anthropic" or "openai"."""
    if path == "/api":
        return "ollama"
    for prefix, shape in SHAPES:
        if path.startswith(prefix):
            return shape
    return "openai"


def _default_type(status: int) -> str:
    if status == 401:
        return "authentication_error"
    if status == 404:
        return "not_found_error"
    if status == 429:
        return "rate_limit_error"
    return "invalid_request_error" if status < 500 else "server_error"


def bad_request(message: str, param: str | None = None, *, code: str | None = None
                ) -> APIError:
    return APIError(400, message, param=param, code=code)


def unsupported(param: str, why: str = "") -> APIError:
    """A request field localrun does not implement: refused, never silently ignored."""
    detail = f": {why}" if why else ""
    return APIError(400, f"Unsupported parameter '{param}'{detail}", param=param,
                    code="unsupported_parameter")


def from_localrun(exc: E.LocalrunError, *, param: str | None = None) -> APIError:
    """The HTTP answer for a library error: its message and hint, and the status that
    says whose move it is (4xx: change the request; 5xx: the server or engine failed)."""
    text = exc.message + (f" ({exc.hint})" if exc.hint else "")
    if isinstance(exc, (E.UnknownModelError, E.HubNotFoundError, E.NoVariantError,
                        E.OfflineMissingError)):
        return APIError(404, text, param="model", code="model_not_found")
    if isinstance(exc, E.ContextOverflowError):
        return APIError(400, text, param="messages", code="context_length_exceeded")
    if isinstance(exc, E.InvalidSamplingError):
        return APIError(400, text, param=param or exc.option, code="invalid_value")
    if isinstance(exc, AdapterError):  # a LoRA adapter not loaded, not loadable
        return APIError(400, text, param=param or "lora", code="invalid_value")
    if isinstance(exc, E.UnsupportedFeatureError):  # logprobs/echo/token ids on this engine
        return APIError(400, text, param=param or exc.option, code="unsupported_parameter")
    if isinstance(exc, E.StructuredOutputError):
        return APIError(400, text, param=param, code="invalid_value")
    if isinstance(exc, (E.ModelGatedError, E.HubAuthError)):
        return APIError(403, text, type="permission_error", param="model")
    if isinstance(exc, E.ModelTooLargeError):
        return APIError(400, text, param="model", code="model_too_large")
    if isinstance(exc, E.HubUnavailableError):
        headers = {"Retry-After": str(int(exc.retry_after))} if exc.retry_after else None
        return APIError(503, text, code="hub_unavailable", headers=headers)
    if isinstance(exc, E.ModelClosedError):
        return APIError(503, text, code="model_unloaded", headers={"Retry-After": "1"})
    if isinstance(exc, E.GenerationError):
        return APIError(500, text, code="engine_error")
    if isinstance(exc, (E.EngineNotInstalledError, E.EngineUnavailableError,
                        E.FormatMismatchError, E.NoSuitableEngineError, E.ModelFileError)):
        return APIError(400, text, param="model", code="model_unavailable")
    if isinstance(exc, (ValueError, LookupError, TypeError)):
        return APIError(400, text, param=param)
    if type(exc) is E.LocalrunError:  # the plain class: raised for what the caller passed
        return APIError(400, text, param=param)
    return APIError(500, text)
