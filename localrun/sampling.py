"""Sampling options: validation, and resolution against the model's own defaults.

Engines ship defaults that are not neutral (llama.cpp: min_p 0.05, top_k 40;
ExLlamaV2: repetition 1.025). localrun never lets them leak: every backend receives a
fully resolved :class:`ResolvedSampling` and passes every field explicitly.
Precedence: the caller's value, then the model's own generation defaults
(generation_config.json or GGUF ``general.sampling.*``), then what localrun's catalog
knows about the model, then :data:`FALLBACK`. The driver (``localrun.driver``) is where
a request meets those defaults, for chat, stream, complete and batch alike, and where
``max_tokens`` is clamped to the context and the seed drawn.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

from localrun.errors import InvalidSamplingError
from localrun.structured.constraint import Constraint
from localrun.types import MAX_TOP_LOGPROBS, SPECULATIVE_MODES, Sampling, SpeculativeMode


@dataclass(frozen=True)
class ResolvedSampling:
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    repetition_penalty: float
    seed: int | None
    stop: tuple[str, ...]
    #: what the reply must match (structured output, forced tool calls); set by the API
    #: from schema=/response_format=/tool_choice, never from the model's defaults
    constraint: Constraint | None = None
    #: log probabilities of the chosen tokens: None, off; n, with the n most likely
    #: tokens at each position (0-20). The caller's alone, never a model default.
    logprobs: int | None = None
    #: the prompt's tokens with their log probabilities (raw prompts; see types.Sampling)
    echo: bool = False
    #: the LoRA adapters the reply runs under, (name, scale) in load order; set by the
    #: driver (``localrun.adapters.choose``); None: the load-time set
    adapters: tuple[tuple[str, float], ...] | None = None
    #: this call's speculative decoding; None: the model's own setting
    speculative: SpeculativeMode | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


#: Used only where neither the caller nor the model says anything. Filters are off,
#: so the distribution is the model's own, softened by a moderate temperature.
FALLBACK = ResolvedSampling(
    max_tokens=1024,
    temperature=0.7,
    top_p=1.0,
    top_k=0,
    min_p=0.0,
    repetition_penalty=1.0,
    seed=None,
    stop=(),
)

#: What a reply reports beyond its text (log probabilities), set per call like the
#: sampling options but no command-line flag: the CLI prints text.
LOGPROB_OPTIONS: tuple[str, ...] = ("logprobs", "top_logprobs", "echo")
#: Per-call choices that are no sampling value (no preset or command-line flag sets them;
#: the CLI sets speculative decoding at load: --speculative).
CALL_OPTIONS: tuple[str, ...] = ("adapters", "speculative")
SAMPLING_OPTIONS: tuple[str, ...] = tuple(f.name for f in fields(Sampling)
                                          if f.name not in (*LOGPROB_OPTIONS, *CALL_OPTIONS))
_OPTIONS = (*SAMPLING_OPTIONS, *LOGPROB_OPTIONS, *CALL_OPTIONS)
SPECULATIVE_ALLOWED = "one of " + ", ".join(repr(m) for m in SPECULATIVE_MODES)

MAX_SEED = 2**32 - 1
MAX_TOKENS_ALLOWED = "an integer >= 1 (0 only with echo=True: score the prompt alone)"


def _number(name: str, value: object, allowed: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidSamplingError(name, value, allowed)
    if not math.isfinite(value):
        raise InvalidSamplingError(name, value, allowed)
    return float(value)


def _integer(name: str, value: object, allowed: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidSamplingError(name, value, allowed)
    return value


def _check(name: str, value: Any) -> Any:
    """Validate one option; return it in canonical type. ``None`` passes through."""
    if value is None:
        return None
    if name == "max_tokens":
        v = _integer(name, value, MAX_TOKENS_ALLOWED)
        if v < 0:
            raise InvalidSamplingError(name, value, MAX_TOKENS_ALLOWED)
        return v  # 0 only with echo=True: make_sampling checks the pair
    if name == "adapters":
        from localrun.adapters import read_choice

        return read_choice(value)
    if name in ("logprobs", "echo"):
        if not isinstance(value, bool):
            raise InvalidSamplingError(name, value, "True or False")
        return value
    if name == "top_logprobs":
        allowed = f"an integer from 0 to {MAX_TOP_LOGPROBS}"
        k = _integer(name, value, allowed)
        if not 0 <= k <= MAX_TOP_LOGPROBS:
            raise InvalidSamplingError(name, value, allowed)
        return k
    if name == "temperature":
        t = _number(name, value, "a number >= 0 (0 = greedy)")
        if t < 0:
            raise InvalidSamplingError(name, value, "a number >= 0 (0 = greedy)")
        return t
    if name == "top_p":
        p = _number(name, value, "0 < top_p <= 1 (1 = off)")
        if not 0 < p <= 1:
            raise InvalidSamplingError(name, value, "0 < top_p <= 1 (1 = off)")
        return p
    if name == "top_k":
        k = _integer(name, value, "an integer >= 0 (0 = off)")
        if k < 0:
            raise InvalidSamplingError(name, value, "an integer >= 0 (0 = off)")
        return k
    if name == "min_p":
        m = _number(name, value, "0 <= min_p < 1 (0 = off)")
        if not 0 <= m < 1:
            raise InvalidSamplingError(name, value, "0 <= min_p < 1 (0 = off)")
        return m
    if name == "repetition_penalty":
        r = _number(name, value, "a number > 0 (1 = off)")
        if r <= 0:
            raise InvalidSamplingError(name, value, "a number > 0 (1 = off)")
        return r
    if name == "seed":
        s = _integer(name, value, f"an integer from 0 to {MAX_SEED}")
        if not 0 <= s <= MAX_SEED:
            raise InvalidSamplingError(name, value, f"an integer from 0 to {MAX_SEED}")
        return s
    if name == "speculative":
        return check_speculative(value)
    if name == "stop":
        items: Iterable[object] = [value] if isinstance(value, str) else value
        try:
            stops = tuple(items)
        except TypeError:
            raise InvalidSamplingError(name, value, "a string or a list of strings") from None
        if not all(isinstance(s, str) and s for s in stops):
            raise InvalidSamplingError(name, value, "non-empty strings")
        return stops
    raise InvalidSamplingError(name, value, "one of " + ", ".join(_OPTIONS))


def check_speculative(value: object) -> SpeculativeMode | None:
    """``speculative=`` as given at load or per call: one of the modes (None: unset);
    anything else raises InvalidSamplingError listing them."""
    if value is None:
        return None
    word = value.strip().lower().replace("_", "-") if isinstance(value, str) else None
    for mode in SPECULATIVE_MODES:
        if word == mode:
            return mode
    raise InvalidSamplingError("speculative", value, SPECULATIVE_ALLOWED)


def make_sampling(base: Sampling | None = None, **options: Any) -> Sampling:
    """Build a validated :class:`Sampling` from keyword options (``None`` = unset)."""
    checked: dict[str, Any] = {}
    for name, value in options.items():
        if name not in _OPTIONS:
            raise InvalidSamplingError(name, value, "one of " + ", ".join(_OPTIONS))
        v = _check(name, value)
        if v is not None:
            checked[name] = v
    out = replace(base or Sampling(), **checked)
    if out.max_tokens == 0 and not out.echo:
        raise InvalidSamplingError("max_tokens", 0, MAX_TOKENS_ALLOWED)
    if out.logprobs is False and out.top_logprobs:
        raise InvalidSamplingError("top_logprobs", out.top_logprobs,
                                   "0 or unset when logprobs=False")
    return out


def _model_default(name: str, value: Any) -> Any:
    # A model's own defaults may use other conventions (top_k=-1 for "off"); ignore
    # what localrun cannot read rather than failing every call on that model.
    if value is None:
        return None
    try:
        return _check(name, value)
    except InvalidSamplingError:
        return None


def resolve(request: Sampling, model_defaults: Mapping[str, Any] | None = None) -> ResolvedSampling:
    """Fill every unset option: the caller's value, else the model's, else FALLBACK."""
    defaults = model_defaults or {}
    out: dict[str, Any] = {}
    for f in fields(ResolvedSampling):
        if f.name in ("constraint", "logprobs", "echo", "adapters", "speculative"):
            continue
        value = getattr(request, f.name)
        if value is None or (f.name == "stop" and not value):
            value = _model_default(f.name, defaults.get(f.name))
        if value is None:
            value = getattr(FALLBACK, f.name)
        out[f.name] = value
    top = request.top_logprobs or 0
    return ResolvedSampling(**out, logprobs=top if request.logprobs or top else None,
                            echo=bool(request.echo), speculative=request.speculative)
