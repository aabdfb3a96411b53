"""localrun list / localrun rm: models on disk (HF cache, Ollama, LM Studio, packaged)."""

from __future__ import annotations

import json
import sys
from typing import Annotated

import typer


def list_models(
    json_out: Annotated[bool, typer.Option("--json", help="One JSON object per model.")] = False,
    path_of: Annotated[str | None, typer.Option(
        "--path", metavar="NAME", help="Print only the path of the model with this name (as "
        "listed, or a name it was pulled as): localrun run \"$(localrun list --path NAME)\".",
    )] = None,
) -> None:
    """List downloaded models: name, format, quant, size, location and the engine that runs it.

    Models in the Hugging Face cache, Ollama's and LM Studio's stores, and
    the embedded default model. A model downloaded by an alias or a base repo
    id shows that name too (it runs by it, offline included), e.g.
    qwen2.5:0.5b above Qwen/Qwen2.5-0.5B-Instruct-GGUF:Q4_K_M.

    Examples:

      localrun list

      localrun list --json

      localrun list --path smollm2:135m
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
    if path_of is not None:
        path = next((m.path for m in found if path_of in (m.name, *m.pulled_as)), None)
        if path is None:
            from localrun.errors import LocalrunError

            raise LocalrunError(f"No model named {path_of!r} on disk (localrun list shows "
                                "the names)", hint=f"download it first: localrun pull {path_of}")
        sys.stdout.write(path + "\n")
        return
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
    model: Annotated[str, typer.Argument(help="A name you pulled (alias or Hub repo id, with "
                                         "an optional :QUANT and @revision), or a Hub repo "
                                         "id to remove that repo.")],
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask.")] = False,
) -> None:
    """Remove from the Hugging Face cache what a name was pulled as (nothing else).

    An alias removes the files its `localrun pull` downloaded, at that revision only;
    a file another pulled name still needs, or that another program had downloaded, stays.
    A Hub repo id removes that repo (@revision: that revision; :QUANT: that quant's GGUF
    files). The cache is shared with transformers and other programs: whatever else of
    the model is cached is listed as kept, with the command that would remove it. Lists
    what goes and what stays, then asks; --yes skips the question.

    Examples:

      localrun rm qwen2.5:0.5b

      localrun rm Qwen/Qwen2.5-7B-Instruct-GGUF:Q5_K_M --yes

      localrun rm Qwen/Qwen2.5-0.5B-Instruct@main
    """
    from localrun import hub

    def mib(n: int) -> str:
        if n >= 2**30:
            return f"{n / 2**30:,.1f} GiB"
        return f"{n / 2**20:,.1f} MiB" if n >= 2**20 else f"{n / 2**10:,.1f} KiB"

    def say(line: str) -> None:
        typer.echo(line, err=True)

    removal = hub.plan_removal(model)
    if removal.files:
        say(f"Will remove {mib(removal.freed_bytes)} from the Hugging Face cache:")
        for p in removal.files:
            say(f"  {p}")
        if removal.whole:
            say(f"  that is every file of {', '.join(removal.whole)}: the revision goes "
                "(its snapshot folder and refs)")
    else:
        say("Nothing to delete from the Hugging Face cache.")
    if removal.forgets:
        say(f"Forgets the pulled name{'s' if len(removal.forgets) > 1 else ''} (pull again "
            f"to run offline): {', '.join(removal.forgets)}")
    if removal.kept:
        say("Kept:")
        for k in removal.kept:
            more = f"; to remove it: {k.command}" if k.command else ""
            say(f"  {k.what} ({mib(k.size)}): {k.reason}{more}")
    if not yes and not typer.confirm("Proceed?", err=True):
        raise typer.Exit(1)
    freed = hub.remove(removal)
    if removal.files:
        n = len(removal.files)
        say(f"Removed {n} file{'s' if n > 1 else ''} from "
            f"{', '.join(removal.repos)} ({mib(freed)} freed)")
    else:
        say(f"Nothing deleted; forgot {', '.join(removal.forgets)}")


def register(app: typer.Typer) -> None:
    app.command("list")(list_models)
    app.command("rm")(rm)
