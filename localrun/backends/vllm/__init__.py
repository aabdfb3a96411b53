"""vLLM as a managed child process, from its own environment: all that localrun knows
and does about it. ``facts`` (its table row), ``env`` (finding the environment, without
importing vllm), ``session`` (``vllm serve`` under a watchdog, spoken to through the
remote engine's client), ``startup`` (its startup progress, reported while it loads:
:func:`startup_progress`, public here)."""

from localrun.backends.vllm.startup import Startup, startup_progress

__all__ = ["Startup", "startup_progress"]
