"""Images on llama.cpp through mtmd (libmtmd): a GGUF text model and its projector.

The projector (``mmproj-*.gguf``, a GGUF of architecture ``clip``) lies beside the
model, or comes from the ``mmproj=`` engine option. We call mtmd's C API ourselves
rather than llama-cpp-python's ``MTMDChatHandler``: the handler fetches any URL it is
given and runs its own sampling; here localrun decodes every image
(:mod:`localrun.images`), mtmd turns the rendered prompt (with :data:`MARKER` where each
image goes) into text and image chunks, and the session's own token loop generates
from the context those chunks filled.

**Counting.** A prompt's tokens are its text tokens plus each image's embeddings (what
its KV cache holds; OpenVINO GenAI counts the same way). Qwen2-VL's M-RoPE advances the
position by less than that for an image (max(rows, columns) of its patch grid):
llama-cpp-python's own ``usage.prompt_tokens`` counts positions instead.

**Logging.** mtmd ignores ``verbose=False``; it is silenced through its log callbacks,
which must live as long as the process (a freed callback crashes a later mtmd call), so
the one callback is a module global, never freed.
"""

from __future__ import annotations

import ctypes
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from localrun.errors import ModelFileError
from localrun.formats.projector import projector_beside
from localrun.images import DEFAULT_IMAGE_TOKENS, MARKER, Image, ImagesUnsupportedError

# DEFAULT_IMAGE_TOKENS: larger images are scaled down by mtmd to fit (its range: 8-4096)

_QUIET: Any = None  # the log callback: never freed (see the module's docstring)


def find_projector(model: str, option: str | None) -> str | None:
    """The projector GGUF for ``model``: the ``mmproj=`` option's file, else the one
    ``mmproj*.gguf`` of architecture ``clip`` beside the model; None when there is none."""
    from localrun.formats.gguf import read_gguf

    if option:
        path = Path(option).expanduser()
        if not path.is_file():
            raise ModelFileError(str(path), "the mmproj file does not exist")
        if read_gguf(path).architecture != "clip":
            raise ModelFileError(str(path), "not a projector GGUF (its architecture is not "
                                 "'clip'); pass the model's mmproj-*.gguf")
        return str(path)
    found = projector_beside(Path(model))
    return str(found) if found is not None else None


@dataclass(eq=False)
class Chunks:
    """A tokenized prompt with images: mtmd's chunks (freed with this object)."""

    handle: Any
    #: per chunk: ("text", token ids) or ("image", chunk pointer, embeddings, positions)
    parts: list[tuple[Any, ...]] = field(default_factory=list)
    #: seconds mtmd took to encode each image at the last feed, and its embeddings
    encode_seconds: list[float] = field(default_factory=list)


class Vision:
    """The projector loaded for one ``Llama`` (an mtmd context)."""

    def __init__(self, lc: Any, llm: Any, projector: str, threads: int,
                 max_tokens: int = DEFAULT_IMAGE_TOKENS) -> None:
        import llama_cpp.mtmd_cpp as mtmd

        global _QUIET
        if _QUIET is None:
            _QUIET = lc.llama_log_callback(lambda level, text, user_data: None)
        mtmd.mtmd_log_set(_QUIET, None)
        mtmd.mtmd_helper_log_set(_QUIET, None)
        self.mtmd, self.lc, self.projector = mtmd, lc, projector
        params = mtmd.mtmd_context_params_default()
        params.use_gpu = bool(lc.llama_supports_gpu_offload())
        params.print_timings = False
        params.n_threads = threads
        params.media_marker = MARKER.encode()
        if hasattr(params, "image_max_tokens"):
            params.image_max_tokens = max_tokens
        self.max_tokens = max_tokens
        #: seconds mtmd took to encode the last prompt's images (bench --image)
        self.last_encode_s: float | None = None
        self.ctx = mtmd.mtmd_init_from_file(projector.encode(), llm.model, params)
        if not self.ctx:
            raise ModelFileError(projector, "mtmd could not load this projector for the model "
                                 "(a projector made for another model?)")
        if not mtmd.mtmd_support_vision(self.ctx):
            self.close()
            raise ModelFileError(projector, "this projector has no vision encoder")

    def encode(self, llm: Any, text: str, images: Sequence[Image], add_special: bool
               ) -> tuple[list[int], Chunks]:
        """The prompt's tokens as localrun counts them (each image as that many
        placeholder ids) and its chunks."""
        mtmd = self.mtmd
        if text.count(MARKER) != len(images):
            raise ImagesUnsupportedError("llama.cpp", f"the prompt holds {text.count(MARKER)} "
                                         f"image markers for {len(images)} images",
                                         hint="send each image as its own content part")
        bitmaps = []
        try:
            for im in images:
                buf = (ctypes.c_uint8 * len(im.rgb)).from_buffer_copy(im.rgb)
                bitmap = mtmd.mtmd_bitmap_init(im.width, im.height, buf)
                if not bitmap:
                    raise ImagesUnsupportedError("llama.cpp", f"mtmd refused a {im.width}x"
                                                 f"{im.height} image")
                bitmaps.append(bitmap)
            handle = mtmd.mtmd_input_chunks_init()
            chunks = Chunks(handle)
            weakref.finalize(chunks, mtmd.mtmd_input_chunks_free, handle)
            data = text.encode("utf-8")
            inp = mtmd.mtmd_input_text()
            inp.text, inp.text_len = data, len(data)
            inp.add_special, inp.parse_special = add_special, True
            arr = (mtmd.mtmd_bitmap_p_ctypes * max(len(bitmaps), 1))(*bitmaps)
            rc = mtmd.mtmd_tokenize(self.ctx, handle, ctypes.byref(inp), arr, len(bitmaps))
            if rc != 0:
                raise ImagesUnsupportedError("llama.cpp", f"mtmd could not tokenize the "
                                             f"prompt with its images (error {rc})")
        finally:
            for bitmap in bitmaps:
                mtmd.mtmd_bitmap_free(bitmap)
        tokens: list[int] = []
        for i in range(mtmd.mtmd_input_chunks_size(handle)):
            chunk = mtmd.mtmd_input_chunks_get(handle, i)
            kind = mtmd.mtmd_input_chunk_get_type(chunk)
            if kind == mtmd.MTMD_INPUT_CHUNK_TYPE_TEXT:
                n = ctypes.c_size_t()
                ptr = mtmd.mtmd_input_chunk_get_tokens_text(chunk, ctypes.byref(n))
                ids = [int(ptr[j]) for j in range(n.value)]
                chunks.parts.append(("text", ids))
                tokens += ids
            else:
                n_tokens = int(mtmd.mtmd_input_chunk_get_n_tokens(chunk))
                n_pos = int(mtmd.mtmd_input_chunk_get_n_pos(chunk))
                chunks.parts.append(("image", chunk, n_tokens, n_pos))
                tokens += [-1] * n_tokens
        if not chunks.parts or chunks.parts[-1][0] != "text" or not chunks.parts[-1][1]:
            raise ImagesUnsupportedError("llama.cpp", "the prompt ends with an image",
                                         hint="add text after the image")
        return tokens, chunks

    def feed(self, llm: Any, chunks: Chunks) -> list[int]:
        """Fill the context with the prompt, all but its last token, from position 0;
        return the ids ``Llama.generate`` is to be given (its cells so far, then the
        last token), so that it feeds the last token alone and samples after it."""
        mtmd, lc = self.mtmd, self.lc
        llm.n_tokens = 0
        llm._ctx.kv_cache_seq_rm(-1, 0, -1)
        chunks.encode_seconds = []
        parts = chunks.parts
        for k, part in enumerate(parts):
            if part[0] == "text":
                ids = part[1][:-1] if k == len(parts) - 1 else part[1]
                if ids:
                    llm.eval(ids)
                continue
            _, chunk, _, _ = part
            start = llm.n_tokens
            t0 = time.perf_counter()
            if mtmd.mtmd_encode_chunk(self.ctx, chunk) != 0:
                raise ImagesUnsupportedError("llama.cpp", "mtmd could not encode an image")
            chunks.encode_seconds.append(time.perf_counter() - t0)
            embd = mtmd.mtmd_get_output_embd(self.ctx)
            new_past = lc.llama_pos(0)
            rc = mtmd.mtmd_helper_decode_image_chunk(
                self.ctx, llm._ctx.ctx, chunk, embd, lc.llama_pos(start), lc.llama_seq_id(0),
                int(llm.n_batch), ctypes.byref(new_past),
                mtmd.mtmd_helper_post_decode_callback(), None)
            if rc != 0:
                raise ImagesUnsupportedError("llama.cpp", f"llama.cpp could not decode an "
                                             f"image's embeddings (error {rc})")
            end = int(new_past.value)
            llm.input_ids[start:end] = -1  # no token there: generate() compares ids alone
            llm.n_tokens = end
        self.last_encode_s = sum(chunks.encode_seconds)
        return [*llm.input_ids[:llm.n_tokens].tolist(), parts[-1][1][-1]]

    def close(self) -> None:
        ctx, self.ctx = getattr(self, "ctx", None), None
        if ctx:
            self.mtmd.mtmd_free(ctx)


def load_vision(lc: Any, llm: Any, model: str, options: dict[str, Any], threads: int
                ) -> Vision | None:
    """The projector for this model loaded on ``llm``, or None (no projector): the
    ``mmproj=`` and ``image_tokens=`` engine options, checked here. Closes ``llm`` if
    it fails."""
    from localrun.backends.llama_cpp.facts import SPEC
    from localrun.backends.options import check_options
    from localrun.errors import InvalidOptionError

    try:
        opts = check_options(SPEC, options)
        tokens = int(opts.get("image_tokens", DEFAULT_IMAGE_TOKENS))
        if not 8 <= tokens <= 4096:  # mtmd's own range
            raise InvalidOptionError(SPEC.title, "image_tokens", tokens,
                                     "most image tokens one image takes, 8 to 4096")
        projector = find_projector(model, opts.get("mmproj"))
        return None if projector is None else Vision(lc, llm, projector, threads, tokens)
    except BaseException:
        llm.close()
        raise


def no_projector(model: str) -> ImagesUnsupportedError:
    return ImagesUnsupportedError(
        "llama.cpp", f"{Path(model).name} was loaded without a vision projector",
        hint="put the model's mmproj-*.gguf beside it, or load it with mmproj='PATH' "
        "(a text-only model cannot take images: load a vision model)")
