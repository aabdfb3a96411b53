"""Any OpenAI-compatible server as a backend: vLLM, SGLang, another ``localrun serve``.

The model runs on the server; this session speaks ``/v1/chat/completions`` (chat) and
``/v1/completions`` (raw text) to it, streaming with server-sent events and
``stream_options.include_usage`` so the last event carries the server's own token
counts. Sampling goes as OpenAI's fields, plus ``top_k``, ``min_p`` and
``repetition_penalty`` as the extra body fields vLLM and SGLang accept (sent only when
they are not off, so a strict OpenAI endpoint never sees them by default).

The prompt's tokens stay on the server: a prompt here carries the messages or the text,
and its token count (what ``Usage.prompt_tokens`` reads) is filled in from the server's
usage once the reply has streamed. Stop strings go to the server (it stops early) and
are also matched by the API, as on every backend. ``Model.count_tokens`` asks the
server's ``POST /tokenize`` (vLLM, SGLang); a server without one (OpenAI, ``localrun
serve``) gets TokenCountUnavailableError rather than a guess.

Concurrency (:mod:`localrun.backends.remote.streams`): every sequence is its own
streaming request on a thread of its own; the server's scheduler batches them.
Cancelling one shuts its connection down at once, so the server aborts that request.

Tools (:mod:`localrun.backends.remote.tools`) go to the server's own tool support
(OpenAI's ``tools``/``tool_choice``), and the tool calls it streams back come out as
localrun's ToolCall/ToolCallDelta.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, overload
from urllib.parse import urlsplit

import httpx2

from localrun.backends.base import (
    Batcher,
    Footprint,
    GenerationStats,
    LoadRequest,
    Prompt,
    Session,
    SessionBackend,
)
from localrun.backends.options import check_options
from localrun.backends.remote.facts import SPEC
from localrun.backends.remote.streams import ClosingCancel, RequestBatcher
from localrun.backends.remote.tools import (
    ENVELOPE_TEMPLATE,
    CallWriter,
    read_envelope,
    strict_tool,
    tool_choice,
)
from localrun.errors import (
    ContextOverflowError,
    LocalrunError,
    RemoteAuthError,
    RemoteError,
    RemoteModelNotFoundError,
    TokenCountUnavailableError,
)
from localrun.sampling import ResolvedSampling
from localrun.structured.constraint import Constraint
from localrun.types import CancelToken, Message, ModelInfo

#: Seconds to wait for a connection, and for the next byte of a reply (a long prompt on
#: a busy server can take minutes before its first token).
CONNECT_TIMEOUT = 10.0
READ_TIMEOUT = 600.0

#: vLLM's 400 for a prompt longer than the model: "This model's maximum context length
#: is 2048 tokens. However, you requested 2100 tokens (2000 in the messages, 100 in the
#: completion)." (SGLang and localrun serve word it alike.)
_CONTEXT = re.compile(r"maximum context length is (\d+) tokens.*?(\d+) in the messages",
                      re.S)


def normalize_base_url(url: str) -> str:
    """``http://host:8000`` or ``http://host:8000/v1/`` -> ``http://host:8000/v1``."""
    raw = url.strip().rstrip("/")
    parts = urlsplit(raw)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise LocalrunError(f"Invalid base URL {url!r}",
                            hint="pass the server's address, e.g. "
                            "--base-url http://127.0.0.1:8000/v1")
    return raw if raw.endswith("/v1") else raw + "/v1"


class ServerTokens(Sequence[int]):
    """A prompt's tokens as the server counted them: the length is known once the
    server's usage has arrived (0 before); the ids themselves stay on the server."""

    def __init__(self) -> None:
        self.known = 0

    def __len__(self) -> int:
        return self.known

    @overload
    def __getitem__(self, index: int) -> int: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[int]: ...
    def __getitem__(self, index: int | slice) -> int | Sequence[int]:
        raise IndexError("the prompt's token ids stay on the server")


@dataclass(frozen=True)
class RemotePrompt(Prompt):
    messages: tuple[Message, ...] | None = None  # None: a raw-text completion prompt
    #: OpenAI function tools for the server (None: none sent)
    tools: tuple[dict[str, Any], ...] | None = None
    #: a forced call (tool_choice "required" or a named tool): localrun pre-filled the
    #: call's opening marker, so the first call's text starts at its JSON
    forced: bool = False


def error_message(body: bytes) -> str:
    """The server's own words from an error body: OpenAI's ``{"error": {"message"}}``,
    vLLM's older ``{"message"}``, FastAPI's ``{"detail"}``, else the text itself."""
    text = body.decode("utf-8", "replace").strip()
    try:
        data = json.loads(text)
    except ValueError:
        return text[:300] or "(empty reply)"
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        for key in ("message", "detail"):
            if data.get(key):
                return str(data[key])
        if isinstance(err, str):
            return err
    return text[:300]


class OpenAIClient:
    """The few calls localrun makes to an OpenAI-compatible server, with its errors
    turned into localrun's."""

    def __init__(self, base_url: str, api_key: str | None = None,
                 timeout: float = READ_TIMEOUT) -> None:
        self.base_url = normalize_base_url(base_url)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx2.Client(
            headers=headers, trust_env=False,
            timeout=httpx2.Timeout(timeout, connect=CONNECT_TIMEOUT))
        #: model ids the server listed (for the 404 message)
        self.served: list[str] = []

    def close(self) -> None:
        self._http.close()

    def models(self) -> list[dict[str, Any]]:
        try:
            r = self._http.get(f"{self.base_url}/models")
        except httpx2.HTTPError as e:
            raise self._transport(e) from e
        if r.status_code >= 400:
            raise self.http_error(r.status_code, r.content, model=None)
        try:
            data = r.json().get("data", [])
        except (ValueError, AttributeError) as e:
            raise RemoteError(self.base_url, f"/models is not OpenAI's JSON ({e})",
                              status=r.status_code) from e
        cards = [c for c in data if isinstance(c, dict) and "id" in c]
        self.served = [str(c["id"]) for c in cards]
        return cards

    def stream(self, path: str, body: dict[str, Any], cancel: CancelToken
               ) -> Iterator[dict[str, Any]]:
        """POST a streaming request; yield each server-sent event's JSON until [DONE].
        A :class:`ClosingCancel` shuts the connection down when cancelled."""
        url = f"{self.base_url}{path}"
        closing = cancel if isinstance(cancel, ClosingCancel) else None
        try:
            with self._http.stream("POST", url, json=body) as r:
                if r.status_code >= 400:
                    raise self.http_error(r.status_code, r.read(), model=body.get("model"))
                if closing is not None:
                    closing.attach(r)
                try:
                    yield from self._events(r, cancel, body.get("model"))
                finally:
                    # Detached before the connection can go back to the pool for another
                    # request: a cancel that comes later must not shut that one down.
                    if closing is not None:
                        closing.detach()
        except httpx2.HTTPError as e:
            if cancel.cancelled:
                return  # the connection we shut down ourselves
            raise self._transport(e) from e

    def _events(self, r: httpx2.Response, cancel: CancelToken, model: Any
                ) -> Iterator[dict[str, Any]]:
        for line in r.iter_lines():
            if cancel.cancelled:
                return  # leaving closes the connection: the server aborts
            if not line.startswith("data:"):
                continue  # comments, "event:" lines, blank separators
            data = line[5:].strip()
            if data == "[DONE]":
                return
            try:
                event = json.loads(data)
            except ValueError as e:
                raise RemoteError(self.base_url, f"unreadable stream event {data[:80]!r}",
                                  status=r.status_code) from e
            if isinstance(event, dict) and "error" in event:
                # vLLM reports a failure after the 200 as an event
                err = event["error"]
                status = err.get("code") if isinstance(err, dict) else None
                raise self.http_error(status if isinstance(status, int) else 500,
                                      json.dumps(event).encode(), model=model)
            yield event

    def tokenize(self, model: str, text: str) -> int:
        """How many tokens the server's tokenizer makes of ``text`` as a completion
        prompt (special tokens it adds included): ``POST /tokenize`` at the server's
        root, as vLLM and SGLang serve it. A server without it: TokenCountUnavailableError."""
        root = self.base_url[: -len("/v1")]
        try:
            r = self._http.post(f"{root}/tokenize", json={"model": model, "prompt": text})
        except httpx2.HTTPError as e:
            raise self._transport(e) from e
        msg = error_message(r.content) if r.status_code >= 400 else ""
        if r.status_code in (404, 405, 501) and model not in msg:
            raise TokenCountUnavailableError(self.base_url, msg, status=r.status_code)
        if r.status_code >= 400:
            raise self.http_error(r.status_code, r.content, model=model)
        try:
            data = r.json()
            count = data["count"] if "count" in data else len(data["tokens"])
        except (ValueError, TypeError, KeyError) as e:
            raise RemoteError(self.base_url, f"/tokenize answered no token count ({e})",
                              status=r.status_code) from e
        return int(count)

    def _transport(self, e: httpx2.HTTPError) -> RemoteError:
        if isinstance(e, httpx2.ConnectError):
            reason = f"connection failed ({e})"
        elif isinstance(e, httpx2.TimeoutException):
            reason = f"no answer in time ({type(e).__name__})"
        else:
            reason = f"{type(e).__name__}: {e}"
        return RemoteError(self.base_url, reason)

    def http_error(self, status: int, body: bytes, *, model: Any) -> LocalrunError:
        msg = error_message(body)
        if status in (401, 403):
            return RemoteAuthError(self.base_url, msg, status=status)
        if status == 404 and model is not None:
            return RemoteModelNotFoundError(self.base_url, str(model), self.served,
                                            reason=msg)
        m = _CONTEXT.search(msg)
        if status == 400 and m:
            return ContextOverflowError(int(m.group(2)), int(m.group(1)))
        if status == 400 and "tool-call-parser" in msg:
            # vLLM: '"auto" tool choice requires --enable-auto-tool-choice and
            # --tool-call-parser to be set'
            return RemoteError(self.base_url, msg, status=status, hint=(
                "the server was started without a tool-call parser: start it with "
                "--enable-auto-tool-choice --tool-call-parser FORMAT (hermes, mistral, "
                "llama3_json, pythonic), or force a call with tool_choice='required' or a "
                "tool's name"))
        return RemoteError(self.base_url, msg, status=status)


def request_body(model: str, prompt: RemotePrompt, s: ResolvedSampling) -> dict[str, Any]:
    """The JSON of one streaming request for ``prompt`` under sampling ``s``."""
    body: dict[str, Any] = {
        "model": model,
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": s.max_tokens,
        "temperature": s.temperature,
        "top_p": s.top_p,
    }
    if prompt.messages is not None:
        body["messages"] = [dict(m) for m in prompt.messages]
    else:
        body["prompt"] = prompt.text or ""
    if s.seed is not None:
        body["seed"] = s.seed
    if s.stop:
        body["stop"] = list(s.stop)
    # vLLM/SGLang extras, only when on: their "off" values differ between versions
    # (top_k -1 or 0), and OpenAI itself refuses fields it does not know.
    if s.top_k > 0:
        body["top_k"] = s.top_k
    if s.min_p > 0:
        body["min_p"] = s.min_p
    if s.repetition_penalty != 1.0:
        body["repetition_penalty"] = s.repetition_penalty
    if prompt.tools:
        # the server's own tool support: it renders them and parses the calls; the
        # constraint localrun made for them is not sent. "strict" (OpenAI's field) makes
        # it constrain each call's arguments to the tool's schema, as localrun does on
        # every engine (vLLM 0.32 leaves them free without it, even for a forced call).
        body["tools"] = [strict_tool(t) for t in prompt.tools]
        body["tool_choice"] = tool_choice(prompt.forced, s.constraint)
    elif s.constraint is not None:
        # the server's own structured output (vLLM: its guided-decoding backend)
        body["response_format"] = {"type": "json_schema", "json_schema": {
            "name": re.sub(r"[^A-Za-z0-9_-]", "_", s.constraint.label)[:64] or "reply",
            "schema": s.constraint.schema_dict, "strict": True}}
    return body


class RemoteSession(Session):
    def __init__(self, request: LoadRequest, *, client: OpenAIClient | None = None,
                 backend: str = "remote") -> None:
        opts = check_options(SPEC, request.options) if client is None else {}
        if client is None:
            base_url = opts.get("base_url")
            if not base_url:
                raise LocalrunError("The remote backend needs the server's address",
                                    hint="pass --base-url http://HOST:8000/v1 (or "
                                    "base_url=... to localrun.load)")
            client = OpenAIClient(str(base_url), opts.get("api_key"),
                                  float(opts.get("timeout", READ_TIMEOUT)))
        self._client = client
        try:
            cards = client.models()
            card = self._pick(request.path, cards)
        except BaseException:
            client.close()
            raise
        self.model_id = str(card["id"])
        ctx = card.get("max_model_len") or card.get("context_length")
        # No figure from the server: the caller's, else unbounded here (the server
        # refuses a prompt too long for it, and that becomes ContextOverflowError).
        context = int(ctx) if isinstance(ctx, int) and ctx > 0 else (request.context or 2**31 - 1)
        self.info = ModelInfo(
            backend=backend,
            engine_version=str(card.get("owned_by") or "openai-api"),
            format=str(card.get("format") or "remote"),
            quantization=None,
            path=f"{client.base_url}#{self.model_id}",
            context_length=context,
            trained_context_length=context if isinstance(ctx, int) else None,
            name=self.model_id,
            device=urlsplit(client.base_url).netloc,
        )

    def _pick(self, name: str, cards: list[dict[str, Any]]) -> dict[str, Any]:
        ids = [str(c["id"]) for c in cards]
        url = self._client.base_url
        if not name:
            if len(cards) == 1:
                return cards[0]
            raise RemoteModelNotFoundError(url, "", ids, reason=(
                f"name the model: the server serves {len(ids)} ({', '.join(ids[:8])})"),
                status=None)
        for c in cards:
            if c["id"] == name:
                return c
        # localrun serve loads any model localrun can on its first request, listed or not
        if cards and all(c.get("owned_by") == "localrun" for c in cards):
            return {"id": name, "owned_by": "localrun"}
        raise RemoteModelNotFoundError(url, name, ids, status=None)

    # -- encoding: the server renders and tokenizes ----------------------------------

    def encode_chat(self, messages: Sequence[Message]) -> Prompt:
        return RemotePrompt(ServerTokens(), None, tuple(messages))

    def encode_text(self, text: str) -> Prompt:
        return RemotePrompt(ServerTokens(), text, None)

    #: a conversation with tools comes through encode_rendered (see remote_tools)
    chat_template = ENVELOPE_TEMPLATE

    def encode_rendered(self, text: str) -> Prompt:
        messages, tools, rest = read_envelope(text)
        return RemotePrompt(ServerTokens(), None, tuple(messages),  # type: ignore[arg-type]
                            tuple(tools) if tools else None, forced=bool(rest.strip()))

    def check_constraint(self, constraint: Constraint) -> None:
        """The server enforces what is sent: a schema as ``response_format``, a forced
        call as ``tool_choice``; "auto" calls are the server's own parser's."""

    def count_tokens(self, text: str) -> int:
        return self._client.tokenize(self.model_id, text)

    def served_name(self, sampling: ResolvedSampling) -> str:
        """The model a request names on the server (vLLM: the adapter it runs under)."""
        return self.model_id

    # -- generation -------------------------------------------------------------------

    def generate(self, prompt: Prompt, sampling: ResolvedSampling, cancel: CancelToken,
                 stats: GenerationStats) -> Iterator[str]:
        if not isinstance(prompt, RemotePrompt):
            raise LocalrunError("The remote backend was given a prompt it did not encode",
                                hint="pass messages or text to Model.chat/complete")
        chat = prompt.messages is not None
        body = request_body(self.served_name(sampling), prompt, sampling)
        pieces = 0
        calls = CallWriter(primed=prompt.forced)
        for event in self._request("/chat/completions" if chat else "/completions", body,
                                   cancel):
            usage = event.get("usage")
            if isinstance(usage, dict):
                if isinstance(prompt.tokens, ServerTokens):
                    prompt.tokens.known = int(usage.get("prompt_tokens") or 0)
                stats.completion_tokens = int(usage.get("completion_tokens") or pieces)
            for choice in event.get("choices") or ():
                delta = choice.get("delta") or {}
                text = delta.get("content") if chat else choice.get("text")
                piece = (calls.close() + str(text)) if text else ""
                if chat and delta.get("tool_calls"):
                    piece += calls.feed(delta["tool_calls"])
                finish = choice.get("finish_reason")
                if finish:
                    piece += calls.close()
                if piece:
                    pieces += 1
                    stats.completion_tokens = max(stats.completion_tokens, pieces)
                    yield piece
                if finish:
                    stats.finish_reason = "length" if finish == "length" else "stop"
        rest = calls.close()  # a stream that ended without a finish_reason
        if rest:
            yield rest

    #: the server batches: every sequence goes out as its own concurrent request, a
    #: lone one too (so that a call never waits for another to end)
    batch_alone = True
    _batcher: RequestBatcher | None = None

    def batcher(self) -> Batcher:
        if self._batcher is None:
            self._batcher = RequestBatcher(self.generate, self.info.backend)
        return self._batcher

    def footprint(self, slots: int | None = None) -> Footprint:
        """The model runs in another process: on another machine (nothing here; no
        :attr:`memory_facts`), or in vLLM's server on this one (its estimate), whose KV
        cache is allocated up front and shared by the sequences (per_slot 0)."""
        capacity = self.batcher().capacity
        est = self.estimate() if self.memory_facts is not None else None
        return Footprint(min(slots or capacity, capacity),
                         est.total_bytes if est is not None else 0, 0, 0)

    def _request(self, path: str, body: dict[str, Any], cancel: CancelToken
                 ) -> Iterator[dict[str, Any]]:
        try:
            yield from self._client.stream(path, body, cancel)
        except ContextOverflowError as e:
            # vLLM refuses prompt + max_tokens past the context before it answers; the
            # other backends stop at the context's end ("length"): ask again for what fits.
            room = e.context - e.prompt_tokens
            if room <= 0 or body["max_tokens"] <= room:
                raise
            yield from self._client.stream(path, {**body, "max_tokens": room}, cancel)

    def close(self) -> None:
        if self._batcher is not None:
            self._batcher.close()
        self._client.close()


BACKEND = SessionBackend("remote", RemoteSession)
