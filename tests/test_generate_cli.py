"""`localrun generate` as a user runs it: real processes, real engine, the embedded model;
and on OpenVINO, whose continuous batching runs several prompts at once."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import localrun_cmd, requires_llama

FLAGS = ("--backend", "llama.cpp", "--context", "1024", "-t", "0", "--no-progress")
QUESTIONS = ["What is 2+2?", "What is the opposite of hot?", "How many legs does a dog have?",
             "What color is the sky on a clear day?", "Name a fruit.", "Name a colour.",
             "What is the capital of France?", "Say hello.", "Name an animal.",
             "What is 3+3?", "Name a planet.", "What do bees make?"]


def generate(model: Path, inp: Path, out: Path, *extra: str, env: dict[str, str] | None = None,
             timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*localrun_cmd(), "generate", str(model), "-i", str(inp), "-o",
                           str(out), *FLAGS, *extra], capture_output=True, text=True,
                          timeout=timeout, env=env)


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n"
                            for r in rows), encoding="utf-8")
    return path


def results(path: Path) -> list[dict[str, Any]]:
    raw = path.read_text(encoding="utf-8")
    assert raw.endswith("\n"), "the output ends with a partial line"
    return [json.loads(line) for line in raw.splitlines()]


def assert_valid(row: dict[str, Any]) -> None:
    assert "error" not in row, row
    assert isinstance(row["text"], str) and row["finish_reason"] in ("stop", "length")
    assert row["usage"]["prompt_tokens"] > 0 and row["usage"]["completion_tokens"] > 0
    assert row["timings"]["total"] > 0


def assert_each_once(path: Path, ids: list[Any]) -> list[dict[str, Any]]:
    rows = results(path)
    assert sorted(map(str, (r["id"] for r in rows))) == sorted(map(str, ids))
    for r in rows:
        assert_valid(r)
    return rows


@requires_llama
def test_jsonl_with_overrides_and_malformed_lines(default_gguf: Path, tmp_path: Path) -> None:
    inp = write_jsonl(tmp_path / "in.jsonl", [
        {"id": "a", "prompt": "Write a long story about a dragon.", "max_tokens": 3},
        {"id": "b", "messages": [{"role": "user", "content": "Count from 1 to 10, "
                                  "separated by commas."}], "stop": ["5"]},
        "{not json",
        {"id": "c", "prompt": "Hi", "temperature": -1},
        {"id": "d", "prompt": "Hi", "temprature": 1},
        "",
        {"prompt": "What is 2+2?"},
    ])
    out = tmp_path / "out.jsonl"
    r = generate(default_gguf, inp, out, "-n", "16")
    assert r.returncode == 1, r.stderr  # some lines failed
    assert "Traceback" not in r.stderr
    assert "done 3 · failed 3 · skipped 0" in r.stderr
    assert "--retry-failed" in r.stderr
    rows = {json.dumps(row["id"]): row for row in results(out)}
    assert rows['"a"']["usage"]["completion_tokens"] == 3  # per-line max_tokens honoured
    assert rows['"a"']["finish_reason"] == "length"
    assert rows['"b"']["finish_reason"] == "stop" and "5" not in rows['"b"']["text"]
    assert rows["7"]["usage"]["completion_tokens"] <= 16  # no id: its line number
    assert_valid(rows["7"])
    assert rows["null"]["line"] == 3 and "JSON" in rows["null"]["error"]
    assert rows['"c"']["line"] == 4 and "temperature" in rows['"c"']["error"]
    assert rows['"d"']["line"] == 5 and "temprature" in rows['"d"']["error"]
    # A re-run has nothing left to do and leaves the file as it was.
    before = out.read_bytes()
    r = generate(default_gguf, inp, out)
    assert r.returncode == 0 and "nothing to do" in r.stderr
    assert out.read_bytes() == before


@requires_llama
def test_plain_text_input(default_gguf: Path, tmp_path: Path) -> None:
    inp = tmp_path / "prompts.txt"
    inp.write_text("What is 2+2?\n\nName a fruit.\n", encoding="utf-8")
    out = tmp_path / "out.jsonl"
    r = generate(default_gguf, inp, out, "-n", "8")
    assert r.returncode == 0, r.stderr
    rows = assert_each_once(out, [1, 3])  # ids are line numbers: stable for resume
    assert [row["id"] for row in rows] == [1, 3]


@requires_llama
def test_duplicate_ids_refused_before_anything_runs(default_gguf: Path, tmp_path: Path) -> None:
    inp = write_jsonl(tmp_path / "in.jsonl", [{"id": "x", "prompt": "Hi"},
                                              {"id": "y", "prompt": "Hi"},
                                              {"id": "x", "prompt": "Hello"}])
    out = tmp_path / "out.jsonl"
    out.write_text('{"id": "old", "text": "kept"}\n', encoding="utf-8")
    r = generate(default_gguf, inp, out)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("error: ") and lines[1].strip().startswith(
        "hint: ")
    assert "'x'" in lines[0] and "lines 1 and 3" in lines[0]
    assert out.read_text(encoding="utf-8") == '{"id": "old", "text": "kept"}\n'


@requires_llama
def test_fail_fast_on_malformed_line_runs_nothing(default_gguf: Path, tmp_path: Path) -> None:
    inp = write_jsonl(tmp_path / "in.jsonl", [{"id": 1, "prompt": "Hi"}, "[1, 2]"])
    out = tmp_path / "out.jsonl"
    r = generate(default_gguf, inp, out, "--fail-fast")
    assert r.returncode == 1 and "Line 2" in r.stderr and "Traceback" not in r.stderr
    assert not out.exists()


@requires_llama
def test_partial_last_line_is_redone(default_gguf: Path, tmp_path: Path) -> None:
    inp = write_jsonl(tmp_path / "in.jsonl", [{"id": i, "prompt": q}
                                              for i, q in enumerate(QUESTIONS[:3])])
    out = tmp_path / "out.jsonl"
    r = generate(default_gguf, inp, out, "-n", "8")
    assert r.returncode == 0, r.stderr
    first, second, _ = out.read_text(encoding="utf-8").splitlines(keepends=True)
    out.write_text(first + second[: len(second) // 2], encoding="utf-8")  # as if killed
    r = generate(default_gguf, inp, out, "-n", "8")
    assert r.returncode == 0, r.stderr
    assert "incomplete last line" in r.stderr and "skipped 1" in r.stderr
    rows = assert_each_once(out, [0, 1, 2])
    assert rows[0] == json.loads(first)  # what was complete is kept as it was


def _kill_midway(cmd: list[str], out: Path, sig: int, min_lines: int) -> int:
    # Ctrl-C reaches it even where the suite itself ignores SIGINT (started in the
    # background by a shell: its children inherit the ignore, and Python then installs
    # no KeyboardInterrupt handler: the run finished, exit 0)
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 240
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            if out.exists() and out.read_bytes().count(b"\n") >= min_lines:
                break
            time.sleep(0.05)
        assert proc.poll() is None, "the run finished before it could be interrupted"
        os.kill(proc.pid, sig)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode


@requires_llama
def test_sigkill_midway_then_resume(default_gguf: Path, tmp_path: Path) -> None:
    ids = [f"q{i}" for i in range(len(QUESTIONS))]
    inp = write_jsonl(tmp_path / "in.jsonl", [{"id": i, "prompt": q}
                                              for i, q in zip(ids, QUESTIONS, strict=True)])
    out = tmp_path / "out.jsonl"
    cmd = [*localrun_cmd(), "generate", str(default_gguf), "-i", str(inp), "-o", str(out),
           *FLAGS, "-n", "24", "-j", "2"]  # two at a time: work left after two lines
    rc = _kill_midway(cmd, out, signal.SIGKILL, 2)
    assert rc == -signal.SIGKILL
    done_before = out.read_bytes().count(b"\n")
    assert 2 <= done_before < len(ids)
    r = generate(default_gguf, inp, out, "-n", "24")
    assert r.returncode == 0, r.stderr
    assert f"skipped {done_before}" in r.stderr
    assert_each_once(out, ids)


@requires_llama
def test_ctrl_c_saves_and_tells_how_to_resume(default_gguf: Path, tmp_path: Path) -> None:
    ids = list(range(len(QUESTIONS)))
    inp = write_jsonl(tmp_path / "in.jsonl", [{"id": i, "prompt": q}
                                              for i, q in zip(ids, QUESTIONS, strict=True)])
    out = tmp_path / "out.jsonl"
    # two at a time: work is left when the first line lands
    cmd = [*localrun_cmd(), "generate", str(default_gguf), "-i", str(inp), "-o", str(out),
           *FLAGS, "-n", "24", "-j", "2"]
    proc_rc = _kill_midway(cmd, out, signal.SIGINT, 1)
    assert proc_rc == 130
    rows = results(out)  # whole lines only
    assert 1 <= len(rows) < len(ids)
    r = generate(default_gguf, inp, out, "-n", "24")
    assert r.returncode == 0, r.stderr
    assert_each_once(out, ids)


@requires_llama
def test_retry_failed_replaces_error_lines(default_gguf: Path, tmp_path: Path) -> None:
    inp = tmp_path / "in.jsonl"
    write_jsonl(inp, [{"id": "a", "prompt": "Hi", "max_tokens": 0}, {"id": "b", "prompt": "Hi"}])
    out = tmp_path / "out.jsonl"
    assert generate(default_gguf, inp, out, "-n", "4").returncode == 1
    write_jsonl(inp, [{"id": "a", "prompt": "Hi", "max_tokens": 2}, {"id": "b", "prompt": "Hi"}])
    r = generate(default_gguf, inp, out, "-n", "4")
    assert "nothing to do" in r.stderr and "1 failed" in r.stderr
    r = generate(default_gguf, inp, out, "-n", "4", "--retry-failed")
    assert r.returncode == 0, r.stderr
    assert_each_once(out, ["a", "b"])


@requires_llama
@pytest.mark.parametrize("bad", [["--concurrency", "0"], ["--temperature", "-1"],
                                 ["--format", "csv"]])
def test_bad_flags_one_line(default_gguf: Path, tmp_path: Path, bad: list[str]) -> None:
    inp = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "Hi"}])
    out = tmp_path / "out.jsonl"
    r = generate(default_gguf, inp, out, *bad)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert r.stderr.startswith("error: ") and "hint: " in r.stderr
    assert not out.exists()


@requires_llama
def test_lines_that_are_not_utf8_fail_alone(default_gguf: Path, tmp_path: Path) -> None:
    """Issue 11, item 10: a Latin-1 byte or a lone surrogate escape fails its own line in
    one clear sentence; the other lines run. (A UTF-8 BOM and a raw U+2028 inside a JSON
    string are valid UTF-8 and run too.)"""
    inp = tmp_path / "in.jsonl"
    inp.write_bytes(b"\xef\xbb\xbf" + b'{"id": "ok", "prompt": "Say hello."}\n'
                    b'{"id": "latin1", "prompt": "Caf\xe9?"}\n'
                    b'{"id": "esc", "prompt": "Caf\\udce9?"}\n'
                    + '{"id": "ls", "prompt": "Name a fruit.\u2028Just one."}\n'.encode())
    out = tmp_path / "out.jsonl"
    r = generate(default_gguf, inp, out, "-n", "4")
    assert r.returncode == 1, r.stderr
    assert "Traceback" not in r.stderr and "bug" not in r.stderr
    assert "done 2 · failed 2" in r.stderr
    rows = {row.get("line"): row for row in results(out)}
    assert rows[2]["id"] is None and "not UTF-8 text: byte 0xE9" in rows[2]["error"]
    assert "iconv" in rows[2]["error"]
    assert rows[3]["id"] is None and "'\\udce9'" in rows[3]["error"]
    done = {row["id"] for row in results(out) if "error" not in row}
    assert done == {"ok", "ls"}


@requires_llama
def test_text_input_line_not_utf8(default_gguf: Path, tmp_path: Path) -> None:
    inp = tmp_path / "prompts.txt"
    inp.write_bytes(b"Say hello.\nCaf\xe9?\n")
    out = tmp_path / "out.jsonl"
    r = generate(default_gguf, inp, out, "-n", "4")
    assert r.returncode == 1 and "Traceback" not in r.stderr and "bug" not in r.stderr
    rows = {row["id"]: row for row in results(out)}
    assert_valid(rows[1])
    assert rows[2]["line"] == 2 and "not UTF-8 text: byte 0xE9 at offset 3" in rows[2]["error"]


# -- one run per output file; a full disk (issue 24, item 8) ------------------------------


def _one_error_line(stderr: str) -> str:
    assert "Traceback" not in stderr and "bug" not in stderr, stderr
    lines = [ln for ln in stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 2 and lines[0].startswith("error: "), stderr
    assert lines[1].strip().startswith("hint: "), stderr
    return lines[0]


@requires_llama
def test_a_second_run_on_the_same_output_refuses(default_gguf: Path, tmp_path: Path) -> None:
    """The first run holds the output: a second one started meanwhile writes nothing and
    says who has it; the first then finishes with every id exactly once."""
    ids = [f"q{i}" for i in range(24)]
    inp = write_jsonl(tmp_path / "in.jsonl", [{"id": i, "prompt": QUESTIONS[n % 12]}
                                              for n, i in enumerate(ids)])
    out = tmp_path / "out.jsonl"
    first = subprocess.Popen([*localrun_cmd(), "generate", str(default_gguf), "-i", str(inp),
                              "-o", str(out), *FLAGS, "-n", "4"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while not (out.exists() and out.read_bytes().count(b"\n") >= 1):
            assert first.poll() is None and time.monotonic() < deadline, "no first result"
            time.sleep(0.05)
        first.send_signal(signal.SIGSTOP)  # holds its lock, writes nothing until SIGCONT
        before = out.read_bytes()
        second = generate(default_gguf, inp, out, "-n", "4", timeout=120)
        assert second.returncode != 0
        line = _one_error_line(second.stderr)
        assert str(out) in line and "another" in line.lower() and str(first.pid) in line
        assert out.read_bytes() == before  # the second run wrote nothing
    finally:
        first.send_signal(signal.SIGCONT)
        try:
            first.wait(timeout=240)
        finally:
            if first.poll() is None:
                first.kill()
                first.wait()
    assert first.returncode == 0, first.stderr.read() if first.stderr else ""
    assert_each_once(out, ids)
    assert not out.with_name(out.name + ".lock").exists()  # the lock file goes with the run
    r = generate(default_gguf, inp, out, "-n", "4")  # and a later run is not locked out
    assert r.returncode == 0 and "nothing to do" in r.stderr, r.stderr


#: ``localrun ARGS`` whose writes to one file (argv[1]) stop with ENOSPC after argv[2]
#: bytes, as a full disk does: the last write that fits is cut short, the next fails.
#: Used where no small file system can be mounted (mounting needs root).
_FULL_DISK_SHIM = """
import errno, os, sys
target, left = os.path.realpath(sys.argv[1]), [int(sys.argv[2])]
real = os.write
def write(fd, data):
    try:
        name = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        name = ""
    if name != target:
        return real(fd, data)
    if left[0] <= 0:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    n = real(fd, bytes(data[:left[0]]))
    left[0] -= n
    return n
os.write = write
sys.argv = ["localrun", *sys.argv[3:]]
from localrun.cli import main
main()
"""


def _mount_tmpfs(folder: Path, size: int) -> bool:
    """A ``size``-byte tmpfs at ``folder`` (root only); False where it cannot be had."""
    folder.mkdir()
    if os.geteuid() != 0 or not shutil.which("mount"):
        return False
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
                       capture_output=True, timeout=30)
    return r.returncode == 0


@requires_llama
def test_a_full_disk_is_one_line_and_resume_completes(default_gguf: Path,
                                                       tmp_path: Path) -> None:
    """ENOSPC while appending: "disk full" in one line with the path, a non-zero exit, no
    torn line; after space is freed the same command finishes every id exactly once.
    On a real 8 KiB tmpfs where root can mount one, else a write that fails as one does."""
    ids = [f"q{i}" for i in range(40)]  # ~40 x 250 bytes: more than the space there is
    inp = write_jsonl(tmp_path / "in.jsonl", [{"id": i, "prompt": QUESTIONS[n % 12]}
                                              for n, i in enumerate(ids)])
    disk = tmp_path / "disk"
    mounted = _mount_tmpfs(disk, 8192)
    out = disk / "out.jsonl"
    try:
        if mounted:
            r = generate(default_gguf, inp, out, "-n", "4")
        else:
            r = subprocess.run([sys.executable, "-c", _FULL_DISK_SHIM, str(out), "3000",
                                "generate", str(default_gguf), "-i", str(inp), "-o", str(out),
                                *FLAGS, "-n", "4"], capture_output=True, text=True,
                               timeout=300)
        assert r.returncode == 1, r.stderr
        line = _one_error_line(r.stderr)
        assert "disk full" in line.lower() and str(out) in line and "bytes" in line, line
        rows = results(out)  # whole lines only: no torn line left behind
        assert 1 <= len(rows) < len(ids), len(rows)
        assert len({row["id"] for row in rows}) == len(rows)
        kept = out.read_bytes()
        if mounted:  # space freed: the same file system, grown
            subprocess.run(["mount", "-o", "remount,size=1048576", str(disk)], check=True,
                           capture_output=True, timeout=30)
        r = generate(default_gguf, inp, out, "-n", "4")
        assert r.returncode == 0, r.stderr
        assert f"skipped {len(rows)}" in r.stderr
        assert out.read_bytes().startswith(kept)  # what was written is kept as it was
        assert_each_once(out, ids)
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(disk)], capture_output=True, timeout=30)


# -- an engine that batches: OpenVINO GenAI's continuous batching -----------------------

requires_openvino = pytest.mark.skipif(
    importlib.util.find_spec("openvino_genai") is None,
    reason="openvino-genai is not installed (pip install -e '.[openvino]')")


@requires_openvino
def test_generate_j4_runs_four_at_once_on_openvino(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """`localrun generate -j 4` on the OpenVINO fixture: every id once, and by the
    engine's own count its steps ran 4 sequences at once, never more. The command runs
    in this process (the CLI app itself) so the engine's step reports can be read."""
    from typer.testing import CliRunner

    from localrun.backends.openvino import batcher as openvino_batch
    from localrun.cli import app
    from tests.models import test_model
    from tests.test_batch import StepSpy

    model = test_model("openvino-int4")
    spies: list[StepSpy] = []

    class Spied(openvino_batch.ContinuousBatcher):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            spies.append(StepSpy(self.pipe))
            self.pipe = spies[-1]

    monkeypatch.setattr(openvino_batch, "ContinuousBatcher", Spied)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    ids = [f"q{i}" for i in range(8)]
    inp = write_jsonl(tmp_path / "in.jsonl", [{"id": i, "prompt": q}
                                              for i, q in zip(ids, QUESTIONS, strict=False)])
    out = tmp_path / "out.jsonl"
    r = CliRunner().invoke(app, ["generate", str(model), "--backend", "openvino", "-i",
                                 str(inp), "-o", str(out), "-t", "0", "-n", "8", "-j", "4",
                                 "--no-progress"])
    assert r.exit_code == 0, (r.output, r.exception)
    rows = assert_each_once(out, ids)
    assert all(row["usage"]["completion_tokens"] <= 8 for row in rows)
    assert len(spies) == 1, "the batch did not go through the continuous batcher"
    steps = spies[0].scheduled
    assert max(steps) == 4 and sum(n > 1 for n in steps) >= 4, steps
