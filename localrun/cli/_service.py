"""``localrun serve --install-service`` / ``--uninstall-service``: the command line that
the service runs, rebuilt from what was typed; the report printed (:mod:`localrun.service`
does the work)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import typer

from localrun.errors import LocalrunError

#: serve's own parameters that are not passed on to the service
_NOT_PASSED = ("install_service", "uninstall_service", "api_key", "help")


def serve_args(ctx: Any) -> list[str]:
    """The serve arguments and flags the user gave (on the command line or through an
    environment variable), long spellings, in declaration order; --api-key-file made
    absolute (the service may start elsewhere)."""
    args: list[str] = []
    for param in ctx.command.params:
        name = param.name
        source = ctx.get_parameter_source(name) if name else None
        if name in _NOT_PASSED or source is None or \
                getattr(source, "name", "") not in ("COMMANDLINE", "ENVIRONMENT"):
            continue
        value = ctx.params.get(name)
        if getattr(param, "param_type_name", "") == "argument":
            args += [str(v) for v in (value or ())]
            continue
        flag = max(param.opts, key=len)
        if param.is_flag:
            if value:
                args.append(flag)
            elif param.secondary_opts:
                args.append(max(param.secondary_opts, key=len))
            continue
        values = value if param.multiple else [value]
        for v in values or ():
            if name == "api_key_file":
                v = Path(v).expanduser().resolve()
            args += [flag, str(v)]
    return args


def service_flags(ctx: Any, *, install: bool, uninstall: bool, drain_timeout: float) -> None:
    """Install or uninstall the service, print what happened; LocalrunError if it failed."""
    from localrun import service

    if install and uninstall:
        raise LocalrunError("--install-service and --uninstall-service both given",
                            hint="pass one of them")
    say = typer.echo
    if uninstall:
        report = service.uninstall()
    else:
        if ctx.params.get("api_key") is not None:
            raise LocalrunError("--install-service would write --api-key's key into the "
                                "service file", hint="pass the key in a file: --api-key-file "
                                f"PATH, or set {service.KEY_ENV} (then it is kept in a file "
                                "only you can read)")
        args = serve_args(ctx)
        key = None
        if "--api-key-file" not in args:
            key = os.environ.get(service.KEY_ENV) or None
        spec = service.ServiceSpec(
            (*service.localrun_argv(), "serve", *args), os.getcwd(),
            service.passed_environment(os.environ), stop_timeout=drain_timeout + 30)
        report = service.install(spec, key=key)
    say(report.notes[0])
    for cmd in report.ran:
        say(f"ran: {cmd}")
    if report.todo:
        say("Run these to start it (the service manager was not found here):")
        for cmd in report.todo:
            say(f"  {cmd}")
    for line in report.notes[1:]:
        say(line)
    if report.failed:
        raise LocalrunError(f"The service file is {'removed' if uninstall else 'written'}, "
                            f"but {report.failed}",
                            hint="run it yourself in your login session (a user service "
                            "manager needs one), then check the logs")
