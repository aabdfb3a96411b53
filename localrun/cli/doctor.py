"""localrun doctor: what this machine has, which engines are installed, what auto mode picks."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Annotated

import typer

if TYPE_CHECKING:
    from rich.console import Console

    from localrun.hardware import HardwareProfile
    from localrun.planning.selection import Plan


def doctor(
    json_out: Annotated[bool, typer.Option("--json", help="Print the hardware profile as JSON "
                                           "(loadable with: localrun plan --hardware FILE).")]
    = False,
) -> None:
    """Show the hardware, the engines, and which one auto mode picks and why.

    Also what to install for a better engine, and every probe that failed.

    Examples:

      localrun doctor

      localrun doctor --json > my-machine.json
    """
    from localrun.backends import installed_backends
    from localrun.hardware import detect_hardware
    from localrun.planning.selection import PlanRequest, select

    installed = installed_backends()
    profile = detect_hardware(probe_openvino="openvino" in installed)
    if json_out:
        sys.stdout.write(profile.to_json() + "\n")
        return
    from rich.console import Console

    console = Console(highlight=False, soft_wrap=True)
    _hardware(console, profile)
    _engines(console, installed)
    try:
        plan: Plan | None = select(profile, installed, PlanRequest())
    except Exception as e:  # a LocalrunError with a hint; doctor still shows the rest
        plan = None
        console.print(f"[bold]Auto mode[/]: no engine can be chosen: {_e(e)}")
    if plan is not None:
        _auto(console, plan)
    console.print("[bold]Probes[/]")
    if profile.notes:
        for n in profile.notes:
            console.print(f"  - {_e(n)}")
    else:
        console.print("  every probe answered")


def _e(value: object) -> str:
    """Dynamic text is not rich markup ('localrun[mlx]' must print as typed)."""
    from rich.markup import escape

    return escape(str(value))


def _gib(n: int | None) -> str:
    return f"{n / 1024**3:.1f} GiB" if n is not None else "unknown"


def _hardware(console: Console, p: HardwareProfile) -> None:
    from localrun.planning.selection import describe_host, host_kind

    console.print(f"[bold]Host[/]: {_e(p.os)} {_e(p.os_version)}, {_e(p.arch)}")
    c = p.cpu
    console.print(f"[bold]CPU[/]: {_e(c.model or 'unknown')} ({_e(c.vendor or 'unknown vendor')}); "
                  f"{_e(c.physical_cores or '?')} physical / {_e(c.logical_cores or '?')} logical "
                  f"cores, {_e(c.usable_cores or '?')} usable by this process")
    console.print(f"  instruction sets: {_e(', '.join(c.flags) or 'none of interest detected')}")
    ram = f"[bold]Memory[/]: {_e(_gib(p.ram_total))} total, {_e(_gib(p.ram_available))} available"
    if p.ram_limit:
        ram += f" (container limit {_e(_gib(p.ram_limit))})"
    console.print(ram)
    if p.apple is not None:
        a = p.apple
        console.print(f"[bold]Apple Silicon[/]: {_e(a.chip)}, {_e(_gib(a.unified_memory))} unified "
                      f"memory, {a.performance_cores or '?'}P + {a.efficiency_cores or '?'}E "
                      "cores" + (" (this Python runs under Rosetta)" if a.rosetta else ""))
    gpus = [g for g in p.gpus if g.vendor != "apple"]
    if not gpus:
        console.print("[bold]GPUs[/]: none")
    for g in gpus:
        facts = [f"{_gib(g.memory_total)} VRAM" if g.memory_total else "shared memory"]
        if g.memory_free is not None:
            facts.append(f"{_gib(g.memory_free)} free")
        if g.compute_capability:
            facts.append(f"compute capability {g.compute_capability}")
        if g.arch_target:
            facts.append(g.arch_target)
        if g.driver:
            facts.append(f"driver {g.driver}")
        facts.append("integrated" if g.integrated else "discrete")
        console.print(f"[bold]GPU[/] {_e(g.vendor)} {g.index}: {_e(g.name)} "
                      f"({_e(', '.join(facts))}; via {_e(g.source)})")
    for n in p.npus:
        console.print(f"[bold]NPU[/]: {_e(n.name)} "
                      f"(driver {_e(n.driver or '?')}; via {_e(n.source)})")
    console.print(f"[bold]Host kind[/]: {_e(host_kind(p))} — {_e(describe_host(p))}")


def _engines(console: Console, installed: dict[str, str]) -> None:
    from localrun.backends import BACKENDS, install_hint

    console.print("[bold]Engines[/]")
    for name, spec in BACKENDS.items():
        if spec.home == "nowhere":
            continue  # a server elsewhere, not an engine here
        if spec.home == "own-env":
            _vllm(console)
            continue
        if name in installed:
            console.print(f"  [green]✓[/] {name:<10} {_e(spec.title)} {_e(installed[name])}")
        else:
            console.print(f"  [dim]✗ {name:<10} not installed: "
                          f"{_e(install_hint(name))}[/]")


def _vllm(console: Console) -> None:
    """vLLM lives in an environment of its own: say which one localrun found, and how."""
    from localrun.backends.vllm.env import INSTALL_HINT, find_vllm

    env = find_vllm()
    if env is None:
        console.print(f"  [dim]✗ {'vllm':<10} not found: {_e(INSTALL_HINT)}[/]")
        return
    console.print(f"  [green]✓[/] {'vllm':<10} vLLM {_e(env.version or '(version unknown)')} "
                  f"via {_e(env.source)}: {_e(' '.join(env.command))}")


def _auto(console: Console, plan: Plan) -> None:
    state = "" if plan.installed else " (not installed)"
    console.print(f"[bold]Auto mode[/]: {_e(plan.backend)}{_e(state)} on {_e(plan.device)}, "
                  f"{_e(plan.format)} {_e(plan.quantization or '')}".rstrip())
    for r in plan.reasons:
        console.print(f"  - {_e(r)}")
    for n in plan.notes:
        console.print(f"  note: {_e(n)}")
    if plan.install_hint:
        console.print(f"[bold]Better engine[/]: {_e(plan.install_hint)}")


def register(app: typer.Typer) -> None:
    app.command("doctor")(doctor)
