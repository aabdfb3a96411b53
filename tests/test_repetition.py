"""find_cycle: a reply stuck in a loop (a short phrase, or a whole sentence) is spotted;
ordinary text, even text that repeats its structure, is not."""

from __future__ import annotations

import re

import pytest

from localrun.structured.repetition import (
    MAX_PERIOD,
    MIN_CHARS,
    MIN_REPEATS,
    Cycle,
    find_cycle,
    repeats_needed,
    strip_cycle,
)

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
    repeats = repeats_needed(len(unit))
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


# -- a whole sentence said over and over (issue 25) ------------------------------------------

#: A sentence of about 20 tokens, as SmolLM2-135M repeats one in a story it cannot finish.
SENTENCE = ("The knight raised his sword and the dragon roared, filling the valley with fire "
            "and smoke. ")


def _pieces(text: str) -> list[str]:
    """``text`` split as an engine streams it: a word (with its leading space) at a time."""
    return re.findall(r"\s*\S+", text) + ([text[len(text.rstrip()):]] if text[-1:].isspace()
                                          else [])


def test_a_20_token_sentence_repeated_7_times_is_stopped() -> None:
    intro = "Once upon a time, in a kingdom far away, a young knight set out to find a dragon. "
    text, caught_at = "", None
    for piece in _pieces(intro + SENTENCE * 7):
        text += piece
        c = find_cycle(text)
        if c is not None:
            caught_at = text
            break
    assert caught_at is not None, "a sentence repeated 7 times was not caught"
    assert c is not None and c.unit.strip() in SENTENCE + SENTENCE  # the sentence (a rotation)
    assert len(c.unit) == len(SENTENCE) and c.repeats >= 5
    assert caught_at.count("dragon roared") < 7  # stopped before the 7th repeat was written
    kept = strip_cycle(caught_at, c)
    assert kept.count("dragon roared") == 1 and find_cycle(kept) is None


def test_two_sentences_taking_turns_are_a_loop() -> None:
    pair = "I love the sea. It is blue and calm and full of fish that swim all day long. "
    c = find_cycle("Hello. " + pair * 5)
    assert c == Cycle(pair, 5)


def test_a_sentence_said_four_times_is_not_yet_a_loop() -> None:
    assert find_cycle("Intro. " + SENTENCE * 4) is None


#: Prose, a list, code and a table: each repeats words or structure, none its characters.
VARIED = [
    "The dragon lived in a cave above the village. Every winter it flew down to steal "
    "sheep, and every spring the villagers rebuilt their fences. One year a young knight "
    "arrived. She did not fight the dragon; she asked it why it was hungry. The dragon "
    "said the mountain goats had gone, and the knight promised to bring them back. She "
    "kept her word, and the dragon never came down again.",
    "".join(f"- Step {i}: stir the sauce for {i} minutes, then taste it and add salt.\n"
            for i in range(1, 12)),
    "".join(f"    if x == {i}:\n        return numbers[{i}]  # the {i}th entry\n"
            for i in range(12)),
    "| name | value | unit |\n|------|-------|------|\n" + "".join(
        f"| sample {i} | {i * 3.5:.1f} | grams |\n" for i in range(12)),
    "Repeat after me: I will practise every day. I will practise every day, said Tom. "
    "I will practise every day, said Anna. And so they did.",
    ("[" + ", ".join(["0"] * 20) + "],\n") * 6,  # a wide zero matrix: long rows, no letters
]


@pytest.mark.parametrize("text", VARIED)
def test_text_with_repeated_structure_is_not_a_loop(text: str) -> None:
    streamed = ""
    for piece in _pieces(text):
        streamed += piece
        assert find_cycle(streamed) is None, streamed[-200:]


class _Watched(str):
    """A str that counts the characters find_cycle slices out of it, and the earliest
    index it reads."""

    sliced = 0
    first = 1 << 62

    def __getitem__(self, key: object) -> str:  # type: ignore[override]
        out = str.__getitem__(self, key)  # type: ignore[index]
        if isinstance(key, slice):
            _Watched.sliced += len(out)
            start = key.indices(len(self))[0]
            _Watched.first = min(_Watched.first, start)
        return out


def _cost(text: str) -> tuple[int, int]:
    """(characters sliced, how far from the end the earliest read was) for one call."""
    _Watched.sliced, _Watched.first = 0, 1 << 62
    assert find_cycle(_Watched(text)) is None
    return _Watched.sliced, len(text) - _Watched.first


def test_a_call_costs_the_same_on_a_short_and_a_long_text() -> None:
    """The cost per streamed token does not grow with the reply: only the end of the text
    is read, the same characters whatever came before."""
    filler = "".join(f"Line {i} of a long reply. " for i in range(40_000))  # ~1 MB
    short, long = filler[-4000:] + VARIED[0], filler + VARIED[0]  # the same last 4 kB
    assert len(long) > 1000 * MAX_PERIOD
    assert _cost(long) == _cost(short)
    sliced, reach = _cost(long)
    assert reach <= MAX_PERIOD * MIN_REPEATS
    assert sliced < 40 * MAX_PERIOD  # about one PROBE-sized look per period
