"""localrun serve against clients that hold connections without sending (issue 24, item 3),
and the streams a drain cuts (item 9): request headers and bodies are timed, connections
capped overall and per client, accept errors logged once, the response never timed; a
stream still running when --drain-timeout is over ends with an error event.

Everything on 127.0.0.1 (the other clients from 127.0.0.2 and .3), bounded in sockets
and seconds.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import pytest

from localrun.server.config import ServerConfig
from tests.conftest import localrun_cmd, requires_llama
from tests.serverutil import MODEL, WAIT, Running, request, serve, server_fixtures

COUNTING = "1, 2, 3, 4, 5, 6, 7, 8,"  # SmolLM2 keeps counting: no early end of sequence
#: what the server takes beyond a timeout to act on it, on a loaded 2-core box
SLACK = 4.0


def _open(port: int, data: bytes = b"", source: str = "127.0.0.1") -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.bind((source, 0))
    except OSError as e:
        s.close()
        pytest.skip(f"cannot send from {source} here ({e.strerror}): Linux routes all of "
                    "127/8 to loopback, macOS only 127.0.0.1")
    s.connect(("127.0.0.1", port))
    if data:
        s.sendall(data)
    return s


def _partial(port: int) -> bytes:
    """Request headers without the blank line that ends them."""
    return f"GET /health HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n".encode()


def _closed_within(s: socket.socket, seconds: float) -> tuple[bool, bytes]:
    """Whether the server closed ``s`` within ``seconds``, and what it sent."""
    got = b""
    deadline = time.monotonic() + seconds
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return False, got
        s.settimeout(left)
        try:
            data = s.recv(65536)
        except TimeoutError:
            return False, got
        except ConnectionResetError:
            return True, got
        if not data:
            return True, got
        got += data


def _is_open(s: socket.socket) -> bool:
    closed, _ = _closed_within(s, 0.3)
    return not closed


def _error(raw: bytes) -> tuple[int, Any]:
    head, _, body = raw.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    return status, json.loads(body)


def _health(url: str, timeout: float) -> tuple[int, float]:
    t0 = time.monotonic()
    status, _, _ = request("GET", url + "/health", timeout=timeout)
    return status, time.monotonic() - t0


@contextlib.contextmanager
def _sockets() -> Iterator[list[socket.socket]]:
    held: list[socket.socket] = []
    try:
        yield held
    finally:
        for s in held:
            s.close()


# -- timing what a client sends ----------------------------------------------------------

def test_half_sent_headers_are_closed_at_the_header_timeout() -> None:
    with serve(ServerConfig(header_timeout=1.0)) as srv, _sockets() as held:
        port = urlsplit(srv.url).port
        assert port is not None
        t0 = time.monotonic()
        for _ in range(10):
            held.append(_open(port, _partial(port)))  # headers never finished
        for _ in range(10):
            held.append(_open(port))  # nothing sent at all
        ends = []
        for i, s in enumerate(held):
            closed, got = _closed_within(s, 1.0 + SLACK - (time.monotonic() - t0))
            assert closed, f"connection {i} still open {time.monotonic() - t0:.1f} s " \
                "after connecting (--header-timeout 1)"
            ends.append(time.monotonic() - t0)
            if i < 10:  # a request was begun: it is answered 408, in JSON
                status, body = _error(got)
                assert status == 408 and "--header-timeout" in body["error"]["message"]
            else:
                assert got == b""  # nothing asked, nothing answered
        assert min(ends) > 0.8  # the timeout closed them, nothing earlier
        assert _health(srv.url, WAIT)[0] == 200


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/api/chat"])
def test_a_body_slower_than_allowed_is_closed(path: str, caplog: pytest.LogCaptureFixture
                                              ) -> None:
    with serve(ServerConfig(body_timeout=1.0)) as srv, _sockets() as held:
        port = urlsplit(srv.url).port
        assert port is not None
        s = _open(port, f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
                  "Content-Type: application/json\r\nContent-Length: 100000\r\n\r\n{".encode())
        held.append(s)
        t0 = time.monotonic()
        closed, got = False, b""
        while time.monotonic() - t0 < 1.0 + SLACK:  # a byte every 0.1 s: 10 B/s
            closed, got = _closed_within(s, 0.1)
            if closed:
                break
            with contextlib.suppress(OSError):
                s.send(b" ")
        assert closed, "a body trickling at 10 B/s was still read after " \
            f"{time.monotonic() - t0:.1f} s (--body-timeout 1)"
        status, body = _error(got)
        message = body["error"] if path.startswith("/api/") else body["error"]["message"]
        assert status == 408 and "--body-timeout" in message  # in the route's own shape
        assert _health(srv.url, WAIT)[0] == 200
    assert not [r for r in caplog.records if r.levelname == "ERROR"], caplog.text


# -- capping connections -----------------------------------------------------------------

def test_one_client_cannot_hold_all_connections() -> None:
    with serve(ServerConfig(max_connections_per_client=4)) as srv, _sockets() as held:
        port = urlsplit(srv.url).port
        assert port is not None
        # 10 half-sent requests from one address: each past the 4th closes that client's
        # longest waiting one (waiting 0.5 s at least), so it holds its newest 4
        for _ in range(10):
            held.append(_open(port, _partial(port), source="127.0.0.2"))
            time.sleep(0.2)
        states = [_is_open(s) for s in held]
        assert states == [False] * 6 + [True] * 4, states
        status, seconds = _health(srv.url, 5.0)  # another client is served at once
        assert status == 200 and seconds < 5.0
        # 4 requests running from one address (bodies under way): a 5th is refused
        busy = [_open(port, f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}"
                      "\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
                      .encode(), source="127.0.0.3") for _ in range(4)]
        held.extend(busy)
        time.sleep(0.3)
        fifth = _open(port, _partial(port), source="127.0.0.3")
        held.append(fifth)
        closed, got = _closed_within(fifth, SLACK)
        assert closed and _error(got)[0] == 429
        message = _error(got)[1]["error"]["message"]
        assert "at most 4 per client (--max-connections-per-client)" in message, message
        assert all(_is_open(s) for s in busy)  # running requests are never the ones closed
        assert _health(srv.url, 5.0)[0] == 200


def test_at_the_cap_a_waiting_connection_makes_room() -> None:
    with serve(ServerConfig(max_connections=6)) as srv, _sockets() as held:
        port = urlsplit(srv.url).port
        assert port is not None
        for source in ("127.0.0.2", "127.0.0.3"):
            for _ in range(3):  # the default per client: half the connections
                held.append(_open(port, _partial(port), source=source))
                time.sleep(0.05)
        assert all(_is_open(s) for s in held)
        time.sleep(0.5)  # a connection waits 0.5 s at least before it can be closed for room
        status, seconds = _health(srv.url, 5.0)  # the 7th: the oldest waiting one goes
        assert status == 200 and seconds < 5.0
        assert [_is_open(s) for s in held] == [False] + [True] * 5


# -- the real CLI with few file descriptors ---------------------------------------------

def _low_fd_limit(n: int) -> Any:
    def set_limit() -> None:
        import resource

        resource.setrlimit(resource.RLIMIT_NOFILE, (n, n))

    return set_limit


def _start(args: list[str], preexec: Any = None) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen([*localrun_cmd(), "serve", *args, "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=preexec)
    assert proc.stdout is not None
    lines, url = [], ""
    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        m = re.search(r"localrun serve \S+ · (http://127\.0\.0\.1:\d+)", line)
        url = m.group(1) if m else url
        if line.startswith("Ctrl-C"):
            return proc, url
    proc.kill()
    raise AssertionError("no banner from localrun serve:\n" + "".join(lines))


def _stop(proc: subprocess.Popen[str]) -> tuple[int, str]:
    proc.send_signal(signal.SIGTERM)
    try:
        out, _ = proc.communicate(timeout=WAIT)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        raise AssertionError("the server did not stop on SIGTERM:\n" + out[-3000:]) from None
    return proc.returncode, out


@pytest.mark.skipif(sys.platform == "win32", reason="no RLIMIT_NOFILE on Windows")
def test_slow_connections_beyond_the_cap_leave_health_prompt_and_the_log_quiet() -> None:
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 1024:  # this test's own side of 600 connections
        if hard != resource.RLIM_INFINITY and hard < 1024:
            pytest.skip(f"this process may open only {hard} files; the test needs 1024")
        resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))
    proc, url = _start([], preexec=_low_fd_limit(256))
    try:
        port = urlsplit(url).port
        assert port is not None
        with _sockets() as held:
            for _ in range(600):  # far more than 256 files allow
                # one refused by a full backlog is the client's problem, not the server's
                with contextlib.suppress(OSError):
                    held.append(_open(port, _partial(port)))
            time.sleep(1)  # held, not just opened (new ones keep their place for 0.5 s)
            status, seconds = _health(url, 10.0)
            assert status == 200 and seconds < 5.0, (status, seconds)
            time.sleep(0.5)
            still = sum(_is_open(s) for s in held[-300:])
            assert still < 200, f"{still} of the last 300 connections are held open"
        code, out = _stop(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(WAIT)
    assert code == 0, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    accept_lines = [ln for ln in out.splitlines() if "open files" in ln or "accept" in ln]
    assert len(accept_lines) < 20 and len(out) < 20_000, out[-3000:]


#: a server (localrun's make_server, in a child process) whose file descriptors another
#: thread takes, all of them, once it serves; then gives back after 4 s
_OUT_OF_FILES = """
import os, resource, sys, threading, time
resource.setrlimit(resource.RLIMIT_NOFILE, (128, 128))
from localrun.server.app import bind, create_app, make_server
from localrun.server.config import ServerConfig

sock = bind("127.0.0.1", 0)
config = ServerConfig(port=sock.getsockname()[1], max_connections=16,
                      max_connections_per_client=16)
server = make_server(create_app(config), config)

def take_all_files():
    while not server.started:
        time.sleep(0.01)
    taken = []
    try:
        while True:
            taken.append(os.open(os.devnull, os.O_RDONLY))
    except OSError:
        pass
    print(sock.getsockname()[1], flush=True)
    time.sleep(4)
    for fd in taken:
        os.close(fd)
    print("given back", flush=True)
    time.sleep(2)
    server.should_exit = True

threading.Thread(target=take_all_files, daemon=True).start()
server.run(sockets=[sock])
"""


@pytest.mark.skipif(sys.platform == "win32", reason="no RLIMIT_NOFILE on Windows")
def test_an_accept_out_of_files_is_one_line_not_a_loop() -> None:
    import os
    from pathlib import Path

    proc = subprocess.Popen([sys.executable, "-c", _OUT_OF_FILES], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            cwd=Path(__file__).resolve().parent.parent,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline() or 0)
        assert port, proc.stderr.read() if proc.stderr else ""
        with _sockets() as held:
            for _ in range(50):  # each accept fails: no file left
                held.append(_open(port, f"GET /health HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
                                  "Connection: close\r\n\r\n".encode()))
            assert proc.stdout.readline().strip() == "given back"
            # then served, 16 at least (at most 16 open at once: others may get 429)
            deadline = time.monotonic() + WAIT
            answers = [_closed_within(s, max(0.1, deadline - time.monotonic()))[1]
                       for s in held]
        assert sum(a.startswith(b"HTTP/1.1 200") for a in answers) >= 16, answers
        assert all(a.startswith((b"HTTP/1.1 200", b"HTTP/1.1 429")) or not a
                   for a in answers), answers
        _, err = proc.communicate(timeout=WAIT)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(WAIT)
    lines = [ln for ln in err.splitlines() if "accept" in ln or "open files" in ln]
    assert "Traceback" not in err and 1 <= len(lines) <= 2, err[-3000:]
    assert "Too many open files" in lines[0] and "ulimit -n" in lines[0], lines


# -- streams: not timed, and ended with an error when the drain is over -----------------

server_model, srv = server_fixtures(ServerConfig(header_timeout=0.3, body_timeout=0.5))


@requires_llama
@pytest.mark.slow
def test_a_stream_longer_than_the_timeouts_completes_and_keep_alive_stays(srv: Running
                                                                          ) -> None:
    u = urlsplit(srv.url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=WAIT)
    try:
        t0 = time.monotonic()
        conn.request("POST", "/v1/completions", headers={"Content-Type": "application/json"},
                     body=json.dumps({"model": MODEL, "prompt": COUNTING, "max_tokens": 256,
                                      "temperature": 0, "stream": True}))
        r = conn.getresponse()
        text = r.read().decode()
        took = time.monotonic() - t0
        assert r.status == 200 and text.rstrip().endswith("data: [DONE]"), text[-500:]
        assert took > 0.6, f"the stream took {took:.2f} s: too short to show anything"
        local = conn.sock.getsockname()
        time.sleep(0.7)  # idle past --header-timeout, within the keep-alive (5 s)
        conn.request("GET", "/health")
        assert conn.getresponse().read() and conn.sock.getsockname() == local
        # a body that takes longer than --body-timeout, but at 7 KiB/s
        body = json.dumps({"model": MODEL, "prompt": "1, 2,", "max_tokens": 2}).encode()
        body += b" " * (6144 - len(body))
        s = _open(u.port or 0, f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{u.port}"
                  f"\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
                  "Connection: close\r\n\r\n".encode())
        with s:
            for i in range(0, len(body), 1024):
                s.sendall(body[i:i + 1024])
                time.sleep(0.15)
            closed, got = _closed_within(s, WAIT)
        assert closed and got.startswith(b"HTTP/1.1 200"), got[:300]
    finally:
        conn.close()


@requires_llama
@pytest.mark.slow
def test_streams_running_when_the_drain_is_over_end_with_an_error_event() -> None:
    from tests.models import test_model

    path = str(test_model("gguf-q4_1"))
    proc, url = _start([path, "--context", "2048", "--backend", "llama.cpp",
                        "--drain-timeout", "1", "--parallel", "2"])
    try:
        u = urlsplit(url)
        streams = []
        for route, body in (
                ("/v1/completions", {"model": path, "prompt": COUNTING, "max_tokens": 1500,
                                     "temperature": 0, "stream": True}),
                ("/api/generate", {"model": path, "prompt": COUNTING, "stream": True,
                                   "options": {"num_predict": 1500, "temperature": 0}})):
            conn = http.client.HTTPConnection(u.hostname, u.port, timeout=WAIT)
            conn.request("POST", route, body=json.dumps(body),
                         headers={"Content-Type": "application/json"})
            r = conn.getresponse()
            assert r.status == 200 and r.readline().strip()  # it is running
            streams.append((conn, r))
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        rests = []
        for conn, r in streams:
            try:
                rests.append(r.read().decode())  # to its end: no IncompleteRead
            except http.client.IncompleteRead as e:
                raise AssertionError("a stream was cut without an error event: "
                                     + e.partial.decode()[-300:]) from None
            conn.close()
        openai_last = [ln for ln in rests[0].splitlines() if ln.startswith("data: ")][-1]
        error = json.loads(openai_last[6:])["error"]
        assert error["code"] == "server_stopping" and "--drain-timeout" in error["message"]
        ollama_last = json.loads(rests[1].strip().splitlines()[-1])
        assert set(ollama_last) == {"error"} and "--drain-timeout" in ollama_last["error"]
        assert proc.wait(WAIT) == 0
        assert time.monotonic() - t0 < 1 + 2 + SLACK * 2  # drain, uvicorn's grace, slack
        assert proc.stdout is not None
        out = proc.stdout.read()
        assert "Traceback" not in out and "ended 2 requests still running" in out, out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(WAIT)

