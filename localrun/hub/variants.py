"""Variant discovery: which format a repo holds, the variants inside it (GGUF files and
shard sets, ONNX folders, EXL bpw branches, ...), which a quant tag names, which belong to
the requested model size, and which repos to look in (catalog entries, the Hub's model
tree ranked by publisher trust)."""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass

import httpx2
from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

from localrun.hub.client import api, offline
from localrun.hub.listing import Listing
from localrun.naming.catalog import CatalogEntry

#: GGUF quant -> approximate bits per weight (llama.cpp's quantize table); the quality scale.
GGUF_BPW: dict[str, float] = {
    "F32": 32.0, "BF16": 16.0, "F16": 16.0, "Q8_0": 8.5, "Q6_K": 6.56, "Q6_K_L": 6.6,
    "Q5_1": 6.0, "Q5_K_L": 5.9, "Q5_K_M": 5.69, "Q5_K_S": 5.54, "Q5_0": 5.5,
    "UD-Q4_K_XL": 4.9, "Q4_K_L": 4.9, "Q4_K_M": 4.85, "Q4_K_S": 4.58, "Q4_1": 5.0,
    "Q4_0": 4.55, "IQ4_NL": 4.5, "IQ4_XS": 4.25, "MXFP4_MOE": 4.25, "MXFP4": 4.25,
    "Q3_K_XL": 4.3, "Q3_K_L": 4.27, "Q3_K_M": 3.91, "IQ3_M": 3.66, "Q3_K_S": 3.5,
    "IQ3_S": 3.44, "IQ3_XS": 3.3, "IQ3_XXS": 3.06, "Q2_K_L": 3.2, "Q2_K": 2.96,
    "IQ2_M": 2.7, "IQ2_S": 2.5, "IQ2_XS": 2.31, "IQ2_XXS": 2.06, "IQ1_M": 1.75, "IQ1_S": 1.56,
}

TRUSTED_QUANTIZERS: tuple[str, ...] = (
    "ggml-org", "bartowski", "unsloth", "lmstudio-community", "hugging-quants",
    "mlx-community", "OpenVINO", "microsoft", "onnxruntime", "turboderp", "amd",
    "MaziyarPanahi", "QuantFactory",
)

#: Hub tag that marks each format (formats without one are recognised by their files).
FORMAT_TAGS: dict[str, str] = {"gguf": "gguf", "mlx": "mlx", "openvino": "openvino"}

#: Files never needed to run a model.
SKIP_FILE = re.compile(r"(?i)(^|/)(\.gitattributes|[^/]*\.md|measurement\.json|"
                       r"[^/]*\.(png|jpe?g|gif|webp|pdf))$")
#: Weight files (their sizes make up the weights estimate).
WEIGHT_FILE = re.compile(r"(?i)\.(gguf|safetensors|bin|onnx|onnx\.data|onnx_data|data)$")
#: GGUF files that are not the language model.
GGUF_IGNORE = re.compile(r"(?i)(mmproj|imatrix)")
GGUF_SHARD = re.compile(r"(?i)-(\d{5})-of-(\d{5})\.gguf$")
GGUF_QUANT = re.compile(
    r"(?i)(?:^|[-_.])((?:UD-)?(?:I?Q\d(?:_[0-9A-Z]+)*|BF16|F16|F32|MXFP4(?:_MOE)?))$")
BPW_BRANCH = re.compile(r"(?i)^(\d+(?:[._]\d+)?)(?:bpw)?(?:_h\d+)?$")
BITS_IN_NAME = re.compile(r"(?i)(?:^|[-_])(?:q|int|uint|nf)?(\d+)[-_]?bits?(?:$|[-_])")
OV_QUANT = re.compile(r"(?i)-(int4|int8|fp16|nf4|fp32)(?:-(cw|gq|sym|asym))?-ov$")
ONNX_BITS = re.compile(r"(?i)(?:u?int|fp|f)(\d+)")


@dataclass(frozen=True)
class Candidate:
    listing: Listing
    format: str
    quant: str | None
    bpw: float
    files: tuple[str, ...]
    primary: str | None = None
    subfolder: str | None = None
    penalty: float = 0.0  # pushes device-mismatched variants back
    pinned: bool = False  # the file/folder/branch a catalog entry names (wins ties)

    @property
    def weights_bytes(self) -> int:
        return sum(self.listing.files[f].size for f in self.files if WEIGHT_FILE.search(f))

    @property
    def label(self) -> str:
        where = f"@{self.listing.revision}" if self.format in ("exl2", "exl3") else ""
        sub = f"/{self.subfolder}" if self.subfolder else ""
        return f"{self.listing.repo}{where}{sub}" + (f":{self.quant}" if self.quant else "")


# --- format and variants of one repo ----------------------------------------------------------

def repo_format(listing: Listing) -> str:
    """The format a repo holds, from its tags, file names and config."""
    names = list(listing.files)
    qc = (listing.config or {}).get("quantization_config")
    method = qc.get("quant_method") if isinstance(qc, dict) else None
    if any(n.lower().endswith(".gguf") and not GGUF_IGNORE.search(n) for n in names):
        return "gguf"
    if any(n.rsplit("/", 1)[-1] == "genai_config.json" for n in names):
        return "onnx"
    if any(n.rsplit("/", 1)[-1] in ("openvino_model.xml", "openvino_language_model.xml")
           for n in names):
        return "openvino"
    if method in ("exl2", "exl3"):
        return str(method)
    low = listing.repo.lower()
    if low.endswith(("-exl2", "_exl2")):
        return "exl2"
    if low.endswith(("-exl3", "_exl3")):
        return "exl3"
    if "mlx" in listing.tags or isinstance((listing.config or {}).get("quantization"), dict):
        return "mlx"
    if "gguf" in listing.tags:
        return "gguf"
    if isinstance(method, str):
        return method
    return "hf"


def gguf_quant(filename: str) -> str | None:
    """``qwen2.5-0.5b-instruct-q4_k_m.gguf`` -> ``Q4_K_M`` (shard suffixes ignored)."""
    stem = GGUF_SHARD.sub("", filename.rsplit("/", 1)[-1])
    stem = re.sub(r"(?i)\.gguf$", "", stem)
    m = GGUF_QUANT.search(stem)
    return m.group(1).upper() if m else None


def _gguf_candidates(listing: Listing) -> tuple[list[Candidate], list[str]]:
    """One candidate per model file (shards grouped); also the names of incomplete shard
    sets. A repo may hold several models with the same quant (``…-1.5B-Q4_K_M.gguf`` and
    ``…-7B-Q4_K_M.gguf``): each file is its own candidate, never folded into another."""
    singles: list[str] = []
    shard_sets: dict[str, list[str]] = {}
    for name in sorted(listing.files):
        if not name.lower().endswith(".gguf") or GGUF_IGNORE.search(name):
            continue
        if GGUF_SHARD.search(name):
            shard_sets.setdefault(GGUF_SHARD.sub("", name).lower(), []).append(name)
        else:
            singles.append(name)
    cands: list[Candidate] = []
    incomplete: list[str] = []
    for f in singles:
        q = gguf_quant(f)
        cands.append(Candidate(listing, "gguf", q, GGUF_BPW.get(q or "?", 8.0),
                               (f, *_projector(listing, f)), primary=f))
    for shards in shard_sets.values():
        m = GGUF_SHARD.search(shards[0])
        assert m is not None
        n = int(m.group(2))
        stem = GGUF_SHARD.sub("", shards[0])
        want = [f"{stem}-{i:05d}-of-{n:05d}.gguf" for i in range(1, n + 1)]
        have = {s.lower(): s for s in shards}
        missing = [w for w in want if w.lower() not in have]
        if missing:
            incomplete.extend(missing)
            continue
        ordered = tuple(have[w.lower()] for w in want)
        q = gguf_quant(ordered[0])
        cands.append(Candidate(listing, "gguf", q, GGUF_BPW.get(q or "?", 8.0),
                               ordered + _projector(listing, ordered[0]), primary=ordered[0]))
    return cands, incomplete


#: a projector's types, best first (llama.cpp runs its projector at the type it has)
_PROJECTOR_TYPES = ("F16", "BF16", "Q8_0", "F32")


def _projector(listing: Listing, model: str) -> tuple[str, ...]:
    """The projector a vision model's GGUF needs beside it (``mmproj*.gguf`` in its
    folder, the F16 one where there are several), downloaded and sized with it; ()."""
    from localrun.formats.projector import MMPROJ

    folder = model.rpartition("/")[0]
    found = [n for n in listing.files if MMPROJ.search(n) and n.rpartition("/")[0] == folder]
    if not found:
        return ()
    rank = {t: i for i, t in enumerate(_PROJECTOR_TYPES)}
    return (min(found, key=lambda n: (rank.get(gguf_quant(n) or "", 9), n)),)


def _all_files(listing: Listing, under: str = "") -> tuple[str, ...]:
    prefix = f"{under}/" if under else ""
    return tuple(sorted(n for n in listing.files
                        if n.startswith(prefix) and not SKIP_FILE.search(n)))


def _named_bits(name: str) -> float | None:
    low = name.lower()
    if re.search(r"(?:^|[-_])(bf16|fp16|f16)(?:$|[-_])", low):
        return 16.0
    m = BITS_IN_NAME.search(low)
    return float(m.group(1)) if m else None


def device_kind(device: str | None) -> str | None:
    """``"GPU.1"`` / ``"cuda:0"`` / ``"NPU"`` -> ``"gpu"`` / ``"cuda"`` / ``"npu"``."""
    if not device:
        return None
    return re.split(r"[:.]", device.strip().lower(), maxsplit=1)[0] or None


def variant_candidates(listing: Listing, fmt: str, device: str | None) -> tuple[
        list[Candidate], list[str]]:
    """Every variant of ``fmt`` inside one repo listing (and missing shard names)."""
    device = device_kind(device)
    if fmt == "gguf":
        return _gguf_candidates(listing)
    if fmt == "onnx":
        out = []
        for n in listing.files:
            parts = n.split("/")
            if parts[-1] != "genai_config.json":
                continue
            sub = "/".join(parts[:-1])
            label = sub or listing.repo.split("/")[-1]
            m = ONNX_BITS.search(label.rsplit("/", 1)[-1])
            bits = float(m.group(1)) if m else 16.0
            on_gpu = bool(re.search(r"(?i)(gpu|cuda|dml|directml)", sub))
            want_gpu = device in ("cuda", "gpu", "dml", "directml", "rocm")
            quant = f"int{int(bits)}" if m and "int" in m.group(0).lower() else (
                f"fp{int(bits)}" if m else None)
            out.append(Candidate(listing, "onnx", quant, bits, _all_files(listing, sub),
                             subfolder=sub or None,
                             penalty=0.0 if on_gpu == want_gpu else 0.5))
        return out, []
    name = listing.repo.split("/")[-1]
    if fmt == "openvino":
        if ov_missing(listing.files):
            return [], []  # OpenVINO GenAI cannot load it: not a candidate
        m = OV_QUANT.search(name)
        quant = m.group(1).lower() if m else None
        bits = {"int4": 4.0, "nf4": 4.0, "int8": 8.0, "fp16": 16.0, "fp32": 32.0}.get(
            quant or "", 16.0)
        npu_tuned = bool(m and m.group(2))
        penalty = 0.0 if npu_tuned == (device == "npu") else 0.5
        return [Candidate(listing, fmt, quant, bits, _all_files(listing), penalty=penalty)], []
    if fmt in ("exl2", "exl3"):
        qc = (listing.config or {}).get("quantization_config") or {}
        qbits = qc.get("bits") if isinstance(qc, dict) else None
        m = BPW_BRANCH.match(listing.revision)
        bpw = float(qbits) if isinstance(qbits, (int, float)) else (
            float(m.group(1).replace("_", ".")) if m else None)
        if bpw is None or not any(n.endswith(".safetensors") for n in listing.files):
            return [], []
        return [Candidate(listing, fmt, listing.revision if m else f"{bpw}bpw", bpw,
                      _all_files(listing))], []
    if fmt == "mlx":
        q = (listing.config or {}).get("quantization")
        mbits = q.get("bits") if isinstance(q, dict) else None
        b = float(mbits) if isinstance(mbits, int) else _named_bits(name) or 16.0
        quant = "bf16" if b == 16.0 else f"{int(b)}bit"
        return [Candidate(listing, fmt, quant, b, _all_files(listing))], []
    return [Candidate(listing, fmt, None, 16.0, _all_files(listing))], []


#: What OpenVINO GenAI's LLMPipeline loads: the model IR and the tokenizer IRs beside it
#: (community exports often lack the latter: the engine then refuses the folder).
OV_MODEL_XML = ("openvino_model.xml", "openvino_language_model.xml")
OV_TOKENIZER_XML = ("openvino_tokenizer.xml", "openvino_detokenizer.xml")


def ov_missing(files: Iterable[str]) -> list[str]:
    """The files an OpenVINO IR repo lacks for OpenVINO GenAI ([] when it is complete)."""
    names = {f for f in files if "/" not in f}
    xml = next((x for x in OV_MODEL_XML if x in names), None)
    need = [xml[:-4] + ".bin"] if xml else [f"{OV_MODEL_XML[0]} (or {OV_MODEL_XML[1]})"]
    return [n for n in (*need, *OV_TOKENIZER_XML) if n not in names]


def unusable(lst: Listing, fmt: str) -> str | None:
    """Why a repo in ``fmt`` has nothing an engine can run, or None."""
    if fmt == "openvino" and ov_missing(lst.files):
        return "lacks " + ", ".join(ov_missing(lst.files))
    if fmt not in ("exl2", "exl3") and not variant_candidates(lst, fmt, None)[0]:
        return f"holds no complete {fmt} model"
    return None


def quant_matches(cand_quant: str | None, cand_bpw: float, fmt: str, tag: str) -> bool:
    """Does a user's quant tag (``Q4_K_M``, ``4bit``, ``int4``, ``4.0bpw``) name this variant?"""
    t = tag.strip().lower()
    q = (cand_quant or "").lower()
    if q and t == q:
        return True
    if fmt == "gguf":
        return bool(q) and (t.replace("-", "_") == q.replace("-", "_"))
    if fmt in ("exl2", "exl3"):
        bm = BPW_BRANCH.match(t)
        return bm is not None and abs(float(bm.group(1).replace("_", ".")) - cand_bpw) < 1e-6
    m = re.match(r"^(?:q|u?int|nf)?(\d+)(?:[-_]?bits?)?$", t)
    if m:
        return abs(float(m.group(1)) - cand_bpw) < 1e-6
    if t in ("bf16", "fp16", "f16"):
        return cand_bpw == 16.0
    return False


# --- several models in one repo -------------------------------------------------------------------

#: A parameter count in a name: ``1.5B``, ``7b``, ``135M`` (not ``int4``, ``8bit``, ``2.5bpw``).
MODEL_SIZE = re.compile(r"(?i)(?<![a-z0-9.])(\d+(?:\.\d+)?)([bm])(?![a-z0-9])")


def model_sizes(text: str) -> set[float]:
    """Parameter counts (in billions) named in a repo, folder or file name."""
    return {float(n) / (1000.0 if unit.lower() == "m" else 1.0)
            for n, unit in MODEL_SIZE.findall(text)}


def model_size(repo: str) -> float | None:
    """The parameter count a repo id names (``Qwen/Qwen2.5-0.5B-Instruct`` -> 0.5), if one."""
    sizes = model_sizes(repo.split("/")[-1])
    return next(iter(sizes)) if len(sizes) == 1 else None


def _size_label(b: float) -> str:
    return f"{b * 1000:g}M" if b < 1 else f"{b:g}B"


def _other_size(c: Candidate, wanted: float) -> set[float] | None:
    """The sizes a candidate's own folder or file names, when none is ``wanted``."""
    text = c.subfolder or c.primary or ""
    sizes = model_sizes(text)
    if sizes and not any(math.isclose(s, wanted, rel_tol=0.02) for s in sizes):
        return sizes
    return None


def keep_model_size(cands: list[Candidate], wanted: float | None
                    ) -> tuple[list[Candidate], list[str]]:
    """Drop the variants of other models in multi-model repos (a 7B folder next to the 1.5B
    one, ``…-7B-Q4_K_M.gguf`` next to ``…-1.5B-…``); one reason line per repo."""
    if wanted is None:
        return cands, []
    kept: list[Candidate] = []
    dropped: dict[str, set[float]] = {}
    for c in cands:
        other = _other_size(c, wanted)
        if other is None:
            kept.append(c)
        else:
            dropped.setdefault(c.listing.repo, set()).update(other)
    lines = [f"{repo} also holds other models ({', '.join(_size_label(x) for x in sorted(sz))}"
             f"): only its {_size_label(wanted)} variants are candidates"
             for repo, sz in dropped.items()]
    return kept, lines


# --- discovery ----------------------------------------------------------------------------------

def trust_rank(repo: str, own_org: str | None) -> int:
    org = repo.split("/")[0]
    if own_org and org.lower() == own_org.lower():
        return 0
    for i, name in enumerate(TRUSTED_QUANTIZERS):
        if org.lower() == name.lower():
            return 1 + i
    return 100


def _search_children(base: str, fmt: str) -> list[tuple[str, int]]:
    """Quantized children of ``base`` in ``fmt`` from the Hub's model tree: (repo, downloads)."""
    filters = [f"base_model:quantized:{base}"]
    if fmt in FORMAT_TAGS:
        filters.append(FORMAT_TAGS[fmt])
    found = []
    for m in api().list_models(filter=filters, sort="downloads", limit=50):
        rid = m.id
        tags = m.tags or []
        low = rid.lower()
        if fmt in FORMAT_TAGS or (fmt == "onnx" and ("onnx" in low or "onnx" in tags)) or (
                fmt in ("exl2", "exl3") and fmt in low):
            found.append((rid, int(m.downloads or 0)))
    return found


def candidate_repos(base: str | None, fmt: str, entry: CatalogEntry | None, *,
                    search: bool = True) -> list[str]:
    """Repos to look in, best first: verified catalog variants, then the Hub's model
    tree ranked by publisher trust and downloads (``search`` and the Hub reachable), then
    unverified catalog entries."""
    verified = [v.repo for v in (entry.variants_for(fmt) if entry else []) if v.verified]
    unverified = [v.repo for v in (entry.variants_for(fmt) if entry else []) if not v.verified]
    discovered: list[str] = []
    if base and search and not offline():
        own = base.split("/")[0]
        try:
            children = _search_children(base, fmt)
        except (HfHubHTTPError, httpx2.HTTPError, OfflineModeIsEnabled):
            children = []
        children.sort(key=lambda rd: (trust_rank(rd[0], own), -rd[1]))
        discovered = [r for r, _ in children]
    out: list[str] = []
    for r in [*verified, *discovered, *unverified]:
        if r not in out:
            out.append(r)
    return out


def names_a_variant(repo: str) -> bool:
    """Does a repo id name a quantized variant (``…-GGUF``, ``…-4bit``, ``…-int4-ov``)?
    Offline, such a name is never stood in for by another publisher's cached repo."""
    return bool(re.search(r"(?i)(gguf|mlx|onnx|exl[23]|awq|gptq|-ov$|\d+[-_]?bits?|"
                          r"(?:^|[-_])(?:u?int\d+|fp\d+|bf16|q\d\w*)(?:$|[-_]))",
                          repo.split("/")[-1]))
