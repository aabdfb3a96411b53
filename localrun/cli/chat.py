"""localrun chat [MODEL]: an interactive chat, replies streamed as they are generated."""

from __future__ import annotations

import contextlib
import sys
from typing import Any

import typer

from localrun.cli import options as o

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


def chat(
    model: o.ModelArg = None,
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
) -> None:
    """Chat with a model in the terminal (default: the embedded SmolLM2-135M).

    Type /help inside the chat for its commands. When stdin is not a terminal,
    the whole input is one message: it is answered once and chat exits.

    Examples:

      localrun chat

      localrun chat smollm2:135m --system "Answer in one sentence."

      echo "What is the capital of France?" | localrun chat
    """
    from localrun.api import make_sampling
    from localrun.errors import ContextOverflowError, LocalrunError

    sampling = o.sampling_kwargs(max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                                 top_k=top_k, min_p=min_p, repetition_penalty=repetition_penalty,
                                 seed=seed, stop=stop)
    make_sampling(**sampling)
    interactive = sys.stdin.isatty()
    if not interactive:
        text = sys.stdin.read()
        if not text.strip():
            raise LocalrunError("No input on stdin", hint='echo "your question" | localrun chat')

    with o.load_model(model, backend, context, allow_unoptimized) as m:
        history: list[dict[str, str]] = []
        system_prompt = system

        def conversation() -> list[Any]:
            head = [{"role": "system", "content": system_prompt}] if system_prompt else []
            return head + history

        if not interactive:
            history.append({"role": "user", "content": text})
            with m.stream(conversation(), **sampling) as stream:
                for chunk in stream:
                    sys.stdout.write(chunk.text)
                    sys.stdout.flush()
            sys.stdout.write("\n")
            return

        sys.stderr.write(o.header(m, model) + "\n")
        sys.stderr.write("Type /help for commands, Ctrl-D to exit.\n")
        last = None
        with contextlib.suppress(ImportError):
            import readline  # noqa: F401  (line editing and history for input())
        while True:
            try:
                message = _read_message()
            except KeyboardInterrupt:
                sys.stderr.write("\n")
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
            stream = m.stream(conversation(), **sampling)
            parts: list[str] = []
            try:
                for chunk in stream:
                    parts.append(chunk.text)
                    sys.stdout.write(chunk.text)
                    sys.stdout.flush()
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
            history.append({"role": "assistant", "content": "".join(parts)})


def register(app: typer.Typer) -> None:
    app.command("chat")(chat)


