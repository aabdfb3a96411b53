"""``localrun serve ... --install-service``: the server as a background service of the user.

Linux: a systemd user unit, ``~/.config/systemd/user/localrun.service`` (``Restart=on-failure``,
logs in the journal: ``journalctl --user -u localrun``), then ``systemctl --user
daemon-reload`` and ``enable --now``. macOS: a launchd agent,
``~/Library/LaunchAgents/org.localrun.serve.plist`` (restarted when it fails, logs in
``~/Library/Logs/localrun/``), then ``launchctl bootstrap gui/$UID``. Where the tool is
missing, the exact commands are given instead of run.

The service runs the same ``localrun serve`` command with the same flags, from the same
folder, with the environment variables that say where models are (``HF_HOME``,
``LOCALRUN_HOME``, ...). The API key never goes into the unit: ``--api-key-file`` is kept
(as an absolute path), and a key from ``$LOCALRUN_API_KEY`` is written to a file only the
user can read (``serve-api-key`` in localrun's config folder), which the unit names.
Installing twice with the same flags changes nothing; with other flags it rewrites the
file and restarts the service. The texts are made by pure functions
(:func:`unit_text`, :func:`plist_text`), so tests check them without a service manager.
"""

from __future__ import annotations

import os
import plistlib
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from localrun.errors import LocalrunError
from localrun.sharedfile import write_atomic

Platform = Literal["systemd", "launchd"]
UNIT = "localrun.service"
LABEL = "org.localrun.serve"
KEY_ENV = "LOCALRUN_API_KEY"
KEY_FILE = "serve-api-key"
#: Variables that say where models and state are, passed on to the service when set.
#: Never a secret (HF_TOKEN: huggingface_hub reads its token file by itself).
PASSED_ENV = ("LOCALRUN_HOME", "HF_HOME", "HF_HUB_CACHE", "HF_ENDPOINT", "HF_HUB_OFFLINE",
              "LOCALRUN_VLLM_PYTHON", "CUDA_VISIBLE_DEVICES", "LOCALRUN_TEST_MODELS")

Runner = Callable[[Sequence[str]], "subprocess.CompletedProcess[str]"]


@dataclass(frozen=True)
class ServiceSpec:
    """What the service runs: the command, its folder, its environment."""

    argv: tuple[str, ...]
    working_dir: str
    environment: tuple[tuple[str, str], ...] = ()
    stop_timeout: float = 60.0  # seconds to drain before being killed


@dataclass(frozen=True)
class ServicePaths:
    service_file: Path
    key_file: Path
    logs: str  # where the logs are, for the person (a command or a folder)


@dataclass
class Report:
    """What install/uninstall did, for the CLI to print."""

    changed: bool
    notes: list[str] = field(default_factory=list)
    ran: list[str] = field(default_factory=list)  # commands run
    todo: list[str] = field(default_factory=list)  # commands to run (the tool is missing)
    failed: str | None = None  # a command that failed, and what it said


def platform_kind(name: str | None = None) -> Platform:
    """The service manager of this OS; LocalrunError where there is none localrun knows."""
    name = name or sys.platform
    if name.startswith("linux"):
        return "systemd"
    if name == "darwin":
        return "launchd"
    raise LocalrunError(f"--install-service knows systemd (Linux) and launchd (macOS), not "
                        f"{name}", hint="run localrun serve under this system's own service "
                        "manager (on Windows: Task Scheduler or NSSM)")


def localrun_argv() -> list[str]:
    """This installation's ``localrun``, as an absolute path (the venv's script, else its
    Python with ``-m localrun``): a service has no PATH of the user's."""
    exe = Path(sys.executable)
    if not exe.is_absolute():
        exe = Path.cwd() / exe
    script = exe.parent / "localrun"
    return [str(script)] if script.exists() else [str(exe), "-m", "localrun"]


def paths(platform: Platform, home: Path, environ: Mapping[str, str]) -> ServicePaths:
    if platform == "systemd":
        config = Path(environ.get("XDG_CONFIG_HOME") or home / ".config")
        return ServicePaths(config / "systemd" / "user" / UNIT,
                            config / "localrun" / KEY_FILE, "journalctl --user -u localrun -f")
    return ServicePaths(home / "Library" / "LaunchAgents" / f"{LABEL}.plist",
                        home / "Library" / "Application Support" / "localrun" / KEY_FILE,
                        str(home / "Library" / "Logs" / "localrun"))


# -- the texts (pure) -------------------------------------------------------------------

def _systemd_quote(value: str, *, dollar: bool = True) -> str:
    """One word of a unit file line: ``%`` (specifiers) and ``$`` (ExecStart's variables)
    doubled, quoted with C escapes when it holds blanks, quotes or backslashes."""
    if any(c in value for c in "\n\r\0"):
        raise LocalrunError(f"Cannot put {value!r} in a service file: it holds a line break "
                            "or NUL", hint="pass that value without line breaks")
    out = value.replace("%", "%%")
    if dollar:
        out = out.replace("$", "$$")
    if out and not any(c in out for c in " \t\"'\\;"):
        return out
    return '"' + out.replace("\\", "\\\\").replace('"', '\\"') + '"'


def unit_text(spec: ServiceSpec) -> str:
    """The systemd user unit for ``spec``."""
    lines = [
        "# Written by `localrun serve --install-service`; `localrun serve "
        "--uninstall-service` removes it.",
        "[Unit]",
        "Description=localrun serve: OpenAI- and Ollama-compatible API for local models",
        "",
        "[Service]",
        "Type=simple",
        "ExecStart=" + " ".join(_systemd_quote(a) for a in spec.argv),
        "WorkingDirectory=" + spec.working_dir.replace("%", "%%"),
        *(f"Environment={_systemd_quote(f'{k}={v}', dollar=False)}"
          for k, v in spec.environment),
        "Environment=PYTHONUNBUFFERED=1",
        "Restart=on-failure",
        "RestartSec=5",
        # SIGTERM drains the requests in flight (--drain-timeout) before it exits
        f"TimeoutStopSec={max(1, round(spec.stop_timeout))}",
        "",
        "[Install]",
        "WantedBy=default.target",
    ]
    return "\n".join(lines) + "\n"


def plist_text(spec: ServiceSpec, log_dir: str) -> bytes:
    """The launchd agent for ``spec``: started at login, restarted when it fails."""
    doc: dict[str, object] = {
        "Label": LABEL,
        "ProgramArguments": list(spec.argv),
        "WorkingDirectory": spec.working_dir,
        "EnvironmentVariables": {**dict(spec.environment), "PYTHONUNBUFFERED": "1"},
        "RunAtLoad": True,
        "KeepAlive": {"SuccessfulExit": False},
        "ThrottleInterval": 5,
        "ExitTimeOut": max(1, round(spec.stop_timeout)),
        "StandardOutPath": f"{log_dir}/serve.log",
        "StandardErrorPath": f"{log_dir}/serve.log",
    }
    return plistlib.dumps(doc, sort_keys=False)


def passed_environment(environ: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    return tuple((k, environ[k]) for k in PASSED_ENV if environ.get(k))


# -- files --------------------------------------------------------------------------------

def _write_if_changed(path: Path, data: bytes, mode: int) -> bool:
    """Write ``data`` atomically (mode ``mode`` from the start); False if it was there."""
    try:
        if path.read_bytes() == data and (path.stat().st_mode & 0o777) == mode:
            return False
    except OSError:
        pass
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, data, mode=mode)
    except OSError as e:
        raise LocalrunError(f"Cannot write {path}: {e.strerror or e}",
                            hint=f"check that {path.parent} is writable") from None
    return True


def _remove(path: Path) -> bool:
    try:
        path.unlink()
    except FileNotFoundError:
        return False
    except OSError as e:
        raise LocalrunError(f"Cannot remove {path}: {e.strerror or e}",
                            hint=f"remove it by hand: rm {path}") from None
    return True


def _run(argv: Sequence[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=60,
                          check=False)


def _shell(argv: Sequence[str]) -> str:
    import shlex

    return " ".join(shlex.quote(a) for a in argv)


class _Steps:
    """Commands run in order (or listed, where the tool is missing); stops at a failure."""

    def __init__(self, report: Report, tool: str | None, run: Runner):
        self.report, self.tool, self.run = report, tool, run

    def __call__(self, *argv: str, allowed_to_fail: bool = False) -> bool:
        r = self.report
        if r.failed is not None:
            return False
        if self.tool is None:
            r.todo.append(_shell(argv))
            return True
        try:
            done = self.run([self.tool, *argv[1:]])
        except (OSError, subprocess.SubprocessError) as e:
            r.failed = f"{_shell(argv)}: {e}"
            return False
        r.ran.append(_shell(argv))
        if done.returncode != 0 and not allowed_to_fail:
            said = (done.stderr or done.stdout or "").strip().splitlines()
            r.failed = f"{_shell(argv)} exited {done.returncode}" + (
                f": {said[-1]}" if said else "")
        return done.returncode == 0


# -- install / uninstall ---------------------------------------------------------------

def install(spec: ServiceSpec, *, key: str | None = None, platform: Platform | None = None,
            home: Path | None = None, environ: Mapping[str, str] | None = None,
            run: Runner = _run, which: Callable[[str], str | None] | None = None) -> Report:
    """Write the service for ``spec`` and start it. ``key``: an API key to hand to the
    service through a file only the user can read (``--api-key-file`` is added)."""
    import shutil

    platform = platform or platform_kind()
    environ = os.environ if environ is None else environ
    home = home or Path(environ.get("HOME") or Path.home())
    where = paths(platform, home, environ)
    which = which or shutil.which
    key_changed = False
    if key is not None:
        key_changed = _write_if_changed(where.key_file, (key + "\n").encode(), 0o600)
        spec = ServiceSpec((*spec.argv, "--api-key-file", str(where.key_file)),
                           spec.working_dir, spec.environment, spec.stop_timeout)
    elif str(where.key_file) not in spec.argv and _remove(where.key_file):
        key_changed = True  # the key file of an earlier install, no longer used
    existed = where.service_file.exists()
    if platform == "systemd":
        text = unit_text(spec).encode()
    else:
        text = plist_text(spec, where.logs)
        Path(where.logs).mkdir(parents=True, exist_ok=True)
    changed = _write_if_changed(where.service_file, text, 0o644) or key_changed
    report = Report(changed)
    report.notes.append(f"{'Wrote' if changed else 'Unchanged:'} {where.service_file}"
                        + ("" if changed else " (already installed with these flags)"))
    if platform == "systemd":
        step = _Steps(report, which("systemctl"), run)
        if changed or step.tool is None:
            step("systemctl", "--user", "daemon-reload")
        step("systemctl", "--user", "enable", "--now", UNIT)
        if changed and existed:
            step("systemctl", "--user", "restart", UNIT)
        report.notes.append(f"Logs: {where.logs}")
        report.notes.append("To keep it running after you log out: loginctl enable-linger "
                            "$USER")
    else:
        domain = f"gui/{os.getuid()}"
        step = _Steps(report, which("launchctl"), run)
        loaded = step.tool is not None and step.run(
            [step.tool, "print", f"{domain}/{LABEL}"]).returncode == 0
        if changed and (loaded or step.tool is None):
            step("launchctl", "bootout", domain, str(where.service_file),
                 allowed_to_fail=True)
        if changed or not loaded:
            step("launchctl", "bootstrap", domain, str(where.service_file))
        report.notes.append(f"Logs: {where.logs}/serve.log")
    return report


def uninstall(*, platform: Platform | None = None, home: Path | None = None,
              environ: Mapping[str, str] | None = None, run: Runner = _run,
              which: Callable[[str], str | None] | None = None) -> Report:
    """Stop the service and remove its file and key file."""
    import shutil

    platform = platform or platform_kind()
    environ = os.environ if environ is None else environ
    home = home or Path(environ.get("HOME") or Path.home())
    where = paths(platform, home, environ)
    which = which or shutil.which
    if not where.service_file.exists():
        gone_key = _remove(where.key_file)
        return Report(gone_key, [f"Not installed: no {where.service_file}"])
    report = Report(True)
    if platform == "systemd":
        step = _Steps(report, which("systemctl"), run)
        step("systemctl", "--user", "disable", "--now", UNIT, allowed_to_fail=True)
        _remove(where.service_file)
        step("systemctl", "--user", "daemon-reload")
    else:
        step = _Steps(report, which("launchctl"), run)
        step("launchctl", "bootout", f"gui/{os.getuid()}", str(where.service_file),
             allowed_to_fail=True)
        _remove(where.service_file)
    _remove(where.key_file)
    report.notes.append(f"Removed {where.service_file}")
    return report


__all__ = ["LABEL", "PASSED_ENV", "UNIT", "Platform", "Report", "ServicePaths", "ServiceSpec",
           "install", "localrun_argv", "passed_environment", "paths", "platform_kind",
           "plist_text", "uninstall", "unit_text"]
