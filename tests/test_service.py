"""`localrun serve ... --install-service` (issue 31 item 5): the systemd user unit and the
launchd agent, as text (checked by `systemd-analyze verify` where it exists, by plistlib),
and the install as a user runs it, with HOME in a temporary folder and `systemctl` a
script on PATH that records its arguments (or missing): idempotent, restarted on new
flags, the key kept out of the unit, uninstalled cleanly."""

from __future__ import annotations

import os
import plistlib
import shutil
import stat
import subprocess
from pathlib import Path
from typing import Any

import pytest

from localrun import service
from localrun.errors import LocalrunError
from localrun.service import ServiceSpec
from tests.conftest import localrun_cmd

KEY = "k3y-that-must-stay-out-of-the-unit"


def _spec(*args: str, env: tuple[tuple[str, str], ...] = ()) -> ServiceSpec:
    return ServiceSpec((*service.localrun_argv(), "serve", *args), "/srv/my models", env,
                       stop_timeout=60)


def verify(unit: Path, tmp_path: Path) -> None:
    """``systemd-analyze verify`` finds nothing to say about the unit (it exits 0 even for
    a line it ignores, so its output must be empty too)."""
    tool = shutil.which("systemd-analyze")
    if tool is None:
        pytest.skip("systemd-analyze is not installed here (the contents are checked above)")
    runtime = tmp_path / "runtime"
    runtime.mkdir(exist_ok=True, mode=0o700)
    for mode in ((), ("--user",)):
        r = subprocess.run([tool, "verify", *mode, str(unit)], capture_output=True, text=True,
                           timeout=60, env={**os.environ, "XDG_RUNTIME_DIR": str(runtime)})
        said = [line for line in (r.stdout + r.stderr).splitlines()
                if unit.name in line or "error" in line.lower()]
        assert r.returncode == 0 and not said, r.stdout + r.stderr


def test_the_unit_runs_this_localrun_with_the_flags(tmp_path: Path) -> None:
    spec = _spec("smollm2:135m", "--port", "9000", "--system", "50% off; say \"$HOME\" \\o/",
                 env=(("HF_HOME", "/data/hf cache"),))
    text = service.unit_text(spec)
    lines = text.splitlines()
    exe = service.localrun_argv()[0]
    assert Path(exe).is_absolute() and Path(exe).exists()
    assert (f"ExecStart={exe} serve smollm2:135m --port 9000 --system "
            '"50%% off; say \\"$$HOME\\" \\\\o/"') in lines
    assert "WorkingDirectory=/srv/my models" in lines
    assert 'Environment="HF_HOME=/data/hf cache"' in lines
    for line in ("Restart=on-failure", "[Install]", "WantedBy=default.target",
                 "TimeoutStopSec=60"):
        assert line in lines
    unit = tmp_path / "localrun.service"
    unit.write_text(text.replace("/srv/my models", str(tmp_path)))
    verify(unit, tmp_path)


def test_a_line_break_cannot_reach_the_unit() -> None:
    with pytest.raises(LocalrunError, match="line break"):
        service.unit_text(_spec("--allowed-hosts", "a\n[Service]\nExecStartPre=/bin/evil"))


def test_the_launchd_agent_is_a_valid_plist() -> None:
    spec = _spec("qwen2.5:0.5b", "--keep-alive", "1h", env=(("HF_HOME", "/d/hf"),))
    doc = plistlib.loads(service.plist_text(spec, "/Users/me/Library/Logs/localrun"))
    assert doc["Label"] == service.LABEL
    assert doc["ProgramArguments"] == list(spec.argv)
    assert doc["WorkingDirectory"] == "/srv/my models"
    assert doc["EnvironmentVariables"] == {"HF_HOME": "/d/hf", "PYTHONUNBUFFERED": "1"}
    assert doc["RunAtLoad"] is True and doc["KeepAlive"] == {"SuccessfulExit": False}
    assert doc["StandardErrorPath"] == "/Users/me/Library/Logs/localrun/serve.log"


class FakeLaunchctl:
    """launchctl: records its calls; ``print`` answers whether the agent is loaded."""

    def __init__(self) -> None:
        self.calls: list[list[str]] = []
        self.loaded = False

    def __call__(self, argv: Any) -> subprocess.CompletedProcess[str]:
        argv = list(argv)
        self.calls.append(argv[1:])
        rc = 0
        if argv[1] == "print":
            rc = 0 if self.loaded else 113
        elif argv[1] == "bootstrap":
            self.loaded = True
        elif argv[1] == "bootout":
            rc, self.loaded = (0 if self.loaded else 5), False
        return subprocess.CompletedProcess(argv, rc, "", "")


def test_launchd_install_is_idempotent_and_uninstalls(tmp_path: Path) -> None:
    fake = FakeLaunchctl()
    kw: dict[str, Any] = {"platform": "launchd", "home": tmp_path, "environ": {},
                          "run": fake, "which": lambda _: "/bin/launchctl"}
    domain = f"gui/{os.getuid()}"
    plist = tmp_path / "Library" / "LaunchAgents" / f"{service.LABEL}.plist"
    first = service.install(_spec("--port", "9000"), key=KEY, **kw)
    assert first.changed and first.failed is None
    assert fake.calls == [["print", f"{domain}/{service.LABEL}"],
                          ["bootstrap", domain, str(plist)]]
    doc = plistlib.loads(plist.read_bytes())
    key_file = Path(doc["ProgramArguments"][-1])
    assert doc["ProgramArguments"][-2] == "--api-key-file"
    assert key_file.read_text() == KEY + "\n" and KEY not in plist.read_text()
    assert (tmp_path / "Library" / "Logs" / "localrun").is_dir()
    fake.calls.clear()
    again = service.install(_spec("--port", "9000"), key=KEY, **kw)
    assert not again.changed and fake.calls == [["print", f"{domain}/{service.LABEL}"]]
    fake.calls.clear()
    service.install(_spec("--port", "9001"), key=KEY, **kw)
    assert [c[0] for c in fake.calls] == ["print", "bootout", "bootstrap"]
    fake.calls.clear()
    gone = service.uninstall(**kw)
    assert gone.changed and [c[0] for c in fake.calls] == ["bootout"]
    assert not plist.exists() and not key_file.exists()


# -- the command, as a user runs it -----------------------------------------------------------

def _fake_systemctl(bin_dir: Path, log: Path, fail: str = "") -> None:
    bin_dir.mkdir(exist_ok=True)
    script = bin_dir / "systemctl"
    body = f'echo "$@" >> {log}\n'
    if fail:
        body += f'echo "{fail}" >&2\nexit 1\n'
    script.write_text("#!/bin/sh\n" + body)
    script.chmod(0o755)


def _serve(tmp_path: Path, *args: str, path: Path, key: str | None = KEY
           ) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("XDG_CONFIG_HOME", "LOCALRUN_API_KEY", "LOCALRUN_DEBUG")}
    env.update(HOME=str(tmp_path / "home"), PATH=str(path), HF_HOME=str(tmp_path / "hf"))
    if key is not None:
        env["LOCALRUN_API_KEY"] = key
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    return subprocess.run([*localrun_cmd(), "serve", *args], capture_output=True, text=True,
                          timeout=120, env=env, cwd=work)


def test_install_service_is_idempotent_restarts_on_new_flags_and_uninstalls(
        tmp_path: Path) -> None:
    log = tmp_path / "systemctl.log"
    _fake_systemctl(tmp_path / "bin", log)
    unit = tmp_path / "home" / ".config" / "systemd" / "user" / "localrun.service"
    key_file = tmp_path / "home" / ".config" / "localrun" / "serve-api-key"

    r = _serve(tmp_path, "smollm2:135m", "-p", "9000", "--keep-alive", "1h",
               "--install-service", path=tmp_path / "bin")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[0] == f"Wrote {unit}"
    assert "Logs: journalctl --user -u localrun -f" in r.stdout
    assert log.read_text().splitlines() == ["--user daemon-reload",
                                            "--user enable --now localrun.service"]
    text = unit.read_text()
    exec_line = next(line for line in text.splitlines() if line.startswith("ExecStart="))
    assert exec_line == (f"ExecStart={service.localrun_argv()[0]} serve smollm2:135m --port "
                         f"9000 --keep-alive 1h --api-key-file {key_file}")
    assert f"WorkingDirectory={tmp_path / 'work'}" in text
    assert f"Environment=HF_HOME={tmp_path / 'hf'}" in text
    assert KEY not in text and KEY not in r.stdout + r.stderr
    assert key_file.read_text() == KEY + "\n"
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    verify(unit, tmp_path)

    before = unit.stat().st_mtime_ns
    r = _serve(tmp_path, "smollm2:135m", "--port", "9000", "--keep-alive", "1h",
               "--install-service", path=tmp_path / "bin")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[0] == (f"Unchanged: {unit} (already installed with these "
                                        "flags)")
    assert unit.stat().st_mtime_ns == before
    assert log.read_text().splitlines()[2:] == ["--user enable --now localrun.service"]

    r = _serve(tmp_path, "smollm2:135m", "--port", "9001", "--install-service",
               path=tmp_path / "bin")
    assert r.returncode == 0, r.stderr
    assert "--port 9001 --api-key-file" in unit.read_text()
    assert log.read_text().splitlines()[3:] == ["--user daemon-reload",
                                                "--user enable --now localrun.service",
                                                "--user restart localrun.service"]

    r = _serve(tmp_path, "--uninstall-service", path=tmp_path / "bin")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[0] == f"Removed {unit}"
    assert log.read_text().splitlines()[6:] == ["--user disable --now localrun.service",
                                                "--user daemon-reload"]
    assert not unit.exists() and not key_file.exists()
    r = _serve(tmp_path, "--uninstall-service", path=tmp_path / "bin")
    assert r.returncode == 0 and r.stdout.startswith("Not installed")


def test_without_systemctl_the_commands_are_shown(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    r = _serve(tmp_path, "--install-service", path=empty, key=None)
    assert r.returncode == 0, r.stderr
    out = r.stdout.splitlines()
    at = out.index("Run these to start it (the service manager was not found here):")
    assert out[at + 1:at + 4] == [
        "  systemctl --user daemon-reload", "  systemctl --user enable --now localrun.service",
        "Logs: journalctl --user -u localrun -f"]
    unit = tmp_path / "home" / ".config" / "systemd" / "user" / "localrun.service"
    assert "--api-key-file" not in unit.read_text()  # no key, no key file
    assert not (tmp_path / "home" / ".config" / "localrun" / "serve-api-key").exists()


def test_a_failing_systemctl_is_one_line_and_a_hint(tmp_path: Path) -> None:
    _fake_systemctl(tmp_path / "bin", tmp_path / "log", fail="Failed to connect to bus")
    r = _serve(tmp_path, "--install-service", path=tmp_path / "bin")
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert lines[-2] == ("error: The service file is written, but systemctl --user "
                         "daemon-reload exited 1: Failed to connect to bus")
    assert lines[-1].lstrip().startswith("hint: run it yourself in your login session")


def test_the_key_on_the_command_line_is_refused(tmp_path: Path) -> None:
    _fake_systemctl(tmp_path / "bin", tmp_path / "log")
    r = _serve(tmp_path, "--api-key", "visible-key", "--install-service",
               path=tmp_path / "bin", key=None)
    assert r.returncode == 1
    assert "error: --install-service would write --api-key's key into the service file" \
        in r.stderr
    assert not (tmp_path / "home" / ".config" / "systemd").exists()
    assert not (tmp_path / "log").exists()
