"""On an NVIDIA GPU: what scripts/gpu_kit/run.py runs there, engine by engine.

Every test skips, saying why, where there is no CUDA GPU, the engine (or its GPU build)
is missing, or its model is not named: LOCALRUN_GPU_GGUF (llama.cpp), LOCALRUN_EXL2_MODEL,
LOCALRUN_EXL3_MODEL. The kit makes them: a tiny Llama with random weights
(scripts/gpu_kit/make_models.py) converted by each engine's own converter. Its answers
are noise, so these tests check code paths (offload, flash attention, streaming, stop
strings, cancellation, batching, a failing job, VRAM readings), never answer quality.
The kit selects them by name: ``-k nvml``, ``-k llama_cpp``, ``-k exllamav2``,
``-k exllamav3``.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import shutil
import subprocess
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import localrun
from localrun.errors import LocalrunError
from localrun.types import CancelToken

MiB = 1024**2
GiB = 1024**3
CONTEXT = 2048
#: A job that fails must end the call with an error well before this (the ExLlamaV3
#: driver once spun forever on an empty result list).
HANG_S = 60.0
INJECTED = "gpu-kit: injected prefill failure"


def _nvidia_gpus() -> list[Any]:
    from localrun.hardware import detect_hardware

    return list(detect_hardware().nvidia_gpus)


def _skip_without_gpu() -> None:
    if not _nvidia_gpus():
        pytest.skip("no NVIDIA GPU on this host (NVML and nvidia-smi see none)")


def _model_path(env: str) -> Path:
    value = os.environ.get(env)
    if not value or not Path(value).exists():
        pytest.skip(f"set {env} to the kit's model (scripts/gpu_kit/run.py makes it)")
    return Path(value)


def _within(seconds: float, fn: Callable[[], Any]) -> Any:
    """fn's result, or its exception raised here; fail if it is still running after
    ``seconds`` (it is left running: a hang is the finding)."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # handed back to the test thread
            box["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    if t.is_alive():
        pytest.fail(f"still running after {seconds:.0f} s: the engine hangs")
    if "error" in box:
        raise box["error"]
    return box.get("value")


def _stop_case(text: str) -> tuple[str, str] | None:
    """(stop string, expected reply) for a greedy reply: a later word, cut at its first
    occurrence."""
    words = text.split()
    for w in words[2:]:
        i = text.find(w)
        if i > 0:
            return w, text[:i]
    return None


# -- NVML against nvidia-smi -------------------------------------------------------------

def _smi_memory() -> list[dict[str, Any]]:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        pytest.skip("nvidia-smi is not on PATH")
    out = subprocess.run([exe, "--query-gpu=index,name,memory.total,memory.used,memory.free,"
                          "compute_cap", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, timeout=30, check=True).stdout
    rows = []
    for line in out.strip().splitlines():
        idx, name, total, used, free, cc = (c.strip() for c in line.split(","))
        rows.append({"index": int(idx), "name": name, "total": int(total), "used": int(used),
                     "free": int(free), "cc": cc})
    return rows


def _nvml() -> list[Any]:
    from localrun.hardware.accelerators import probe_nvml
    from localrun.hardware.system import Notes

    notes = Notes()
    gpus = probe_nvml(notes)
    if gpus is None:
        pytest.skip(f"NVML does not answer here: {'; '.join(notes.items)}")
    return gpus


@pytest.mark.slow
def test_nvml_matches_nvidia_smi() -> None:
    _skip_without_gpu()
    before = _smi_memory()
    nvml = _nvml()
    after = _smi_memory()
    assert len(nvml) == len(before) == len(after)
    for g, a, b in zip(nvml, before, after, strict=True):
        assert g.name == a["name"]
        assert g.compute_capability == a["cc"]
        assert g.memory_total is not None and g.memory_free is not None
        # nvidia-smi prints NVML's numbers in whole MiB
        assert abs(g.memory_total / MiB - a["total"]) <= 1, (g.memory_total, a)
        low, high = min(a["free"], b["free"]), max(a["free"], b["free"])
        assert low - 2 <= g.memory_free / MiB <= high + 2, (g.memory_free / MiB, a, b)
    profile_gpu = _nvidia_gpus()[0]
    assert profile_gpu.source == "nvml"  # nvidia-smi is only the fallback


@pytest.mark.slow
def test_nvml_sees_a_2_gib_allocation_like_torch() -> None:
    _skip_without_gpu()
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA device")
    torch.cuda.init()
    torch.zeros(1, device="cuda:0")  # the CUDA context, before the baseline
    base = _nvml()[0].memory_free
    block = torch.empty(2 * GiB, dtype=torch.uint8, device="cuda:0")
    try:
        block.fill_(1)
        torch.cuda.synchronize()
        during = _nvml()[0].memory_free
        smi = _smi_memory()[0]
        torch_free = torch.cuda.mem_get_info(0)[0]
    finally:
        del block
        torch.cuda.empty_cache()
    assert base - during >= 2 * GiB - 64 * MiB, (base, during)
    assert abs(during / MiB - smi["free"]) <= 64, (during / MiB, smi)
    # localrun's ExLlama context fit reads torch's figure (probe_cuda): the two agree
    assert abs(torch_free - during) < GiB, (torch_free, during)
    assert _nvml()[0].memory_free - during >= 2 * GiB - 64 * MiB


# -- llama.cpp ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def gguf() -> Path:
    _skip_without_gpu()
    path = _model_path("LOCALRUN_GPU_GGUF")
    try:
        import llama_cpp
    except ImportError:
        pytest.skip("llama-cpp-python is not installed")
    if not llama_cpp.llama_supports_gpu_offload():
        pytest.skip("this llama-cpp-python is a CPU build (no GPU offload)")
    return path


@pytest.fixture()
def llama_log() -> Iterator[list[str]]:
    """llama.cpp's own log lines while the test runs (it logs even with verbose=False
    when a callback is set: llama-cpp-python only filters in its Python callback)."""
    import llama_cpp
    import llama_cpp._logger as lcl

    lines: list[str] = []

    @llama_cpp.llama_log_callback  # type: ignore[misc]
    def collect(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
        lines.append(text.decode("utf-8", "replace"))

    llama_cpp.llama_log_set(collect, ctypes.c_void_p(0))
    try:
        yield lines
    finally:
        llama_cpp.llama_log_set(lcl.llama_log_callback, ctypes.c_void_p(0))


def _offloaded(log: list[str]) -> tuple[int, int]:
    m = re.search(r"offloaded (\d+)/(\d+) layers to GPU", "".join(log))
    assert m, "llama.cpp logged no 'offloaded N/M layers to GPU' line"
    return int(m.group(1)), int(m.group(2))


def _flash_attn(log: list[str]) -> str:
    """What llama.cpp decided: 'enabled' or 'disabled'."""
    text = "".join(log)
    resolved = re.findall(r"Flash Attention (enabled|not supported)", text)
    if resolved:
        return "enabled" if resolved[-1] == "enabled" else "disabled"
    m = re.findall(r"flash_attn\s*=\s*(\w+)", text)
    assert m, "llama.cpp logged no flash_attn setting"
    return m[-1]


@pytest.mark.slow
def test_llama_cpp_full_offload(gguf: Path, llama_log: list[str]) -> None:
    with localrun.load(str(gguf), backend="llama.cpp", context=CONTEXT) as m:
        done, total = _offloaded(llama_log)
        assert done == total, f"only {done} of {total} layers on the GPU"
        assert re.search(r"CUDA0 model buffer size\s*=\s*[\d.]+ MiB", "".join(llama_log))
        assert m.info.device and "cpu" not in m.info.device, m.info.device
        a = m.chat("What is the capital of France?", temperature=0, max_tokens=24)
        b = m.chat("What is the capital of France?", temperature=0, max_tokens=24)
        assert a.text == b.text and a.usage.completion_tokens > 0
        assert a.timings.decode_tps > 0


@pytest.mark.slow
def test_llama_cpp_partial_offload(gguf: Path, llama_log: list[str]) -> None:
    with localrun.load(str(gguf), backend="llama.cpp", context=CONTEXT, n_gpu_layers=2) as m:
        done, total = _offloaded(llama_log)
        assert done == 2 and total > 2, (done, total)
        text = "".join(llama_log)
        assert re.search(r"CUDA0 model buffer size", text)
        assert re.search(r"CPU(_Mapped)? model buffer size", text)
        c = m.chat("Name three colours.", temperature=0, max_tokens=16)
        assert c.usage.completion_tokens > 0
        stream = m.stream("Tell me a long story.", temperature=0, max_tokens=200)
        for n, _ in enumerate(stream, 1):
            if n == 3:
                stream.cancel()
        assert stream.completion is not None
        assert stream.completion.finish_reason == "cancelled"


@pytest.mark.slow
def test_llama_cpp_flash_attention_on_and_off(gguf: Path, llama_log: list[str]) -> None:
    replies = {}
    for fa in (True, False):
        llama_log.clear()
        with localrun.load(str(gguf), backend="llama.cpp", context=CONTEXT,
                           flash_attn=fa) as m:
            assert _flash_attn(llama_log) == ("enabled" if fa else "disabled")
            replies[fa] = m.chat("Write a haiku about rain.", temperature=0, max_tokens=16)
    assert all(r.usage.completion_tokens > 0 for r in replies.values())


@pytest.mark.slow
def test_llama_cpp_default_turns_flash_attention_on(gguf: Path, llama_log: list[str]) -> None:
    """localrun's default follows llama-server's: 'auto', which llama.cpp resolves to on
    for a model fully on a CUDA device."""
    with localrun.load(str(gguf), backend="llama.cpp", context=CONTEXT) as m:
        assert _flash_attn(llama_log) == "enabled"
        assert m.chat("Hi", temperature=0, max_tokens=4).usage.completion_tokens > 0


# -- ExLlamaV2 / ExLlamaV3 ---------------------------------------------------------------

EXL = {"exllamav2": "LOCALRUN_EXL2_MODEL", "exllamav3": "LOCALRUN_EXL3_MODEL"}


@pytest.fixture(scope="module", params=sorted(EXL))
def exl(request: pytest.FixtureRequest) -> Iterator[tuple[str, Any]]:
    """(engine, Model), each engine's model loaded once for this module."""
    engine = request.param
    _skip_without_gpu()
    from localrun.backends import is_installed

    if not is_installed(engine):
        pytest.skip(f"{engine} is not installed (pip install -e '.[{engine}]')")
    path = _model_path(EXL[engine])
    with localrun.load(str(path), backend=engine, context=CONTEXT) as m:
        yield engine, m


@pytest.mark.slow
def test_exllama_load_and_greedy(exl: tuple[str, Any]) -> None:
    engine, m = exl
    assert m.info.backend == engine and m.info.context_length == CONTEXT
    assert m.info.quantization and "bpw" in m.info.quantization
    a = m.chat("What is the capital of France?", temperature=0, max_tokens=24)
    b = m.chat("What is the capital of France?", temperature=0, max_tokens=24)
    assert a.text == b.text and a.usage.completion_tokens > 0
    assert a.finish_reason in ("stop", "length")
    assert a.timings.decode_tps > 0 and 0 < a.timings.ttft <= a.timings.total
    n = m.chat("Count to a hundred.", temperature=0, max_tokens=5)
    assert n.finish_reason == "length" and n.usage.completion_tokens == 5


@pytest.mark.slow
def test_exllama_stop_strings(exl: tuple[str, Any]) -> None:
    _, m = exl
    q = "Write a long story about a dragon."
    full = m.chat(q, temperature=0, max_tokens=24).text
    case = _stop_case(full)
    if case is None:
        pytest.skip(f"the greedy reply has no word to stop at: {full!r}")
    stop, expected = case
    c = m.chat(q, temperature=0, max_tokens=24, stop=[stop])
    assert c.finish_reason == "stop", (stop, full, c.text)
    assert c.text == expected and stop not in c.text


@pytest.mark.slow
def test_exllama_streaming_equals_chat(exl: tuple[str, Any]) -> None:
    _, m = exl
    q = "Name three animals that live in the sea."
    c = m.chat(q, temperature=0, max_tokens=16)
    chunks = list(m.stream(q, temperature=0, max_tokens=16))
    assert len(chunks) > 1
    assert "".join(ch.text for ch in chunks) == c.text
    assert chunks[-1].finish_reason == c.finish_reason
    assert chunks[-1].usage == c.usage


@pytest.mark.slow
def test_exllama_cancel_mid_stream(exl: tuple[str, Any]) -> None:
    _, m = exl
    token = CancelToken()
    stream = m.stream("Write a very long story about the sea.", temperature=0,
                      max_tokens=300, cancel=token)
    for n, _ in enumerate(stream, 1):
        if n == 3:
            token.cancel()
    assert stream.completion is not None
    assert stream.completion.finish_reason == "cancelled"
    assert stream.completion.usage.completion_tokens < 10
    assert m.chat("Hi", temperature=0, max_tokens=3).usage.completion_tokens >= 1


@pytest.mark.slow
def test_exllama_batch_of_8_through_the_dynamic_generator(exl: tuple[str, Any]) -> None:
    engine, m = exl
    session = m._driver.session
    gen = session.generator
    active: list[int] = []
    iterate = gen.iterate

    def counting() -> Any:
        out = iterate()
        active.append(len(gen.active_jobs))
        return out

    prompts = [f"Tell me one fact about the number {i}." for i in range(8)]
    with _patched(gen, "iterate", counting):
        results = m.batch(prompts, temperature=0, max_tokens=16)
    assert len(results) == 8
    assert all(r.usage.completion_tokens > 0 for r in results)
    assert all(r.finish_reason in ("stop", "length") for r in results)
    if session.batcher() is not None:  # paged: the generator runs them side by side
        assert max(active) >= 2, f"{engine} never ran two jobs at once: {active}"
    else:  # ExLlamaV2 without flash-attn runs unpaged, one sequence at a time
        assert max(active) == 1, active


@contextlib.contextmanager
def _patched(obj: Any, name: str, value: Any) -> Iterator[None]:
    own = name in vars(obj)  # an instance attribute, not the class's method
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        if own or isinstance(obj, type):
            setattr(obj, name, old)
        else:
            delattr(obj, name)


def _job_class(engine: str) -> Any:
    if engine == "exllamav2":
        from exllamav2.generator.dynamic import ExLlamaV2DynamicJob

        return ExLlamaV2DynamicJob
    from exllamav3.generator.job import Job

    return Job


@pytest.mark.slow
def test_exllama_failing_job_is_an_error_not_a_hang(exl: tuple[str, Any]) -> None:
    """A job the engine gives up on (exllamav3: Generator.reap_failed_job; exllamav2: the
    exception out of iterate) ends the call with a localrun error, and the model serves
    the next request."""
    engine, m = exl
    job_cls = _job_class(engine)
    prefill = job_cls.prefill

    def failing(self: Any, *a: Any, **kw: Any) -> Any:
        raise RuntimeError(INJECTED)

    with _patched(job_cls, "prefill", failing), pytest.raises(LocalrunError) as info:
        _within(HANG_S, lambda: m.chat("Hi", temperature=0, max_tokens=8))
    assert INJECTED in str(info.value)
    assert job_cls.prefill is prefill
    assert m.chat("Hi", temperature=0, max_tokens=4).usage.completion_tokens >= 1


@pytest.mark.slow
def test_exllama_one_failing_job_in_a_batch(exl: tuple[str, Any]) -> None:
    """The second job fails in prefill; the first and third still get their replies
    (Model.batch: BatchError once all have run, each item's Completion or error)."""
    from localrun.batch import BatchError

    engine, m = exl
    job_cls = _job_class(engine)
    prefill = job_cls.prefill
    seen: list[Any] = []  # jobs in the order the engine first prefilled them

    def failing(self: Any, *a: Any, **kw: Any) -> Any:
        if not any(j is self for j in seen):
            seen.append(self)
        if len(seen) > 1 and self is seen[1]:
            raise RuntimeError(INJECTED)
        return prefill(self, *a, **kw)

    with _patched(job_cls, "prefill", failing), pytest.raises(BatchError) as info:
        _within(HANG_S, lambda: m.batch(["One.", "Two.", "Three."], temperature=0,
                                        max_tokens=8, max_concurrency=3))
    results = info.value.results
    assert [isinstance(r, LocalrunError) for r in results] == [False, True, False], results
    assert INJECTED in str(results[1])
    assert len(m.batch(["Hi", "Hello"], temperature=0, max_tokens=4)) == 2
