"""The CLI as a user runs it: real processes, real engine, real model."""

from __future__ import annotations

import json
import os
import pty
import select
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import localrun_cmd, requires_llama


def cli(*args: str, stdin: str | None = None, env: dict[str, str] | None = None,
        timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*localrun_cmd(), *args], input=stdin, capture_output=True,
                          text=True, timeout=timeout, env=env)


def test_help_teaches() -> None:
    r = cli("--help")
    assert r.returncode == 0
    for word in ("chat", "run"):
        assert word in r.stdout
    r = cli("run", "--help")
    assert "--temperature" in r.stdout and "Examples" in r.stdout


def test_version() -> None:
    r = cli("--version")
    assert r.returncode == 0 and r.stdout.startswith("localrun ")


def _one_line_error(r: subprocess.CompletedProcess[str]) -> str:
    assert r.returncode != 0
    assert "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert lines[0].startswith("error: ")
    assert len(lines) <= 2 and (len(lines) == 1 or lines[1].strip().startswith("hint: "))
    return r.stderr


def test_unknown_model_error(clean_env: dict[str, str]) -> None:
    err = _one_line_error(cli("run", "smollm2:13m", "hi", env=clean_env))
    assert "smollm2:135m" in err


def test_invalid_sampling_error(clean_env: dict[str, str]) -> None:
    err = _one_line_error(cli("run", "smollm2:135m", "hi", "--temperature", "-1",
                              env=clean_env))
    assert "temperature" in err and "-1" in err


def test_missing_file_error(clean_env: dict[str, str], tmp_path: Path) -> None:
    _one_line_error(cli("run", str(tmp_path / "none.gguf"), "hi", env=clean_env))


def test_debug_shows_traceback(clean_env: dict[str, str]) -> None:
    env = dict(clean_env, LOCALRUN_DEBUG="1")
    r = cli("run", "smollm2:13m", "hi", env=env)
    assert r.returncode != 0 and "Traceback" in r.stderr


@requires_llama
def test_run_answers(clean_env: dict[str, str]) -> None:
    r = cli("run", "smollm2:135m", "What is 2+2?", "--temperature", "0", env=clean_env)
    assert r.returncode == 0, r.stderr
    assert "4" in r.stdout or "four" in r.stdout.lower()


@requires_llama
def test_run_json(clean_env: dict[str, str]) -> None:
    r = cli("run", "smollm2:135m", "What is 2+2?", "--temperature", "0", "--json",
            env=clean_env)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["finish_reason"] == "stop"
    assert out["usage"]["prompt_tokens"] > 0 and out["usage"]["completion_tokens"] > 0
    assert set(out["timings"]) == {"ttft", "prefill_tps", "decode_tps", "total"}
    assert out["info"]["backend"] == "llama.cpp" and out["info"]["quantization"] == "Q4_1"


@requires_llama
def test_run_reads_stdin_and_stops(clean_env: dict[str, str]) -> None:
    r = cli("run", "smollm2:135m", "--temperature", "0", "--stop", "5", "--max-tokens", "40",
            stdin="Count from 1 to 10, separated by commas.", env=clean_env)
    assert r.returncode == 0, r.stderr
    assert "4" in r.stdout and "5" not in r.stdout


@requires_llama
def test_chat_non_tty_answers_once(clean_env: dict[str, str]) -> None:
    r = cli("chat", "--temperature", "0", stdin="What is the opposite of hot?\n",
            env=clean_env)
    assert r.returncode == 0, r.stderr
    assert "cold" in r.stdout.lower()


def _read_until(fd: int, needle: str, timeout: float = 90) -> str:
    buf = ""
    end = time.monotonic() + timeout
    while needle not in buf:
        left = end - time.monotonic()
        if left <= 0:
            raise AssertionError(f"timed out waiting for {needle!r}; got {buf[-500:]!r}")
        ready, _, _ = select.select([fd], [], [], left)
        if ready:
            try:
                data = os.read(fd, 4096)
            except OSError:
                break
            if not data:
                break
            buf += data.decode("utf-8", "replace")
    return buf


@requires_llama
def test_chat_interactive_session(clean_env: dict[str, str]) -> None:
    pid, fd = pty.fork()
    if pid == 0:  # child: the real CLI on a terminal
        cmd = localrun_cmd()
        os.execve(cmd[0], [*cmd, "chat", "--temperature", "0", "--max-tokens", "300"],
                  clean_env)
    try:
        out = _read_until(fd, ">>> ")
        assert "llama.cpp" in out and "Q4_1" in out  # the header
        os.write(fd, b"/help\n")
        assert "/reset" in _read_until(fd, ">>> ")
        os.write(fd, b"What is 2+2?\n")
        reply = _read_until(fd, ">>> ")
        assert "4" in reply or "four" in reply.lower()
        os.write(fd, b"/stats\n")
        assert "TTFT" in _read_until(fd, ">>> ")
        # Ctrl-C stops a long reply and returns to the prompt
        os.write(fd, b"Write a very long story about a dragon and a knight.\n")
        time.sleep(1.0)
        os.write(fd, b"\x03")
        assert "[stopped]" in _read_until(fd, ">>> ")
        os.write(fd, b"/reset\n")
        assert "cleared" in _read_until(fd, ">>> ")
        os.write(fd, b"\x04")  # Ctrl-D exits
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        try:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
        os.close(fd)


@pytest.mark.parametrize("model", ["smollm2:135m"])
@requires_llama
def test_gguf_on_wrong_engine_refused(clean_env: dict[str, str], model: str) -> None:
    err = _one_line_error(cli("run", model, "hi", "--backend", "mlx", env=clean_env))
    assert "--backend llama.cpp" in err


# -- text that is not UTF-8 (issue 11, item 10) -----------------------------------------

LATIN1 = b"caf\xe9\n"  # "cafe" with an accent, saved as Latin-1


def _raw_cli(*args: bytes | str, stdin: bytes, env: dict[str, str]
             ) -> subprocess.CompletedProcess[str]:
    r = subprocess.run([*localrun_cmd(), *args], input=stdin, capture_output=True,
                       timeout=120, env=env)
    return subprocess.CompletedProcess(r.args, r.returncode, r.stdout.decode("utf-8", "replace"),
                                       r.stderr.decode("utf-8", "replace"))


#: How Python decodes a stream: surrogateescape (the C locales), or strictly (a UTF-8
#: locale such as en_US.UTF-8, which this machine lacks: PYTHONIOENCODING does the same).
DECODINGS = [{"LC_ALL": "C.UTF-8"}, {"LC_ALL": "C"},
             {"LC_ALL": "C", "PYTHONIOENCODING": "utf-8:strict"}]


@pytest.mark.parametrize("decoding", DECODINGS, ids=["c-utf8", "c", "strict"])
@pytest.mark.parametrize("command", ["run", "chat"])
def test_non_utf8_stdin_is_one_line_error(clean_env: dict[str, str], decoding: dict[str, str],
                                          command: str) -> None:
    env = {**clean_env, **decoding}
    args = ["run", "smollm2:135m"] if command == "run" else ["chat"]
    r = _raw_cli(*args, stdin=LATIN1, env=env)
    err = _one_line_error(r)
    assert r.returncode == 1 and "bug" not in err
    assert "not UTF-8" in err and "0xE9" in err and "offset 3" in err
    assert "iconv -f latin1 -t utf-8" in err


def test_non_utf8_argument_is_one_line_error(clean_env: dict[str, str]) -> None:
    # Python hands argv bytes that are not UTF-8 over as lone surrogates.
    for args in (["run", "smollm2:135m", b"caf\xe9"],
                 ["run", "smollm2:135m", "hi", "--system", b"caf\xe9"],
                 ["chat", "--system", b"caf\xe9"]):
        r = _raw_cli(*args, stdin=b"hi\n", env=clean_env)
        err = _one_line_error(r)
        assert "bug" not in err and "not UTF-8" in err and "0xE9" in err, err


def test_stray_surrogate_error_is_not_called_a_bug(capsys: pytest.CaptureFixture[str]) -> None:
    """Wherever else the user's bytes surface, the last resort names them, not a bug."""
    from localrun.cli._errors import report

    try:
        "caf\udce9".encode("utf-8")
    except UnicodeEncodeError as e:
        code = report(e)
    err = capsys.readouterr().err
    assert code == 1 and "bug" not in err and "not UTF-8" in err and "'\\udce9'" in err
    assert len(err.strip().splitlines()) == 2
    code = report(UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte"))
    assert code == 70 and "bug" in capsys.readouterr().err  # other Unicode errors: ours


@requires_llama
@pytest.mark.parametrize("decoding", DECODINGS[1:], ids=["c", "strict"])
def test_chat_interactive_non_utf8_line(clean_env: dict[str, str],
                                        decoding: dict[str, str]) -> None:
    """A line that is not UTF-8 is refused in one line; the chat goes on. (In C.UTF-8,
    readline drops the bad byte itself: nothing reaches localrun to refuse.)"""
    pid, fd = pty.fork()
    if pid == 0:
        cmd = localrun_cmd()
        os.execve(cmd[0], [*cmd, "chat", "--temperature", "0", "--max-tokens", "20"],
                  {**clean_env, **decoding})
    try:
        _read_until(fd, ">>> ")
        os.write(fd, b"caf\xe9?\n")
        out = _read_until(fd, ">>> ")
        assert "error: That message is not UTF-8 text" in out and "Traceback" not in out
        os.write(fd, b"What is 2+2?\n")
        reply = _read_until(fd, ">>> ")
        assert "4" in reply or "four" in reply.lower()
        os.write(fd, b"\x04")
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        try:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
        os.close(fd)
