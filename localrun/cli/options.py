"""Flags shared by chat, run and generate."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

ModelArg = Annotated[
    str | None,
    typer.Argument(help="Model: a .gguf file, a model folder, or a name such as smollm2:135m "
                   "(default: the embedded SmolLM2-135M-Instruct)."),
]
MaxTokens = Annotated[int | None, typer.Option("--max-tokens", "-n", help="Most tokens to generate (default 1024).")]
Temperature = Annotated[float | None, typer.Option("--temperature", "-t", help="0 = greedy; higher = more varied (default: the model's own, else 0.7).")]
TopP = Annotated[float | None, typer.Option("--top-p", help="Nucleus sampling, 0 < p <= 1 (1 = off).")]
TopK = Annotated[int | None, typer.Option("--top-k", help="Keep the k most likely tokens (0 = off).")]
MinP = Annotated[float | None, typer.Option("--min-p", help="Drop tokens below p x the top probability (0 = off).")]
RepPenalty = Annotated[float | None, typer.Option("--repetition-penalty", help="Penalize repeated tokens (1 = off).")]
Seed = Annotated[int | None, typer.Option("--seed", help="Seed for reproducible sampling.")]
Stop = Annotated[list[str] | None, typer.Option("--stop", help="Stop at this string (repeatable); it is not printed.")]
System = Annotated[str | None, typer.Option("--system", "-s", help="System prompt.")]
Context = Annotated[int | None, typer.Option("--context", "-c", help="Context window in tokens (default: the model's, up to 8192).")]
Backend = Annotated[str, typer.Option("--backend", "-b", help="Engine: auto, llama.cpp, mlx, exllamav2, exllamav3, openvino, onnx, vllm, remote.")]
AllowUnoptimized = Annotated[bool, typer.Option("--allow-unoptimized", help="Let an engine load a format it runs without its optimized kernels.")]
BaseUrl = Annotated[str | None, typer.Option("--base-url", envvar="LOCALRUN_BASE_URL", help="An OpenAI-compatible server to run on (vLLM, SGLang, localrun serve), e.g. http://host:8000/v1; implies --backend remote.")]
ApiKey = Annotated[str | None, typer.Option("--api-key", envvar="LOCALRUN_REMOTE_API_KEY", help="Key for --base-url's server (sent as a Bearer token).")]
VllmPython = Annotated[str | None, typer.Option("--vllm-python", envvar="LOCALRUN_VLLM_PYTHON", help="Python of the environment vLLM is installed in (--backend vllm).")]


def remote_options(backend: str, base_url: str | None, api_key: str | None,
                   vllm_python: str | None = None) -> tuple[str, dict[str, Any]]:
    """The backend and engine options --base-url / --api-key / --vllm-python mean."""
    opts: dict[str, Any] = {}
    if base_url:
        if backend not in ("auto", "remote"):
            from localrun.errors import LocalrunError

            raise LocalrunError(f"--base-url runs on a server, not on --backend {backend}",
                                hint="drop --backend, or use --backend remote")
        backend = "remote"
        opts["base_url"] = base_url
        if api_key:
            opts["api_key"] = api_key
    if vllm_python and backend == "vllm":
        opts["vllm_python"] = vllm_python
    return backend, opts
SchemaFile = Annotated[Path | None, typer.Option("--schema", help="Reply with JSON matching this JSON Schema file, enforced by constrained decoding.")]
JsonObject = Annotated[bool, typer.Option("--json-object", help="Reply with one JSON object (any keys), enforced by constrained decoding.")]


def sampling_kwargs(**flags: Any) -> dict[str, Any]:
    """Keep only the flags the user set."""
    out = {k: v for k, v in flags.items() if v is not None}
    if "stop" in out and not out["stop"]:
        del out["stop"]
    return out


def structured_kwargs(schema: Path | None, json_object: bool) -> dict[str, Any]:
    """``schema=``/``response_format=`` for ``--schema FILE`` / ``--json-object``, read and
    checked before any model loads."""
    import json

    from localrun.errors import LocalrunError

    if schema is not None and json_object:
        raise LocalrunError("--schema and --json-object both say what the reply is",
                            hint="pass one of them (--schema FILE already means JSON)")
    if json_object:
        return {"response_format": {"type": "json_object"}}
    if schema is None:
        return {}
    try:
        value = json.loads(schema.read_text(encoding="utf-8"))
    except OSError as e:
        raise LocalrunError(f"Cannot read --schema {schema}: {e.strerror or e}",
                            hint="pass the path of a JSON Schema file") from e
    except (ValueError, UnicodeDecodeError) as e:
        raise LocalrunError(f"--schema {schema} is not JSON: {e}",
                            hint="the file must hold one JSON Schema object") from e
    from localrun.structured.output import prepare

    prepare(schema=value)  # a malformed or unenforceable schema fails here, not mid-load
    return {"schema": value}


def load_model(model: str | None, backend: str, context: int | None,
               allow_unoptimized: bool = False, *, base_url: str | None = None,
               api_key: str | None = None, vllm_python: str | None = None) -> Any:
    """Load for a command: explain a Hub plan and show download progress on stderr,
    and turn the "runs without optimized kernels" warning into one line."""
    import sys
    import warnings

    from rich.console import Console

    from localrun.api import load
    from localrun.errors import UnoptimizedFormatWarning

    backend, engine_options = remote_options(backend, base_url, api_key, vllm_python)
    console = Console(stderr=True, highlight=False)
    bar = _DownloadBar(console)

    def on_plan(plan: Any, fetch_plan: Any) -> None:
        from localrun.cli.pull import print_plan

        if fetch_plan.download_bytes:
            console.print(f"[bold]Engine[/]: {plan.backend} on {plan.device}")
            print_plan(console, fetch_plan)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", UnoptimizedFormatWarning)
        try:
            model_obj = load(model, backend=backend, context=context,
                             allow_unoptimized=allow_unoptimized, on_plan=on_plan,
                             progress=bar.report, **engine_options)
        finally:
            bar.close()
    for w in caught:
        if issubclass(w.category, UnoptimizedFormatWarning):
            sys.stderr.write(f"warning: {w.message}\n")
    return model_obj


class _DownloadBar:
    """A rich progress bar started at the first byte and closed after the download."""

    def __init__(self, console: Any) -> None:
        self._console = console
        self._progress: Any = None
        self._task: Any = None

    def report(self, p: Any) -> None:
        if self._progress is None:
            from rich.progress import (
                BarColumn,
                DownloadColumn,
                Progress,
                TextColumn,
                TimeRemainingColumn,
                TransferSpeedColumn,
            )

            self._progress = Progress(TextColumn("{task.description}"), BarColumn(),
                                      DownloadColumn(), TransferSpeedColumn(),
                                      TimeRemainingColumn(), console=self._console)
            self._progress.start()
            self._task = self._progress.add_task("downloading", total=p.total or None)
        name = p.file.rsplit("/", 1)[-1][:40]
        self._progress.update(self._task, advance=p.delta,
                              description=f"[{p.index}/{p.count}] {name}")

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None


def header(model: Any, name: str | None) -> str:
    i = model.info
    quant = f" {i.quantization}" if i.quantization else ""
    return (f"{name or i.name or i.path} · {i.backend} {i.engine_version} · "
            f"{i.format}{quant} · context {i.context_length}")
