"""localrun chat [MODEL]: an interactive chat, replies streamed as they are generated."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
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
  /image PATH    attach an image file to your next message (a vision model)
  /exit          leave (or Ctrl-D)
Multi-line input: end a line with \\ to continue it, or wrap the text in \"\"\" lines.
Ctrl-C stops the reply being generated (/stats then says "cancelled"); keys typed
while a reply streams start the next line. Ctrl-C at the prompt clears the line."""


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


def _stats_line(c: Any, stopped: str | None = None) -> str:
    """/stats: the last reply's numbers; ``stopped`` says who cut it short."""
    t = c.timings
    finish = f"{c.finish_reason} ({stopped})" if stopped else c.finish_reason
    return (f"{c.usage.prompt_tokens} prompt + {c.usage.completion_tokens} reply tokens · "
            f"TTFT {t.ttft * 1000:.0f} ms · prefill {t.prefill_tps:.0f} tok/s · "
            f"decode {t.decode_tps:.1f} tok/s · {t.total:.2f} s · finish: {finish}")


def _stats(last: tuple[Any, str | None] | None) -> str:
    if last is None:
        return "No reply yet."
    completion, stopped = last
    if completion is None:
        return f"The last reply was cancelled ({stopped}) before the engine reported its numbers."
    return _stats_line(completion, stopped)


def _header(m: Any, name: str | None) -> str:
    """The model as the user named it (the embedded one by its alias, not the file's own
    general.name), then the engine, format and context."""
    from localrun.naming.stores import DEFAULT_MODEL_ALIAS

    i = m.info
    quant = f" {i.quantization}" if i.quantization else ""
    shown = name or (DEFAULT_MODEL_ALIAS if _is_embedded(m) else i.name or i.path)
    return (f"{shown} · {i.backend} {i.engine_version} · "
            f"{i.format}{quant} · context {i.context_length}")


def _is_embedded(m: Any) -> bool:
    from pathlib import Path

    from localrun.resolve import default_model_path_or_none

    embedded = default_model_path_or_none()
    return embedded is not None and Path(m.info.path).resolve() == embedded


@dataclass
class _Reply:
    """A reply as it streams: its text, the line to show if it was cut short, and
    whether the loop guard or Ctrl-C stopped it."""

    text: str = ""
    note: str | None = None
    looped: bool = False
    interrupted: bool = False


#: Characters of a looping unit quoted in the note (a sentence can be long).
NOTE_UNIT_CHARS = 60


def _quoted(unit: str) -> str:
    return repr(unit if len(unit) <= NOTE_UNIT_CHARS else unit[:NOTE_UNIT_CHARS] + "…")


@contextlib.contextmanager
def _ctrl_c_cancels(stream: Any, reply: _Reply) -> Iterator[None]:
    """While a reply streams, Ctrl-C cancels it: the stream then ends by itself with
    ``finish_reason="cancelled"`` and its usage and timings (for /stats). A second
    Ctrl-C, if the engine has not stopped yet, interrupts as usual."""
    import signal

    def cancel(signum: int, frame: Any) -> None:
        if reply.interrupted:
            raise KeyboardInterrupt
        reply.interrupted = True
        stream.cancel()

    try:
        previous = signal.signal(signal.SIGINT, cancel)
    except ValueError:  # not the main thread: Ctrl-C raises KeyboardInterrupt as before
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _print_reply(stream: Any, reply: _Reply) -> None:
    """Stream a reply to stdout; cancel it once it is stuck repeating a phrase or a
    sentence (:func:`localrun.structured.repetition.find_cycle`).

    ``reply.text`` keeps a cut-off cycle once, so the conversation does not teach the
    model its own loop; it holds what was shown so far if Ctrl-C interrupts (the pieces
    the engine still sends before it stops are not shown).
    """
    from localrun.structured.repetition import find_cycle, strip_cycle

    # a thinking model's thinking: dimmed before the answer in a terminal, else on stderr
    # (stdout keeps the answer alone); never kept in the conversation
    tty = sys.stdout.isatty()
    think_out = sys.stdout if tty else sys.stderr
    thinking = False
    for chunk in stream:
        if reply.note is not None or reply.interrupted:  # cancelled: wait for the last chunk
            continue
        if chunk.reasoning:
            if not thinking:
                think_out.write("\x1b[2m" if tty else "")
                thinking = True
            think_out.write(chunk.reasoning)
            think_out.flush()
            continue
        if thinking:
            think_out.write("\x1b[0m\n\n" if tty else "\n")
            thinking = False
        sys.stdout.write(chunk.text)
        sys.stdout.flush()
        reply.text += chunk.text
        if chunk.text and (cycle := find_cycle(reply.text)) is not None:
            stream.cancel()
            reply.looped = True
            reply.text = strip_cycle(reply.text, cycle)
            reply.note = (f"stopped: the reply was repeating {_quoted(cycle.unit)} "
                          f"({cycle.repeats} times in a row)")
    if thinking:
        think_out.write("\x1b[0m\n" if tty else "\n")
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
    adapter: o.AdapterOpt = None,
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
    stuck repeating a phrase or a sentence is stopped, with a note on stderr.
    Keys typed while a reply streams are not echoed into it: they start the next
    input line.

    Examples:

      localrun chat

      localrun chat smollm2:135m --system "Answer in one sentence."

      localrun chat ./model.gguf --adapter ./style-lora.gguf

      echo "What is the capital of France?" | localrun chat
    """
    from localrun.cli._input import CONVERT, bad_byte_message, check_text, read_stdin
    from localrun.cli._typeahead import TypeAhead, clear_prefill, prefill
    from localrun.errors import ContextOverflowError, LocalrunError
    from localrun.images import ImagesUnsupportedError, read_image

    options = sampling.kwargs()
    structured = prompting.structured()
    options.update(prompting.thinking())
    template = prompting.template()
    convert = f"convert it first: {CONVERT} FILE | localrun chat"
    prompting.check_system()
    adapters = o.read_adapters(adapter)  # checked before any input is read
    interactive = sys.stdin.isatty()
    if not interactive:
        text = read_stdin(hint=convert)
        if not text.strip():
            raise LocalrunError("No input on stdin", hint='echo "your question" | localrun chat')

    with loading.load(model, remote, chat_template=template, adapters=adapters) as m:
        if "max_tokens" not in options and _is_embedded(m):
            options["max_tokens"] = EMBEDDED_CHAT_MAX_TOKENS
        history: list[dict[str, Any]] = []
        pending: list[Any] = []  # /image: images for the next message
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
        last: tuple[Any, str | None] | None = None  # the last reply's Completion; who cut it
        with contextlib.suppress(ImportError):
            import readline  # noqa: F401  (line editing and history for input())
        typed = ""  # keys typed while the last reply streamed: the next line starts with them
        while True:
            try:
                prefill(typed)
                typed = ""
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
            finally:
                clear_prefill()
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
                    sys.stderr.write(_stats(last) + "\n")
                elif cmd == "/image":
                    try:
                        pending.append(read_image(arg.strip(), f"/image {arg.strip()}"))
                        im = pending[-1]
                        sys.stderr.write(f"Image attached ({im.format.upper()}, {im.width}x"
                                         f"{im.height}): it goes with your next message.\n")
                    except LocalrunError as e:
                        sys.stderr.write(f"error: {e.message}\n  hint: {e.hint}\n")
                else:
                    sys.stderr.write(f"Unknown command {cmd}; /help lists them.\n")
                continue
            history.append({"role": "user", "content": message,
                            **({"images": pending} if pending else {})})
            pending = []
            stream = m.stream(conversation(), **structured, **options)
            reply = _Reply()
            keys = TypeAhead()
            try:
                with keys, _ctrl_c_cancels(stream, reply):
                    _print_reply(stream, reply)
                if reply.interrupted:
                    sys.stdout.write(" [stopped]")
                last = (stream.completion, "Ctrl-C" if reply.interrupted
                        else "it was repeating itself" if reply.looped else None)
            except KeyboardInterrupt:  # a second Ctrl-C: the engine had not stopped yet
                stream.close()
                sys.stdout.write(" [stopped]")
                last = (None, "Ctrl-C")
            except ContextOverflowError as e:
                history.pop()
                sys.stderr.write(f"error: {e.message}\n  hint: /reset to start over\n")
                continue
            except ImagesUnsupportedError as e:  # the message is dropped, the chat goes on
                history.pop()
                sys.stderr.write(f"error: {e.message}\n  hint: {e.hint}\n")
                continue
            finally:
                stream.close()
                typed = keys.text
            sys.stdout.write("\n")
            if reply.note:
                _dim(reply.note)
            history.append({"role": "assistant", "content": reply.text})


def register(app: typer.Typer) -> None:
    app.command("chat")(chat)


