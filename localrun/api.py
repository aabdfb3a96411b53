"""The public API: ``load()`` and :class:`Model`.

A Model validates each call's arguments and hands the sequence to its driver
(:mod:`localrun.driver`), where everything an engine lacks is built once: the
model's own sampling defaults, the token limit and the seed, stop strings, usage on
streams, timings, cancellation between tokens, and the queue (or the engine's own
batching) that lets several threads share a Model.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from localrun.backends.base import Footprint, Session
from localrun.driver import Driver, Request, Stream
from localrun.driver.sequence import token_ids
from localrun.errors import LocalrunError, ModelClosedError
from localrun.reasoning import reasoning_request, refuse
from localrun.sampling import ResolvedSampling, make_sampling
from localrun.structured.output import prepare, raw_plan
from localrun.templates import normalize_messages
from localrun.types import CancelToken, Completion, Message, ModelInfo, Sampling

if TYPE_CHECKING:
    from localrun.adapters import Adapter
    from localrun.batch import BatchInput
    from localrun.hub import Download, ProgressCallback
    from localrun.naming.presets import Preset
    from localrun.planning.selection import Plan
    from localrun.resolve import Target

__all__ = ["Model", "Stream", "load", "make_sampling"]


class Model:
    """A loaded model. Safe to share between threads: where the engine batches
    (llama.cpp, MLX, OpenVINO GenAI, ExLlama, a remote server or vLLM) calls run together
    in its batch; elsewhere (ONNX Runtime GenAI) they queue up and run one at a time."""

    def __init__(self, session: Session, sampling_defaults: Mapping[str, Any] | None = None,
                 *, chat_template: str | None = None, reasoning: str | None = None,
                 preset: Preset | None = None) -> None:
        self.info: ModelInfo = session.info
        self._driver = Driver(session, sampling_defaults, chat_template, reasoning)
        #: the preset this model was loaded as (``localrun.load("mybot")``), else None
        self.preset = preset
        if preset is not None:  # between the caller's values and the model's own
            self._driver.defaults = {**self._driver.defaults, **preset.sampling}

    @property
    def reasoning(self) -> str | None:
        """How the model thinks: the name of its reasoning format
        (:data:`localrun.reasoning.FORMATS`: "qwen3", "deepseek-r1", ...), read from its
        chat template or the catalog; None for a model that does not think."""
        fmt = self._driver.chat.reasoning
        return fmt.name if fmt is not None else None

    # -- public API -------------------------------------------------------------------

    def chat(
        self,
        messages: str | Sequence[Message],
        *,
        cancel: CancelToken | None = None,
        response_format: Any = None,
        schema: Any = None,
        tools: Sequence[Any] | None = None,
        tool_choice: Any = None,
        parallel_tool_calls: bool | None = None,
        think: bool | None = None,
        reasoning_effort: str | None = None,
        thinking_budget: int | None = None,
        **sampling: Any,
    ) -> Completion:
        """Reply to a conversation (or a single user message) with the chat template.

        Structured output: ``schema=`` a JSON Schema dict or a pydantic model class
        (``Completion.parsed`` is then the reply as data, or the model instance), or
        ``response_format=`` in OpenAI's shape (``{"type": "json_object"}``,
        ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}``).
        Tools: ``tools=`` OpenAI function dicts, Python functions or pydantic models;
        ``tool_choice=`` "auto" (default), "none", "required" or
        ``{"type": "function", "function": {"name": ...}}``. Calls come back in
        ``Completion.tool_calls`` with ``finish_reason="tool_calls"``; send results back
        as ``{"role": "tool", "tool_call_id": ..., "content": ...}`` messages. Schemas and
        forced calls are enforced by constrained decoding; an engine that cannot
        enforce them raises instead of answering unconstrained. "auto" may make several
        calls, "required" one, or several with ``parallel_tool_calls=True`` (OpenAI's
        "required" with parallel calls); ``parallel_tool_calls=False`` allows one at
        most: the grammar ends the reply after the first call, and where calls are
        parsed as written only the first is kept.

        Thinking models (:attr:`reasoning` is not None: Qwen3, DeepSeek-R1, ...): the
        thinking comes back apart, in ``Completion.reasoning`` (``usage.reasoning_tokens``
        counts it), the answer in ``text``. ``think=False`` switches it off (the
        template's switch, or an empty thinking block); ``thinking_budget=N`` ends it
        after N tokens with the model's own end marker, and the answer follows;
        ``reasoning_effort`` ("none", "minimal", "low", "medium", "high") is a budget by
        name (:data:`localrun.reasoning.EFFORT_BUDGETS`). ``max_tokens`` bounds thinking
        and answer together; stop strings apply to the answer. Asking a model that does
        not think to think raises ThinkingUnavailableError (an InvalidSamplingError); a
        schema or a tool call constrains the answer alone.
        """
        return self.stream(messages, cancel=cancel, response_format=response_format,
                           schema=schema, tools=tools, tool_choice=tool_choice,
                           parallel_tool_calls=parallel_tool_calls, think=think,
                           reasoning_effort=reasoning_effort,
                           thinking_budget=thinking_budget, **sampling).join()

    def complete(
        self, prompt: str | Sequence[int], *, cancel: CancelToken | None = None,
        response_format: Any = None, schema: Any = None, **sampling: Any
    ) -> Completion:
        """Continue raw text, without the chat template (``schema=`` constrains it too).

        ``prompt`` is text, or token ids of this model's tokenizer, used as they are (no
        BOS added; llama.cpp, ONNX Runtime GenAI and MLX take them). ``echo=True`` puts
        the prompt's tokens with their log probabilities in
        ``Completion.prompt_logprobs`` (the first token's is None); with
        ``max_tokens=0`` the prompt is only scored (lm-evaluation-harness's
        loglikelihood). ``logprobs``/``top_logprobs`` as for :meth:`stream`.
        """
        return self.stream(prompt, raw=True, cancel=cancel, response_format=response_format,
                           schema=schema, **sampling).join()

    def stream(
        self,
        messages: str | Sequence[Message] | Sequence[int],
        *,
        raw: bool = False,
        cancel: CancelToken | None = None,
        response_format: Any = None,
        schema: Any = None,
        tools: Sequence[Any] | None = None,
        tool_choice: Any = None,
        parallel_tool_calls: bool | None = None,
        think: bool | None = None,
        reasoning_effort: str | None = None,
        thinking_budget: int | None = None,
        **sampling: Any,
    ) -> Stream:
        """Stream a reply as :class:`Chunk` objects. ``raw=True`` skips the chat template.

        Sampling options: max_tokens, temperature (0 = greedy), top_p, top_k, min_p,
        repetition_penalty, seed, stop. Unset options take the model's own defaults.
        Structured output and tools as for :meth:`chat`; tool calls stream as
        ``Chunk.tool_calls`` deltas (a stable ``index``, the id and name first, then
        argument fragments that concatenate to the call's JSON arguments). A thinking
        model's thinking streams first, in chunks whose ``reasoning`` holds it (``kind``
        "reasoning"), then the answer in ``text``; the options as for :meth:`chat`.

        Log probabilities: ``logprobs=True`` fills ``Completion.logprobs`` (and each
        chunk's ``logprobs``) with every chosen token's, ``top_logprobs=k`` (at most 20)
        adds the k most likely tokens at each position; the model's own distribution,
        before penalties, temperature, filters and masks (OpenAI's and vLLM's). llama.cpp,
        ONNX Runtime GenAI and MLX report them; another engine raises
        UnsupportedFeatureError before generating. ``echo`` as for :meth:`complete`.

        LoRA adapters: ``adapters=`` the set this reply runs under, instead of the one the
        model loaded with (``load(adapters=...)``; adapters not named are off):
        ``{"name": scale}``, a list of names or indices (their load-time scale), ``(name,
        scale)`` pairs or ``{"id"|"name": ..., "scale": ...}``; ``[]`` for the base
        model. llama.cpp switches sets between calls (and within a batch) on one loaded
        model; vLLM takes one adapter per call; MLX refuses a set other than its own.
        ``speculative=`` ("off", "auto", "prompt-lookup", "draft") overrides the load's
        speculative decoding for this call; ``Completion.timings`` counts the drafted and
        accepted tokens.
        """
        tokens = None
        if raw and not isinstance(messages, str):
            tokens = token_ids(messages)
            if not tokens:
                raise LocalrunError("raw=True takes a prompt string or a non-empty list of "
                                    "token ids", hint="pass the text itself, or its token ids")
        request = make_sampling(**sampling)
        if request.echo and not raw:
            raise LocalrunError("echo=True takes a raw prompt, not a conversation",
                                hint="use Model.complete(prompt, echo=True)")
        structured = prepare(response_format, schema, tools, tool_choice,
                             parallel_tool_calls)
        reasoning = reasoning_request(think, reasoning_effort, thinking_budget)
        prepared = None
        if raw:  # tools need a chat turn: refuse now, not mid-stream; the plan goes along
            prepared = raw_plan(structured) if structured is not None else None
            if reasoning is not None and reasoning.think:
                raise refuse(reasoning, "a raw prompt has no chat template to think in")
        msgs = None if raw else normalize_messages(messages)  # type: ignore[arg-type]
        if msgs is not None and self.preset is not None:
            msgs = self.preset.conversation(msgs)  # its system prompt, unless the caller's
        text = messages if isinstance(messages, str) and raw else None
        return self._driver.stream(Request(msgs, text, request, structured, tokens, reasoning,
                                           prepared), cancel or CancelToken())

    def batch(
        self,
        items: Iterable[BatchInput],
        *,
        max_concurrency: int | None = None,
        cancel: CancelToken | None = None,
        response_format: Any = None,
        schema: Any = None,
        tools: Sequence[Any] | None = None,
        tool_choice: Any = None,
        parallel_tool_calls: bool | None = None,
        think: bool | None = None,
        reasoning_effort: str | None = None,
        thinking_budget: int | None = None,
        **sampling: Any,
    ) -> list[Completion]:
        """Reply to many prompts; the Completions come back in input order.

        Each item is a prompt string, a list of messages, or a
        :class:`localrun.batch.BatchItem` with its own sampling overrides; ``sampling``
        applies to all. Engines that batch run up to ``max_concurrency`` items at once
        (None: the engine decides); the others run them in turn. If any item fails,
        :class:`localrun.batch.BatchError` is raised once all have run: its ``results``
        hold every Completion and each failed item's error. ``cancel`` ends the batch:
        items in flight and those not started finish with ``finish_reason="cancelled"``.
        ``response_format``/``schema``/``tools``/``tool_choice``/``parallel_tool_calls``
        and ``think``/``reasoning_effort``/``thinking_budget`` (as for :meth:`chat`)
        apply to every item.
        """
        from localrun.batch import BatchError

        results: dict[int, Completion | LocalrunError] = dict(
            self.batch_iter(items, max_concurrency=max_concurrency, cancel=cancel,
                            response_format=response_format, schema=schema, tools=tools,
                            tool_choice=tool_choice, parallel_tool_calls=parallel_tool_calls,
                            think=think, reasoning_effort=reasoning_effort,
                            thinking_budget=thinking_budget, **sampling))
        ordered = [results[i] for i in range(len(results))]
        if any(isinstance(r, LocalrunError) for r in ordered):
            raise BatchError(ordered)
        return [r for r in ordered if isinstance(r, Completion)]

    def batch_iter(
        self,
        items: Iterable[BatchInput],
        *,
        max_concurrency: int | None = None,
        cancel: CancelToken | None = None,
        response_format: Any = None,
        schema: Any = None,
        tools: Sequence[Any] | None = None,
        tool_choice: Any = None,
        parallel_tool_calls: bool | None = None,
        think: bool | None = None,
        reasoning_effort: str | None = None,
        thinking_budget: int | None = None,
        **sampling: Any,
    ) -> Iterator[tuple[int, Completion | LocalrunError]]:
        """Like :meth:`batch`, but yield ``(index, result)`` as each item finishes.

        ``result`` is the item's Completion, or the LocalrunError that item hit (a
        prompt over the context, an invalid override, an engine failure, a reply whose
        JSON was cut short); the other items go on. Batch-wide mistakes (invalid shared
        sampling, a malformed schema or tool) raise at once.
        """
        from localrun.batch import run_batch

        structured = prepare(response_format, schema, tools, tool_choice,
                             parallel_tool_calls)
        reasoning = reasoning_request(think, reasoning_effort, thinking_budget)
        if self.preset is not None:
            items = self.preset.batch_items(items)
        return run_batch(self._driver, items, max_concurrency=max_concurrency, cancel=cancel,
                         sampling=sampling, structured=structured, reasoning=reasoning)

    @property
    def defaults(self) -> ResolvedSampling:
        """The sampling a call that sets no option runs with: the model's own defaults
        (GGUF ``general.sampling.*``, generation_config.json), else its model card's
        (catalog.json), else localrun's neutral ones. A call's own options override each."""
        return self._driver.resolve(Sampling())

    @property
    def max_concurrency(self) -> int:
        """Sequences this model runs at once, together in its engine's batch (calls from
        several threads, a :meth:`batch`); 1 when the engine runs one at a time. The
        first ask builds the engine's batcher (llama.cpp's is a second context), within
        :meth:`limit_concurrency`."""
        return self._driver.capacity()

    def limit_concurrency(self, n: int) -> None:
        """Run at most ``n`` sequences at once (``load(max_concurrency=n)`` does this at
        load). Before the engine's batcher is built (the first overlap, or the first ask
        of :attr:`max_concurrency`) it also sizes it: llama.cpp's batch context then holds
        ``n`` KV streams, not as many as memory allows, and ``n=1`` builds none. Later it
        only caps how many run at once."""
        self._driver.limit(_check_concurrency(n))

    def footprint(self, slots: int | None = None) -> Footprint:
        """What the engine holds in memory (bytes) with ``slots`` sequences running at once
        (None: as many as it runs, within :meth:`limit_concurrency`): a
        :class:`~localrun.backends.base.Footprint` of ``fixed`` (weights, overhead, the
        context's KV cache, a batch context built already), ``per_slot`` (what each
        sequence adds: llama.cpp's KV stream per slot before its batch context is built,
        MLX's growing KV cache) and ``kept`` (what it keeps between calls for KV reuse:
        MLX's prompt caches); ``total`` sums them. Its ``slots`` are those the engine
        would run. llama.cpp's batch context is not built by asking, so that a caller
        can size it first (:meth:`limit_concurrency`, then :attr:`max_concurrency`
        builds it); another engine's batcher, which holds nothing up front, may be."""
        if slots is not None:
            _check_concurrency(slots, "slots")
        return self._driver.footprint(slots)

    def count_tokens(self, text: str) -> int:
        """Tokens of raw text for this model's tokenizer."""
        return self._driver.count_tokens(text)

    def count_prompt_tokens(self, messages: str | Sequence[Message], *,
                            tools: Sequence[Any] | None = None, tool_choice: Any = None,
                            response_format: Any = None, schema: Any = None,
                            parallel_tool_calls: bool | None = None,
                            think: bool | None = None, reasoning_effort: str | None = None,
                            thinking_budget: int | None = None) -> int:
        """Tokens of the prompt :meth:`chat` would send for ``messages`` with the same
        arguments (the chat template given at load or the model's own, its tools, a
        forced call's prefill, the thinking switch or empty thinking block), counted
        without generating (``Completion.usage.prompt_tokens`` of that call)."""
        from localrun.driver.prompt import assistant_prefill, check_prefill, encode_prompt
        from localrun.driver.reasoning import thinking_prompt
        from localrun.driver.sequence import structured_plan

        structured = prepare(response_format, schema, tools, tool_choice,
                             parallel_tool_calls)
        reasoning = reasoning_request(think, reasoning_effort, thinking_budget)
        msgs = normalize_messages(messages)
        if self.preset is not None:
            msgs = self.preset.conversation(msgs)
        chat = self._driver.chat
        with self._driver.exclusive() as session:
            head, prefix = assistant_prefill(msgs)
            check_prefill(session, prefix, structured, chat)
            plan = structured_plan(session, head, structured, chat)
            if chat.reasoning is not None:
                return len(thinking_prompt(session, chat, head, plan,  # type: ignore[arg-type]
                                           reasoning)[0].tokens)
            if reasoning is not None and reasoning.think:
                raise refuse(reasoning, "this model does not think (its chat template has "
                             "no thinking block)")
            return len(encode_prompt(session, head, None, plan, None, chat, prefix).tokens)

    def close(self) -> None:
        """Free the engine's memory. Waits for running calls to finish."""
        session = self._driver.close()
        if session is not None:
            session.close()

    def __enter__(self) -> Model:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        i = self.info
        return f"<localrun.Model {i.name or i.path} on {i.backend} ({i.format} {i.quantization})>"

    # -- internals --------------------------------------------------------------------

    @property
    def _session(self) -> Session | None:
        """The engine's session (None once closed); tests and scripts look inside it."""
        return self._driver.session

    def _live(self) -> Session:
        session = self._driver.session
        if session is None:
            raise ModelClosedError()
        return session



def load(
    model: str | None = None,
    *,
    backend: str = "auto",
    context: int | None = None,
    device: str | None = None,
    threads: int | None = None,
    allow_unoptimized: bool = False,
    max_concurrency: int | None = None,
    exact: bool = False,
    quant: str | None = None,
    progress: ProgressCallback | None = None,
    on_plan: Callable[[Plan, Download], None] | None = None,
    chat_template: str | os.PathLike[str] | None = None,
    on_startup: Callable[[Any], None] | None = None,
    adapters: Sequence[Adapter | str | os.PathLike[str]] | None = None,
    speculative: str | None = None,
    draft_model: str | None = None,
    **engine_options: Any,
) -> Model:
    """Load a model and return a :class:`Model`.

    ``model`` is a local file or folder, or a name such as ``"smollm2:135m"``; ``None``
    is the embedded default model. A preset's name (``localrun create``) loads its
    model with its context and engine, its sampling values as the model's defaults and
    its system prompt where a conversation has none (:mod:`localrun.naming.presets`).
    ``backend="auto"`` picks the engine for this host and the model's format; naming
    one forces it (after the compatibility check).
    ``context`` is the context window in tokens (default: the model's trained
    context, capped at 8192, on every engine). ``device`` is where it runs (``"cpu"``,
    ``"cuda:1"``, ``"GPU.1"``, ``"NPU"``, ...; default: the device the plan chose for this
    host, as ``localrun plan`` shows it). ``allow_unoptimized=True`` lets an engine load
    a format it runs but has no optimized kernels for. ``max_concurrency`` is the most
    sequences the model will run at once (default: as many as its engine batches, see
    :meth:`Model.limit_concurrency`); 2 or more also builds the engine's batcher now
    (llama.cpp's batch context), so that the first :meth:`Model.batch` does not pay for
    it. ``exact=True`` trades speed for replies that do not depend on what ran before:
    greedy replies the same alone or batched, with a warm or cold cache, one seed one
    sample (the default reuses every cached KV cell and computes in the engine's own
    precision; README, "Speed"). Other keywords are engine options
    (``localrun.backends.engine_options(backend)`` lists them; others are refused).

    A name that is not on disk (``"qwen2.5:0.5b"``, ``"org/repo:Q4_K_M"``) is planned
    for this machine and downloaded into the Hugging Face cache first: ``on_plan``
    receives the plan before any download, ``progress`` receives download progress,
    ``quant`` picks a quant. A model that does not fit in memory is refused first.

    ``chat_template`` replaces the model's own chat template (Jinja source, or a path to
    a ``.jinja`` file), on every engine: localrun then renders each conversation with it
    (as llama-server's ``--chat-template-file``). A template that thinks makes the model
    a thinking model (:attr:`Model.reasoning`).

    ``on_startup`` receives an engine's progress while it starts, where that takes long
    (a managed vLLM: a minute or more, :class:`localrun.backends.vllm.Startup` reports).

    ``adapters`` loads LoRA adapters with the model (:mod:`localrun.adapters`): paths
    (``"style.gguf"``, ``"style.gguf:0.5"``, ``"name=style.gguf"``) or
    :class:`~localrun.adapters.Adapter` (path, scale, name); llama.cpp takes GGUF
    adapters (several), MLX an mlx-lm adapter folder, vLLM PEFT folders; other engines
    refuse them. A call's ``adapters=`` then picks another set where the engine switches
    per request (llama.cpp, vLLM): ``{"name": scale}``, names, ``[]`` for the base model.
    A preset's adapters load with its model unless ``adapters`` is given.
    """
    from localrun.adapters import normalize
    from localrun.backends import canonical_backend
    from localrun.naming.presets import lookup
    from localrun.resolve import resolve
    from localrun.sampling import check_speculative
    from localrun.speculation import draft_path

    if context is not None and (isinstance(context, bool) or not isinstance(context, int)
                                or context < 16):
        raise LocalrunError(f"Invalid context {context!r}",
                            hint="pass a number of tokens >= 16, e.g. context=4096")
    if max_concurrency is not None:
        _check_concurrency(max_concurrency)
    chosen = normalize(adapters)  # a missing file fails before anything is fetched
    if not isinstance(exact, bool):
        raise LocalrunError(f"Invalid exact {exact!r}",
                            hint="pass exact=True (replies independent of the cache and "
                                 "the batch) or exact=False (fastest)")
    preset = None
    if backend == "auto" or canonical_backend(backend) != "remote":  # a server's own names
        preset = lookup(model)
    if preset is not None:  # its model, engine and context; the caller's own values win
        model, backend, context, allow_unoptimized = preset.load_args(
            backend, context, allow_unoptimized)
        if adapters is None:
            chosen = normalize(preset.adapters)
        exact = exact or preset.exact
    template = read_template(chat_template) if chat_template is not None else None
    mode = check_speculative(speculative)
    # the adapters are checked for the engine and counted in the fit before any download
    target = resolve(model, backend=backend, context=context, quant=quant,
                     allow_unoptimized=allow_unoptimized, device=device, progress=progress,
                     on_plan=on_plan, options=engine_options, adapters=chosen)
    draft = draft_path(draft_model, target.backend, mode, progress=progress)
    return open_target(target, threads=threads, max_concurrency=max_concurrency,
                       chat_template=template, preset=preset, on_startup=on_startup,
                       adapters=chosen, speculative=mode, draft_model=draft,
                       exact=exact)


def open_target(target: Target, *, threads: int | None = None,
                max_concurrency: int | None = None, chat_template: str | None = None,
                preset: Preset | None = None,
                on_startup: Callable[[Any], None] | None = None,
                adapters: tuple[Adapter, ...] = (),
                speculative: str | None = None, draft_model: str | None = None,
                exact: bool = False) -> Model:
    """Load a resolved :class:`~localrun.resolve.Target` (its files on disk) on its
    engine, with its load options: what :func:`load` and the server's manager do once
    the model is resolved, without resolving it again. ``adapters``: LoRA adapters
    checked already (:func:`localrun.adapters.normalize` and ``for_engine``)."""

    from localrun.backends import get_backend

    if max_concurrency is not None:
        _check_concurrency(max_concurrency)
    request = replace(target.load_request(threads, on_startup), exact=exact)
    if adapters:
        request = replace(request, adapters=adapters)
    # speculative decoding (localrun.speculation)
    request = replace(request, speculative=speculative, draft_model=draft_model)
    session = get_backend(target.backend).load(request)
    loaded = Model(session, target.sampling_defaults, chat_template=chat_template,
                   reasoning=target.reasoning, preset=preset)
    if max_concurrency is not None:
        loaded.limit_concurrency(max_concurrency)
        if max_concurrency > 1:
            loaded.max_concurrency  # noqa: B018 - builds the batcher now, not in a batch
    return loaded


def _check_concurrency(n: Any, what: str = "max_concurrency") -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise LocalrunError(f"Invalid {what} {n!r}",
                            hint="pass the most sequences to run at once, >= 1, e.g. "
                                 f"{what}=4")
    return n


def read_template(value: str | os.PathLike[str]) -> str:
    """A chat template's Jinja source, from itself or from its file; checked now (a
    template that does not compile fails here, not at the first call)."""
    from localrun.errors import ChatTemplateError
    from localrun.templates import check_template

    source = value
    if isinstance(value, os.PathLike) or (isinstance(value, str) and "{" not in value):
        try:
            source = Path(value).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise LocalrunError(f"Cannot read the chat template {str(value)!r}: "
                                f"{getattr(e, 'strerror', None) or e}",
                                hint="pass a .jinja file's path, or the template's Jinja "
                                "source itself") from e
    if not isinstance(source, str) or not source.strip():
        raise ChatTemplateError("the chat template is empty")
    check_template(source)
    return source
