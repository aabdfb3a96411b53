"""localrun serve --parallel: a model whose engine batches runs several requests at once,
together in the engine's batch; with --parallel 1 they run in turn. On 127.0.0.1, four
streamed requests of 16 tokens per server.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import threading
import urllib.request
from collections.abc import Iterator
from dataclasses import replace
from datetime import datetime
from typing import Any

import pytest

from tests.conftest import HAVE_LLAMA
from tests.serverutil import WAIT, Running, request, serve

pytest.importorskip("fastapi", reason="the serve extra is not installed "
                    "(pip install 'localrun[serve]')")

from localrun.server.config import ServerConfig

pytestmark = pytest.mark.slow
N = 4
TOKENS = 16
COUNTING = "1, 2, 3, 4, 5, 6, 7, 8,"  # SmolLM2 keeps counting: every reply is 16 tokens

ENGINES = [
    pytest.param(("openvino", "openvino-int4", {}), id="openvino", marks=pytest.mark.skipif(
        importlib.util.find_spec("openvino_genai") is None,
        reason="openvino-genai is not installed (pip install 'localrun[openvino]')")),
    pytest.param(("llama.cpp", "gguf-q4_1", {"threads": 1}), id="llama.cpp",
                 marks=pytest.mark.skipif(not HAVE_LLAMA, reason="llama-cpp-python is not "
                                          "installed (pip install 'localrun[llama-cpp]')")),
]


@pytest.fixture(scope="module", params=ENGINES)
def model(request: pytest.FixtureRequest) -> Iterator[Any]:
    import localrun
    from tests.models import test_model

    backend, fmt, options = request.param
    with localrun.load(str(test_model(fmt)), backend=backend, context=1024,
                       **options) as m:
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


def test_parallel_requests_run_together_in_the_engines_batch(model: Any) -> None:
    if not model._session.batch_alone:
        pytest.skip(f"{model.info.backend} runs a sequence that arrives alone through its "
                    "single-sequence path to the end (Session.batch_alone is False): the "
                    "requests that arrive meanwhile wait for it, then run together")
    assert model.max_concurrency >= N  # the engine batches at least N
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
    # one at a time: each one's first token came after the one before it had finished.
    # The last line's stamp can trail the engine by a few tens of ms (OpenVINO's step()
    # holds the GIL while the handler writes): allow a tenth of a request's span, far
    # below the whole-span overlap of requests that run together.
    for (prev_first, last, _), (first, _, _) in itertools.pairwise(spans):
        assert first > last - 0.1 * (last - prev_first), spans


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


@pytest.mark.skipif(not HAVE_LLAMA, reason="llama-cpp-python is not installed "
                    "(pip install 'localrun[llama-cpp]')")
def test_memory_counts_a_kv_cache_per_request_at_once() -> None:
    """A model loaded on request counts its weights, overhead and one KV cache per
    request it runs at once; what --max-memory cannot hold runs fewer at once."""
    from localrun.server.manager import _estimate_path
    from tests.models import test_model

    path = str(test_model("gguf-q4_1"))
    one = _estimate_path(path, 512)
    assert one is not None and one.kv_cache_bytes > 0
    kv = one.kv_cache_bytes
    base = ServerConfig(context=512, keep_alive=None, parallel=N)
    sizes = {}
    for max_memory in (None, one.total_bytes + kv + kv // 2):  # room for 2 at once, not 4
        with serve(replace(base, max_memory=max_memory)) as s:
            status, _, body = request("POST", s.url + "/api/generate", {"model": path})
            assert status == 200, body  # Ollama's way to load a model
            ps = _ps(s)
        assert ps["size"] == one.total_bytes + (ps["parallel"] - 1) * kv
        sizes[max_memory] = ps["parallel"]
    assert sizes == {None: N, one.total_bytes + kv + kv // 2: 2}
