"""What every route needs: the settings, the models, the metrics."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

from localrun.errors import LocalrunError
from localrun.server.config import ServerConfig
from localrun.server.errors import APIError, from_localrun
from localrun.server.manager import Lease, ModelManager
from localrun.server.metrics import Metrics

log = logging.getLogger("localrun.server")


@dataclass
class ServerState:
    config: ServerConfig
    manager: ModelManager
    metrics: Metrics

    async def acquire(self, name: str, **kwargs: Any) -> Lease:
        """:meth:`ModelManager.acquire`, for a name this server lets API requests load
        (:func:`localrun.server.policy.check_model`: 403 for a local path or a
        download it does not allow). Every route that loads a model comes through here."""
        await self.admit(name)
        return await self.manager.acquire(name, **kwargs)

    async def admit(self, name: str, *, loads: bool = True) -> None:
        """403 unless API requests may use ``name``: a model loaded already, named on
        the command line, or one the policy allows (see :meth:`acquire`)."""
        c = self.config
        if (c.pull_allowed and c.local_paths_allowed) or not isinstance(name, str) \
                or not name:
            return
        preset = self.manager.presets.get(name)  # a preset: its model loaded is enough
        model = preset.model if preset is not None else name
        if any(m.name == model for m in self.manager.models.values()):
            return
        from localrun.server.policy import check_model

        await asyncio.to_thread(check_model, c, name, loads=loads)


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
