"""localrun pull MODEL: plan, then download into the Hugging Face cache."""

from __future__ import annotations

from typing import Annotated, Any

import typer


def pull(
    model: Annotated[str, typer.Argument(help="Alias (qwen2.5:0.5b), Hub repo id "
                                         "(org/name[:QUANT][@revision]) or ollama:NAME.")],
    backend: Annotated[str | None, typer.Option("--backend", "-b", help="Engine the "
                       "download is for (default: the one auto mode picks for this "
                       "machine, see 'localrun plan').")] = None,
    quant: Annotated[str | None, typer.Option("--quant", "-q", help="Quant to fetch: "
                     "Q4_K_M, 4bit, int4, 4.0bpw, …")] = None,
    context: Annotated[int | None, typer.Option("--context", "-c", help="Context window "
                       "the memory check plans for (default: the model's, up to 8192).")] = None,
    memory: Annotated[float | None, typer.Option("--memory-gb", help="Memory budget in "
                      "GiB (default: the chosen device's free memory).")] = None,
    hardware: Annotated[str | None, typer.Option("--hardware", help="Download the variant "
                        "for another machine, described by 'localrun doctor --json'.")]
    = None,
) -> None:
    """Show the plan (repo, files, sizes, memory fit), then download with progress.

    Refuses before downloading when the model does not fit. What the name
    resolved to (repo, commit, files) is remembered, so `localrun run` with
    the same name works offline; `localrun list` shows it.

    Examples:

      localrun pull qwen2.5:0.5b

      localrun pull Qwen/Qwen2.5-7B-Instruct-GGUF:Q4_K_M --context 16384
    """
    from rich.console import Console
    from rich.markup import escape as e

    from localrun import hub
    from localrun.backends import BACKENDS
    from localrun.hardware import HardwareProfile
    from localrun.planning import plan_fetch

    console = Console(stderr=True, highlight=False)
    profile = HardwareProfile.load(hardware) if hardware else None
    installed = dict.fromkeys(BACKENDS, "assumed") if profile is not None else None
    chosen, plan = plan_fetch(model, backend=backend or "auto", hardware=profile,
                              installed=installed, context=context, quant=quant)
    if plan is None or memory is not None:
        budget = int(memory * 2**30) if memory is not None else None
        plan = hub.plan_fetch(model, backend=chosen.backend, context=context, quant=quant,
                              memory_budget_bytes=budget)
    print_plan(console, plan)
    plan.require_fit()
    if plan.local_path is not None:
        console.print(f"Nothing to download: {e(plan.local_path)}")
        typer.echo(plan.local_path)
        return
    path = _download(console, plan)
    console.print(f"[green]Ready[/]: {e(str(path))}")
    # What the name resolved to is remembered: the same command runs it offline too.
    name = model + (f":{quant}" if quant else "")
    flag = f" --backend {plan.backend}" if backend else ""
    console.print(f"[dim]Run it (offline too): localrun run {e(name)}{e(flag)}[/]")
    typer.echo(str(path))


def print_plan(console: Any, plan: Any) -> None:
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


def _download(console: Any, plan: Any) -> Any:
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    from localrun import hub

    columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
               TransferSpeedColumn(), TimeRemainingColumn())
    with Progress(*columns, console=console, transient=False) as bar:
        task = bar.add_task("downloading", total=plan.download_bytes or None)

        def report(p: hub.DownloadProgress) -> None:
            bar.update(task, advance=p.delta,
                       description=f"[{p.index}/{p.count}] {p.file.rsplit('/', 1)[-1][:40]}")

        return hub.fetch(plan, progress=report)


def register(app: typer.Typer) -> None:
    app.command("pull")(pull)
