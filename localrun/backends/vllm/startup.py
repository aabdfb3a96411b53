"""vLLM's startup progress (a minute or more): each second's report goes to the callback
:func:`startup_progress` sets around ``localrun.load`` (the CLI's progress line), else
to the ``localrun.vllm`` logger."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class Startup:
    """One progress report while vLLM starts: seconds so far and its last log line."""

    seconds: float
    line: str


StartupCallback = Callable[[Startup], None]

_listener: contextvars.ContextVar[StartupCallback | None] = contextvars.ContextVar(
    "localrun_vllm_startup", default=None)


@contextlib.contextmanager
def startup_progress(callback: StartupCallback) -> Iterator[None]:
    """Send the startup progress of every vLLM loaded in this block (on this thread or
    task) to ``callback``: ``localrun.load`` has no parameter for it, as only vLLM
    takes a minute to come up. Without one, progress goes to the ``localrun.vllm`` log."""
    token = _listener.set(callback)
    try:
        yield
    finally:
        _listener.reset(token)


def listener() -> StartupCallback | None:
    """The callback :func:`startup_progress` set for this thread or task, if any."""
    return _listener.get()
