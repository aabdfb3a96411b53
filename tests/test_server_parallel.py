"""localrun serve --parallel: a model whose engine batches runs several requests at once,
together in the engine's batch; with --parallel 1 (or an engine that does not batch)
they run in turn. Timestamps are the client's: when each stream's first token and its
last arrive. On 127.0.0.1, four requests of 16 tokens per server.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.conftest import HAVE_LLAMA
from tests.serverutil import WAIT, Running, request, serve

openai = pytest.importorskip("openai", reason="the openai client is not installed "
                             "(pip install -e '.[dev]')")

from localrun.server.config import ServerConfig  # noqa: E402

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
    """``n`` streaming completions started together: (first token, last token, text)."""
    client = openai.OpenAI(base_url=s.v1, api_key="unused", max_retries=0, timeout=WAIT)
    barrier = threading.Barrier(n)
    spans: list[Any] = [None] * n

    def one(i: int) -> None:
        barrier.wait(WAIT)
        first = last = 0.0
        text, finish = "", None
        try:
            for c in client.completions.create(model="m", prompt=COUNTING, stream=True,
                                               max_tokens=TOKENS, temperature=0):
                now = time.monotonic()
                if c.choices and c.choices[0].text:
                    first = first or now
                    last = now
                    text += c.choices[0].text
                if c.choices and c.choices[0].finish_reason:
                    finish = c.choices[0].finish_reason
            spans[i] = (first, last, text) if finish == "length" else repr(finish)
        except Exception as e:  # asserted below, with what it was
            spans[i] = repr(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT * 2)
    assert all(isinstance(x, tuple) and x[0] for x in spans), spans
    return spans


def _ps(s: Running) -> dict[str, Any]:
    status, _, body = request("GET", s.url + "/api/ps")
    assert status == 200
    (entry,) = json.loads(body)["models"]
    return dict(entry)


def test_parallel_requests_run_together_in_the_engines_batch(model: Any) -> None:
    assert model.max_concurrency >= N  # the engine batches at least N
    with serve(ServerConfig(parallel=N, max_queue=0), preload={"m": model}) as s:
        assert _ps(s)["parallel"] == N
        spans = _spans(s, N)  # max_queue 0: all N in at once, or some would get 429
        together = _ps(s)["size"]
    firsts, lasts = [a for a, _, _ in spans], [b for _, b, _ in spans]
    # every request had its first token before any had its last: they ran together
    assert max(firsts) < min(lasts), spans
    assert all(text.strip() for _, _, text in spans)

    with serve(ServerConfig(parallel=1, max_queue=N), preload={"m": model}) as s:
        assert _ps(s)["parallel"] == 1
        spans = sorted(_spans(s, N))
        alone = _ps(s)["size"]
    # one at a time: each one's first token came after the one before it had finished
    for (_, last, _), (first, _, _) in itertools.pairwise(spans):
        assert first > last, spans
    # memory counts a KV cache per request that runs at once
    from localrun.server.manager import _estimate_loaded

    est = _estimate_loaded(model.info, None)
    assert est is not None and est.kv_cache_bytes > 0
    assert together - alone == (N - 1) * est.kv_cache_bytes


def test_default_parallel_is_the_engines_capacity_at_most_4_on_the_cpu(model: Any) -> None:
    from localrun.server.manager import DEFAULT_PARALLEL_CPU

    with serve(ServerConfig(), preload={"m": model}) as s:
        ps = _ps(s)
        status, _, body = request("GET", s.v1 + "/models")
    assert status == 200
    want = min(model.max_concurrency, DEFAULT_PARALLEL_CPU)
    assert model.info.device in (None, "cpu", "CPU") and ps["parallel"] == want
    assert ps["running"] == 0 and ps["waiting"] == 0
    assert json.loads(body)["data"][0]["parallel"] == want
