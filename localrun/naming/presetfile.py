'''The preset file read by ``localrun create NAME -f FILE``: an Ollama Modelfile's fields.

::

    # a comment
    FROM qwen2.5:7b                      # required: a model name, a path, or a preset
    SYSTEM """
    You are a careful reviewer.
    Answer in three bullet points.
    """
    PARAMETER temperature 0.2            # one per line; stop may repeat
    PARAMETER stop "<|endoftext|>"
    PARAMETER num_ctx 16384              # Ollama's name; localrun's is context
    ADAPTER ./style-lora.gguf:0.5        # PATH[:SCALE]
    MESSAGE user Is 7 a prime?           # example turns that open every chat
    MESSAGE assistant - Yes.

Instructions are case-insensitive, one per line. A value is the rest of the line, or a
JSON string (``"a\\tb"``), or text between triple quotes, which may span lines (one
newline right after the opening quotes and one right before the closing ones are not
part of it). Relative paths (FROM, ADAPTER) are relative to the file's folder.

PARAMETER takes localrun's names and Ollama's for the same things: ``temperature``,
``top_p``, ``top_k``, ``min_p``, ``repetition_penalty`` (``repeat_penalty``), ``seed``,
``stop``, ``max_tokens`` (``num_predict``), ``context`` (``num_ctx``), ``backend``,
``allow_unoptimized``. Anything else (TEMPLATE, LICENSE, Ollama parameters localrun has
no equivalent for, an unknown word) is refused with its line number: TEMPLATE because
localrun always renders the model's own chat template (Jinja, from its files), which a
Go template cannot replace.
'''

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from localrun.naming.presets import Adapter, Preset, PresetError, parse_adapter

#: PARAMETER name -> (the preset field or sampling option, the value's type)
PARAMETERS: dict[str, tuple[str, type]] = {
    "temperature": ("temperature", float), "top_p": ("top_p", float),
    "top_k": ("top_k", int), "min_p": ("min_p", float),
    "repetition_penalty": ("repetition_penalty", float),
    "repeat_penalty": ("repetition_penalty", float),
    "seed": ("seed", int), "stop": ("stop", str),
    "max_tokens": ("max_tokens", int), "num_predict": ("max_tokens", int),
    "context": ("context", int), "num_ctx": ("context", int),
    "backend": ("backend", str), "allow_unoptimized": ("allow_unoptimized", bool),
}
#: Why an instruction of Ollama's Modelfile is not taken (the others are unknown words).
REFUSED = {
    "template": "localrun renders the model's own chat template (from its files); leave "
                "TEMPLATE out",
    "license": "a preset keeps no license text; leave LICENSE out",
    "requires": "leave REQUIRES out (localrun checks what a model needs when it loads)",
}
INSTRUCTIONS = ("FROM", "SYSTEM", "PARAMETER", "ADAPTER", "MESSAGE")
_BOOLS = {"true": True, "false": False, "1": True, "0": False, "yes": True, "no": False}


class PresetFileError(PresetError):
    """A preset file that cannot be read: the file, the line and why."""

    def __init__(self, path: str, line: int, reason: str, *, hint: str | None = None):
        self.path = path
        self.line = line
        self.reason = reason
        super().__init__(f"{path} line {line}: {reason}", hint=hint or (
            "a preset file takes FROM, SYSTEM, PARAMETER, ADAPTER and MESSAGE lines "
            "(see localrun create --help)"))


@dataclass
class PresetSpec:
    """What a file says, before :func:`localrun.naming.presets.make` checks it as a whole."""

    model: str | None = None
    system: str | None = None
    sampling: dict[str, Any] = field(default_factory=dict)
    context: int | None = None
    backend: str | None = None
    allow_unoptimized: bool = False
    adapters: list[Adapter] = field(default_factory=list)
    messages: list[tuple[str, str]] = field(default_factory=list)


def read(path: str | Path) -> PresetSpec:
    """Parse the preset file at ``path``; PresetFileError names the line."""
    p = Path(path).expanduser()
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        why = e.strerror if isinstance(e, OSError) and e.strerror else type(e).__name__
        raise PresetError(f"Cannot read the preset file {path}: {why}",
                          hint="pass a UTF-8 text file: localrun create NAME -f FILE") from None
    return parse(text, str(path), base=p.resolve().parent)


def parse(text: str, source: str = "<preset>", *, base: Path | None = None) -> PresetSpec:
    """Parse preset file text (``base``: the folder relative paths start from)."""
    lines = text.splitlines()
    spec = PresetSpec()
    seen: dict[str, int] = {}  # instruction or parameter -> its first line
    i = 0
    while i < len(lines):
        number = i + 1
        stripped = lines[i].strip()
        i += 1
        if not stripped or stripped.startswith("#"):
            continue
        word, rest = [*stripped.split(None, 1), ""][:2]
        key = word.lower()
        if key in REFUSED:
            raise PresetFileError(source, number, f"{word} is not supported: {REFUSED[key]}")
        if word.upper() not in INSTRUCTIONS:
            raise PresetFileError(source, number, f"unknown instruction {word!r}")
        arg = ""
        if key in ("parameter", "message"):
            arg, rest = [*rest.split(None, 1), ""][:2]
            if not arg:
                raise PresetFileError(source, number, f"{word} needs a name and a value")
        value, i = _value(rest.strip(), lines, i, source, number)
        if key in ("from", "system") or (key == "parameter" and arg.lower() != "stop"):
            once = PARAMETERS.get(arg.lower(), (arg.lower(),))[0] if arg else key
            if once in seen:
                what = f"{word} {arg}" if arg else word
                raise PresetFileError(source, number, f"{what} again (first on line "
                                      f"{seen[once]})")
            seen[once] = number
        _apply(spec, key, arg, value, source, number, base)
    if spec.model is None:
        raise PresetFileError(source, max(1, len(lines)), "no FROM line",
                              hint="name the model first: FROM qwen2.5:7b (or a path, or "
                              "another preset)")
    return spec


def _value(rest: str, lines: list[str], i: int, source: str, number: int
           ) -> tuple[str, int]:
    """The value starting at ``rest``, and the index of the next line to read."""
    if rest.startswith('"""'):
        body = rest[3:]
        parts: list[str] = []
        while '"""' not in body:
            parts.append(body)
            if i >= len(lines):
                raise PresetFileError(source, number, 'the """ opened here is never closed')
            body = lines[i]
            i += 1
        end = body.index('"""')
        if body[end + 3:].strip():
            raise PresetFileError(source, i if parts else number,
                                  'text after the closing """')
        parts.append(body[:end])
        value = "\n".join(parts)
        value = value[1:] if value.startswith("\n") else value
        return (value[:-1] if value.endswith("\n") else value), i
    if rest.startswith('"'):
        try:
            value = json.loads(rest)
        except ValueError:
            raise PresetFileError(source, number, f"{rest[:40]} is not a closed JSON string",
                                  hint='escape quotes inside it: "say \\"hi\\"", or use '
                                  '"""triple quotes"""') from None
        if not isinstance(value, str):
            raise PresetFileError(source, number, "a quoted value must be one string")
        return value, i
    return rest, i


def _apply(spec: PresetSpec, key: str, arg: str, value: str, source: str, number: int,
           base: Path | None) -> None:
    if key == "from":
        if not value:
            raise PresetFileError(source, number, "FROM names no model")
        spec.model = _path(value, base, only_if_there=True)
    elif key == "system":
        spec.system = value
    elif key == "adapter":
        if not value:
            raise PresetFileError(source, number, "ADAPTER names no file")
        try:
            a = parse_adapter(value)
        except PresetError as e:
            raise PresetFileError(source, number, e.message) from None
        spec.adapters.append(Adapter(_path(a.path, base, only_if_there=False), a.scale, a.name))
    elif key == "message":
        role = arg.lower()
        if role not in ("user", "assistant"):
            raise PresetFileError(source, number, f"MESSAGE role {arg!r}: use user or "
                                  "assistant (the system prompt is SYSTEM)")
        spec.messages.append((role, value))
    else:
        _parameter(spec, arg, value, source, number)


def _parameter(spec: PresetSpec, name: str, value: str, source: str, number: int) -> None:
    from localrun.sampling import make_sampling

    known = PARAMETERS.get(name.lower())
    if known is None:
        raise PresetFileError(source, number, f"unknown PARAMETER {name!r}", hint=(
            "localrun takes " + ", ".join(sorted(PARAMETERS))))
    target, kind = known
    try:
        if kind is bool:
            if value.lower() not in _BOOLS:
                raise ValueError
            typed: Any = _BOOLS[value.lower()]
        else:
            typed = kind(value)
    except ValueError:
        what = {int: "an integer", float: "a number", bool: "true or false"}.get(kind, "text")
        raise PresetFileError(source, number, f"PARAMETER {name} takes {what}, not "
                              f"{value!r}") from None
    if target == "context":
        if typed < 16:
            raise PresetFileError(source, number, f"PARAMETER {name} {typed}: a context "
                                  "is 16 tokens or more")
        spec.context = typed
    elif target == "backend":
        spec.backend = typed
    elif target == "allow_unoptimized":
        spec.allow_unoptimized = typed
    elif target == "stop":
        if not typed:
            raise PresetFileError(source, number, "PARAMETER stop needs a string")
        spec.sampling.setdefault("stop", []).append(typed)
    else:
        try:
            make_sampling(**{target: typed})
        except PresetError:
            raise
        except Exception as e:  # InvalidSamplingError: the option, the value, the range
            raise PresetFileError(source, number, str(getattr(e, "message", e))) from None
        spec.sampling[target] = typed


def _path(value: str, base: Path | None, *, only_if_there: bool) -> str:
    """A relative path taken from the file's folder; a name left as it is (FROM: a
    relative path only when it starts with ./ or ../, or is there)."""
    p = Path(value).expanduser()
    if base is None or p.is_absolute():
        return str(p) if value.startswith("~") else value
    candidate = base / p
    explicit = value.startswith(("./", "../", ".\\", "..\\"))
    if not only_if_there or explicit or candidate.exists():
        return str(candidate)
    return value


# -- writing ------------------------------------------------------------------------------

def _quote(text: str) -> str:
    plain = (text and text == text.strip() and not text.startswith('"')
             and all(c.isprintable() for c in text))
    if plain:
        return text
    if "\n" in text and '"""' not in text:
        return '"""\n' + text + '\n"""'
    return json.dumps(text, ensure_ascii=False)


def format_preset(p: Preset) -> str:
    """``p`` as a preset file that :func:`parse` reads back into the same preset."""
    lines = [f"# localrun preset {p.name} (localrun create {p.name} -f THIS_FILE)",
             f"FROM {_quote(p.model)}"]
    if p.system is not None:
        lines.append(f"SYSTEM {_quote(p.system)}")
    for key, value in p.sampling.items():
        for v in (value if key == "stop" else (value,)):
            lines.append(f"PARAMETER {key} {_quote(str(v))}")
    if p.context is not None:
        lines.append(f"PARAMETER context {p.context}")
    if p.backend is not None:
        lines.append(f"PARAMETER backend {p.backend}")
    if p.allow_unoptimized:
        lines.append("PARAMETER allow_unoptimized true")
    lines += [f"ADAPTER {_quote(a.display)}" for a in p.adapters]
    lines += [f"MESSAGE {role} {_quote(content)}" for role, content in p.messages]
    return "\n".join(lines) + "\n"


__all__ = ["INSTRUCTIONS", "PARAMETERS", "PresetFileError", "PresetSpec", "format_preset",
           "parse", "read"]
