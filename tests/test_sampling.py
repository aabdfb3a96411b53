from __future__ import annotations

import math

import pytest

from localrun.errors import InvalidSamplingError
from localrun.sampling import FALLBACK, make_sampling, resolve
from localrun.types import Sampling


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("temperature", -0.1), ("temperature", math.nan), ("temperature", "hot"),
        ("top_p", 0.0), ("top_p", 1.5), ("top_k", -1), ("top_k", 2.5), ("min_p", 1.0),
        ("min_p", -0.1), ("repetition_penalty", 0), ("max_tokens", 0), ("max_tokens", True),
        ("seed", -1), ("seed", 2**32), ("stop", [""]), ("stop", 5), ("bogus", 1),
    ],
)
def test_invalid_values_raise_typed_error(option: str, value: object) -> None:
    with pytest.raises(InvalidSamplingError) as info:
        make_sampling(**{option: value})
    assert info.value.option == option
    assert "allowed" in str(info.value)
    assert isinstance(info.value, ValueError)


def test_valid_values_are_kept() -> None:
    s = make_sampling(temperature=0, top_p=1, top_k=0, min_p=0.0, repetition_penalty=1.1,
                      seed=7, max_tokens=3, stop="\n")
    assert s == Sampling(max_tokens=3, temperature=0.0, top_p=1.0, top_k=0, min_p=0.0,
                         repetition_penalty=1.1, seed=7, stop=("\n",))


def test_precedence_caller_then_model_then_fallback() -> None:
    model = {"temperature": 0.3, "top_k": 20, "top_p": 0.9}
    r = resolve(make_sampling(top_k=5), model)
    assert r.top_k == 5  # caller wins
    assert r.temperature == 0.3 and r.top_p == 0.9  # model's own defaults
    assert r.min_p == FALLBACK.min_p and r.repetition_penalty == FALLBACK.repetition_penalty
    assert r.max_tokens == FALLBACK.max_tokens


def test_unreadable_model_defaults_are_ignored() -> None:
    r = resolve(Sampling(), {"top_k": -1, "temperature": "x"})
    assert r.top_k == FALLBACK.top_k and r.temperature == FALLBACK.temperature


def test_fallback_filters_are_neutral() -> None:
    # Engines' own defaults (llama.cpp min_p 0.05, top_k 40) must never leak through.
    assert (FALLBACK.top_k, FALLBACK.top_p, FALLBACK.min_p, FALLBACK.repetition_penalty) == (
        0, 1.0, 0.0, 1.0)
