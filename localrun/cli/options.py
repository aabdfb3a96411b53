"""Command-line options declared once, in groups that every command shares.

A group is a frozen dataclass whose fields are typer options. A command takes the whole
group as one keyword parameter (``sampling: o.SamplingFlags``) and is wrapped in
:func:`with_groups`, which spreads the group's fields into the signature typer reads and
gathers the parsed values back into the dataclass for the call. So a flag's name, default,
help text and ``--help`` heading are written here once, and every command that takes a
group offers exactly the same flags (tests/test_cli_options.py holds them to that).
"""

from __future__ import annotations

import dataclasses
import inspect
import typing
from collections.abc import Callable
from copy import copy
from pathlib import Path
from typing import Annotated, Any, ClassVar

import typer

from localrun.errors import LocalrunError
from localrun.hardware.profile import profile_names

ModelArg = Annotated[
    str | None,
    typer.Argument(help="Model: a .gguf file, a model folder, or a name such as smollm2:135m "
                   "(default: the embedded SmolLM2-135M-Instruct)."),
]
#: Also taken alone by `pull`, whose other engine flags are its own (under the same heading).
Context = Annotated[int | None, typer.Option(
    "--context", "-c", help="Context window in tokens (default: the model's, up to 8192).",
    rich_help_panel="Model loading")]
#: `run`, `chat` and `create` (serve's --lora takes the same form).
AdapterOpt = Annotated[list[str] | None, typer.Option(
    "--adapter", help="A LoRA adapter to load with the model, [NAME=]PATH[:SCALE] (repeat "
    "for several; scale 1 = as trained): a GGUF file on llama.cpp, an mlx-lm folder on "
    "MLX, a PEFT folder on vLLM.", show_default=False)]
#: Also taken by `bench`, beside its own engine flags.
Exact = Annotated[bool, typer.Option(
    "--exact", help="Replies that do not depend on what ran before (greedy replies the same "
    "alone or batched, with a warm or cold cache), at some speed: README, \"Speed\". "
    "Default: the engine's fastest.", rich_help_panel="Model loading")]


@dataclasses.dataclass(frozen=True)
class OptionGroup:
    """Base of the option groups; ``panel`` is the ``--help`` heading of their flags."""

    panel: ClassVar[str]

    @classmethod
    def options(cls) -> dict[str, Any]:
        """Each field's ``Annotated[type, typer.Option]``, under the group's heading."""
        hints = typing.get_type_hints(cls, include_extras=True)
        out: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            base, info = typing.get_args(hints[f.name])
            info = copy(info)  # typer copies it again per command; the original stays bare
            info.rich_help_panel = cls.panel
            out[f.name] = Annotated[base, info]
        return out


@dataclasses.dataclass(frozen=True)
class SamplingFlags(OptionGroup):
    """How each reply is sampled: one flag per localrun sampling option."""

    panel: ClassVar[str] = "Sampling"

    max_tokens: Annotated[int | None, typer.Option(
        "--max-tokens", "-n", help="Most tokens to generate (default 1024; 256 per reply in "
        "chat with the embedded model).")] = None
    temperature: Annotated[float | None, typer.Option(
        "--temperature", "-t",
        help="0 = greedy; higher = more varied (default: the model's own, else 0.7).")] = None
    top_p: Annotated[float | None, typer.Option(
        "--top-p", help="Nucleus sampling, 0 < p <= 1 (1 = off).")] = None
    top_k: Annotated[int | None, typer.Option(
        "--top-k", help="Keep the k most likely tokens (0 = off).")] = None
    min_p: Annotated[float | None, typer.Option(
        "--min-p", help="Drop tokens below p x the top probability (0 = off).")] = None
    repetition_penalty: Annotated[float | None, typer.Option(
        "--repetition-penalty", help="Penalize repeated tokens (1 = off).")] = None
    seed: Annotated[int | None, typer.Option(
        "--seed", help="Seed for reproducible sampling.")] = None
    stop: Annotated[list[str] | None, typer.Option(
        "--stop", help="Stop at this string (repeatable); it is not printed.")] = None

    def kwargs(self) -> dict[str, Any]:
        """The options the user set, checked now so a bad flag fails before any load."""
        from localrun.sampling import make_sampling

        out = {k: v for k, v in dataclasses.asdict(self).items() if v is not None}
        if "stop" in out and not out["stop"]:
            del out["stop"]
        make_sampling(**out)
        return out


@dataclasses.dataclass(frozen=True)
class PromptFlags(OptionGroup):
    """The system prompt and the shape the reply must have."""

    panel: ClassVar[str] = "Prompt and reply"

    system: Annotated[str | None, typer.Option("--system", "-s", help="System prompt.")] = None
    schema: Annotated[Path | None, typer.Option(
        "--schema", help="Reply with JSON matching this JSON Schema file, enforced by "
        "constrained decoding.")] = None
    json_object: Annotated[bool, typer.Option(
        "--json-object", help="Reply with one JSON object (any keys), enforced by "
        "constrained decoding.")] = False
    think: Annotated[bool | None, typer.Option(
        "--think/--no-think", help="A thinking model (Qwen3, DeepSeek-R1, ...) thinks, or "
        "answers at once (default: its template's own choice). The thinking goes to "
        "stderr, dimmed; the answer to stdout.")] = None
    thinking_budget: Annotated[int | None, typer.Option(
        "--thinking-budget", help="Most tokens of thinking: at N the thinking is closed and "
        "the answer follows (0 = no thinking). --max-tokens counts both.",
        min=0)] = None
    reasoning_effort: Annotated[str | None, typer.Option(
        "--reasoning-effort", help="Thinking budget by name: none, minimal (256 tokens), "
        "low (1024), medium (4096), high (no budget of its own).")] = None
    chat_template: Annotated[Path | None, typer.Option(
        "--chat-template", help="Render conversations with this Jinja chat template file "
        "instead of the model's own.")] = None

    def thinking(self) -> dict[str, Any]:
        """``think``/``thinking_budget``/``reasoning_effort`` as given, checked now."""
        from localrun.reasoning import reasoning_request

        out = {k: v for k, v in (("think", self.think),
                                 ("thinking_budget", self.thinking_budget),
                                 ("reasoning_effort", self.reasoning_effort)) if v is not None}
        reasoning_request(**out)
        return out

    def template(self) -> str | None:
        """The --chat-template file's source, read and checked before any model loads."""
        if self.chat_template is None:
            return None
        from localrun.api import read_template

        return read_template(self.chat_template)

    def check_system(self) -> None:
        if self.system is not None:
            from localrun.cli._input import check_text

            check_text("--system", self.system, hint="pass UTF-8 text")

    def structured(self) -> dict[str, Any]:
        """``schema=``/``response_format=`` for ``--schema FILE`` / ``--json-object``, read
        and checked before any model loads."""
        import json

        if self.schema is not None and self.json_object:
            raise LocalrunError("--schema and --json-object both say what the reply is",
                                hint="pass one of them (--schema FILE already means JSON)")
        if self.json_object:
            return {"response_format": {"type": "json_object"}}
        if self.schema is None:
            return {}
        try:
            value = json.loads(self.schema.read_text(encoding="utf-8"))
        except OSError as e:
            raise LocalrunError(f"Cannot read --schema {self.schema}: {e.strerror or e}",
                                hint="pass the path of a JSON Schema file") from e
        except (ValueError, UnicodeDecodeError) as e:
            raise LocalrunError(f"--schema {self.schema} is not JSON: {e}",
                                hint="the file must hold one JSON Schema object") from e
        from localrun.structured.output import prepare

        prepare(schema=value)  # a malformed or unenforceable schema fails here, not mid-load
        return {"schema": value}


@dataclasses.dataclass(frozen=True)
class LoadingFlags(OptionGroup):
    """Which engine loads the model, and how."""

    panel: ClassVar[str] = "Model loading"

    context: Context = None
    backend: Annotated[str, typer.Option(
        "--backend", "-b", help="Engine: auto, llama.cpp, mlx, exllamav2, exllamav3, openvino, "
        "onnx, vllm, remote.")] = "auto"
    allow_unoptimized: Annotated[bool, typer.Option(
        "--allow-unoptimized",
        help="Let an engine load a format it runs without its optimized kernels.")] = False
    speculative: Annotated[str | None, typer.Option(
        "--speculative", help="Speculative decoding: auto (default where the engine has "
        "it: on only where it wins), prompt-lookup, draft (with --draft-model), off.")] = None
    draft_model: Annotated[str | None, typer.Option(
        "--draft-model", help="A smaller model with the same tokenizer that drafts tokens "
        "for speculative decoding (a path or a name).")] = None
    exact: Exact = False

    def no_speculation(self, command: str) -> None:
        """Refuse --speculative/--draft-model on a command that loads no model with them
        (one line, naming the commands that do)."""
        from localrun.errors import LocalrunError

        flag = "--draft-model" if self.draft_model is not None else \
            "--speculative" if self.speculative is not None else None
        if flag is not None:
            raise LocalrunError(f"{command} does not take {flag}",
                                hint="speculative decoding is set where a model is loaded: "
                                     "localrun run/chat/generate MODEL " + flag + " ...")

    def load(self, model: str | None, remote: RemoteFlags | None = None,
             chat_template: str | None = None, adapters: Any = None) -> Any:
        """Load for a command: explain a Hub plan and show download progress on stderr,
        and turn the "runs without optimized kernels" warning into one line."""
        import sys
        import warnings

        from rich.console import Console

        from localrun.api import load
        from localrun.cli._download import DownloadBar, print_plan
        from localrun.cli._startup import StartupLine
        from localrun.errors import UnoptimizedFormatWarning

        backend, engine_options = (remote or RemoteFlags()).resolve(self.backend)
        console = Console(stderr=True, highlight=False)

        def on_plan(plan: Any, fetch_plan: Any) -> None:
            if fetch_plan.download_bytes:
                console.print(f"[bold]Engine[/]: {plan.backend} on {plan.device}")
                print_plan(console, fetch_plan)

        with warnings.catch_warnings(record=True) as caught, DownloadBar(console) as bar, \
                StartupLine(console) as startup:
            warnings.simplefilter("always", UnoptimizedFormatWarning)
            model_obj = load(model, backend=backend, context=self.context,
                             allow_unoptimized=self.allow_unoptimized, on_plan=on_plan,
                             progress=bar.report, chat_template=chat_template,
                             on_startup=startup.report, adapters=adapters,
                             speculative=self.speculative, draft_model=self.draft_model,
                             exact=self.exact,
                             **engine_options)
        for w in caught:
            if issubclass(w.category, UnoptimizedFormatWarning):
                sys.stderr.write(f"warning: {w.message}\n")
        return model_obj


@dataclasses.dataclass(frozen=True)
class RemoteFlags(OptionGroup):
    """Engines that run outside this process: a server, or vLLM in its own environment."""

    panel: ClassVar[str] = "Model loading"

    base_url: Annotated[str | None, typer.Option(
        "--base-url", envvar="LOCALRUN_BASE_URL",
        help="An OpenAI-compatible server to run on (vLLM, SGLang, localrun serve), e.g. "
        "http://host:8000/v1; implies --backend remote.")] = None
    api_key: Annotated[str | None, typer.Option(
        "--api-key", envvar="LOCALRUN_REMOTE_API_KEY",
        help="Key for --base-url's server (sent as a Bearer token). Not LOCALRUN_API_KEY: that one is the key 'localrun serve' asks of its own clients.")] = None
    vllm_python: Annotated[str | None, typer.Option(
        "--vllm-python", envvar="LOCALRUN_VLLM_PYTHON",
        help="Python of the environment vLLM is installed in (--backend vllm).")] = None

    def resolve(self, backend: str) -> tuple[str, dict[str, Any]]:
        """The backend and engine options --base-url / --api-key / --vllm-python mean."""
        opts: dict[str, Any] = {}
        if self.base_url:
            if backend not in ("auto", "remote"):
                raise LocalrunError(f"--base-url runs on a server, not on --backend {backend}",
                                    hint="drop --backend, or use --backend remote")
            backend = "remote"
            opts["base_url"] = self.base_url
            if self.api_key:
                opts["api_key"] = self.api_key
        if self.vllm_python and backend == "vllm":
            opts["vllm_python"] = self.vllm_python
        return backend, opts


@dataclasses.dataclass(frozen=True)
class DownloadFlags(OptionGroup):
    """What to plan and download for: the quant, and another machine."""

    panel: ClassVar[str] = "Download"

    quant: Annotated[str | None, typer.Option(
        "--quant", "-q", help="Quant to plan for and download: Q4_K_M, 4bit, int4, 4.0bpw, "
        "…")] = None
    hardware: Annotated[str | None, typer.Option(
        "--hardware", help="Plan for another machine: a JSON file as printed by 'localrun doctor --json', or the name of an example machine: " + ", ".join(profile_names()) + ".")] = None

    def profile(self) -> Any:
        """The described machine (a HardwareProfile), or None for this one."""
        if not self.hardware:
            return None
        from localrun.hardware import HardwareProfile

        return HardwareProfile.find(self.hardware)


def read_adapters(values: list[str] | None) -> tuple[Any, ...] | None:
    """--adapter (--lora) values, each checked before anything loads: the file is there,
    the scale in range, the names unique (:func:`localrun.adapters.normalize`); None
    without any (a preset's own adapters then load)."""
    if not values:
        return None
    from localrun.adapters import normalize

    return normalize(values)


#: Every group, for the tests that hold commands to them.
GROUPS: tuple[type[OptionGroup], ...] = (SamplingFlags, PromptFlags, LoadingFlags,
                                         RemoteFlags, DownloadFlags)


def with_groups(func: Callable[..., None]) -> Callable[..., None]:
    """Let typer see each group parameter of ``func`` as the group's own flags.

    Every parameter becomes keyword-only in the signature typer reads (typer passes
    keywords; the groups' fields take a group's place, in its order). The wrapper keeps
    ``__cli_groups__`` (parameter name -> group) for the tests.
    """
    groups: dict[str, type[OptionGroup]] = {}
    params: list[inspect.Parameter] = []
    for p in inspect.signature(func, eval_str=True).parameters.values():
        group = p.annotation
        if not (isinstance(group, type) and issubclass(group, OptionGroup)):
            params.append(p.replace(kind=inspect.Parameter.KEYWORD_ONLY))
            continue
        groups[p.name] = group
        defaults = {f.name: f.default for f in dataclasses.fields(group)}
        params += [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY,
                                     default=defaults[name], annotation=hint)
                   for name, hint in group.options().items()]
    names = [p.name for p in params]
    clash = sorted({n for n in names if names.count(n) > 1})
    if clash:  # two groups, or a group and the command, would fight over one parameter
        raise TypeError(f"{func.__qualname__}: parameter {clash[0]!r} is declared twice")
    fields = {name: [f.name for f in dataclasses.fields(g)]
              for name, g in groups.items()}

    def command(**kwargs: Any) -> None:
        for name, group in groups.items():
            kwargs[name] = group(**{f: kwargs.pop(f) for f in fields[name]})
        func(**kwargs)

    for attr in ("__module__", "__name__", "__qualname__", "__doc__"):
        setattr(command, attr, getattr(func, attr))
    command.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    command.__annotations__ = {p.name: p.annotation for p in params}
    command.__cli_groups__ = groups  # type: ignore[attr-defined]
    return command
