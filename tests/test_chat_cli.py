"""`localrun chat` with the embedded model: a reply stuck in a loop is stopped (issue 11).

The embedded SmolLM2-135M answers "What is the capital of France?" with a sentence and
then, often, one phrase over and over ("la Femme, la Femme, ...") up to the token
limit. These tests find such a reply through the Python API (which keeps the model's
raw behaviour), then run the same generation (same seed) through the real CLI and
check that chat cut it short where the loop became plain, and said so.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from typing import Any

import pytest

from localrun.structured.repetition import find_cycle
from tests.conftest import localrun_cmd, requires_llama

pytestmark = [pytest.mark.slow, requires_llama]

#: As `echo "..." | localrun chat` sends them: the line with its newline.
QUESTION = "What is the capital of France?\n"
STORY = "Write a long story about a dragon and a knight.\n"
SEEDS = range(12)


@pytest.fixture(scope="module")
def embedded() -> Iterator[Any]:
    """The embedded model loaded as `localrun chat` loads it (default context)."""
    import localrun

    with localrun.load() as m:
        yield m


def _until_loop(m: Any, prompt: str, seed: int) -> tuple[str, bool] | None:
    """The text streamed up to where a loop became plain, and whether the API went on
    generating after it; None if the reply never looped within 256 tokens."""
    text = ""
    with m.stream(prompt, seed=seed, max_tokens=256) as stream:
        for chunk in stream:
            text += chunk.text
            if chunk.text and find_cycle(text) is not None:
                more = next(stream)  # the API does not stop a loop: the raw behaviour
                return text, bool(more.text) and more.finish_reason is None
    return None


def _chat(prompt: str, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*localrun_cmd(), "chat", *args], input=prompt,
                          capture_output=True, text=True, timeout=300, env=env)


def test_chat_stops_a_reply_stuck_in_a_loop(embedded: Any, clean_env: dict[str, str]) -> None:
    found = None
    for seed in SEEDS:  # as in the issue: the model's own sampling, seed by seed
        looped = _until_loop(embedded, QUESTION, seed)
        if looped is not None:
            found = seed, *looped
            break
    assert found is not None, f"no seed in {SEEDS} made the embedded model loop"
    seed, cut, api_went_on = found
    assert api_went_on
    r = _chat(QUESTION, clean_env, "--seed", str(seed))
    assert r.returncode == 0, r.stderr
    assert r.stdout == cut + "\n"  # the same reply, cut where the loop became plain
    notes = r.stderr.strip().splitlines()
    assert len(notes) == 1 and notes[0].startswith("stopped: the reply was repeating ")
    assert "times in a row" in notes[0]


def test_embedded_model_chat_reply_limit(embedded: Any, clean_env: dict[str, str]) -> None:
    """Without --max-tokens, chat caps the embedded model's replies at 256 tokens (the
    API's limit stays 1,024), and says so when a reply reaches it."""
    found = None
    for seed in SEEDS:
        c = embedded.chat(STORY, seed=seed, max_tokens=256)
        if c.finish_reason == "length" and find_cycle(c.text) is None:
            found = seed, c.text
            break
    assert found is not None, f"no seed in {SEEDS} gave a story longer than 256 tokens"
    seed, first_256 = found
    # The API's own limit is untouched: the same generation goes on past 256 tokens.
    with embedded.stream(STORY, seed=seed) as stream:
        text = ""
        for chunk in stream:
            text += chunk.text
            if len(text) > len(first_256) + 20:
                break
    assert text.startswith(first_256) and len(text) > len(first_256) + 20
    r = _chat(STORY, clean_env, "--seed", str(seed))
    assert r.returncode == 0, r.stderr
    assert r.stdout == first_256 + "\n"
    assert "reached the 256-token limit; --max-tokens N allows longer replies" in r.stderr
    # --max-tokens is the user's word: no cap of chat's own.
    r = _chat(STORY, clean_env, "--seed", str(seed), "--max-tokens", "264")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(first_256) and len(r.stdout) > len(first_256) + 1
