"""The server's pieces that need no model: settings, durations, wire encodings, imports."""

from __future__ import annotations

import base64
import json
import struct
import subprocess
import sys

import pytest

from localrun.errors import LocalrunError
from localrun.server.config import (
    DEFAULT_PORT,
    ServerConfig,
    format_duration,
    is_loopback,
    parse_duration,
)


@pytest.mark.parametrize("value, seconds", [
    ("5m", 300.0), ("1h30m", 5400.0), ("250ms", 0.25), ("30s", 30.0), ("0", 0.0), (0, 0.0),
    (90, 90.0), ("2.5", 2.5), ("-1", None), (-1, None), ("-5m", None), (None, None)])
def test_keep_alive_durations(value: object, seconds: float | None) -> None:
    assert parse_duration(value) == seconds  # type: ignore[arg-type]


@pytest.mark.parametrize("seconds, text", [(300, "5m"), (5400, "1h30m"), (45, "45s"),
                                           (0.5, "0.5s"), (None, "forever"), (0, "0s")])
def test_durations_print_as_written(seconds: float | None, text: str) -> None:
    assert format_duration(seconds) == text
    assert parse_duration(text if text != "forever" else "-1") == seconds


@pytest.mark.parametrize("value", ["", "5 minutes", "m5", "5x", True, float("nan"), "1h-"])
def test_bad_durations_say_what_to_send(value: object) -> None:
    with pytest.raises(LocalrunError) as e:
        parse_duration(value, what="--keep-alive")  # type: ignore[arg-type]
    assert "Invalid --keep-alive" in e.value.message and "5m" in (e.value.hint or "")


def test_default_port_collides_with_no_other_local_server() -> None:
    # Ollama, LM Studio, llama-server (old and new), vLLM / llama-cpp-python, Lemonade
    assert DEFAULT_PORT not in (11434, 1234, 8080, 9931, 8000, 13305)


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "::1", "127.5.0.1", "[::1]"])
def test_loopback_hosts(host: str) -> None:
    assert is_loopback(host)
    ServerConfig(host=host).check()


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.168.1.5", "example.com"])
def test_exposed_host_needs_a_key_or_insecure(host: str) -> None:
    assert not is_loopback(host)
    with pytest.raises(LocalrunError) as e:
        ServerConfig(host=host).check()
    assert "without an API key" in e.value.message and "--api-key" in (e.value.hint or "")
    ServerConfig(host=host, api_key="k").check()
    ServerConfig(host=host, insecure=True).check()


@pytest.mark.parametrize("bad", [{"port": 70000}, {"parallel": 0}, {"max_queue": -1},
                                 {"max_request_bytes": 10}, {"api_key": " "}])
def test_nonsense_settings_are_refused(bad: dict[str, object]) -> None:
    with pytest.raises(LocalrunError):
        ServerConfig(**bad).check()  # type: ignore[arg-type]


def test_base64_embeddings_are_little_endian_float32() -> None:
    pytest.importorskip("fastapi")
    from localrun.server.openai_api import encode_vector

    vec = [0.5, -1.25, 3.0]
    raw = base64.b64decode(encode_vector(vec))
    assert struct.unpack("<3f", raw) == (0.5, -1.25, 3.0)
    np = pytest.importorskip("numpy")  # what the openai client decodes with
    assert np.frombuffer(raw, dtype="float32").tolist() == vec


PROBE = """
import json, sys, io, contextlib
sys.argv = {argv!r}
from localrun.cli import main
with contextlib.redirect_stdout(io.StringIO()) as out:
    try:
        main()
    except SystemExit:
        pass
print(json.dumps([sorted(m for m in sys.modules if m.split('.')[0] in
                  ('fastapi', 'starlette', 'uvicorn', 'prometheus_client')),
                  out.getvalue()]))
"""


@pytest.mark.parametrize("argv", [["localrun", "--help"], ["localrun", "serve", "--help"]])
def test_help_imports_no_web_stack(argv: list[str]) -> None:
    out = subprocess.run([sys.executable, "-c", PROBE.format(argv=argv)], capture_output=True,
                         text=True, check=True, timeout=60)
    loaded, text = json.loads(out.stdout.strip().splitlines()[-1])
    assert loaded == []
    assert "serve" in text
    if "serve" in argv:
        for flag in ("--port", "--api-key", "--max-queue", "--keep-alive", "--cors-origins",
                     "--parallel", "--request-timeout", "--drain-timeout"):
            assert flag in text, flag
        assert str(DEFAULT_PORT) in text


def test_an_openvino_ir_without_config_json_counts_its_kv_cache() -> None:
    """serve's memory accounting of an IR folder without config.json (the test fixture's
    GGUF export): its KV cache from the IR's state, in OpenVINO's f32 on the CPU, not
    unknown (0 bytes)."""
    from localrun.memory import ModelShape, kv_cache_bytes
    from localrun.server.sizing import estimate_path
    from tests.models import test_model

    est = estimate_path(str(test_model("openvino-int4")), 512, "openvino", "CPU")
    assert est is not None and est.kv_known
    assert est.kv_cache_bytes == kv_cache_bytes(ModelShape(30, 3, 64), 512, 4) > 0
