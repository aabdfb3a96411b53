"""Help and usage errors read as the README says (issue 25, item 6): no value type after a
flag that takes none, arguments named in capitals, a repeatable option's type once, and
a command line that does not parse is one line and a hint, exit status 2."""

from __future__ import annotations

import os
import subprocess

import pytest

from tests.conftest import localrun_cmd

WIDE = {**os.environ, "COLUMNS": "250"}  # no wrapped lines


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*localrun_cmd(), *args], capture_output=True, text=True,
                          timeout=120, env=WIDE)


def _commands() -> list[str]:
    import typer.main

    from localrun.cli import app

    return sorted(typer.main.get_command(app).commands)  # type: ignore[attr-defined]


@pytest.mark.parametrize("command", _commands())
def test_help_shows_no_type_on_flags_and_names_arguments_in_capitals(command: str) -> None:
    r = cli(command, "--help")
    assert r.returncode == 0, r.stderr
    for wrong in ("<bool>", "{model}", "{models}", "<list[", "--stop <list"):
        assert wrong not in r.stdout, f"localrun {command} --help shows {wrong}"
    usage = next(line for line in r.stdout.splitlines() if "Usage:" in line)
    assert "{" not in usage, usage


def test_run_usage_and_stop_metavar() -> None:
    out = cli("run", "--help").stdout
    assert "Usage: localrun run [OPTIONS] MODEL [PROMPT]" in out
    stop = next(line for line in out.splitlines() if "--stop" in line)
    assert "<str>" in stop and "list" not in stop


def _one_line_usage_error(r: subprocess.CompletedProcess[str], command: str) -> str:
    assert r.returncode == 2, (r.returncode, r.stderr)
    lines = r.stderr.splitlines()
    assert len(lines) == 2, r.stderr
    assert lines[0].startswith("error: ") and lines[1] == (
        f"  hint: localrun {command} --help lists its arguments and flags"
        if command else "  hint: localrun --help lists its commands")
    assert "╭" not in r.stderr and "Usage:" not in r.stderr and r.stdout == ""
    return lines[0]


@pytest.mark.parametrize(("args", "needle"), [
    (("run", "--nope"), "No such option: --nope"),
    (("run",), "Missing argument 'MODEL'"),
    (("doctor", "--json", "true"), "unexpected extra argument"),
    (("run", "smollm2:135m", "hi", "--temperature", "warm"), "'--temperature'"),
    (("run", "x", "--temprature", "0"), "--temperature"),  # click's "did you mean"
])
def test_a_usage_error_is_one_line_and_a_hint(args: tuple[str, ...], needle: str) -> None:
    assert needle in _one_line_usage_error(cli(*args), args[0])


def test_an_unknown_command_is_one_line_and_a_hint() -> None:
    assert "No such command 'nope'" in _one_line_usage_error(cli("nope"), "")


def test_the_two_api_keys_say_which_is_which() -> None:
    """--api-key of run/chat/generate (LOCALRUN_REMOTE_API_KEY: sent to a --base-url
    server) and serve's (LOCALRUN_API_KEY: asked of its clients) are two keys."""
    for command in ("run", "chat", "generate"):
        out = " ".join(cli(command, "--help").stdout.split())
        assert "LOCALRUN_REMOTE_API_KEY" in out and "LOCALRUN_API_KEY" in out, command
    out = " ".join(cli("serve", "--help").stdout.split())
    assert "LOCALRUN_API_KEY" in out and "LOCALRUN_REMOTE_API_KEY is another key" in out


def test_pull_files_its_engine_flags_under_model_loading() -> None:
    out = cli("pull", "--help").stdout
    loading = out.split("Model loading", 1)[1].split("╰", 1)[0]
    assert "--backend" in loading and "--context" in loading


def test_generate_help_says_llama_cpp_batches() -> None:
    out = " ".join(cli("generate", "--help").stdout.split())
    assert "llama.cpp runs them in turn" not in out
    assert "llama.cpp, MLX, OpenVINO, ExLlama and remote servers batch them" in out
