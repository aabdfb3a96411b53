from __future__ import annotations

from localrun.driver.stopping import StopMatcher


def run(pieces: list[str], stops: list[str]) -> tuple[str, bool]:
    m = StopMatcher(stops)
    out = []
    for p in pieces:
        text, hit = m.feed(p)
        out.append(text)
        if hit:
            return "".join(out), True
    out.append(m.flush())
    return "".join(out), False


def test_no_stops_passes_through() -> None:
    assert run(["a", "b"], []) == ("ab", False)


def test_stop_inside_one_piece() -> None:
    assert run(["Hello. World"], ["."]) == ("Hello", True)


def test_stop_split_across_pieces() -> None:
    assert run(["one END", "ING", "<|e", "nd|> more"], ["<|end|>"]) == ("one ENDING", True)


def test_partial_prefix_released_when_it_does_not_match() -> None:
    assert run(["abc<|", "x"], ["<|end|>"]) == ("abc<|x", False)


def test_earliest_of_several_stops_wins() -> None:
    assert run(["x", "yz STOP then END"], ["END", "STOP"]) == ("xyz ", True)


def test_held_text_is_not_emitted_early() -> None:
    m = StopMatcher(["###"])
    assert m.feed("ab#") == ("ab", False)
    assert m.feed("#") == ("", False)
    assert m.feed("c") == ("##c", False)
