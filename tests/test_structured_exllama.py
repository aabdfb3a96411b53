"""Constrained decoding on ExLlamaV2/V3 (issue 13), against fakes built from the engines'
source (both need CUDA to import; exllamav2 0.3.2 and exllamav3 1.6.5 unpacked):

- ExLlamaV2: localrun's ``ExLlamaV2Filter`` subclass is driven exactly as
  ``ExLlamaV2Sampler.sample`` drives a filter that ``can_mask_logits`` (generator/
  sampler.py: ``get_next(mask=True)`` -> ``prepare_logit_mask``, then ``mask_logits`` on
  the flat logits; ``DynamicJob.receive_sample`` -> ``feed(next_token)`` with the token
  as a (1, 1) tensor) over random logits and the SmolLM2 tokenizer: every reply must be
  the schema's JSON.
- ExLlamaV3: the job gets the engine's own ``LLGuidanceFilter`` (generator/filter/
  llguidance.py) with localrun's compiled grammar and ``eos_after_completed=True``.
"""

from __future__ import annotations

import json
import shutil
import sys
import types
from concurrent.futures import Future
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from localrun.backends.base import Prompt
from localrun.errors import ConstrainedDecodingUnavailableError, UnsupportedSchemaError
from localrun.sampling import FALLBACK
from localrun.structured.constraint import Constraint
from localrun.structured.schema import closed_objects
from tests.models import test_model
from tests.test_exllama import _model_folder, _v2_session, _v3_session

GiB = 1024**3
SCHEMA = closed_objects({
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8},
                   "tags": {"type": "array", "maxItems": 2, "items": {"enum": ["a", "b"]}},
                   "n": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["name", "tags", "n"]})
CONSTRAINT = Constraint.json(SCHEMA, "JSON Schema 'test'")


class ExLlamaV2Filter:
    """exllamav2/generator/filters/base.py (0.3.2), the parts a subclass relies on."""

    allow_return_type_list = True

    def __init__(self, model: Any, tokenizer: Any) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.sequence_str = ""
        self.background_result: Future[Any] | None = None

    def use_background_worker(self) -> bool:
        return False

    def can_mask_logits(self) -> bool:
        return False

    def get_next(self, mask: bool = False) -> Any:
        if self.background_result is None:
            return self.prepare_logit_mask() if mask else self.next()  # type: ignore
        r = self.background_result.result()
        self.background_result = None
        return r


class Token:
    """The (1, 1) tensor ``receive_sample`` feeds to filters."""

    def __init__(self, value: int) -> None:
        self.value = value

    def item(self) -> int:
        return self.value


@pytest.fixture()
def folder(tmp_path: Path) -> Path:
    """A fake model folder with SmolLM2's real tokenizer.json (llguidance reads it)."""
    f = _model_folder(tmp_path / "m")
    shutil.copy(test_model("hf") / "tokenizer.json", f / "tokenizer.json")
    return f


def _install_filters(monkeypatch: pytest.MonkeyPatch) -> None:
    import numpy as np

    filters = types.ModuleType("exllamav2.generator.filters")
    filters.ExLlamaV2Filter = ExLlamaV2Filter  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "exllamav2.generator.filters", filters)
    torch = sys.modules["torch"]
    monkeypatch.setattr(torch, "from_numpy", np.asarray, raising=False)


def test_v2_filter_constrains_every_sampled_token(folder: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    import numpy as np

    session, made = _v2_session(monkeypatch, folder, [24 * GiB])
    _install_filters(monkeypatch)
    session.check_constraint(CONSTRAINT)
    sampling = replace(FALLBACK, constraint=CONSTRAINT)
    vocab = 49152
    tokenizer = session._grammar.compiler().tokenizer
    rng = np.random.default_rng(0)
    for trial in range(10):
        job = session.make_job(Prompt([1, 2, 3]), replace(sampling, max_tokens=64), trial)
        (flt,) = job.kwargs["filters"]
        assert flt.can_mask_logits() and flt.use_background_worker()
        assert flt.model is made["model"]
        flt.begin("")  # DynamicJob: f.begin("") when new_tokens == 0
        out: list[int] = []
        for _ in range(64):
            assert flt.get_next(mask=True) is True
            logits = rng.normal(size=vocab).astype(np.float32) * 4
            logits = flt.mask_logits(logits)
            token = int(np.argmax(logits))
            if token in session._stop:
                break
            flt.feed(Token(token))
            out.append(token)
        else:
            pytest.fail("the grammar never let the job end")
        text = tokenizer.decode_str(out)
        data = json.loads(text)
        assert set(data) == {"name", "tags", "n"} and 0 <= data["n"] <= 9, text
    # where the sampler cannot mask (CFG), it asks for the allowed set instead
    flt.begin("")
    allowed, end = flt.next()
    assert allowed and 2 not in allowed and end == set()
    assert all('{"name": '.startswith(tokenizer.decode_str([t])) for t in allowed)


def test_v2_unconstrained_jobs_get_no_filter(folder: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    session, _ = _v2_session(monkeypatch, folder, [24 * GiB])
    plain = replace(FALLBACK, max_tokens=8)
    assert "filters" not in session.make_job(Prompt([1]), plain, 0).kwargs
    with pytest.raises(UnsupportedSchemaError, match="on exllamav2"):
        session.check_constraint(Constraint.json({"type": "array", "uniqueItems": True}))


def test_v3_jobs_get_the_engines_llguidance_filter(folder: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    import llguidance

    session, _ = _v3_session(monkeypatch, folder, [24 * GiB])
    made: list[dict[str, Any]] = []

    class LLGuidanceFilter:
        def __init__(self, tokenizer: Any, **kw: Any) -> None:
            made.append({"tokenizer": tokenizer, **kw})

    filt = types.ModuleType("exllamav3.generator.filter")
    filt.LLGuidanceFilter = LLGuidanceFilter  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "exllamav3.generator", types.ModuleType("x"))
    monkeypatch.setitem(sys.modules, "exllamav3.generator.filter", filt)
    session.check_constraint(CONSTRAINT)
    job = session.make_job(Prompt([1]), replace(FALLBACK, constraint=CONSTRAINT, max_tokens=64),
                           0)
    assert len(job.kwargs["filters"]) == 1 and len(made) == 1
    kw = made[0]
    assert kw["tokenizer"] is session._tokenizer and kw["eos_after_completed"] is True
    # the grammar is llguidance's, valid for this model's tokenizer
    tok = session._grammar.compiler().tokenizer
    assert llguidance.LLMatcher.validate_grammar(kw["llg_grammar"], tok) == ""
    plain = replace(FALLBACK, max_tokens=8)
    assert "filters" not in session.make_job(Prompt([1]), plain, 1).kwargs


def test_v3_without_llguidance_filter_is_a_typed_error(folder: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    session, _ = _v3_session(monkeypatch, folder, [24 * GiB])
    monkeypatch.setitem(sys.modules, "exllamav3.generator", types.ModuleType("x"))
    monkeypatch.setitem(sys.modules, "exllamav3.generator.filter",
                        types.ModuleType("exllamav3.generator.filter"))  # an older release
    with pytest.raises(ConstrainedDecodingUnavailableError, match="LLGuidanceFilter"):
        session.make_job(Prompt([1]), replace(FALLBACK, constraint=CONSTRAINT, max_tokens=8),
                         0)


def test_no_tokenizer_json_is_a_typed_error(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    session, _ = _v2_session(monkeypatch, _model_folder(tmp_path / "m"), [24 * GiB])
    with pytest.raises(ConstrainedDecodingUnavailableError, match=r"tokenizer\.json"):
        session.check_constraint(CONSTRAINT)
