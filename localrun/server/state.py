"""What every route needs: the settings, the models, the metrics."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from localrun.errors import LocalrunError
from localrun.server.config import ServerConfig
from localrun.server.errors import APIError, from_localrun
from localrun.server.manager import ModelManager
from localrun.server.metrics import Metrics

log = logging.getLogger("localrun.server")


@dataclass
class ServerState:
    config: ServerConfig
    manager: ModelManager
    metrics: Metrics


def state_of(request: Any) -> ServerState:
    s: ServerState = request.app.state.localrun
    return s


def to_api_error(exc: BaseException, *, param: str | None = None) -> APIError:
    """Any failure as an answer: library errors with their message and hint, anything
    else as a 500 that names the exception (the traceback goes to the server's log)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, LocalrunError):
        return from_localrun(exc, param=param)
    log.error("internal error: %s: %s", type(exc).__name__, exc, exc_info=exc)
    return APIError(500, f"Internal error: {type(exc).__name__}: {exc}", code="internal_error")
