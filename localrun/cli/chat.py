"""localrun chat [MODEL]: an interactive chat, replies streamed as they are generated."""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass
from typing import Any

import typer

from localrun.cli import options as o

#: The reply limit in chat for the embedded SmolLM2-135M when --max-tokens is not given.
#: Measured: of 16 replies to 8 everyday questions (2 seeds each), the 12 that ended did
#: so within 182 tokens; the other 4 ran to the general limit (1,024), 3 of them stuck
#: repeating one phrase. Past ~200 tokens it has nothing left to say.
EMBEDDED_CHAT_MAX_TOKENS = 256

HELP = """\
Commands:
  /help          show this help
  /reset         forget the conversation (keeps the system prompt)
  /system TEXT   set the system prompt and start over
  /stats         tokens, time to first token and speed of the last reply
  /exit          leave (or Ctrl-D)
Multi-line input: end a line with \\ to continue it, or wrap the text in \"\"\" lines.
Ctrl-C stops the reply being generated; Ctrl-C at the prompt clears the line."""


def _read_message() -> str | None:
    """Read one user message; None at end of input (Ctrl-D)."""
    try:
        line = input(">>> ")
    except EOFError:
        return None
    if line.strip() == '"""':
        lines: list[str] = []
        while True:
            try:
                part = input("... ")
            except EOFError:
                break
            if part.strip() == '"""':
                break
            lines.append(part)
        return "\n".join(lines)
    parts = []
    while line.endswith("\\"):
        parts.append(line[:-1])
        try:
            line = input("... ")
        except EOFError:
            line = ""
            break
    parts.append(line)
    return "\n".join(parts)


def _stats_line(c: Any) -> str:
    t = c.timings
    return (f"{c.usage.prompt_tokens} prompt + {c.usage.completion_tokens} reply tokens · "
            f"TTFT {t.ttft * 1000:.0f} ms · prefill {t.prefill_tps:.0f} tok/s · "
            f"decode {t.decode_tps:.1f} tok/s · {t.total:.2f} s · finish: {c.finish_reason}")


def _header(m: Any, name: str | None) -> str:
    i = m.info
    quant = f" {i.quantization}" if i.quantization else ""
    return (f"{name or i.name or i.path} · {i.backend} {i.engine_version} · "
            f"{i.format}{quant} · context {i.context_length}")


def _is_embedded(m: Any) -> bool:
    from pathlib import Path

    from localrun.resolve import default_model_path_or_none

    embedded = default_model_path_or_none()
    return embedded is not None and Path(m.info.path).resolve() == embedded


@dataclass
class _Reply:
    """A reply as it streams: its text, and the line to show if it was cut short."""

    text: str = ""
    note: str | None = None


def _print_reply(stream: Any, reply: _Reply) -> None:
    """Stream a reply to stdout; cancel it once it is stuck repeating a short cycle.

    ``reply.text`` keeps a cut-off cycle once, so the conversation does not teach the
    model its own loop; it holds what was shown so far if Ctrl-C interrupts.
    """
    from localrun.repetition import find_cycle, strip_cycle

    for chunk in stream:
        if reply.note is not None:  # cancelled: only the last chunk (usage, timings) is left
            continue
        sys.stdout.write(chunk.text)
        sys.stdout.flush()
        reply.text += chunk.text
        if chunk.text and (cycle := find_cycle(reply.text)) is not None:
            stream.cancel()
            reply.text = strip_cycle(reply.text, cycle)
            reply.note = (f"stopped: the reply was repeating {cycle.unit!r} "
                          f"({cycle.repeats} times in a row)")
    c = stream.completion
    if reply.note is None and c is not None and c.finish_reason == "length":
        reply.note = (f"the reply reached the {c.usage.completion_tokens}-token limit; "
                      "--max-tokens N allows longer replies")


def _dim(line: str) -> None:
    """One dim line on stderr, after the reply's own line."""
    from rich.console import Console
    from rich.markup import escape

    sys.stdout.flush()
    Console(stderr=True, highlight=False, soft_wrap=True).print(f"[dim]{escape(line)}[/]")


@o.with_groups
def chat(
    model: o.ModelArg = None,
    *,
    sampling: o.SamplingFlags,
    prompting: o.PromptFlags,
    loading: o.LoadingFlags,
    remote: o.RemoteFlags,
) -> None:
    """Chat with a model in the terminal (default: the embedded SmolLM2-135M).

    --schema FILE / --json-object make every reply JSON (enforced by the engine).

    Type /help inside the chat for its commands. When stdin is not a terminal,
    the whole input is one message: it is answered once and chat exits. A reply
    stuck repeating a short phrase is stopped, with a note on stderr.

    Examples:

      localrun chat

      localrun chat smollm2:135m --system "Answer in one sentence."

      echo "What is the capital of France?" | localrun chat
    """
    from localrun.cli._input import CONVERT, bad_byte_message, check_text, read_stdin
    from localrun.errors import ContextOverflowError, LocalrunError

    options = sampling.kwargs()
    structured = prompting.structured()
    convert = f"convert it first: {CONVERT} FILE | localrun chat"
    prompting.check_system()
    interactive = sys.stdin.isatty()
    if not interactive:
        text = read_stdin(hint=convert)
        if not text.strip():
            raise LocalrunError("No input on stdin", hint='echo "your question" | localrun chat')

    with loading.load(model, remote) as m:
        if "max_tokens" not in options and _is_embedded(m):
            options["max_tokens"] = EMBEDDED_CHAT_MAX_TOKENS
        history: list[dict[str, str]] = []
        system_prompt = prompting.system

        def conversation() -> list[Any]:
            head = [{"role": "system", "content": system_prompt}] if system_prompt else []
            return head + history

        if not interactive:
            history.append({"role": "user", "content": text})
            reply = _Reply()
            with m.stream(conversation(), **structured, **options) as stream:
                _print_reply(stream, reply)
            sys.stdout.write("\n")
            if reply.note:
                _dim(reply.note)
            return

        sys.stderr.write(_header(m, model) + "\n")
        sys.stderr.write("Type /help for commands, Ctrl-D to exit.\n")
        last = None
        with contextlib.suppress(ImportError):
            import readline  # noqa: F401  (line editing and history for input())
        while True:
            try:
                message = _read_message()
                if message is not None:
                    check_text("That message", message, hint="type it again")
            except KeyboardInterrupt:
                sys.stderr.write("\n")
                continue
            except UnicodeDecodeError as e:  # the terminal sent bytes that are not UTF-8
                sys.stderr.write(f"error: {bad_byte_message('That message', e.object, e.start)}"
                                 "\n  hint: type it again\n")
                continue
            except LocalrunError as e:
                sys.stderr.write(f"error: {e.message}\n  hint: {e.hint}\n")
                continue
            if message is None:
                sys.stderr.write("\n")
                return
            stripped = message.strip()
            if not stripped:
                continue
            if stripped.startswith("/"):
                cmd, _, arg = stripped.partition(" ")
                if cmd in ("/exit", "/quit", "/bye"):
                    return
                if cmd == "/help":
                    sys.stderr.write(HELP + "\n")
                elif cmd == "/reset":
                    history.clear()
                    sys.stderr.write("Conversation cleared.\n")
                elif cmd == "/system":
                    system_prompt = arg.strip() or None
                    history.clear()
                    sys.stderr.write("System prompt set; conversation cleared.\n"
                                     if system_prompt else "System prompt removed.\n")
                elif cmd == "/stats":
                    sys.stderr.write((_stats_line(last) if last else "No reply yet.") + "\n")
                else:
                    sys.stderr.write(f"Unknown command {cmd}; /help lists them.\n")
                continue
            history.append({"role": "user", "content": message})
            stream = m.stream(conversation(), **structured, **options)
            reply = _Reply()
            try:
                _print_reply(stream, reply)
                last = stream.completion
            except KeyboardInterrupt:
                stream.close()
                sys.stdout.write(" [stopped]")
            except ContextOverflowError as e:
                history.pop()
                sys.stderr.write(f"error: {e.message}\n  hint: /reset to start over\n")
                continue
            finally:
                stream.close()
            sys.stdout.write("\n")
            if reply.note:
                _dim(reply.note)
            history.append({"role": "assistant", "content": reply.text})


def register(app: typer.Typer) -> None:
    app.command("chat")(chat)


