"""The served /openapi.json drives a fuzzer (schemathesis) at the real server: a few
examples per operation, valid ones and invalid ones, and no answer is a 5xx (issue 27).

Bounded: loopback only, ``EXAMPLES`` examples per operation and mode, each request
``REQUEST_TIMEOUT`` seconds at most, the whole run ``TIME_LIMIT`` seconds (past it the
remaining examples are not sent; the test says how many were). Valid requests are
steered to the preloaded test model with at most ``TOKENS`` tokens (``num_ctx`` left
out, so no second copy loads), so generation runs for real; invalid ones go as generated.
The server has no API key and allows no downloads, local paths or deletes: a generated
model name is looked up on disk and refused, never fetched; presets made by the
management routes go to a localrun home of the run's own.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.conftest import requires_llama
from tests.serverutil import MODEL, Running, request, server_fixtures

schemathesis = pytest.importorskip("schemathesis", reason="schemathesis is not installed "
                                   "(pip install -e '.[clients]')")
hypothesis = pytest.importorskip("hypothesis")

from localrun.server.config import ServerConfig  # noqa: E402

pytestmark = [requires_llama, pytest.mark.slow]

EXAMPLES = 5
REQUEST_TIMEOUT = 60
TIME_LIMIT = 300
TOKENS = 4
#: issue 31's management routes, fuzzed like the others
MANAGEMENT = {"POST /api/create", "POST /api/copy", "DELETE /api/delete", "POST /models/load",
              "POST /models/unload", "POST /v1/models/load", "POST /v1/models/unload"}
GENERATING = {"/v1/chat/completions", "/v1/completions", "/v1/messages", "/api/chat",
              "/api/generate", "/v1/responses"}

server_model, srv = server_fixtures(ServerConfig(max_queue=64))


@pytest.fixture(scope="module", autouse=True)
def home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Stored responses (/v1/responses) in a folder of this run's own."""
    old = os.environ.get("LOCALRUN_HOME")
    os.environ["LOCALRUN_HOME"] = str(tmp_path_factory.mktemp("localrun-home"))
    yield
    if old is None:
        os.environ.pop("LOCALRUN_HOME", None)
    else:
        os.environ["LOCALRUN_HOME"] = old


def _steer(path: str, body: Any) -> None:
    """A valid request names the test model and asks for few tokens."""
    if not isinstance(body, dict) or "model" not in body:
        return
    body["model"] = MODEL
    if path not in GENERATING:
        return
    if path.startswith("/api/"):
        options = body.get("options") if isinstance(body.get("options"), dict) else {}
        options.pop("num_ctx", None)
        options["num_predict"] = TOKENS
        body["options"] = options
    elif path == "/v1/responses":  # a new conversation (a made-up id is a 400)
        body["max_output_tokens"] = TOKENS
        body.pop("previous_response_id", None)
        if body.get("input") is None:
            body["input"] = "Hi"
    else:
        body.pop("max_completion_tokens", None)
        body["max_tokens"] = TOKENS


def test_the_served_spec_drives_a_fuzzer_to_no_5xx(srv: Running) -> None:
    status, _, raw = request("GET", srv.url + "/openapi.json")
    assert status == 200
    schema = schemathesis.openapi.from_dict(json.loads(raw))
    modes = (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE)
    server_errors: list[str] = []
    sent: dict[str, int] = {}
    stop_at = time.monotonic() + TIME_LIMIT
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 20, [op.label for op in operations]
    labels = {op.label for op in operations}
    assert labels >= MANAGEMENT, sorted(MANAGEMENT - labels)
    assert {"POST /v1/responses", "GET /v1/responses/{response_id}",
            "DELETE /v1/responses/{response_id}",
            "GET /v1/responses/{response_id}/input_items"} <= {op.label for op in operations}
    for op in operations:
        for mode in modes:
            try:
                _fuzz(srv.url, op, mode, stop_at, sent, server_errors)()
            except hypothesis.errors.Unsatisfiable:
                # nothing to make invalid (a GET without parameters): valid examples only
                assert mode == schemathesis.GenerationMode.NEGATIVE, op.label
    assert not server_errors, "\n".join(server_errors)
    assert len(sent) == len(operations), sent  # every operation was reached
    assert time.monotonic() <= stop_at + REQUEST_TIMEOUT, "the run overran its bound"
    # the server still serves
    status, _, raw = request("POST", srv.url + "/v1/chat/completions", {
        "model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]})
    assert status == 200, raw[:300]


def _fuzz(url: str, op: Any, mode: Any, stop_at: float, sent: dict[str, int],
          server_errors: list[str]) -> Any:
    """``op``'s examples in ``mode``, each sent to ``url``; 5xx answers collected."""
    from hypothesis import HealthCheck, Phase, given, settings

    @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
              phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    @given(case=op.as_strategy(generation_mode=mode))
    def run(case: Any) -> None:
        if time.monotonic() > stop_at:
            return
        if mode == schemathesis.GenerationMode.POSITIVE:
            _steer(op.path, case.body)
        response = case.call(base_url=url, timeout=REQUEST_TIMEOUT)
        sent[op.label] = sent.get(op.label, 0) + 1
        if response.status_code >= 500:
            server_errors.append(f"{op.label} ({mode.value}) -> {response.status_code}: "
                                 f"{response.text[:300]} (body "
                                 f"{json.dumps(case.body, default=str)[:300]})")

    return run
