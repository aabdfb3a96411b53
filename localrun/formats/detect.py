"""Tell a model's format from its files alone, without any engine.

Recognised and served: GGUF, MLX, EXL2, EXL3, OpenVINO IR, ONNX Runtime GenAI.
Recognised but not served (refused with the way out): GPTQ, AWQ, FP8,
compressed-tensors, bitsandbytes, plain fp16/bf16 safetensors. Damaged inputs (bad
JSON, truncated headers, missing files) raise ModelFileError, never a raw exception.

Detection looks only where a model's files can be: a folder's own files, and (for the
way-out messages) at most :data:`WALK_DEPTH` folders below it: an ONNX GenAI repo keeps
each variant in a subfolder (``cpu_and_mobile/cpu-int4-.../``), a transformers.js export
its ``.onnx`` files in ``onnx/``. A folder with more than :data:`WALK_ENTRIES` entries
there is not a model folder (``/``, a home directory) and is refused as such, quickly.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from localrun.errors import ModelFileError
from localrun.formats.gguf import is_gguf, read_gguf
from localrun.formats.integrity import check_model_files
from localrun.formats.safetensors import SafetensorsHeader, read_safetensors_header

#: quantization_config.quant_method -> format
QUANT_METHODS: dict[str, str] = {
    "exl2": "exl2", "exl3": "exl3", "gptq": "gptq", "awq": "awq", "fp8": "fp8",
    "compressed-tensors": "compressed-tensors", "compressed_tensors": "compressed-tensors",
    "bitsandbytes": "bitsandbytes", "bitsandbytes_4bit": "bitsandbytes",
    "bitsandbytes_8bit": "bitsandbytes", "gptq_marlin": "gptq", "awq_marlin": "awq",
    "mxfp4": "mxfp4",
}

#: Tensor-name suffixes that give a format away when config.json says nothing.
TENSOR_MARKERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("exl3", (".trellis", ".suh", ".svh")),
    ("exl2", (".q_weight", ".q_invperm", ".q_scale")),
    ("gptq", (".qweight", ".qzeros", ".g_idx")),
    ("mlx", (".biases",)),  # MLX affine quantization keeps .scales and .biases
)

#: Files that sit next to a GGUF model but are not the model.
GGUF_NOT_MODEL = re.compile(r"(^mmproj|imatrix|^ggml-vocab)", re.I)
GGUF_SHARD = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.I)

OPENVINO_MODEL_FILES = ("openvino_model.xml", "openvino_language_model.xml")
OPENVINO_TOKENIZER_FILES = ("openvino_tokenizer.xml", "openvino_detokenizer.xml")

#: Folders below a model folder that detection looks into (variants, ``onnx/``), and the
#: most files and folders it reads there before deciding it is not a model folder. A
#: Hugging Face repo holds tens to hundreds; ``/`` holds millions.
WALK_DEPTH = 2
WALK_ENTRIES = 4096

#: safetensors dtype -> the name users know for unquantized weights
DTYPE_NAMES: dict[str, str] = {"BF16": "bf16", "F16": "fp16", "F32": "fp32"}


@dataclass(frozen=True)
class DetectedModel:
    format: str
    path: str  # the file or folder an engine should be given
    quantization: str | None = None
    architecture: str | None = None
    context_length: int | None = None
    details: dict[str, Any] = field(default_factory=dict)


def read_json(path: Path, *, required: bool = False) -> dict[str, Any]:
    """A JSON object from a model's file; ``{}`` when an optional file is absent."""
    if not path.is_file():
        if required:
            raise ModelFileError(str(path.parent), f"{path.name} is missing")
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelFileError(str(path), f"unreadable JSON ({e})") from e
    if not isinstance(data, dict):
        raise ModelFileError(str(path), "expected a JSON object")
    return data


def detect(path: str | os.PathLike[str]) -> DetectedModel:
    """Detect the format of a model file or folder; raise ModelFileError if unusable,
    including a weight file shorter than the model's own metadata says (integrity.py):
    a truncated download is refused here, before any engine opens it."""
    found = _detect(path)
    check_model_files(found.path, found.format)
    return found


def _detect(path: str | os.PathLike[str]) -> DetectedModel:
    p = Path(path).expanduser()
    if not p.exists():
        raise ModelFileError(str(p), "no such file or folder")
    if p.is_file():
        if p.suffix.lower() == ".gguf" or is_gguf(p):
            return _gguf(p)
        if p.suffix.lower() in (".safetensors", ".onnx", ".xml", ".json"):
            # a file inside a model folder: the folder is the model
            return _detect_dir(p.parent)
        raise ModelFileError(str(p), "not a model file localrun knows (expected a .gguf file "
                             "or a model folder)")
    return _detect_dir(p)


def _gguf(p: Path) -> DetectedModel:
    info = read_gguf(p)
    m = GGUF_SHARD.search(p.name)
    details: dict[str, Any] = {"file_size": info.file_size}
    if m:
        details["shards"] = int(m.group(2))
    return DetectedModel("gguf", str(p), info.quantization, info.architecture,
                         info.context_length, details)


def walk(folder: Path, depth: int = WALK_DEPTH, limit: int = WALK_ENTRIES) -> list[Path]:
    """The files in ``folder`` and in its folders at most ``depth`` levels below
    (symlinked folders are not followed; unreadable ones are skipped); ModelFileError
    once more than ``limit`` entries have been seen, without reading further."""
    files: list[Path] = []
    seen = 0
    level = [folder]
    for down in range(depth + 1):
        below: list[Path] = []
        for d in level:
            for e in _entries(d, must=down == 0):
                seen += 1
                if seen > limit:
                    raise _not_a_model_folder(folder, limit, depth)
                try:
                    if e.is_dir(follow_symlinks=False):
                        below.append(Path(e.path))
                    elif e.is_file():
                        files.append(Path(e.path))
                except OSError:
                    continue
        level = below
    return files


def _entries(d: Path, *, must: bool) -> Iterator[os.DirEntry[str]]:
    """The entries of folder ``d``; an unreadable one has none (``must``: it is the
    model folder itself, and ModelFileError says why it cannot be read)."""
    try:
        with os.scandir(d) as entries:
            yield from entries
    except OSError as err:
        if must:
            raise ModelFileError(str(d), err.strerror or str(err)) from err


def folder_bytes(path: str | os.PathLike[str]) -> int:
    """Bytes of a model file, or of the files of a model folder (as far as detection
    looks: :func:`walk`); ModelFileError for a folder that is not a model folder."""
    p = Path(path)
    if not p.is_dir():
        return p.stat().st_size
    total = 0
    for f in walk(p):
        try:
            total += f.stat().st_size
        except OSError:
            continue
    return total


def _not_a_model_folder(p: Path, limit: int, depth: int) -> ModelFileError:
    where = f"in it and {depth} levels below" if depth else "in it"
    return ModelFileError(
        str(p), f"does not look like a model folder: more than {limit:,} files and folders "
        f"{where} (a model folder holds one model's files)",
        hint="pass the model's .gguf file or the folder that holds its config.json, "
        "genai_config.json or openvino_model.xml")


def _top_names(p: Path) -> set[str]:
    """The names in the folder itself (at most WALK_ENTRIES: a model folder)."""
    names: set[str] = set()
    for e in _entries(p, must=True):
        names.add(e.name)
        if len(names) > WALK_ENTRIES:
            raise _not_a_model_folder(p, WALK_ENTRIES, 0)
    return names


def _detect_dir(p: Path) -> DetectedModel:
    names = _top_names(p)
    config = read_json(p / "config.json", required=True) if "config.json" in names else None
    if "genai_config.json" in names:
        return _onnx_genai(p, config)
    if any(n in names for n in OPENVINO_MODEL_FILES):
        return _openvino(p, names, config)
    safetensors = sorted(n for n in names if n.endswith(".safetensors"))
    ggufs = sorted(n for n in names if n.lower().endswith(".gguf")
                   and not GGUF_NOT_MODEL.search(n))
    if ggufs and not safetensors:
        return _gguf_in_dir(p, ggufs)
    if config is not None:
        return _from_config(p, names, safetensors, config)
    if safetensors:
        raise ModelFileError(str(p), "safetensors weights without config.json: the model's "
                             "architecture is unknown")
    _refuse_nested(p)
    raise ModelFileError(str(p), "no model files found (looked for *.gguf, config.json + "
                         "*.safetensors, genai_config.json, openvino_model.xml)")


def _refuse_nested(p: Path) -> None:
    """A folder whose model files are further down: ONNX GenAI variants in subfolders
    (pass one), or ONNX files that are not a GenAI model (the way to make one)."""
    files = walk(p)
    variants = sorted(str(f.parent.relative_to(p)) for f in files
                      if f.name == "genai_config.json" and f.parent != p)
    if variants:
        raise ModelFileError(
            str(p), f"holds {len(variants)} ONNX Runtime GenAI model"
            f"{'s' if len(variants) > 1 else ''} in subfolders: " + ", ".join(variants[:5]),
            hint=f"pass the folder of the one you want, e.g. {p / variants[0]}")
    onnx = sorted(str(f.relative_to(p)) for f in files if f.name.endswith(".onnx"))
    if onnx:
        raise _not_genai(p, onnx)


def _gguf_in_dir(p: Path, ggufs: list[str]) -> DetectedModel:
    shards: dict[str, list[str]] = {}
    singles = []
    for n in ggufs:
        m = GGUF_SHARD.search(n)
        if m:
            shards.setdefault(n[: m.start()], []).append(n)
        else:
            singles.append(n)
    models = singles + [sorted(v)[0] for v in shards.values()]
    if len(models) > 1:
        raise ModelFileError(str(p), "several GGUF models in one folder: "
                             + ", ".join(models), hint="pass the .gguf file you want")
    first = models[0]
    m = GGUF_SHARD.search(first)
    if m:
        stem, total = first[: m.start()], int(m.group(2))
        want = {f"{stem}-{i:05d}-of-{total:05d}.gguf" for i in range(1, total + 1)}
        missing = sorted(want - set(ggufs))
        if missing:
            raise ModelFileError(str(p), f"GGUF split into {total} files, missing: "
                                 + ", ".join(missing))
    return _gguf(p / first)


def _onnx_genai(p: Path, config: dict[str, Any] | None) -> DetectedModel:
    cfg_path = p / "genai_config.json"
    cfg = read_json(cfg_path, required=True)
    model = cfg.get("model")
    if not isinstance(model, dict):
        raise ModelFileError(str(cfg_path), "no 'model' section")
    decoder = model.get("decoder")
    filename = decoder.get("filename") if isinstance(decoder, dict) else None
    if not isinstance(filename, str):
        raise ModelFileError(str(cfg_path), "no model.decoder.filename")
    if not (p / filename).is_file():
        raise ModelFileError(str(p), f"genai_config.json names {filename}, which is missing")
    providers: list[str] = []
    opts = decoder.get("session_options") if isinstance(decoder, dict) else None
    if isinstance(opts, dict):
        for entry in opts.get("provider_options") or []:
            if isinstance(entry, dict):
                providers += [str(k) for k in entry]
    ctx = model.get("context_length")
    arch = model.get("type")
    quant = _quant_from_name(p)
    return DetectedModel("onnx", str(p), quant, str(arch) if arch else None,
                         ctx if isinstance(ctx, int) else None,
                         {"providers": providers or ["cpu"], "decoder": filename})


def _quant_from_name(p: Path) -> str | None:
    # ONNX GenAI folders name their variant (cpu-int4-rtn-block-32, cuda-fp16, ...)
    m = re.search(r"(int4|int8|fp16|fp32|bf16|q4)", str(p).lower())
    return m.group(1) if m else None


def _not_genai(p: Path, onnx: list[str]) -> ModelFileError:
    return ModelFileError(
        str(p),
        "ONNX files without genai_config.json (" + ", ".join(onnx[:3]) + ") are a "
        "transformers.js/Optimum export, not an ONNX Runtime GenAI model",
        hint="use a GenAI variant (repos with genai_config.json), or build one: "
        "python -m onnxruntime_genai.models.builder -i MODEL_DIR -o OUT -p int4 -e cpu",
    )


def _openvino(p: Path, names: set[str], config: dict[str, Any] | None) -> DetectedModel:
    xml = next(n for n in OPENVINO_MODEL_FILES if n in names)
    missing = [n for n in (xml[:-4] + ".bin", *OPENVINO_TOKENIZER_FILES) if n not in names]
    if missing:
        raise ModelFileError(
            str(p), "OpenVINO IR model is incomplete, missing: " + ", ".join(missing),
            hint="re-download the model (localrun pull MODEL); to make tokenizer IRs: "
            "convert_tokenizer MODEL --with-detokenizer -o " + str(p),
        )
    quant = None
    if "openvino_config.json" in names:
        qc = read_json(p / "openvino_config.json", required=True).get("quantization_config")
        if isinstance(qc, dict) and qc.get("bits"):
            quant = f"int{qc['bits']}"
    quant = quant or _quant_from_name(p)
    arch, ctx = _arch_ctx(config)
    return DetectedModel("openvino", str(p), quant, arch, ctx,
                         {"model_file": xml, "tokenizer": True})


def _arch_ctx(config: dict[str, Any] | None) -> tuple[str | None, int | None]:
    if config is None:
        return None, None
    archs = config.get("architectures")
    arch = archs[0] if isinstance(archs, list) and archs and isinstance(archs[0], str) \
        else config.get("model_type")
    ctx = config.get("max_position_embeddings")
    return (str(arch) if arch else None), (ctx if isinstance(ctx, int) else None)


def _from_config(p: Path, names: set[str], safetensors: list[str],
                 config: dict[str, Any]) -> DetectedModel:
    arch, ctx = _arch_ctx(config)
    weights = _check_shards(p, names, safetensors)
    qc = config.get("quantization_config")
    if isinstance(qc, dict) and isinstance(qc.get("quant_method"), str):
        method = qc["quant_method"].lower()
        fmt = QUANT_METHODS.get(method, method)
        if weights:
            read_safetensors_header(p / weights[0])  # damage check
        return DetectedModel(fmt, str(p), _quant_label(fmt, qc), arch, ctx,
                             {"quantization_config": qc})
    mlxq = config.get("quantization")
    if isinstance(mlxq, dict) and "bits" in mlxq:
        if weights:
            read_safetensors_header(p / weights[0])
        return DetectedModel("mlx", str(p), f"{mlxq['bits']}bit", arch, ctx,
                             {"group_size": mlxq.get("group_size")})
    if not weights:
        if any(n.endswith(".bin") and n.startswith("pytorch_model") for n in names):
            return DetectedModel("hf", str(p), _dtype(config), arch, ctx,
                                 {"weights": "pytorch_model.bin"})
        _refuse_nested(p)
        raise ModelFileError(str(p), "config.json but no weights (*.safetensors) beside it")
    header = read_safetensors_header(p / weights[0])
    fmt = _format_from_header(header)
    if fmt == "hf":
        dtype = DTYPE_NAMES.get(header.main_dtype or "") or _dtype(config)
        return DetectedModel("hf", str(p), dtype, arch, ctx)
    return DetectedModel(fmt, str(p), None, arch, ctx, {"detected_from": "tensor names"})


def _format_from_header(header: SafetensorsHeader) -> str:
    if header.metadata.get("format") == "mlx":
        return "mlx"
    for fmt, suffixes in TENSOR_MARKERS:
        if header.has_suffix(*suffixes):
            return fmt
    return "hf"


def _check_shards(p: Path, names: set[str], safetensors: list[str]) -> list[str]:
    """The weight files, index first-shard first; raise if the index names missing files."""
    if "model.safetensors.index.json" not in names:
        return safetensors
    index = read_json(p / "model.safetensors.index.json", required=True)
    wmap = index.get("weight_map")
    if not isinstance(wmap, dict) or not wmap:
        raise ModelFileError(str(p / "model.safetensors.index.json"), "no weight_map")
    files = sorted({str(v) for v in wmap.values()})
    missing = [f for f in files if f not in names]
    if missing:
        raise ModelFileError(str(p), f"{len(missing)} of {len(files)} weight files are "
                             "missing: " + ", ".join(missing[:5]))
    return files


def _dtype(config: dict[str, Any]) -> str | None:
    d = config.get("torch_dtype") or config.get("dtype")
    return {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}.get(str(d)) \
        if d else None


def _quant_label(fmt: str, qc: dict[str, Any]) -> str | None:
    bits = qc.get("bits", qc.get("w_bit"))
    if fmt in ("exl2", "exl3"):
        return f"{float(bits):.2f}bpw".replace(".00bpw", ".0bpw") if bits else None
    if fmt == "bitsandbytes":
        return "4bit" if qc.get("load_in_4bit") else "8bit" if qc.get("load_in_8bit") else None
    if fmt == "fp8":
        return "fp8"
    return f"{bits}bit" if bits else None
