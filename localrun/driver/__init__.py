"""The generation driver: every sequence of every Model runs through it.

``api.py`` (``Model.chat/stream/complete``) and ``batch.py`` (``Model.batch``) only
validate their arguments and hand :class:`Request` objects to the Model's
:class:`Driver`; ``Model.stream()`` is a batch of one.

- :mod:`localrun.driver.sequence`: one sequence (:class:`Generation`): sampling
  resolution, prompt, context check, constraint, token limit, seed, stop strings,
  structured output, usage, timings; and :class:`Stream`.
- :mod:`localrun.driver.prompt`: a request's prompt tokens (:func:`encode_prompt`), an
  assistant prefill included.
- :mod:`localrun.driver.scheduler`: who runs the engine and when (:class:`Driver`):
  alone on the caller's thread, in turn, or many at once through the session's
  :class:`~localrun.backends.base.Batcher` on one engine thread.
"""

from __future__ import annotations

from localrun.driver.prompt import encode_prompt
from localrun.driver.scheduler import BatchResult, Driver
from localrun.driver.sequence import (
    NOT_STARTED,
    Generation,
    Outcome,
    Request,
    Stream,
    completion_of,
    constrained,
    limited,
    structured_plan,
    timings_of,
)

__all__ = ["NOT_STARTED", "BatchResult", "Driver", "Generation", "Outcome", "Request",
           "Stream", "completion_of", "constrained", "encode_prompt", "limited",
           "structured_plan", "timings_of"]
