"""llama.cpp's embedding mode: a GGUF of an embedding model (an encoder, or a model with
a pooling type), pooled as the GGUF says, vectors of unit length."""

from __future__ import annotations

from typing import Any

from localrun.backends.base import Embedder
from localrun.types import ModelInfo


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

    def embed(self, texts: list[str]) -> list[list[float]]:
        from localrun.backends.llama_cpp.openmp import release_pool

        try:
            out: Any = self._llm.embed(texts, normalize=True, truncate=True)
        finally:
            release_pool()  # a request's worker thread: its pool would outlive it idle
        return [list(map(float, v)) for v in out]

    def close(self) -> None:
        self._llm.close()


def load_embedder(path: str, name: str, context: int | None, device: str | None
                  ) -> Embedder:
    """The GGUF at ``path`` in llama.cpp's embedding mode (on the CPU)."""
    return LlamaEmbedder(path, name, context)
