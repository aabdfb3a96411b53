"""A small OpenAI-compatible server that behaves like vLLM's, for the remote and vllm
backends' tests: SSE chunks (a role chunk, one chunk per token, a finish chunk, then a
usage chunk when ``stream_options.include_usage``), stop strings cut out of the text,
``finish_reason`` "stop"/"length", errors in OpenAI's JSON shape (vLLM's 400 for a long
prompt, 401, 404 for an unknown model), and ``/health``.

Its "model" has a word-level tokenizer and answers by repeating the last user message's
words: greedy (temperature 0) in order, once, then end-of-sequence; sampled, words drawn
with ``random.Random(seed)``. With ``tools``, it calls each tool whose name the last user
message holds (after saying "Checking."), with ``{"q": <the message's last word>}`` as
arguments, streamed in 4-character fragments as vLLM streams them; ``first_delay`` holds
the first event back (a queued request), watching for the client going away meanwhile,
as uvicorn does. ``POST /tokenize`` counts words (vLLM's shape) unless ``tokenize`` is
off. Run as a script it is a fake ``vllm`` executable:
``vllm serve MODEL --port P [--served-model-name N] [--max-model-len L]``, with
FAKE_VLLM_MODE=fail (log an error and exit 1), =hang (never healthy), FAKE_VLLM_DELAY
(seconds before it listens) and FAKE_VLLM_PIDFILE (fork a worker, as vLLM forks its
engine core, and write both pids there).
"""

from __future__ import annotations

import json
import os
import random
import select
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class FakeOpenAI:
    def __init__(self, models: list[str], *, api_key: str | None = None,
                 max_model_len: int = 64, token_delay: float = 0.0,
                 first_delay: float = 0.0, tokenize: bool = True,
                 auto_tools: bool = True) -> None:
        self.models = models
        self.auto_tools = auto_tools  # False: as vLLM started without --tool-call-parser
        self.first_delay = first_delay
        self.tokenize = tokenize
        self.api_key = api_key
        self.max_model_len = max_model_len
        self.token_delay = token_delay
        self.requests: list[dict[str, Any]] = []
        self.disconnects = 0
        self.active = 0  # streams in flight now, and the most at once
        self.most_active = 0
        self._lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def start(self) -> FakeOpenAI:
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def _json(self, status: int, data: Any) -> None:
                body = json.dumps(data).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _error(self, status: int, message: str, kind: str) -> None:
                self._json(status, {"error": {"message": message, "type": kind,
                                              "param": None, "code": status}})

            def do_GET(self) -> None:
                if self.path == "/health":
                    self._json(200, {})
                elif self.path == "/v1/models":
                    if not self._authorized():
                        return
                    self._json(200, {"object": "list", "data": [
                        {"id": m, "object": "model", "owned_by": "vllm",
                         "max_model_len": fake.max_model_len} for m in fake.models]})
                else:
                    self._error(404, "Not Found", "NotFoundError")

            def _authorized(self) -> bool:
                if fake.api_key and self.headers.get("Authorization") != \
                        f"Bearer {fake.api_key}":
                    self._error(401, "Unauthorized", "AuthenticationError")
                    return False
                return True

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                fake.requests.append(body)
                if not self._authorized():
                    return
                if self.path == "/tokenize" and fake.tokenize:
                    if body.get("model") not in fake.models:
                        self._error(404, f"The model `{body.get('model')}` does not exist.",
                                    "NotFoundError")
                        return
                    words = str(body.get("prompt", "")).split()
                    self._json(200, {"count": len(words), "max_model_len": fake.max_model_len,
                                     "tokens": list(range(len(words))), "token_strs": None})
                    return
                chat = self.path == "/v1/chat/completions"
                if not chat and self.path != "/v1/completions":
                    self._error(404, "Not Found", "NotFoundError")
                    return
                if body.get("model") not in fake.models:
                    self._error(404, f"The model `{body.get('model')}` does not exist.",
                                "NotFoundError")
                    return
                if chat:
                    users = [m["content"] for m in body["messages"] if m["role"] == "user"]
                    prompt = " ".join(str(m["content"] or "") for m in body["messages"])
                    source = users[-1] if users else ""
                else:
                    prompt = source = body["prompt"]
                if body.get("tools") and body.get("tool_choice", "auto") == "auto" and \
                        not fake.auto_tools:
                    self._error(400, '"auto" tool choice requires --enable-auto-tool-choice '
                                "and --tool-call-parser to be set", "BadRequestError")
                    return
                if "crash" in source:
                    self._error(500, "EngineCore encountered an issue.", "InternalServerError")
                    return
                n_prompt = len(prompt.split())
                max_tokens = int(body.get("max_tokens") or 16)
                if n_prompt + max_tokens > fake.max_model_len:
                    self._error(400, (
                        f"This model's maximum context length is {fake.max_model_len} tokens. "
                        f"However, you requested {n_prompt + max_tokens} tokens "
                        f"({n_prompt} in the messages, {max_tokens} in the completion). "
                        "Please reduce the length of the messages or completion."),
                        "BadRequestError")
                    return
                self._stream(body, chat, n_prompt, source.split(), max_tokens)

            def _send(self, data: Any) -> None:
                payload = b"data: " + (data if isinstance(data, bytes) else
                                       json.dumps(data).encode()) + b"\n\n"
                self.wfile.write(b"%x\r\n%s\r\n" % (len(payload), payload))
                self.wfile.flush()

            def _stream(self, body: dict[str, Any], chat: bool, n_prompt: int,
                        words: list[str], max_tokens: int) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                base = {"id": "cmpl-1", "object": "chat.completion.chunk" if chat
                        else "text_completion", "created": 0, "model": body["model"]}

                def choice(text: str | None, finish: str | None) -> dict[str, Any]:
                    if chat:
                        delta = {} if text is None else {"content": text}
                        return {"index": 0, "delta": delta, "finish_reason": finish}
                    return {"index": 0, "text": text or "", "finish_reason": finish}

                temperature = float(body.get("temperature", 1.0))
                rng = random.Random(body.get("seed"))
                stops = body.get("stop") or []
                stops = [stops] if isinstance(stops, str) else stops
                text, n, finish = "", 0, "stop"
                with fake._lock:
                    fake.active += 1
                    fake.most_active = max(fake.most_active, fake.active)
                try:
                    if fake.first_delay and self._client_left(fake.first_delay):
                        fake.disconnects += 1
                        return
                    if chat and body.get("tools"):
                        self._calls(body, base, words)
                        return
                    if chat:
                        self._send({**base, "choices": [{"index": 0, "delta": {
                            "role": "assistant", "content": ""}, "finish_reason": None}]})
                    while True:
                        if temperature == 0:
                            if n >= len(words):
                                break  # end of sequence
                            word = words[n]
                        else:
                            word = rng.choice(words or ["x"])
                        if n >= max_tokens:
                            finish = "length"
                            break
                        piece = word if n == 0 else " " + word
                        n += 1
                        full = text + piece
                        hits = [full.find(s) for s in stops if s in full]
                        if hits:  # vLLM cuts the stop string and what follows
                            piece = full[len(text):min(hits)]
                            if piece:
                                self._send({**base, "choices": [choice(piece, None)]})
                            break
                        text += piece
                        time.sleep(fake.token_delay)
                        self._send({**base, "choices": [choice(piece, None)]})
                    self._send({**base, "choices": [choice(None, finish)]})
                    if (body.get("stream_options") or {}).get("include_usage"):
                        self._send({**base, "choices": [], "usage": {
                            "prompt_tokens": n_prompt, "completion_tokens": n,
                            "total_tokens": n_prompt + n}})
                    self._send(b"[DONE]")
                    self.wfile.write(b"0\r\n\r\n")
                except (BrokenPipeError, ConnectionResetError):
                    fake.disconnects += 1
                finally:
                    with fake._lock:
                        fake.active -= 1

            def _client_left(self, seconds: float) -> bool:
                """Wait ``seconds``; True as soon as the client closes its connection."""
                deadline = time.monotonic() + seconds
                while time.monotonic() < deadline:
                    ready, _, _ = select.select([self.connection], [], [], 0.05)
                    if ready:
                        try:
                            if not self.connection.recv(1, socket.MSG_PEEK):
                                return True
                        except OSError:
                            return True
                return False

            def _calls(self, body: dict[str, Any], base: dict[str, Any],
                       words: list[str]) -> None:
                names = [t["function"]["name"] for t in body["tools"]]
                choice = body.get("tool_choice", "auto")
                if isinstance(choice, dict):
                    called = [choice["function"]["name"]]
                else:
                    called = [n for n in names if n in words] or \
                        (names[:1] if choice == "required" else [])

                def send(delta: dict[str, Any], finish: str | None = None) -> None:
                    self._send({**base, "choices": [{"index": 0, "delta": delta,
                                                     "finish_reason": finish}]})

                send({"role": "assistant", "content": ""})
                if choice == "auto":
                    send({"content": "Checking."})
                args = json.dumps({"q": words[-1] if words else ""})
                for i, name in enumerate(called):
                    send({"tool_calls": [{"index": i, "id": f"chatcmpl-tool-{i}",
                                          "type": "function",
                                          "function": {"name": name, "arguments": ""}}]})
                    for j in range(0, len(args), 4):
                        time.sleep(fake.token_delay)
                        send({"tool_calls": [{"index": i, "function": {
                            "arguments": args[j:j + 4]}}]})
                send({}, "tool_calls" if called else "stop")
                if (body.get("stream_options") or {}).get("include_usage"):
                    self._send({**base, "choices": [], "usage": {
                        "prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12}})
                self._send(b"[DONE]")
                self.wfile.write(b"0\r\n\r\n")

        return Handler


def main(argv: list[str]) -> int:
    """The fake ``vllm`` command line."""
    if not argv or argv[0] != "serve":
        print("usage: vllm serve MODEL [options]", file=sys.stderr)
        return 2
    model, rest = argv[1], argv[2:]
    opts: dict[str, str] = {}
    for i, arg in enumerate(rest):
        if arg.startswith("--"):  # a flag with its value, or a switch (--enforce-eager)
            nxt = rest[i + 1] if i + 1 < len(rest) else ""
            opts[arg] = "" if nxt.startswith("--") else nxt
    print(f"INFO vllm serve {model} {' '.join(rest)}", flush=True)
    mode = os.environ.get("FAKE_VLLM_MODE", "")
    if mode == "fail":
        print("ERROR torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB",
              flush=True)
        return 1
    pidfile = os.environ.get("FAKE_VLLM_PIDFILE")
    if pidfile:
        worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        with open(pidfile, "w") as f:
            f.write(f"{os.getpid()} {worker.pid}\n")
    time.sleep(float(os.environ.get("FAKE_VLLM_DELAY", "0")))
    if mode == "hang":
        time.sleep(600)
        return 1
    name = opts.get("--served-model-name", model)
    fake = FakeOpenAI([name], max_model_len=int(opts.get("--max-model-len", "64")))
    fake.server.server_close()
    fake.server = ThreadingHTTPServer(("127.0.0.1", int(opts["--port"])),
                                      fake.server.RequestHandlerClass)
    fake.server.daemon_threads = True
    print("INFO Application startup complete.", flush=True)
    fake.server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
