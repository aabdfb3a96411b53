"""localrun run MODEL [PROMPT]: answer once and exit."""

from __future__ import annotations

import json
import sys
from typing import Annotated

import typer

from localrun.cli import options as o


def run(
    model: Annotated[str, typer.Argument(help="Model: a .gguf file, a model folder, or a "
                                         "name such as smollm2:135m.")],
    prompt: Annotated[str | None, typer.Argument(help="The prompt (default: read stdin).")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print the Completion as JSON "
                                           "(text, finish_reason, usage, timings, info).")] = False,
    raw: Annotated[bool, typer.Option("--raw", help="Complete the text as is, without the "
                                      "chat template.")] = False,
    max_tokens: o.MaxTokens = None,
    temperature: o.Temperature = None,
    top_p: o.TopP = None,
    top_k: o.TopK = None,
    min_p: o.MinP = None,
    repetition_penalty: o.RepPenalty = None,
    seed: o.Seed = None,
    stop: o.Stop = None,
    system: o.System = None,
    context: o.Context = None,
    backend: o.Backend = "auto",
    allow_unoptimized: o.AllowUnoptimized = False,
    base_url: o.BaseUrl = None,
    api_key: o.ApiKey = None,
    vllm_python: o.VllmPython = None,
    schema: o.SchemaFile = None,
    json_object: o.JsonObject = False,
) -> None:
    """Answer one prompt and exit; the reply streams to stdout.

    --schema FILE / --json-object make the reply JSON (enforced by the engine); --json
    prints the whole Completion as JSON (with "parsed" when a schema was given).

    Examples:

      localrun run smollm2:135m "What is 2+2?"

      echo "Name three primary colours." | localrun run smollm2:135m --temperature 0

      localrun run ./model.gguf "Hi" --json

      localrun run smollm2:135m "Ann is 31 and lives in Oslo." --schema person.json
    """
    from localrun.cli._input import CONVERT, check_text, read_stdin
    from localrun.errors import LocalrunError

    convert = f"{CONVERT} FILE | localrun run {model}"
    if prompt is None:
        if sys.stdin.isatty():
            raise LocalrunError("No prompt given",
                                hint=f"localrun run {model} \"your question\", or pipe it on stdin")
        prompt = read_stdin(hint=f"convert it first: {convert}")
    else:
        check_text("The prompt", prompt, hint=f"pass UTF-8 text, or pipe it: {convert}")
    if system is not None:
        check_text("--system", system, hint="pass UTF-8 text")
    if not prompt.strip():
        raise LocalrunError("The prompt is empty", hint=f"localrun run {model} \"your question\"")
    sampling = o.sampling_kwargs(max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                                 top_k=top_k, min_p=min_p, repetition_penalty=repetition_penalty,
                                 seed=seed, stop=stop)
    from localrun.api import make_sampling  # validate flags before loading anything

    make_sampling(**sampling)
    structured = o.structured_kwargs(schema, json_object)
    with o.load_model(model, backend, context, allow_unoptimized,
                      base_url=base_url, api_key=api_key, vllm_python=vllm_python) as m:
        if raw:
            if system:
                raise LocalrunError("--system has no meaning with --raw",
                                    hint="drop one of them")
            stream = m.stream(prompt, raw=True, **structured, **sampling)
        else:
            messages = ([{"role": "system", "content": system}] if system else []) + [
                {"role": "user", "content": prompt}]
            stream = m.stream(messages, **structured, **sampling)
        with stream:
            if json_out:
                completion = stream.join()
                out = completion.to_dict()
                out["info"] = m.info.to_dict()
                sys.stdout.write(json.dumps(out, indent=2) + "\n")
                return
            for chunk in stream:
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
            sys.stdout.write("\n")
            stream.join()  # a JSON reply cut short by --max-tokens is an error, not a reply


def register(app: typer.Typer) -> None:
    app.command("run")(run)
