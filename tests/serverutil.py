"""Run ``localrun serve`` for a test: in this process (uvicorn in a thread) or as a
subprocess (for signals). Always on 127.0.0.1, on a free port, stopped by the test."""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

pytest.importorskip("fastapi", reason="the serve extra is not installed "
                    "(pip install -e '.[serve]')")

from localrun.server.app import bind, create_app, make_server
from localrun.server.config import ServerConfig
from localrun.server.manager import ModelManager
from localrun.server.metrics import Metrics

#: Every wait in these tests is bounded by this (seconds), on a loaded 2-core box.
WAIT = 60.0


#: The name the shared test model is served under.
MODEL = "smollm2:135m"


def server_fixtures(config: ServerConfig) -> tuple[Any, Any]:
    """A test module's two fixtures, assigned as ``server_model, srv = server_fixtures(...)``:

    - ``server_model``: the embedded SmolLM2-135M GGUF on llama.cpp, loaded once per
      module and warmed up. One thread: on a busy 2-core machine llama.cpp's two threads
      wait on each other at every token (measured here under load: 0.1 s vs 1-1.5 s for
      6 tokens);
    - ``srv``: ``config`` served on 127.0.0.1 with that model preloaded as ``MODEL``.
    """

    @pytest.fixture(scope="module", name="server_model")
    def server_model() -> Iterator[Any]:
        import localrun
        from tests.conftest import HAVE_LLAMA
        from tests.models import test_model

        if not HAVE_LLAMA:
            pytest.skip("llama-cpp-python is not installed (pip install -e '.[llama-cpp]')")
        with localrun.load(str(test_model("gguf-q4_1")), backend="llama.cpp", context=2048,
                           threads=1, exact=True) as m:
            m.complete("1, 2, 3,", max_tokens=2, temperature=0)  # first touch of the weights
            yield m

    @pytest.fixture(scope="module", name="srv")
    def srv(server_model: Any) -> Iterator[Running]:
        with serve(config, preload={MODEL: server_model}) as s:
            yield s

    return server_model, srv


@dataclass
class Running:
    url: str
    app: Any
    manager: ModelManager
    server: Any

    @property
    def v1(self) -> str:
        return self.url + "/v1"


@contextlib.contextmanager
def serve(config: ServerConfig | None = None, *, manager: ModelManager | None = None,
          preload: dict[str, Any] | None = None) -> Iterator[Running]:
    """Serve ``config`` (port ignored: a free one) until the block ends.

    ``preload`` maps names to already-loaded localrun Models, registered as if named on
    the command line (kept loaded) so tests share one load.
    """
    from dataclasses import replace

    config = config or ServerConfig()
    sock = bind("127.0.0.1", 0)
    config = replace(config, host="127.0.0.1", port=sock.getsockname()[1])
    manager = manager or ModelManager(config, Metrics())
    for name, model in (preload or {}).items():
        manager._register(name, "chat", None, _Borrowed(model), 0.0, pinned=True)
    app = create_app(config, manager=manager)
    server = make_server(app, config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True,
                              name="test-server")
    thread.start()
    url = f"http://127.0.0.1:{config.port}"
    deadline = time.monotonic() + WAIT
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    try:
        yield Running(url, app, manager, server)
    finally:
        server.should_exit = True
        thread.join(WAIT)
        sock.close()


class _Borrowed:
    """A shared test Model lent to a server: the server's unload must not close it."""

    def __init__(self, model: Any) -> None:
        self._model = model
        self.info = model.info

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)

    def close(self) -> None:
        pass


def request(method: str, url: str, body: Any = None, headers: dict[str, str] | None = None,
            timeout: float = WAIT) -> tuple[int, dict[str, str], bytes]:
    data = json.dumps(body).encode() if body is not None and not isinstance(body, bytes) \
        else body
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json",
                                          **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def metric(url: str, name: str, **labels: str) -> float:
    """One sample of /metrics (0 when absent)."""
    _, _, body = request("GET", url + "/metrics")
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in body.decode().splitlines():
        if line.startswith("#"):
            continue
        m = re.match(r"^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+(\S+)$", line)
        if not m or m.group(1) != name:
            continue
        got = ",".join(sorted((m.group(2) or "{}")[1:-1].split(","))) if m.group(2) else ""
        if got == want:
            return float(m.group(3))
    return 0.0


def start_cli(args: list[str], env: dict[str, str] | None = None
              ) -> tuple[subprocess.Popen[str], str, list[str]]:
    """``localrun serve ARGS --port 0`` as a subprocess; returns it, its URL (from the
    banner) and the stderr lines read so far."""
    from tests.conftest import localrun_cmd

    proc = subprocess.Popen([*localrun_cmd(), "serve", *args, "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **(env or {})})
    assert proc.stdout is not None
    lines: list[str] = []
    url = ""
    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        m = re.search(r"localrun serve \S+ · (http://127\.0\.0\.1:\d+)", line)
        if m:
            url = m.group(1)
        if line.startswith("Ctrl-C"):  # the banner's last line: serving from now on
            return proc, url, lines
    proc.kill()
    raise AssertionError("no banner from localrun serve:\n" + "".join(lines))
