"""What a download looks like on stderr, the same for `pull` and for any command that
loads a model by name: the plan (repo, files, sizes, memory fit), then one progress bar."""

from __future__ import annotations

from types import TracebackType
from typing import Any


class DownloadBar:
    """A rich progress bar over every file of a download; it appears at the first byte, so
    a model that is already cached shows none."""

    def __init__(self, console: Any) -> None:
        self._console = console
        self._progress: Any = None
        self._task: Any = None

    def report(self, p: Any) -> None:
        """The callback for hub.fetch / load(progress=): one hub.DownloadProgress."""
        if self._progress is None:
            from rich.progress import (
                BarColumn,
                DownloadColumn,
                Progress,
                TextColumn,
                TimeRemainingColumn,
                TransferSpeedColumn,
            )

            self._progress = Progress(TextColumn("{task.description}"), BarColumn(),
                                      DownloadColumn(), TransferSpeedColumn(),
                                      TimeRemainingColumn(), console=self._console)
            self._progress.start()
            self._task = self._progress.add_task("downloading", total=p.total or None)
        name = p.file.rsplit("/", 1)[-1][:40]
        self._progress.update(self._task, advance=p.delta,
                              description=f"[{p.index}/{p.count}] {name}")

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

    def __enter__(self) -> DownloadBar:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


def print_plan(console: Any, plan: Any) -> None:
    """A hub.Download: what the name resolved to, each file, the download and the fit."""
    from rich.markup import escape as e

    from localrun import hub

    where = plan.repo or plan.local_path or plan.ref
    rev = f"@{plan.revision}" if plan.revision and plan.revision != "main" else ""
    console.print(f"[bold]Model[/]: {e(plan.ref)} → {e(str(where))}{e(rev)} "
                  f"({e(plan.format)}{' ' + e(plan.quant) if plan.quant else ''}, "
                  f"for {e(plan.backend)}; source {e(plan.source)})")
    for f in plan.files:
        state = "cached" if f.cached else "to download"
        console.print(f"  {e(f.path)}  {f.size / 2**20:,.1f} MiB  ({state})")
    if plan.files:
        console.print(f"[bold]Download[/]: {plan.download_bytes / 2**20:,.1f} MiB of "
                      f"{plan.total_bytes / 2**20:,.1f} MiB")
    console.print(f"[bold]Memory[/]: {e(plan.memory.breakdown())}")
    color = "green" if plan.fits else "red"
    console.print(f"[bold]Fit[/]: [{color}]{e(plan.verdict)}[/]")
    for line in hub.describe_options(plan.options)[:8]:
        console.print(f"  {e(line)}")
    for reason in plan.reasons:
        console.print(f"  · {e(reason)}")
