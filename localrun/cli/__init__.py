"""The localrun command line. Thin: every command is a wrapper over the library.

Command modules import the library (and through it, engines) inside the command
function, so ``localrun --help`` loads nothing heavy. Every command is a
:class:`Command`: its usage line and ``--help`` name arguments and values the way the
README does. Usage errors (an unknown flag, a missing argument) are one line and a hint,
exit status 2, like every other error (:mod:`localrun.cli._errors`).
"""

from __future__ import annotations

import sys
from typing import Any

import typer
from typer.core import TyperCommand

from localrun import __version__
from localrun.cli._errors import debug, is_usage_error, report, usage_error

#: click's names of value types -> the names --help shows (typer's own: <int>, <str>)
_TYPE_NAMES = {"text": "str", "integer": "int", "float": "float", "path": "path",
               "boolean": "bool", "choice": "str"}


def _value_name(param: Any) -> str:
    """The type of one value of a repeatable option: ``str`` for ``list[str]``."""
    bare = getattr(param, "bare_type", None)  # typer's own click copy
    if callable(bare):
        name = str(bare())
        return name[5:-1] if name.startswith("list[") and name.endswith("]") else name
    kind = getattr(getattr(param, "type", None), "name", "")  # click's ParamType
    return _TYPE_NAMES.get(kind, kind or "str")


def _tidy(param: Any) -> None:
    """A flag takes no value: no ``<bool>`` after it. A repeatable option takes one
    value each time: ``<str>``, not ``<list[str]>``; an argument that takes several
    values, ``<str>...``. An argument is named in capitals
    (``MODEL``), as the usage line and errors show it. (Duck-typed: typer builds on
    click, or on its own copy of it from 0.22.)"""
    if param.metavar is not None:
        return
    kind = getattr(param, "param_type_name", "")
    if kind == "option":
        if param.is_flag:
            param.metavar = ""
        elif param.multiple:
            param.metavar = f"<{_value_name(param)}>"
    elif kind == "argument" and param.name:
        param.metavar = param.name.upper()
        if param.nargs != 1 and callable(getattr(param, "display_type_rich", None)):
            # several values: "<str>..." in the type column, not "<list[str]>"
            each = f"<{_value_name(param)}>..."
            param.display_type_rich = lambda ctx: each


class Command(TyperCommand):
    """A typer command whose help reads as the README: ``localrun run [OPTIONS] MODEL
    [PROMPT]``, flags without a value type (see :func:`_tidy`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        for param in self.params:
            _tidy(param)

    def get_help_option(self, ctx: Any) -> Any:
        option = super().get_help_option(ctx)
        if option is not None:
            _tidy(option)
        return option

    def collect_usage_pieces(self, ctx: Any) -> list[str]:
        pieces = [self.options_metavar] if self.options_metavar else []
        for param in self.get_params(ctx):
            if getattr(param, "param_type_name", "") == "argument":
                name = param.metavar or (param.name or "").upper()
                name += "..." if param.nargs != 1 else ""
                pieces.append(name if param.required else f"[{name}]")
        return pieces

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
    "manage",
    "generate",
    "bench",
    "serve",
)


def _register() -> None:
    import importlib

    for name in COMMANDS:
        importlib.import_module(f"localrun.cli.{name}").register(app)
    for info in app.registered_commands:
        if info.cls in (None, TyperCommand):  # typer's default (None before 0.22)
            info.cls = Command


_register()


def main() -> None:
    from typer.main import get_command

    try:
        # standalone_mode=False: click's usage errors come back here as exceptions
        # (typer would print them in a box), and so does each command's exit code.
        code = get_command(app).main(prog_name="localrun", standalone_mode=False)
    except typer.Abort:  # end of input at a prompt
        sys.stderr.write("\ninterrupted\n")
        sys.exit(130)
    except SystemExit:
        raise
    except BaseException as exc:
        if isinstance(exc, KeyboardInterrupt):
            sys.stderr.write("\ninterrupted\n")
            sys.exit(130)
        if is_usage_error(exc):
            sys.exit(usage_error(exc))
        if debug():
            raise
        sys.exit(report(exc))
    sys.exit(code if isinstance(code, int) else 0)
