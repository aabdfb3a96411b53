#!/usr/bin/env python3
"""Write a GGUF of a real model's shape with RANDOM weights, for speed benchmarks only.

The weights are random (normal(0, 0.02) matrices, seeded; norms of ones), so the model's
text is meaningless: use it to time llama.cpp (tokens/s, batching, memory), never to
judge output. Why: speed depends on the shape (a 1.7B model is memory-bound at one token,
where decoding several sequences together pays; the 135M fixture is compute-bound), and
this machine cannot download a real 1.7B model.

The architecture is Llama (llama.cpp's ``llama``), tied embeddings, the SmolLM2 family's
shapes; the tokenizer and chat template are the SmolLM2 test fixture's (every
``tokenizer.*`` key copied byte for byte from the Q8_0 GGUF that
``scripts/make_test_models.py`` builds), so prompts tokenize as for SmolLM2. The rows of
the control tokens (``<|im_end|>``, the EOS, ...) in the tied embedding are zero: their
logit is then 0 while every other token's is spread around it, so greedy decoding never
picks EOS and a benchmark's replies run to their ``max_tokens``.

    .venv/bin/python scripts/make_shape_model.py                  # 1.7b: F16 -> Q4_0
    .venv/bin/python scripts/make_shape_model.py --shape 360m --quant q4_0 q8_0
    .venv/bin/python scripts/make_shape_model.py --check          # load, generate, logits

Shapes (hidden / layers / intermediate / heads / KV heads / rope theta): ``1.7b`` =
SmolLM2-1.7B's 2048 / 24 / 8192 / 32 / 32 / 130000; ``360m`` = SmolLM2-360M's
960 / 32 / 2560 / 15 / 5 / 100000; ``tiny`` = 64 / 2 / 128 / 4 / 2 (for tests). Vocabulary
49152 (the tokenizer's), RMS norm epsilon 1e-5, context 8192.

The F16 file is written tensor by tensor (peak memory: one chunk of about 32 MB of
random numbers, not the model), then quantized with llama.cpp's own quantizer
(llama-cpp-python's ``llama_model_quantize``, as ``llama-quantize`` does) and deleted
unless ``--keep-f16``. The GGUF container is written here (standard library and numpy
only), so no ``gguf`` package is needed. Output: ``~/.cache/localrun/shape-models/``
(``--out`` to change); a file already there is kept unless ``--force``.
"""

from __future__ import annotations

import argparse
import mmap
import os
import struct
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent

GGUF_MAGIC = b"GGUF"
GGUF_VERSION = 3
ALIGNMENT = 32  # general.alignment's default
# GGUF metadata value types
U8, I8, U16, I16, U32, I32, F32, BOOL, STRING, ARRAY, U64, I64, F64 = range(13)
_SCALAR_SIZE = {U8: 1, I8: 1, U16: 2, I16: 2, U32: 4, I32: 4, F32: 4, BOOL: 1, U64: 8,
                I64: 8, F64: 8}
GGML_F32, GGML_F16 = 0, 1
TOKEN_CONTROL = 3  # llama_token_type LLAMA_TOKEN_TYPE_CONTROL

#: --quant name -> (llama_ftype, file name part)
QUANTS = {"q4_0": (2, "Q4_0"), "q8_0": (7, "Q8_0"), "q4_k_m": (15, "Q4_K_M")}


@dataclass(frozen=True)
class Shape:
    label: str
    hidden: int
    layers: int
    intermediate: int
    heads: int
    kv_heads: int
    rope_theta: float = 100000.0
    rms_eps: float = 1e-5
    context: int = 8192

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def params(self, vocab: int) -> int:
        kv = self.kv_heads * self.head_dim
        block = (2 * self.hidden * self.hidden + 2 * self.hidden * kv
                 + 3 * self.hidden * self.intermediate + 2 * self.hidden)
        return vocab * self.hidden + self.layers * block + self.hidden


SHAPES = {
    "1.7b": Shape("SmolLM2-1.7B", 2048, 24, 8192, 32, 32, rope_theta=130000.0),
    "360m": Shape("SmolLM2-360M", 960, 32, 2560, 15, 5, rope_theta=100000.0),
    "tiny": Shape("tiny", 64, 2, 128, 4, 2),
}


def default_out() -> Path:
    return Path.home() / ".cache" / "localrun" / "shape-models"


def fixture_gguf() -> Path:
    """The SmolLM2 Q8_0 test fixture (its tokenizer is copied)."""
    sys.path.insert(0, str(ROOT))
    from tests.models import BUILD_HINT, read_manifest

    path = ((read_manifest() or {}).get("models") or {}).get("gguf-q8_0")
    if not path or not Path(path).is_file():
        raise SystemExit(f"no SmolLM2 Q8_0 fixture to copy the tokenizer from: {BUILD_HINT}")
    return Path(path)


# ---------------------------------------------------------------- reading metadata


class _Cursor:
    def __init__(self, buf: mmap.mmap) -> None:
        self.buf, self.pos = buf, 0

    def take(self, n: int) -> bytes:
        if self.pos + n > len(self.buf):
            raise ValueError("truncated GGUF header")
        out = self.buf[self.pos:self.pos + n]
        self.pos += n
        return out

    def u32(self) -> int:
        return int(struct.unpack("<I", self.take(4))[0])

    def u64(self) -> int:
        return int(struct.unpack("<Q", self.take(8))[0])

    def string(self) -> bytes:
        return self.take(self.u64())

    def skip_value(self, vtype: int) -> None:
        if vtype == STRING:
            n = self.u64()  # read before pos is taken: it moves pos
            self.pos += n
        elif vtype == ARRAY:
            etype, count = self.u32(), self.u64()
            if etype in _SCALAR_SIZE:
                self.pos += _SCALAR_SIZE[etype] * count
            else:
                for _ in range(count):
                    self.skip_value(etype)
        elif vtype in _SCALAR_SIZE:
            self.pos += _SCALAR_SIZE[vtype]
        else:
            raise ValueError(f"unknown GGUF value type {vtype}")


@dataclass
class Metadata:
    """A GGUF's key/values: each key's raw (type + value) bytes, in file order."""

    raw: dict[str, bytes]

    def array(self, key: str) -> tuple[int, int, bytes]:
        """An array's element type, count and element bytes."""
        blob = self.raw[key]
        vtype, etype, count = struct.unpack("<IIQ", blob[:16])
        if vtype != ARRAY:
            raise ValueError(f"{key} is not an array")
        return etype, count, blob[16:]


def read_metadata(path: Path) -> Metadata:
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        cur = _Cursor(buf)
        if cur.take(4) != GGUF_MAGIC:
            raise ValueError(f"{path} is not a GGUF file")
        version = cur.u32()
        if version < 2:
            raise ValueError(f"{path}: GGUF version {version} is not supported (2+)")
        cur.u64()  # tensor count
        n_kv = cur.u64()
        raw: dict[str, bytes] = {}
        for _ in range(n_kv):
            key = cur.string().decode()
            start = cur.pos
            cur.skip_value(cur.u32())
            raw[key] = buf[start:cur.pos]
    return Metadata(raw)


# ---------------------------------------------------------------- writing


def _str(s: str) -> bytes:
    b = s.encode()
    return struct.pack("<Q", len(b)) + b


def _kv_u32(v: int) -> bytes:
    return struct.pack("<II", U32, v)


def _kv_f32(v: float) -> bytes:
    return struct.pack("<If", F32, v)


def _kv_str(v: str) -> bytes:
    return struct.pack("<I", STRING) + _str(v)


@dataclass
class _Tensor:
    name: str
    rows: int  # numpy shape (rows, cols); GGUF ne = (cols, rows); 1-D when rows == 0
    cols: int
    fill: Callable[[int, int], np.ndarray]  # (row0, row1) -> that block, final dtype

    @property
    def dtype(self) -> int:
        return GGML_F32 if self.rows == 0 else GGML_F16

    @property
    def nbytes(self) -> int:
        return self.cols * 4 if self.rows == 0 else self.rows * self.cols * 2


def _pad(n: int) -> int:
    return (ALIGNMENT - n % ALIGNMENT) % ALIGNMENT


def _tensors(shape: Shape, vocab: int, zero_rows: Sequence[int], seed: int,
             scale: float) -> list[_Tensor]:
    h, kv = shape.hidden, shape.kv_heads * shape.head_dim
    specs: list[tuple[str, int, int]] = [("token_embd.weight", vocab, h)]
    for i in range(shape.layers):
        b = f"blk.{i}."
        specs += [(b + "attn_norm.weight", 0, h), (b + "attn_q.weight", h, h),
                  (b + "attn_k.weight", kv, h), (b + "attn_v.weight", kv, h),
                  (b + "attn_output.weight", h, h), (b + "ffn_norm.weight", 0, h),
                  (b + "ffn_gate.weight", shape.intermediate, h),
                  (b + "ffn_up.weight", shape.intermediate, h),
                  (b + "ffn_down.weight", h, shape.intermediate)]
    specs.append(("output_norm.weight", 0, h))  # no output.weight: tied to token_embd
    zero = np.asarray(sorted(zero_rows), dtype=np.int64)

    def matrix(index: int, name: str, cols: int) -> Callable[[int, int], np.ndarray]:
        # one generator per tensor, drawn in row order: the same numbers for any chunking
        rng = np.random.default_rng([seed, index])
        done = [0]  # rows drawn so far

        def fill(r0: int, r1: int) -> np.ndarray:
            if r0 != done[0]:
                raise RuntimeError(f"{name}: rows must be filled in order")
            done[0] = r1
            block = rng.standard_normal((r1 - r0, cols), dtype=np.float32)
            block *= scale
            if name == "token_embd.weight":
                hit = zero[(zero >= r0) & (zero < r1)]
                block[hit - r0] = 0.0
            return block.astype(np.float16)

        return fill

    def ones(cols: int) -> Callable[[int, int], np.ndarray]:
        return lambda r0, r1: np.ones(cols, dtype=np.float32)

    return [_Tensor(name, rows, cols, ones(cols) if rows == 0 else matrix(i, name, cols))
            for i, (name, rows, cols) in enumerate(specs)]


def _header(shape: Shape, meta: Metadata, tensors: list[_Tensor], vocab: int) -> bytes:
    a = "llama."
    name = f"{shape.label}-shape (random weights, for speed benchmarks only)"
    kvs: list[tuple[str, bytes]] = [
        ("general.architecture", _kv_str("llama")),
        ("general.type", _kv_str("model")),
        ("general.name", _kv_str(name)),
        ("general.file_type", _kv_u32(1)),  # LLAMA_FTYPE_MOSTLY_F16
        (a + "vocab_size", _kv_u32(vocab)),
        (a + "context_length", _kv_u32(shape.context)),
        (a + "embedding_length", _kv_u32(shape.hidden)),
        (a + "block_count", _kv_u32(shape.layers)),
        (a + "feed_forward_length", _kv_u32(shape.intermediate)),
        (a + "attention.head_count", _kv_u32(shape.heads)),
        (a + "attention.head_count_kv", _kv_u32(shape.kv_heads)),
        (a + "rope.dimension_count", _kv_u32(shape.head_dim)),
        (a + "rope.freq_base", _kv_f32(shape.rope_theta)),
        (a + "attention.layer_norm_rms_epsilon", _kv_f32(shape.rms_eps)),
    ]
    kvs += [(k, v) for k, v in meta.raw.items() if k.startswith("tokenizer.")]
    out = [GGUF_MAGIC, struct.pack("<IQQ", GGUF_VERSION, len(tensors), len(kvs))]
    out += [_str(k) + v for k, v in kvs]
    offset = 0
    for t in tensors:
        ne = (t.cols,) if t.rows == 0 else (t.cols, t.rows)
        out.append(_str(t.name) + struct.pack(f"<I{len(ne)}QIQ", len(ne), *ne, t.dtype,
                                              offset))
        offset += t.nbytes + _pad(t.nbytes)
    blob = b"".join(out)
    return blob + b"\0" * _pad(len(blob))


def _chunks(t: _Tensor, elements: int = 8 << 20) -> Iterator[tuple[int, int]]:
    if t.rows == 0:
        yield 0, 1
        return
    step = max(1, elements // t.cols)
    for r0 in range(0, t.rows, step):
        yield r0, min(t.rows, r0 + step)


def control_tokens(meta: Metadata) -> list[int]:
    etype, count, body = meta.array("tokenizer.ggml.token_type")
    if etype != I32:
        raise ValueError(f"tokenizer.ggml.token_type has element type {etype}, not int32")
    types = np.frombuffer(body, dtype="<i4", count=count)
    return [int(i) for i in np.flatnonzero(types == TOKEN_CONTROL)]


def write_f16(shape: Shape, tokenizer_gguf: Path, out: Path, *, seed: int = 0,
              scale: float = 0.02) -> Path:
    """Write the F16 GGUF of ``shape`` with random weights to ``out`` (atomically)."""
    meta = read_metadata(tokenizer_gguf)
    _, vocab, _ = meta.array("tokenizer.ggml.tokens")
    if shape.hidden % shape.heads or shape.heads % shape.kv_heads:
        raise ValueError(f"{shape}: hidden must divide by heads, heads by KV heads")
    tensors = _tensors(shape, vocab, control_tokens(meta), seed, scale)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".part")
    with open(tmp, "wb") as f:
        f.write(_header(shape, meta, tensors, vocab))
        for t in tensors:
            for r0, r1 in _chunks(t):
                f.write(t.fill(r0, r1).tobytes())
            f.write(b"\0" * _pad(t.nbytes))
    os.replace(tmp, out)
    return out


def quantize(src: Path, dst: Path, quant: str, threads: int = 2) -> Path:
    """llama.cpp's quantizer (as ``llama-quantize src dst TYPE``), written atomically."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = QUANTS[quant][0]
    params.nthread = threads
    tmp = dst.with_name(dst.name + ".part")
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), params)
    if rc != 0:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"llama_model_quantize({src.name} -> {quant}) returned {rc}")
    os.replace(tmp, dst)
    return dst


def file_name(shape: Shape, kind: str, seed: int = 0) -> str:
    tag = "" if seed == 0 else f".seed{seed}"
    return f"{shape.label}-shape.random{tag}.{kind}.gguf"


def build(shape: Shape, out_dir: Path, quants: Sequence[str] = ("q4_0",), *,
          tokenizer_gguf: Path | None = None, keep_f16: bool = False, force: bool = False,
          seed: int = 0, scale: float = 0.02, threads: int = 2,
          log: Callable[[str], None] = lambda s: None) -> dict[str, Path]:
    """The F16 model and its quantized files in ``out_dir``: {"f16"|quant: path}.

    Files already there are kept (unless ``force``); the F16 file is written only when a
    file asked for is missing, and removed afterwards unless ``keep_f16``."""
    made: dict[str, Path] = {}
    f16 = out_dir / file_name(shape, "F16", seed)
    wanted = {q: out_dir / file_name(shape, QUANTS[q][1], seed) for q in quants}
    missing = [q for q, p in wanted.items() if force or not p.exists()]
    if (keep_f16 or missing) and (force or not f16.exists()):
        t0 = time.monotonic()
        write_f16(shape, tokenizer_gguf or fixture_gguf(), f16, seed=seed, scale=scale)
        log(f"wrote {f16} ({f16.stat().st_size / 2**30:.2f} GiB, "
            f"{time.monotonic() - t0:.0f} s)")
    for q in missing:
        t0 = time.monotonic()
        quantize(f16, wanted[q], q, threads)
        log(f"wrote {wanted[q]} ({wanted[q].stat().st_size / 2**30:.2f} GiB, "
            f"{time.monotonic() - t0:.0f} s)")
    made.update(wanted)
    if keep_f16:
        made["f16"] = f16
    elif f16.exists():
        f16.unlink()
    return made


# ---------------------------------------------------------------- checks


def check(path: Path, threads: int = 2) -> dict[str, Any]:
    """Logits of a prompt (finite?) from llama.cpp, and a reply through localrun."""
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(path), n_ctx=256, n_threads=threads,
                          n_threads_batch=threads, logits_all=True, verbose=False)
    try:
        tokens = llm.tokenize(b"Once upon a time, in a small village", add_bos=False)
        llm.eval(tokens)
        logits = np.asarray(llm.scores[:len(tokens)])
    finally:
        llm.close()
    sys.path.insert(0, str(ROOT))
    import localrun

    with localrun.load(str(path), backend="llama.cpp", context=512, threads=threads) as m:
        reply = m.chat("Tell me a story.", max_tokens=16, temperature=0.0)
    return {"finite": bool(np.isfinite(logits).all()),
            "logit_std": float(logits.std()), "logit_absmax": float(np.abs(logits).max()),
            "reply_tokens": reply.usage.completion_tokens, "reply": reply.text,
            "finish_reason": reply.finish_reason}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="1.7b")
    ap.add_argument("--quant", nargs="*", choices=sorted(QUANTS), default=["q4_0"],
                    help="quantized files to write (default q4_0; none: only the F16)")
    ap.add_argument("--out", type=Path, default=default_out(),
                    help="folder (default ~/.cache/localrun/shape-models)")
    ap.add_argument("--keep-f16", action="store_true", help="keep the F16 file")
    ap.add_argument("--force", action="store_true", help="rebuild files already there")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--scale", type=float, default=0.02, help="std of the random matrices")
    ap.add_argument("--threads", type=int, default=2, help="quantizer and check threads")
    ap.add_argument("--check", action="store_true",
                    help="then load each file: finite logits, and a reply through localrun")
    args = ap.parse_args(argv)
    shape = SHAPES[args.shape]
    files = build(shape, args.out, args.quant, keep_f16=args.keep_f16 or not args.quant,
                  force=args.force, seed=args.seed, scale=args.scale, threads=args.threads,
                  log=lambda s: print(s, file=sys.stderr))
    print(f"{shape.label} shape: {shape.params(49152) / 1e9:.3f} B parameters "
          f"(random weights: for speed benchmarks only)")
    bad = 0
    for kind, path in files.items():
        print(f"{kind}: {path}")
        if args.check:
            r = check(path, args.threads)
            bad += not r["finite"]
            print(f"  logits finite: {r['finite']} (std {r['logit_std']:.3f}, "
                  f"max |x| {r['logit_absmax']:.3f}); reply: {r['reply_tokens']} tokens, "
                  f"{r['finish_reason']}: {r['reply']!r}")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
