"""localrun generate MODEL --input IN --output OUT: a resumable batch job.

Nothing is lost and nothing runs twice: each result is one JSON line appended (and
flushed) the moment it is done; a re-run with the same output skips the ids already
there; a partial last line left by a killed run is cut off and redone. One run at a
time per output file (a lock beside it); a write that fails (a full disk) is taken back
to the last whole line and stops the run, which the same command then resumes.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

import typer

from localrun.cli import options as o

InputFormat = Literal["auto", "jsonl", "text"]
#: Fields an input line may carry besides the sampling options.
LINE_FIELDS = ("id", "prompt", "messages", "system")
#: fsync the output at most this often (seconds); each line is written and flushed
#: at once regardless, so a killed process loses nothing; fsync guards against a
#: machine crash. Measured here: ~2.8 ms per fsync vs ~1 µs per write, which per line
#: would cost a tiny model at concurrency 8 several % of its throughput.
FSYNC_EVERY = 1.0


@dataclass
class Record:
    """One input line: a runnable prompt, or the reason it cannot run."""

    line: int
    id: Any  # str or int; None when a malformed line had no readable id
    input: str | list[Any] | None = None
    sampling: dict[str, Any] = field(default_factory=dict)
    error: str | None = None

    @property
    def key(self) -> str:
        return _key(self.id) if self.id is not None else f"#line {self.line}"


def _key(value: Any) -> str:
    return json.dumps(value, sort_keys=True, ensure_ascii=False)


# -- input ------------------------------------------------------------------------------


def _sniff(path: Path, lines: list[str]) -> Literal["jsonl", "text"]:
    if path.suffix.lower() in (".jsonl", ".json", ".ndjson"):
        return "jsonl"
    if path.suffix.lower() == ".txt":
        return "text"
    first = next((ln for ln in lines if ln.strip()), "")
    try:
        return "jsonl" if isinstance(json.loads(first), dict) else "text"
    except ValueError:
        return "text"


def _parse_json_line(n: int, text: str, system: str | None) -> Record:
    from localrun.errors import LocalrunError
    from localrun.sampling import SAMPLING_OPTIONS, make_sampling
    from localrun.templates import normalize_messages

    try:
        obj = json.loads(text)
    except ValueError as e:
        return Record(n, None, error=f"not valid JSON ({e})")
    if not isinstance(obj, dict):
        return Record(n, None, error=f"expected a JSON object, got {type(obj).__name__}")
    try:  # a "\udce9" escape is valid JSON but no Unicode text: no tokenizer takes it
        json.dumps(obj, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as e:
        return Record(n, None, error=f"holds {e.object[e.start:e.end]!r}, which is not a "
                      "Unicode character (a lone surrogate escape)")
    rid = obj.get("id", n)
    if isinstance(rid, bool) or not isinstance(rid, (str, int)) or rid == "":
        return Record(n, None, error=f"'id' must be a non-empty string or an integer, got {rid!r}")
    rec = Record(n, rid)
    unknown = sorted(k for k in obj if k not in LINE_FIELDS and k not in SAMPLING_OPTIONS)
    if unknown:
        rec.error = (f"unknown field {unknown[0]!r} (allowed: "
                     + ", ".join((*LINE_FIELDS, *SAMPLING_OPTIONS)) + ")")
        return rec
    has_prompt, has_messages = "prompt" in obj, "messages" in obj
    if has_prompt == has_messages:
        rec.error = "needs exactly one of 'prompt' (a string) or 'messages' (a list)"
        return rec
    sampling = {k: obj[k] for k in SAMPLING_OPTIONS if k in obj}
    try:
        make_sampling(**sampling)
        if has_prompt:
            prompt, line_system = obj["prompt"], obj.get("system", system)
            if not isinstance(prompt, str) or not prompt.strip():
                raise LocalrunError("'prompt' must be a non-empty string")
            if line_system is not None and not isinstance(line_system, str):
                raise LocalrunError("'system' must be a string")
            rec.input = ([{"role": "system", "content": line_system}] if line_system else []) \
                + [{"role": "user", "content": prompt}]
        else:
            if "system" in obj:
                raise LocalrunError("'system' goes with 'prompt'; put it in 'messages' instead")
            rec.input = list(normalize_messages(obj["messages"]))
    except LocalrunError as e:
        rec.error = e.message
        return rec
    rec.sampling = sampling
    return rec


def read_input(path: Path, fmt: InputFormat, system: str | None) -> list[Record]:
    """Every prompt line of the input, with its line number; blank lines are skipped."""
    from localrun.cli._input import CONVERT, bad_byte_message
    from localrun.errors import LocalrunError

    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise LocalrunError(f"No input file {path}",
                            hint="pass --input FILE (JSONL lines or one prompt per line)"
                            ) from None
    except OSError as e:
        raise LocalrunError(f"Cannot read input file {path}: {e}",
                            hint="the input must be a UTF-8 text or JSONL file") from None
    # Split the bytes, then decode each line: a line that is not UTF-8 fails alone (the
    # others run), and U+2028 inside a JSON string does not split a line.
    lines: list[str | None] = []
    bad: dict[int, str] = {}
    for n, raw in enumerate(data.removeprefix(b"\xef\xbb\xbf").splitlines(), 1):
        try:
            lines.append(raw.decode("utf-8"))
        except UnicodeDecodeError as e:
            lines.append(None)
            bad[n] = bad_byte_message("the line", raw, e.start) \
                + f"; convert the file to UTF-8 (e.g. {CONVERT})"
    kind = _sniff(path, [ln for ln in lines if ln is not None]) if fmt == "auto" else fmt
    records = []
    for n, line in enumerate(lines, 1):
        if line is None:
            records.append(Record(n, None if kind == "jsonl" else n, error=bad[n]))
            continue
        if not line.strip():
            continue
        if kind == "jsonl":
            records.append(_parse_json_line(n, line, system))
        else:
            messages = ([{"role": "system", "content": system}] if system else []) + [
                {"role": "user", "content": line}]
            records.append(Record(n, n, messages))
    return records


def check_duplicates(records: list[Record], path: Path) -> None:
    from localrun.errors import LocalrunError

    seen: dict[str, int] = {}
    for r in records:
        if r.id is None:
            continue
        if r.key in seen:
            raise LocalrunError(
                f"Duplicate id {r.id!r} in {path} (lines {seen[r.key]} and {r.line}); "
                "nothing was run",
                hint="give every line a unique \"id\", or drop the ids to number lines "
                "automatically")
        seen[r.key] = r.line


# -- output -----------------------------------------------------------------------------


@dataclass
class Done:
    """What an earlier run left in the output file."""

    ok: set[str] = field(default_factory=set)
    failed: set[str] = field(default_factory=set)
    partial_bytes: int = 0  # bytes of an incomplete last line, to cut off
    size: int = 0  # bytes up to the end of the last complete line


def read_output(path: Path) -> Done:
    """Ids already done (and failed) in ``path``; reads, never writes."""
    from localrun.errors import LocalrunError

    done = Done()
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return done
    except OSError as e:
        raise LocalrunError(f"Cannot read output file {path}: {e}",
                            hint="pass another --output") from None
    done.size = data.rfind(b"\n") + 1
    done.partial_bytes = len(data) - done.size
    for n, raw in enumerate(data[: done.size].splitlines(), 1):
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw)
            if not isinstance(obj, dict) or "id" not in obj:
                raise ValueError("no id")
        except ValueError:
            raise LocalrunError(
                f"Line {n} of {path} is not a result line localrun wrote; not appending to it",
                hint="pass another --output, or remove that line to resume") from None
        key = _key(obj["id"]) if obj["id"] is not None else f"#line {obj.get('line')}"
        (done.failed if "error" in obj else done.ok).add(key)
    done.failed -= done.ok
    return done


class Output:
    """Append-only JSONL: one os.write per line, so a line is whole or absent. A write
    that fails (a full disk) is taken back to the last whole line, and the run stops."""

    def __init__(self, path: Path, keep_bytes: int, drop_keys: set[str]) -> None:
        self.path = path
        try:
            if drop_keys:
                _rewrite_without(path, drop_keys)
            elif path.exists() and path.stat().st_size != keep_bytes:
                with open(path, "r+b") as f:  # cut a partial line left by a killed run
                    f.truncate(keep_bytes)
                    os.fsync(f.fileno())
            self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            self._size = os.fstat(self._fd).st_size
        except OSError as e:
            raise write_error(path, e, 0) from None
        self._synced = time.monotonic()
        self.written = 0  # lines this run

    def write(self, obj: dict[str, Any]) -> None:
        data = (json.dumps(obj, ensure_ascii=False) + "\n").encode("utf-8")
        view = memoryview(data)
        try:
            while view:
                view = view[os.write(self._fd, view):]
        except OSError as e:
            with contextlib.suppress(OSError):  # cutting a file back needs no new space
                os.ftruncate(self._fd, self._size)
            self._close()
            raise write_error(self.path, e, len(data), self.written) from None
        self._size += len(data)
        self.written += 1
        if time.monotonic() - self._synced >= FSYNC_EVERY:
            self._sync()
            self._synced = time.monotonic()

    def _sync(self) -> None:
        try:
            os.fsync(self._fd)
        except OSError as e:  # some file systems report a full disk only here
            self._close()
            raise write_error(self.path, e, 0, self.written) from None

    def _close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def close(self) -> None:
        if self._fd >= 0:
            self._sync()
            self._close()


def write_error(path: Path, e: OSError, nbytes: int, saved: int = 0) -> Exception:
    """One line for a failed write of the output: a full disk (or quota) by name."""
    from localrun.errors import LocalrunError

    what = f"{nbytes:,} bytes of a result" if nbytes else "the results"
    kept = f"; the {saved} results written before it are kept" if saved else ""
    full = e.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC))
    return LocalrunError(
        f"{'Disk full' if full else 'Cannot write'}: {what} could not be written to {path} "
        f"({e.strerror or e}){kept}",
        hint=("free space on that disk (df -h shows it), then " if full else
              "fix that, then ") + "run the same command again: it resumes where this stopped")


@contextlib.contextmanager
def exclusive(output: Path) -> Iterator[None]:
    """Hold ``OUTPUT.lock`` (an exclusive flock) while a run reads and appends ``output``;
    LocalrunError at once when another run holds it. The lock goes with its holder, even
    killed; the file is removed at the end (a run that opened it meanwhile sees it gone
    and takes a fresh one). Windows has no flock: runs there are not locked."""
    from localrun.errors import LocalrunError

    try:
        import fcntl
    except ImportError:  # Windows
        yield
        return
    lock = output.with_name(output.name + ".lock")
    while True:
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise LocalrunError(f"Cannot create the lock file {lock}: {e.strerror or e}",
                                hint="pass --output in a folder you can write to") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
            os.close(fd)
            if e.errno not in (errno.EAGAIN, errno.EACCES):
                raise LocalrunError(f"Cannot lock {lock}: {e.strerror or e}",
                                    hint="pass --output on a local disk") from None
            who = f" (pid {holder})" if holder.isdigit() else ""
            raise LocalrunError(
                f"Another localrun generate{who} is writing to {output}; a second run on the "
                "same file would run its prompts twice", hint="wait for it to finish (or "
                "stop it), then run the same command again to resume; or pass another "
                "--output") from None
        try:
            same = os.fstat(fd).st_ino == os.stat(lock).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)  # its holder removed it as we opened it: take the new one
    with contextlib.suppress(OSError):  # the pid, for the message above; a full disk
        os.ftruncate(fd, 0)               # does not stop the run here
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            os.unlink(lock)
        os.close(fd)


def _rewrite_without(path: Path, drop_keys: set[str]) -> None:
    """Drop the error lines of ids run again (--retry-failed), atomically."""
    keep = []
    for raw in path.read_bytes().splitlines(keepends=True):
        if not raw.endswith(b"\n") or not raw.strip():
            continue
        obj = json.loads(raw)
        key = _key(obj["id"]) if obj["id"] is not None else f"#line {obj.get('line')}"
        if "error" in obj and key in drop_keys:
            continue
        keep.append(raw)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            f.writelines(keep)
            f.flush()
            os.fsync(f.fileno())
    except OSError:
        tmp.unlink(missing_ok=True)  # the output itself is untouched
        raise
    os.replace(tmp, path)


def _result(rec: Record, c: Any) -> dict[str, Any]:
    out = {"id": rec.id, "text": c.text, "finish_reason": c.finish_reason,
           "usage": c.usage.to_dict(),
           "timings": {k: round(v, 6) for k, v in vars(c.timings).items()}}
    if c.reasoning is not None:  # a thinking model's thinking, apart from the answer
        out["reasoning"] = c.reasoning
    return out


def _failure(rec: Record, message: str, kind: str = "InvalidInput",
             hint: str | None = None) -> dict[str, Any]:
    out = {"id": rec.id, "line": rec.line, "error": message, "error_type": kind}
    if hint:
        out["hint"] = hint
    return out


# -- the command ------------------------------------------------------------------------


@dataclass
class Tally:
    done: int = 0
    failed: int = 0
    skipped: int = 0
    tokens: int = 0
    start: float = field(default_factory=time.perf_counter)

    def line(self, out: Path) -> str:
        wall = time.perf_counter() - self.start
        tps = self.tokens / wall if wall > 0 else 0.0
        return (f"done {self.done} · failed {self.failed} · skipped {self.skipped} · "
                f"{self.tokens:,} tokens · {wall:.1f} s · {tps:.1f} tok/s → {out}")


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """Let `kill PID` stop the run as cleanly as Ctrl-C does."""
    def handler(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    try:
        old = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


@o.with_groups
def generate(
    model: o.ModelArg = None,
    input: Annotated[Path, typer.Option("--input", "-i", help="Prompts: JSONL lines "
                     "{\"id\", \"prompt\" | \"messages\", sampling options...} or plain "
                     "text, one prompt per line.")] = Path("-"),
    output: Annotated[Path, typer.Option("--output", "-o", help="Results, one JSON line "
                      "each; re-running with the same file resumes.")] = Path("-"),
    concurrency: Annotated[int | None, typer.Option("--concurrency", "-j", help="Most "
                           "prompts in flight at once on engines that batch (default: the "
                           "engine decides: llama.cpp, MLX, OpenVINO, ExLlama and remote "
                           "servers batch them, ONNX runs them in turn).")] = None,
    fail_fast: Annotated[bool, typer.Option("--fail-fast", help="Stop at the first "
                         "malformed line or failed prompt.")] = False,
    retry_failed: Annotated[bool, typer.Option("--retry-failed", help="Run ids whose "
                            "earlier result is an error again.")] = False,
    input_format: Annotated[str, typer.Option("--format", help="Input format: auto, "
                            "jsonl or text.")] = "auto",
    progress: Annotated[bool, typer.Option("--progress/--no-progress", help="Show the "
                        "progress bar on stderr.")] = True,
    *,
    sampling: o.SamplingFlags,
    prompting: o.PromptFlags,
    loading: o.LoadingFlags,
    remote: o.RemoteFlags,
) -> None:
    """Run every prompt of a file and append each result to a JSONL file as it finishes.

    --schema FILE / --json-object make every reply JSON (enforced by the engine); a reply
    cut short by --max-tokens is then a failure line.

    Each output line: {"id", "text", "finish_reason", "usage", "timings"}.

    A malformed line or a failed prompt: {"id", "line", "error"}; exit status 1.

    Re-run with the same --output to resume: ids already there are skipped.

    Examples:

      localrun generate smollm2:135m -i prompts.jsonl -o results.jsonl -t 0

      localrun generate ./model.gguf -i questions.txt -o answers.jsonl -j 8
    """
    from rich.console import Console

    from localrun.errors import LocalrunError

    err = Console(stderr=True, soft_wrap=True)  # whole lines: stderr is often a log
    if str(input) == "-" or str(output) == "-":
        raise LocalrunError("generate needs an input and an output file",
                            hint="localrun generate MODEL --input IN.jsonl --output OUT.jsonl")
    if input_format not in ("auto", "jsonl", "text"):
        raise LocalrunError(f"Unknown --format {input_format!r}", hint="use auto, jsonl or text")
    if concurrency is not None and concurrency < 1:
        raise LocalrunError(f"Invalid --concurrency {concurrency}", hint="pass a number >= 1")
    if not output.parent.is_dir() or output.is_dir():
        raise LocalrunError(f"Cannot write results to {output}: "
                            + ("it is a folder" if output.is_dir() else "no such folder"),
                            hint="pass --output as a file path in an existing folder")
    if input.resolve() == output.resolve():
        raise LocalrunError("--input and --output are the same file",
                            hint="write the results to another file")
    options = sampling.kwargs()  # checked before reading or loading anything
    structured = prompting.structured()
    options.update(prompting.thinking())
    template = prompting.template()
    prompting.check_system()

    records = read_input(input, input_format, prompting.system)  # type: ignore[arg-type]
    check_duplicates(records, input)
    bad = [r for r in records if r.error]
    if fail_fast and bad:
        raise LocalrunError(f"Line {bad[0].line} of {input}: {bad[0].error}; nothing was run",
                            hint="fix that line, or drop --fail-fast to record it and go on")
    with exclusive(output):  # one run at a time appends to a file
        previous = read_output(output)
        redo = previous.failed if retry_failed else set()
        tally = Tally()
        todo = []
        for r in records:
            if (r.key in previous.ok or r.key in previous.failed) and r.key not in redo:
                tally.skipped += 1
            else:
                todo.append(r)
        if previous.partial_bytes:
            err.print(f"note: an incomplete last line ({previous.partial_bytes} bytes) from an "
                      "interrupted run will be cut off and redone", highlight=False)
        if not todo:
            failed = f" ({len(previous.failed)} failed; --retry-failed runs them again)" \
                if previous.failed else ""
            err.print(f"nothing to do: all {len(records)} ids of {input} are in {output}{failed}",
                      highlight=False)
            return

        with loading.load(model, remote, chat_template=template) as m:
            out = Output(output, previous.size, redo & {r.key for r in todo})
            try:
                _run(m, out, todo, {**structured, **options}, concurrency, fail_fast, progress,
                     tally, err, len(records))
            finally:
                out.close()


def _run(m: Any, out: Output, todo: list[Record], sampling: dict[str, Any],
         concurrency: int | None, fail_fast: bool, show: bool, tally: Tally, err: Any,
         total: int) -> None:
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
    )

    from localrun.batch import BatchItem
    from localrun.errors import LocalrunError
    from localrun.types import CancelToken

    tally.start = time.perf_counter()  # throughput without the model's load time
    runnable = [r for r in todo if r.error is None]
    first_failure: str | None = None
    for r in todo:
        if r.error is not None:
            out.write(_failure(r, r.error))
            tally.failed += 1
    cancel = CancelToken()
    bar = Progress(TextColumn("generating"), BarColumn(), MofNCompleteColumn(),
                   TextColumn("· {task.fields[tps]} tok/s · ETA"), TimeRemainingColumn(),
                   console=err, disable=not show, transient=False)
    task = bar.add_task("generate", total=total, completed=tally.skipped + tally.failed,
                        tps="0.0")
    items = [BatchItem(r.input or "", r.sampling) for r in runnable]
    interrupted = False
    with bar, _sigterm_as_interrupt():
        results = m.batch_iter(items, max_concurrency=concurrency, cancel=cancel, **sampling)
        try:
            for i, res in results:
                rec = runnable[i]
                if isinstance(res, LocalrunError):
                    out.write(_failure(rec, res.message, type(res).__name__, res.hint))
                    tally.failed += 1
                    if fail_fast and first_failure is None:
                        first_failure = f"id {rec.id!r} (line {rec.line}): {res.message}"
                        cancel.cancel()
                elif res.finish_reason != "cancelled":
                    out.write(_result(rec, res))
                    tally.done += 1
                    tally.tokens += res.usage.completion_tokens
                wall = time.perf_counter() - tally.start
                bar.update(task, completed=tally.skipped + tally.failed + tally.done,
                           tps=f"{tally.tokens / wall if wall > 0 else 0:.1f}")
        except KeyboardInterrupt:
            interrupted = True
            cancel.cancel()
        finally:
            results.close()
    err.print(tally.line(out.path), highlight=False)
    if interrupted:
        err.print(f"interrupted: {tally.done + tally.failed} results of this run are saved; "
                  "run the same command again to resume", highlight=False)
        raise typer.Exit(130)
    if first_failure is not None:
        raise LocalrunError(f"Stopped at the first failure (--fail-fast): {first_failure}",
                            hint="fix it and run the same command again; "
                            "finished results are kept")
    if tally.failed:
        raise LocalrunError(f"{tally.failed} prompt(s) failed; their output lines carry "
                            "\"error\" and the input line number",
                            hint="fix them and run again with --retry-failed")


def register(app: typer.Typer) -> None:
    app.command("generate")(generate)
