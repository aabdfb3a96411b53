"""localrun create / show (presets) and localrun ps / stop (a running server's models)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from localrun.cli import options as o

HostOpt = Annotated[str | None, typer.Option(
    "--host", envvar="LOCALRUN_HOST", show_envvar=False,
    help="The server's address: host, host:port or a URL (default: $LOCALRUN_HOST, else "
    "127.0.0.1:8799).", show_default=False)]
PortOpt = Annotated[int | None, typer.Option(
    "--port", help="The server's port (default: the one in --host, else 8799).",
    show_default=False)]
#: --system as o.PromptFlags declares it (create takes it alone from that group)
SystemOpt = o.PromptFlags.options()["system"]
KeyFileOpt = Annotated[Path | None, typer.Option(
    "--api-key-file", help="Read the API key from this file (its first line), so that "
    "it is not on the command line.", show_default=False)]


@o.with_groups
def create(
    name: Annotated[str, typer.Argument(help="The preset's name: letters, digits, . _ - "
                                        "and an optional :tag (mybot, coder:16k).")],
    from_: Annotated[str | None, typer.Option(
        "--from", help="The model it runs: any name localrun accepts, a path, or another "
        "preset (copied).", show_default=False)] = None,
    file: Annotated[Path | None, typer.Option(
        "--file", "-f", help="Read the preset from this file (FROM, SYSTEM, PARAMETER, "
        "ADAPTER, MESSAGE lines, as an Ollama Modelfile); flags given too win over it.",
        show_default=False)] = None,
    system: SystemOpt = None,  # type: ignore[valid-type]
    adapter: o.AdapterOpt = None,
    *,
    sampling: o.SamplingFlags,
    loading: o.LoadingFlags,
) -> None:
    """Save a model with a system prompt and defaults under a name of your own.

    The name then works wherever a model name does (run, chat, generate, plan,
    serve, localrun.load): the model loads with the preset's context and
    engine, its sampling values are the defaults (a flag or argument given
    with the call still wins), and its system prompt opens every
    conversation that has none. Creating a name again replaces it. The
    model is not downloaded now: it is when first used (or localrun pull).

    File format (-f), one instruction per line, # for comments:

      FROM qwen2.5:7b · SYSTEM You are terse. · SYSTEM \"\"\"several lines\"\"\" ·
      PARAMETER temperature 0.2 · PARAMETER stop "###" · PARAMETER num_ctx 16384 ·
      ADAPTER ./lora.gguf:0.5 · MESSAGE user ... · MESSAGE assistant ...

    PARAMETER names: temperature, top_p, top_k, min_p, repetition_penalty
    (repeat_penalty), seed, stop, max_tokens (num_predict), context (num_ctx),
    backend, allow_unoptimized. TEMPLATE is refused: localrun renders the
    model's own chat template.

    Examples:

      localrun create pirate --from smollm2:135m --system "Talk like a pirate." --temperature 0.3

      localrun create coder:16k --from qwen2.5:7b --context 16384 --temperature 0.2

      localrun create reviewer -f Presetfile

      localrun run pirate "Where is the treasure?"
    """
    from localrun.errors import LocalrunError
    from localrun.naming import presetfile, presets

    loading.no_speculation("create")
    if from_ is None and file is None:
        raise LocalrunError("Nothing to make the preset from",
                            hint=f"localrun create {name} --from MODEL, or -f FILE")
    presets.check_name(name)  # before reading anything else
    spec = presetfile.read(file) if file is not None else presetfile.PresetSpec()
    if system is not None:
        from localrun.cli._input import check_text

        check_text("--system", system, hint="pass UTF-8 text")
    adapters = ([presets.parse_adapter(a) for a in adapter] if adapter else spec.adapters)
    preset = presets.make(
        name, from_ or spec.model or "",
        system=system if system is not None else spec.system,
        sampling={**spec.sampling, **sampling.kwargs()},
        context=loading.context if loading.context is not None else spec.context,
        backend=loading.backend if loading.backend != "auto" else spec.backend,
        allow_unoptimized=loading.allow_unoptimized or spec.allow_unoptimized,
        adapters=adapters, messages=spec.messages, exact=loading.exact)
    old = presets.save(preset)
    say = typer.echo
    say(f"{'Replaced' if old else 'Created'} preset {preset.name}: {summary(preset)}")
    say(f"  run it: localrun run {preset.name} \"Hello\"")


def summary(p: Any) -> str:
    """One line: the model, then each thing the preset sets."""
    parts = [p.model]
    if p.system:
        first = p.system.splitlines()[0]
        more = "…" if len(first) > 40 or "\n" in p.system else ""
        parts.append("system " + json.dumps(first[:40] + more, ensure_ascii=False))
    parts += [f"{k} {','.join(map(repr, v)) if k == 'stop' else v}"
              for k, v in p.sampling.items()]
    if p.context:
        parts.append(f"context {p.context}")
    if p.backend:
        parts.append(f"backend {p.backend}")
    if p.allow_unoptimized:
        parts.append("allow unoptimized")
    if p.exact:
        parts.append("exact")
    parts += [f"adapter {a.display}" for a in p.adapters]
    if p.messages:
        parts.append(f"{len(p.messages)} example message{'s' * (len(p.messages) > 1)}")
    return " · ".join(parts)


def show(
    name: Annotated[str, typer.Argument(help="A preset's name.")],
    json_out: Annotated[bool, typer.Option("--json", help="Print it as JSON.")] = False,
) -> None:
    """Print a preset as a preset file (localrun create NAME -f FILE reads it back).

    Examples:

      localrun show pirate

      localrun show pirate > Presetfile; localrun create pirate2 -f Presetfile

      localrun show pirate --json
    """
    from localrun.naming import presetfile, presets

    p = presets.get(name)
    if p is None:
        raise presets.PresetNotFoundError(name, [q.name for q in presets.all_presets()])
    if json_out:
        sys.stdout.write(json.dumps(p.to_json(), ensure_ascii=False) + "\n")
        return
    sys.stdout.write(presetfile.format_preset(p))


def _server(host: str | None, port: int | None, key_file: Path | None) -> Any:
    from localrun.control import Server, read_key, server_url

    return Server(server_url(host, port), read_key(key_file))


def _mib(n: int | None) -> str:
    if n is None:
        return "-"
    return f"{n / 2**30:,.1f} GiB" if n >= 2**30 else f"{n / 2**20:,.0f} MiB"


def _until(seconds: float | None) -> str:
    if seconds is None:
        return "never"
    if seconds < 60:
        return f"in {seconds:.0f} s"
    if seconds < 3600:
        return f"in {seconds / 60:.0f} min"
    return f"in {seconds / 3600:.1f} h"


def ps(
    json_out: Annotated[bool, typer.Option("--json", help="One JSON object per model.")]
    = False,
    host: HostOpt = None,
    port: PortOpt = None,
    api_key_file: KeyFileOpt = None,
) -> None:
    """List the models a running localrun serve holds: engine, device, memory,
    context, and when each unloads if left idle ("never (pinned)": named on
    serve's command line). A preset runs on its model's copy, shown beside it.

    The server is found at --host/--port, else $LOCALRUN_HOST, else
    127.0.0.1:8799; a server started with a key needs it: $LOCALRUN_API_KEY
    or --api-key-file.

    Examples:

      localrun ps

      localrun ps --port 9000 --json

      LOCALRUN_HOST=192.168.1.20:8799 localrun ps --api-key-file ~/.localrun-key
    """
    server = _server(host, port, api_key_file)
    models = server.ps()
    if json_out:
        for m in models:
            sys.stdout.write(json.dumps(m.to_json()) + "\n")
        return
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    if not models:
        Console(stderr=True, highlight=False).print(
            f"No models loaded at {escape(server.url)} (they load on their first request)")
        return
    table = Table(box=None)
    for col in ("name", "engine", "device", "memory", "context", "unloads", "busy"):
        table.add_column(col, overflow="fold")
    for m in models:
        busy = f"{m.running or 0} running, {m.waiting or 0} waiting" if (
            m.running or m.waiting) else "idle"
        name = m.name + (f" (preset {', '.join(m.presets)})" if m.presets else "")
        unloads = "never (pinned)" if m.pinned else _until(m.expires_in)
        table.add_row(escape(name), escape(m.backend or "-"), escape(m.device or "-"),
                      _mib(m.size), str(m.context_length or "-"), unloads, busy)
    Console(soft_wrap=True, highlight=False).print(table)


def stop(
    name: Annotated[str, typer.Argument(help="A loaded model's name, as localrun ps "
                                        "lists it, or a preset's (its model).")],
    json_out: Annotated[bool, typer.Option("--json", help="Print what happened as JSON.")]
    = False,
    host: HostOpt = None,
    port: PortOpt = None,
    api_key_file: KeyFileOpt = None,
) -> None:
    """Unload a model from a running localrun serve, freeing its memory.

    It loads again on its next request. Models named on serve's command
    line stay loaded until the server stops (exit status 1 says so).

    Examples:

      localrun stop qwen2.5:0.5b

      localrun stop qwen2.5:0.5b --port 9000 --json
    """
    from localrun.errors import LocalrunError

    server = _server(host, port, api_key_file)
    result = server.stop(name)
    if json_out:
        sys.stdout.write(json.dumps(result.to_json()) + "\n")
        if not result.unloaded:
            raise typer.Exit(1)
        return
    if result.unloaded:
        typer.echo(f"Unloaded {result.name} ({_mib(result.freed)} freed)")
        return
    if result.outcome == "pinned":
        raise LocalrunError(
            f"{result.name} stays loaded: it was named on localrun serve's command line, "
            "and those models stay until the server stops",
            hint="restart localrun serve without it to free its memory")
    busy = sum((m.running or 0) + (m.waiting or 0) for m in result.still)
    raise LocalrunError(f"{result.name} stays loaded: it has {busy} request"
                        f"{'s' * (busy != 1)} running or waiting",
                        hint=f"run localrun stop {result.name} again once they finish")


def register(app: typer.Typer) -> None:
    app.command("create")(create)
    app.command("show")(show)
    app.command("ps")(ps)
    app.command("stop")(stop)
