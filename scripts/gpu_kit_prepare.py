#!/usr/bin/env python3
"""Assemble what the GPU kit carries to a bare GPU machine, and print the command to run.

    .venv/bin/python scripts/gpu_kit_prepare.py            # build .gpu_kit/ (ignored)
    .venv/bin/python scripts/gpu_kit_prepare.py --offline  # from the download cache only

The GPU machine has no network: everything it needs beyond its own image travels with
the working tree (64 MiB in all, carried folders included). This puts into ``.gpu_kit/``:

- ``wheels/``: ExLlamaV2, ExLlamaV3 and the dependencies the machine lacks, for
  CPython 3.12 on manylinux x86-64 (``spec.WHEELS``; its image's package list is
  ``spec.DEVICE_PACKAGES``);
- ``llama_cpp_python-<v>-cuda-src.tar.gz``: the llama-cpp-python sdist (76 MB) cut down
  to what a CUDA build of the Python package reads (``spec.keep_sdist_member``: no other
  ggml backends, models, docs, tests, examples, tools or web UI, no git history), with
  llama.cpp's common library (never shipped by the package) switched off;
- ``tokenizer/``: SmolLM2's tokenizer, from the fixture that
  ``scripts/make_test_models.py --only hf`` builds (the tiny test model uses it);
- ``prebuilt/`` (only with ``--prebuilt DIR``): llama.cpp's CUDA libraries built here by
  ``scripts/gpu_kit/prebuild_llama.py --all``, which run.py then unpacks instead of
  building them on the device;
- ``bundle.json``: what is inside, sizes and sha256, and the size of everything that
  travels, checked against the limit.

Downloads are cached in ``~/.cache/localrun/gpu-kit`` (``--cache``). Then it prints the
one-line command and the ``carry`` list for the device tool. The kit itself
(scripts/gpu_kit/run.py) travels with the working tree. Rehearse it here first:
``python scripts/gpu_kit/run.py --dry-run``.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))

from gpu_kit import spec  # noqa: E402

MiB = 1024 * 1024


class PrepareError(RuntimeError):
    """A step of the preparation failed: the message says what and what to do."""


def log(msg: str) -> None:
    print(f"[gpu_kit_prepare] {msg}", file=sys.stderr, flush=True)


def default_cache() -> Path:
    return Path(os.environ.get("LOCALRUN_GPU_KIT_CACHE") or
                Path.home() / ".cache" / "localrun" / "gpu-kit")


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _pip_download(args: Sequence[str], dest: Path, offline: bool) -> None:
    if offline:
        raise PrepareError(f"--offline and {' '.join(args)} is not in the cache {dest}")
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "-d", str(dest),
           *args]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        last = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["?"]
        raise PrepareError(f"pip download {' '.join(args[-1:])} failed: {last[0]} "
                           "(needs the package registry; --offline uses the cache only)")


def wheel_matches(filename: str, requirement: str) -> bool:
    """exllamav2==0.3.2 ~ exllamav2-0.3.2-py3-none-any.whl (names normalized)."""
    name, _, version = requirement.partition("==")
    parts = filename[:-4].split("-") if filename.endswith(".whl") else []
    return len(parts) >= 2 and spec.canonical(parts[0]) == spec.canonical(name) and \
        parts[1] == version


def fetch_wheels(cache: Path, offline: bool) -> list[Path]:
    """One cached wheel per requirement in spec.WHEELS (downloaded when missing)."""
    folder = cache / "wheels"
    folder.mkdir(parents=True, exist_ok=True)
    out = []
    for req in spec.WHEELS:
        found = [p for p in folder.glob("*.whl") if wheel_matches(p.name, req)]
        if not found:
            log(f"downloading {req} (cp{spec.PY_VERSION.replace('.', '')}, manylinux x86-64)")
            plats = [a for p in spec.PLATFORMS for a in ("--platform", p)]
            _pip_download(["--only-binary=:all:", "--python-version", spec.PY_VERSION,
                           "--implementation", "cp", *plats, req], folder, offline)
            found = [p for p in folder.glob("*.whl") if wheel_matches(p.name, req)]
        if not found:
            raise PrepareError(f"no wheel for {req} in {folder} after pip download")
        out.append(sorted(found)[-1])
    return out


def fetch_sdist(cache: Path, offline: bool) -> Path:
    folder = cache / "sdist"
    path = folder / spec.LLAMA_SDIST
    if not path.is_file():
        log(f"downloading the llama-cpp-python {spec.LLAMA_CPP_VERSION} sdist (76 MB)")
        _pip_download(["--no-binary=:all:", f"llama-cpp-python=={spec.LLAMA_CPP_VERSION}"],
                      folder, offline)
    if not path.is_file():
        raise PrepareError(f"pip download gave no {spec.LLAMA_SDIST} in {folder}")
    return path


def trim_sdist(sdist: Path, out: Path) -> dict[str, Any]:
    """Write the trimmed, patched source archive; return what was kept and dropped."""
    top = f"llama_cpp_python-{spec.LLAMA_CPP_VERSION}/"
    kept = dropped = kept_bytes = dropped_bytes = 0
    patched = False
    tmp = out.with_name(out.name + ".tmp")
    with tarfile.open(sdist) as src, tarfile.open(tmp, "w:gz", compresslevel=9) as dst:
        for m in src:
            if not m.name.startswith(top) or not (m.isfile() or m.isdir()):
                dropped += 1
                continue
            rel = m.name[len(top):]
            if m.isdir():
                continue  # folders come with their files
            if not spec.keep_sdist_member(rel):
                dropped += 1
                dropped_bytes += m.size
                continue
            fh = src.extractfile(m)
            data = fh.read() if fh is not None else b""
            if rel == "CMakeLists.txt":
                old, new = (s.encode() for s in spec.CMAKE_PATCH)
                if old not in data:
                    raise PrepareError(f"{top}CMakeLists.txt no longer has the line the trim "
                                       "patches (spec.CMAKE_PATCH): update it")
                data = data.replace(old, new)
                patched = True
            info = tarfile.TarInfo(m.name)
            info.size, info.mode, info.mtime = len(data), m.mode, m.mtime
            dst.addfile(info, io.BytesIO(data))
            kept += 1
            kept_bytes += len(data)
    if not patched:
        raise PrepareError(f"{sdist.name} has no {top}CMakeLists.txt")
    os.replace(tmp, out)
    return {"kept_files": kept, "kept_bytes": kept_bytes, "dropped_files": dropped,
            "dropped_bytes": dropped_bytes}


def trimmed_source(cache: Path, offline: bool) -> tuple[Path, dict[str, Any]]:
    """The trimmed archive, cached by the sdist's sha256 and spec.TRIM_VERSION."""
    sdist = fetch_sdist(cache, offline)
    digest = sha256_of(sdist)
    folder = cache / "trimmed" / f"{digest[:16]}-t{spec.TRIM_VERSION}"
    archive = folder / spec.LLAMA_SRC_ARCHIVE
    stats_file = folder / "stats.json"
    if archive.is_file() and stats_file.is_file():
        return archive, json.loads(stats_file.read_text())
    folder.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    stats = trim_sdist(sdist, archive)
    stats.update(sdist=sdist.name, sdist_bytes=sdist.stat().st_size, sdist_sha256=digest,
                 trim_version=spec.TRIM_VERSION)
    stats_file.write_text(json.dumps(stats, indent=1) + "\n")
    log(f"trimmed {sdist.name}: kept {stats['kept_files']} files "
        f"({stats['kept_bytes'] / MiB:.1f} MiB), dropped {stats['dropped_files']} "
        f"({stats['dropped_bytes'] / MiB:.1f} MiB) in {time.monotonic() - t0:.1f} s")
    return archive, stats


def fixture_tokenizer_dir() -> Path | None:
    """The SmolLM2 HF fixture folder listed by scripts/make_test_models.py's manifest."""
    env = os.environ.get("LOCALRUN_TEST_MODELS")
    root = Path(env).expanduser() if env else Path.home() / ".cache/localrun/test-models"
    try:
        manifest = json.loads((root / "manifest.json").read_text(encoding="utf-8"))
        hf = Path(manifest["models"]["hf"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return hf if hf.is_dir() else None


def copy_tokenizer(src: Path, dest: Path) -> list[str]:
    missing = [n for n in spec.TOKENIZER_REQUIRED if not (src / n).is_file()]
    if missing:
        raise PrepareError(f"{src} has no {', '.join(missing)}: point --tokenizer at the "
                           "SmolLM2 HF folder (python scripts/make_test_models.py --only hf)")
    dest.mkdir(parents=True, exist_ok=True)
    copied = []
    for name in spec.TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, dest / name)
            copied.append(name)
    return copied


def tree_bytes(repo: Path) -> int:
    """Bytes of what the device tool sends besides carried paths: tracked files and
    untracked files git does not ignore."""
    try:
        proc = subprocess.run(["git", "ls-files", "-z", "--cached", "--others",
                               "--exclude-standard"], cwd=repo, capture_output=True,
                              check=True)
    except (OSError, subprocess.CalledProcessError):
        return sum(p.stat().st_size for p in repo.rglob("*")
                   if p.is_file() and ".git" not in p.parts and spec.BUNDLE_DIR not in p.parts)
    total = 0
    for name in proc.stdout.decode().split("\0"):
        p = repo / name
        if name and p.is_file() and not p.is_symlink():
            total += p.stat().st_size
    return total


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def run_command(bundle_rel: str, budget_s: int = spec.DEFAULT_BUDGET_S) -> str:
    return (f"PYTHONUNBUFFERED=1 python3 scripts/gpu_kit/run.py --bundle {bundle_rel} "
            f'--out "$OUT" --budget {budget_s}')


def copy_prebuilt(src: Path, dest: Path) -> dict[str, Any]:
    """llama.cpp's libraries from scripts/gpu_kit/prebuild_llama.py --all (the archive and
    its .json), for run.py --llama prebuilt (its default when the bundle has them)."""
    found = sorted(src.glob(spec.PREBUILT_GLOB))
    if not found:
        raise PrepareError(f"no {spec.PREBUILT_GLOB} in {src}: run "
                           "scripts/gpu_kit/prebuild_llama.py --all first")
    archive = found[-1]
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copy2(archive, dest / archive.name)
    meta = archive.with_suffix("").with_suffix(".json")
    info: dict[str, Any] = {"file": archive.name, "bytes": archive.stat().st_size,
                            "sha256": sha256_of(archive)}
    if meta.is_file():
        shutil.copy2(meta, dest / meta.name)
        info["built"] = json.loads(meta.read_text(encoding="utf-8"))
    return info


def prepare(out: Path, cache: Path, tokenizer: Path | None, offline: bool,
            repo: Path = REPO, prebuilt: Path | None = None) -> dict[str, Any]:
    t0 = time.monotonic()
    wheels = fetch_wheels(cache, offline)
    archive, trim = trimmed_source(cache, offline)
    tok_src = tokenizer or fixture_tokenizer_dir()
    if tok_src is None:
        raise PrepareError("no SmolLM2 HF fixture to take the tokenizer from: run "
                           "python scripts/make_test_models.py --only hf (or pass --tokenizer)")
    tmp = Path(tempfile.mkdtemp(prefix=".gpu_kit-", dir=out.parent))
    try:
        (tmp / "wheels").mkdir()
        for w in wheels:
            shutil.copy2(w, tmp / "wheels" / w.name)
        shutil.copy2(archive, tmp / archive.name)
        tok_files = copy_tokenizer(tok_src, tmp / "tokenizer")
        manifest: dict[str, Any] = {
            "kit_version": spec.KIT_VERSION,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "wheels": [{"file": w.name, "bytes": w.stat().st_size, "sha256": sha256_of(w)}
                       for w in wheels],
            "llama_cpp": {"version": spec.LLAMA_CPP_VERSION, "file": archive.name,
                          "bytes": archive.stat().st_size, "sha256": sha256_of(archive),
                          **trim},
            "tokenizer": {"files": tok_files, "source": str(tok_src)},
        }
        if prebuilt is not None:
            manifest["prebuilt"] = copy_prebuilt(prebuilt, tmp / spec.PREBUILT_DIR)
        tree = tree_bytes(repo)
        bundle = 0
        for _ in range(4):  # the sizes are part of bundle.json: write until they hold
            manifest["sizes"] = {"bundle_bytes": bundle, "tree_bytes": tree,
                                 "travel_bytes": bundle + tree,
                                 "limit_bytes": spec.TRAVEL_LIMIT}
            (tmp / spec.BUNDLE_MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
            if folder_bytes(tmp) == bundle:
                break
            bundle = folder_bytes(tmp)
        if bundle + tree > spec.TRAVEL_LIMIT:
            raise PrepareError(
                f"what travels is {(bundle + tree) / MiB:.1f} MiB (bundle {bundle / MiB:.1f}, "
                f"working tree {tree / MiB:.1f}), over the {spec.TRAVEL_LIMIT / MiB:.0f} MiB "
                "limit: trim more (spec.DROP_LLAMA) or carry fewer wheels")
        shutil.rmtree(out, ignore_errors=True)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log(f"bundle ready in {time.monotonic() - t0:.1f} s: {out}")
    return manifest


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=REPO / spec.BUNDLE_DIR,
                    help=f"bundle folder (default: {spec.BUNDLE_DIR}/ in the repo, ignored)")
    ap.add_argument("--cache", type=Path, default=default_cache(),
                    help="download cache (default: ~/.cache/localrun/gpu-kit)")
    ap.add_argument("--tokenizer", type=Path, default=None,
                    help="folder with SmolLM2's tokenizer.json (default: the hf fixture)")
    ap.add_argument("--offline", action="store_true", help="use the download cache only")
    ap.add_argument("--prebuilt", type=Path, default=None,
                    help="carry llama.cpp's libraries built here "
                         "(scripts/gpu_kit/prebuild_llama.py --all; its --out folder)")
    ap.add_argument("--json", action="store_true", help="print bundle.json instead of prose")
    args = ap.parse_args(argv)
    out = args.out.resolve()
    try:
        manifest = prepare(out, args.cache.expanduser(), args.tokenizer, args.offline,
                           prebuilt=args.prebuilt)
    except PrepareError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(manifest, indent=1))
        return 0
    s = manifest["sizes"]
    try:
        rel = out.relative_to(REPO).as_posix()
    except ValueError:
        rel = None
    print(f"bundle {out}: {s['bundle_bytes'] / MiB:.1f} MiB; with the working tree "
          f"{s['travel_bytes'] / MiB:.1f} MiB of {s['limit_bytes'] / MiB:.0f} MiB")
    if manifest.get("prebuilt"):
        print(f"llama.cpp: the prebuilt libraries ({manifest['prebuilt']['file']}) replace "
              "the build on the device (run.py --llama build overrides)")
    if rel is None:
        print("(outside the repo: it cannot be carried; use the default --out)")
        return 0
    print("rehearse here:  .venv/bin/python scripts/gpu_kit/run.py --dry-run")
    print("device tool run, timeout_s 600:")
    print(f"  command: {run_command(rel)}")
    print(f"  carry:   {json.dumps([rel])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
