"""What a web page, a local process or a client without the key can make ``localrun serve``
do (issue 24: items 2 and 9): forged cross-site requests (415 for bodies that are not
JSON), DNS rebinding (the Host check), foreign origins, downloads and local paths by API
request (off unless flagged or keyed; one answer whether or not a path exists), paths in
model lists, forged access-log lines, and how the key is given.

Servers run on 127.0.0.1 in this process (tests/serverutil.py) or as a CLI subprocess;
every request count and wait is bounded.
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import signal
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from localrun.server.config import ServerConfig
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

Q = [{"role": "user", "content": "Hi"}]


server_model, srv = server_fixtures(ServerConfig())


def _raw(url: str, method: str, path: str, body: bytes | None = None,
         headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    """One request with exactly these headers (urllib adds a form Content-Type itself)."""
    u = urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=WAIT)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        conn.close()


def _message(path: str, body: bytes) -> str:
    """The error message, in either API's shape (asserting the shape is the route's)."""
    data = json.loads(body)
    if path.startswith("/api/"):
        assert isinstance(data["error"], str), data
        return str(data["error"])
    assert isinstance(data["error"], dict) and "message" in data["error"], data
    return str(data["error"]["message"])


# -- item 2: forged requests --------------------------------------------------------------

#: What a browser adds to a page's cross-site form post, less the Origin (which older
#: browsers left out of form posts, and which the Origin check refuses on its own).
BROWSER = {"User-Agent": "Mozilla/5.0 (X11; Linux x86_64) AppleWebKit/537.36 Chrome/131.0",
           "Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": "navigate"}

@requires_llama
def test_posts_that_are_not_json_get_415_and_start_nothing(monkeypatch: pytest.MonkeyPatch,
                                                           tmp_path: Path) -> None:
    """A page can POST text/plain or a form to any site without a preflight: such
    bodies are refused before anything is read, loaded or downloaded, even where the
    server allows pulls and paths."""
    from tests.hubserver import BASE, start
    from tests.models import test_model

    path = str(test_model("gguf-q4_1"))
    for fake in start(monkeypatch, tmp_path):
        config = ServerConfig(backend="llama.cpp", allow_pull=True, allow_local_paths=True)
        with serve(config) as s:
            posts = {"/v1/chat/completions": {"model": path, "messages": Q, "max_tokens": 1},
                     "/api/pull": {"model": BASE, "stream": False},
                     "/api/generate": {"model": path}}
            for route, body in posts.items():
                payload = json.dumps(body).encode()
                for ctype in ("text/plain", "application/x-www-form-urlencoded",
                              "multipart/form-data; boundary=x", None):
                    # as a browser sends it (no Origin: old browsers' form posts), and
                    # with no User-Agent at all
                    for extra in (BROWSER, {}):
                        headers = {"Content-Type": ctype} if ctype else {}
                        status, _, raw = _raw(s.url, "POST", route, payload,
                                              {**headers, **extra})
                        assert status == 415, (route, ctype, extra, raw)
                        msg = _message(route, raw)
                        assert "application/json" in msg and (ctype or "missing") in msg
            assert fake.hub.requests == []  # nothing planned, nothing downloaded
            assert s.manager.models == {}  # nothing loaded
            # JSON with parameters is JSON (what clients send)
            status, _, raw = _raw(s.url, "POST", "/api/show", b'{"model": "no-such-model"}',
                                  {"Content-Type": "Application/JSON; charset=utf-8"})
            assert status == 404, raw


def test_a_host_name_the_server_does_not_answer_to_is_refused() -> None:
    """DNS rebinding: a page of evil.example whose name now resolves to 127.0.0.1 sends
    ``Host: evil.example``; the loopback names and addresses still work, on any port
    (a forwarded port), and --allowed-hosts adds names."""
    with serve(ServerConfig()) as s:
        port = urlsplit(s.url).port
        for route in ("/v1/models", "/api/tags"):
            status, _, raw = _raw(s.url, "GET", route, headers={"Host": "evil.example"})
            assert status == 403, raw
            msg = _message(route, raw)
            assert "evil.example" in msg and "--allowed-hosts" in msg
        status, _, raw = _raw(s.url, "POST", "/api/chat", json.dumps(
            {"model": MODEL, "messages": Q}).encode(), {"Host": f"evil.example:{port}",
                                                          "Content-Type": "application/json"})
        assert status == 403 and "DNS rebinding" in _message("/api/chat", raw)
        for host in ("localhost", f"localhost:{port}", "127.0.0.1:1", f"[::1]:{port}",
                     "LOCALHOST."):
            assert _raw(s.url, "GET", "/api/version", headers={"Host": host})[0] == 200, host
        # health probes answer whatever the name (a container's service name)
        assert _raw(s.url, "GET", "/health", headers={"Host": "evil.example"})[0] == 200
    with serve(ServerConfig(allowed_hosts=("llm.example",))) as s:
        assert _raw(s.url, "GET", "/api/version", headers={"Host": "llm.example:443"}
                    )[0] == 200
        assert _raw(s.url, "GET", "/api/version", headers={"Host": "evil.example"})[0] == 403


@requires_llama
def test_a_foreign_origin_is_refused_a_listed_one_works(srv: Running,
                                                        server_model: Any) -> None:
    body = {"model": MODEL, "messages": Q, "max_tokens": 1, "temperature": 0}
    before = metric(srv.url, "localrun_prompt_tokens_total", model=MODEL)
    for origin in ("http://evil.example", "null", "http://localhost:1"):
        status, _, raw = request("POST", srv.v1 + "/chat/completions", body,
                                 headers={"Origin": origin})
        assert status == 403, (origin, raw)
        assert "--cors-origins" in _message("/v1/", raw)
    assert metric(srv.url, "localrun_prompt_tokens_total", model=MODEL) == before  # no work
    # the server's own origin is not foreign
    status, _, raw = request("POST", srv.v1 + "/chat/completions", body,
                             headers={"Origin": srv.url})
    assert status == 200, raw
    app = "http://app.example"
    with serve(ServerConfig(cors_origins=(app,)), preload={MODEL: server_model}) as s:
        pre = {"Origin": app, "Access-Control-Request-Method": "POST",
               "Access-Control-Request-Headers": "content-type"}
        status, headers, _ = request("OPTIONS", s.v1 + "/chat/completions", headers=pre)
        low = {k.lower(): v for k, v in headers.items()}
        assert status == 200 and low["access-control-allow-origin"] == app
        status, headers, raw = request("POST", s.v1 + "/chat/completions", body,
                                       headers={"Origin": app})
        low = {k.lower(): v for k, v in headers.items()}
        assert status == 200 and low["access-control-allow-origin"] == app, raw
        status, _, raw = request("POST", s.v1 + "/chat/completions", body,
                                 headers={"Origin": "http://evil.example"})
        assert status == 403, raw


@requires_llama
def test_downloads_by_api_request_need_allow_pull(monkeypatch: pytest.MonkeyPatch,
                                                  tmp_path: Path) -> None:
    """Off by default: /api/pull and a name not in the cache get 403 naming the flag,
    without a single request to the Hub. --allow-pull allows it; afterwards the name,
    now in the cache, loads on a server without the flag (the main use)."""
    from tests.hubserver import SMOLLM2, add_smollm2, start
    from tests.models import test_model

    repo = f"{SMOLLM2}-GGUF"
    for fake in start(monkeypatch, tmp_path):
        add_smollm2(fake.hub, test_model("gguf-q4_1"))
        config = ServerConfig(backend="llama.cpp", context=512, parallel=1)
        with serve(config) as s:
            for route, body in (("/api/pull", {"model": repo, "stream": False}),
                                ("/api/pull", {"model": repo}),
                                ("/v1/chat/completions", {"model": repo, "messages": Q}),
                                ("/api/generate", {"model": "qwen2.5:0.5b"})):
                status, _, raw = request("POST", s.url + route, body)
                assert status == 403, (route, raw)
                assert "--allow-pull" in _message(route, raw), raw
            assert fake.hub.requests == []
        from dataclasses import replace

        with serve(replace(config, allow_pull=True)) as s:
            status, _, raw = request("POST", s.url + "/api/pull",
                                     {"model": repo, "stream": False})
            assert status == 200 and json.loads(raw) == {"status": "success"}, raw
            assert any(r["path"].endswith(".gguf") for r in fake.hub.resolve_requests("GET"))
        gets = len(fake.hub.resolve_requests("GET"))
        with serve(config) as s:
            status, _, raw = request("POST", s.url + "/api/generate", {"model": repo})
            assert status == 200 and json.loads(raw)["done_reason"] == "load", raw
        # loaded from the cache: the planner's header reads (Range), no download
        assert all("Range" in r["headers"] for r in fake.hub.resolve_requests("GET")[gets:])


@requires_llama
def test_local_paths_need_allow_local_paths_and_get_one_answer(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A path by API request is refused (403 naming the flag) with the same answer
    whether or not it exists, on every route that takes a model; --allow-local-paths
    or an API key allow it."""
    from tests.hubserver import start
    from tests.models import test_model

    existing = str(test_model("gguf-q4_1"))
    missing = str(Path(existing).with_name("no-such-model.gguf"))
    routes = {"/v1/chat/completions": {"messages": Q}, "/v1/completions": {"prompt": "x"},
              "/v1/embeddings": {"input": "x"}, "/api/chat": {"messages": Q},
              "/api/generate": {}, "/api/embed": {"input": "x"}, "/api/show": {},
              "/api/pull": {"stream": False}}
    for _ in start(monkeypatch, tmp_path):  # a private, empty cache
        monkeypatch.chdir(tmp_path)
        (tmp_path / "acme" / "model").mkdir(parents=True)  # a relative path shaped as a repo
        config = ServerConfig(backend="llama.cpp", context=512, parallel=1)
        with serve(config) as s:
            pairs = [(existing, missing), (str(Path(existing).parent), "/no/such/folder"),
                     ("./" + os.path.relpath(existing), "./no-such.gguf"),
                     ("ollama:../../x", "ollama:../../y")]
            for route, extra in routes.items():
                for there, absent in pairs:
                    answers = []
                    for name in (there, absent):
                        status, _, raw = request("POST", s.url + route,
                                                 {"model": name, **extra})
                        assert status == 403, (route, name, raw)
                        msg = _message(route, raw)
                        assert "--allow-local-paths" in msg, msg
                        answers.append(msg.replace(name, "NAME"))
                    assert answers[0] == answers[1], answers
            # a name that is a folder here is answered as a name that is not
            status, _, a = request("POST", s.v1 + "/chat/completions",
                                   {"model": "acme/model", "messages": Q})
            status2, _, b = request("POST", s.v1 + "/chat/completions",
                                    {"model": "acme/other", "messages": Q})
            assert (status, status2) == (403, 403)
            assert json.loads(a)["error"]["message"].replace("acme/model", "N") == \
                json.loads(b)["error"]["message"].replace("acme/other", "N")
            for name in ("acme/model", "acme/other"):
                assert request("POST", s.url + "/api/show", {"model": name})[0] == 404
            assert s.manager.models == {}
        with serve(ServerConfig(allow_local_paths=True, backend="llama.cpp", context=512,
                                parallel=1)) as s:
            status, _, raw = request("POST", s.url + "/api/generate", {"model": existing})
            assert status == 200, raw
            status, _, raw = request("POST", s.url + "/api/show", {"model": missing})
            assert status == 404, raw
        with serve(ServerConfig(api_key="k")) as s:  # a key allows paths, and shows them
            status, _, raw = request("POST", s.url + "/api/show", {"model": existing},
                                     headers={"Authorization": "Bearer k"})
            assert status == 200 and json.loads(raw)["localrun"]["path"] == existing


# -- item 9: what leaks, what is forged -----------------------------------------------------

@requires_llama
def test_model_lists_show_no_path_without_the_key(srv: Running, server_model: Any) -> None:
    path = server_model.info.path
    for method, route, body in (("GET", "/v1/models", None), ("GET", f"/v1/models/{MODEL}",
                                                              None),
                                ("POST", "/api/show", {"model": MODEL}),
                                ("GET", "/api/tags", None), ("GET", "/api/ps", None)):
        status, _, raw = request(method, srv.url + route, body)
        assert status == 200, raw
        text = raw.decode()
        assert path not in text and str(Path(path).parent) not in text, (route, text)
        assert '"path"' not in text, (route, text)
    with serve(ServerConfig(api_key="k"), preload={MODEL: server_model}) as s:
        status, _, raw = request("GET", s.v1 + "/models", headers={"Authorization": "Bearer k"})
        assert status == 200
        assert json.loads(raw)["data"][0]["path"] == path


def test_access_log_escapes_what_clients_send(caplog: pytest.LogCaptureFixture) -> None:
    """A path or model name with CR/LF, NUL or a bidi override cannot add or hide a log
    line: also on a 401, before anything else is read."""
    with caplog.at_level(logging.INFO, logger="localrun.server.access"), \
            serve(ServerConfig(api_key="k")) as s:
        status, _, _ = _raw(s.url, "GET", "/v1/models%0d%0a127.0.0.1:1%20%22GET%20/%22%20200"
                            "%00%e2%80%ae")
        assert status == 401
        body = json.dumps({"model": "m\n127.0.0.1:1 \"GET /\" 200\x00\u202e",
                           "messages": Q}).encode()
        status, _, _ = _raw(s.url, "POST", "/v1/chat/completions", body,
                            {"Content-Type": "application/json",
                             "Authorization": "Bearer k"})
        assert status >= 400
    lines = [r.getMessage() for r in caplog.records if r.name == "localrun.server.access"]
    assert len(lines) == 2, lines
    for line in lines:
        assert line.isprintable(), repr(line)
    assert '"GET /v1/models\\r\\n127.0.0.1:1 \\"GET /\\" 200\\x00\\u202e" 401' in lines[0]
    assert 'model=m\\n127.0.0.1:1 \\"GET /\\" 200\\x00\\u202e' in lines[1]


def _serve_cli(args: list[str], env: dict[str, str] | None = None,
               ) -> subprocess.CompletedProcess[str]:
    """``localrun serve ARGS`` that stops at its settings (not a running server)."""
    return subprocess.run([*localrun_cmd(), "serve", *args], capture_output=True, text=True,
                          timeout=WAIT, env={**os.environ, "LOCALRUN_API_KEY": "",
                                             **(env or {})})


def test_api_key_from_a_file_and_a_warning_for_one_on_the_command_line(tmp_path: Path
                                                                       ) -> None:
    key_file = tmp_path / "key"
    key_file.write_text("s3cret\n", encoding="utf-8")
    key_file.chmod(0o600)
    proc, url, banner = start_cli(["--api-key-file", str(key_file)],
                                  env={"LOCALRUN_API_KEY": ""})
    try:
        text = "".join(banner)
        assert "warning" not in text and "Bearer key required" in text
        assert "download models: on (API key set)" in text
        assert request("GET", url + "/v1/models")[0] == 401
        assert request("GET", url + "/v1/models",
                       headers={"Authorization": "Bearer s3cret"})[0] == 200
        # the CLI's log handler escapes too: a model name cannot start a line of its own
        status, _, _ = request("POST", url + "/v1/chat/completions",
                               {"model": "x\nFORGED line", "messages": Q},
                               headers={"Authorization": "Bearer s3cret"})
        assert status == 404
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=WAIT)
    assert "model=x\\nFORGED line" in out
    assert not any(line.startswith("FORGED") for line in out.splitlines()), out
    # on the command line: it works, with a warning (it shows in `ps`)
    bad_port = ["--port", "70000"]  # stops right after reading the settings
    ran = _serve_cli(["--api-key", "s3cret", *bad_port])
    assert "warning: --api-key on the command line is visible to other users" in ran.stderr
    assert "LOCALRUN_API_KEY" in ran.stderr and "--api-key-file" in ran.stderr
    ran = _serve_cli(bad_port, env={"LOCALRUN_API_KEY": "s3cret"})
    assert ran.returncode == 1 and "warning" not in ran.stderr, ran.stderr
    ran = _serve_cli(["--api-key", "a", "--api-key-file", str(key_file)])
    assert ran.returncode == 1 and "Both --api-key and --api-key-file" in ran.stderr
    empty = tmp_path / "empty"
    empty.write_text("\n", encoding="utf-8")
    ran = _serve_cli(["--api-key-file", str(empty)])
    assert ran.returncode == 1 and f"The API key file {empty} is empty" in ran.stderr
    ran = _serve_cli(["--api-key-file", str(tmp_path / "absent")])
    assert ran.returncode == 1 and "Cannot read the API key file" in ran.stderr
    assert "Traceback" not in ran.stderr
    helped = subprocess.run([*localrun_cmd(), "serve", "--help"], capture_output=True,
                            text=True, timeout=WAIT, env={**os.environ, "COLUMNS": "200"})
    for flag in ("--api-key-file", "LOCALRUN_API_KEY", "--allow-pull", "--allow-local-paths",
                 "--allowed-hosts", "`ps`"):
        assert flag in helped.stdout, flag


# -- the pieces, without a server --------------------------------------------------------

@pytest.mark.parametrize("bind, allowed, refused", [
    ("127.0.0.1", ["localhost", "127.0.0.1:8799", "[::1]", "127.0.0.2", "localhost.:1"],
     ["evil.example", "127.0.0.1.nip.io", "myhost", "10.0.0.1", "0.0.0.0", "a b"]),
    ("192.168.1.5", ["192.168.1.5:8799", "localhost", "127.0.0.1"],
     ["evil.example", "10.0.0.1"]),
    ("0.0.0.0", ["10.0.0.1:1", "[fe80::1]", "localhost", "192.168.1.5"],
     ["evil.example", "rebind.10.0.0.1.example"]),
])
def test_host_rule_per_bind(bind: str, allowed: list[str], refused: list[str]) -> None:
    from localrun.server.policy import HostRule, machine_names

    rule = HostRule.for_config(ServerConfig(host=bind, insecure=True))
    for host in allowed:
        assert rule.allows(host), host
    for host in refused:
        assert not rule.allows(host), host
    # this machine's name: answered where other machines connect, not on loopback
    for name in machine_names() - {"localhost"}:
        assert rule.allows(name) is (bind != "127.0.0.1"), name
    assert HostRule.for_config(ServerConfig(allowed_hosts=("*",))).allows("evil.example")


def test_allowed_hosts_entries_are_checked() -> None:
    from localrun.errors import LocalrunError

    ServerConfig(allowed_hosts=("llm.example.com", "proxy:8443", "*", "[::1]")).check()
    for bad in ("http://llm.example.com", "a/b", "two words"):
        with pytest.raises(LocalrunError) as e:
            ServerConfig(allowed_hosts=(bad,)).check()
        assert "--allowed-hosts" in e.value.message


@pytest.mark.parametrize("name, is_path", [
    ("/abs/m.gguf", True), ("./m", True), ("~/m", True), ("m.GGUF", True),
    ("file:///etc/passwd", True), ("C:\\models\\m.gguf", True), ("..", True),
    ("ollama:../../../x:y", True), ("org/../x", True), ("a\x00b", True),
    ("qwen2.5:0.5b", False), ("Qwen/Qwen2.5-0.5B-Instruct-GGUF:Q4_K_M", False),
    ("hf.co/org/repo", False), ("ollama:qwen2.5:0.5b", False), ("smollm2:135m", False),
])
def test_what_reads_as_a_path(name: str, is_path: bool) -> None:
    from localrun.server.policy import looks_like_path

    assert looks_like_path(name) is is_path


def test_the_policy_opens_with_its_flags_or_a_key() -> None:
    from localrun.server.errors import APIError
    from localrun.server.policy import check_model, check_pull

    for config in (ServerConfig(api_key="k"),
                   ServerConfig(allow_pull=True, allow_local_paths=True)):
        check_model(config, "/no/such.gguf")
        check_pull(config, "org/not-downloaded-anywhere")
    shut = ServerConfig(models=("/x/m.gguf",))
    check_model(shut, "/x/m.gguf")  # named on the command line
    check_model(shut, "smollm2:135m")  # the packaged default
    with pytest.raises(APIError) as e:
        check_model(shut, "/x/other.gguf")
    assert e.value.status == 403 and e.value.code == "local_paths_not_allowed"
    with pytest.raises(APIError) as e:
        check_pull(ServerConfig(allow_local_paths=True), "smollm2:135m")
    assert e.value.status == 403 and "--allow-pull" in e.value.message


def test_printable_escapes_what_would_break_a_log_line() -> None:
    pytest.importorskip("fastapi")
    from localrun.server.app import printable

    assert printable("/v1/chat/completions") == "/v1/chat/completions"
    assert printable("a\r\nb\x00c\x1b[31m\x7f\x85\u2028\u202e\"\\") == \
        'a\\r\\nb\\x00c\\x1b[31m\\x7f\\x85\\u2028\\u202e\\"\\\\'
    assert printable("naïve ☃") == "naïve ☃"


def test_the_cli_log_escapes_messages_not_tracebacks() -> None:
    pytest.importorskip("fastapi")
    from localrun.cli.serve import log_formatter

    record = logging.LogRecord("localrun.server", logging.INFO, __file__, 1,
                               "loading %s (%s)", ("m\nFORGED", 'a "quoted" \\ name'), None)
    assert log_formatter().format(record).endswith(
        'loading m\\nFORGED (a "quoted" \\ name)')
    try:
        raise RuntimeError("x")
    except RuntimeError:
        import sys

        record = logging.LogRecord("localrun.server", logging.ERROR, __file__, 1, "failed",
                                   (), sys.exc_info())
    assert "\nTraceback (most recent call last):\n" in log_formatter().format(record)


def test_banner_says_what_is_open() -> None:
    from localrun.cli.serve import banner

    shut = banner(ServerConfig(), [])
    assert "download models: off (--allow-pull turns it on)" in shut
    assert "load local paths: off (--allow-local-paths turns it on)" in shut
    assert "hosts answered: localhost, loopback addresses" in shut and "CORS: off" in shut
    opened = banner(ServerConfig(allow_pull=True, allowed_hosts=("llm.example",),
                                 cors_origins=("http://app.example",)), [])
    assert "download models: on (--allow-pull)" in opened
    assert "load local paths: off" in opened and "llm.example" in opened
    assert "CORS: http://app.example" in opened
    keyed = banner(ServerConfig(api_key="k"), [])
    assert "download models: on (API key set)" in keyed
    assert "load local paths: on (API key set)" in keyed


@requires_llama
def test_curl_d_and_headerless_scripts_still_post_json(srv: Running) -> None:
    """``curl URL -d '{…}'`` (Ollama's documented examples) sends a form Content-Type and
    a script posting a JSON string may send none: from a client that is not a browser
    (no Origin, Referer or Sec-Fetch-*, no browser User-Agent, none of which a page can
    forge without a preflight) the body is read as JSON. The same post with any one
    browser mark is refused."""
    body = json.dumps({"model": MODEL, "prompt": "1, 2, 3,", "stream": False,
                       "options": {"num_predict": 2, "temperature": 0}}).encode()
    curl = {"User-Agent": "curl/8.5.0", "Content-Type": "application/x-www-form-urlencoded"}
    status, _, raw = _raw(srv.url, "POST", "/api/generate", body, curl)
    assert status == 200, raw
    assert json.loads(raw)["done"] is True
    status, _, raw = _raw(srv.url, "POST", "/api/generate", body,
                          {"User-Agent": "python-requests/2.32"})
    assert status == 200, raw
    for mark in ({"Sec-Fetch-Site": "cross-site"}, {"Referer": "https://evil.example/"},
                 {"User-Agent": BROWSER["User-Agent"]}, {"Content-Type": "text/plain"}):
        status, _, raw = _raw(srv.url, "POST", "/api/generate", body, {**curl, **mark})
        assert status == 415, (mark, raw)
