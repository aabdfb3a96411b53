#!/usr/bin/env python3
"""Build llama.cpp's own tools from the source vendored in the installed llama-cpp-python.

The engine's own anchors for localrun's benchmarks: ``llama-server``, ``llama-bench``,
``llama-batched-bench``, ``llama-lookup``, ``llama-speculative`` (then ``llama-cli`` and
``llama-mtmd-cli``, cheap once the server's libraries are built), compiled from the same
llama.cpp commit as the installed binding (its sdist carries ``vendor/llama.cpp``) with the
project's CMake flags (scripts/llama_cpp_cmake_args.py: this CPU's vector extensions, no
AMX), so that a comparison measures localrun, not two builds.

Output, per installed version::

    ~/.cache/localrun/llama-tools/<version>/bin/llama-server ...
    ~/.cache/localrun/llama-tools/<version>/.done     (JSON: version, flags, targets)

``.done`` appears when the core tools are in ``bin/`` (it is rewritten when the extras are
added); another process may poll for it. Idempotent: a finished build is left as it is (``--force``
builds again); two runs at once take turns (a lock file). The sdist comes from
``--sdist``, a copy already on this machine (localrun's GPU kit cache, the tools folder
itself) or ``pip download llama-cpp-python==<version> --no-binary :all: --no-deps``.

    .venv/bin/python scripts/build_llama_tools.py                     # build (minutes)
    nohup .venv/bin/python scripts/build_llama_tools.py > build.log 2>&1 &
    .venv/bin/python scripts/build_llama_tools.py --print-bin         # where the tools are

Builds with ``-j2`` by default (``--jobs``). Exit status 0 when the core tools are built.
"""

from __future__ import annotations

import argparse
import fcntl
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
CORE = ("llama-server", "llama-bench", "llama-batched-bench", "llama-lookup",
        "llama-speculative")
EXTRA = ("llama-cli", "llama-mtmd-cli")
#: CMake options of the tools build besides the CPU's (no network at build time: no
#: prebuilt web UI from the Hub, no HTTPS; static, so bin/ needs no build folder)
BUILD_OPTIONS = ("-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF",
                 "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_TOOLS=ON",
                 "-DLLAMA_BUILD_EXAMPLES=ON", "-DLLAMA_BUILD_SERVER=ON",
                 "-DLLAMA_BUILD_APP=OFF", "-DLLAMA_BUILD_UI=OFF",
                 "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_CURL=OFF")


class BuildError(Exception):
    """What went wrong, in one line, and what to do."""


def installed_version() -> str:
    try:
        return importlib.metadata.version("llama_cpp_python")
    except importlib.metadata.PackageNotFoundError:
        raise BuildError("llama-cpp-python is not installed here: install it (pip install "
                         "'localrun-llm[llama-cpp]') or pass --version") from None


def tools_root(version: str) -> Path:
    base = os.environ.get("LOCALRUN_LLAMA_TOOLS") or str(
        Path.home() / ".cache" / "localrun" / "llama-tools")
    return Path(base) / version


def project_cmake_args() -> list[str]:
    """scripts/llama_cpp_cmake_args.py's flags (the binding's own build's)."""
    sys.path.insert(0, str(HERE))
    try:
        from llama_cpp_cmake_args import cmake_args
    finally:
        sys.path.pop(0)
    return cmake_args().split()


def find_sdist(version: str, root: Path, given: str | None) -> Path:
    """The sdist of llama-cpp-python ``version``: given, on disk, or downloaded."""
    name = f"llama_cpp_python-{version}.tar.gz"
    if given:
        path = Path(given).expanduser()
        if not path.is_file():
            raise BuildError(f"--sdist {path}: no such file")
        return path
    for folder in (root / "src", Path.home() / ".cache" / "localrun" / "gpu-kit" / "sdist"):
        if (folder / name).is_file():
            return folder / name
    (root / "src").mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", f"llama-cpp-python=={version}",
           "--no-binary", ":all:", "--no-deps", "-d", str(root / "src")]
    print("$", " ".join(cmd), flush=True)
    if subprocess.run(cmd).returncode != 0 or not (root / "src" / name).is_file():
        raise BuildError(f"could not download llama-cpp-python {version}'s sdist: pass "
                         f"--sdist PATH to a {name}")
    return root / "src" / name


def unpack(sdist: Path, root: Path) -> Path:
    """``vendor/llama.cpp`` of the sdist, unpacked once into ``root/src/llama.cpp``."""
    dest = root / "src" / "llama.cpp"
    marker = dest / ".unpacked"
    if marker.is_file() and marker.read_text() == sdist.name:
        return dest
    if dest.exists():
        shutil.rmtree(dest)
    tmp = root / "src" / "unpacking"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers()
                   if "/vendor/llama.cpp/" in m.name and (m.isfile() or m.isdir())]
        if not members:
            raise BuildError(f"{sdist} has no vendor/llama.cpp: is it llama-cpp-python's sdist?")
        tar.extractall(tmp, members=members, filter="data")
    top = next(tmp.iterdir())
    (top / "vendor" / "llama.cpp").rename(dest)
    shutil.rmtree(tmp)
    marker.write_text(sdist.name)
    return dest


def run(cmd: list[str]) -> int:
    print("$", " ".join(cmd), flush=True)
    return subprocess.run(cmd).returncode


def configure(src: Path, build: Path, flags: list[str]) -> None:
    stamp = build / ".configured"
    wanted = json.dumps(flags)
    if stamp.is_file() and stamp.read_text() == wanted:
        return
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    if run(["cmake", "-S", str(src), "-B", str(build), *gen, *flags]) != 0:
        raise BuildError(f"cmake could not configure {src}: see the output above")
    stamp.write_text(wanted)


def build_targets(build: Path, targets: tuple[str, ...], jobs: int) -> bool:
    return run(["cmake", "--build", str(build), "-j", str(jobs), "--target", *targets]) == 0


def install(build: Path, bin_dir: Path, targets: tuple[str, ...]) -> list[str]:
    """Copy the built ``targets`` into ``bin_dir`` (atomically each); the ones copied."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    done = []
    for name in targets:
        built = build / "bin" / name
        if not built.is_file():
            continue
        tmp = bin_dir / f".{name}.tmp"
        shutil.copy2(built, tmp)
        tmp.replace(bin_dir / name)
        done.append(name)
    return done


def write_done(root: Path, info: dict[str, object]) -> None:
    tmp = root / ".done.tmp"
    tmp.write_text(json.dumps(info, indent=1) + "\n")
    tmp.replace(root / ".done")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--version", help="llama-cpp-python version (default: the installed one)")
    ap.add_argument("--sdist", help="path to llama_cpp_python-<version>.tar.gz")
    ap.add_argument("--jobs", "-j", type=int, default=2)
    ap.add_argument("--no-extra", action="store_true", help="skip llama-cli/llama-mtmd-cli")
    ap.add_argument("--force", action="store_true", help="build even if .done exists")
    ap.add_argument("--print-bin", action="store_true",
                    help="print the bin folder and exit (1 if not built yet)")
    args = ap.parse_args(argv)
    try:
        version = args.version or installed_version()
        root = tools_root(version)
        bin_dir = root / "bin"
        if args.print_bin:
            print(bin_dir)
            return 0 if (root / ".done").is_file() else 1
        root.mkdir(parents=True, exist_ok=True)
        with open(root / ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # another run builds: wait for it
            return _build(args, version, root, bin_dir)
    except BuildError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


def _build(args: argparse.Namespace, version: str, root: Path, bin_dir: Path) -> int:
    wanted = CORE + (() if args.no_extra else EXTRA)
    have = {p.name for p in bin_dir.iterdir()} if bin_dir.is_dir() else set()
    if (root / ".done").is_file() and not args.force:
        missing = [t for t in wanted if t not in have]
        if not missing or (all(t in EXTRA for t in missing) and _extras_failed(root)):
            print(f"llama.cpp tools {version} already built: {bin_dir}")
            return 0
    t0 = time.time()
    sdist = find_sdist(version, root, args.sdist)
    src = unpack(sdist, root)
    flags = [*BUILD_OPTIONS, *project_cmake_args()]
    build = root / "build"
    configure(src, build, flags)
    info: dict[str, object] = {"version": version, "sdist": str(sdist), "cmake_args": flags,
                               "bin": str(bin_dir)}
    if not build_targets(build, CORE, args.jobs):
        raise BuildError(f"building {', '.join(CORE)} failed: see the output above")
    info["tools"] = install(build, bin_dir, CORE)
    info["core_seconds"] = round(time.time() - t0)
    write_done(root, info)
    print(f"core tools built in {info['core_seconds']} s: {bin_dir}", flush=True)
    if not args.no_extra:
        ok = build_targets(build, EXTRA, args.jobs)
        info["tools"] = install(build, bin_dir, CORE + EXTRA)
        info["extras_failed"] = not ok
        info["seconds"] = round(time.time() - t0)
        write_done(root, info)
        print(("extras built" if ok else "extras failed (the core tools are fine)")
              + f": {bin_dir}", flush=True)
    return 0


def _extras_failed(root: Path) -> bool:
    try:
        return bool(json.loads((root / ".done").read_text()).get("extras_failed"))
    except (OSError, ValueError):
        return False


if __name__ == "__main__":
    sys.exit(main())
