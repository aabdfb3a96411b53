"""localrun serve under load and faults: the queue and 429, disconnects, timeouts, engine
errors, keep-alive and LRU unloading, auth, CORS, metrics, the access log, SIGTERM.

Everything on 127.0.0.1, bounded in requests and seconds.
"""

from __future__ import annotations

import http.client
import json
import logging
import signal
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import pytest

from tests.conftest import localrun_cmd, requires_llama
from tests.serverutil import (
    MODEL,
    WAIT,
    Running,
    metric,
    request,
    serve,
    server_fixtures,
    start_cli,
)

openai = pytest.importorskip("openai", reason="the openai client is not installed "
                             "(pip install -e '.[dev]')")

from localrun.server.config import ServerConfig  # noqa: E402

pytestmark = [requires_llama, pytest.mark.slow]
COUNTING = "1, 2, 3, 4, 5, 6, 7, 8,"  # SmolLM2 keeps counting: no early end of sequence


def _conn(url: str, timeout: float = WAIT) -> http.client.HTTPConnection:
    u = urlsplit(url)
    return http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)


def _stream(url: str, body: dict[str, Any], path: str = "/v1/completions"
            ) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    conn = _conn(url)
    conn.request("POST", path, body=json.dumps({**body, "stream": True}),
                 headers={"Content-Type": "application/json"})
    return conn, conn.getresponse()


def _wait_for(check: Any, seconds: float = WAIT, what: str = "condition") -> None:
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


server_model, srv = server_fixtures(ServerConfig(max_queue=8))


def test_burst_of_64_streams_gets_only_200_and_429(srv: Running) -> None:
    n = 64
    barrier = threading.Barrier(n)
    results: list[tuple[int, bool, str]] = [(0, False, "")] * n

    def one(i: int) -> None:
        barrier.wait(WAIT)
        try:
            conn, r = _stream(srv.url, {"model": MODEL, "prompt": COUNTING, "max_tokens": 6,
                                        "temperature": 0})
            body = r.read().decode()
            results[i] = (r.status, body.rstrip().endswith("data: [DONE]"),
                          r.headers.get("Retry-After") or "")
            conn.close()
        except Exception as e:  # recorded, asserted below
            results[i] = (-1, False, repr(e))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT * 2)
    statuses = [s for s, _, _ in results]
    assert set(statuses) <= {200, 429}, results
    ok, busy = statuses.count(200), statuses.count(429)
    assert ok >= 1 and busy >= 1, statuses
    assert all(done for s, done, _ in results if s == 200)
    assert all(int(ra) >= 1 for s, _, ra in results if s == 429)
    assert request("GET", srv.url + "/health")[0] == 200
    assert metric(srv.url, "localrun_requests_rejected_total", model=MODEL,
                  reason="queue_full") >= busy
    assert metric(srv.url, "localrun_requests_running", model=MODEL) == 0
    assert metric(srv.url, "localrun_queue_depth", model=MODEL) == 0


def test_429_when_the_queue_is_full(server_model: Any) -> None:
    with serve(ServerConfig(parallel=1, max_queue=0), preload={MODEL: server_model}) as s:
        conn, r = _stream(s.url, {"model": MODEL, "prompt": COUNTING, "max_tokens": 400,
                                  "temperature": 0})
        assert r.status == 200 and r.readline()  # generating now
        client = openai.OpenAI(base_url=s.v1, api_key="x", max_retries=0)
        with pytest.raises(openai.RateLimitError) as e:
            client.completions.create(model=MODEL, prompt="hi", max_tokens=2)
        assert int(e.value.response.headers["Retry-After"]) >= 1
        assert "--max-queue 0" in e.value.body["message"]
        conn.close()  # disconnect: the slot comes back
        _wait_for(lambda: metric(s.url, "localrun_requests_running", model=MODEL) == 0,
                  what="the cancelled request to end")
        r2 = client.completions.create(model=MODEL, prompt="hi", max_tokens=2)
        assert r2.choices[0].text is not None


def test_a_client_that_leaves_the_queue_frees_its_place(server_model: Any) -> None:
    with serve(ServerConfig(parallel=1, max_queue=1), preload={MODEL: server_model}) as s:
        conn_a, a = _stream(s.url, {"model": MODEL, "prompt": COUNTING, "max_tokens": 4000,
                                    "temperature": 0})
        assert a.status == 200 and a.readline()  # A runs
        b = socket.create_connection(("127.0.0.1", urlsplit(s.url).port), timeout=WAIT)
        body = json.dumps({"model": MODEL, "prompt": "Hi", "max_tokens": 2}).encode()
        b.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
                  b"application/json\r\nContent-Length: " + str(len(body)).encode() +
                  b"\r\n\r\n" + body)
        _wait_for(lambda: metric(s.url, "localrun_queue_depth", model=MODEL) == 1,
                  what="B to wait in the queue")
        b.close()  # B gives up while queued
        _wait_for(lambda: metric(s.url, "localrun_queue_depth", model=MODEL) == 0,
                  seconds=10, what="B's place to be freed")
        results: list[int] = []
        c = threading.Thread(target=lambda: results.append(request(
            "POST", s.v1 + "/completions", {"model": MODEL, "prompt": "Hi",
                                             "max_tokens": 2})[0]))
        c.start()  # C fits in the queue again (A running, nobody waiting)
        _wait_for(lambda: metric(s.url, "localrun_queue_depth", model=MODEL) == 1,
                  what="C to be queued")
        conn_a.close()  # A leaves: C runs
        c.join(WAIT)
        assert results == [200]


def test_disconnect_stops_the_sequence(srv: Running) -> None:
    before = metric(srv.url, "localrun_completion_tokens_total", model=MODEL)
    conn, r = _stream(srv.url, {"model": MODEL, "prompt": COUNTING, "max_tokens": 4000,
                                "temperature": 0})
    got = 0
    while got < 3:  # three tokens in, the client goes away
        line = r.readline()
        assert line, "the stream ended early"
        got += line.startswith(b"data: {")
    conn.sock.shutdown(socket.SHUT_RDWR)  # type: ignore[union-attr]
    conn.close()
    t0 = time.monotonic()
    _wait_for(lambda: metric(srv.url, "localrun_requests_running", model=MODEL) == 0,
              seconds=20, what="the generation to stop")
    stopped_after = time.monotonic() - t0
    generated = metric(srv.url, "localrun_completion_tokens_total", model=MODEL) - before
    # 4000 tokens would take minutes here; it stopped within a few tokens of the disconnect
    assert generated < 200, generated
    assert stopped_after < 20
    status, _, body = request("POST", srv.v1 + "/completions",
                              {"model": MODEL, "prompt": "Hi", "max_tokens": 3})
    assert status == 200, body


def test_timeout_answers_504_and_the_server_goes_on(server_model: Any) -> None:
    with serve(ServerConfig(request_timeout=1.0), preload={MODEL: server_model}) as s:
        status, _, body = request("POST", s.v1 + "/completions",
                                  {"model": MODEL, "prompt": COUNTING, "max_tokens": 4000,
                                   "temperature": 0})
        assert status == 504, body
        assert "timed out after 1 s" in json.loads(body)["error"]["message"]
        _wait_for(lambda: metric(s.url, "localrun_requests_running", model=MODEL) == 0,
                  seconds=20, what="the timed-out generation to stop")
        status, _, _ = request("POST", s.v1 + "/completions",
                               {"model": MODEL, "prompt": "Hi", "max_tokens": 2})
        assert status == 200


def test_engine_error_is_a_500_and_the_server_stays_up(srv: Running) -> None:
    import localrun
    from tests.models import test_model

    with localrun.load(str(test_model("gguf-q4_1")), backend="llama.cpp", context=512) as m:
        session = m._session
        real = session.generate

        def failing(*args: Any, **kwargs: Any) -> Iterator[str]:
            pieces = real(*args, **kwargs)
            yield next(pieces)
            raise RuntimeError("simulated engine fault")

        session.generate = failing  # type: ignore[method-assign]
        # one at a time: no batcher is built, so every request runs the failing generate()
        failing = srv.manager._register("failing", "chat", None, m, 0.0, pinned=True,
                                        held=m.footprint(1))
        try:
            status, _, body = request("POST", srv.v1 + "/chat/completions", {
                "model": "failing", "messages": [{"role": "user", "content": "Hi"}]})
            err = json.loads(body)["error"]
            assert status == 500 and "simulated engine fault" in err["message"], body
            assert err["type"] == "server_error" and "Traceback" not in body.decode()
            conn, r = _stream(srv.url, {"model": "failing", "prompt": "Hi"})
            lines = r.read().decode().splitlines()
            assert r.status == 200  # the first token made it: the error comes in the stream
            assert any("simulated engine fault" in ln for ln in lines), lines
            conn.close()
            session.generate = real  # type: ignore[method-assign]
            status, _, _ = request("POST", srv.v1 + "/chat/completions", {
                "model": "failing", "max_tokens": 2,
                "messages": [{"role": "user", "content": "Hi"}]})
            assert status == 200
        finally:
            del srv.manager.models[failing.key]
            srv.manager.metrics.models_loaded.set(len(srv.manager.models))


def test_auth(server_model: Any) -> None:
    with serve(ServerConfig(api_key="s3cret"), preload={MODEL: server_model}) as s:
        bad = openai.OpenAI(base_url=s.v1, api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError) as e:
            bad.models.list()
        assert e.value.status_code == 401 and "Invalid API key" in e.value.body["message"]
        assert request("GET", s.url + "/health")[0] == 200  # health stays public
        for path in ("/metrics", "/api/tags", "/api/ps", "/v1/models", "/"):
            status, headers, _ = request("GET", s.url + path)
            assert status == 401 and headers.get("www-authenticate") == "Bearer", path
        good = openai.OpenAI(base_url=s.v1, api_key="s3cret", max_retries=0)
        assert next(m.id for m in good.models.list()) == MODEL
        status, _, body = request("GET", s.url + "/api/ps",
                                  headers={"Authorization": "Bearer s3cret"})
        assert status == 200 and json.loads(body)["models"]


def test_cors_off_by_default_and_on_for_named_origins(srv: Running,
                                                      server_model: Any) -> None:
    pre = {"Origin": "http://app.example", "Access-Control-Request-Method": "POST",
           "Access-Control-Request-Headers": "content-type"}
    _, headers, _ = request("OPTIONS", srv.v1 + "/chat/completions", headers=pre)
    assert "access-control-allow-origin" not in {k.lower() for k in headers}
    with serve(ServerConfig(cors_origins=("http://app.example",), api_key="k"),
               preload={MODEL: server_model}) as s:
        status, headers, _ = request("OPTIONS", s.v1 + "/chat/completions", headers=pre)
        low = {k.lower(): v for k, v in headers.items()}
        assert status == 200 and low["access-control-allow-origin"] == "http://app.example"
        status, headers, _ = request("OPTIONS", s.v1 + "/chat/completions",
                                     headers={**pre, "Origin": "http://evil.example"})
        assert status == 400
        assert "access-control-allow-origin" not in {k.lower() for k in headers}


def test_metrics_and_access_log(srv: Running, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="localrun.server.access"):
        status, _, _ = request("POST", srv.v1 + "/chat/completions", {
            "model": MODEL, "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "user", "content": "Hi"}]})
        assert status == 200
        _wait_for(lambda: any("/v1/chat/completions" in r.getMessage()
                              for r in caplog.records), what="the access log line")
    lines = [r.getMessage() for r in caplog.records if "/v1/chat/completions" in
             r.getMessage()]
    assert len(lines) == 1
    assert '"POST /v1/chat/completions" 200' in lines[0] and f"model={MODEL}" in lines[0]
    assert "tokens=" in lines[0]
    _, headers, body = request("GET", srv.url + "/metrics")
    text = body.decode()
    assert headers["content-type"].startswith("text/plain")
    assert metric(srv.url, "localrun_time_to_first_token_seconds_count", model=MODEL) >= 1
    assert metric(srv.url, "localrun_time_per_output_token_seconds_count", model=MODEL) >= 1
    assert metric(srv.url, "localrun_requests_total", endpoint="/v1/chat/completions",
                  model=MODEL, status="200") >= 1
    assert "localrun_queue_depth" in text and "localrun_models_loaded 1.0" in text


def test_keep_alive_and_lru_unloading() -> None:
    from localrun.server.sizing import estimate_bytes
    from tests.models import test_model

    small, large = str(test_model("gguf-q4_1")), str(test_model("gguf-q8_0"))
    # one KV cache a model; the models are loaded by path
    base = ServerConfig(context=512, keep_alive=1.0, parallel=1, allow_local_paths=True)
    need = estimate_bytes(small, None, base) or 0
    need_large = estimate_bytes(large, None, base) or 0
    assert need and need_large
    from dataclasses import replace

    # room for either model, not both: the least recently used one goes
    with serve(replace(base, keep_alive=None, max_memory=need + need_large - 1)) as s:
        for path in (small, large):
            status, _, body = request("POST", s.url + "/api/generate", {
                "model": path, "prompt": "Hi", "stream": False,
                "options": {"num_predict": 1}})
            assert status == 200, body
        loaded = [m["model"] for m in json.loads(request("GET", s.url + "/api/ps")[2])
                  ["models"]]
        assert loaded == [large]
    with serve(replace(base, keep_alive=None, max_memory=need + need_large)) as s:
        for path in (small, large):
            assert request("POST", s.url + "/api/generate", {"model": path})[0] == 200
        assert len(json.loads(request("GET", s.url + "/api/ps")[2])["models"]) == 2
    # keep-alive: an idle model unloads by itself
    with serve(base) as s:
        assert request("POST", s.url + "/api/generate", {"model": small})[0] == 200
        ps = json.loads(request("GET", s.url + "/api/ps")[2])["models"]
        assert [m["model"] for m in ps] == [small] and ps[0]["expires_at"] != "2318-01-01"
        _wait_for(lambda: not json.loads(request("GET", s.url + "/api/ps")[2])["models"],
                  seconds=15, what="the keep-alive to unload the model")


def test_cli_refuses_an_exposed_server_and_a_busy_port() -> None:
    import subprocess

    proc = subprocess.run([*localrun_cmd(), "serve", "--host", "0.0.0.0"],
                          capture_output=True, text=True, timeout=WAIT)
    assert proc.returncode == 1
    assert "Refusing to serve on 0.0.0.0 without an API key" in proc.stderr
    assert "--api-key" in proc.stderr and "Traceback" not in proc.stderr
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        proc = subprocess.run([*localrun_cmd(), "serve", "--port", str(port)],
                              capture_output=True, text=True, timeout=WAIT)
    assert proc.returncode == 1 and f"Port {port} on 127.0.0.1 is already in use" in \
        proc.stderr, proc.stderr


def test_sigterm_finishes_the_request_in_flight_then_exits() -> None:
    from tests.models import test_model

    path = str(test_model("gguf-q4_1"))
    # A drain far above the default 30 s: past --drain-timeout the server cancels what
    # is still running (by design), and on a loaded 2-core box these 24 tokens can take
    # longer than 30 s: the stream is then cut mid-way, exit status 0.
    proc, url, banner = start_cli([path, "--context", "512", "--backend", "llama.cpp",
                                   "--drain-timeout", "600"])
    try:
        text = "".join(banner)
        assert "llama.cpp" in text and "context 512" in text and f"curl {url}/v1/" in text
        conn, r = _stream(url, {"model": path, "prompt": COUNTING, "max_tokens": 24,
                                "temperature": 0})
        assert r.status == 200 and r.readline().startswith(b"data: ")
        proc.send_signal(signal.SIGTERM)
        try:
            rest = r.read().decode()  # the request in flight is finished, not cut
        except http.client.IncompleteRead:
            proc.wait(WAIT)
            assert proc.stdout is not None
            raise AssertionError("the stream was cut; the server said:\n"
                                 + proc.stdout.read()) from None
        assert rest.rstrip().endswith("data: [DONE]"), rest
        finishes = [json.loads(ln[6:])["choices"][0]["finish_reason"]
                    for ln in rest.splitlines() if ln.startswith("data: {")]
        assert finishes[-1] == "length"
        assert len(finishes) >= 3  # tokens still came after the signal: it was in flight
        conn.close()
        assert proc.wait(WAIT) == 0
        with pytest.raises(OSError):  # nothing listens any more
            socket.create_connection(("127.0.0.1", urlsplit(url).port), timeout=2).close()
        assert proc.stdout is not None
        assert "localrun serve stopped" in proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(WAIT)
