"""localrun list / localrun rm: models on disk (HF cache, Ollama, LM Studio, packaged)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any

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
    the embedded default model; then presets (localrun create), each with
    its model and what it sets (--json: "kind": "preset" lines). A model
    downloaded by an alias or a base repo id shows that name too (it runs
    by it, offline included), e.g.
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

    from localrun import hub
    from localrun.backends import compat
    from localrun.naming import stores

    found = [*hub.cached_models(), *stores.ollama_models(), *stores.lmstudio_models()]
    default = stores.default_model()
    if default is not None:
        found.append(default)
    saved = _presets()
    if path_of is not None:
        preset = next((p for p in saved if p.name.lower() == path_of.lower()), None)
        model = preset.model if preset is not None else path_of  # a preset: its model's
        path = next((m.path for m in found if model in (m.name, *m.pulled_as)), None)
        if path is None and preset is not None and Path(model).is_absolute() \
                and Path(model).exists():
            path = model
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
        for p in saved:
            sys.stdout.write(json.dumps({"kind": "preset", **p.to_json()},
                                        ensure_ascii=False) + "\n")
        return
    if not found and not saved:
        Console(stderr=True).print("No models on disk yet. Try: localrun pull qwen2.5:0.5b")
        return
    if not found:
        _show_presets(saved)
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
    if saved:
        _show_presets(saved)


def _presets() -> list[Any]:
    """The saved presets; a presets file that cannot be read is one warning line."""
    from localrun.naming import presets

    try:
        return presets.all_presets()
    except presets.PresetError as e:
        sys.stderr.write(f"warning: presets not listed: {e.message}\n")
        return []


def _show_presets(saved: list[Any]) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    from localrun.cli.manage import summary

    table = Table(box=None, title="presets (localrun create)", title_justify="left")
    for col in ("name", "from", "sets"):
        table.add_column(col, overflow="fold")
    for p in saved:
        sets = summary(p).split(" · ", 1)[1:]
        table.add_row(escape(p.name), escape(p.model), escape(sets[0] if sets else "-"))
    Console(soft_wrap=True).print(table)


def rm(
    model: Annotated[str, typer.Argument(help="A name you pulled (alias or Hub repo id, with "
                                         "an optional :QUANT and @revision), a Hub repo "
                                         "id to remove that repo, or a preset's name.")],
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask.")] = False,
) -> None:
    """Remove from the Hugging Face cache what a name was pulled as (nothing else).

    An alias removes the files its `localrun pull` downloaded, at that revision only;
    a file another pulled name still needs, or that another program had downloaded, stays.
    A Hub repo id removes that repo (@revision: that revision; :QUANT: that quant's GGUF
    files). The cache is shared with transformers and other programs: whatever else of
    the model is cached is listed as kept, with the command that would remove it. Lists
    what goes and what stays, then asks; --yes skips the question. A preset's name
    removes the preset only, never its model's files.

    Examples:

      localrun rm qwen2.5:0.5b

      localrun rm Qwen/Qwen2.5-7B-Instruct-GGUF:Q5_K_M --yes

      localrun rm Qwen/Qwen2.5-0.5B-Instruct@main
    """
    from localrun import hub
    from localrun.naming import presets

    if presets.lookup(model) is not None:
        from localrun.cli.manage import summary

        gone = presets.remove(model)
        typer.echo(f"Removed preset {gone.name} ({summary(gone)}); its model's files "
                   f"stay (localrun rm {gone.model} removes them)", err=True)
        return

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
    if not yes and not _confirm("Proceed?"):
        raise typer.Exit(1)
    freed = hub.remove(removal)
    if removal.files:
        n = len(removal.files)
        say(f"Removed {n} file{'s' if n > 1 else ''} from "
            f"{', '.join(removal.repos)} ({mib(freed)} freed)")
    else:
        say(f"Nothing deleted; forgot {', '.join(removal.forgets)}")


def _confirm(question: str) -> bool:
    """Ask on stderr. End of input (a pipe, a script) is no answer: nothing is removed,
    and one line says so and how to answer ahead (click reads it as an abort)."""
    try:
        return typer.confirm(question, err=True)
    except typer.Abort as e:
        if not isinstance(e.__context__, EOFError):
            raise  # Ctrl-C: "interrupted"
        sys.stderr.write("\nerror: no answer (end of input): nothing removed\n"
                         "  hint: answer y at the prompt, or pass --yes to remove "
                         "without asking\n")
        return False


def register(app: typer.Typer) -> None:
    app.command("list")(list_models)
    app.command("rm")(rm)
