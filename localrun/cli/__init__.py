"""The localrun command line. Thin: every command is a wrapper over the library.

Command modules import the library (and through it, engines) inside the command
function, so ``localrun --help`` loads nothing heavy.
"""

from __future__ import annotations

import sys

import typer

from localrun import __version__
from localrun.cli._errors import debug, report

app = typer.Typer(
    name="localrun",
    help="Run language models locally on the engine that suits this machine best.\n\n"
    "Start with:  localrun chat   (the embedded SmolLM2-135M model, no download)",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"localrun {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                 help="Show the version and exit."),
) -> None:
    pass


#: Command modules, in --help order; each has register(app).
COMMANDS = (
    "chat",
    "run",
    "doctor",
    "plan",
    "pull",
    "models",
    "generate",
    "bench",
    "serve",
)


def _register() -> None:
    import importlib

    for name in COMMANDS:
        importlib.import_module(f"localrun.cli.{name}").register(app)


_register()


def main() -> None:
    try:
        app()
    except SystemExit:
        raise
    except BaseException as exc:
        if isinstance(exc, KeyboardInterrupt):
            sys.stderr.write("\ninterrupted\n")
            sys.exit(130)
        if debug():
            raise
        sys.exit(report(exc))
