"""Sampling options reach every engine and mean the same there (README: "Sampling
options mean the same on every engine").

Each installed CPU engine runs its SmolLM2-135M fixture (the cases of
tests/test_conformance.py). A filter pushed to its limit must give greedy decoding;
a repetition penalty must break a loop; a seed must fix the text; the model's own
defaults (GGUF ``general.sampling.*``, generation_config.json) and its model card's
(catalog.json, for SmolLM2: temperature 0.2, top_p 0.9) must be what a call without
options runs with, in any file of the model. Replies are kept short (MLX decodes
about 5 tokens/s on a 2-core CPU).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import localrun
from localrun.formats.detect import detect
from localrun.naming import catalog, identity, stores
from tests.hubserver import gguf_bytes
from tests.models import test_model
from tests.test_conformance import CASES, IDS, _skip_unless_installed

CONTEXT = 512
MAX = 12
PROMPT = "Tell me about cats."
SEED = 5
#: SmolLM2-135M-Instruct's model card: generate(..., temperature=0.2, top_p=0.9)
CARD = {"temperature": 0.2, "top_p": 0.9}
#: Where a Hub download of the model lives in the Hugging Face cache (what names it
#: for fixtures whose files carry no model name: OpenVINO IR and ONNX GenAI folders)
HUB_DIR = ("models--HuggingFaceTB--SmolLM2-135M-Instruct", "snapshots", "0" * 40)
NAMELESS = ("openvino-int4", "onnx-int4")


def as_hub_download(src: Path, root: Path) -> Path:
    """``src`` laid out as a download in the Hugging Face cache (symlinks, no copy)."""
    snap = root.joinpath(*HUB_DIR)
    snap.mkdir(parents=True)
    if src.is_file():
        (snap / src.name).symlink_to(src)
        return snap / src.name
    (snap / src.name).mkdir()
    for f in src.iterdir():
        (snap / src.name / f.name).symlink_to(f)
    return snap / src.name


@pytest.fixture(scope="module", params=CASES, ids=IDS)
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
         ) -> Iterator[tuple[str, str, Any]]:
    """(backend, fixture, Model), each loaded once. The OpenVINO and ONNX fixtures name
    no model in their files, so they are loaded from where a Hub download would be."""
    backend, fixture = request.param
    _skip_unless_installed(backend)
    path = test_model(fixture)
    if fixture in NAMELESS:
        path = as_hub_download(path, tmp_path_factory.mktemp(fixture))
    with localrun.load(str(path), backend=backend, context=CONTEXT,
                       exact=True) as model:
        yield backend, fixture, model


_texts: dict[tuple[int, str], str] = {}


def gen(model: Any, prompt: str = PROMPT, *, raw: bool = False, **sampling: Any) -> str:
    """The reply's text, generated once per (model, prompt, options) in this module."""
    sampling.setdefault("max_tokens", MAX)
    key = (id(model), json.dumps([prompt, raw, sampling], sort_keys=True))
    if key not in _texts:
        call = model.complete if raw else model.chat
        _texts[key] = call(prompt, **sampling).text
    return _texts[key]


# -- filters at their limit are greedy decoding ----------------------------------------


def test_sampling_at_temperature_1_is_not_greedy(case: Any) -> None:
    """Guard for the tests below: with this seed, unfiltered sampling leaves greedy."""
    model = case[2]
    assert gen(model, temperature=1.0, seed=SEED) != gen(model, temperature=0)


def test_top_k_1_is_greedy(case: Any) -> None:
    model = case[2]
    assert gen(model, temperature=1.0, top_k=1, seed=SEED) == gen(model, temperature=0)


def test_min_p_near_1_is_greedy(case: Any) -> None:
    model = case[2]
    assert gen(model, temperature=1.0, min_p=0.99, seed=SEED) == gen(model, temperature=0)


@pytest.mark.parametrize("top_k", [0, 40])
def test_top_p_near_0_is_greedy(case: Any, top_k: int) -> None:
    """ONNX Runtime GenAI's top-p-only sampler (top_k 0) bounds the tail loosely and kept
    far more tokens than asked: localrun masks the exact nucleus there. With top_k > 1
    its top-k-then-top-p sampler does it, exactly."""
    model = case[2]
    assert gen(model, temperature=1.0, top_k=top_k, top_p=0.01, seed=SEED) == \
        gen(model, temperature=0)


@pytest.mark.parametrize("option", [{"top_p": 0.05}, {"top_k": 200, "top_p": 0.05},
                                    {"min_p": 0.9}], ids=["top_p", "top_k+top_p", "min_p"])
def test_temperature_comes_before_the_filters(case: Any, option: dict[str, float]) -> None:
    """top_p and min_p (like top_k) act on the distribution at the call's temperature,
    as in transformers (whose generation_config.json values models ship). At temperature
    50 the distribution is nearly flat, so top_p=0.05 keeps thousands of tokens (about
    ten of the top 200), and min_p=0.9 every token within 50 * ln(1/0.9) = 5.3 logits of
    the best: the reply is far from greedy. An engine that filters at temperature 1 and
    applies the temperature last (llama-cpp-python's chain and mlx-lm's make_sampler did,
    and localrun's min_p mask on ONNX did) keeps only the most likely token there
    (p_max >= 0.05; a runner-up within 0.1 logits of it is rare), and its reply is the
    greedy one."""
    model = case[2]
    greedy = gen(model, temperature=0, max_tokens=4)
    for seed in (1, 2):
        assert gen(model, temperature=50.0, seed=seed, max_tokens=4, **option) != greedy


def test_top_k_comes_before_top_p(case: Any) -> None:
    """top_p acts on the top_k tokens renormalized, as in transformers. With top_k=2
    the most likely of the two always holds at least half of their mass, so top_p=0.5
    keeps it alone: greedy. mlx-lm's make_sampler applied top_p to the whole
    distribution before top_k, and kept two tokens wherever p_max < 0.5."""
    model = case[2]
    assert gen(model, temperature=1.0, top_k=2, top_p=0.5, seed=SEED) == \
        gen(model, temperature=0)


# -- repetition penalty ----------------------------------------------------------------

LOOP = "yes, yes, yes, yes, yes, yes, yes, yes,"


def test_repetition_penalty_breaks_a_loop(case: Any) -> None:
    model = case[2]
    greedy = gen(model, LOOP, raw=True, temperature=0)
    assert len(re.findall(r"\byes\b", greedy)) >= 5, greedy  # guard: greedy loops
    penalized = gen(model, LOOP, raw=True, temperature=0, repetition_penalty=1.3)
    assert penalized != greedy
    assert len(re.findall(r"\byes\b", penalized)) <= 2, penalized


def test_raw_completion_keeps_the_first_space(case: Any) -> None:
    """complete() returns the text that follows the prompt: " yes" after "yes,"
    (mlx-lm's streaming detokenizer dropped the first space of every reply)."""
    greedy = gen(case[2], LOOP, raw=True, temperature=0)
    assert greedy.startswith(" yes,"), repr(greedy)


class _Vocab:
    """What mlx-lm's streaming detokenizers read from a tokenizer: its size and pieces."""

    def __init__(self, pieces: list[str]) -> None:
        self.pieces = pieces

    def __len__(self) -> int:
        return len(self.pieces)

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return [self.pieces[i] for i in ids]


@pytest.mark.parametrize(("kind", "pieces"), [
    ("BPEStreamingDetokenizer", ["\u0120the", "\u0120cat", "s", "\u0120"]),  # byte-level BPE
    ("SPMStreamingDetokenizer", ["\u2581the", "\u2581cat", "s", "\u2581"]),  # SentencePiece
])
def test_mlx_detokenizers_keep_the_first_space(kind: str, pieces: list[str]) -> None:
    """Both of mlx-lm's fast detokenizers (the fixture above runs the BPE one) give the
    text as the tokens spell it, its first space included."""
    _skip_unless_installed("mlx")
    from mlx_lm import tokenizer_utils

    from localrun.backends.mlx.engine import keep_first_space

    detok = keep_first_space(getattr(tokenizer_utils, kind)(_Vocab(pieces)))
    detok.reset()
    text = ""
    for token in (0, 1, 2, 3, 0):
        detok.add_token(token)
        text += detok.last_segment
    detok.finalize()
    assert text + detok.last_segment == " the cats  the"


# -- the filters localrun computes for ONNX Runtime GenAI (no engine) --------------------


def _penalized(logits: Any, seq: list[int], penalty: float) -> Any:
    """transformers' RepetitionPenaltyLogitsProcessor over the whole sequence (float64)."""
    import numpy as np

    s = logits.astype(np.float64).copy()
    for t in set(seq):
        s[t] = s[t] * penalty if s[t] < 0 else s[t] / penalty
    return s


def _transformers_keep(logits: Any, seq: list[int], temperature: float, top_k: int,
                       top_p: float, min_p: float, penalty: float) -> Any:
    """The tokens transformers' sampling keeps, step by step as its processors and
    warpers are written (float64, whole sorts): RepetitionPenalty over the sequence,
    Temperature, TopK, TopP (drops the ascending cumulative mass <= 1 - top_p, keeps at
    least one), MinP (p < min_p * p_max, after the others)."""
    import numpy as np

    s = _penalized(logits, seq, penalty) / temperature
    if top_k > 0:
        s[s < np.sort(s)[-top_k]] = -np.inf
    if top_p < 1.0:
        order = np.argsort(s)
        p = np.exp(s[order] - s.max())
        cum = np.cumsum(p / p.sum())
        drop = cum <= 1 - top_p
        drop[-1] = False
        s[order[drop]] = -np.inf
    if min_p > 0:
        p = np.exp(s - s.max())
        s[p < min_p] = -np.inf  # p / p_max, and p_max is exp(0) = 1
    return np.isfinite(s)


@pytest.mark.parametrize(("temperature", "top_k", "top_p", "min_p", "penalty"), [
    (1.0, 0, 0.9, 0.0, 1.0), (0.7, 0, 0.95, 0.0, 1.0), (50.0, 0, 0.05, 0.0, 1.0),
    (0.2, 0, 0.5, 0.0, 1.0), (1.0, 40, 0.95, 0.05, 1.1), (1.3, 5, 0.5, 0.0, 1.3),
    (2.0, 0, 1.0, 0.3, 1.0), (0.5, 0, 0.8, 0.1, 1.2), (3.0, 0, 0.999, 0.0, 1.0),
    (1.0, 40, 1.0, 0.0, 1.0), (0.8, 40, 0.9, 0.0, 1.0),
])
def test_onnx_filters_keep_what_transformers_keeps(temperature: float, top_k: int,
                                                   top_p: float, min_p: float,
                                                   penalty: float) -> None:
    """localrun samples every ONNX Runtime GenAI token itself (onnx_genai's module
    docstring); the tokens its filters keep (a partial sort, for speed) are exactly
    those transformers' full-sort warpers keep."""
    np = pytest.importorskip("numpy", reason="the ONNX backend's sampler runs on numpy")
    from localrun.backends.logits_sampler import kept_tokens
    from localrun.sampling import ResolvedSampling

    rng = np.random.default_rng(18)
    sampling = ResolvedSampling(max_tokens=8, temperature=temperature, top_p=top_p,
                                top_k=top_k, min_p=min_p, repetition_penalty=penalty,
                                seed=None, stop=(), constraint=None)
    for trial in range(20):
        logits = (rng.standard_normal(5000) * rng.choice([1.0, 3.0, 8.0])).astype(np.float32)
        if trial % 4 == 0:  # a structured-output mask already applied
            logits[rng.random(5000) < 0.5] = -np.inf
        seq = [int(t) for t in rng.integers(0, 5000, 60)]
        seq.append(int(np.argmax(logits)))  # the penalty hits the best token too
        expected = _transformers_keep(logits, seq, temperature, top_k, top_p, min_p, penalty)
        kept = np.zeros(5000, dtype=bool)
        kept[kept_tokens(_penalized(logits, seq, penalty).astype(np.float32), sampling)] = True
        assert (kept == expected).all(), (trial, int(kept.sum()), int(expected.sum()))


# -- seeds -----------------------------------------------------------------------------


def test_same_seed_same_text_with_filters_on(case: Any) -> None:
    model = case[2]
    kw: dict[str, Any] = {"temperature": 1.0, "top_k": 40, "top_p": 0.95, "min_p": 0.02,
                          "repetition_penalty": 1.1, "max_tokens": 8}
    a = model.chat(PROMPT, seed=7, **kw).text
    assert model.chat(PROMPT, seed=7, **kw).text == a
    assert model.chat(PROMPT, seed=8, **kw).text != a


# -- defaults: the model's own, then its model card's ------------------------------------


def test_model_card_defaults_in_every_file(case: Any) -> None:
    """The same model gets its card's defaults whatever the file and format."""
    d = case[2].defaults
    assert (d.temperature, d.top_p) == (CARD["temperature"], CARD["top_p"])
    assert (d.top_k, d.min_p, d.repetition_penalty) == (0, 0.0, 1.0)  # localrun's neutral
    assert d.max_tokens == 1024 and d.seed is None and d.stop == ()


def test_defaults_reach_the_engine(case: Any) -> None:
    """A call without options samples exactly as one that spells the card's values out,
    and not as localrun's fallback (temperature 0.7, top_p 1) would."""
    model = case[2]
    told: list[str] = []
    for seed in (1, 2, 3):
        unset = gen(model, seed=seed)
        assert unset == gen(model, seed=seed, **CARD)
        told.append(gen(model, seed=seed, temperature=0.7, top_p=1.0))
        if told[-1] != unset:
            return
    pytest.fail(f"the fallback sampling gave the card's text for 3 seeds: {told}")


# -- defaults written in the model's files -----------------------------------------------

FILE_DEFAULTS = {"temperature": 0.6, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}


def _gguf_with(src: Path, dst: Path, extra: dict[str, float | int]) -> Path:
    """A copy of a GGUF with more metadata (u32 / f32 values) before its tensors."""
    data = src.read_bytes()
    view = memoryview(data)
    n_tensors, n_kv = struct.unpack_from("<QQ", data, 8)
    pos = 24

    def skip_str() -> None:
        nonlocal pos
        (n,) = struct.unpack_from("<Q", data, pos)
        pos += 8 + n

    sizes = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}

    def skip_value(t: int) -> None:
        nonlocal pos
        if t == 8:
            skip_str()
        elif t == 9:
            (inner, count) = struct.unpack_from("<IQ", data, pos)
            pos += 12
            if inner == 8:
                for _ in range(count):
                    skip_str()
            else:
                pos += sizes[inner] * count
        else:
            pos += sizes[t]

    alignment = 32
    for _ in range(n_kv):
        (klen,) = struct.unpack_from("<Q", data, pos)
        key = bytes(view[pos + 8:pos + 8 + klen]).decode()
        pos += 8 + klen
        (t,) = struct.unpack_from("<I", data, pos)
        pos += 4
        if key == "general.alignment":
            (alignment,) = struct.unpack_from("<I", data, pos)
        skip_value(t)
    kv_end = pos
    for _ in range(n_tensors):
        skip_str()
        (dims,) = struct.unpack_from("<I", data, pos)
        pos += 4 + 8 * dims + 4 + 8
    infos_end = pos
    data_start = -(-infos_end // alignment) * alignment
    added = bytearray()
    for key, value in extra.items():
        kb = key.encode()
        added += struct.pack("<Q", len(kb)) + kb
        added += struct.pack("<If", 6, value) if isinstance(value, float) else \
            struct.pack("<II", 4, value)
    head = bytearray(view[:24])
    struct.pack_into("<Q", head, 16, n_kv + len(extra))
    head += bytes(view[24:kv_end]) + added + bytes(view[kv_end:infos_end])
    head += b"\0" * (-len(head) % alignment)
    out = dst / src.name
    with out.open("wb") as f:
        f.write(head)
        f.write(view[data_start:])
    return out


def test_gguf_general_sampling_defaults_are_applied(tmp_path: Path) -> None:
    """GGUF ``general.sampling.*`` beats the model card, and reaches llama.cpp."""
    _skip_unless_installed("llama.cpp")
    path = _gguf_with(test_model("gguf-q4_1"), tmp_path, {
        "general.sampling.temp": 0.6, "general.sampling.top_p": 0.8,
        "general.sampling.top_k": 20, "general.sampling.penalty_repeat": 1.05})
    with localrun.load(str(path), backend="llama.cpp", context=CONTEXT) as model:
        d = model.defaults
        assert (d.temperature, d.top_p, d.top_k, d.repetition_penalty, d.min_p) == \
            pytest.approx((0.6, 0.8, 20, 1.05, 0.0))
        unset = model.chat(PROMPT, seed=SEED, max_tokens=MAX).text
        assert unset == model.chat(PROMPT, seed=SEED, max_tokens=MAX, temperature=0.6,
                                   top_p=0.8, top_k=20, repetition_penalty=1.05).text


@pytest.mark.parametrize(("backend", "fixture"), [c for c in CASES if c[1] in (
    "mlx-4bit", "openvino-int4", "onnx-int4")], ids=lambda v: str(v))
def test_generation_config_defaults_are_applied(backend: str, fixture: str,
                                                tmp_path: Path) -> None:
    """generation_config.json beats the model card, and reaches the engine."""
    _skip_unless_installed(backend)
    src = test_model(fixture)
    folder = as_hub_download(src, tmp_path)
    gen_config = folder / "generation_config.json"
    base = json.loads(gen_config.read_text()) if gen_config.exists() else {}
    if gen_config.exists():
        gen_config.unlink()
    gen_config.write_text(json.dumps({**base, "do_sample": True, **FILE_DEFAULTS}))
    # exact: one seed, one sample, whatever the cache holds from the call before
    with localrun.load(str(folder), backend=backend, context=CONTEXT, exact=True) as model:
        d = model.defaults
        assert (d.temperature, d.top_p, d.top_k, d.repetition_penalty) == \
            pytest.approx(tuple(FILE_DEFAULTS.values()))
        if backend != "mlx":  # MLX is slow here; test_defaults_reach_the_engine covers it
            unset = model.chat(PROMPT, seed=SEED, max_tokens=MAX).text
            assert unset == model.chat(PROMPT, seed=SEED, max_tokens=MAX,
                                       **FILE_DEFAULTS).text


# -- which model a file is (no engine) -----------------------------------------------------


def test_card_defaults_found_by_name_not_by_path(tmp_path: Path) -> None:
    q8 = test_model("gguf-q8_0")
    assert identity.card_sampling(detect(q8)) == CARD  # general.name SmolLM2-135M-Instruct
    hf = test_model("hf")  # config.json _model_name_or_path: SmolLM2's training-run name
    assert identity.card_sampling(detect(hf)) == CARD
    for fixture in NAMELESS:
        nameless = test_model(fixture)
        assert identity.card_sampling(detect(nameless)) == {}, fixture
        hub = as_hub_download(nameless, tmp_path / fixture)
        assert identity.card_sampling(detect(hub)) == CARD, fixture


@pytest.mark.parametrize(("meta", "expected"), [
    ({"general.name": "SmolLM2 135M Instruct"}, CARD),
    ({"general.name": "x", "general.basename": "SmolLM2", "general.size_label": "135M",
      "general.finetune": "Instruct"}, CARD),
    ({"general.name": "x",
      "general.repo_url": "https://huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct"}, CARD),
    ({"general.name": "SmolLM2 135M"}, {}),  # the base model is another model
    ({"general.name": "SmolLM2 1.7B Instruct"}, {}),  # in the catalog, card not recorded
    # general.base_model is the model this one was made from, not this one
    ({"general.name": "my fine-tune", "general.base_model.0.repo_url":
      "https://huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct"}, {}),
])
def test_gguf_names(tmp_path: Path, meta: dict[str, str], expected: dict[str, float]) -> None:
    f = tmp_path / "m.gguf"
    f.write_bytes(gguf_bytes(arch="llama", extra=meta))
    assert identity.card_sampling(detect(f)) == expected


def test_converted_folder_named_by_its_readme(tmp_path: Path) -> None:
    """mlx_lm.convert and optimum write the source repo as README base_model."""
    folder = tmp_path / "SomeName-4bit"
    shutil.copytree(test_model("mlx-4bit"), folder, copy_function=os.symlink)
    (folder / "config.json").unlink()
    cfg = json.loads((test_model("mlx-4bit") / "config.json").read_text())
    cfg.pop("_model_name_or_path", None)
    (folder / "config.json").write_text(json.dumps(cfg))
    assert identity.card_sampling(detect(folder)) == {}
    (folder / "README.md").unlink()
    (folder / "README.md").write_text("---\nlibrary_name: mlx\nbase_model:\n"
                                      "- HuggingFaceTB/SmolLM2-135M-Instruct\ntags:\n- mlx\n"
                                      "---\n# SmolLM2\n")
    assert identity.card_sampling(detect(folder)) == CARD


def test_one_record_of_the_card() -> None:
    entry = catalog.lookup("smollm2:135m")
    assert entry is not None and dict(entry.sampling) == CARD
    assert stores.DEFAULT_MODEL_SAMPLING == CARD
