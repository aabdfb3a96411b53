"""The Hugging Face Hub: find a model's variant for an engine, plan the fit, download.

The only module that imports ``huggingface_hub``; import it lazily (``import localrun``
must not pull it in). Two steps, so a plan can be shown before any byte moves:

    plan = plan_fetch("qwen2.5:0.5b", backend="llama.cpp", memory_budget_bytes=8 * 2**30)
    plan.require_fit()           # ModelTooLargeError with the numbers, before downloading
    path = fetch(plan, progress=callback)   # the .gguf file or the model folder

Downloads go into the standard HF cache (``HF_HOME``/``HF_HUB_CACHE``), from the commit
the plan listed. Files on plain HTTP (the Hub's 302 to its CDN) are fetched by localrun
into ``blobs/<etag>.localrun.incomplete`` and continued with Range requests after a
dropped connection, an expired signed URL or a killed process; their LFS sha256 is
checked before the blob takes its name, and huggingface_hub links it into the snapshot.
Xet-backed files go through ``hf_hub_download`` (hf_xet), checked after. Both report
progress through the same meter, and both are tried again on 5xx, 429 (Retry-After) and
dropped connections. A disk-space check, and errors that say what to do.
With ``HF_HUB_OFFLINE=1`` (or no network) plans are made from the cache,
and what is missing is named: a name that was downloaded before (an alias, a base repo
id) is planned from what that download resolved it to (:mod:`localrun.pulls`).

Catalog entries are hints, not promises: an entry the Hub no longer has (404, gated, no
usable weights) is passed over with one line in the plan's reasons, and the Hub's model
tree is searched instead. In a repo holding several models (ONNX folders, GGUF files),
only the variants of the requested model size are candidates.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import json
import math
import os
import re
import shutil
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Literal, TypeVar

import httpx2
import huggingface_hub
from huggingface_hub import (
    HfApi,
    constants,
    get_hf_file_metadata,
    get_session,
    hf_hub_download,
    hf_hub_url,
    hf_raise_for_status,
    scan_cache_dir,
)
from huggingface_hub.errors import (
    CacheNotFound,
    GatedRepoError,
    HfHubHTTPError,
    LocalEntryNotFoundError,
    OfflineModeIsEnabled,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

# Public API (documented, and in the ``__all__`` of huggingface_hub.utils' lazy facade,
# which mypy cannot follow).
from huggingface_hub.utils import (  # type: ignore[attr-defined]
    WeakFileLock,
    build_hf_headers,
)

from localrun import memory, pulls
from localrun.backends import BACKENDS, canonical_backend
from localrun.catalog import CatalogEntry, Variant
from localrun.errors import (
    ChecksumError,
    DiskFullError,
    HubAuthError,
    HubNotFoundError,
    HubUnavailableError,
    LocalrunError,
    ModelGatedError,
    ModelTooLargeError,
    NoVariantError,
    OfflineMissingError,
)
from localrun.formats import compat
from localrun.memory import MemoryEstimate, ModelShape
from localrun.refs import ModelRef, as_catalog_alias, default_serves, parse_ref
from localrun.stores import StoredModel, find_lmstudio, find_ollama

Source = Literal["hub", "cache", "ollama", "lmstudio", "local"]

#: The engine a plan is made for when the caller names none (until selection decides).
DEFAULT_BACKEND = "llama.cpp"


def default_backend() -> str:
    """The backend ``localrun pull`` plans for without --backend."""
    return DEFAULT_BACKEND


# --- tables ------------------------------------------------------------------------------

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

#: The quality each format aims for by default (bits per weight); the nearest variant that
#: fits wins. GGUF: Q4_K_M. MLX/OpenVINO/ONNX: 4-bit / int4 first. EXL2/EXL3: the largest
#: bpw that fits (these engines run on a GPU whose memory should be used).
DEFAULT_TARGET: dict[str, float] = {
    "gguf": GGUF_BPW["Q4_K_M"], "mlx": 4.0, "openvino": 4.0, "onnx": 4.0,
    "exl2": math.inf, "exl3": math.inf, "hf": 16.0,
}

#: Publishers whose quantizations are trusted after the model's own org, in order.
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

#: GGUF header bytes read to learn the model's shape (retried once with the larger size).
GGUF_HEADER_READS = (2 * 2**20, 24 * 2**20)
#: Hub repos examined per discovery (the search returns more).
MAX_DISCOVERED = 8


# --- the plan ------------------------------------------------------------------------------

@dataclass(frozen=True)
class PlannedFile:
    path: str  # relative to the repo root
    size: int
    sha256: str | None = None  # LFS checksum, when the Hub gave it
    cached: bool = False


@dataclass(frozen=True)
class QuantOption:
    """One variant considered, with what it would need (shown so users can choose)."""

    repo: str
    quant: str | None
    weights_bytes: int
    needed_bytes: int | None  # None until the model's shape was known
    fits: bool | None
    revision: str | None = None
    subfolder: str | None = None


@dataclass(frozen=True)
class FetchPlan:
    """What to fetch for one model on one engine, and whether it fits. Pure data.

    ``files`` are what :func:`fetch` downloads (only what the engine needs);
    ``primary`` the file the engine opens (first GGUF shard) or None for folders.
    ``fits`` is False when even the chosen variant exceeds ``budget_bytes`` at
    ``context``; :meth:`require_fit` turns that into ModelTooLargeError.
    """

    ref: str
    source: Source
    format: str
    backend: str
    repo: str | None
    revision: str | None
    commit: str | None
    quant: str | None
    subfolder: str | None
    files: tuple[PlannedFile, ...]
    primary: str | None
    local_path: str | None
    memory: MemoryEstimate
    budget_bytes: int | None
    context: int
    max_context: int | None
    fits: bool
    options: tuple[QuantOption, ...] = ()
    reasons: tuple[str, ...] = ()
    gated: bool = False
    asked_quant: str | None = None  # the quant the caller asked for (ref or quant=)

    @property
    def download_bytes(self) -> int:
        return sum(f.size for f in self.files if not f.cached)

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def verdict(self) -> str:
        if self.budget_bytes is None:
            return f"needs {_gib(self.memory.total_bytes)} (no memory budget given)"
        word = "fits" if self.fits else "does NOT fit"
        line = (f"{word}: needs {_gib(self.memory.total_bytes)} of "
                f"{_gib(self.budget_bytes)} at context {self.context:,}")
        if not self.fits and self.max_context:
            line += f"; the largest context that fits is {self.max_context:,}"
        return line

    def require_fit(self) -> None:
        """Raise ModelTooLargeError (with needed/available bytes) unless the plan fits."""
        if self.fits or self.budget_bytes is None:
            return
        raise ModelTooLargeError(
            self.repo or self.ref, quant=self.quant, needed_bytes=self.memory.total_bytes,
            available_bytes=self.budget_bytes, context=self.context,
            max_context=self.max_context or 0, breakdown=self.memory.breakdown())

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["memory"] = self.memory.to_dict()
        d["download_bytes"] = self.download_bytes
        d["verdict"] = self.verdict
        return d


@dataclass(frozen=True)
class DownloadProgress:
    """Reported to fetch()'s callback as bytes arrive. ``delta`` is negative when a file
    starts over: a server that answers a resume request with the whole file, a Xet try
    that failed, a checksum mismatch. ``file_done`` starts above 0 when an earlier
    download of the file is continued."""

    file: str
    index: int  # 1-based, among the files being downloaded
    count: int
    delta: int
    file_done: int
    file_total: int | None
    done: int
    total: int


ProgressCallback = Callable[[DownloadProgress], None]


# --- what a repo holds ----------------------------------------------------------------------

@dataclass
class _Listing:
    repo: str
    revision: str
    commit: str | None
    files: dict[str, PlannedFile]
    tags: list[str] = field(default_factory=list)
    gated: bool = False
    config: dict[str, Any] | None = None
    downloads: int = 0
    source: Source = "hub"
    snapshot: Path | None = None  # cache listings: the snapshot folder


@dataclass(frozen=True)
class _Cand:
    listing: _Listing
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


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def _offline() -> bool:
    return bool(constants.HF_HUB_OFFLINE) or _unreachable() is not None


#: Seconds to wait for the Hub's TCP handshake before treating it as unreachable.
REACH_TIMEOUT = 3.0


def _unreachable() -> str | None:
    """Why the Hub cannot be reached from here, or None. Asked once per endpoint.

    Without this, every API call of a plan on a machine with no network would sit in
    huggingface_hub's retry backoff (1+2+4+8+8 s) and print a warning per retry.
    """
    return _probe_endpoint(constants.ENDPOINT)


@functools.lru_cache(maxsize=4)
def _probe_endpoint(endpoint: str) -> str | None:
    import socket
    from urllib.parse import urlsplit

    if constants.HF_HUB_OFFLINE:
        return None
    url = urlsplit(endpoint)
    host = url.hostname or "huggingface.co"
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        with socket.create_connection((host, port), timeout=REACH_TIMEOUT):
            return None
    except OSError as e:
        return f"the Hub ({host}) cannot be reached ({e.strerror or type(e).__name__})"


def _cache_dir() -> str:
    # Read at call time: tests and users may move the cache after import.
    return str(constants.HF_HUB_CACHE)


def _api() -> HfApi:
    return HfApi()


def _is_network_error(exc: BaseException) -> bool:
    return isinstance(exc, (httpx2.ConnectError, httpx2.TimeoutException, OfflineModeIsEnabled))


def _hub_listing(repo: str, revision: str | None) -> _Listing:
    api = _api()
    what = f"to list {repo}" + (f"@{revision}" if revision else "")
    info = _hub_call(lambda: api.model_info(repo, revision=revision), repo, what, revision)
    commit = info.sha
    # The tree of the commit the info named: a branch that moves on meanwhile cannot mix
    # the files of two commits into one plan.
    tree = _hub_call(lambda: list(api.list_repo_tree(repo, recursive=True,
                                                     revision=commit or revision)),
                     repo, what, revision, retry=False)
    files: dict[str, PlannedFile] = {}
    for f in tree:
        if isinstance(f, huggingface_hub.hf_api.RepoFile):
            sha = f.lfs.sha256 if f.lfs is not None else None
            files[f.path] = PlannedFile(f.path, int(f.size), sha)
    config = info.config if isinstance(info.config, dict) else None
    return _Listing(repo=repo, revision=revision or "main", commit=commit, files=files,
                    tags=list(info.tags or []), gated=bool(info.gated), config=config,
                    downloads=int(info.downloads or 0))


def _cached_repos() -> dict[str, Any]:
    try:
        info = scan_cache_dir(_cache_dir())
    except CacheNotFound:
        return {}
    return {r.repo_id: r for r in info.repos if r.repo_type == "model"}


def _cache_listing(repo: str, revision: str | None, cached: dict[str, Any]) -> _Listing | None:
    """The cached snapshot of ``repo`` at ``revision`` (branch or commit), if any."""
    entry = cached.get(repo)
    if entry is None:
        return None
    rev = revision or "main"
    chosen = entry.refs.get(rev)
    if chosen is None:
        chosen = next((r for r in entry.revisions if r.commit_hash.startswith(rev)), None)
    if chosen is None:
        return None
    snap = Path(chosen.snapshot_path)
    files = {}
    for f in chosen.files:
        rel = Path(f.file_path).relative_to(snap).as_posix()
        files[rel] = PlannedFile(rel, int(f.size_on_disk), None, cached=True)
    config = None
    if (snap / "config.json").is_file():
        try:
            loaded = json.loads((snap / "config.json").read_text(encoding="utf-8"))
            config = loaded if isinstance(loaded, dict) else None
        except (OSError, ValueError):
            config = None
    return _Listing(repo=repo, revision=rev, commit=chosen.commit_hash, files=files,
                    config=config, source="cache", snapshot=snap)


# --- format and variants of one repo ----------------------------------------------------------

def repo_format(listing: _Listing) -> str:
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


def _gguf_candidates(listing: _Listing) -> tuple[list[_Cand], list[str]]:
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
    cands: list[_Cand] = []
    incomplete: list[str] = []
    for f in singles:
        q = gguf_quant(f)
        cands.append(_Cand(listing, "gguf", q, GGUF_BPW.get(q or "?", 8.0), (f,), primary=f))
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
        cands.append(_Cand(listing, "gguf", q, GGUF_BPW.get(q or "?", 8.0), ordered,
                           primary=ordered[0]))
    return cands, incomplete


def _all_files(listing: _Listing, under: str = "") -> tuple[str, ...]:
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


def _variant_candidates(listing: _Listing, fmt: str, device: str | None) -> tuple[
        list[_Cand], list[str]]:
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
            out.append(_Cand(listing, "onnx", quant, bits, _all_files(listing, sub),
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
        return [_Cand(listing, fmt, quant, bits, _all_files(listing), penalty=penalty)], []
    if fmt in ("exl2", "exl3"):
        qc = (listing.config or {}).get("quantization_config") or {}
        qbits = qc.get("bits") if isinstance(qc, dict) else None
        m = BPW_BRANCH.match(listing.revision)
        bpw = float(qbits) if isinstance(qbits, (int, float)) else (
            float(m.group(1).replace("_", ".")) if m else None)
        if bpw is None or not any(n.endswith(".safetensors") for n in listing.files):
            return [], []
        return [_Cand(listing, fmt, listing.revision if m else f"{bpw}bpw", bpw,
                      _all_files(listing))], []
    if fmt == "mlx":
        q = (listing.config or {}).get("quantization")
        mbits = q.get("bits") if isinstance(q, dict) else None
        b = float(mbits) if isinstance(mbits, int) else _named_bits(name) or 16.0
        quant = "bf16" if b == 16.0 else f"{int(b)}bit"
        return [_Cand(listing, fmt, quant, b, _all_files(listing))], []
    return [_Cand(listing, fmt, None, 16.0, _all_files(listing))], []


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


def unusable(lst: _Listing, fmt: str) -> str | None:
    """Why a repo in ``fmt`` has nothing an engine can run, or None."""
    if fmt == "openvino" and ov_missing(lst.files):
        return "lacks " + ", ".join(ov_missing(lst.files))
    if fmt not in ("exl2", "exl3") and not _variant_candidates(lst, fmt, None)[0]:
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


def _other_size(c: _Cand, wanted: float) -> set[float] | None:
    """The sizes a candidate's own folder or file names, when none is ``wanted``."""
    text = c.subfolder or c.primary or ""
    sizes = model_sizes(text)
    if sizes and not any(math.isclose(s, wanted, rel_tol=0.02) for s in sizes):
        return sizes
    return None


def keep_model_size(cands: list[_Cand], wanted: float | None) -> tuple[list[_Cand], list[str]]:
    """Drop the variants of other models in multi-model repos (a 7B folder next to the 1.5B
    one, ``…-7B-Q4_K_M.gguf`` next to ``…-1.5B-…``); one reason line per repo."""
    if wanted is None:
        return cands, []
    kept: list[_Cand] = []
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

def _trust_rank(repo: str, own_org: str | None) -> int:
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
    for m in _api().list_models(filter=filters, sort="downloads", limit=50):
        rid = m.id
        tags = m.tags or []
        low = rid.lower()
        if fmt in FORMAT_TAGS or (fmt == "onnx" and ("onnx" in low or "onnx" in tags)) or (
                fmt in ("exl2", "exl3") and fmt in low):
            found.append((rid, int(m.downloads or 0)))
    return found


def _candidate_repos(ref: ModelRef, base: str | None, fmt: str,
                     entry: CatalogEntry | None, *, offline: bool = False) -> list[str]:
    """Repos to look in, best first: verified catalog variants, then the Hub's model
    tree ranked by publisher trust and downloads, then unverified catalog entries."""
    verified = [v.repo for v in (entry.variants_for(fmt) if entry else []) if v.verified]
    unverified = [v.repo for v in (entry.variants_for(fmt) if entry else []) if not v.verified]
    discovered: list[str] = []
    if base and not offline and not _offline():
        own = base.split("/")[0]
        try:
            children = _search_children(base, fmt)
        except (HfHubHTTPError, httpx2.HTTPError, OfflineModeIsEnabled):
            children = []
        children.sort(key=lambda rd: (_trust_rank(rd[0], own), -rd[1]))
        discovered = [r for r, _ in children]
    out: list[str] = []
    for r in [*verified, *discovered, *unverified]:
        if r not in out:
            out.append(r)
    return out


# --- the model's shape (for the KV cache) ---------------------------------------------------------

def _read_shape(cand: _Cand) -> ModelShape | None:
    """From GGUF metadata (a Range read of the file's head) or config.json /
    genai_config.json; never downloads weights."""
    lst = cand.listing
    try:
        if cand.format == "gguf" and cand.primary:
            if lst.snapshot is not None:
                return _shape_from_gguf_head(_file_reader(lst.snapshot / cand.primary))
            if lst.source == "hub":
                primary = cand.primary
                return _shape_from_gguf_head(lambda at, n: _range_read(lst, primary, at, n))
            return None
        name = f"{cand.subfolder}/genai_config.json" if cand.subfolder else (
            "genai_config.json" if "genai_config.json" in lst.files else "config.json")
        if name not in lst.files:
            return memory.shape_from_config(lst.config) if lst.config else None
        if lst.snapshot is not None:
            path = str(lst.snapshot / name)
        else:
            path = hf_hub_download(lst.repo, name, revision=lst.commit or lst.revision)
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        return memory.shape_from_config(data) if isinstance(data, dict) else None
    except (OSError, ValueError, HfHubHTTPError, httpx2.HTTPError):
        return None


def _shape_from_gguf_head(read: Callable[[int, int], bytes]) -> ModelShape | None:
    """The model's shape from the metadata at a GGUF file's head; ``read(start, n)`` gives
    the ``n`` bytes from ``start`` (fewer at the end of the file)."""
    buf = b""
    for size in GGUF_HEADER_READS:
        buf += read(len(buf), size - len(buf))
        try:
            return memory.shape_from_gguf_metadata(memory.gguf_metadata_from_bytes(buf))
        except EOFError:
            continue
    return None


def _file_reader(path: str | os.PathLike[str]) -> Callable[[int, int], bytes]:
    def read(start: int, n: int) -> bytes:
        with open(path, "rb") as fh:
            fh.seek(start)
            return fh.read(n)

    return read


def _range_read(lst: _Listing, path: str, start: int, n: int) -> bytes:
    """``n`` bytes of a repo file from ``start`` (one HTTP Range request; the Hub
    redirects LFS files to its CDN, and the Authorization header stays behind: httpx drops
    it on a redirect to another origin). A server that ignores the Range and answers 200
    sends the whole file: the wanted bytes are cut from it, and reading stops there.
    Public huggingface_hub API only: ``hf_hub_url``, ``build_hf_headers``, ``get_session``,
    ``hf_raise_for_status``."""
    url = hf_hub_url(lst.repo, path, revision=lst.commit or lst.revision)
    headers = build_hf_headers()
    headers["Range"] = f"bytes={start}-{start + n - 1}"
    out = bytearray()
    with get_session().stream("GET", url, headers=headers, follow_redirects=True,
                              timeout=constants.HF_HUB_DOWNLOAD_TIMEOUT) as r:
        if r.status_code == 416:  # start is past the end of the file
            return b""
        if r.status_code >= 400:
            r.read()
            hf_raise_for_status(r)
        skip = start if r.status_code == 200 else 0
        for chunk in r.iter_bytes():
            if skip:
                cut = min(skip, len(chunk))
                chunk, skip = chunk[cut:], skip - cut
            out += chunk
            if len(out) >= n:
                break
    return bytes(out[:n])


# --- planning -----------------------------------------------------------------------------------

def plan_fetch(
    ref: str | ModelRef,
    *,
    backend: str | None = None,
    format: str | None = None,
    memory_budget_bytes: int | None = None,
    context: int | None = None,
    quant: str | None = None,
    device: str | None = None,
    allow_unoptimized: bool = False,
) -> FetchPlan:
    """Plan what to download for ``ref`` on ``backend``, before downloading anything.

    ``ref``: anything :func:`localrun.refs.parse_ref` accepts. ``backend``: the engine
    (default :func:`default_backend`); ``format``: override the format it wants (default:
    the engine's native one). ``memory_budget_bytes``: free VRAM / unified memory / RAM;
    None skips the fit check. ``context``: tokens of KV cache to plan for (default: the
    model's trained context, at most 8192). ``quant``: a tag overriding the one in ``ref``.
    ``device``: "cpu", "cuda", "npu", "GPU.0", … (chooses among ONNX/OpenVINO device
    variants).

    Network use: Hub API calls (model info, file tree, refs, search) and, only once the
    weights fit the budget, a small read of the model's header or config.json for the
    KV-cache size. Offline (``HF_HUB_OFFLINE=1`` or the Hub unreachable) a name that was
    downloaded before is planned from what that download fetched, else from the cache.
    Raises UnknownModelError, HubNotFoundError, NoVariantError, FormatMismatchError,
    OfflineMissingError. A plan that does not fit is returned with ``fits=False`` (call
    ``require_fit()`` to refuse).
    """
    r = ref if isinstance(ref, ModelRef) else parse_ref(ref)
    name = canonical_backend(backend or default_backend())
    fmt = format or BACKENDS[name].formats[0]
    want_quant = quant or r.quant
    if r.kind == "default" and not default_serves(want_quant):
        r = as_catalog_alias(r)  # e.g. smollm2:135m --quant Q8_0: the alias, on the Hub

    local = _plan_local(r, name, fmt, want_quant, memory_budget_bytes, context, device)
    if local is not None:
        return local
    planner = _Planner(r, name, fmt, want_quant, device, memory_budget_bytes, context,
                       allow_unoptimized)
    return replace(planner.plan(), asked_quant=want_quant)


class _Planner:
    """One :func:`plan_fetch` call for a Hub name: its state (online, or planning from the
    cache once the Hub is out of reach), the reasons shown with the plan, and its steps."""

    def __init__(self, r: ModelRef, backend: str, fmt: str, want_quant: str | None,
                 device: str | None, budget: int | None, context: int | None,
                 allow_unoptimized: bool) -> None:
        self.r = r
        self.backend = backend
        self.fmt = fmt
        self.want_quant = want_quant
        self.device = device
        self.budget = budget
        self.context = context
        self.allow_unoptimized = allow_unoptimized
        self.reasons: list[str] = []
        self.failures: dict[str, str] = {}  # repo (or repo@branch) -> why it was passed over
        self.offline_reason = ("HF_HUB_OFFLINE=1 is set" if constants.HF_HUB_OFFLINE
                               else _unreachable())
        self.cached: dict[str, Any] = _cached_repos() if self.offline_reason else {}
        self.pins: dict[str, Variant] = {}  # repo (lower case) -> its catalog entry
        self.passed: list[str] = []  # what was passed over, and why

    def note(self, line: str) -> None:
        """A reason that says what was passed over; it also goes with a NoVariantError
        (``passed_over``), so that an engine fallback can show why."""
        self.reasons.append(line)
        self.passed.append(line)

    def no_variant(self, fmt: str, tried: list[str], hint: str | None = None) -> NoVariantError:
        err = NoVariantError(self.r.raw, format=fmt, backend=self.backend, tried=tried,
                             hint=hint)
        err.passed_over = tuple(self.passed)
        return err

    # -- steps ------------------------------------------------------------------------------

    def plan(self) -> FetchPlan:
        if self.offline_reason:
            recorded = self.from_records()
            if recorded is not None:
                return recorded
        try:
            return self.search()
        except OfflineMissingError:
            # The Hub went out of reach half way: an earlier download of this name may do.
            recorded = self.from_records() if self.offline_reason else None
            if recorded is None:
                raise
            return recorded

    def listing(self, repo: str, revision: str | None) -> _Listing | None:
        """The repo's files at ``revision`` from the Hub, or from the cache when offline.
        A repo other than the one the user named that the Hub refuses is None, with
        the reason kept in ``failures``."""
        if self.offline_reason is None:
            try:
                return _hub_listing(repo, revision)
            except HubNotFoundError as e:
                if repo == self.r.repo:
                    raise
                where = f"{repo}@{revision}" if revision else repo
                self.failures[where] = ("is not on the Hub (404)" if e.revision is None
                                        else f"has no branch {revision!r} on the Hub")
                return None
            except ModelGatedError:
                if repo == self.r.repo:
                    raise
                self.failures[repo] = "is gated (401: accept its licence and set HF_TOKEN)"
                return None
            except (httpx2.ConnectError, httpx2.TimeoutException, OfflineModeIsEnabled) as e:
                self.offline_reason = f"the Hub cannot be reached ({type(e).__name__})"
                self.cached = _cached_repos()
        return _cache_listing(repo, revision, self.cached)

    def search(self) -> FetchPlan:
        """Plan from the Hub (or the cache): the named repo, or the variants of a base."""
        r = self.r
        base: str | None
        listings: list[_Listing] = []
        if r.kind == "repo":
            assert r.repo is not None
            first = self.listing(r.repo, r.revision)
            if first is None:
                # Offline and not cached. A base model's own repo is rarely downloaded:
                # its variants in the cache (e.g. pulled by an older localrun) may do.
                if not (self.offline_reason and r.revision is None
                        and not _names_a_variant(r.repo)):
                    raise OfflineMissingError(r.raw, [f"{r.repo}@{r.revision or 'main'}"],
                                              reason=self.offline_reason or "not cached")
                base = r.repo
                self.reasons.append(f"{r.repo} is not in the cache: looking for its "
                                    f"{self.fmt} variants there")
            else:
                own_fmt = repo_format(first)
                if own_fmt != "hf" or (first.config or {}).get("quantization_config"):
                    # The repo is itself a variant: its format decides.
                    if own_fmt != self.fmt:
                        compat.check(own_fmt, self.backend, model=r.repo,
                                     allow_unoptimized=self.allow_unoptimized)
                        self.fmt = own_fmt
                    listings = [first]
                    if self.fmt in ("exl2", "exl3") and r.revision is None:
                        listings = self.exl_branches(first)
                    base = None
                    self.reasons.append(f"{r.repo} is a {self.fmt} repo")
                else:
                    base = r.repo
                    self.reasons.append(f"{r.repo} is the original model; looking for its "
                                        f"{self.fmt} variants")
        else:  # alias
            entry = r.entry
            assert entry is not None
            base = entry.base
            self.reasons.append(f"alias {r.alias} is {entry.base}")
        if base is not None:
            listings = self.variant_listings(base, r.entry or _entry_for(base))
        return self.choose(listings, base)

    def variant_listings(self, base: str, entry: CatalogEntry | None) -> list[_Listing]:
        """The repos holding ``base`` in the wanted format: catalog entries and the Hub's
        model tree. A catalog entry the Hub refuses or that holds no usable weights is
        passed over with one line, never the end of the plan."""
        fmt = self.fmt
        self.pins = {v.repo.lower(): v for v in reversed(entry.variants_for(fmt))} \
            if entry else {}
        repos = _candidate_repos(self.r, base, fmt, entry, offline=bool(self.offline_reason))
        if self.offline_reason:
            stem = base.split("/")[-1].lower()
            repos += [rid for rid in self.cached if stem in rid.lower() and rid not in repos]
        listings: list[_Listing] = []
        for rid in repos[:MAX_DISCOVERED]:
            pin = self.pins.get(rid.lower())
            lst = self.listing(rid, None)
            if lst is None:
                if pin is not None and rid in self.failures:
                    self.note(f"catalog entry {rid} {self.failures[rid]}: passed over; "
                              "the Hub's model tree is searched instead")
                continue
            own = repo_format(lst)
            if own != fmt:
                if pin is not None and lst.source == "hub":
                    self.note(
                        f"catalog entry {rid} holds no {compat.title(fmt)} weights on "
                        f"{lst.revision} (its files look like {compat.title(own)}): passed over")
                continue
            why = unusable(lst, fmt)
            if why is not None:
                if pin is not None and lst.source == "hub":
                    self.note(f"catalog entry {rid} {why}: passed over (no usable "
                              f"{compat.title(fmt)} weights)")
                continue
            if fmt in ("exl2", "exl3"):
                branches = self.exl_branches(lst, pin.branch if pin else None)
                if not branches and pin is not None and lst.source == "hub":
                    self.note(f"catalog entry {pin.where} has no {fmt} weights on any "
                              "branch: passed over")
                listings.extend(branches)
            else:
                listings.append(lst)
        if not listings and self.offline_reason is None \
                and compat.support("hf", self.backend) == "loads" and self.allow_unoptimized:
            base_lst = self.listing(base, self.r.revision)
            if base_lst is not None:
                listings.append(base_lst)
                self.fmt = "hf"
        if not listings:
            if self.offline_reason:
                raise OfflineMissingError(
                    self.r.raw, [f"any {fmt} variant of {base}"
                                 + (f" (e.g. {', '.join(repos[:3])})" if repos else "")],
                    reason=self.offline_reason)
            raise self.no_variant(fmt, repos or [base])
        return self.without_gated(listings)

    def without_gated(self, listings: list[_Listing]) -> list[_Listing]:
        """With no HF token, a gated variant would fail at download: use the open ones."""
        if huggingface_hub.get_token() is not None:
            return listings
        open_ = [lst for lst in listings if not lst.gated]
        gated = sorted({lst.repo for lst in listings if lst.gated})
        if open_ and gated:
            self.note(f"{', '.join(gated)} gated and no HF_TOKEN is set: passed over "
                      "for open variants")
            return open_
        return listings

    def exl_branches(self, first: _Listing, pinned: str | None = None) -> list[_Listing]:
        """EXL2/EXL3 repos keep each bpw on its own branch (main may hold only a README).
        The catalog's branch is tried too: it works when the Hub lists no refs."""
        out = [first] if BPW_BRANCH.match(first.revision) or _has_weights(first) else []
        if first.source == "cache":
            entry = self.cached.get(first.repo) or _cached_repos().get(first.repo)
            names = sorted(entry.refs) if entry is not None else []
        else:
            try:
                names = [b.name for b in _api().list_repo_refs(first.repo).branches]
            except (HfHubHTTPError, httpx2.HTTPError):
                names = []
        if pinned and pinned not in names:
            names.append(pinned)
        for b in names:
            if b != first.revision and BPW_BRANCH.match(b):
                lst = self.listing(first.repo, b)
                if lst is not None:
                    out.append(lst)
                elif b == pinned and f"{first.repo}@{b}" in self.failures:
                    why = self.failures[f"{first.repo}@{b}"]
                    self.note(f"catalog entry {first.repo}@{b} {why}: passed over")
        return out

    def candidates(self, listings: list[_Listing]) -> tuple[list[_Cand], list[str]]:
        """Every variant in ``listings`` (the catalog's own file/folder/branch pinned),
        then only those of the requested model size; also missing shard names."""
        cands: list[_Cand] = []
        missing: list[str] = []
        for lst in listings:
            cs, inc = _variant_candidates(lst, self.fmt, self.device)
            cands.extend(self.pin(lst, cs))
            missing.extend(f"{lst.repo}: {m}" for m in inc)
        wanted = model_size(self.r.repo) if self.r.kind == "repo" and self.r.repo else None
        if self.r.kind == "alias" and self.r.entry is not None:
            wanted = model_size(self.r.entry.base)
        cands, lines = keep_model_size(cands, wanted)
        for line in lines:
            self.note(line)
        return cands, missing

    def pin(self, lst: _Listing, cands: list[_Cand]) -> list[_Cand]:
        v = self.pins.get(lst.repo.lower())
        if v is None or not cands:
            return cands
        out = [replace(c, pinned=(
            (v.subfolder is None or c.subfolder == v.subfolder)
            and (v.file is None or c.primary == v.file)
            and (v.branch is None or lst.revision == v.branch)
            and bool(v.subfolder or v.file or v.branch))) for c in cands]
        if lst.source == "hub" and not any(c.pinned for c in out):
            if v.subfolder and not any(c.subfolder == v.subfolder for c in cands):
                self.note(f"catalog folder {v.subfolder} is not in {lst.repo}: its other "
                          "variants are candidates")
            elif v.file and not any(c.primary == v.file for c in cands):
                self.note(f"catalog file {v.file} is not in {lst.repo}: its other files "
                          "are candidates")
        return out

    def choose(self, listings: list[_Listing], base: str | None) -> FetchPlan:
        r, fmt, want_quant = self.r, self.fmt, self.want_quant
        cands, missing = self.candidates(listings)
        if want_quant:
            matching = [c for c in cands if quant_matches(c.quant, c.bpw, fmt, want_quant)]
            if not matching:
                have = sorted({c.quant for c in cands if c.quant})
                if self.offline_reason:
                    raise OfflineMissingError(
                        r.raw, [f"{want_quant} of {r.repo or base}", *missing],
                        reason=self.offline_reason,
                        hint="cached quants: " + (", ".join(have) or "none")
                        + f"; connect and run `localrun pull {r.raw}`")
                raise self.no_variant(
                    fmt, [lst.repo for lst in listings],
                    hint=f"no {want_quant} file; available: {', '.join(have) or 'none'}")
            cands = matching
        if not cands:
            if self.offline_reason:
                raise OfflineMissingError(r.raw, missing or [f"{fmt} files of {r.repo or base}"],
                                          reason=self.offline_reason)
            whys = [f"{lst.repo} {w}" for lst in listings if (w := unusable(lst, fmt))]
            raise self.no_variant(fmt, [lst.repo for lst in listings],
                                  hint="; ".join(whys) + "; name another variant repo, or pick "
                                  "another engine with --backend" if whys else None)
        if self.offline_reason:
            self.reasons.append(f"{self.offline_reason}: planned from the Hugging Face cache")
        return _choose(r, self.backend, fmt, cands, base, self.budget, self.context,
                       self.reasons, target=DEFAULT_TARGET.get(fmt, 4.0),
                       explicit=bool(want_quant), device=self.device)

    def from_records(self) -> FetchPlan | None:
        """Offline: plan what an earlier download of this very name fetched for this
        engine (and quant), if its files are still in the cache."""
        name = record_name(self.r)
        if name is None:
            return None
        recs = pulls.find(_records(), name, backend=self.backend)
        if self.want_quant:
            want = pulls.norm_quant(self.want_quant)
            recs = [x for x in recs if want in (pulls.norm_quant(x.quant),
                                                pulls.norm_quant(x.variant_quant))]
        else:
            recs.sort(key=lambda x: x.quant is not None)  # the default choice first
        cached = self.cached or _cached_repos()
        for rec in recs:
            lst = _record_listing(rec, cached)
            if lst is None:
                continue
            cands = [c for c in _variant_candidates(lst, rec.format, self.device)[0]
                     if (c.primary, c.subfolder) == (rec.primary, rec.subfolder)]
            if not cands:
                continue
            when = time.strftime("%Y-%m-%d", time.localtime(rec.pulled_at))
            reasons = [f"{self.offline_reason}: {rec.display} was downloaded for "
                       f"{rec.backend} on {when}; using those files"]
            return _choose(self.r, self.backend, rec.format, cands[:1], None, self.budget,
                           self.context, reasons, target=DEFAULT_TARGET.get(rec.format, 4.0),
                           explicit=True, why="what that download fetched",
                           device=self.device)
        return None


def _names_a_variant(repo: str) -> bool:
    """Does a repo id name a quantized variant (``…-GGUF``, ``…-4bit``, ``…-int4-ov``)?
    Offline, such a name is never stood in for by another publisher's cached repo."""
    return bool(re.search(r"(?i)(gguf|mlx|onnx|exl[23]|awq|gptq|-ov$|\d+[-_]?bits?|"
                          r"(?:^|[-_])(?:u?int\d+|fp\d+|bf16|q\d\w*)(?:$|[-_]))",
                          repo.split("/")[-1]))


def _entry_for(repo: str) -> CatalogEntry | None:
    from localrun import catalog

    return catalog.for_repo(repo)


# --- what earlier downloads resolved names to (localrun.pulls) -----------------------------------

def record_name(r: ModelRef) -> str | None:
    """The name a download of ``r`` is remembered under: the catalog alias, or the repo
    id (with ``@revision`` when one was named); None for local models."""
    if r.kind == "alias" and r.alias:
        return r.alias
    if r.kind == "repo" and r.repo:
        return r.repo + (f"@{r.revision}" if r.revision else "")
    return None


def _records() -> list[pulls.PullRecord]:
    return pulls.load(_cache_dir())


def _record_listing(rec: pulls.PullRecord, cached: dict[str, Any]) -> _Listing | None:
    """The cached snapshot a record points at, if every file it names is still there."""
    lst = _cache_listing(rec.repo, rec.commit or rec.revision, cached)
    if lst is None or not rec.files or any(f not in lst.files for f in rec.files):
        return None
    lst.revision = rec.revision  # the branch name (EXL bpw branches are quants)
    return lst


def _remember(plan: FetchPlan) -> None:
    """Write down what ``plan``'s name resolved to (best effort: a read-only home only
    loses the offline shortcut, never the download)."""
    try:
        r = parse_ref(plan.ref)
    except LocalrunError:
        return
    if r.kind == "default":  # the packaged model's name, planned as the catalog alias
        r = as_catalog_alias(r)
    name = record_name(r)
    if name is None or plan.repo is None:
        return
    rec = pulls.PullRecord(
        name=name, backend=plan.backend, quant=plan.asked_quant, repo=plan.repo,
        revision=plan.revision or "main", commit=plan.commit, format=plan.format,
        variant_quant=plan.quant, subfolder=plan.subfolder, primary=plan.primary,
        files=tuple(f.path for f in plan.files), cache=_cache_dir())
    with contextlib.suppress(OSError):
        pulls.remember(rec)


def pulled_backends(ref: str | ModelRef) -> list[str]:
    """Engines an earlier download of ``ref`` (the same name) is in the cache for."""
    r = ref if isinstance(ref, ModelRef) else parse_ref(ref)
    name = record_name(r)
    if name is None:
        return []
    cached = _cached_repos()
    out: list[str] = []
    for rec in pulls.find(_records(), name):
        if rec.backend not in out and _record_listing(rec, cached) is not None:
            out.append(rec.backend)
    return out



def _has_weights(lst: _Listing) -> bool:
    return any(n.endswith(".safetensors") for n in lst.files)


def _choose(r: ModelRef, backend: str, fmt: str, cands: list[_Cand], base: str | None,
            budget: int | None, context: int | None, reasons: list[str], *, target: float,
            explicit: bool, why: str | None = None, device: str | None = None) -> FetchPlan:
    # KV element size and overhead of this engine on this device (memory.ENGINE_MEMORY)
    fixed = memory.engine_memory(backend, device).overhead_fixed
    own = (base or cands[0].listing.repo).split("/")[0]
    repo_order = {c.listing.repo: i for i, c in enumerate(
        sorted(cands, key=lambda c: _trust_rank(c.listing.repo, own)))}

    def key(c: _Cand) -> tuple[float, float, bool, int, float]:
        dist = -c.bpw if math.isinf(target) else abs(c.bpw - target)
        return (round(dist, 2), c.penalty, not c.pinned, repo_order[c.listing.repo], -c.bpw)

    ordered = sorted(cands, key=key)
    shape: ModelShape | None = None
    shape_read = False
    options: list[QuantOption] = []
    chosen: _Cand | None = None
    chosen_est: MemoryEstimate | None = None
    ctx = context or 4096

    for c in ordered:
        w = c.weights_bytes
        if budget is not None and w + memory.overhead_bytes(w, fixed) > budget:
            # The weights alone do not fit: no need to read anything more.
            options.append(QuantOption(c.listing.repo, c.quant, w,
                                       w + memory.overhead_bytes(w, fixed), False,
                                       c.listing.revision, c.subfolder))
            continue
        if not shape_read:
            shape, shape_read = _read_shape(c), True
            if context is None:
                trained = shape.trained_context if shape else None
                ctx = min(trained or 4096, 8192)
        est = memory.estimate(w, shape, ctx, backend=backend, device=device)
        fits = budget is None or est.total_bytes <= budget
        options.append(QuantOption(c.listing.repo, c.quant, w, est.total_bytes, fits,
                                   c.listing.revision, c.subfolder))
        if fits and chosen is None:
            chosen, chosen_est = c, est
            if budget is None:
                break
    if chosen is None:
        # Nothing fits: report the smallest (explicit: the one asked for) with its numbers.
        chosen = ordered[0] if explicit else min(ordered, key=lambda c: c.weights_bytes)
        chosen_est = memory.estimate(chosen.weights_bytes, shape, ctx, backend=backend,
                                     device=device)
    assert chosen_est is not None
    trained = shape.trained_context if shape else None
    max_ctx = (memory.max_context(chosen.weights_bytes, shape, budget, limit=trained,
                                  backend=backend, device=device)
               if budget is not None else None)
    fits = budget is None or chosen_est.total_bytes <= budget
    lst = chosen.listing
    reasons.append(f"chose {chosen.label}" + (
        f" ({why})" if why else " (asked for)" if explicit
        else f" (default quality {fmt_target(fmt)}, nearest that fits)"))
    if shape is None:
        reasons.append("KV cache size unknown (no GGUF header or config.json read)")
    if lst.gated and huggingface_hub.get_token() is None:
        reasons.append(f"{lst.repo} is gated: set HF_TOKEN after accepting its licence")
    files = tuple(_with_cache_state(lst, lst.files[f]) for f in chosen.files)
    return FetchPlan(
        ref=r.raw, source="cache" if lst.source == "cache" else "hub", format=fmt,
        backend=backend, repo=lst.repo, revision=lst.revision, commit=lst.commit,
        quant=chosen.quant, subfolder=chosen.subfolder, files=files, primary=chosen.primary,
        local_path=None, memory=chosen_est, budget_bytes=budget, context=ctx,
        max_context=max_ctx, fits=fits, options=tuple(options), reasons=tuple(reasons),
        gated=lst.gated)


def fmt_target(fmt: str) -> str:
    return {"gguf": "Q4_K_M", "mlx": "4-bit", "openvino": "int4", "onnx": "int4",
            "exl2": "largest bpw", "exl3": "largest bpw"}.get(fmt, "default")


def _with_cache_state(lst: _Listing, f: PlannedFile) -> PlannedFile:
    if f.cached or lst.commit is None:
        return f
    hit = huggingface_hub.try_to_load_from_cache(lst.repo, f.path, cache_dir=_cache_dir(),
                                                 revision=lst.commit)
    return replace(f, cached=isinstance(hit, str))


def _plan_local(r: ModelRef, backend: str, fmt: str, quant: str | None, budget: int | None,
                context: int | None, device: str | None = None) -> FetchPlan | None:
    """Models that need no download: local paths, the packaged default, Ollama, LM Studio."""
    found: StoredModel | None = None
    if r.kind in ("path", "default"):
        from localrun.formats.detect import detect
        from localrun.stores import default_model_path

        p = r.path if r.kind == "path" else default_model_path()
        assert p is not None
        d = detect(p)
        size = p.stat().st_size if p.is_file() else sum(
            f.stat().st_size for f in p.rglob("*") if f.is_file())
        found = StoredModel(r.raw, d.path, d.format, d.quantization, size, "default")
        source: Source = "local"
    elif r.kind == "ollama":
        found = find_ollama(r.alias or "")
        if found is None:
            raise HubNotFoundError(f"ollama:{r.alias}", hint=f"ollama pull {r.alias}")
        source = "ollama"
    elif r.kind == "lmstudio":
        found = find_lmstudio(r.repo or "", quant)
        if found is None:
            raise HubNotFoundError(f"lmstudio:{r.repo}", hint="download it in LM Studio, or "
                                   f"localrun pull {r.repo}")
        source = "lmstudio"
    elif fmt == "gguf" and r.kind == "alias" and r.alias:
        hit = find_ollama(r.alias)
        if hit is not None and (quant is None or (hit.quant or "").lower() == quant.lower()):
            found, source = hit, "ollama"
    elif fmt == "gguf" and r.kind == "repo" and r.repo and r.revision is None:
        hit = find_lmstudio(r.repo, quant)
        if hit is not None:
            found, source = hit, "lmstudio"
    if found is None:
        return None
    if found.format != fmt:
        compat.check(found.format, backend, model=r.raw)
    shape = None
    if found.format == "gguf":
        try:
            shape = _shape_from_gguf_head(_file_reader(found.path))
        except OSError:
            shape = None
    ctx = context or min((shape.trained_context if shape else None) or 4096, 8192)
    est = memory.estimate(found.size, shape, ctx, backend=backend, device=device)
    fits = budget is None or est.total_bytes <= budget
    max_ctx = memory.max_context(found.size, shape, budget,
                                 limit=shape.trained_context if shape else None,
                                 backend=backend, device=device) \
        if budget is not None else None
    return FetchPlan(
        ref=r.raw, source=source, format=found.format, backend=backend, repo=found.repo,
        revision=None, commit=None, quant=found.quant, subfolder=None, files=(),
        primary=None, local_path=found.path, memory=est, budget_bytes=budget, context=ctx,
        max_context=max_ctx, fits=fits,
        reasons=(f"found in place ({source}): {found.path}",))


# --- talking to the Hub: retries, and errors that say what to do --------------------------------

#: HTTP statuses worth another try: the Hub or its file storage is busy or briefly down.
RETRY_STATUS = frozenset({408, 429, 500, 502, 503, 504})
#: Tries per Hub request, and per file download without progress (a dropped connection,
#: an expired signed URL, a 5xx or 429 each cost one; bytes that arrive reset the count).
HUB_ATTEMPTS = 4
#: The first wait between tries in seconds (doubling after each); Retry-After overrides it.
RETRY_BACKOFF = 1.0
#: The longest wait localrun sits out; a longer Retry-After is reported instead.
MAX_RETRY_WAIT = 60.0

_T = TypeVar("_T")


def _status(e: BaseException) -> int | None:
    status = getattr(getattr(e, "response", None), "status_code", None)
    return status if isinstance(status, int) else None


def _retry_after(e: BaseException) -> float | None:
    """The Retry-After seconds of an HTTP error response, if it has them."""
    response = getattr(e, "response", None)
    value = response.headers.get("Retry-After") if response is not None else None
    return float(value) if isinstance(value, str) and value.strip().isdigit() else None


def _token_set() -> bool:
    return huggingface_hub.get_token() is not None


def _typed(e: BaseException, repo: str, what: str, *, revision: str | None = None,
           filename: str | None = None, tries: int = 1) -> LocalrunError:
    """A huggingface_hub error as localrun's: one line, and what to do next."""
    if isinstance(e, GatedRepoError):
        return ModelGatedError(repo, token_sent=_status(e) == 403)
    if isinstance(e, RevisionNotFoundError):
        return HubNotFoundError(repo, revision=revision)
    if isinstance(e, RemoteEntryNotFoundError):
        return HubNotFoundError(repo, revision=revision, filename=filename)
    if isinstance(e, RepositoryNotFoundError):
        # The Hub answers 401 for a private repo and a missing one alike, and 404 to a
        # token without access to it: say which of the two cases this is.
        return HubNotFoundError(repo, hint=(
            "the token in HF_TOKEN has no access to it, or it does not exist: check the name "
            "at https://huggingface.co/models" if _token_set() else
            "check the name at https://huggingface.co/models; for a private repo set HF_TOKEN"))
    status = _status(e)
    message = getattr(getattr(e, "response", None), "headers", {}).get("X-Error-Message")
    if status in (401, 403):
        return HubAuthError(what, status=status, reason=message or (
            "invalid credentials" if status == 401 else "forbidden"))
    if status is not None:
        reason = f"HTTP {status}" + (f" ({message})" if message else "")
        if status == 429:
            reason = f"rate-limited (429){': ' + message if message else ''}"
    elif isinstance(e, _Retry):
        reason = str(e)
    else:
        reason = f"the connection kept failing ({type(e).__name__}: {str(e)[:120]})"
    return HubUnavailableError(what, reason=f"{reason}, after {tries} "
                               f"tr{'y' if tries == 1 else 'ies'}", status=status,
                               retry_after=_retry_after(e))


def _wait_before_retry(e: BaseException, attempt: int) -> bool:
    """Sleep before try ``attempt + 1`` of something that failed with ``e``; False when
    it should not be tried again (no tries left, or the Hub asks for a longer wait)."""
    if attempt >= HUB_ATTEMPTS:
        return False
    delay = _retry_after(e)
    if delay is None:
        delay = RETRY_BACKOFF * 2 ** (attempt - 1)
    if delay > MAX_RETRY_WAIT:
        return False
    time.sleep(delay)
    return True


def _hub_call(fn: Callable[[], _T], repo: str, what: str, revision: str | None = None, *,
              retry: bool = True) -> _T:
    """``fn()`` (one Hub API request) tried again on 429/5xx, honouring Retry-After;
    errors typed. Network errors pass through: the planner then plans from the cache.
    ``retry=False`` for huggingface_hub's paginated listings, which it retries itself
    (``model_info`` it does not)."""
    attempt = 1
    while True:
        try:
            return fn()
        except (RepositoryNotFoundError, RevisionNotFoundError, RemoteEntryNotFoundError) as e:
            raise _typed(e, repo, what, revision=revision) from e
        except HfHubHTTPError as e:
            if retry and _status(e) in RETRY_STATUS and _wait_before_retry(e, attempt):
                attempt += 1
                continue
            raise _typed(e, repo, what, revision=revision, tries=attempt) from e


# --- downloading --------------------------------------------------------------------------------

#: Suffix of localrun's partial downloads, next to the blob they become in the HF cache.
#: Kept across tries and processes (huggingface_hub >= 1.18 discards its own partial
#: files), so that a download cut off by an expired URL or a killed process continues;
#: ``*.incomplete`` is what ``hf cache`` lists (and ``hf cache prune`` removes) as partial.
PARTIAL_SUFFIX = ".localrun.incomplete"


class _Meter:
    """Turns byte positions of each file into :class:`DownloadProgress` reports."""

    def __init__(self, progress: ProgressCallback | None, todo: Sequence[PlannedFile]) -> None:
        self.progress = progress
        self.count = len(todo)
        self.total = sum(f.size for f in todo)
        self.done = 0

    def file(self, f: PlannedFile, index: int) -> _FileMeter:
        return _FileMeter(self, f, index)


class _FileMeter:
    def __init__(self, meter: _Meter, f: PlannedFile, index: int) -> None:
        self.meter = meter
        self.f = f
        self.index = index
        self.at_bytes = 0
        self.file_total: int | None = f.size or None

    def at(self, position: int, file_total: int | None = None) -> None:
        """The file now holds ``position`` bytes (less than before after a restart)."""
        if file_total is not None:
            self.file_total = file_total
        delta = position - self.at_bytes
        if delta == 0:
            return
        self.at_bytes = position
        m = self.meter
        m.done += delta
        if m.progress is not None:
            m.progress(DownloadProgress(self.f.path, self.index, m.count, delta, position,
                                        self.file_total, m.done, m.total))

    def add(self, n: int, file_total: int | None = None) -> None:
        self.at(self.at_bytes + n, file_total)


def _bar_class(meter: _FileMeter) -> type:
    """A tqdm stand-in for huggingface_hub's ``tqdm_class`` that forwards byte counts.

    It implements what ``xet_get`` (through ``XetDownloadProgressReporter``) and
    ``http_get`` call on a bar, the surface of huggingface_hub's own aggregated bar
    (``update_transfer`` makes the Xet reporter count reconstructed file bytes, the same
    bytes the HTTP path counts), and draws nothing: the caller renders.
    """

    class _Bar:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self.total = kwargs.get("total")
            self.n = int(kwargs.get("initial") or 0)
            self.format_dict: dict[str, Any] = {}
            meter.at(self.n, self.total)

        def __enter__(self) -> _Bar:
            return self

        def __exit__(self, *exc: object) -> None:
            return None

        def update(self, n: float | None = 1) -> None:
            d = int(n or 0)
            self.n += d
            meter.add(d, self.total)

        def update_transfer(self, n: float | None = 1) -> None:
            return None  # bytes on the wire (Xet: compressed, deduplicated), not file bytes

        def set_postfix_str(self, *args: Any, **kwargs: Any) -> None:
            return None

        set_transfer_postfix_str = set_description = set_description_str = set_postfix_str

        def refresh(self, *args: Any, **kwargs: Any) -> None:
            return None

        def close(self) -> None:
            return None

    return _Bar


def sha256_file(path: str | os.PathLike[str]) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _check_disk(needed: int) -> None:
    p = Path(_cache_dir())
    probe = p
    while not probe.exists() and probe.parent != probe:
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if needed > free:
        raise DiskFullError(str(p), needed_bytes=needed, free_bytes=free)


def _drop_cached(pointer: str) -> None:
    blob = os.path.realpath(pointer)
    for p in {pointer, blob}:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(p)


def fetch(plan: FetchPlan, *, progress: ProgressCallback | None = None,
          verify: Literal["new", "all"] = "new") -> Path:
    """Download what ``plan`` names into the HF cache; return what the engine opens.

    Returns the GGUF file (first shard) for GGUF plans, the variant folder for ONNX,
    else the snapshot folder; for in-place models (Ollama, LM Studio, local) their path.
    Refuses a plan that does not fit (ModelTooLargeError) before any download. Files
    come from the commit the plan listed (``plan.commit``), not from wherever its branch
    points by now. Every file with an LFS sha256 that this call downloads (``verify=
    "all"``: every file) is checked before it enters the cache; a mismatch is fetched once
    more, then ChecksumError. Dropped connections, expired download URLs, 5xx and 429
    answers are tried again (a download continues from the bytes it has, also in a later
    process); then HubUnavailableError. Raises ModelGatedError, HubNotFoundError,
    HubAuthError, OfflineMissingError, DiskFullError.
    A Hub model's name is remembered with what it resolved to (:mod:`localrun.pulls`),
    so that the same name runs offline later.
    """
    plan.require_fit()
    if plan.local_path is not None:
        return Path(plan.local_path)
    assert plan.repo is not None
    todo = [f for f in plan.files if not _cached_now(plan, f)]
    if _offline() and todo:
        raise OfflineMissingError(plan.ref, [f"{plan.repo}/{f.path}" for f in todo],
                                  reason=_unreachable() or "HF_HUB_OFFLINE=1 is set")
    _check_disk(sum(f.size for f in todo))
    meter = _Meter(progress, todo)
    paths: dict[str, str] = {}
    for f in plan.files:
        if f in todo:
            path = _download(plan, f, meter.file(f, todo.index(f) + 1))
        else:
            path = _from_cache(plan, f)
            if verify == "all" and f.sha256 and sha256_file(path) != f.sha256:
                _drop_cached(path)
                path = _download(plan, f, _Meter(None, [f]).file(f, 1))
        paths[f.path] = path
    first = next(iter(paths.items()), None)
    if first is None:
        raise HubNotFoundError(plan.repo, hint="the plan names no files")
    rel, abs_path = first
    root = Path(abs_path)
    for _ in rel.split("/"):
        root = root.parent
    _note_ref(plan)
    _remember(plan)
    if plan.primary:
        return root / plan.primary
    if plan.subfolder:
        return root / plan.subfolder
    return root


def _cached_now(plan: FetchPlan, f: PlannedFile) -> bool:
    assert plan.repo is not None
    hit = huggingface_hub.try_to_load_from_cache(
        plan.repo, f.path, cache_dir=_cache_dir(), revision=plan.commit or plan.revision)
    return isinstance(hit, str)


def _pinned(plan: FetchPlan) -> str:
    """The revision files are fetched at: the commit the plan listed."""
    return plan.commit or plan.revision or "main"


def _shown_revision(plan: FetchPlan) -> str:
    rev = plan.revision or "main"
    if plan.commit and not plan.commit.startswith(rev):
        return f"{rev} (commit {plan.commit[:12]}, as planned)"
    return rev


def _from_cache(plan: FetchPlan, f: PlannedFile) -> str:
    """A file the cache has: asked for by commit, huggingface_hub answers without a
    request (the Hub may be out of reach, or the branch may have moved on)."""
    assert plan.repo is not None
    try:
        return str(hf_hub_download(plan.repo, f.path, revision=_pinned(plan),
                                   cache_dir=_cache_dir()))
    except LocalEntryNotFoundError as e:
        reason = "HF_HUB_OFFLINE=1 is set" if _offline() else "the Hub cannot be reached"
        raise OfflineMissingError(plan.ref, [f"{plan.repo}/{f.path}"], reason=reason) from e
    except HfHubHTTPError as e:
        raise _typed(e, plan.repo, f"to look up {f.path}", revision=_shown_revision(plan),
                     filename=f.path) from e


class _Mismatch(Exception):
    """A downloaded file whose sha256 is not the one the Hub listed (already deleted)."""

    def __init__(self, path: str, actual: str) -> None:
        super().__init__(path)
        self.path = path
        self.actual = actual


class _Retry(Exception):
    """A download try that ended for a passing reason (cut short, an expired URL)."""


def _download(plan: FetchPlan, f: PlannedFile, meter: _FileMeter) -> str:
    """One file of the plan into the HF cache at the planned commit, checked; a file
    whose checksum is wrong is fetched once more, then ChecksumError."""
    assert plan.repo is not None
    for attempt in (1, 2):
        try:
            return _download_once(plan, f, meter)
        except _Mismatch as bad:
            meter.at(0)
            if attempt == 2:
                raise ChecksumError(bad.path, expected=f.sha256 or "?",
                                    actual=bad.actual) from None
    raise AssertionError("unreachable")


def _xet_enabled() -> bool:
    import importlib.util

    return not constants.HF_HUB_DISABLE_XET and importlib.util.find_spec("hf_xet") is not None


def _download_once(plan: FetchPlan, f: PlannedFile, meter: _FileMeter) -> str:
    """Ask the Hub where the file is (HEAD), then fetch it: Xet-backed files through
    huggingface_hub (hf_xet), the others with localrun's resumable HTTP download. Tried
    again while failures pass (see HUB_ATTEMPTS)."""
    assert plan.repo is not None
    repo, revision = plan.repo, _pinned(plan)
    url = hf_hub_url(repo, f.path, revision=revision)
    what = f"to download {f.path} from {repo}"
    attempt = 1
    while True:
        before = meter.at_bytes
        try:
            meta = get_hf_file_metadata(url)
            if meta.xet_file_data is not None and _xet_enabled():
                return _via_huggingface_hub(repo, f, revision, meter)
            return _http_to_cache(repo, f, revision, url, meta, meter)
        except (RepositoryNotFoundError, RevisionNotFoundError, RemoteEntryNotFoundError) as e:
            raise _typed(e, repo, what, revision=_shown_revision(plan), filename=f.path) from e
        except (OfflineModeIsEnabled, LocalEntryNotFoundError) as e:
            reason = "HF_HUB_OFFLINE=1 is set" if _offline() else "the Hub cannot be reached"
            raise OfflineMissingError(plan.ref, [f"{repo}/{f.path}"], reason=reason) from e
        except (HfHubHTTPError, httpx2.TransportError, _Retry) as e:
            passing = (isinstance(e, (httpx2.TransportError, _Retry))
                       or _status(e) in RETRY_STATUS)
            if meter.at_bytes > before:
                attempt = 1  # bytes arrived: a slow, flaky line is not a failure
            if not passing or not _wait_before_retry(e, attempt):
                raise _typed(e, repo, what, tries=attempt) from e
            attempt += 1
        except OSError as e:
            if e.errno == errno.ENOSPC:
                raise DiskFullError(_cache_dir(), needed_bytes=f.size,
                                    free_bytes=shutil.disk_usage(_cache_dir()).free) from e
            raise


def _via_huggingface_hub(repo: str, f: PlannedFile, revision: str, meter: _FileMeter) -> str:
    """A Xet-backed file: hf_xet fetches it (its chunk cache is what an interrupted Xet
    download continues from); progress comes through the same meter as HTTP's."""
    meter.at(0)
    path = str(hf_hub_download(repo, f.path, revision=revision, cache_dir=_cache_dir(),
                               tqdm_class=_bar_class(meter)))
    if f.sha256:
        actual = sha256_file(path)
        if actual != f.sha256:
            _drop_cached(path)
            raise _Mismatch(path, actual)
    return path


def _storage(repo: str) -> Path:
    """The repo's folder in the HF cache (its documented layout: ``models--org--name``)."""
    return Path(_cache_dir()) / ("models--" + repo.replace("/", "--"))


def _http_to_cache(repo: str, f: PlannedFile, revision: str, url: str,
                   meta: huggingface_hub.HfFileMetadata, meter: _FileMeter) -> str:
    """Download to ``blobs/<etag>`` + PARTIAL_SUFFIX, continuing what is there; check the
    sha256 before the blob takes its name, then let huggingface_hub link it into the
    snapshot (with the blob in place, ``hf_hub_download`` only makes the link)."""
    etag = meta.etag
    if not etag or meta.location is None:
        raise _Retry(f"the Hub gave no ETag or location for {f.path}")
    size = meta.size if meta.size is not None else (f.size or None)
    storage = _storage(repo)
    blob = storage / "blobs" / etag
    if not blob.exists():
        blob.parent.mkdir(parents=True, exist_ok=True)
        lock = Path(_cache_dir()) / ".locks" / storage.name / f"{etag}.lock"
        lock.parent.mkdir(parents=True, exist_ok=True)
        partial = blob.with_name(etag + PARTIAL_SUFFIX)
        with WeakFileLock(lock):  # the lock huggingface_hub takes for this blob
            if not blob.exists():
                _stream(partial, url, meta.location, size, meter)
                if f.sha256:
                    actual = sha256_file(partial)
                    if actual != f.sha256:
                        partial.unlink()
                        raise _Mismatch(str(blob), actual)
                os.replace(partial, blob)
    meter.at(blob.stat().st_size)
    return str(hf_hub_download(repo, f.path, revision=revision, cache_dir=_cache_dir()))


def _same_origin(a: str, b: str) -> bool:
    from urllib.parse import urlsplit

    ua, ub = urlsplit(a), urlsplit(b)
    return (ua.scheme, ua.hostname, ua.port) == (ub.scheme, ub.hostname, ub.port)


def _stream(partial: Path, url: str, location: str, size: int | None,
            meter: _FileMeter) -> None:
    """GET ``location`` into ``partial`` from the bytes it already holds (a Range
    request). A server that answers the Range with 200 sends the whole file: it is
    written from the start. Raises _Retry when the file came out short, or when the
    signed URL no longer works (the next try asks the Hub for a fresh one)."""
    have = partial.stat().st_size if partial.exists() else 0
    if size is not None and have > size:
        have = 0
    meter.at(have, size)
    if size is not None and have == size:
        return  # complete: the checksum decides
    headers = build_hf_headers()
    if not _same_origin(url, location):
        # A signed CDN URL carries its own authorization; the token must not leave the Hub.
        headers = {k: v for k, v in headers.items() if k.lower() != "authorization"}
    if have:
        headers["Range"] = f"bytes={have}-"
    with get_session().stream("GET", location, headers=headers, follow_redirects=True,
                              timeout=constants.HF_HUB_DOWNLOAD_TIMEOUT) as r:
        if r.status_code == 416:  # the partial is no prefix of this file: start over
            partial.unlink(missing_ok=True)
            raise _Retry(f"the file storage refused to continue at byte {have} of {size} "
                         "(416): it holds another length than the Hub lists")
        if r.status_code in (401, 403, 410) and not _same_origin(url, location):
            raise _Retry(f"{r.status_code} from the file storage: the signed URL expired")
        if r.status_code >= 400:
            r.read()
            hf_raise_for_status(r)
        start = 0
        if r.status_code == 206:
            m = re.match(r"bytes (\d+)-", r.headers.get("Content-Range", ""))
            start = int(m.group(1)) if m else 0
            if start > have:
                partial.unlink(missing_ok=True)
                raise _Retry(f"the server resumed at byte {start}, not {have}")
        with open(partial, "r+b" if partial.exists() else "wb") as fh:
            fh.seek(start)
            fh.truncate()
            meter.at(start, size)
            # As the bytes arrive (no buffering to a chunk size): what arrived before a
            # dropped connection is on disk for the next try to continue from.
            for chunk in r.iter_bytes():
                fh.write(chunk)
                meter.add(len(chunk))
    got = partial.stat().st_size
    if size is not None and got != size:
        raise _Retry(f"the download stopped at byte {got} of {size}")


def _note_ref(plan: FetchPlan) -> None:
    """Write down in the cache which commit the plan's branch or tag named (what
    huggingface_hub does when asked by name, and offline plans look up): files were
    asked for by commit."""
    rev, commit = plan.revision, plan.commit
    if plan.source != "hub" or plan.repo is None or not rev or not commit \
            or commit.startswith(rev):
        return
    ref = _storage(plan.repo) / "refs" / rev
    with contextlib.suppress(OSError):
        ref.parent.mkdir(parents=True, exist_ok=True)
        tmp = ref.with_name(ref.name + ".tmp")
        tmp.write_text(commit, encoding="utf-8")
        os.replace(tmp, ref)


# --- the cache: list and remove ------------------------------------------------------------------

def cached_models() -> list[StoredModel]:
    """Models in the HF cache: one row per GGUF quant, per EXL branch, per ONNX variant,
    else per repo; ``pulled_as`` names the aliases and repo ids downloads resolved to it."""
    out: list[StoredModel] = []
    cached = _cached_repos()
    names = _pulled_names(cached)
    for repo_id, entry in sorted(cached.items()):
        for ref_name, rev in sorted(entry.refs.items()):
            lst = _cache_listing(repo_id, ref_name, {repo_id: entry})
            if lst is None:
                continue
            fmt = repo_format(lst)
            cands, _ = _variant_candidates(lst, fmt, None)
            for c in cands:
                size = sum(lst.files[f].size for f in c.files if f in lst.files)
                if fmt == "gguf" and c.primary:
                    name = f"{repo_id}:{c.quant}" if c.quant else repo_id
                    path = str(Path(rev.snapshot_path) / c.primary)
                elif fmt == "onnx" and c.subfolder:
                    name, path = repo_id, str(Path(rev.snapshot_path) / c.subfolder)
                else:
                    name, path = repo_id, str(rev.snapshot_path)
                if ref_name != "main":
                    name += f"@{ref_name}"
                out.append(StoredModel(name=name, path=path, format=fmt, quant=c.quant,
                                       size=size, store="hf", repo=repo_id, revision=ref_name,
                                       pulled_as=tuple(names.get(str(Path(path)), ()))))
    return out


def _pulled_names(cached: dict[str, Any]) -> dict[str, list[str]]:
    """Path of a cached model -> the names (with engine) downloads of it were asked by."""
    out: dict[str, list[str]] = {}
    for rec in _records():
        lst = _record_listing(rec, cached)
        if lst is None or lst.snapshot is None:
            continue
        shown = out.setdefault(str(lst.snapshot / (rec.primary or rec.subfolder or "")), [])
        if rec.display not in shown:
            shown.append(rec.display)
    return out


@dataclass(frozen=True)
class Removal:
    """What ``remove`` would delete from the HF cache."""

    ref: str
    repos: tuple[str, ...]
    files: tuple[str, ...]  # paths shown to the user
    freed_bytes: int
    _strategy: Any = field(default=None, repr=False, compare=False)


def plan_removal(ref: str | ModelRef) -> Removal:
    """What belongs to ``ref`` in the HF cache: a repo (with ``:QUANT``, only that
    quant's files), or for an alias every cached variant repo and its base repo."""
    r = ref if isinstance(ref, ModelRef) else parse_ref(ref)
    try:
        info = scan_cache_dir(_cache_dir())
    except CacheNotFound:
        info = None
    repos_by_id = {x.repo_id.lower(): x for x in info.repos} if info else {}
    # What downloads of this very name resolved to (discovered repos are in no catalog).
    name = record_name(r)
    recorded = [rec.repo for rec in pulls.find(_records(), name)] if name else []
    if r.kind == "repo" and r.repo:
        wanted = [r.repo, *recorded]
    elif r.kind == "alias" and r.entry is not None:
        e = r.entry
        wanted = [e.base, *(v.repo for v in e.variants), *recorded]
    else:
        raise LocalrunError(f"{r.raw} is not in the Hugging Face cache",
                            hint="localrun rm takes a Hub repo id or an alias; "
                            "see `localrun list`")
    wanted = list(dict.fromkeys(w.lower() for w in wanted))
    hits = [repos_by_id[w] for w in wanted if w in repos_by_id]
    if not hits or info is None:
        raise HubNotFoundError(r.raw, hint="nothing of it is cached; see `localrun list`")
    quant = r.quant
    if quant:
        files = [f for repo in hits for rev in repo.revisions for f in rev.files
                 if f.file_name.lower().endswith(".gguf")
                 and quant_matches(gguf_quant(f.file_name), 0.0, "gguf", quant)]
        if not files:
            raise HubNotFoundError(r.raw, hint=f"no cached {quant} file; see `localrun list`")
        strategy = info.delete_files(*files)
        shown = tuple(str(f.file_path) for f in files)
    else:
        strategy = info.delete_revisions(*[rev.commit_hash for repo in hits
                                           for rev in repo.revisions])
        shown = tuple(str(repo.repo_path) for repo in hits)
    return Removal(r.raw, tuple(repo.repo_id for repo in hits), shown,
                   int(strategy.expected_freed_size), strategy)


def remove(removal: Removal) -> int:
    """Delete what :func:`plan_removal` found; return the bytes freed. Records of
    downloads whose files are gone are dropped with them."""
    removal._strategy.execute()
    cached = _cached_repos()
    with contextlib.suppress(OSError):
        pulls.forget(_cache_dir(), lambda rec: _record_listing(rec, cached) is None)
    return removal.freed_bytes


def describe_options(options: Iterable[QuantOption]) -> list[str]:
    """One line per variant considered (for `localrun plan` / `pull`)."""
    lines = []
    for o in options:
        need = _gib(o.needed_bytes) if o.needed_bytes is not None else "?"
        mark = {True: "fits", False: "too big", None: "?"}[o.fits]
        lines.append(f"{o.repo}{'/' + o.subfolder if o.subfolder else ''}"
                     f"{':' + o.quant if o.quant else ''}: weights {_gib(o.weights_bytes)}, "
                     f"needs {need} ({mark})")
    return lines


__all__: Sequence[str] = (
    "DEFAULT_BACKEND", "DownloadProgress", "FetchPlan", "PlannedFile",
    "ProgressCallback", "QuantOption", "Removal", "cached_models", "default_backend",
    "describe_options", "device_kind", "fetch", "gguf_quant", "keep_model_size", "model_size",
    "model_sizes", "plan_fetch", "plan_removal", "pulled_backends", "quant_matches",
    "record_name", "remove", "repo_format",
)
