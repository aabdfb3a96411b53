"""What a command shows on stderr while a managed vLLM starts (a minute or more): the
seconds so far and vLLM's last log line; in place on a terminal, else one line now and
then (a log or CI output would fill with one line per second)."""

from __future__ import annotations

import time
from types import TracebackType
from typing import Any

#: Seconds between the lines when stderr is not a terminal.
EVERY = 10.0


class StartupLine:
    """Context manager: while it is open, :meth:`report` (``localrun.load``'s
    ``on_startup``) shows a starting vLLM's progress; it ends the line on close."""

    def __init__(self, console: Any) -> None:
        self._console = console
        self._status: Any = None
        self._last = -EVERY

    def report(self, p: Any) -> None:
        """One ``localrun.backends.vllm.Startup``."""
        from rich.markup import escape

        line = " ".join(p.line.split())
        if len(line) > 100:  # a log line's message is at its end
            line = "…" + line[-99:]
        text = f"starting vLLM: {p.seconds:.0f} s" + (f" · {line}" if line else "")
        if self._console.is_terminal:
            if self._status is None:
                self._status = self._console.status(escape(text))
                self._status.start()
            else:
                self._status.update(escape(text))
        elif time.monotonic() - self._last >= EVERY:
            self._last = time.monotonic()
            self._console.print(escape(text), soft_wrap=True)

    def __enter__(self) -> StartupLine:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._status is not None:
            self._status.stop()
            self._status = None
