"""Flags shared by chat, run and generate."""

from __future__ import annotations

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
Backend = Annotated[str, typer.Option("--backend", "-b", help="Engine: auto, llama.cpp, mlx, exllamav2, exllamav3, openvino, onnx.")]
AllowUnoptimized = Annotated[bool, typer.Option("--allow-unoptimized", help="Let an engine load a format it runs without its optimized kernels.")]


def sampling_kwargs(**flags: Any) -> dict[str, Any]:
    """Keep only the flags the user set."""
    out = {k: v for k, v in flags.items() if v is not None}
    if "stop" in out and not out["stop"]:
        del out["stop"]
    return out


def load_model(model: str | None, backend: str, context: int | None,
               allow_unoptimized: bool = False) -> Any:
    from localrun.api import load

    return load(model, backend=backend, context=context, allow_unoptimized=allow_unoptimized)


def header(model: Any, name: str | None) -> str:
    i = model.info
    quant = f" {i.quantization}" if i.quantization else ""
    return (f"{name or i.name or i.path} · {i.backend} {i.engine_version} · "
            f"{i.format}{quant} · context {i.context_length}")
