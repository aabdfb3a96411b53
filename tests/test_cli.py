"""The CLI as a user runs it: real processes, real engine, real model."""

from __future__ import annotations

import json
import os
import pty
import re
import select
import shlex
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import localrun_cmd, requires_llama


def cli(*args: str, stdin: str | None = None, env: dict[str, str] | None = None,
        timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*localrun_cmd(), *args], input=stdin, capture_output=True,
                          text=True, timeout=timeout, env=env)


def _commands() -> dict[str, Any]:
    """Every command the CLI registers, by name (its click command)."""
    import typer.main

    from localrun.cli import app

    group = typer.main.get_command(app)
    return dict(group.commands)  # type: ignore[attr-defined]


COMMANDS = sorted(_commands())


def test_root_help_lists_every_command() -> None:
    r = cli("--help")
    assert r.returncode == 0
    for name in COMMANDS:
        assert name in r.stdout


@pytest.mark.parametrize("command", COMMANDS)
def test_help_teaches(command: str) -> None:
    """Every command's --help has examples, and every flag an example uses exists."""
    assert len(COMMANDS) >= 9  # chat run doctor plan pull list rm generate bench
    r = cli(command, "--help", env={**os.environ, "COLUMNS": "250"})  # no wrapped lines
    assert r.returncode == 0, r.stderr
    assert "Examples:" in r.stdout, f"localrun {command} --help has no examples"
    section = r.stdout.split("Examples:", 1)[1].split("╭", 1)[0]  # up to the options box
    # each use of this command, from "localrun COMMAND" to the end of its shell command
    uses = [seg[seg.index(f"localrun {command}"):] for line in section.splitlines()
            for seg in re.split(r"[;|]", line) if f"localrun {command}" in seg]
    assert uses, f"no example of localrun {command} in:\n{section}"
    known = {opt for param in _commands()[command].params
             for opt in (*param.opts, *param.secondary_opts)}
    for use in uses:
        for word in shlex.split(use)[2:]:
            if word.startswith("-"):
                assert word.split("=", 1)[0] in known, f"{use!r}: no option {word}"


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
    assert set(out["timings"]) == {"ttft", "prefill_tps", "decode_tps", "total",
                                   "drafted_tokens", "accepted_tokens"}
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


def _read_some(fd: int, n: int, timeout: float = 90) -> str:
    """At least ``n`` more characters of output."""
    buf = ""
    end = time.monotonic() + timeout
    while len(buf) < n:
        left = end - time.monotonic()
        if left <= 0:
            raise AssertionError(f"timed out waiting for output; got {buf!r}")
        ready, _, _ = select.select([fd], [], [], left)
        if ready:
            buf += os.read(fd, 4096).decode("utf-8", "replace")
    return buf


class _PtyChat:
    """The real `localrun chat` on a pseudo-terminal, as a person types into it."""

    def __init__(self, env: dict[str, str], *args: str) -> None:
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # child: the CLI
            cmd = localrun_cmd()
            os.execve(cmd[0], [*cmd, "chat", *args], env)
        try:
            self.header = _read_until(self.fd, ">>> ")
        except BaseException:
            self.close()
            raise

    def send_bytes(self, data: bytes) -> str:
        """Write raw bytes (Ctrl-C, Ctrl-D, text that is not UTF-8); the output up to the
        next ">>> "."""
        os.write(self.fd, data)
        return _read_until(self.fd, ">>> ")

    def send(self, *lines: str) -> str:
        """Type lines (continuation lines after their "... " prompt); the output up to
        the next ">>> ", with the terminal's CR LF as LF."""
        for line in lines[:-1]:
            os.write(self.fd, line.encode() + b"\n")
            _read_until(self.fd, "... ")
        os.write(self.fd, lines[-1].encode() + b"\n")
        return _read_until(self.fd, ">>> ").replace("\r\n", "\n")

    def stats(self) -> tuple[int, int]:
        """(prompt tokens, reply tokens) of the last reply, as /stats reports them."""
        m = re.search(r"(\d+) prompt \+ (\d+) reply tokens", self.send("/stats"))
        assert m, "no token counts in /stats"
        return int(m[1]), int(m[2])

    def exit_code(self) -> int:
        _, status = os.waitpid(self.pid, 0)
        return os.waitstatus_to_exitcode(status)

    def close(self) -> None:
        if self.fd < 0:
            return
        try:
            os.kill(self.pid, 9)
            os.waitpid(self.pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
        os.close(self.fd)
        self.fd = -1


@pytest.fixture
def pty_chat() -> Iterator[Callable[..., _PtyChat]]:
    """Start `localrun chat` on a pseudo-terminal; every one started is ended after the test."""
    chats: list[_PtyChat] = []

    def begin(env: dict[str, str], *args: str) -> _PtyChat:
        chats.append(_PtyChat(env, *args))
        return chats[-1]

    yield begin
    for chat in chats:
        chat.close()


@requires_llama
def test_chat_interactive_session(clean_env: dict[str, str],
                                  pty_chat: Callable[..., _PtyChat]) -> None:
    chat = pty_chat(clean_env, "--temperature", "0", "--max-tokens", "300")
    # the model as the README names it, not the GGUF's general.name
    assert "smollm2:135m · llama.cpp" in chat.header and "Q4_1" in chat.header
    assert "Smollm2 135M" not in chat.header
    assert "/reset" in chat.send("/help")
    reply = chat.send("What is 2+2?")
    assert "4" in reply or "four" in reply.lower()
    assert "TTFT" in chat.send("/stats")
    # Ctrl-C stops a long reply and returns to the prompt; keys typed while it streams
    # are not echoed into it, and start the next line (Ctrl-C keeps them)
    os.write(chat.fd, b"Write a very long story about a dragon and a knight.\n")
    _read_until(chat.fd, "knight.")  # the line as the prompt echoed it
    _read_some(chat.fd, 20)  # the reply has started
    os.write(chat.fd, b"/sta")
    time.sleep(0.5)
    stopped = chat.send_bytes(b"\x03")
    assert "[stopped]" in stopped
    assert "/sta" not in stopped.split("[stopped]")[0]
    # "ts" completes the kept "/sta": /stats reports the cancelled reply, not the one before
    stats = chat.send("ts")
    assert "finish: cancelled (Ctrl-C)" in stats, stats
    assert "cleared" in chat.send("/reset")
    os.write(chat.fd, b"\x04")  # Ctrl-D exits
    assert chat.exit_code() == 0


PIRATE = "You are a pirate. Answer like a pirate."
CHAT_FLAGS = ("--backend", "llama.cpp", "--context", "2048", "--temperature", "0",
              "--max-tokens", "24")


def _user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


@requires_llama
def test_chat_commands_and_multiline_input(llama_model: Any, clean_env: dict[str, str],
                                          pty_chat: Callable[..., _PtyChat]) -> None:
    """/system, /reset, /exit and both multi-line forms, checked against the Python API on
    the same model and context: each reply's text and its prompt tokens (from /stats) are
    those of the conversation the command should have left."""
    greedy = {"temperature": 0, "max_tokens": 24}

    def api(messages: list[dict[str, str]]) -> Any:
        return llama_model.chat(messages, **greedy)

    system = {"role": "system", "content": PIRATE}
    q1, q2 = "What is 2+2?", "And what is 3+3?"
    plain = api([_user(q1)])
    piratical = api([system, _user(q1)])
    assert piratical.text != plain.text  # the system prompt shows in the reply
    follow_up = api([system, _user(q1), {"role": "assistant", "content": piratical.text},
                     _user(q2)])
    continued = api([_user("Answer in one word.\nWhat is the opposite of hot?")])
    block = api([_user("Translate to French:\nGood morning.")])

    chat = pty_chat(clean_env, *CHAT_FLAGS)
    assert "System prompt set; conversation cleared." in chat.send(f"/system {PIRATE}")
    assert piratical.text in chat.send(q1)
    assert chat.stats() == (piratical.usage.prompt_tokens,
                            piratical.usage.completion_tokens)
    assert follow_up.text in chat.send(q2)  # the conversation goes on
    assert chat.stats()[0] == follow_up.usage.prompt_tokens
    # /reset forgets the conversation and keeps the system prompt
    assert "Conversation cleared." in chat.send("/reset")
    assert piratical.text in chat.send(q1)
    assert chat.stats()[0] == piratical.usage.prompt_tokens
    # /system with no text removes it (and starts over)
    assert "System prompt removed." in chat.send("/system")
    assert plain.text in chat.send(q1)
    assert chat.stats()[0] == plain.usage.prompt_tokens
    # a line ending in \ continues on the next line: one message of two lines
    chat.send("/reset")
    assert continued.text in chat.send("Answer in one word.\\",
                                       "What is the opposite of hot?")
    assert chat.stats()[0] == continued.usage.prompt_tokens
    # a """ block is one message, the lines between the markers
    chat.send("/reset")
    assert block.text in chat.send('"""', "Translate to French:", "Good morning.", '"""')
    assert chat.stats()[0] == block.usage.prompt_tokens
    os.write(chat.fd, b"/exit\n")
    assert chat.exit_code() == 0


#: Candidate settings for the flag test: each is used only if leaving out any one flag
#: changes the reply (so a flag the CLI dropped could not go unnoticed). The first one
#: qualifies with llama-cpp-python 0.3.36; the others are spares for another build.
FLAG_SETS: tuple[dict[str, Any], ...] = (
    {"seed": 7, "temperature": 1.2, "top_p": 0.85, "top_k": 5, "min_p": 0.3,
     "repetition_penalty": 1.3},
    {"seed": 7, "temperature": 1.2, "top_p": 0.95, "top_k": 8, "min_p": 0.2,
     "repetition_penalty": 1.3},
    {"seed": 11, "temperature": 1.1, "top_p": 0.9, "top_k": 6, "min_p": 0.25,
     "repetition_penalty": 1.4},
)
FLAG_PROMPT = "Describe the sea."
FLAG_SYSTEM = "You are a pirate."
FLAG_TOKENS = 12


@requires_llama
def test_sampling_flags_reach_the_engine(llama_model: Any, default_gguf: Path,
                                         clean_env: dict[str, str], tmp_path: Path) -> None:
    """--seed --system --temperature --top-p --top-k --min-p --repetition-penalty, given
    together to run, chat and generate, give the reply the API gives with those options;
    leaving out any one of them would give another reply. (--context and --backend: the
    loaded model's info; --max-tokens and --stop: other tests.)"""

    def api(system: bool, **kw: Any) -> str:
        head = [{"role": "system", "content": FLAG_SYSTEM}] if system else []
        return str(llama_model.chat([*head, _user(FLAG_PROMPT)], max_tokens=FLAG_TOKENS,
                                    **kw).text)

    chosen = expected = None
    for flags in FLAG_SETS:
        expected = api(True, **flags)
        without = [api(True, **{k: v for k, v in flags.items() if k != name})
                   for name in flags if name != "seed"]
        without += [api(True, **{**flags, "seed": flags["seed"] + 1}), api(False, **flags)]
        if expected not in without:
            chosen = flags
            break
    assert chosen is not None and expected, (
        "no setting in FLAG_SETS where every flag changes the reply: add one that does")
    args = ["--backend", "llama.cpp", "--context", "2048", "--max-tokens", str(FLAG_TOKENS),
            "--system", FLAG_SYSTEM]
    for name, value in chosen.items():
        args += [f"--{name.replace('_', '-')}", str(value)]

    r = cli("run", str(default_gguf), FLAG_PROMPT, *args, "--json", env=clean_env)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["text"] == expected
    assert (out["info"]["backend"], out["info"]["context_length"]) == ("llama.cpp", 2048)
    r = cli("chat", str(default_gguf), *args, stdin=FLAG_PROMPT, env=clean_env)
    assert r.returncode == 0, r.stderr
    assert r.stdout == expected + "\n"
    (tmp_path / "in.txt").write_text(FLAG_PROMPT + "\n")
    r = cli("generate", str(default_gguf), "-i", str(tmp_path / "in.txt"), "-o",
            str(tmp_path / "out.jsonl"), "--no-progress", *args, env=clean_env)
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / "out.jsonl").read_text())["text"] == expected


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
    cases: tuple[list[bytes | str], ...] = (
        ["run", "smollm2:135m", b"caf\xe9"],
        ["run", "smollm2:135m", "hi", "--system", b"caf\xe9"],
        ["chat", "--system", b"caf\xe9"])
    for args in cases:
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
def test_chat_interactive_non_utf8_line(clean_env: dict[str, str], decoding: dict[str, str],
                                        pty_chat: Callable[..., _PtyChat]) -> None:
    """A line that is not UTF-8 is refused in one line; the chat goes on. (In C.UTF-8,
    readline drops the bad byte itself: nothing reaches localrun to refuse.)"""
    chat = pty_chat({**clean_env, **decoding}, "--temperature", "0", "--max-tokens", "20")
    out = chat.send_bytes(b"caf\xe9?\n")
    assert "error: That message is not UTF-8 text" in out and "Traceback" not in out
    reply = chat.send("What is 2+2?")
    assert "4" in reply or "four" in reply.lower()
    os.write(chat.fd, b"\x04")
    assert chat.exit_code() == 0
