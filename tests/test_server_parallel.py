"""localrun serve --parallel: a model whose engine batches runs several requests at once,
together in the engine's batch; with --parallel 1 they run in turn. On 127.0.0.1, four
streamed requests of 16 tokens per server.
"""

from __future__ import annotations

import contextlib
import importlib.util
import itertools
import json
import shutil
import threading
import urllib.request
from collections.abc import Iterator
from dataclasses import replace
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import HAVE_LLAMA
from tests.serverutil import WAIT, Running, request, serve

pytest.importorskip("fastapi", reason="the serve extra is not installed "
                    "(pip install -e '.[serve]')")

from localrun.server.config import ServerConfig

pytestmark = pytest.mark.slow
N = 4
TOKENS = 16
COUNTING = "1, 2, 3, 4, 5, 6, 7, 8,"  # SmolLM2 keeps counting: every reply is 16 tokens

ENGINES = [
    pytest.param(("openvino", "openvino-int4", {}), id="openvino", marks=pytest.mark.skipif(
        importlib.util.find_spec("openvino_genai") is None,
        reason="openvino-genai is not installed (pip install -e '.[openvino]')")),
    pytest.param(("llama.cpp", "gguf-q4_1", {"threads": 1}), id="llama.cpp",
                 marks=pytest.mark.skipif(not HAVE_LLAMA, reason="llama-cpp-python is not "
                                          "installed (pip install -e '.[llama-cpp]')")),
]


@pytest.fixture(scope="module", params=ENGINES)
def model(request: pytest.FixtureRequest) -> Iterator[Any]:
    import localrun
    from tests.models import test_model

    backend, fmt, options = request.param
    with localrun.load(str(test_model(fmt)), backend=backend, context=1024,
                       exact=True, **options) as m:
        m.complete(COUNTING, max_tokens=2, temperature=0)  # first touch of the weights
        yield m


def _spans(s: Running, n: int) -> list[tuple[float, float, str]]:
    """``n`` streaming generations started together: when each one's first token and its
    last were sent, by the server's clock (Ollama's ``created_at`` on every line: the
    client's own clock would add its threads' delays on a busy machine), and its text."""
    barrier = threading.Barrier(n)
    spans: list[Any] = [None] * n
    body = json.dumps({"model": "m", "prompt": COUNTING, "raw": True, "stream": True,
                       "options": {"num_predict": TOKENS, "temperature": 0}}).encode()

    def one(i: int) -> None:
        barrier.wait(WAIT)
        times, text, reason = [], "", None
        try:
            req = urllib.request.Request(s.url + "/api/generate", data=body, method="POST")
            with urllib.request.urlopen(req, timeout=WAIT) as r:
                for line in r:
                    part = json.loads(line)
                    if part.get("response"):
                        times.append(_seconds(part["created_at"]))
                        text += part["response"]
                    reason = part.get("done_reason", reason)
            spans[i] = (times[0], times[-1], text) if reason == "length" else repr(reason)
        except Exception as e:  # asserted below, with what it was
            spans[i] = repr(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT * 2)
    assert all(isinstance(x, tuple) for x in spans), spans
    return spans


def _seconds(rfc3339: str) -> float:
    return datetime.fromisoformat(rfc3339.replace("Z", "+00:00")).timestamp()


def _ps(s: Running) -> dict[str, Any]:
    status, _, body = request("GET", s.url + "/api/ps")
    assert status == 200
    (entry,) = json.loads(body)["models"]
    return dict(entry)


def _batches_alone(model: Any) -> None:
    """The engine batches at least N, and once its batcher is built (the server asks
    for max_concurrency) a sequence that arrives alone runs through it too: one that ran
    through the single-sequence path would hold the engine to its end while the requests
    arriving meanwhile wait (llama.cpp's did before issue 15)."""
    assert model.max_concurrency >= N
    assert model._session.batch_alone, model.info.backend


def test_parallel_requests_run_together_in_the_engines_batch(model: Any) -> None:
    _batches_alone(model)
    with serve(ServerConfig(parallel=N, max_queue=0), preload={"m": model}) as s:
        assert _ps(s)["parallel"] == N
        spans = _spans(s, N)  # max_queue 0: all N in at once, or some would get 429
    firsts, lasts = [a for a, _, _ in spans], [b for _, b, _ in spans]
    # every request had its first token before any had its last: they ran together
    assert max(firsts) < min(lasts), spans
    assert all(text.strip() for _, _, text in spans)

    with serve(ServerConfig(parallel=1, max_queue=N), preload={"m": model}) as s:
        assert _ps(s)["parallel"] == 1
        spans = sorted(_spans(s, N))
    # one at a time: each one's first token came once the one before it had finished.
    # The stamps are the clients' (threads of this process): a line's stamp can trail
    # the engine by tens of ms on a loaded machine (OpenVINO's step() holds the GIL, and
    # the reading thread waits for it; 50 ms of a 210 ms span seen), so allow half a
    # request's span, far below the whole-span overlap of requests that run together
    # (above: every first token before any last one).
    for (prev_first, last, _), (first, _, _) in itertools.pairwise(spans):
        assert first > last - 0.5 * (last - prev_first), spans


def test_a_request_arriving_mid_stream_starts_before_that_one_ends(model: Any) -> None:
    """A long generation that arrived alone does not hold the engine to its end: a
    request that arrives while it streams gets its first token before the long one's
    last (both through the engine's batch)."""
    _batches_alone(model)
    long, short = 256, 4
    streaming = threading.Event()
    spans: list[Any] = [None, None]

    def one(url: str, i: int, tokens: int, first: threading.Event | None) -> None:
        body = json.dumps({"model": "m", "prompt": COUNTING, "raw": True, "stream": True,
                           "options": {"num_predict": tokens, "temperature": 0}}).encode()
        times: list[float] = []
        try:
            req = urllib.request.Request(url + "/api/generate", data=body, method="POST")
            with urllib.request.urlopen(req, timeout=WAIT) as r:
                for line in r:
                    part = json.loads(line)
                    if part.get("response"):
                        times.append(_seconds(part["created_at"]))
                        if first is not None:
                            first.set()
                    if part.get("done"):
                        spans[i] = (times[0], times[-1], len(times), part.get("eval_count"))
        except Exception as e:  # asserted below, with what it was
            spans[i] = repr(e)
        finally:
            if first is not None:
                first.set()

    with serve(ServerConfig(parallel=N), preload={"m": model}) as s:
        first = threading.Thread(target=one, args=(s.url, 0, long, streaming))
        first.start()
        assert streaming.wait(WAIT)
        second = threading.Thread(target=one, args=(s.url, 1, short, None))
        second.start()
        second.join(WAIT * 2)
        first.join(WAIT * 2)
    assert all(isinstance(x, tuple) for x in spans), spans
    (first_a, last_a, _, count_a), (first_b, _, _, count_b) = spans
    assert count_a == long and count_b == short, spans  # COUNTING runs to the limit
    assert first_a < first_b < last_a, spans


def test_whole_answers_run_together_without_crossing_threads_per_token(
        model: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Requests that ask for one JSON answer, N at once, get the reply a streamed one
    gets; their workers post one "done" event each, none per token (a token's trip
    through a worker thread and the event loop took a core from the engine's threads
    mid-step)."""
    from localrun.server import jobs

    _batches_alone(model)
    kinds: list[str] = []
    put = jobs.Job._put

    def counted(self: Any, event: Any) -> None:
        kinds.append(event.kind)
        put(self, event)

    monkeypatch.setattr(jobs.Job, "_put", counted)
    body = {"model": "m", "prompt": COUNTING, "raw": True, "stream": False,
            "options": {"num_predict": TOKENS, "temperature": 0}}
    barrier = threading.Barrier(N)
    answers: list[Any] = [None] * N

    def one(url: str, i: int) -> None:
        barrier.wait(WAIT)
        try:
            status, _, raw = request("POST", url + "/api/generate", body)
            answers[i] = json.loads(raw) if status == 200 else (status, raw)
        except Exception as e:  # asserted below, with what it was
            answers[i] = repr(e)

    with serve(ServerConfig(parallel=N, max_queue=0), preload={"m": model}) as s:
        streamed = _spans(s, 1)[0][2]
        kinds.clear()
        threads = [threading.Thread(target=one, args=(s.url, i)) for i in range(N)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(WAIT * 2)
    assert all(isinstance(a, dict) for a in answers), answers
    assert [a["response"] for a in answers] == [streamed] * N
    assert [a["eval_count"] for a in answers] == [TOKENS] * N
    assert kinds == ["done"] * N, kinds


def test_default_parallel_is_the_engines_capacity_at_most_4_on_the_cpu(model: Any) -> None:
    from localrun.cli.serve import banner
    from localrun.server.manager import DEFAULT_PARALLEL_CPU

    with serve(ServerConfig(), preload={"m": model}) as s:
        ps = _ps(s)
        text = banner(s.manager.config, list(s.manager.models.values()))
        status, _, body = request("GET", s.v1 + "/models")
    assert status == 200
    want = min(model.max_concurrency, DEFAULT_PARALLEL_CPU)
    assert model.info.device in (None, "cpu", "CPU") and ps["parallel"] == want
    assert ps["running"] == 0 and ps["waiting"] == 0
    assert json.loads(body)["data"][0]["parallel"] == want
    assert f"context {model.info.context_length} · {want} requests at once" in text


@contextlib.contextmanager
def _load_on_request(config: ServerConfig, path: str, loads: list[str] | None = None
                     ) -> Iterator[tuple[dict[str, Any], Any]]:
    """Serve ``config`` and load ``path`` as a request would (Ollama's way: /api/generate
    with no prompt): its /api/ps entry and the Model the server loaded, until the block
    ends. ``loads`` gets the name of each model the server loads."""
    from localrun.server.manager import ModelManager, _load_chat
    from localrun.server.metrics import Metrics

    def load(name: str, config: ServerConfig, context: int | None,
             target: Any = None) -> Any:
        if loads is not None:
            loads.append(name)
        return _load_chat(name, config, context, target)

    config = replace(config, allow_local_paths=True)  # a path, by request
    with serve(config, manager=ModelManager(config, Metrics(), loader=load)) as s:
        status, _, body = request("POST", s.url + "/api/generate", {"model": path})
        assert status == 200, body
        (loaded,) = s.manager.models.values()
        yield _ps(s), loaded.handle


@pytest.mark.skipif(not HAVE_LLAMA, reason="llama-cpp-python is not installed "
                    "(pip install -e '.[llama-cpp]')")
def test_llama_cpp_counts_the_batch_context_it_builds() -> None:
    """llama.cpp's batcher is a second context with a KV stream of the whole context
    per slot of its own, one for each request the server runs at once (--parallel, 4 by
    default on the CPU), not as many as memory would hold (8): a model loaded on request
    counts its weights, overhead and KV cache plus those streams. Where --max-memory
    holds fewer, the batch context is built with as many as fit, and where it holds not
    even two, none is built (one request at a time): sized before it is built, the model
    loaded once."""
    from localrun.server.manager import DEFAULT_PARALLEL_CPU
    from localrun.server.sizing import estimate_bytes, estimate_loaded
    from tests.models import test_model

    path = str(test_model("gguf-q4_1"))
    base = ServerConfig(context=512, keep_alive=None, parallel=3)
    need = estimate_bytes(path, None, base)  # weights, overhead, one KV cache
    for parallel, want in ((None, DEFAULT_PARALLEL_CPU), (3, 3)):
        with _load_on_request(replace(base, parallel=parallel), path) as (ps, handle):
            est = estimate_loaded(handle.info, None)
            streams = handle._session._batcher.capacity  # its batch context's KV streams
            reserved = handle._session._batcher.reserved_bytes  # what it allocated
            held = handle.footprint(want)
        assert need and est is not None and est.kv_cache_bytes > 0
        assert ps["parallel"] == want == streams == held.slots  # a stream per request
        assert reserved == want * est.kv_cache_bytes  # each the session's whole context
        assert ps["size"] == need + reserved == held.total  # the engine's own footprint

    stream, loads = est.kv_cache_bytes, []
    for room, fit in ((need + 2 * stream, 2), (need + 2 * stream - 1, 1)):
        with _load_on_request(replace(base, max_memory=room), path, loads) as (ps, handle):
            batcher = getattr(handle._session, "_batcher", None)
            streams = batcher.capacity if batcher is not None else 0
        assert ps["parallel"] == fit and streams == (fit if fit > 1 else 0)
        assert ps["size"] == need + streams * stream <= room
    assert loads == [path, path]  # once per server: never loaded again without a batcher


@pytest.mark.skipif(importlib.util.find_spec("openvino_genai") is None,
                    reason="openvino-genai is not installed (pip install -e '.[openvino]')")
def test_openvino_counts_one_kv_cache_whatever_runs_at_once(tmp_path: Path) -> None:
    """OpenVINO GenAI runs every sequence through the session's one pipeline, whose
    paged KV cache is one context's worth of blocks: requests at once share it, so a
    --max-memory that holds the model and one KV cache lets all N run."""
    from localrun.server.sizing import estimate_bytes, estimate_path
    from tests.models import test_model

    # the IR with the model's config.json beside it, as OpenVINO's repos ship it (the
    # fixture's GGUF export has none: its KV cache would count as unknown, 0 bytes)
    for f in test_model("openvino-int4").iterdir():
        (tmp_path / f.name).symlink_to(f)
    shutil.copy(test_model("hf") / "config.json", tmp_path)
    path = str(tmp_path)
    config = ServerConfig(context=512, keep_alive=None, parallel=N)
    need = estimate_bytes(path, None, config)  # weights, overhead, one KV cache
    one = estimate_path(path, 512, "openvino", "CPU")
    assert need and one is not None and need == one.total_bytes and one.kv_cache_bytes > 0
    with _load_on_request(replace(config, max_memory=need), path) as (ps, handle):
        assert handle.info.backend == "openvino"
        held = handle.footprint(N)
    assert held.per_slot == 0 and held.total == need  # one paged KV cache, shared
    assert ps["parallel"] == N and ps["size"] == need


@pytest.mark.skipif(not HAVE_LLAMA, reason="llama-cpp-python is not installed "
                    "(pip install -e '.[llama-cpp]')")
def test_a_model_named_at_start_sizes_its_batch_context_to_memory() -> None:
    """The same for a model named on the command line (loaded before serving): as many
    KV streams as --max-memory holds beside it, none where it holds one request."""
    import localrun
    from localrun.server.manager import ModelManager
    from localrun.server.metrics import Metrics
    from localrun.server.sizing import estimate_bytes, estimate_path
    from tests.models import test_model

    path = str(test_model("gguf-q4_1"))
    config = ServerConfig(context=512, keep_alive=None, parallel=N)
    need = estimate_bytes(path, None, config)
    assert need
    loads: list[str] = []

    def load(name: str) -> Any:
        loads.append(name)
        return localrun.load(name, context=512)

    one = estimate_path(path, 512, "llama.cpp", "cpu")
    assert one is not None and one.total_bytes == need
    stream = one.kv_cache_bytes  # a KV stream holds the session's whole context
    for room, fit in ((need + 3 * stream, 3), (need + stream, 1)):
        manager = ModelManager(replace(config, max_memory=room), Metrics())
        (m,) = manager.preload((path,), load=load)
        try:
            batcher = getattr(m.handle._session, "_batcher", None)
            streams = batcher.capacity if batcher is not None else 0
            assert m.slots == fit and streams == (fit if fit > 1 else 0)
            assert m.size == need + streams * stream <= room
        finally:
            m.handle.close()
    assert loads == [path, path]  # once each: never loaded again without a batcher
