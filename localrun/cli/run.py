"""localrun run MODEL [PROMPT]: answer once and exit."""

from __future__ import annotations

import json
import sys
from typing import Annotated, Any

import typer

from localrun.cli import options as o


@o.with_groups
def run(
    model: Annotated[str, typer.Argument(help="Model: a .gguf file, a model folder, or a "
                                         "name such as smollm2:135m.")],
    prompt: Annotated[str | None, typer.Argument(help="The prompt (default: read stdin).")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print the Completion as JSON "
                                           "(text, finish_reason, usage, timings, info).")] = False,
    raw: Annotated[bool, typer.Option("--raw", help="Complete the text as is, without the "
                                      "chat template.")] = False,
    images: Annotated[list[str] | None, typer.Option(
        "--image", help="An image file to send with the prompt (PNG, JPEG, WebP or GIF; "
        "repeat for several). Needs a vision model: a GGUF with its mmproj beside it, or "
        "an OpenVINO VLM.", show_default=False)] = None,
    adapter: o.AdapterOpt = None,
    *,
    sampling: o.SamplingFlags,
    prompting: o.PromptFlags,
    loading: o.LoadingFlags,
    remote: o.RemoteFlags,
) -> None:
    """Answer one prompt and exit; the reply streams to stdout.

    --schema FILE / --json-object make the reply JSON (enforced by the engine); --json
    prints the whole Completion as JSON (with "parsed" when a schema was given).

    Examples:

      localrun run smollm2:135m "What is 2+2?"

      echo "Name three primary colours." | localrun run smollm2:135m --temperature 0

      localrun run ./model.gguf "Hi" --json

      localrun run smollm2:135m "Ann is 31 and lives in Oslo." --schema person.json

      localrun run ./qwen2.5-vl.gguf "Describe this." --image photo.png

      localrun run ./model.gguf "Hi" --adapter ./style-lora.gguf:0.5
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
    prompting.check_system()
    if not prompt.strip():
        raise LocalrunError("The prompt is empty", hint=f"localrun run {model} \"your question\"")
    if images and raw:
        raise LocalrunError("--image needs the chat template", hint="drop --raw")
    pictures = _read_images(images)  # checked before loading anything
    adapters = o.read_adapters(adapter)
    options = sampling.kwargs()
    structured = prompting.structured()
    thinking = prompting.thinking()
    template = prompting.template()
    system = prompting.system
    with loading.load(model, remote, chat_template=template, adapters=adapters) as m:
        if raw:
            if system:
                raise LocalrunError("--system has no meaning with --raw",
                                    hint="drop one of them")
            stream = m.stream(prompt, raw=True, **structured, **thinking, **options)
        else:
            messages = ([{"role": "system", "content": system}] if system else []) + [
                {"role": "user", "content": prompt, **({"images": pictures} if pictures
                                                       else {})}]
            stream = m.stream(messages, **structured, **thinking, **options)
        with stream:
            if json_out:
                completion = stream.join()
                out = completion.to_dict()
                out["info"] = m.info.to_dict()
                sys.stdout.write(json.dumps(out, indent=2) + "\n")
                return
            thought = False
            for chunk in stream:
                if chunk.reasoning:  # the thinking: stderr, dimmed where it is a terminal
                    thought = True
                    dim = sys.stderr.isatty()
                    sys.stderr.write(f"\x1b[2m{chunk.reasoning}\x1b[0m" if dim
                                     else chunk.reasoning)
                    sys.stderr.flush()
                    continue
                if thought and chunk.text:
                    sys.stderr.write("\n")
                    thought = False
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
            sys.stdout.write("\n")
            stream.join()  # a JSON reply cut short by --max-tokens is an error, not a reply


def _read_images(paths: list[str] | None) -> list[Any]:
    """Each --image file, read and checked now (an ImageError names the bad one)."""
    from localrun.images import read_image

    return [read_image(p, f"--image {p}") for p in paths or ()]


def register(app: typer.Typer) -> None:
    app.command("run")(run)
