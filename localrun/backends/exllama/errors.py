"""What a failed engine import, load or job means for the user: one-line errors with a
hint (localrun's error family, :mod:`localrun.errors`)."""

from __future__ import annotations

from collections.abc import Mapping

from localrun.backends.exllama.facts import SPECS
from localrun.backends.exllama.options import title
from localrun.backends.installed import missing
from localrun.errors import (
    EngineUnavailableError,
    GenerationError,
    LocalrunError,
    ModelFileError,
)


def _first_line(error: BaseException, width: int) -> str:
    text = str(error).strip()
    return text.splitlines()[0][:width] if text else type(error).__name__


def engine_import_error(engine: str, error: BaseException) -> LocalrunError:
    """What a failed ``import exllamav2`` / ``import exllamav3`` means for the user.

    On a host without CUDA both raise ``OSError: CUDA_HOME environment variable is not
    set`` (their extension is built on first import); a missing torch is an ImportError
    (exllamav3 raises RuntimeError with its own message).
    """
    text = _first_line(error, 200)
    if isinstance(error, ModuleNotFoundError) or (
            isinstance(error, RuntimeError) and "PyTorch is required" in text):
        return missing(SPECS[engine], reason=text)
    return EngineUnavailableError(
        engine,
        f"needs an NVIDIA GPU with CUDA (or an AMD GPU with ROCm), and importing "
        f"{engine} failed: {text}",
        hint="on a GPU host install the CUDA toolkit and a CUDA build of torch (set CUDA_HOME); "
             "without a GPU use a GGUF variant with --backend llama.cpp",
    )


def no_gpu_error(engine: str, detail: str) -> EngineUnavailableError:
    return EngineUnavailableError(
        engine,
        f"needs an NVIDIA GPU with CUDA (or an AMD GPU with ROCm); {detail}",
        hint="run it on a host with a supported GPU (localrun doctor shows what was found), "
             "or use a GGUF variant with --backend llama.cpp",
    )


def load_failure(engine: str, path: str, error: BaseException) -> LocalrunError:
    """An exception from the engine's config/model/cache/tokenizer constructors, mapped."""
    name = title(engine)
    text = _first_line(error, 300)
    if "out of memory" in text.lower():
        return LocalrunError(f"{name} ran out of GPU memory while loading {path}: {text}",
                             hint="load with a smaller context (context=...), a quantized KV "
                                  "cache (kv_cache='q4'), or a smaller quant")
    return ModelFileError(path, f"{name} could not load it ({type(error).__name__}: {text})",
                          hint=f"check that it is a complete {name} model folder; "
                               "re-download or re-quantize it")


class EngineJobError(GenerationError):
    """Sequences the engine gave up on: exllamav3 reports a job that failed in page
    allocation or prefill with an ``"stage": "error"`` result (``Generator.reap_failed_job``)
    and keeps serving the others; a job that leaves the engine's queues without a final
    result is reported the same way rather than waited for."""

    def __init__(self, engine: str, failures: Mapping[int, object], *,
                 numbered: bool = True) -> None:
        """``failures``: sequence -> the engine's error (None: the job vanished).
        ``numbered=False`` for one sequence whose number means nothing to the caller
        (a batcher's key): the message then speaks of "this sequence"."""
        self.failures = dict(failures)
        first = self.failures[min(self.failures)]
        what = f"{type(first).__name__}: {first}" if isinstance(first, BaseException) else \
            "the job left the engine's queue without a result"
        which = ", ".join(str(i) for i in sorted(self.failures))
        noun = "sequence" if len(self.failures) == 1 else "sequences"
        where = f"{noun} {which}" if numbered else "the engine gave up on this sequence"
        super().__init__(title(engine or "ExLlama"), f"{where}: {what}")
