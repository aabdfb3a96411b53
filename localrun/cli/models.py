"""localrun list / localrun rm: models on disk (HF cache, Ollama, LM Studio, packaged)."""

from __future__ import annotations

import json
import sys
from typing import Annotated

import typer


def list_models(
    json_out: Annotated[bool, typer.Option("--json", help="One JSON object per model.")] = False,
) -> None:
    """List downloaded models: name, format, quant, size, location and the engine that runs it.

    Models in the Hugging Face cache, Ollama's and LM Studio's stores, and
    the embedded default model. A model downloaded by an alias or a base repo
    id shows that name too (it runs by it, offline included), e.g.
    qwen2.5:0.5b above Qwen/Qwen2.5-0.5B-Instruct-GGUF:Q4_K_M.

    Examples:

      localrun list

      localrun list --json
    """
    from dataclasses import asdict

    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    from localrun import hub, stores
    from localrun.formats import compat

    found = [*hub.cached_models(), *stores.ollama_models(), *stores.lmstudio_models()]
    default = stores.default_model()
    if default is not None:
        found.append(default)
    if json_out:
        for m in found:
            d = asdict(m)
            d["engines"] = compat.native_backends(m.format)
            sys.stdout.write(json.dumps(d) + "\n")
        return
    if not found:
        Console(stderr=True).print("No models on disk yet. Try: localrun pull qwen2.5:0.5b")
        return
    table = Table(box=None)
    for col in ("name", "format", "quant", "size", "engine", "location"):
        table.add_column(col, overflow="fold")
    for m in found:
        engines = ", ".join(compat.native_backends(m.format)) or "-"
        name = escape(m.name)
        if m.pulled_as:
            name = ", ".join(escape(n) for n in m.pulled_as) + f"\n[dim]{name}[/]"
        table.add_row(name, m.format, m.quant or "-", f"{m.size / 2**20:,.1f} MiB",
                      engines, escape(m.path))
    Console(soft_wrap=True).print(table)


def rm(
    model: Annotated[str, typer.Argument(help="Hub repo id (org/name, or org/name:QUANT for "
                                         "one quant) or alias.")],
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask.")] = False,
) -> None:
    """Remove a model from the Hugging Face cache (only what belongs to it).

    Lists the files and the space freed, then asks; --yes skips the question.

    Examples:

      localrun rm qwen2.5:0.5b

      localrun rm Qwen/Qwen2.5-7B-Instruct-GGUF:Q5_K_M --yes
    """
    from localrun import hub

    removal = hub.plan_removal(model)
    typer.echo(f"Will remove {removal.freed_bytes / 2**20:,.1f} MiB:", err=True)
    for p in removal.files:
        typer.echo(f"  {p}", err=True)
    if not yes and not typer.confirm("Proceed?", err=True):
        raise typer.Exit(1)
    freed = hub.remove(removal)
    typer.echo(f"Removed {', '.join(removal.repos)} ({freed / 2**20:,.1f} MiB freed)", err=True)


def register(app: typer.Typer) -> None:
    app.command("list")(list_models)
    app.command("rm")(rm)
