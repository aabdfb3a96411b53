"""llguidance: the one grammar library behind every engine that exposes its logits.

A :class:`~localrun.structured.constraint.Constraint` becomes an llguidance grammar
(JSON Schema, or a Lark grammar for ``tool_choice="auto"``) compiled for one model's
tokenizer; a :class:`TokenMask` then tells the engine, before each token, which token
ids may come next, and is told which one did. The schema subset is llguidance's
(https://github.com/guidance-ai/llguidance/blob/main/docs/json_schema.md): ``type``,
``properties``/``required``/``additionalProperties``, ``items``/``prefixItems``/
``minItems``/``maxItems``, ``enum``/``const``, ``anyOf``/``oneOf``/``allOf``, ``$ref``/
``$defs``, numeric bounds and ``multipleOf``, ``minLength``/``maxLength``/``pattern``
(no look-around)/``format`` (date, time, date-time, email, uuid, ...). Keywords it
cannot enforce (``uniqueItems``, ``contains``, ``not``, ``if``/``then``,
``dependentRequired``, remote ``$ref``) raise :class:`UnsupportedSchemaError` before any
token is generated, on every engine.

JSON is generated compact, ``{"a": 1, "b": [2, 3]}``: no free whitespace, so that a
sampled reply cannot wander off into newlines (a small model at temperature 1 does); the
only blanks between tokens are the one space of ``", "`` and ``": "``. Every number is
bounded before the schema becomes a grammar (:func:`~localrun.structured.bounds.
bounded_schema`: int64 integers, decimals of at most 9 fraction digits, the schema's own
bounds kept), so no value of the grammar is longer than the schema's strings allow.
"""

from __future__ import annotations

import functools
import json
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from localrun.errors import (
    ConstrainedDecodingUnavailableError,
    GenerationError,
    UnsupportedSchemaError,
)
from localrun.structured.bounds import bounded_schema
from localrun.structured.constraint import Constraint

if TYPE_CHECKING:
    import numpy
    from llguidance import LLMatcher, LLTokenizer

#: How llguidance lays out the JSON it allows (its ``x-guidance`` options).
JSON_OPTIONS: dict[str, Any] = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}

LLGUIDANCE_HINT = "pip install 'llguidance>=1.9,<2' (a dependency of localrun)"
#: What structured output needs of a model's files.
FAST_TOKENIZER_HINT = "structured output needs a Hugging Face fast tokenizer (tokenizer.json)"


def llguidance() -> Any:
    """The llguidance module, or the typed error saying how to get it."""
    try:
        import llguidance as llg
    except ImportError as e:
        raise ConstrainedDecodingUnavailableError(
            "any engine", f"llguidance is not installed ({e})", hint=LLGUIDANCE_HINT) from e
    return llg


def json_grammar(schema: dict[str, Any]) -> str:
    """The llguidance grammar (its JSON form) for one JSON value of ``schema``, its
    numbers bounded (:func:`~localrun.structured.bounds.bounded_schema`). Compiled once
    per schema: the API's check and the engine's matcher share it."""
    # the schema's JSON text, in its own key order (the order a grammar writes them in)
    return _json_grammar(json.dumps(schema, ensure_ascii=False))


@functools.lru_cache(maxsize=64)
def _json_grammar(schema_json: str) -> str:
    llg = llguidance()
    try:
        grammar: str = llg.LLMatcher.grammar_from_json_schema(
            bounded_schema(json.loads(schema_json)), overrides=JSON_OPTIONS)
    except ValueError as e:
        raise UnsupportedSchemaError("the schema", str(e)) from e
    return grammar


def check_schema(schema: dict[str, Any], label: str = "the schema") -> None:
    """Raise :class:`UnsupportedSchemaError` if llguidance cannot enforce ``schema``.

    Needs no tokenizer, so the API checks every schema before it touches an engine: the
    same schema is refused the same way on every engine. The grammar it compiles is the
    one the engine's matcher gets (:func:`json_grammar`).
    """
    error = _grammar_error(json_grammar(schema))
    if error:
        raise UnsupportedSchemaError(label, error)


@functools.lru_cache(maxsize=64)
def _grammar_error(grammar: str) -> str:
    error: str = llguidance().LLMatcher.validate_grammar(grammar)
    return error


def _lark_text(s: str) -> str:
    return json.dumps(s) if s else ""


def special_token(tokenizer: LLTokenizer, text: str) -> int | None:
    """The id of ``text`` when it is one special token of this vocabulary (Mistral's
    ``[TOOL_CALLS]``, Llama's ``<|python_tag|>``), else None (plain text, as Qwen's
    ``<tool_call>``, which its tokenizer does not mark special)."""
    ids = tokenizer.tokenize_str(text, parse_special=True)
    if len(ids) == 1 and tokenizer.is_special_token(ids[0]):
        return int(ids[0])
    return None


def constraint_grammar(constraint: Constraint, tokenizer: LLTokenizer | None = None) -> str:
    """The llguidance grammar of a constraint.

    Without a tag: one JSON value. With one (``tool_choice="auto"``): free text in which
    each tool call is the trigger, then JSON, then the end text; the JSON is constrained
    only from the trigger on (a lazy lexeme, llguidance's StructTag recipe). A trigger
    that is a special token of the vocabulary is matched as that token, which needs
    ``tokenizer``.
    """
    schema = constraint.schema_dict
    tag = constraint.tag
    repeat = constraint.repeat
    if tag is None and repeat is None:
        return json_grammar(schema)
    value = "%json " + json.dumps({**bounded_schema(schema), "x-guidance": JSON_OPTIONS})
    llg = llguidance()
    if repeat is not None:  # forced calls, the first one's trigger in the prompt
        more = " ".join(p for p in (_lark_text(repeat.end + "\n"),
                                    _trigger(repeat.trigger, tokenizer),
                                    _lark_text(repeat.begin), "value") if p)
        lark = ("%llguidance {}\n"
                f"start: value more* {_lark_text(repeat.end)}?\n"
                f"more: {more}\n"
                f"value: {value}\n")
        forced: str = llg.LLMatcher.grammar_from_lark(lark)
        return forced
    assert tag is not None
    body = " ".join(p for p in (_lark_text(tag.begin), value, _lark_text(tag.end)) if p)
    special = special_token(tokenizer, tag.trigger) if tokenizer is not None else None
    if special is not None:
        call = f"call: TEXT <[{special}]> {body}\n"
    else:
        call = f"call_trigger[lazy]: TEXT {_lark_text(tag.trigger)}\ncall: call_trigger {body}\n"
    # not parallel: a call ends the reply (nothing may follow it but the end)
    lark = ("%llguidance {}\n"
            f"start: {'call | tail' if tag.single else 'call* tail'}\n"
            "tail: TEXT\n"
            "TEXT: /(.|\\n)*/\n" + call)
    grammar: str = llg.LLMatcher.grammar_from_lark(lark)
    return grammar


def _trigger(trigger: str, tokenizer: LLTokenizer | None) -> str:
    """A call's opening marker in Lark: its special token where it is one."""
    special = special_token(tokenizer, trigger) if tokenizer is not None else None
    return f"<[{special}]>" if special is not None else _lark_text(trigger)


class GrammarCompiler:
    """llguidance for one model's tokenizer: compiled grammars (cached) and matchers.

    ``width`` is the number of logits the engine produces (it may exceed the
    tokenizer's vocabulary: padding rows are never allowed).
    """

    def __init__(self, tokenizer: LLTokenizer, width: int | None = None) -> None:
        self.tokenizer = tokenizer
        self.width = width or tokenizer.vocab_size
        self._grammars: dict[Constraint, str] = {}
        self._lock = threading.Lock()

    def grammar(self, constraint: Constraint) -> str:
        """The grammar for ``constraint``, checked against this tokenizer (cached)."""
        with self._lock:
            cached = self._grammars.get(constraint)
        if cached is not None:
            return cached
        llg = llguidance()
        grammar = constraint_grammar(constraint, self.tokenizer)
        error = llg.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if error:
            raise UnsupportedSchemaError(constraint.label, error)
        with self._lock:
            if len(self._grammars) >= 64:  # a long-running agent with many schemas
                self._grammars.pop(next(iter(self._grammars)))
            self._grammars[constraint] = grammar
        return grammar

    def mask(self, constraint: Constraint, backend: str) -> TokenMask:
        """A fresh matcher for one request."""
        llg = llguidance()
        matcher = llg.LLMatcher(self.tokenizer, self.grammar(constraint), log_level=0)
        if matcher.is_error():
            raise UnsupportedSchemaError(constraint.label, matcher.get_error())
        return TokenMask(matcher, self.tokenizer.vocab_size, self.width, backend)


class TokenMask:
    """One request's llguidance matcher: which tokens may come next, and what came.

    ``allowed()`` before each step, ``consume(token)`` after it (never for the EOS that
    ends the reply). Once the grammar is complete only EOS is allowed, so the engine's
    own end-of-sequence handling ends the reply.
    """

    def __init__(self, matcher: LLMatcher, vocab: int, width: int, backend: str) -> None:
        import numpy as np

        self._np = np
        self.matcher = matcher
        self.backend = backend
        self.width = width
        self._vocab = vocab
        self._words = np.zeros((vocab + 31) // 32, dtype=np.int32)
        self._bits = self._words.view(np.uint8)
        self.consumed = 0

    def allowed(self) -> numpy.ndarray[Any, Any]:
        """A bool array of ``width`` entries: True where the token may come next."""
        np = self._np
        self.matcher.unsafe_compute_mask_ptr(self._words.ctypes.data, self._words.nbytes)
        self._check()
        bits = np.unpackbits(self._bits, bitorder="little", count=min(self._vocab, self.width))
        if bits.shape[0] < self.width:
            bits = np.concatenate([bits, np.zeros(self.width - bits.shape[0], np.uint8)])
        allowed: numpy.ndarray[Any, Any] = bits.view(bool)  # 0/1 bytes: no copy needed
        return allowed

    def apply(self, logits: numpy.ndarray[Any, Any]) -> numpy.ndarray[Any, Any]:
        """``logits`` (last axis = vocabulary) with every disallowed token at -inf, set in
        place when the array is writeable (both engine hooks hand over their own copy)."""
        np = self._np
        allowed = self.allowed()
        width = logits.shape[-1]
        if width != allowed.shape[0]:  # an engine whose rows differ from what it said
            fit = np.zeros(width, dtype=bool)
            n = min(width, allowed.shape[0])
            fit[:n] = allowed[:n]
            allowed = fit
        out = logits if logits.flags.writeable else logits.copy()
        np.copyto(out, -np.inf, where=~allowed)
        return out

    def consume(self, token: int) -> None:
        if not self.matcher.consume_token(int(token)):
            raise GenerationError(
                self.backend, f"the constrained decoder rejected token {int(token)} "
                f"({self.matcher.get_error() or 'not allowed by the grammar'})")
        self.consumed += 1

    def consume_all(self, tokens: Sequence[int]) -> None:
        for t in tokens:
            self.consume(t)

    @property
    def done(self) -> bool:
        """The grammar is complete: only EOS may follow."""
        return bool(self.matcher.is_stopped())

    def _check(self) -> None:
        if self.matcher.is_error():
            raise GenerationError(self.backend,
                                  f"the constrained decoder failed: {self.matcher.get_error()}")


# -- tokenizers -------------------------------------------------------------------------


def tokenizer_from_json(tokenizer_json: str, eos: Sequence[int], n_vocab: int | None = None
                        ) -> LLTokenizer:
    """llguidance's tokenizer from the text of a Hugging Face ``tokenizer.json``."""
    llg = llguidance()
    try:
        tok: LLTokenizer = llg.LLTokenizer(tokenizer_json, n_vocab=n_vocab,
                                           eos_token=sorted(set(eos)) or None)
    except Exception as e:  # pyo3 raises ValueError/RuntimeError for tokenizers it cannot read
        raise ConstrainedDecodingUnavailableError(
            "this model", f"llguidance cannot read its tokenizer.json ({e})",
            hint=FAST_TOKENIZER_HINT) from e
    return tok


def tokenizer_in_folder(folder: Path, eos: Sequence[int], engine: str,
                        n_vocab: int | None = None) -> LLTokenizer:
    """llguidance's tokenizer from a model folder's ``tokenizer.json``; the typed error
    naming ``engine`` (as users know it) where the folder has none."""
    source = folder / "tokenizer.json"
    if not source.is_file():
        raise ConstrainedDecodingUnavailableError(
            engine, f"{folder} has no tokenizer.json for llguidance", hint=FAST_TOKENIZER_HINT)
    return tokenizer_from_json(source.read_text(encoding="utf-8"), eos, n_vocab)


def tokenizer_from_llama(vocab: Any, eos: Sequence[int]) -> LLTokenizer:
    """llguidance's tokenizer from a llama.cpp vocabulary (about 0.5 s for 50k tokens)."""
    llg = llguidance()
    try:
        from llguidance.llamacpp import lltokenizer_from_vocab
    except ImportError as e:
        raise ConstrainedDecodingUnavailableError(
            "llama.cpp", f"llguidance {getattr(llg, '__version__', '?')} has no llama.cpp "
            f"tokenizer bridge ({e})", hint=LLGUIDANCE_HINT) from e
    import warnings

    with warnings.catch_warnings():
        # it asks llama_token_get_attr, which llama-cpp-python 0.3.36 deprecates, once
        # per token of the vocabulary
        warnings.simplefilter("ignore", DeprecationWarning)
        tok: LLTokenizer = lltokenizer_from_vocab(vocab, eos_token=sorted(set(eos)) or None)
    return tok


# -- one model's compiler ---------------------------------------------------------------


class LazyGrammar:
    """One model's llguidance compiler, built on first use (building llguidance's
    tokenizer takes ~0.5 s per 50k tokens) and shared by its requests."""

    def __init__(self, backend: str, make_tokenizer: Callable[[], Any],
                 width: int | None = None) -> None:
        self.backend = backend
        self._make = make_tokenizer
        self._width = width
        self._compiler: GrammarCompiler | None = None
        self._lock = threading.Lock()

    def compiler(self) -> GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                self._compiler = GrammarCompiler(self._make(), self._width)
            return self._compiler

    def check(self, constraint: Constraint) -> None:
        """Compile now (cached): schema errors before any token is generated."""
        try:
            self.compiler().grammar(constraint)
        except UnsupportedSchemaError as e:
            raise UnsupportedSchemaError(e.what, e.detail, backend=self.backend) from e

    def mask(self, constraint: Constraint) -> TokenMask:
        return self.compiler().mask(constraint, self.backend)
