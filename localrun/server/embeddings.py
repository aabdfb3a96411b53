"""Embedding models for /v1/embeddings and /api/embed.

The engines that embed say so in their facts (``BackendSpec.embedder``: llama.cpp, a GGUF
of an embedding model; OpenVINO GenAI, an IR folder) and drive their own embedding mode
(``backends/<engine>/embeddings.py``). Here a loaded one is run for requests: one call
at a time, each input checked against the model's window. A text-generation model has
no embedding head: asking one for embeddings is a 400, never a vector of pooled hidden
states that only looks like an embedding.
"""

from __future__ import annotations

import importlib
import json
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from localrun.backends import BACKENDS
from localrun.backends.base import Embedder as EngineEmbedder
from localrun.server.errors import APIError

if TYPE_CHECKING:
    from localrun.resolve import Target

#: GGUF architectures that are encoders: they embed and cannot generate.
ENCODER_ARCHITECTURES = frozenset({
    "bert", "nomic-bert", "nomic-bert-moe", "jina-bert-v2", "jina-bert-v3", "t5encoder",
    "modern-bert", "neo-bert", "gte", "eurobert"})
#: transformers architecture suffixes of models that generate text
GENERATIVE_SUFFIXES = ("ForCausalLM", "ForConditionalGeneration", "LMHeadModel")
#: The engines with an embedding mode (their facts name its module).
ENGINES_THAT_EMBED = tuple(name for name, spec in BACKENDS.items() if spec.embedder)


@dataclass(frozen=True)
class EmbedResult:
    vectors: list[list[float]]
    tokens: int


class Embedder:
    """A loaded embedding model as the server runs it: the engine's embedder, one call at
    a time, each input checked against its window."""

    def __init__(self, engine: EngineEmbedder) -> None:
        self._engine = engine
        self._lock = threading.Lock()
        self.info = engine.info
        self.dimensions = engine.dimensions
        self.max_tokens = engine.max_tokens

    def count(self, text: str) -> int:
        return self._engine.count(text)

    def embed(self, texts: list[str], *, truncate: bool) -> EmbedResult:
        """Unit-length vectors, one per text. A text over the model's window is a 400
        unless ``truncate`` (Ollama's default), which cuts it to the window."""
        counts = [self.count(t) for t in texts]
        for i, n in enumerate(counts):
            if n > self.max_tokens and not truncate:
                raise APIError(400, f"Input {i} is {n} tokens but {self.info.name or 'the model'}"
                               f" embeds at most {self.max_tokens} tokens per input (split the "
                               "text, or send truncate=true to /api/embed)", param="input",
                               code="context_length_exceeded")
        with self._lock:
            vectors = self._engine.embed(texts)
        return EmbedResult(vectors, sum(min(n, self.max_tokens) for n in counts))

    def close(self) -> None:
        self._engine.close()


def embedding_only(path: str, fmt: str) -> bool:
    """True for a model built to embed (an encoder, or a GGUF with a pooling type)."""
    p = Path(path)
    if fmt == "gguf" and p.is_file():
        from localrun.formats.gguf import read_gguf

        meta = read_gguf(p, check_size=False).metadata
        arch = meta.get("general.architecture")
        return arch in ENCODER_ARCHITECTURES or f"{arch}.pooling_type" in meta
    config = p / "config.json" if p.is_dir() else None
    if config is not None and config.is_file():
        try:
            archs = json.loads(config.read_text("utf-8")).get("architectures") or []
        except (OSError, ValueError):
            return False
        return bool(archs) and not any(str(a).endswith(GENERATIVE_SUFFIXES) for a in archs)
    return False


def load_embedder(name: str, *, backend: str = "auto", context: int | None = None,
                  allow_unoptimized: bool = False, target: Target | None = None) -> Embedder:
    """Load ``name`` to embed (``target``: resolved already, downloaded here if need be)."""
    from localrun.resolve import fetch_target, resolve

    target = fetch_target(target) if target is not None else \
        resolve(name, backend=backend, allow_unoptimized=allow_unoptimized)
    if not embedding_only(target.path, target.format):
        raise APIError(400, f"'{name}' is a text-generation model: it has no embedding head. "
                       "Use an embedding model (a GGUF or OpenVINO IR of e.g. "
                       "all-MiniLM-L6-v2 or nomic-embed-text)", param="model",
                       code="model_cannot_embed")
    module = BACKENDS[target.backend].embedder if target.backend in BACKENDS else None
    if module is not None:
        engine = importlib.import_module(module).load_embedder(target.path, name, context,
                                                                 target.device)
        return Embedder(engine)
    raise APIError(400, f"'{name}' runs on {target.backend}, which has no embedding mode in "
                   f"localrun (engines that embed: {', '.join(ENGINES_THAT_EMBED)})",
                   param="model", code="model_cannot_embed")
