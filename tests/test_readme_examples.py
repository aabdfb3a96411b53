"""Every fenced code block of README.md runs, as a reader would run it (issue 25 item 2).

Blocks are found by their fences; each is one test, named by its line and language. A
block that cannot run here is marked in the README by an HTML comment on the line(s)
before its fence — ``<!-- readme-test: skip: WHY -->`` — and the test is skipped with
that reason. A new block runs by default; one in a language this runner does not know
fails until it is marked.

How each kind of block runs:

- ``console``: every ``$ command`` (with ``\\`` continuation lines) runs in bash
  (``-o pipefail``) in a fresh folder under pytest's tmp_path, with this venv's
  ``localrun`` first on PATH; the lines under a command are its output as the README
  shows it, compared with what it printed (stdout and stderr together). A shown output
  whose first line is ``error: …`` expects a non-zero exit, anything else exit 0.
  ``$ cat FILE`` shows a file the reader writes: when FILE is not there the runner
  writes it from the shown lines first (``prompts.jsonl``, ``person.json``).
  Commands read ``y`` on stdin (the answer to ``localrun rm``'s question) unless they
  pipe their own. A command whose output has ``>>> `` lines (``localrun chat``) runs
  on a pseudo-terminal: each ``>>> line`` is typed, then Ctrl-D.
- ``bash`` / ``sh``: every line (``\\`` continued; ``$ `` optional) runs as above, exit 0.
- ``python``: the block runs in a subprocess (its own file, this venv's Python). A
  comment at the end of a ``print(...)`` call shows what that call prints: each print's
  text is compared with it; comments elsewhere are just comments.

Where things come from: the Hugging Face Hub is ``tests/hubserver.py``'s stand-in
(``HF_ENDPOINT``; its standard repos plus the ones the README names: the datacenter
models, ``mlx-community/Qwen2.5-7B-Instruct-4bit``, a ``Q5_K_M`` in
``Qwen/Qwen2.5-7B-Instruct-GGUF``) with a private ``HF_HOME`` per block; the embedded
model is the one on this machine. ``localrun serve`` runs once for the module, on
127.0.0.1 and a free port (``--port 0`` added): a ``$ localrun serve`` command is
checked against its startup output, and ``8799`` in any block (URLs, output) is
rewritten to the port it got. It stops (SIGINT, then SIGKILL) when the module ends.

Tolerance when comparing shown output with real output (the same for ``print``
comments):

- lines are compared stripped, blank lines ignored, runs of spaces match any spaces;
- ``…`` or ``...`` inside a line matches any text; a line that is only ``…``/``...``
  matches any number of lines (the README shortened the output there);
- every number matches any number (timings, rates, sizes, token counts, versions, ports
  and clock times vary with the machine, the load and the release);
- the shown lines must appear in order and adjacent (but for ``…`` lines) somewhere in
  the output: lines before and after them are allowed;
- model text is compared exactly where the call is greedy (``--temperature 0``,
  ``-t 0``, ``temperature=0``: the embedded model answers the same on every run); in a
  chat transcript of a sampled model, the lines after a typed message are its reply and
  only need to be there (at least one line);
- ``<!-- readme-test: labels: WHY -->`` (output describing the machine it ran on,
  ``localrun doctor``): only each unindented line up to its first ``:`` is compared, in
  order, each matching the start of a later output line.
"""

from __future__ import annotations

import ast
import io
import json
import os
import pty
import re
import select
import shlex
import signal
import subprocess
import sys
import time
import tokenize
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.hubserver import (
    QWEN_CONFIG,
    FakeFile,
    FakeRepo,
    HubServer,
    _json_file,
    _sharded_safetensors,
    _text,
    add_datacenter_models,
    gguf_bytes,
    hub_env,
    standard_hub,
)

ROOT = Path(__file__).resolve().parent.parent
#: LOCALRUN_README_UNDER_TEST checks another copy (e.g. an older commit's, to see the
#: blocks that failed as written there).
README = Path(os.environ.get("LOCALRUN_README_UNDER_TEST") or ROOT / "README.md")
#: One command (or one python block) may take this long; the whole file stays within a
#: few minutes on an idle 2-core machine (the embedded 135M model, short replies).
COMMAND_TIMEOUT = 300.0
#: The longest wait for `localrun serve`'s banner, and for its exit after SIGINT.
SERVE_WAIT = 180.0
README_PORT = "8799"

FENCE = re.compile(r"^```([\w+-]*)\s*$")
DIRECTIVE = re.compile(r"^<!--\s*readme-test:\s*(\w+)\s*:\s*(.+?)\s*-->\s*$")
KINDS = ("skip", "labels")
GREEDY = re.compile(r"(?:--temperature|-t)[ =]0(?:\.0*)?(?![\d.])|temperature\s*=\s*0(?![\d.])"
                    r"|\"temperature\":\s*0(?![\d.])")
NUMBER = r"(?<![\w.])(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)*(?!\w)"
TOKEN = re.compile(r"\.\.\.|…|" + NUMBER + r"|[ \t]+")
ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)|\x1b[=>]")
GAP = object()
REPLY = object()


# --- the README's blocks ---


@dataclass
class Block:
    line: int  #: the opening fence's line number (1-based)
    lang: str
    lines: list[str]
    directive: tuple[str, str] | None = None

    @property
    def text(self) -> str:
        return "\n".join(self.lines) + "\n"

    @property
    def id(self) -> str:
        first = next((ln for ln in self.lines if ln.strip()), "")
        slug = re.sub(r"[^\w.:+-]+", "-", first.removeprefix("$ "))[:40].strip("-")
        return f"L{self.line}-{self.lang or 'plain'}-{slug}"


def readme_blocks(text: str) -> list[Block]:
    """The fenced blocks, each with the readme-test comment right before it (if any)."""
    blocks: list[Block] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start = i
        i += 1
        body: list[str] = []
        while i < len(lines) and not lines[i].startswith("```"):
            body.append(lines[i])
            i += 1
        before = next((ln for ln in reversed(lines[:start]) if ln.strip()), "")
        blocks.append(Block(start + 1, m.group(1), body, _directive(before, start)))
        i += 1
    return blocks


def _directive(line: str, fence: int) -> tuple[str, str] | None:
    if "readme-test" not in line:
        return None
    m = DIRECTIVE.match(line.strip())
    if not m or m.group(1) not in KINDS:
        raise AssertionError(f"README.md line {fence}: unreadable marker {line!r}; write "
                             f"<!-- readme-test: KIND: WHY --> with KIND one of {KINDS}")
    return m.group(1), m.group(2)


BLOCKS = readme_blocks(README.read_text(encoding="utf-8"))


# --- comparing shown output with real output ---


def clean(text: str) -> list[str]:
    """Output as lines: escape codes out, each line as its last carriage return left it,
    stripped, blank lines dropped."""
    out = []
    for line in ANSI.sub("", text).replace("\r\n", "\n").split("\n"):
        line = line.split("\r")[-1].strip()
        if line:
            out.append(line)
    return out


def line_pattern(shown: str) -> str:
    """One shown line (stripped) as a regular expression, with the tolerance rules."""
    out = []
    pos = 0
    for m in TOKEN.finditer(shown):
        out.append(re.escape(shown[pos:m.start()]))
        tok = m.group()
        out.append(".*?" if tok in ("...", "…") else r"[ \t]+" if tok.isspace() else NUMBER)
        pos = m.end()
    out.append(re.escape(shown[pos:]))
    return "".join(out)


def _is_gap(line: str) -> bool:
    return line.strip() in ("...", "…")


def block_regex(shown: list[Any]) -> re.Pattern[str]:
    """Shown lines (strings, GAP, REPLY) as one regex over the cleaned output's lines."""
    parts: list[str] = []
    gap = False
    for item in shown:
        if item is GAP:
            gap = True
            continue
        pat = r".+(?:\n.+)*?" if item is REPLY else line_pattern(item) + r"[ \t]*"
        if parts:
            parts.append(r"\n(?:[^\n]*\n)*?" if gap else r"\n")
        parts.append(pat + "$" if item is not REPLY else pat)
        gap = False
    return re.compile(r"(?m)^" + "".join(parts))


def shown_items(shown: list[str], *, chat_replies: bool) -> list[Any]:
    """Shown output lines -> patterns: gaps, and (in a sampled chat) replies."""
    items: list[Any] = []
    in_reply = False
    for line in shown:
        s = line.strip()
        if not s:
            continue
        if _is_gap(s):
            items.append(GAP)
        elif s.startswith(">>> "):
            items.append(s)
            in_reply = chat_replies and not s[4:].startswith("/")
            if in_reply:
                items.append(REPLY)
        elif not in_reply:
            items.append(s)
    return items


def compare(shown: list[str], actual: str, *, labels: bool = False,
            chat_replies: bool = False) -> str | None:
    """None if the output shows what the README shows, else what is missing."""
    got = clean(actual)
    if labels:
        return _compare_labels(shown, got)
    items = shown_items(shown, chat_replies=chat_replies)
    text = "\n".join(got)
    if not items or block_regex(items).search(text):
        return None
    # the longest run of shown lines that is there, to say which line is not
    for n in range(1, len(items) + 1):
        if not block_regex(items[:n]).search(text):
            missing = items[n - 1]
            what = "a reply" if missing is REPLY else repr(missing)
            return (f"the README shows {what} (after {n - 1} matching lines), the output "
                    "has not:\n" + text)
    return "no match:\n" + text


def _compare_labels(shown: list[str], got: list[str]) -> str | None:
    at = 0
    for line in shown:
        if not line.strip() or line[:1].isspace() or _is_gap(line):
            continue
        label = line.strip().split(":", 1)[0]
        pat = re.compile(line_pattern(label))
        while at < len(got) and not pat.match(got[at]):
            at += 1
        if at == len(got):
            return f"no line starting {label!r} (in order) in the output:\n" + "\n".join(got)
        at += 1
    return None


# --- console and bash blocks ---


@dataclass
class Command:
    text: str
    output: list[str] = field(default_factory=list)


def console_commands(block: Block) -> list[Command]:
    commands: list[Command] = []
    lines = iter(block.lines)
    for line in lines:
        if block.lang == "console" and not line.startswith("$ "):
            if commands:
                commands[-1].output.append(line)
            elif line.strip():
                raise AssertionError(f"README.md line {block.line}: output before any "
                                     f"'$ command': {line!r}")
            continue
        text = line.removeprefix("$ ")
        if not text.strip() or text.lstrip().startswith("#"):
            continue
        while text.endswith("\\"):
            text = text[:-1] + next(lines).strip()  # "\" joins lines; the shell would too
        commands.append(Command(text))
    return commands


def run_command(cmd: Command, cwd: Path, env: dict[str, str]) -> tuple[int, str]:
    m = re.fullmatch(r"cat ([\w.-]+)", cmd.text.strip())
    if m and not (cwd / m.group(1)).exists():
        (cwd / m.group(1)).write_text("\n".join(cmd.output).strip("\n") + "\n",
                                      encoding="utf-8")
    if any(line.startswith(">>> ") for line in cmd.output):
        return run_on_pty(cmd, cwd, env)
    try:
        r = subprocess.run(["bash", "-o", "pipefail", "-c", cmd.text], cwd=cwd, env=env,
                           input="y\n", stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True, timeout=COMMAND_TIMEOUT, start_new_session=True)
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"{cmd.text!r} ran past {COMMAND_TIMEOUT:.0f} s:\n"
                             f"{e.output}") from None
    return r.returncode, r.stdout


def _read_until(fd: int, proc: subprocess.Popen[bytes], marker: str | None,
                deadline: float, buf: list[str]) -> None:
    """Read the terminal into ``buf`` until ``marker`` shows after what was there, or (None)
    until the program closes it."""
    start = len("".join(buf))
    while marker is None or marker not in ANSI.sub("", "".join(buf)[start:]):
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"waited {COMMAND_TIMEOUT:.0f} s for {marker!r}; the "
                                 f"terminal shows:\n{''.join(buf)}")
        ready, _, _ = select.select([fd], [], [], min(left, 1.0))
        if not ready:
            if marker is None and proc.poll() is not None:
                return
            continue
        try:
            data = os.read(fd, 4096)
        except OSError:  # EIO: the program closed the terminal
            data = b""
        if not data:
            if marker is None:
                return
            raise AssertionError(f"the program ended before {marker!r}:\n{''.join(buf)}")
        buf.append(data.decode("utf-8", "replace"))


def run_on_pty(cmd: Command, cwd: Path, env: dict[str, str]) -> tuple[int, str]:
    """Type each ``>>> `` line the README shows, then Ctrl-D; the whole transcript."""
    typed = [line.strip()[4:] for line in cmd.output if line.startswith(">>> ")]
    master, slave = pty.openpty()
    proc = subprocess.Popen(["bash", "-c", cmd.text], cwd=cwd, env=env, stdin=slave,
                            stdout=slave, stderr=slave, start_new_session=True)
    os.close(slave)
    buf: list[str] = []
    deadline = time.monotonic() + COMMAND_TIMEOUT
    try:
        _read_until(master, proc, ">>> ", deadline, buf)
        for text in typed:
            os.write(master, text.encode() + b"\n")
            _read_until(master, proc, ">>> ", deadline, buf)
        os.write(master, b"\x04")
        _read_until(master, proc, None, deadline, buf)
        return proc.wait(timeout=max(1.0, deadline - time.monotonic())), "".join(buf)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        os.close(master)


# --- python blocks ---

#: Runs a block as a script; every print() made by the block's own code is also written,
#: with its line number, to a JSON-lines file.
PRINT_HOOK = """
import builtins, json, runpy, sys
block, log = sys.argv[1], sys.argv[2]
_print = builtins.print
def _hooked(*args, sep=" ", end="\\n", file=None, flush=False):
    frame = sys._getframe(1)
    if file is None and frame.f_code.co_filename == block:
        text = (" " if sep is None else sep).join(map(str, args))
        with open(log, "a", encoding="utf-8") as f:
            f.write(json.dumps([frame.f_lineno, text]) + "\\n")
    _print(*args, sep=sep, end=end, file=file, flush=flush)
builtins.print = _hooked
sys.argv = [block]
runpy.run_path(block, run_name="__main__")
"""


def print_comments(source: str) -> list[tuple[int, int, str]]:
    """(first line, last line, comment) of each print(...) call with a comment on its line(s)."""
    comments: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string[1:].strip()
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                and node.func.id == "print":
            end = node.end_lineno or node.lineno
            shown = next((comments[n] for n in range(end, node.lineno - 1, -1)
                          if n in comments), None)
            if shown is not None:
                out.append((node.lineno, end, shown))
    return out


def run_python(source: str, cwd: Path, env: dict[str, str]) -> None:
    script = cwd / "readme_block.py"
    script.write_text(source, encoding="utf-8")
    log = cwd / "prints.jsonl"
    log.unlink(missing_ok=True)
    try:
        r = subprocess.run([sys.executable, "-c", PRINT_HOOK, str(script), str(log)], cwd=cwd,
                           env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True, timeout=COMMAND_TIMEOUT, start_new_session=True)
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"the block ran past {COMMAND_TIMEOUT:.0f} s:\n{e.output}") from None
    assert r.returncode == 0, f"the block failed (exit {r.returncode}):\n{r.stdout}"
    printed = [json.loads(ln) for ln in log.read_text(encoding="utf-8").splitlines()] \
        if log.exists() else []
    greedy = bool(GREEDY.search(source))
    for first, last, shown in print_comments(source):
        texts = [t for n, t in printed if first <= n <= last]
        assert texts, f"block line {first}: print(...) # {shown} never ran\n{r.stdout}"
        for text in texts:
            if not re.fullmatch(r"\s*" + line_pattern(shown) + r"\s*", text, re.S):
                raise AssertionError(
                    f"block line {first}: the README says it prints\n  {shown}\nit printed\n"
                    f"  {text}" + ("" if greedy else "\n(the block samples: no temperature=0)"))


# --- the stand-in Hub and the server ---


def readme_hub() -> Any:
    """The standard stand-in Hub plus the repos the README's commands name."""
    hub = standard_hub()
    add_datacenter_models(hub)
    shape7b = {"hidden_size": 3584, "num_hidden_layers": 28, "num_attention_heads": 28,
               "num_key_value_heads": 4, "max_position_embeddings": 32768}
    bits4 = {"group_size": 64, "bits": 4}
    mlx = _sharded_safetensors(4_283_175_393, 2)
    mlx.update({"config.json": _json_file({**QWEN_CONFIG, **shape7b, "quantization": bits4,
                                           "quantization_config": bits4}),
                "tokenizer.json": _json_file({"v": 1}), "README.md": _text("# mlx")})
    hub.add(FakeRepo("mlx-community/Qwen2.5-7B-Instruct-4bit", {"main": mlx},
                     tags=["mlx", "safetensors",
                           "base_model:quantized:Qwen/Qwen2.5-7B-Instruct"], downloads=300))
    hub.repos["Qwen/Qwen2.5-7B-Instruct-GGUF"].branches["main"][
        "qwen2.5-7b-instruct-q5_k_m.gguf"] = FakeFile(gguf_bytes(
            quant="Q5_K_M", layers=28, heads=28, kv_heads=4, embedding=3584, pad=5000), lfs=True)
    return hub


@pytest.fixture(scope="module")
def hub_url() -> Iterator[str]:
    with HubServer(readme_hub()) as url:
        yield url


def base_env(hub_url: str, home: Path) -> dict[str, str]:
    env = hub_env(hub_url, home / "hf")
    env.pop("LOCALRUN_DEBUG", None)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.update({"COLUMNS": "400", "PYTHONUNBUFFERED": "1", "NO_COLOR": "1",
                "LOCALRUN_HOME": str(home / "localrun-home")})
    return env


@dataclass
class Server:
    port: str
    log: Path

    def output(self) -> str:
        return self.log.read_text(encoding="utf-8", errors="replace")


def serve_command() -> str:
    """The README's `$ localrun serve ...` (the first), else the plainest one."""
    for block in BLOCKS:
        if block.lang == "console":
            for cmd in console_commands(block):
                if cmd.text.startswith("localrun serve"):
                    return cmd.text
    return "localrun serve smollm2:135m"


@pytest.fixture(scope="module")
def readme_server(hub_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    pytest.importorskip("fastapi", reason="the serve extra is not installed "
                        "(pip install -e '.[serve]')")
    home = tmp_path_factory.mktemp("readme-serve")
    log = home / "serve.log"
    cmd = [*shlex.split(serve_command().split("#", 1)[0]), "--port", "0"]
    with log.open("w", encoding="utf-8") as out:
        proc = subprocess.Popen(cmd, cwd=home, env=base_env(hub_url, home),
                                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + SERVE_WAIT
        text = ""
        while not re.search(r"^Ctrl-C", text, re.M):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"{' '.join(cmd)} did not start within {SERVE_WAIT:.0f} "
                                     f"s (exit {proc.poll()}):\n{text}")
            time.sleep(0.2)
            text = log.read_text(encoding="utf-8", errors="replace")
        port = re.search(r"http://127\.0\.0\.1:(\d+)", text)
        assert port, text
        yield Server(port.group(1), log)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(timeout=SERVE_WAIT)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


# --- the test ---


def _with_port(text: str, port: str | None) -> str:
    return text if port is None else re.sub(rf"(?<=:){README_PORT}\b", port, text)


@pytest.mark.parametrize("block", BLOCKS, ids=[b.id for b in BLOCKS])
def test_readme_block(block: Block, hub_url: str, tmp_path: Path,
                      request: pytest.FixtureRequest) -> None:
    kind, why = block.directive or ("", "")
    if kind == "skip":
        pytest.skip(f"README.md line {block.line}: {why}")
    env = base_env(hub_url, tmp_path)
    work = tmp_path / "work"
    work.mkdir()
    server: Server | None = None
    if README_PORT in block.text or any(
            c.text.startswith("localrun serve") for c in console_commands(block)
            if block.lang == "console"):
        server = request.getfixturevalue("readme_server")
    port = server.port if server else None
    if block.lang == "python":
        run_python(_with_port(block.text, port), work, env)
        return
    if block.lang not in ("console", "bash", "sh", "shell"):
        raise AssertionError(f"README.md line {block.line}: no runner for a {block.lang!r} "
                             "block; mark it <!-- readme-test: skip: WHY --> if it cannot run")
    for cmd in console_commands(block):
        cmd = Command(_with_port(cmd.text, port), [_with_port(o, port) for o in cmd.output])
        if cmd.text.startswith("localrun serve"):
            assert server is not None
            rc, out = 0, server.output()
        else:
            rc, out = run_command(cmd, work, env)
        expect_error = next((o.strip() for o in cmd.output if o.strip()), "").startswith(
            "error:")
        if expect_error:
            assert rc != 0, f"$ {cmd.text}: the README shows an error, it exited 0:\n{out}"
        else:
            assert rc == 0, f"$ {cmd.text}: exit {rc}:\n{out}"
        problem = compare(cmd.output, out, labels=kind == "labels",
                          chat_replies=not GREEDY.search(cmd.text))
        assert problem is None, f"README.md line {block.line}: $ {cmd.text}: {problem}"


# --- the runner's own rules, on small inputs (no model) ---


def test_tolerance_rules() -> None:
    assert compare(["The answer is 4."], "noise\nThe answer is 4.\n") is None
    assert compare(["took 0.05 s at 220.4 tok/s, 8,192 tokens, llama.cpp 0.3.36"],
                   "took 1.5 s at 9 tok/s, 16,384 tokens, llama.cpp 0.4.0") is None
    assert compare(["a", "...", "d"], "a\nb\nc\nd") is None
    assert compare(["a", "d"], "a\nb\nd") is not None  # adjacent unless a gap is shown
    assert compare(['{"id": "chatcmpl-…", "n": 3}'], '{"id": "chatcmpl-x1", "n": 5}') is None
    assert compare(["Oslo"], "Norway") is not None
    assert compare(["smollm2:135m"], "smollm2:13m") is not None  # digits in names are literal
    chat = [">>> hi", "Hello there.", ">>> /stats", "1 prompt + 2 reply tokens"]
    said = ">>> hi\nSomething else\nentirely\n>>> /stats\n9 prompt + 7 reply tokens\n>>> "
    assert compare(chat, said, chat_replies=True) is None
    assert compare(chat, said) is not None
    assert compare(chat, ">>> hi\n>>> /stats\n9 prompt + 7 reply tokens", chat_replies=True)
    doctor = ["Host: Linux", "CPU: Xeon", "  detail: x", "Engines", "  ✓ a"]
    assert compare(doctor, "Host: macOS\nCPU: M2\nMemory: 8\nEngines\n", labels=True) is None
    assert compare(doctor, "CPU: M2\nHost: macOS\nEngines\n", labels=True) is not None


def test_print_comments_are_found_per_call() -> None:
    src = ('x = 1  # not a print\nprint(x)  # 1\nprint(x,\n      x)  # 1 1\nprint(x)\n')
    assert print_comments(src) == [(2, 2, "1"), (3, 4, "1 1")]


def test_a_print_comment_is_what_the_print_shows(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    run_python("x = [1, 2]\nprint(\n    x)  # [1, 2]\nprint(len(x))  # 3\n", tmp_path, env)
    with pytest.raises(AssertionError, match=r"it printed\n  \[1, 2, 3\]"):
        run_python("print([1, 2, 3])  # ['a', 'b']\n", tmp_path, env)
    with pytest.raises(AssertionError, match="never ran"):
        run_python("if False:\n    print(1)  # 1\n", tmp_path, env)
    with pytest.raises(AssertionError, match="the block failed"):
        run_python("raise SystemExit(3)\n", tmp_path, env)


def test_every_block_has_a_runner_or_a_reason() -> None:
    assert len(BLOCKS) >= 15, "the README's code blocks were not found"
    for b in BLOCKS:
        if b.directive is None:
            assert b.lang in ("console", "bash", "sh", "shell", "python"), b.id
        else:
            assert len(b.directive[1]) >= 15, f"{b.id}: say why ({b.directive[1]!r})"
