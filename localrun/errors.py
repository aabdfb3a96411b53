"""One error family. Every error says what happened, the numbers, and what to do next.

Errors carry their facts as attributes (so scripts can act on them) and a ``hint``
with the next command to run. They also inherit the builtin they resemble, so
``except FileNotFoundError`` keeps working for callers who don't know localrun.
Only the CLI turns them into text and exit codes.
"""

from __future__ import annotations

from collections.abc import Sequence


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


class EngineNotInstalledError(LocalrunError, ImportError):
    """The backend's Python package is not installed (or fails to import)."""

    def __init__(self, backend: str, extra: str, *, reason: str | None = None):
        self.backend = backend
        self.extra = extra
        self.reason = reason
        msg = f"The {backend} engine is not installed"
        if reason:
            msg = f"The {backend} engine cannot be used: {reason}"
        super().__init__(msg, hint=f"pip install 'localrun[{extra}]'")


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
