#!/usr/bin/env python3
"""Build llama.cpp's CUDA libraries here, off the GPU machine, for the kit to carry.

The GPU kit's one command has 560 s; llama.cpp's CUDA build for sm_90 is 144 CUDA and 64
C/C++ units, about an hour of one core. When that would not fit the device's 16 cores
beside ExLlamaV2's build, this builds the same trimmed source here, with this machine's
nvcc (13.0, as on the GPU machine) and cuBLAS from PyPI's ``nvidia-cublas`` wheel (the
toolkit here has no cuBLAS), and packs the libraries for ``run.py --llama prebuilt``:

    python scripts/gpu_kit/prebuild_llama.py --sample mmq-instance-q4_0 fattn-tile-instance-dkq64
    python scripts/gpu_kit/prebuild_llama.py --all          # the whole build, then:
    python scripts/gpu_kit_prepare.py --prebuilt .gpu_kit-cuda/out

``--sample`` compiles only the named units (one job each, timed), measures their
objects, and extrapolates the whole build's core-seconds and the packed libraries' size
from them and the unit counts of build.ninja; it prints JSON. ``--all`` builds
everything with ``-j`` (all cores) and writes ``llama-cuda-sm90-<version>.tar.xz`` and
its ``.json`` (what was built, with what, how long, how large) into ``--out``.

What the prebuilt libraries differ in from a build on the device: the CPU backend is
built for x86-64-v3 (AVX2, FMA, F16C, BMI2; no AVX-512, no AMX: the GPU machine's CPU
is not known here), CUDA for ``90-real`` only (no PTX: the H200 runs sm_90 code), and
without CUDA's virtual memory management (``GGML_CUDA_NO_VMM``: no libcuda to link
against here; llama.cpp then uses its legacy memory pool). All work lies under
``--work`` (default ``.gpu_kit-cuda/``, ignored by git): the wheels (cuBLAS: 420 MB),
the source, the build.
"""

from __future__ import annotations

import argparse
import json
import lzma
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))

from gpu_kit import spec  # noqa: E402
from gpu_kit.cuda import find_cuda_home  # noqa: E402
from gpu_kit.facts import ninja_summary, unit_kind  # noqa: E402

WORK = REPO / ".gpu_kit-cuda"
ARCHS = "90-real"
#: x86-64-v3: every server CPU of the last ten years has these; AVX-512 and AMX are off.
CPU_ARGS = ("-DGGML_NATIVE=OFF", "-DGGML_SSE42=ON", "-DGGML_AVX=ON", "-DGGML_AVX2=ON",
            "-DGGML_FMA=ON", "-DGGML_F16C=ON", "-DGGML_BMI2=ON", "-DGGML_AVX_VNNI=OFF",
            "-DGGML_AVX512=OFF", "-DGGML_AVX512_VBMI=OFF", "-DGGML_AVX512_VNNI=OFF",
            "-DGGML_AVX512_BF16=OFF", "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF",
            "-DGGML_AMX_BF16=OFF")
#: Seconds one unit of each kind took, compiled alone for sm_90 on this project's CPU
#: machine (nvcc 13.0), as recorded in docs/results/gpu.md: 2026-11-30 (mmq-instance-q4_0
#: 19, a fattn-mma instance 33, a fattn-tile instance 60, argmax.cu 7) and 2026-12-01,
#: CPU seconds of --sample (mmq-instance-q4_0 23.6, mmf-instance-ncols_1 17.6,
#: ggml-cuda.cu 13.9). Kinds never measured take the mean of all of them.
REFERENCE_S: dict[str, list[float]] = {
    "mmq": [19.0, 23.6], "fattn-mma": [33.0], "fattn-tile": [60.0], "mmf": [17.6],
    "cuda": [7.0, 13.9],
}
MiB = 1024 * 1024


class PrebuildError(RuntimeError):
    """A step failed: the message says which and what to do."""


def log(msg: str) -> None:
    print(f"[prebuild_llama] {msg}", file=sys.stderr, flush=True)


def run(cmd: Sequence[str | os.PathLike[str]], **kw: Any) -> subprocess.CompletedProcess[str]:
    p = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, **kw)
    if p.returncode != 0:
        tail = (p.stderr or p.stdout).strip().splitlines()[-15:]
        raise PrebuildError(f"{Path(str(cmd[0])).name} {' '.join(map(str, cmd[1:3]))} exited "
                            f"{p.returncode}:\n  " + "\n  ".join(tail))
    return p


def nvcc_minor(home: str) -> tuple[int, int]:
    out = run([str(Path(home) / "bin" / "nvcc"), "--version"]).stdout
    m = re.search(r"release (\d+)\.(\d+)", out)
    if not m:
        raise PrebuildError(f"cannot read nvcc's version from: {out.strip()[-200:]}")
    return int(m.group(1)), int(m.group(2))


def cublas(work: Path, version: tuple[int, int], libs: bool) -> dict[str, Any]:
    """cuBLAS headers (and with ``libs``, the libraries: 590 MB unpacked, needed only to
    link) from PyPI's nvidia-cublas wheel of nvcc's minor version, unpacked into
    work/cublas; libcublas.so links point at .so.N."""
    major, minor = version
    wheels = work / "wheels"
    found = sorted(wheels.glob(f"nvidia_cublas-{major}.{minor}.*.whl"))
    if not found:
        log(f"downloading nvidia-cublas {major}.{minor}.* (about 420 MB)")
        run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
             "--only-binary=:all:", "--python-version", spec.PY_VERSION, "--implementation",
             "cp", *[a for p in spec.PLATFORMS for a in ("--platform", p)], "-d", wheels,
             f"nvidia-cublas>={major}.{minor},<{major}.{minor + 1}"])
        found = sorted(wheels.glob(f"nvidia_cublas-{major}.{minor}.*.whl"))
    if not found:
        raise PrebuildError(f"no nvidia-cublas {major}.{minor} wheel in {wheels}")
    wheel = found[-1]
    dest = work / "cublas"
    stamp = dest / (".wheel-libs" if libs else ".wheel")
    if not (stamp.is_file() and stamp.read_text().strip() == wheel.name):
        shutil.rmtree(dest, ignore_errors=True)
        with zipfile.ZipFile(wheel) as z:
            for info in z.infolist():
                m = re.match(r"nvidia/cu\d+/(include|lib)/([^/]+)$", info.filename)
                if m and (libs or m.group(1) == "include"):
                    target = dest / m.group(1) / m.group(2)
                    target.parent.mkdir(parents=True, exist_ok=True)
                    with z.open(info) as src, target.open("wb") as out:
                        shutil.copyfileobj(src, out)
        for so in (dest / "lib").glob("*.so.*"):
            link = so.with_name(so.name.split(".so")[0] + ".so")
            if not link.exists():
                link.symlink_to(so.name)
        stamp.write_text(wheel.name + "\n")
    return {"wheel": wheel.name, "include": str(dest / "include"), "lib": str(dest / "lib")}


def trimmed_archive(bundle: Path) -> Path:
    """The kit's trimmed llama-cpp-python source: the bundle's, else prepare's cache."""
    name = spec.LLAMA_SRC_ARCHIVE
    cache = Path(os.environ.get("LOCALRUN_GPU_KIT_CACHE") or
                 Path.home() / ".cache" / "localrun" / "gpu-kit")
    for p in [bundle / name, *sorted(cache.glob(f"trimmed/*/{name}"))]:
        if p.is_file():
            return p
    raise PrebuildError(f"no {name} in {bundle} or {cache}: run scripts/gpu_kit_prepare.py")


def source(work: Path, archive: Path) -> Path:
    top = work / "src" / f"llama_cpp_python-{spec.LLAMA_CPP_VERSION}"
    stamp = work / "src" / ".archive"
    key = f"{archive.name} {archive.stat().st_size}"
    if top.is_dir() and stamp.is_file() and stamp.read_text().strip() == key:
        return top
    shutil.rmtree(work / "src", ignore_errors=True)
    (work / "src").mkdir(parents=True)
    with tarfile.open(archive) as tar:
        extra: dict[str, Any] = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
        tar.extractall(work / "src", **extra)
    stamp.write_text(key + "\n")
    return top


def configure(work: Path, src: Path, home: str, cb: dict[str, Any]) -> Path:
    build = work / "build"
    inc = f"-I{cb['include']}"
    lib = Path(cb["lib"])
    args: list[str | os.PathLike[str]] = [
            "cmake", "-S", src, "-B", build, "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
            "-DLLAVA_BUILD=OFF", "-Wno-dev", f"-DSKBUILD_PLATLIB_DIR={work / 'stage'}",
            f"-DCMAKE_INSTALL_PREFIX={work / 'prefix'}", *CPU_ARGS, "-DGGML_CUDA=ON",
            f"-DCMAKE_CUDA_ARCHITECTURES={ARCHS}", "-DGGML_CUDA_NO_VMM=ON",
            f"-DCMAKE_CUDA_COMPILER={Path(home) / 'bin' / 'nvcc'}",
            f"-DCMAKE_CUDA_FLAGS={inc}", f"-DCMAKE_CXX_FLAGS={inc}",
            f"-DCUDA_cublas_LIBRARY={lib / 'libcublas.so'}",
            f"-DCUDA_cublasLt_LIBRARY={lib / 'libcublasLt.so'}"]
    if not (build / "build.ninja").is_file():
        t0 = time.monotonic()
        run(args)
        log(f"configured in {time.monotonic() - t0:.0f} s: {build}")
    return build


def units(build: Path) -> list[str]:
    """The object files build.ninja makes (CUDA and C/C++ units)."""
    text = (build / "build.ninja").read_text(errors="replace")
    return re.findall(r"^build (\S+\.(?:cu|c|cpp)\.o):", text, re.M)


def counts_by_kind(objs: Sequence[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for o in objs:
        out[unit_kind(o)] = out.get(unit_kind(o), 0) + 1
    return out


def xz_size(data: bytes) -> int:
    return len(lzma.compress(data, preset=6))


def sample(build: Path, names: Sequence[str]) -> dict[str, Any]:
    """Compile the named units one at a time (one job), timed; extrapolate."""
    objs = units(build)
    measured: list[dict[str, Any]] = []
    for name in names:
        match = [o for o in objs if name in Path(o).name]
        if not match:
            raise PrebuildError(f"no unit named like {name!r} in {build / 'build.ninja'}")
        obj = match[0]
        (build / obj).unlink(missing_ok=True)
        t0 = time.monotonic()
        c0 = os.times()
        run(["ninja", "-C", build, "-j1", obj])
        c1 = os.times()
        wall = time.monotonic() - t0
        data = (build / obj).read_bytes()
        measured.append({"unit": Path(obj).name, "kind": unit_kind(obj), "wall_s": round(wall, 1),
                         "cpu_s": round(c1.children_user - c0.children_user +
                                        c1.children_system - c0.children_system, 1),
                         "object_bytes": len(data), "object_xz_bytes": xz_size(data)})
        log(f"{Path(obj).name}: {wall:.1f} s, {len(data) / MiB:.2f} MiB")
    return {"measured": measured, **extrapolate(objs, measured)}


def extrapolate(objs: Sequence[str], measured: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The whole build from a few units. Per kind, the seconds known for a unit of it:
    those measured here and REFERENCE_S; a kind with none takes the mean of all known
    (C/C++ units: 10 s, assumed). Where a kind has more than one figure (a reference and
    a sample: a small and a large unit of the "cuda" kind, say), low and high bound the
    estimate. The CUDA objects' size: the sampled objects' mean times the CUDA units."""
    kinds = counts_by_kind(objs)
    per: dict[str, list[float]] = {k: list(v) for k, v in REFERENCE_S.items()}
    for m in measured:
        per.setdefault(m["kind"], []).append(m["cpu_s"] or m["wall_s"])
    every = [x for v in per.values() for x in v]
    fallback = sum(every) / len(every)
    plan: dict[str, Any] = {}
    low = high = 0.0
    for kind, n in sorted(kinds.items()):
        sampled = [m["wall_s"] for m in measured if m["kind"] == kind]
        if kind == "c/c++" and not sampled:
            vals, src = [10.0], "assumed (not sampled)"
        elif kind in per:
            vals = per[kind]
            src = " + ".join(filter(None, ("measured here" if sampled else "",
                                           "reference" if kind in REFERENCE_S else "")))
        else:
            vals, src = [fallback], "mean of the known figures"
        plan[kind] = {"units": n, "s_per_unit": [round(min(vals), 1), round(max(vals), 1)],
                      "source": src, "core_s": [round(n * min(vals)), round(n * max(vals))]}
        low += n * min(vals)
        high += n * max(vals)
    cu = [m for m in measured if m["kind"] != "c/c++"]
    n_cuda = sum(n for k, n in kinds.items() if k != "c/c++")
    size: dict[str, Any] = {}
    if cu:
        mean = sum(m["object_bytes"] for m in cu) / len(cu)
        ratio = sum(m["object_xz_bytes"] for m in cu) / sum(m["object_bytes"] for m in cu)
        size = {"cuda_objects_mib": round(n_cuda * mean / MiB, 1), "xz_ratio": round(ratio, 3),
                "packed_mib": round(n_cuda * mean * ratio / MiB, 1),
                "basis": f"mean of {len(cu)} sampled CUDA objects x {n_cuda} CUDA units"}
    return {"units": kinds, "plan": plan, "core_s": [round(low), round(high)],
            "hours_one_core": [round(low / 3600, 2), round(high / 3600, 2)], "size": size}


def build_all(work: Path, build: Path, jobs: int, out: Path, meta: dict[str, Any]) -> Path:
    t0 = time.monotonic()
    run(["cmake", "--build", build, "-j", str(jobs)])
    seconds = time.monotonic() - t0
    stage = work / "stage"
    shutil.rmtree(stage, ignore_errors=True)
    run(["cmake", "--install", build])
    libs = sorted((stage / "llama_cpp" / "lib").glob("*.so*"))
    if not any(p.name.startswith("libggml-cuda.so") for p in libs):
        raise PrebuildError(f"the install left no libggml-cuda.so in {stage}/llama_cpp/lib")
    for p in libs:
        if p.is_file() and not p.is_symlink():
            subprocess.run(["strip", "--strip-unneeded", str(p)], check=False)
    out.mkdir(parents=True, exist_ok=True)
    name = f"llama-cuda-sm90-{spec.LLAMA_CPP_VERSION}"
    archive = out / f"{name}.tar.xz"
    with tarfile.open(archive, "w:xz", preset=6) as tar:
        for p in libs:
            tar.add(p, arcname=f"lib/{p.name}")
    meta.update(build_s=round(seconds, 0), jobs=jobs,
                libs={p.name: p.stat().st_size for p in libs if not p.is_symlink()},
                archive=archive.name, archive_bytes=archive.stat().st_size,
                ninja=ninja_summary(build / ".ninja_log"))
    (out / f"{name}.json").write_text(json.dumps(meta, indent=1) + "\n")
    return archive


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    what = ap.add_mutually_exclusive_group(required=True)
    what.add_argument("--sample", nargs="+", metavar="UNIT",
                      help="compile only these units (a part of the object's name), timed")
    what.add_argument("--all", action="store_true", help="build and pack everything")
    what.add_argument("--count", action="store_true",
                      help="configure, count the units, estimate from REFERENCE_S alone")
    ap.add_argument("--work", type=Path, default=WORK, help=f"default {WORK}")
    ap.add_argument("--bundle", type=Path, default=REPO / spec.BUNDLE_DIR)
    ap.add_argument("--out", type=Path, default=None, help="default WORK/out")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args(argv)
    work = args.work.resolve()
    try:
        home = find_cuda_home()
        if not home:
            raise PrebuildError("no CUDA toolkit (nvcc) here: install it, or build on the "
                                "device (run.py --llama build)")
        version = nvcc_minor(home)
        cb = cublas(work, version, libs=args.all)
        src = source(work, trimmed_archive(args.bundle))
        build = configure(work, src, home, cb)
        meta: dict[str, Any] = {
            "llama_cpp_python": spec.LLAMA_CPP_VERSION, "nvcc": f"{version[0]}.{version[1]}",
            "cublas_wheel": cb["wheel"], "cuda_architectures": ARCHS,
            "cpu_args": list(CPU_ARGS), "no_vmm": True,
            "built": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        if args.count:
            objs = units(build)
            print(json.dumps({**meta, **extrapolate(objs, []), "total": len(objs)},
                             indent=1))
        elif args.sample:
            print(json.dumps({**meta, **sample(build, args.sample)}, indent=1))
        else:
            archive = build_all(work, build, args.jobs, (args.out or work / "out").resolve(),
                                meta)
            print(f"{archive} ({archive.stat().st_size / MiB:.1f} MiB); next: "
                  f"python scripts/gpu_kit_prepare.py --prebuilt {archive.parent}")
    except PrebuildError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
