"""Memory estimates: weights + KV cache + overhead, and the largest context that fits.

Pure arithmetic over numbers the caller gathered (file sizes from the Hub, the model's
shape from GGUF metadata or config.json, the engine's own row: :class:`EngineMemory`,
which each engine states in its facts and :func:`localrun.backends.engine_memory` finds by
name). No I/O except the small readers at the end, which take the shape from a GGUF
header (:mod:`localrun.formats.gguf` parses it) or a config dict, and the weights' size,
parameter count and shape from a model on disk (:func:`local_estimate`: the one way from a
model's path to its estimate). Imports no engine and not the engine table.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

from localrun.formats.gguf import GGUFMetadata

#: Proportional cost: scratch buffers grow with the model.
OVERHEAD_FRACTION = 0.05
#: KV cache element size when the engine (or its device) is not known: f16.
KV_BYTES = 2
#: Contexts are offered in multiples of this many tokens.
CONTEXT_STEP = 256
#: Context a model gets when the caller names none: its trained context, capped here so
#: a 32k- or 128k-context model does not reserve its whole KV cache by default (and a
#: long prompt overflows the same way on every engine).
DEFAULT_CONTEXT_CAP = 8192


MiB = 2**20
#: Fixed cost on top of the weights: compute buffers, runtime, tokenizer (bytes).
OVERHEAD_FIXED = 256 * MiB


@dataclass(frozen=True)
class EngineMemory:
    """What an engine allocates besides its weights, as localrun loads it on a device."""

    kv_element_bytes: int | None  # bytes per K or V element; None: the model's dtype
    overhead_fixed: int = OVERHEAD_FIXED  # runtime, tokenizer, compute buffers (bytes)


#: Engine unknown, or without a memory row: f16 and the full fixed overhead.
UNKNOWN_ENGINE = EngineMemory(KV_BYTES)


class MemoryRows(Protocol):
    """An engine's memory facts (``backends.spec.BackendSpec``'s ``memory`` rows)."""

    @property
    def memory(self) -> Mapping[str, EngineMemory]: ...
    @property
    def default_device(self) -> str: ...


def memory_row(spec: MemoryRows | None, device: str | None = None) -> EngineMemory:
    """What the engine ``spec`` describes allocates on ``device`` ("cpu", "CPU", "GPU.1",
    "cuda:0", "metal", ...; None: its default device) besides its weights: the row of its
    own facts (``BackendSpec.memory``), else :data:`UNKNOWN_ENGINE`."""
    if spec is None:
        return UNKNOWN_ENGINE
    kind = re.split(r"[:.]", device.strip().lower(), maxsplit=1)[0] if device else \
        spec.default_device
    return spec.memory.get(kind) or spec.memory.get("*") or UNKNOWN_ENGINE


def kv_element_bytes(engine: EngineMemory, shape: ModelShape | None) -> int:
    """Bytes per KV element: the engine's own, else the model's dtype, else f16."""
    if engine.kv_element_bytes is not None:
        return engine.kv_element_bytes
    return shape.dtype_bytes if shape is not None and shape.dtype_bytes else KV_BYTES


def context_window(requested: int | None, trained: int | None) -> int:
    """The context window every backend loads a model with (the one rule).

    The caller's context, capped at the trained context; without one, the trained
    context capped at :data:`DEFAULT_CONTEXT_CAP` (the cap itself when the model does not
    say what it was trained for).
    """
    if requested is not None:
        return min(requested, trained) if trained else requested
    return min(trained, DEFAULT_CONTEXT_CAP) if trained else DEFAULT_CONTEXT_CAP


@dataclass(frozen=True)
class ModelShape:
    """What the KV cache size depends on."""

    n_layers: int
    n_kv_heads: int
    head_dim: int
    trained_context: int | None = None
    #: bytes per element of the model's activations (config.json's dtype), if it says
    dtype_bytes: int | None = None

    def kv_bytes_per_token(self, kv_bytes: float = KV_BYTES) -> int:
        """K and V for every layer and KV head. ``kv_bytes`` may be fractional: a
        quantized cache (ExLlama's Q4 is half a byte an element plus an fp16 scale per
        32, 0.5625); a partial byte per token rounds up."""
        total = self.n_layers * self.n_kv_heads * self.head_dim * 2 * kv_bytes
        return -int(-total // 1)


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes needed to run a model at ``context`` tokens; ``kv_known`` False when the
    model's shape could not be read (the KV cache then counts as 0)."""

    weights_bytes: int
    kv_cache_bytes: int
    overhead_bytes: int
    context: int
    kv_known: bool = True
    #: LoRA adapters loaded with the model: their files' bytes (localrun.adapters)
    adapter_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        return (self.weights_bytes + self.kv_cache_bytes + self.overhead_bytes
                + self.adapter_bytes)

    def breakdown(self) -> str:
        kv = f"KV cache {_gib(self.kv_cache_bytes)}" if self.kv_known else "KV cache unknown"
        adapters = f" + adapters {_gib(self.adapter_bytes)}" if self.adapter_bytes else ""
        return (f"weights {_gib(self.weights_bytes)}{adapters} + {kv} + overhead "
                f"{_gib(self.overhead_bytes)}")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["total_bytes"] = self.total_bytes
        return d


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def overhead_bytes(weights_bytes: int, fixed: int = OVERHEAD_FIXED) -> int:
    return fixed + int(weights_bytes * OVERHEAD_FRACTION)


def kv_cache_bytes(shape: ModelShape, context: int, kv_bytes: float = KV_BYTES) -> int:
    """layers × KV heads × head dim × context × 2 (K and V) × bytes per element."""
    return shape.kv_bytes_per_token(kv_bytes) * context


def estimate(weights_bytes: int, shape: ModelShape | None, context: int, *,
             engine: EngineMemory = UNKNOWN_ENGINE) -> MemoryEstimate:
    """Bytes to run the model at ``context`` on the engine whose row is ``engine``
    (:func:`localrun.backends.engine_memory` by name; an engine sizing itself passes its
    own): the KV cache in the element size it allocates, its overhead."""
    eng = engine
    kv = kv_cache_bytes(shape, context, kv_element_bytes(eng, shape)) if shape else 0
    return MemoryEstimate(weights_bytes, kv, overhead_bytes(weights_bytes, eng.overhead_fixed),
                          context, kv_known=shape is not None)


def max_context(weights_bytes: int, shape: ModelShape | None, budget_bytes: int,
                *, limit: int | None = None, engine: EngineMemory = UNKNOWN_ENGINE) -> int:
    """Largest context (a multiple of CONTEXT_STEP, at most ``limit``) that fits the budget
    on the engine whose row is ``engine``, as :func:`estimate` counts it.

    0 when not even CONTEXT_STEP tokens fit. Without a shape, the KV cache is unknown:
    the answer is ``limit`` if the weights fit, else 0.
    """
    eng = engine
    free = budget_bytes - weights_bytes - overhead_bytes(weights_bytes, eng.overhead_fixed)
    if free <= 0:
        return 0
    cap = limit if limit is not None else 1 << 20
    if shape is None:
        return cap
    per_token = shape.kv_bytes_per_token(kv_element_bytes(eng, shape))
    tokens = free // per_token if per_token else cap
    if tokens >= cap:
        return cap
    return int(tokens // CONTEXT_STEP * CONTEXT_STEP)


@dataclass(frozen=True)
class Fit:
    """One model's memory on one engine: at ``context`` (what the engine loads), whether
    it fits the budget, and the largest context that does."""

    context: int
    estimate: MemoryEstimate
    fits: bool
    max_context: int | None  # None without a budget


def fit(weights_bytes: int, shape: ModelShape | None, context: int | None,
        budget: int | None, *, engine: EngineMemory = UNKNOWN_ENGINE) -> Fit:
    """The memory fit of ``weights_bytes`` of a model of ``shape`` (None: KV cache
    unknown, counted as 0) at the context the engines load (:func:`context_window` of the
    caller's ``context`` and the trained one) within ``budget`` (None: no check), on the
    engine whose row is ``engine``: the one fit rule of the Hub's variants and of models
    on disk alike."""
    trained = shape.trained_context if shape else None
    ctx = context_window(context, trained)
    est = estimate(weights_bytes, shape, ctx, engine=engine)
    max_ctx = (max_context(weights_bytes, shape, budget, limit=trained, engine=engine)
               if budget is not None else None)
    return Fit(ctx, est, budget is None or est.total_bytes <= budget, max_ctx)


@dataclass(frozen=True)
class Offload:
    """How much of a model goes on the GPU when it does not all fit (llama.cpp layers).

    ``total`` counts the repeating layers plus the output layer, as llama.cpp's
    ``n_gpu_layers`` does (``n_layer + 1`` offloads everything).
    """

    layers: int
    total: int
    needed_bytes: int  # weights + KV cache + overhead, all of it on the GPU
    free_bytes: int

    @property
    def full(self) -> bool:
        return self.layers >= self.total

    def describe(self, device: str) -> str:
        if self.full:
            return f"all {self.total} layers on {device}"
        if self.layers == 0:
            return (f"the free VRAM of {device} ({_gib(self.free_bytes)}) holds no layer: "
                    "it runs on the CPU")
        return (f"the model needs {_gib(self.needed_bytes)} with its KV cache, {device} has "
                f"{_gib(self.free_bytes)} free: {self.layers} of {self.total} layers go on "
                f"the GPU, the rest run on the CPU (partial offload)")


def gpu_share(weights_bytes: int, kv_cache_bytes: int, free_vram: int) -> float:
    """Share (0 to 1) of a model's layers that fit in ``free_vram`` bytes.

    The overhead (compute buffers) comes off first; each layer then costs its share of
    the weights and of the KV cache (llama.cpp keeps an offloaded layer's KV on the GPU).
    """
    needed = weights_bytes + kv_cache_bytes + overhead_bytes(weights_bytes)
    if needed <= free_vram:
        return 1.0
    room = free_vram - overhead_bytes(weights_bytes)
    return max(0.0, room / (weights_bytes + kv_cache_bytes))


def gpu_offload(weights_bytes: int, n_layers: int, kv_cache_bytes: int,
                free_vram: int) -> Offload:
    """Layers of a model that fit in ``free_vram`` bytes (llama.cpp's partial offload);
    the output layer counts as one more, as in ``n_gpu_layers``."""
    total = n_layers + 1
    needed = weights_bytes + kv_cache_bytes + overhead_bytes(weights_bytes)
    share = gpu_share(weights_bytes, kv_cache_bytes, free_vram)
    layers = total if share >= 1.0 else min(total - 1, int(share * total))
    return Offload(layers, total, needed, free_vram)


def available_ram_bytes() -> int:
    """Memory available to a new process: MemAvailable from /proc/meminfo, else
    free pages from sysconf, else total physical memory."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        page = os.sysconf("SC_PAGE_SIZE")
        for name in ("SC_AVPHYS_PAGES", "SC_PHYS_PAGES"):
            try:
                return int(os.sysconf(name)) * int(page)
            except (ValueError, OSError):
                continue
    except (ValueError, OSError, AttributeError):
        pass
    return 0


#: An optional reserve (:func:`budget`'s ``reserve``) takes at most this share of the room.
RESERVE_SHARE = 4


def budget(available: int | None, *, limit: int | None = None, used: int = 0,
           freed: int = 0, resident: int = 0, reserve: int | None = None) -> int:
    """The one memory policy: bytes something new may take now. The server's fit check
    (a model, with its batcher, beside the loaded ones) and llama.cpp's batcher (its
    batch context's KV streams) both ask it.

    Under ``limit`` (``serve --max-memory``): the limit less ``used``, the bytes counted
    as loaded. Else what the OS shows ``available``, plus ``freed`` (what unloading gave
    back that the OS may not show yet) and ``resident`` (bytes of the new thing in
    memory already, which the OS no longer shows available); None: not known, no bound.
    ``reserve``: the room for an optional reserve, which only lets more run at once (a
    batch context's KV streams): at most ``reserve`` bytes and 1/:data:`RESERVE_SHARE` of
    the room, so that the rest stays for models and the OS."""
    if limit is not None:
        room = limit - used
    elif available is None:
        return reserve if reserve is not None else 2**63 - 1
    else:
        room = available + freed + resident
    return room if reserve is None else min(reserve, room // RESERVE_SHARE)


# --- reading a model's shape -------------------------------------------------------------

def shape_from_config(config: dict[str, Any]) -> ModelShape | None:
    """From a transformers config.json (also MLX, EXL2/3, OpenVINO repos) or an
    ONNX Runtime GenAI genai_config.json."""
    model = config.get("model")
    if isinstance(model, dict) and isinstance(model.get("decoder"), dict):
        dec = model["decoder"]
        layers, kv, hd = (_int(dec.get("num_hidden_layers")), _int(dec.get("num_key_value_heads")),
                          _int(dec.get("head_size")))
        if layers and kv and hd:
            return ModelShape(layers, kv, hd, _int(model.get("context_length")))
        return None
    text = config.get("text_config")
    cfg: dict[str, Any] = text if isinstance(text, dict) else config
    layers = _int(cfg.get("num_hidden_layers"))
    heads = _int(cfg.get("num_attention_heads"))
    kv = _int(cfg.get("num_key_value_heads", heads))
    hd = _int(cfg.get("head_dim"))
    hidden = _int(cfg.get("hidden_size"))
    if hd is None and hidden and heads:
        hd = hidden // heads
    if layers and kv and hd:
        dtype = cfg.get("torch_dtype") or cfg.get("dtype") or config.get("torch_dtype") \
            or config.get("dtype")
        return ModelShape(layers, kv, hd, _int(cfg.get("max_position_embeddings")),
                          DTYPE_BYTES.get(dtype) if isinstance(dtype, str) else None)
    return None


def shape_from_openvino_ir(xml: str) -> ModelShape | None:
    """From a stateful OpenVINO IR (``openvino_model.xml``), for a folder without its
    config.json: the KV cache is the IR's state, a ``ReadValue`` variable for each
    layer's keys and one for its values, shaped ``?,kv_heads,?,head_dim`` (batch and
    sequence dynamic). Variables of other shapes (a recurrent state) hold no tokens and
    are not counted; where the K and V shapes differ, the largest counts for all (an
    estimate on the safe side). The trained context is not in the IR."""
    per_token: list[tuple[int, int]] = []
    for attrs in re.findall(r"<data\s([^>]*\bvariable_id=[^>]*)>", xml):
        found = re.search(r'\bvariable_shape="([^"]*)"', attrs)
        dims = found.group(1).split(",") if found else []
        if len(dims) == 4 and dims[0] == dims[2] == "?" and all(
                d.strip().isdigit() for d in (dims[1], dims[3])):
            per_token.append((int(dims[1]), int(dims[3])))
    if not per_token:
        return None
    heads, head_dim = max(per_token, key=lambda hd: hd[0] * hd[1])
    if not heads or not head_dim:
        return None
    return ModelShape(-(-len(per_token) // 2), heads, head_dim)


#: config.json's torch_dtype (transformers 5: dtype) -> bytes per element
DTYPE_BYTES: dict[str, int] = {"float32": 4, "float16": 2, "bfloat16": 2}


def _int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None


def shape_from_gguf_metadata(meta: Mapping[str, Any]) -> ModelShape | None:
    """From a GGUF file's metadata (``read_gguf(path).metadata``, or
    :func:`localrun.formats.gguf.metadata_from_bytes` for the head of a remote file)."""
    keys = GGUFMetadata(meta)
    layers, kv, hd = keys.n_layers, keys.n_kv_heads or keys.n_heads, keys.head_dim
    if keys.architecture and layers and kv and hd:
        return ModelShape(layers, kv, hd, keys.context_length)
    return None


# --- estimates without the Hub: local files, a parameter count --------------------------

#: Files that hold a model's weights (their sizes are the weights' bytes).
WEIGHT_FILE = re.compile(r"(?i)\.(gguf|safetensors|bin|onnx|onnx\.data|onnx_data|data)$")
#: A GGUF shard's name: ``model-00001-of-00003.gguf``.
GGUF_SHARD = re.compile(r"(?i)^(.*)-(\d{5})-of-(\d{5})\.gguf$")


def gguf_shards(path: Path) -> list[Path]:
    """Every shard of the GGUF model ``path`` is (itself alone when not sharded)."""
    m = GGUF_SHARD.match(path.name)
    if m is None:
        return [path]
    n = int(m.group(3))
    shards = [path.with_name(f"{m.group(1)}-{i:05d}-of-{m.group(3)}.gguf")
              for i in range(1, n + 1)]
    return [s for s in shards if s.is_file()]


def local_weights_bytes(path: Path) -> int:
    """Bytes of a local model's weights: a GGUF file (all its shards, and the projector
    beside it: :func:`~localrun.formats.projector.projector_beside`), or the weight
    files of a model folder (safetensors, ONNX data, OpenVINO .bin), not its other files."""
    if path.is_file():
        files = gguf_shards(path) if path.suffix.lower() == ".gguf" else [path]
        if path.suffix.lower() == ".gguf":  # a vision model's projector loads with it
            from localrun.formats.projector import projector_beside

            files += [p for p in (projector_beside(path),) if p is not None]
    else:
        files = [f for f in path.iterdir() if f.is_file() and WEIGHT_FILE.search(f.name)]
    return sum(f.stat().st_size for f in files)


def local_parameters(path: Path) -> int | None:
    """A GGUF model's parameter count (the elements of its tensors, every shard); None for
    other formats (a quantized folder's tensors are packed, their elements not weights)."""
    from localrun.formats.gguf import read_gguf

    if not (path.is_file() and path.suffix.lower() == ".gguf"):
        return None
    return sum(read_gguf(s).parameters for s in gguf_shards(path)) or None


def local_shape(path: Path) -> tuple[ModelShape | None, str | None]:
    """A local model's shape and the file it came from: a GGUF header, else the folder's
    (or, for an ONNX variant folder, its parent's) genai_config.json or config.json,
    else an OpenVINO IR's state variables."""
    import json

    if path.is_file():
        if path.suffix.lower() != ".gguf":
            return None, None
        from localrun.formats.gguf import read_gguf

        return shape_from_gguf_metadata(read_gguf(path).metadata), "GGUF header"
    for folder in (path, path.parent):
        for name in ("genai_config.json", "config.json"):
            f = folder / name
            try:
                data = json.loads(f.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                continue
            shape = shape_from_config(data) if isinstance(data, dict) else None
            if shape is not None:
                return shape, name
    for name in ("openvino_model.xml", "openvino_language_model.xml"):
        try:
            shape = shape_from_openvino_ir((path / name).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if shape is not None:
            return shape, name
    return None, None


@dataclass(frozen=True)
class LocalSize:
    """What a model on disk weighs: its weights' bytes, its shape (None: unknown, so is
    its KV cache) and the file the shape was read from."""

    weights_bytes: int
    shape: ModelShape | None
    shape_from: str | None


def local_size(path: Path) -> LocalSize:
    """A model on disk: its weights' bytes (:func:`local_weights_bytes`) and shape
    (:func:`local_shape`). Raises OSError when its files cannot be read."""
    shape, where = local_shape(path)
    return LocalSize(local_weights_bytes(path), shape, where)


def local_estimate(path: Path, context: int | None, *, engine: EngineMemory = UNKNOWN_ENGINE,
                   size: LocalSize | None = None) -> MemoryEstimate:
    """A model on disk at ``context`` (None: the default context rule) on the engine whose
    row is ``engine``: its :func:`local_size` (``size``: read already), the context it
    loads with (:func:`context_window`): the one way from a model's path to its estimate.
    Raises OSError when its files cannot be read."""
    s = size if size is not None else local_size(path)
    ctx = context_window(context, s.shape.trained_context if s.shape else None)
    return estimate(s.weights_bytes, s.shape, ctx, engine=engine)


def weights_at(parameters: float, bits_per_weight: float) -> int:
    """Bytes of ``parameters`` weights quantized to ``bits_per_weight``."""
    return int(parameters * bits_per_weight / 8)


def verdict(est: MemoryEstimate, budget: int | None, max_context: int | None) -> str:
    """One line: whether ``est`` fits ``budget``, with the numbers (as a Hub plan says it);
    a KV cache that could not be counted makes the need a lower bound."""
    need = _gib(est.total_bytes) if est.kv_known else f"at least {_gib(est.total_bytes)}"
    kv = "" if est.kv_known else " (KV cache not counted)"
    if budget is None:
        return f"needs {need}{kv} (no memory budget given)"
    fits = est.total_bytes <= budget
    line = (f"{'fits' if fits else 'does NOT fit'}: needs {need} of {_gib(budget)} at context "
            f"{est.context:,}{kv}")
    if not fits and max_context:
        line += f"; the largest context that fits is {max_context:,}"
    elif not fits and est.weights_bytes + est.overhead_bytes > budget:
        line += f"; the weights alone take {_gib(est.weights_bytes)}"
    return line
