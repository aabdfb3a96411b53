"""find_cycle: a reply stuck in a short loop is spotted; ordinary text is not."""

from __future__ import annotations

import pytest

from localrun.repetition import MIN_CHARS, MIN_REPEATS, Cycle, find_cycle, strip_cycle

#: What the embedded SmolLM2-135M said to "What is the capital of France?" (issue 11).
FEMME = "The capital of France is Paris, known as " + "la Femme, " * 40


def test_the_loop_from_the_issue_is_found() -> None:
    c = find_cycle(FEMME)
    assert c is not None
    assert len(c.unit) == 10 and set(c.unit) == set("la Femme, ")  # some rotation of it
    assert c.repeats >= 38  # every whole repeat at the end is counted


def test_found_as_soon_as_it_is_long_enough() -> None:
    """Streamed a piece at a time, the loop is caught at 12 repeats (120 chars), not 40."""
    text = "Paris is the capital. "
    first = None
    for i in range(40):
        text += "la Femme, "
        if find_cycle(text) is not None:
            first = i + 1
            break
    assert first == max(MIN_REPEATS, -(-MIN_CHARS // 10))


@pytest.mark.parametrize("text", [
    "",
    "The capital of France is Paris.",
    "Ha ha ha, that is funny!",
    "Title\n" + "=" * 60 + "\n",  # a rule under a heading
    "| a | b |\n|---|---|\n| 1 | 2 |\n",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23",
    "def f():\n    pass\n\n\ndef g():\n    pass\n",
    "- Paris\n- Lyon\n- Marseille\n- Toulouse\n- Nice\n- Nantes\n- Strasbourg\n",
    "[0, 0, 0, 0],\n" * 4,  # a small zero matrix: repeats, but few times
    "No! " * 7,
])
def test_ordinary_text_is_not_a_loop(text: str) -> None:
    assert find_cycle(text) is None


@pytest.mark.parametrize("unit", ["a", "ab", "\n", "I am a robot. ", "- Paris\n",
                                  "The sun rises in the east and sets in the west, and the moon "
                                  "follows it across the night sky. "])
def test_loops_of_any_unit_length_up_to_the_limit(unit: str) -> None:
    repeats = max(MIN_REPEATS, -(-MIN_CHARS // len(unit)))
    text = "Some start. " + unit * repeats
    c = find_cycle(text)
    assert c == Cycle(unit, repeats)
    assert find_cycle("Some start. " + unit * (repeats - 1)) is None


def test_the_shortest_unit_is_reported() -> None:
    assert find_cycle("x" + "ab" * 100) == Cycle("ab", 100)


def test_a_unit_longer_than_max_period_is_not_looked_for() -> None:
    unit = "".join(chr(65 + i % 26) for i in range(30)) + " "
    assert find_cycle(unit * 10, max_period=20) is None
    assert find_cycle(unit * 10, max_period=40) == Cycle(unit, 10)


def test_a_loop_that_ended_is_not_reported() -> None:
    assert find_cycle(FEMME + "And that is all there is to say about it.") is None


def test_strip_cycle_keeps_one_unit() -> None:
    text = "Intro. " + "la Femme, " * 20
    c = find_cycle(text)
    assert c is not None
    stripped = strip_cycle(text, c)
    assert stripped.startswith("Intro. ") and len(stripped) == len(text) - 19 * 10
    assert find_cycle(stripped) is None


def test_bad_limits_are_refused() -> None:
    with pytest.raises(ValueError):
        find_cycle("aaaa", min_repeats=1)
    with pytest.raises(ValueError):
        find_cycle("aaaa", max_period=0)
