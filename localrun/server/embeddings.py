"""Embedding models for /v1/embeddings and /api/embed.

Two engines embed: llama.cpp (a GGUF of an embedding model, in llama.cpp's embedding
mode, pooled as the GGUF says) and OpenVINO GenAI (``TextEmbeddingPipeline`` over an
IR folder). A text-generation model has no embedding head: asking one for embeddings
is a 400, never a vector of pooled hidden states that only looks like an embedding.

The public Python API has no embedding call yet, so the engines are driven here; this
belongs in localrun/backends once the API grows ``localrun.embed``.
"""

from __future__ import annotations

import json
import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from localrun.server.errors import APIError
from localrun.types import ModelInfo

#: GGUF architectures that are encoders: they embed and cannot generate.
ENCODER_ARCHITECTURES = frozenset({
    "bert", "nomic-bert", "nomic-bert-moe", "jina-bert-v2", "jina-bert-v3", "t5encoder",
    "modern-bert", "neo-bert", "gte", "eurobert"})
#: transformers architecture suffixes of models that generate text
GENERATIVE_SUFFIXES = ("ForCausalLM", "ForConditionalGeneration", "LMHeadModel")
ENGINES_THAT_EMBED = ("llama.cpp", "openvino")


@dataclass(frozen=True)
class EmbedResult:
    vectors: list[list[float]]
    tokens: int


class Embedder(ABC):
    info: ModelInfo
    dimensions: int
    max_tokens: int

    @abstractmethod
    def count(self, text: str) -> int: ...

    @abstractmethod
    def _embed(self, texts: list[str]) -> list[list[float]]: ...

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
            vectors = self._embed(texts)
        return EmbedResult(vectors, sum(min(n, self.max_tokens) for n in counts))

    def close(self) -> None:  # noqa: B027 - optional
        pass

    @property
    def _lock(self) -> threading.Lock:
        lock: threading.Lock | None = self.__dict__.get("_lk")
        if lock is None:
            lock = self.__dict__["_lk"] = threading.Lock()
        return lock


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
                  allow_unoptimized: bool = False) -> Embedder:
    from localrun.resolve import resolve

    target = resolve(name, backend=backend, allow_unoptimized=allow_unoptimized)
    if not embedding_only(target.path, target.format):
        raise APIError(400, f"'{name}' is a text-generation model: it has no embedding head. "
                       "Use an embedding model (a GGUF or OpenVINO IR of e.g. "
                       "all-MiniLM-L6-v2 or nomic-embed-text)", param="model",
                       code="model_cannot_embed")
    if target.backend == "llama.cpp":
        return LlamaEmbedder(target.path, name, context)
    if target.backend == "openvino":
        return OpenVINOEmbedder(target.path, name, context, target.device)
    raise APIError(400, f"'{name}' runs on {target.backend}, which has no embedding mode in "
                   f"localrun (engines that embed: {', '.join(ENGINES_THAT_EMBED)})",
                   param="model", code="model_cannot_embed")


class LlamaEmbedder(Embedder):
    def __init__(self, path: str, name: str, context: int | None) -> None:
        from llama_cpp import Llama, __version__

        from localrun.formats.gguf import read_gguf

        gguf = read_gguf(path, check_size=False)
        trained = gguf.context_length or 512
        n_ctx = min(context, trained) if context else trained
        # an encoder sees each input whole: one micro-batch must hold the longest input
        self._llm = Llama(model_path=path, embedding=True, n_ctx=n_ctx, n_batch=n_ctx,
                          n_ubatch=n_ctx, verbose=False)
        self.max_tokens = n_ctx
        self.dimensions = int(self._llm.n_embd())
        self.info = ModelInfo(backend="llama.cpp", engine_version=__version__, format="gguf",
                              quantization=gguf.quantization, path=path, context_length=n_ctx,
                              trained_context_length=trained, architecture=gguf.architecture,
                              name=name, device="cpu")

    def count(self, text: str) -> int:
        return len(self._llm.tokenize(text.encode("utf-8")))

    def _embed(self, texts: list[str]) -> list[list[float]]:
        from localrun.backends.llama_cpp.openmp import release_pool

        try:
            out: Any = self._llm.embed(texts, normalize=True, truncate=True)
        finally:
            release_pool()  # a request's worker thread: its pool would outlive it idle
        return [list(map(float, v)) for v in out]

    def close(self) -> None:
        self._llm.close()


class OpenVINOEmbedder(Embedder):
    def __init__(self, path: str, name: str, context: int | None, device: str | None) -> None:
        import openvino_genai as ov

        folder = Path(path)
        config = json.loads((folder / "config.json").read_text("utf-8"))
        trained = int(config.get("max_position_embeddings") or 512)
        self.max_tokens = min(context, trained) if context else trained
        cfg = ov.TextEmbeddingPipeline.Config()
        cfg.normalize = True
        cfg.pooling_type = _ov_pooling(folder, ov)
        cfg.max_length = self.max_tokens
        dev = (device or "CPU").upper()
        self._pipe = ov.TextEmbeddingPipeline(str(folder), dev, cfg)
        self._tok = ov.Tokenizer(str(folder))
        self.dimensions = int(config.get("hidden_size") or len(self._embed(["x"])[0]))
        self.info = ModelInfo(backend="openvino", engine_version=ov.__version__,
                              format="openvino", quantization=None, path=path,
                              context_length=self.max_tokens, trained_context_length=trained,
                              architecture=str(config.get("model_type") or "") or None,
                              name=name, device=dev)

    def count(self, text: str) -> int:
        return int(self._tok.encode(text).input_ids.shape[-1])

    def _embed(self, texts: list[str]) -> list[list[float]]:
        out: Any = self._pipe.embed_documents(texts)
        return [list(map(float, v)) for v in out]

    def close(self) -> None:
        self._pipe = None
        self._tok = None


def _ov_pooling(folder: Path, ov: Any) -> Any:
    """The pooling sentence-transformers configured (1_Pooling/config.json); mean if none."""
    kinds = ov.TextEmbeddingPipeline.PoolingType
    cfg = folder / "1_Pooling" / "config.json"
    if cfg.is_file():
        try:
            pooling = json.loads(cfg.read_text("utf-8"))
        except (OSError, ValueError):
            pooling = {}
        if pooling.get("pooling_mode_cls_token"):
            return kinds.CLS
        if pooling.get("pooling_mode_lasttoken"):
            return kinds.LAST_TOKEN
    return kinds.MEAN
