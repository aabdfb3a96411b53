"""Steps with their own time limits, run as their dependencies allow, inside one budget.

A step is a function of a :class:`StepContext`; it returns a one-line detail, or raises
:class:`StepFailed` / :class:`StepSkipped`. Commands run through ``ctx.run``, which kills
the whole process group when the step's time is up (:class:`StepTimeout`). A step whose
dependency did not succeed is skipped with the reason; a failure never stops the others.
Steps marked ``gpu`` run one at a time (readings of free VRAM must not race another
process). Standard library only: this runs under whatever python3 the GPU machine has.

Each command gets its own process group (so a time limit kills its children too) but
stays in the kit's session. With the kernel's autogroup scheduling
(``/proc/sys/kernel/sched_autogroup_enabled``), CPU time is shared equally between
sessions and ``nice`` only weighs processes inside one: a command started in a new
session would get an equal share whatever its nice value, so the builds' priorities
(``nice=``) would do nothing.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

OK, FAILED, TIMEOUT, SKIPPED = "ok", "failed", "timeout", "skipped"


class StepFailed(Exception):
    """The step ran and did not do its job; the message is the one-line reason."""


class StepSkipped(Exception):
    """The step cannot run here (no CUDA, no tool); the message says why."""


class StepTimeout(Exception):
    """A command of the step ran past the step's time limit and was killed."""


@dataclass
class Step:
    name: str
    what: str  # one line: what the step proves
    fn: Callable[[StepContext], str | None]
    deps: tuple[str, ...] = ()
    limit_s: float = 60.0
    min_s: float = 5.0  # not started with less time than this left
    reserve_s: float = 0.0  # time kept back for the steps after it
    gpu: bool = False  # exclusive use of the GPU
    optional: bool = False  # not reaching it (budget) or a timeout is no failure


@dataclass
class StepResult:
    name: str
    what: str
    status: str
    seconds: float = 0.0
    limit_s: float = 0.0
    started_at_s: float | None = None  # from the start of the run
    detail: str = ""
    optional: bool = False
    facts: dict[str, Any] = field(default_factory=dict)
    tests: dict[str, Any] | None = None
    log: str = ""

    def to_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in self.__dict__.items() if k != "log"}
        d["seconds"] = round(self.seconds, 2)
        d["limit_s"] = round(self.limit_s, 1)
        if self.started_at_s is not None:
            d["started_at_s"] = round(self.started_at_s, 2)
        if self.tests is None:
            d.pop("tests")
        return d


@dataclass
class CommandResult:
    returncode: int
    seconds: float
    tail: str  # the last lines of its output (the step's log)
    stdout: str = ""  # its standard output, when run with capture=True


class StepContext:
    """What a step sees: its deadline, its log, the shared environment, its facts."""

    def __init__(self, step: Step, deadline: float, log_path: Path,
                 env: Mapping[str, str]) -> None:
        self.step = step
        self.deadline = deadline
        self.log_path = log_path
        self.env = dict(env)
        self.facts: dict[str, Any] = {}
        self.tests: dict[str, Any] | None = None
        self._procs: list[subprocess.Popen[bytes]] = []
        self._lock = threading.Lock()
        self.abandoned = False

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def log(self, text: str) -> None:
        with self._lock, self.log_path.open("a", encoding="utf-8") as fh:
            fh.write(text.rstrip("\n") + "\n")

    def run(self, cmd: Sequence[str], *, env: Mapping[str, str] | None = None,
            cwd: str | os.PathLike[str] | None = None, nice: int = 0,
            check: bool = True, limit: float | None = None,
            capture: bool = False, new_session: bool = False) -> CommandResult:
        """Run a command, output appended to the step's log, killed at the deadline.

        ``check``: a non-zero exit raises StepFailed naming the command and its last
        output line. ``limit`` caps this command below the step's own deadline.
        ``capture``: standard output is also returned (and still logged).
        ``new_session``: start it in a session of its own, as this runner once did (the
        priority proof measures what that costs; see the module's docstring).
        """
        if self.abandoned:
            raise StepTimeout("the step was abandoned at its time limit")
        full_env = dict(self.env)
        if env:
            full_env.update(env)
        timeout = self.left() if limit is None else min(limit, self.left())
        if timeout <= 0:
            raise StepTimeout(f"no time left to run {Path(cmd[0]).name}")
        argv = [str(c) for c in cmd]
        if nice:
            argv = ["nice", "-n", str(nice), *argv]
        self.log(f"$ {' '.join(argv)}")
        t0 = time.monotonic()
        # commands of one step may run at once (the priority proof): one file each
        stdout_path = self.log_path.with_name(f"{self.log_path.stem}.{next(_SEQ)}.stdout")
        with self.log_path.open("ab") as out, \
                (stdout_path.open("wb") if capture else contextlib.nullcontext(out)) as so:
            proc = subprocess.Popen(argv, stdout=so, stderr=out, env=full_env, cwd=cwd,
                                    **group_kwargs(new_session))
            with self._lock:
                self._procs.append(proc)
            try:
                rc = proc.wait(timeout=max(timeout, 0.01))
            except subprocess.TimeoutExpired:
                kill_group(proc)
                seconds = time.monotonic() - t0
                self.log(f"[killed after {seconds:.1f} s: the step's time limit]")
                raise StepTimeout(f"{Path(str(cmd[0])).name} killed after {seconds:.0f} s "
                                  "(time limit)") from None
            finally:
                with self._lock:
                    self._procs.remove(proc)
        seconds = time.monotonic() - t0
        stdout = ""
        if capture:
            stdout = stdout_path.read_text(encoding="utf-8", errors="replace")
            stdout_path.unlink(missing_ok=True)
            self.log(stdout)
        tail = tail_of(self.log_path)
        self.log(f"[exit {rc} after {seconds:.1f} s]")
        if check and rc != 0:
            last = last_line(tail)
            shown = " ".join([Path(str(cmd[0])).name, *map(str, cmd[1:3])])
            raise StepFailed(f"{shown} exited {rc}" + (f": {last}" if last else ""))
        return CommandResult(rc, seconds, tail, stdout)

    def kill_all(self) -> None:
        self.abandoned = True
        with self._lock:
            procs = list(self._procs)
        for p in procs:
            kill_group(p)


_SEQ = itertools.count()


def group_kwargs(new_session: bool = False) -> dict[str, Any]:
    """Popen arguments: a process group of its own in this session (nice works between
    commands), or a new session (autogroup: nice has no effect between sessions)."""
    if new_session:
        return {"start_new_session": True}
    if sys.version_info >= (3, 11):
        return {"process_group": 0}
    return {"preexec_fn": os.setpgrp}  # pragma: no cover - Python 3.10


def kill_group(proc: subprocess.Popen[bytes]) -> None:
    """TERM, then KILL, the command's whole process group (ninja's and nvcc's children)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=5)
            return
        except subprocess.TimeoutExpired:
            continue


def tail_of(path: Path, max_bytes: int = 4000) -> str:
    try:
        with path.open("rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(size - max_bytes, 0))
            return fh.read().decode("utf-8", "replace")
    except OSError:
        return ""


def last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()
             and not ln.startswith(("$ ", "[exit "))]
    return lines[-1][:300] if lines else ""


def _fmt_t(seconds: float) -> str:
    return f"[{seconds:7.1f}s]"


class Runner:
    """Runs steps in list order as far as dependencies, the GPU and the budget allow."""

    def __init__(self, steps: Sequence[Step], *, budget_s: float, log_dir: Path,
                 env: Mapping[str, str] | None = None, max_parallel: int = 4,
                 echo: Callable[[str], None] | None = None,
                 on_result: Callable[[list[StepResult]], None] | None = None,
                 grace_s: float = 15.0) -> None:
        names = [s.name for s in steps]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate step names in {names}")
        for s in steps:
            unknown = [d for d in s.deps if d not in names]
            if unknown:
                raise ValueError(f"step {s.name} depends on unknown {unknown}")
        self.steps = list(steps)
        self.budget_s = budget_s
        self.log_dir = log_dir
        self.env = dict(os.environ if env is None else env)
        self.max_parallel = max_parallel
        self.echo = echo or (lambda line: print(line, flush=True))
        self.on_result = on_result
        self.grace_s = grace_s
        self.results: dict[str, StepResult] = {}
        self.t0 = 0.0
        self._running: dict[str, tuple[threading.Thread, StepContext, float,
                                       dict[str, Any]]] = {}

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def run(self) -> list[StepResult]:
        self.t0 = time.monotonic()
        deadline = self.t0 + self.budget_s
        self.log_dir.mkdir(parents=True, exist_ok=True)
        pending = list(self.steps)
        running = self._running
        while pending or running:
            now = time.monotonic()
            for step in list(pending):
                why = self._blocked(step)
                if why == "wait":
                    continue
                if why:
                    pending.remove(step)
                    self._finish(StepResult(step.name, step.what, SKIPPED, detail=why,
                                            optional=step.optional))
                    continue
                if step.gpu and any(self._step(n).gpu for n in running):
                    continue
                if len(running) >= self.max_parallel:
                    break
                left = deadline - now - step.reserve_s
                if left < step.min_s:
                    pending.remove(step)
                    self._finish(StepResult(
                        step.name, step.what, SKIPPED, optional=step.optional,
                        detail=f"out of time: {max(left, 0):.0f} s left of the "
                               f"{self.budget_s:.0f} s budget, the step needs at least "
                               f"{step.min_s:.0f} s"))
                    continue
                limit = min(step.limit_s, left)
                pending.remove(step)
                running[step.name] = self._start(step, limit)
            for name, (thread, ctx, limit, box) in list(running.items()):
                step = self._step(name)
                if not thread.is_alive():
                    del running[name]
                    self._finish(box["result"])
                elif time.monotonic() > ctx.deadline + self.grace_s:
                    # a step stuck in its own Python code: give up on it, go on
                    ctx.kill_all()
                    del running[name]
                    self._finish(StepResult(
                        name, step.what, TIMEOUT, seconds=time.monotonic() - box["t0"],
                        limit_s=limit, started_at_s=box["t0"] - self.t0,
                        detail=f"still running {self.grace_s:.0f} s after its {limit:.0f} s "
                               "limit: abandoned", optional=step.optional,
                        log=str(ctx.log_path)))
            time.sleep(0.05)
        return [self.results[s.name] for s in self.steps]

    def abort(self, why: str) -> list[StepResult]:
        """Stop the steps still running (their commands' process groups are killed) and
        record them as out of time; the results so far, in step order. For a ``finally``
        after a signal: the report must still say what ran."""
        for name, (_thread, ctx, limit, box) in list(self._running.items()):
            ctx.kill_all()
            step = self._step(name)
            self.results[name] = StepResult(
                name, step.what, TIMEOUT, seconds=time.monotonic() - box["t0"],
                limit_s=limit, started_at_s=box["t0"] - self.t0, detail=why,
                optional=step.optional, facts=ctx.facts, tests=ctx.tests,
                log=str(ctx.log_path))
        self._running.clear()
        return [self.results[s.name] for s in self.steps if s.name in self.results]

    def _step(self, name: str) -> Step:
        return next(s for s in self.steps if s.name == name)

    def _blocked(self, step: Step) -> str:
        """"" = may start, "wait" = a dependency is still pending, else why it is skipped."""
        for d in step.deps:
            r = self.results.get(d)
            if r is None:
                return "wait"
            if r.status == SKIPPED and r.detail.startswith("needs "):
                return r.detail  # the root cause, not a chain of "needs"
            if r.status != OK:
                return f"needs {d} ({r.status}{': ' + r.detail if r.detail else ''})"[:300]
        return ""

    def _start(self, step: Step, limit: float
               ) -> tuple[threading.Thread, StepContext, float, dict[str, Any]]:
        log_path = self.log_dir / f"{step.name}.log"
        log_path.write_text(f"== {step.name}: {step.what} (limit {limit:.0f} s)\n",
                            encoding="utf-8")
        t0 = time.monotonic()
        ctx = StepContext(step, t0 + limit, log_path, self.env)
        box: dict[str, Any] = {"t0": t0}
        self.echo(f"{_fmt_t(t0 - self.t0)} start {step.name} (limit {limit:.0f} s)")

        def body() -> None:
            status, detail = OK, ""
            try:
                detail = step.fn(ctx) or ""
            except StepSkipped as e:
                status, detail = SKIPPED, str(e)
            except StepTimeout as e:
                status, detail = TIMEOUT, str(e)
            except StepFailed as e:
                status, detail = FAILED, str(e)
            except Exception as e:  # a bug in the step: report it as its failure
                status, detail = FAILED, f"{type(e).__name__}: {e}"
                ctx.log(traceback.format_exc())
            box["result"] = StepResult(
                step.name, step.what, status, seconds=time.monotonic() - t0, limit_s=limit,
                started_at_s=t0 - self.t0, detail=detail.strip().splitlines()[0][:400]
                if detail.strip() else "", optional=step.optional, facts=ctx.facts,
                tests=ctx.tests, log=str(log_path))

        thread = threading.Thread(target=body, name=f"step-{step.name}", daemon=True)
        thread.start()
        return thread, ctx, limit, box

    def _finish(self, result: StepResult) -> None:
        self.results[result.name] = result
        took = f" {result.seconds:.1f} s" if result.started_at_s is not None else ""
        self.echo(f"{_fmt_t(self.elapsed())} {result.status:7} {result.name}{took}"
                  + (f": {result.detail}" if result.detail else ""))
        if self.on_result is not None:
            try:
                self.on_result([self.results[s.name] for s in self.steps
                                if s.name in self.results])
            except Exception as e:  # writing partial results must not stop the run
                print(f"could not write partial results: {e}", file=sys.stderr)


def overall_ok(results: Sequence[StepResult]) -> bool:
    """True when no required step failed or ran out of time."""
    return not any(r.status in (FAILED, TIMEOUT) and not r.optional for r in results)
