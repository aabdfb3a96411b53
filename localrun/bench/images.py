"""``localrun bench --image FILE``: what an image costs a vision model.

The same chat request (greedy, ``--gen-tokens``) is sent with and without the image,
alternating, ``runs`` times each after ``warmup`` pairs: the difference in prompt tokens
is the image's tokens (its embeddings and markers), the difference in TTFT what the image
adds before the first token (preprocessing, the vision encoder, the prefill of its
tokens). The engine's own image-encode time is reported where it gives one (llama.cpp:
mtmd's encode of each image, timed around the call; OpenVINO GenAI: its
``prepare_embeddings`` duration), and the rest divided by the image's tokens is the
prefill per image token.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from localrun.bench.report import ImageResult
from localrun.bench.stats import Summary

if TYPE_CHECKING:
    from localrun.api import Model
    from localrun.images import Image
    from localrun.types import Message

#: the question asked about the image (and without it)
QUESTION = "Describe this image."


def _one(model: Model, messages: list[Message], gen: int, sampling: Mapping[str, Any]
         ) -> tuple[float, int, float | None]:
    """(TTFT, prompt tokens, the engine's encode seconds) of one streamed request."""
    t0 = time.perf_counter()
    first = 0.0
    with model.stream(messages, max_tokens=gen, **sampling) as stream:
        for chunk in stream:
            if not first and chunk.text:
                first = time.perf_counter()
        end = time.perf_counter()
    c = stream.completion
    assert c is not None
    encode = getattr(model._session, "image_encode_seconds", None)
    return (first or end) - t0, c.usage.prompt_tokens, encode


def measure_image(model: Model, image: Image, name: str, gen: int, runs: int, warmup: int,
                  sampling: Mapping[str, Any]) -> ImageResult:
    """The image's cost on ``model`` (the module docstring), decoding with ``sampling``."""
    text: list[Message] = [{"role": "user", "content": QUESTION}]
    with_image: list[Message] = [{"role": "user", "content": QUESTION, "images": [image]}]
    for _ in range(warmup):
        _one(model, text, gen, sampling)
        _one(model, with_image, gen, sampling)
    t_text, t_image, encodes = [], [], []
    n_text = n_image = 0
    for _ in range(runs):
        ttft, n_text, _ = _one(model, text, gen, sampling)
        t_text.append(ttft)
        ttft, n_image, enc = _one(model, with_image, gen, sampling)
        t_image.append(ttft)
        if enc is not None:
            encodes.append(enc)
    text_s, image_s = Summary.of(t_text), Summary.of(t_image)
    encode_s = Summary.of(encodes) if len(encodes) == runs else None
    tokens = n_image - n_text
    rest = image_s.p50 - text_s.p50 - (encode_s.p50 if encode_s else 0.0)
    per = rest / tokens if tokens > 0 and encode_s is not None else None
    return ImageResult(name, image.width, image.height, tokens, text_s, image_s, encode_s,
                       per)
