"""The CLI's option groups: each flag declared once, the same on every command that takes it."""

from __future__ import annotations

import dataclasses
import io
import os
import subprocess
import sys
import typing
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
import typer

from localrun.cli import options as o
from tests.hubserver import BASE, HubFixture, start

ROOT = Path(__file__).resolve().parent.parent

#: Flags spelled the same in two commands that mean different things there (why, each).
SAME_NAME_OTHER_FLAG = {
    "--json": "plan/run/doctor/list print JSON on stdout; bench writes its report to a file",
    "--backend": "pull: the engine a download is for (default: auto's pick); bench: also "
    "'all'; elsewhere: the engine to load on",
    "--api-key": "serve: the key clients must send; run/chat/generate: the key sent to "
    "--base-url's server (each has its own environment variable)",
    "--concurrency": "generate: prompts in flight (-j N); bench: the levels to measure (1,4,8)",
    "--speculative": "bench: the modes to compare (off,auto); elsewhere: the load's mode",
    "--host": "serve: the address to listen on; ps/stop: the running server's address",
    "--port": "serve: the port to listen on (-p); ps/stop: the running server's port",
    "--image": "run: an image sent with the prompt (repeats); bench: the one image whose "
    "cost is measured",
}
#: (command, flag) a command takes alone from a group, beside flags of its own.
ALONE = {("pull", "context"),  # pull's --backend is its own (default: auto's pick)
         ("create", "system"),  # a preset's system prompt; create makes no reply
         ("bench", "exact")}  # bench's other engine flags are its own (--backend all)


def _commands() -> dict[str, Any]:
    """name -> (click command, the function registered with typer)."""
    from localrun.cli import app

    group = typer.main.get_command(app)
    functions = {info.name: info.callback for info in app.registered_commands}
    return {name: (cmd, functions[name]) for name, cmd in group.commands.items()}  # type: ignore[attr-defined]


def _declaration(param: Any) -> tuple[Any, ...]:
    """What a user sees of one flag: every spelling, default, help, environment variable,
    type, and whether it repeats."""
    return (tuple(param.opts), tuple(param.secondary_opts), param.default, param.help,
            param.envvar, param.multiple, param.is_flag, param.name)


def test_a_flag_means_one_thing_on_every_command() -> None:
    """A flag offered by several commands is one declaration: same spellings, default, help
    and environment variable everywhere, unless it is listed as another flag by the same
    name. Fails when a command declares a shared flag again and lets it drift."""
    seen: dict[str, dict[tuple[Any, ...], list[str]]] = defaultdict(lambda: defaultdict(list))
    for name, (cmd, _) in _commands().items():
        for param in cmd.params:
            if isinstance(param, typer.core.TyperOption):
                for opt in (*param.opts, *param.secondary_opts):
                    seen[opt][_declaration(param)].append(name)
    drifted = {opt: dict(decls) for opt, decls in seen.items()
               if len(decls) > 1 and opt not in SAME_NAME_OTHER_FLAG
               and not any(o_ in SAME_NAME_OTHER_FLAG for d in decls for o_ in d[0])}
    assert not drifted, f"flags declared differently on different commands: {drifted}"
    for opt in SAME_NAME_OTHER_FLAG:  # an entry that no longer differs should go
        assert len(seen[opt]) > 1, f"{opt} is one flag now: drop it from SAME_NAME_OTHER_FLAG"


@pytest.mark.parametrize("group", o.GROUPS, ids=lambda g: g.__name__)
def test_a_command_takes_a_group_whole_and_from_options(group: type[o.OptionGroup]) -> None:
    """Every command that offers any flag of a group offers all of them, under the group's
    heading, because it declared the group (not a copy of its flags)."""
    # a flag is the group's when it reads the same: another flag by the same name (serve's
    # --api-key, pull's --backend) is not
    helps = {name: typing.get_args(hint)[1].help for name, hint in group.options().items()}
    flags = set(helps)
    takers = []
    for name, (cmd, function) in _commands().items():
        offered = {p.name: p for p in cmd.params if isinstance(p, typer.core.TyperOption)
                   and p.name in flags and p.help == helps[p.name]}
        declared = group in getattr(function, "__cli_groups__", {}).values()
        if not offered and not declared:
            continue
        takers.append(name)
        if not declared and {(name, flag) for flag in offered} <= ALONE:
            continue
        assert declared, (f"localrun {name} declares {sorted(offered)} itself; "
                          f"take o.{group.__name__}")
        assert set(offered) == flags, f"localrun {name} lacks {sorted(flags - set(offered))}"
        for p in offered.values():
            assert p.rich_help_panel == group.panel, (name, p.name, p.rich_help_panel)
    assert len(takers) >= 2, f"{group.__name__} is used by {takers} only"


def test_groups_are_on_the_commands_that_need_them() -> None:
    groups = {name: set(getattr(fn, "__cli_groups__", {}).values())
              for name, (_, fn) in _commands().items()}
    for name in ("run", "chat", "generate"):
        assert {o.SamplingFlags, o.PromptFlags, o.LoadingFlags, o.RemoteFlags} <= groups[name]
    assert o.LoadingFlags in groups["serve"] and o.LoadingFlags in groups["plan"]
    assert o.DownloadFlags in groups["plan"] and o.DownloadFlags in groups["pull"]


def test_sampling_flags_are_every_sampling_option() -> None:
    from localrun.sampling import SAMPLING_OPTIONS

    assert [f.name for f in dataclasses.fields(o.SamplingFlags)] == list(SAMPLING_OPTIONS)


def test_a_group_and_a_command_cannot_share_a_parameter() -> None:
    def clash(max_tokens: int = 0, *, sampling: o.SamplingFlags) -> None:
        pass

    with pytest.raises(TypeError, match="'max_tokens' is declared twice"):
        o.with_groups(clash)


def test_the_command_receives_the_group() -> None:
    got: list[Any] = []

    @o.with_groups
    def probe(name: str, *, sampling: o.SamplingFlags, loading: o.LoadingFlags) -> None:
        got.append((name, sampling, loading))

    app = typer.Typer()
    app.command()(probe)
    app.command("other")(lambda: None)  # two commands, so typer keeps the command name
    from typer.testing import CliRunner

    r = CliRunner().invoke(app, ["probe", "x", "-t", "0", "--stop", "a", "--stop", "b",
                                 "--backend", "llama.cpp"])
    assert r.exit_code == 0, r.output
    assert got == [("x", o.SamplingFlags(temperature=0.0, stop=["a", "b"]),
                    o.LoadingFlags(backend="llama.cpp"))]
    assert got[0][1].kwargs() == {"temperature": 0.0, "stop": ["a", "b"]}


def test_help_groups_flags_under_headings() -> None:
    env = {**os.environ, "COLUMNS": "200"}
    for command, panels in (("run", ("Sampling", "Prompt and reply", "Model loading")),
                            ("plan", ("Model loading", "Download")),
                            ("pull", ("Download",)), ("serve", ("Model loading",))):
        out = subprocess.run([sys.executable, "-m", "localrun", command, "--help"], cwd=ROOT,
                             env=env, capture_output=True, text=True, timeout=60).stdout
        for panel in panels:
            assert f"╭─ {panel} ─" in out, f"localrun {command} --help: no {panel} heading"


def test_one_download_bar() -> None:
    """The bar load() and pull share: one task over all files, named by the file."""
    from rich.console import Console

    from localrun.cli._download import DownloadBar
    from localrun.hub import DownloadProgress

    buf = io.StringIO()
    console = Console(file=buf, force_terminal=False, width=120)
    with DownloadBar(console) as bar:
        for i, (path, size, done) in enumerate((("a/b/first.gguf", 300, 300),
                                                 ("second.gguf", 700, 1000)), 1):
            bar.report(DownloadProgress(file=path, index=i, count=2, delta=size,
                                        file_done=size, file_total=size, done=done,
                                        total=1000))
    text = buf.getvalue()
    assert "[2/2] second.gguf" in text and "1.0/1.0 kB" in text
    assert bar._progress is None  # stopped


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Any:
    yield from start(monkeypatch, tmp_path)


def test_pull_shows_the_download_bar(fake: HubFixture) -> None:
    r = subprocess.run([sys.executable, "-m", "localrun", "pull", BASE, "--memory-gb", "8",
                        "--hardware", str(ROOT / "tests" / "profiles" / "epyc-cpu.json")],
                       cwd=ROOT, env=fake.env(), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "[1/1] qwen2.5-0.5b-instruct-q4_k_m.gguf" in r.stderr
