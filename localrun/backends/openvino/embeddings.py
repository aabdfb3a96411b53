"""OpenVINO GenAI's embedding mode: ``TextEmbeddingPipeline`` over an IR folder of an
embedding model, pooled as sentence-transformers configured it, vectors of unit length."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from localrun.backends.base import Embedder
from localrun.types import ModelInfo


class OpenVINOEmbedder(Embedder):
    def __init__(self, path: str, name: str, context: int | None, device: str | None) -> None:
        import openvino_genai as ov

        folder = Path(path)
        config = json.loads((folder / "config.json").read_text("utf-8"))
        trained = int(config.get("max_position_embeddings") or 512)
        self.max_tokens = min(context, trained) if context else trained
        cfg = ov.TextEmbeddingPipeline.Config()
        cfg.normalize = True
        cfg.pooling_type = _pooling(folder, ov)
        cfg.max_length = self.max_tokens
        dev = (device or "CPU").upper()
        self._pipe = ov.TextEmbeddingPipeline(str(folder), dev, cfg)
        self._tok = ov.Tokenizer(str(folder))
        self.dimensions = int(config.get("hidden_size") or len(self.embed(["x"])[0]))
        self.info = ModelInfo(backend="openvino", engine_version=ov.__version__,
                              format="openvino", quantization=None, path=path,
                              context_length=self.max_tokens, trained_context_length=trained,
                              architecture=str(config.get("model_type") or "") or None,
                              name=name, device=dev)

    def count(self, text: str) -> int:
        return int(self._tok.encode(text).input_ids.shape[-1])

    def embed(self, texts: list[str]) -> list[list[float]]:
        out: Any = self._pipe.embed_documents(texts)
        return [list(map(float, v)) for v in out]

    def close(self) -> None:
        self._pipe = None
        self._tok = None


def _pooling(folder: Path, ov: Any) -> Any:
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


def load_embedder(path: str, name: str, context: int | None, device: str | None
                  ) -> Embedder:
    """The IR folder at ``path`` in a TextEmbeddingPipeline on ``device`` (CPU if None)."""
    return OpenVINOEmbedder(path, name, context, device)
