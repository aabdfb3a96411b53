"""A request's waits (a model's slot, the load lock, a lookup on disk), each given up at
its deadline or when the client has gone."""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Awaitable, Callable
from typing import Any

from localrun.server.errors import APIError


def left(deadline: float | None) -> float | None:
    """Seconds until ``deadline`` (monotonic; None: no limit)."""
    return None if deadline is None else max(0.0, deadline - time.monotonic())


async def wait(job: Awaitable[Any], undo: Callable[[Any], object] | None,
               timeout: float | None, abort: asyncio.Event | None, where: str,
               started: float) -> Any:
    """What ``job`` comes to (a model's slot, the load lock, a lookup); give up at the
    deadline (504) or when the client has gone (499, nginx's "client closed request":
    logged, never seen by anyone). ``undo(result)`` gives back what ``job`` got just as
    the wait gave up (a lookup in a worker thread just ends: it is bounded)."""
    task: asyncio.Future[Any] = asyncio.ensure_future(job)
    stop: asyncio.Future[Any] | None = None
    waiting = {task}
    if abort is not None:
        stop = asyncio.ensure_future(abort.wait())
        waiting.add(stop)
    done: set[asyncio.Future[Any]] = set()
    try:
        done, _ = await asyncio.wait(waiting, timeout=timeout,
                                     return_when=asyncio.FIRST_COMPLETED)
    finally:
        if stop is not None:
            stop.cancel()
        if task not in done:
            task.cancel()
            task.add_done_callback(functools.partial(_late, undo))
    if task in done:
        return task.result()
    if abort is not None and abort.is_set():
        raise APIError(499, f"The client went away while waiting {where}",
                       code="client_closed_request")
    raise APIError(504, f"Request timed out after waiting {time.monotonic() - started:.1f} s "
                   f"{where} (--request-timeout)", code="timeout")


def _late(undo: Callable[[Any], object] | None, task: asyncio.Future[Any]) -> None:
    """A job given up on that finished anyway: what it got goes straight back."""
    if task.cancelled() or task.exception() is not None:
        return
    if undo is not None:
        undo(task.result())
