"""localrun plan MODEL: the engine, format, quantization and device, without downloading."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Annotated

import typer

from localrun.cli import options as o

if TYPE_CHECKING:
    from rich.console import Console

    from localrun.planning.selection import Plan


@o.with_groups
def plan(
    model: o.ModelArg = None,
    engines: Annotated[str | None, typer.Option(
        "--engines", help="Comma-separated engines to assume installed (default: the ones "
        "installed here; with --hardware: all).")] = None,
    embed: Annotated[bool, typer.Option(
        "--embed", help="Plan for embedding in an application (ONNX Runtime GenAI first).")]
    = False,
    no_hub: Annotated[bool, typer.Option(
        "--no-hub", help="Skip the Hub step (repo, files, memory fit).")] = False,
    json_out: Annotated[bool, typer.Option("--json", help="Print the plan as JSON.")] = False,
    *,
    loading: o.LoadingFlags,
    download: o.DownloadFlags,
) -> None:
    """Show which engine, format, quantization and device would run MODEL, and why.

    Nothing is downloaded or loaded.

    Examples:

      localrun plan smollm2:135m

      localrun plan ./model.gguf --backend mlx

      localrun plan qwen2.5:7b --hardware mac-m2-16gb

      localrun doctor --json > my-pc.json; localrun plan qwen2.5:7b --hardware my-pc.json

    Without the Hub (offline, or unreachable) the memory is estimated from what is
    known here (an earlier download of the name, the parameter count in the catalog or
    the name), and the plan says so; HF_ENDPOINT=URL reaches a mirror or proxy.
    """
    from localrun.backends import BACKENDS, canonical_backend, installed_backends
    from localrun.planning.plan import plan as make_plan

    loading.no_speculation("plan")  # the plan shows the catalog's draft on its own
    profile = download.profile()
    if engines is not None:
        names = [canonical_backend(e) for e in engines.split(",") if e.strip()]
        installed: dict[str, str] | None = {n: "assumed" for n in names}
    elif profile is not None:
        installed = {n: "assumed" for n in BACKENDS}
    else:
        installed = installed_backends()
    result = make_plan(model, backend=loading.backend, hardware=profile, installed=installed,
                       prefer="embed" if embed else "auto",
                       allow_unoptimized=loading.allow_unoptimized, context=loading.context,
                       quant=download.quant, hub=not no_hub)
    if json_out:
        sys.stdout.write(result.to_json() + "\n")
        return
    from rich.console import Console

    console = Console(highlight=False, soft_wrap=True)
    _show(console, result, assumed=profile is not None and engines is None)


def _e(value: object) -> str:
    from rich.markup import escape

    return escape(str(value))


def _show(console: Console, p: Plan, *, assumed: bool) -> None:
    state = "" if p.installed else " [yellow](not installed)[/]"
    console.print(f"[bold]Model[/]: {_e(p.model)}")
    console.print(f"[bold]Plan[/]: {_e(p.backend)}{state} on {_e(p.device)} · {_e(p.format)} "
                  f"{_e(p.quantization or '')} · host kind {_e(p.host)}")
    if p.support == "loads":
        console.print(f"[yellow]warning[/]: {_e(p.backend)} runs {_e(p.format)} without its "
                      "optimized kernels")
    console.print("[bold]Why[/]")
    for r in p.reasons:
        console.print(f"  - {_e(r)}")
    for n in p.notes:
        console.print(f"[bold]Note[/]: {_e(n)}")
    if assumed:
        console.print("[bold]Note[/]: planned for a described machine, assuming every engine "
                      "can be installed there (--engines to narrow)")
    if p.install_hint:
        console.print(f"[bold]Install[/]: {_e(p.install_hint)}")
    # The Hub section (repo, files, memory fit) is filled by the fetch step when present.
    if p.repo is not None:
        console.print(f"[bold]Repo[/]: {_e(p.repo)}")
    if p.files:
        console.print("[bold]Files[/]: " + _e(", ".join(p.files)))
    if p.memory:
        _show_memory(console, p.memory)
    if p.draft:
        _show_draft(console, p.draft)
    if p.images:
        _show_images(console, p.images)


def _show_images(console: Console, images: dict[str, object]) -> None:
    """A vision model's projector and its image-token budget."""
    size = images.get("projector_bytes")
    counted = (f", {size / 2**20:.1f} MiB, counted in the memory above"
               if isinstance(size, int) else "")
    console.print(f"[bold]Images[/]: projector {_e(images.get('projector'))}{_e(counted)} · "
                  f"at most {_e(images.get('tokens_per_image'))} tokens an image (larger "
                  f"images are scaled down; the engine option image_tokens) · at most "
                  f"{_e(images.get('images_per_request'))} images a request, each counted "
                  "against the context")


def _show_draft(console: Console, draft: dict[str, object]) -> None:
    """The catalog's draft model (speculative decoding) and what it adds in memory."""
    mem = draft.get("memory")
    size = ""
    if isinstance(mem, dict) and isinstance(mem.get("total_bytes"), int):
        size = (f" · adds {mem['total_bytes'] / 2**30:.2f} GiB (weights "
                f"{int(mem.get('weights_bytes') or 0) / 2**30:.2f} GiB)")
    console.print(f"[bold]Draft[/]: {_e(draft.get('model'))}{_e(size)} · speculative "
                  f"decoding: --draft-model {_e(draft.get('model'))} --speculative draft")


def _show_memory(console: Console, mem: dict[str, object]) -> None:
    """Memory, Fit, where an estimate came from, and a warning when it does not fit."""
    gib = {k: f"{v / 2**30:.2f} GiB" for k, v in mem.items()
           if k in ("weights_bytes", "kv_cache_bytes", "overhead_bytes") and isinstance(v, int)}
    if mem.get("kv_known") is False:
        gib["kv_cache_bytes"] = "not counted"
    parts = ", ".join(f"{k.removesuffix('_bytes').replace('_', ' ')} {v}"
                      for k, v in gib.items())
    color = "green" if mem.get("fits") else "red"
    console.print(f"[bold]Memory[/]: {_e(parts)}")
    if mem.get("estimated_from"):
        console.print(f"[bold]Estimated from[/]: {_e(mem['estimated_from'])}")
    console.print(f"[bold]Fit[/]: [{color}]{_e(mem.get('verdict', ''))}[/]")
    if mem.get("fits") is False:
        console.print("[yellow]warning[/]: the model does not fit this device's memory; "
                      "plan a smaller --quant or --context, or a smaller model")


def register(app: typer.Typer) -> None:
    app.command("plan")(plan)
