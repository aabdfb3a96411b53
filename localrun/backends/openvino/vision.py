"""Vision-language models on OpenVINO GenAI through ``VLMPipeline``.

A VLM's IR folder (``openvino_language_model.xml`` with ``openvino_vision_embeddings*``;
optimum-intel's export) loads here instead of :class:`~.session.OpenVINOSession`: one
sequence at a time (``VLMPipeline`` has no batching), text alone or with images.

localrun renders the chat template itself and swaps each image's marker for OpenVINO
GenAI's universal tag ``<ov_genai_image_N>`` (``apply_chat_template`` off), so the prompt
is the one localrun counted. The pipeline takes text, not token ids: the count of a
prompt's tokens is its text's tokens plus each image's, which localrun works out the
way the model's image processor sizes an image (Qwen2-VL's ``smart_resize`` within
``min_pixels``/``max_pixels``, one token per 28x28 pixels, plus ``<|vision_start|>`` and
``<|vision_end|>``); images over the per-image budget are scaled down by localrun first,
so the engine's count and localrun's agree. Only the Qwen2-VL family is counted so:
another VLM's folder loads and answers text, and refuses images with that reason.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from localrun.backends._worker import Relay, Worker
from localrun.backends.base import GenerationStats, LoadRequest, Prompt, Session
from localrun.backends.hf_config import (
    architecture,
    eos_ids,
    read_json,
    sampling_defaults,
    trained_context,
)
from localrun.backends.installed import installed_version, missing
from localrun.backends.openvino.devices import ov_device
from localrun.backends.openvino.engine import SIZE_MAX, Engine
from localrun.backends.openvino.facts import SPEC
from localrun.backends.openvino.text import DecodeMany, Detokenizer, TextWindow
from localrun.backends.options import check_options
from localrun.errors import ChatTemplateError, ModelClosedError, ModelFileError
from localrun.formats.projector import OPENVINO_VLM_FILES
from localrun.images import DEFAULT_IMAGE_TOKENS, MARKER, Image, ImagesUnsupportedError
from localrun.memory import context_window
from localrun.sampling import ResolvedSampling
from localrun.types import CancelToken, FinishReason, Message, ModelInfo

#: the files that make a folder a VLM for VLMPipeline
VLM_FILES = OPENVINO_VLM_FILES
#: while tokens come faster than this, the caller's thread is woken once per this many
#: seconds with every token since, not once per token (the Streamer in ``generate``)
WAKE_EVERY_S = 0.004
#: model types whose image tokens localrun counts (Qwen2-VL's image processor)
QWEN2_VL = ("qwen2_vl", "qwen2_5_vl")


def is_vlm(path: str) -> bool:
    folder = Path(path).expanduser()
    return folder.is_dir() and all((folder / f).is_file() for f in VLM_FILES)


#: Texts whose tokens (the model's own) both decoders must turn back alike, alone and
#: between end-of-sequence tokens, before localrun streams with the ``tokenizers`` library
SAMPLE_TEXTS = ("Hello, world! How are you today?", "  two spaces\tand\nnewlines\n\n",
                "Ça va? Größe, naïve café", "日本語のテキストです。", "emoji 🙂👍 ok",
                "def f(x):\n    return x ** 2  # squared", "3.14159, 1,000,000 and 42%")


def fast_decode(folder: Path, tok: Any, encode: Any, eos: int) -> DecodeMany:
    """The batch decode a reply streams through: the ``tokenizers`` library on the
    folder's ``tokenizer.json`` where it turns :data:`SAMPLE_TEXTS`' tokens back as
    OpenVINO's detokenizer does, else that detokenizer. Each token of a streamed reply
    is decoded once (:class:`~.text.Detokenizer`); OpenVINO's detokenizer is a model run
    per call (~40 us alone, 130-160 us beside inference), the ``tokenizers`` library a
    few microseconds, which took ~6 ms of CPU off a 16-token image request
    (docs/results/images.md)."""
    try:
        from tokenizers import Tokenizer
    except ImportError:
        return tok.decode  # type: ignore[no-any-return]
    try:
        hf = Tokenizer.from_file(str(folder / "tokenizer.json"))
    except Exception:  # missing, or a format this version cannot read
        return tok.decode  # type: ignore[no-any-return]

    def decode(lists: list[list[int]]) -> list[str]:
        return hf.decode_batch(lists, skip_special_tokens=True)  # type: ignore[no-any-return]

    sample = [encode(t) for t in SAMPLE_TEXTS]
    sample += [[eos, *ids, eos] for ids in sample] if 0 <= eos < SIZE_MAX else []
    theirs = [tok.decode([ids])[0] for ids in sample]  # one at a time: no padding
    return decode if decode(sample) == theirs else tok.decode  # type: ignore[no-any-return]


class ImageGrid:
    """Qwen2-VL's image sizing: ``smart_resize`` and the tokens an image takes."""

    def __init__(self, pre: dict[str, Any], max_tokens: int) -> None:
        self.patch = int(pre.get("patch_size", 14))
        self.factor = self.patch * int(pre.get("merge_size", 2))
        self.min_pixels = int(pre.get("min_pixels", 56 * 56))
        self.max_pixels = int(pre.get("max_pixels", 28 * 28 * 1280))  # the engine's
        self.max_tokens = max_tokens  # localrun's budget (embeddings per image)

    def fit(self, image: Image) -> Image:
        """The image scaled down (by localrun) until the engine gives it at most
        ``max_tokens`` embeddings (its rounding to whole patches may add some)."""
        target = self.max_tokens * self.factor ** 2
        while True:
            fitted = image.fit(target)
            if self.tokens(fitted) - 2 <= self.max_tokens or target <= self.factor ** 2:
                return fitted
            target = int(target * 0.9)

    def size(self, width: int, height: int) -> tuple[int, int]:
        f = self.factor
        h = max(f, math.floor(height / f + 0.5) * f)
        w = max(f, math.floor(width / f + 0.5) * f)
        if h * w > self.max_pixels:
            beta = math.sqrt(height * width / self.max_pixels)
            h = max(f, math.floor(height / beta / f) * f)
            w = max(f, math.floor(width / beta / f) * f)
        elif h * w < self.min_pixels:
            beta = math.sqrt(self.min_pixels / (height * width))
            h = math.ceil(height * beta / f) * f
            w = math.ceil(width * beta / f) * f
        return w, h

    def tokens(self, image: Image) -> int:
        """Embeddings the image takes, plus its start and end tokens."""
        w, h = self.size(image.width, image.height)
        return (w // self.factor) * (h // self.factor) + 2


class OpenVINOVisionSession(Session):
    """One ``VLMPipeline``: chat with or without images, one sequence at a time."""

    accepts_images = False

    def __init__(self, request: LoadRequest) -> None:
        path = Path(request.path).expanduser()
        config = read_json(path / "config.json")
        gen_config = read_json(path / "generation_config.json")
        try:
            import openvino_genai as og
        except ImportError as e:
            raise missing(SPEC, reason=str(e)) from e
        self._og = og
        device = ov_device(request.device)
        options = check_options(SPEC, request.options)
        max_tokens = int(options.pop("image_tokens", DEFAULT_IMAGE_TOKENS))
        options.pop("PREFIX_CACHING", None)  # the LLM pipelines' (VLMPipeline has none)
        options.pop("ATTENTION_BACKEND", None)
        props: dict[str, Any] = {}
        if request.threads:
            props["INFERENCE_NUM_THREADS"] = request.threads
        props.update(options)
        try:
            self._pipe = og.VLMPipeline(str(path), device, **props)
        except RuntimeError as e:
            raise ModelFileError(str(path), f"OpenVINO GenAI's VLMPipeline could not load "
                                 f"it ({str(e).strip().splitlines()[0][:300]})") from e
        self._tok = self._pipe.get_tokenizer()
        engine_cfg = self._pipe.get_generation_config()
        eos = eos_ids(gen_config, config) | set(engine_cfg.stop_token_ids)
        for t in (self._tok.get_eos_token_id(), engine_cfg.eos_token_id):
            if 0 <= t < SIZE_MAX:
                eos.add(t)
        self._eos = frozenset(eos)
        self._decode = fast_decode(path, self._tok,
                                   lambda t: self._encode(t, special=False),
                                   self._tok.get_eos_token_id())
        self._engine = Engine(og, self._pipe, self._eos, self._tok.decode)
        self.model_type = str(config.get("model_type", ""))
        self._grid = ImageGrid(read_json(path / "preprocessor_config.json"), max_tokens) \
            if self.model_type in QWEN2_VL else None
        self.accepts_images = self._grid is not None
        self.sampling_defaults = sampling_defaults(gen_config)
        self.chat_template = getattr(self._tok, "chat_template", None) or None
        self.bos_token, self.eos_token = self._tok.get_bos_token(), self._tok.get_eos_token()
        trained = trained_context(config)
        self.info = ModelInfo(
            backend="openvino", engine_version=installed_version(SPEC) or "unknown",
            format="openvino", quantization=None, path=str(path),
            context_length=context_window(request.context, trained),
            trained_context_length=trained, architecture=architecture(config),
            name=str(config.get("_name_or_path") or path.name), device=device)
        self.device = device
        # Every call on one thread of the session's own: a fresh thread per call paid
        # for the CPU plugin's per-thread state again on each request (about 6-9 ms of
        # CPU on a 45 ms image request; docs/results/images.md).
        self._worker: Worker | None = Worker("localrun-openvino-vlm")

    # -- encoding ---------------------------------------------------------------------

    def _encode(self, text: str, special: bool) -> list[int]:
        """The text's tokens, image markers left out: :meth:`attach_images` adds each
        image's tokens to these (one tokenizer call a prompt, not two)."""
        ids = self._tok.encode(text.replace(MARKER, ""), add_special_tokens=special
                               ).input_ids.data
        return [int(t) for t in ids[0]]

    def encode_chat(self, messages: Sequence[Message]) -> Prompt:
        plain = [{k: v for k, v in m.items() if k != "images"} for m in messages]
        try:
            text = self._tok.apply_chat_template(plain, add_generation_prompt=True)
        except RuntimeError as e:
            raise ChatTemplateError(str(e), messages) from e
        return Prompt(self._encode(text, special=False), text)

    def encode_text(self, text: str) -> Prompt:
        return Prompt(self._encode(text, special=True), text)

    def encode_rendered(self, text: str) -> Prompt:
        return Prompt(self._encode(text, special=False), text)

    def attach_images(self, prompt: Prompt, images: Sequence[Image]) -> Prompt:
        if self._grid is None:
            raise ImagesUnsupportedError("openvino", f"localrun counts image tokens for the "
                                         f"Qwen2-VL family only, not {self.model_type!r}",
                                         hint="load it on llama.cpp (a GGUF and its mmproj)")
        import openvino as ov

        text = prompt.text or ""
        pieces = text.split(MARKER)
        if len(pieces) != len(images) + 1:
            raise ImagesUnsupportedError("openvino", f"the prompt holds {len(pieces) - 1} "
                                         f"image markers for {len(images)} images")
        grid = self._grid
        fitted = [grid.fit(im) for im in images]
        tokens = list(prompt.tokens)  # the text's, markers left out (_encode)
        tokens += [-1] * sum(grid.tokens(im) for im in fitted)
        tagged = pieces[0] + "".join(f"<ov_genai_image_{i}>" + piece
                                     for i, piece in enumerate(pieces[1:]))
        return Prompt(tokens, tagged, media=[ov.Tensor(im.array()) for im in fitted])

    # -- generation -------------------------------------------------------------------

    def generate(self, prompt: Prompt, sampling: ResolvedSampling, cancel: CancelToken,
                 stats: GenerationStats) -> Iterator[str]:
        og = self._og
        cfg = self._engine.config(sampling)
        cfg.apply_chat_template = False  # rendered by localrun (module docstring)
        relay: Relay[Any] = Relay()
        eos = self._eos
        # Token ids cross to the caller's thread, which detokenizes: OpenVINO GenAI calls
        # a StreamerBase on a thread of its own, beside inference, so this adds no
        # concurrency, and it took ~4 ms less CPU a 16-token request than detokenizing
        # in write() (docs/results/images.md).
        detok, window = Detokenizer(self._decode), TextWindow()
        running, stop, cancelled = (og.StreamingStatus.RUNNING, og.StreamingStatus.STOP,
                                    og.StreamingStatus.CANCEL)
        clock = time.perf_counter

        class Streamer(og.StreamerBase):  # type: ignore[misc, name-defined]
            """Tokens cross in lists: the caller's thread is woken for the first token
            and then at most every :data:`WAKE_EVERY_S` (a token that comes sooner waits
            for the next one, or the end). A wake per token let the caller's thread take
            the GIL from the engine's next ``write()`` at every token: 1.05-1.08 of the
            raw pipeline's time on the test fixture, whose tokens take under 2 ms, and
            1.01-1.04 now (docs/results/images.md); a real VLM's tokens take tens of
            milliseconds, and each is sent at once."""

            def __init__(self) -> None:
                super().__init__()
                self.ended: FinishReason | None = None
                self.held: list[int] = []
                self.woke = -WAKE_EVERY_S

            def write(self, token: int | list[int]) -> Any:
                for t in (token if isinstance(token, list) else (token,)):
                    if t in eos:
                        self.ended = "stop"
                        self.flush()
                        return stop
                    self.held.append(t)
                now = clock()
                if now - self.woke >= WAKE_EVERY_S:
                    self.woke = now
                    self.flush()
                if relay.halted or cancel.cancelled:
                    return cancelled
                return running

            def flush(self) -> None:
                if self.held:
                    relay.put(self.held)  # detokenized by the caller (below)
                    self.held = []

            def end(self) -> None:
                pass

        streamer = Streamer()
        text = prompt.text if prompt.text is not None else self._tok.decode(
            list(prompt.tokens))

        def work() -> Any:
            try:
                return self._pipe.generate(text, images=list(prompt.media or ()),
                                           generation_config=cfg, streamer=streamer)
            finally:
                streamer.flush()

        worker = self._worker
        if worker is None:
            raise ModelClosedError()
        worker.submit(relay.job(work))
        try:
            for tokens in relay:
                for t in tokens:
                    stats.completion_tokens += 1
                    yield detok.pieces([(window, t)])[0]
            relay.result()
            stats.finish_reason = streamer.ended or "length"
        finally:
            result = relay.close()
            if result is not None:
                pm = result.perf_metrics
                stats.prefill_tokens = int(pm.get_num_input_tokens())
                stats.prefill_seconds = float(pm.get_ttft().mean) / 1000.0
                durations = list(pm.raw_metrics.m_durations)
                stats.decode_tokens = len(durations)
                stats.decode_seconds = sum(durations) / 1e6
                self.last_perf = pm

    last_perf: Any = None  # the last call's perf_metrics

    @property
    def image_encode_seconds(self) -> float | None:
        """The last call's ``prepare_embeddings`` duration: its images through the vision
        encoder (``localrun bench --image``); None where the engine reports none."""
        get = getattr(self.last_perf, "get_prepare_embeddings_duration", None)
        return float(get().mean) / 1000.0 if get is not None else None

    def close(self) -> None:
        if self._worker is not None:
            self._worker.stop()  # after the call in flight, if any
            self._worker = None
        self._pipe = None
        self._tok = None

