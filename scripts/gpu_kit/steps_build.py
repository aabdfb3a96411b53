"""The GPU kit's build steps: the machine, the carried wheels, llama.cpp, the ExLlama
extensions, the tiny test models. Each is a function of the Kit and its StepContext that
returns a one-line detail or raises StepFailed / StepSkipped (gpu_kit.runner).
"""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import sys
import tarfile
from pathlib import Path
from typing import Any

from gpu_kit import spec
from gpu_kit.cuda import (
    capture,
    find_cuda_home,
    find_libcuda,
    find_pip_cublas,
    pip_cuda_dirs,
    toolkit_lib,
)
from gpu_kit.kit import REPO, Kit, last_json, prebuilt_archive
from gpu_kit.report import now_iso
from gpu_kit.runner import StepContext, StepFailed, StepSkipped, tail_of

#: Compile fallback: nvcc 13.1+ misparses torch's ATen headers in C++17 mode
#: (turboderp-org/exllamav3 PR #360); the GPU machine has 13.0.
CXX20_MARK = "need 'typename' before"
EXT_NAMES = {"exllamav2": "exllamav2_ext", "exllamav3": "exllamav3_ext"}
#: CPU priority of the three builds that run side by side: ExLlamaV2 first (the smallest,
#: and the most localrun code never run), llama.cpp next, ExLlamaV3 on idle cores only.
EXL2_NICE, LLAMA_NICE, EXL3_NICE = 0, 4, 15
#: Imports the engine's extension (compiling it on first import); with "cxx20", torch's
#: cpp_extension.load gets -std=c++20 for nvcc first.
BUILD_SNIPPET = """
import sys, time
engine, cxx20 = sys.argv[1], sys.argv[2] == "1"
if cxx20:
    import torch.utils.cpp_extension as ce
    _load = ce.load
    def load(*a, **kw):
        kw["extra_cuda_cflags"] = list(kw.get("extra_cuda_cflags") or []) + ["-std=c++20"]
        return _load(*a, **kw)
    ce.load = load
t0 = time.monotonic()
import importlib
ext = importlib.import_module(engine + ".ext")
mod = getattr(ext, "ext_c", None) or getattr(ext, engine + "_ext", None)
print("extension", getattr(mod, "__file__", mod), "in", round(time.monotonic() - t0, 1), "s")
"""


def step_env(kit: Kit, ctx: StepContext) -> str:
    f = ctx.facts
    f["mode"] = "gpu" if kit.gpu else "rehearsal"
    f["python"] = f"{platform.python_version()} ({sys.executable})"
    f["machine"] = f"{platform.machine()}, {os.cpu_count()} cores, {platform.platform()}"
    f["bundle"] = {k: kit.manifest.get(k) for k in ("kit_version", "created", "sizes")}
    smi = capture(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,memory.used,"
                   "memory.free,compute_cap", "--format=csv,noheader"])
    f["nvidia_smi"] = [ln.strip() for ln in smi.splitlines() if ln.strip()] or None
    home = find_cuda_home()
    kit.cuda_home = home
    f["cuda_home"] = home
    if home:
        ver = capture([str(Path(home) / "bin" / "nvcc"), "--version"])
        m = re.search(r"release (\d+)\.(\d+)", ver)
        f["nvcc"] = f"{m.group(1)}.{m.group(2)}" if m else (ver.strip() or None)
        kit.cxx20 = m is not None and (int(m.group(1)), int(m.group(2))) >= (13, 1)
        f["nvcc_cxx20"] = kit.cxx20
    for tool in ("cmake", "ninja", "gcc"):
        lines = capture([tool, "--version"]).strip().splitlines()
        f[tool] = lines[0] if lines else None
    probe = ("import json, torch, transformers; c = torch.cuda.is_available(); "
             "print(json.dumps({'torch': torch.__version__, 'torch_cuda': torch.version.cuda, "
             "'cuda_available': c, 'device': torch.cuda.get_device_name(0) if c else None, "
             "'capability': list(torch.cuda.get_device_capability(0)) if c else None, "
             "'transformers': transformers.__version__}))")
    if kit.tools_python:
        f["torch"] = last_json(ctx.run([kit.tools_python, "-c", probe], check=False,
                                       limit=60, capture=True).stdout)
    # cuBLAS and the driver library: from the toolkit, else from torch's nvidia-* wheels
    cublas: dict[str, Any] = {}
    if home:
        h = Path(home)
        cublas["toolkit_header"] = (h / "include" / "cublas_v2.h").exists()
        lib = toolkit_lib(h, "libcublas")
        cublas["toolkit_lib"] = str(lib) if lib else None
        if not (cublas["toolkit_header"] and lib):
            inc, plib = find_pip_cublas(kit.tools_python or kit.python)
            cublas.update(pip_include=str(inc) if inc else None,
                          pip_lib=str(plib) if plib else None)
            if inc and plib:
                kit.cuda_env = {
                    "CPATH": os.pathsep.join([str(inc), os.environ.get("CPATH", "")]).strip(":"),
                    "LIBRARY_PATH": os.pathsep.join([str(plib), os.environ.get(
                        "LIBRARY_PATH", "")]).strip(":"),
                    "LD_LIBRARY_PATH": os.pathsep.join([str(plib), os.environ.get(
                        "LD_LIBRARY_PATH", "")]).strip(":")}
                so = sorted(plib.glob("libcublas.so*"))[0]
                lt = sorted(plib.glob("libcublasLt.so*"))
                kit.cmake_cuda += [f"-DCUDA_cublas_LIBRARY={so}"] + \
                    ([f"-DCUDA_cublasLt_LIBRARY={lt[0]}"] if lt else [])
        if not toolkit_lib(h, "libcuda"):
            drv = find_libcuda()
            cublas["libcuda"] = str(drv) if drv else None
            kit.cmake_cuda += [f"-DCUDA_cuda_driver_LIBRARY={drv}"] if drv else \
                ["-DGGML_CUDA_NO_VMM=ON"]
    f["cuda_libs"] = cublas
    if kit.gpu:
        t = f.get("torch") or {}
        if not t.get("cuda_available"):
            raise StepFailed(f"torch sees no CUDA device ({t or 'torch did not import'}): "
                             "the GPU steps cannot run")
        if not home:
            raise StepFailed("no CUDA toolkit (nvcc) found: the builds cannot run")
        return f"{t.get('device')} (sm_{''.join(map(str, t.get('capability') or []))}), " \
               f"torch {t.get('torch')}, nvcc {f.get('nvcc')}"
    return f"rehearsal on {platform.machine()}; nvcc {f.get('nvcc') or 'absent'}; " \
           f"torch: {(f.get('torch') or {}).get('torch') or 'no fixtures venv'}"


def read_requires(dist_info: Path) -> list[str]:
    try:
        text = (dist_info / "METADATA").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return []
    return [ln.split(":", 1)[1].strip() for ln in text.splitlines()
            if ln.startswith("Requires-Dist:")]


def requirement_needed(req: str, markers: dict[str, str]) -> str | None:
    """The canonical name of a requirement that applies on the GPU machine, else None."""
    try:
        from packaging.requirements import Requirement
    except ImportError:  # no packaging: take the name, skip anything with a marker
        if ";" in req:
            return None
        m = re.match(r"[A-Za-z0-9._-]+", req)
        return spec.canonical(m.group(0)) if m else None
    r = Requirement(req)
    if r.marker is not None and not r.marker.evaluate(markers):
        return None
    return spec.canonical(r.name)


def localrun_requirements() -> list[str]:
    try:
        import tomllib
    except ImportError:  # Python 3.10: no tomllib; the check covers the carried wheels
        return []
    data = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    return list(data.get("project", {}).get("dependencies", []))


def installed_names() -> set[str]:
    from importlib import metadata

    return {spec.canonical(d.metadata["Name"] or "") for d in metadata.distributions()}


def step_install(kit: Kit, ctx: StepContext) -> str:
    wheels = sorted((kit.bundle / "wheels").glob("*.whl"))
    if not wheels:
        raise StepFailed(f"no wheels in {kit.bundle / 'wheels'}: run scripts/gpu_kit_prepare.py")
    kit.site.mkdir(parents=True, exist_ok=True)
    cmd = [kit.python, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps",
           "--no-compile", "--no-cache-dir", "--upgrade", "--disable-pip-version-check",
           "--target", str(kit.site)]
    if not kit.gpu:  # install for the GPU machine's CPython 3.12, whatever runs here
        cmd += ["--only-binary=:all:", "--python-version", spec.PY_VERSION,
                "--implementation", "cp"] + [a for p in spec.PLATFORMS for a in ("--platform", p)]
    ctx.run([*cmd, *map(str, wheels)], env={"PIP_CONSTRAINT": ""}, limit=120)
    if not kit.gpu:  # the rehearsal's tests run in this venv: pytest-timeout beside it
        plugin = [w for w in wheels if spec.canonical(w.name.split("-")[0]) ==
                  spec.PYTEST_TIMEOUT]
        if plugin:
            ctx.run([kit.python, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps",
                     "--no-compile", "--upgrade", "--disable-pip-version-check", "--target",
                     str(kit.plugins), str(plugin[0])], env={"PIP_CONSTRAINT": ""}, limit=60)
    dists = {spec.canonical(p.name.split("-")[0]): p for p in kit.site.glob("*.dist-info")}
    ctx.facts["installed"] = sorted(p.name[: -len(".dist-info")] for p in dists.values())
    # every requirement must be carried, on the machine's image, or known to be unused
    available = set(dists) | (installed_names() if kit.gpu else set(spec.DEVICE_PACKAGES))
    markers = dict(spec.DEVICE_MARKERS)
    if kit.gpu:
        markers.update(python_version=platform.python_version().rsplit(".", 1)[0],
                       python_full_version=platform.python_version())
    missing: dict[str, list[str]] = {}
    wanted = [(name, read_requires(p)) for name, p in dists.items()]
    wanted.append(("localrun", localrun_requirements()))
    for owner, reqs in wanted:
        for req in reqs:
            name = requirement_needed(req, markers)
            if name and name not in available and name not in spec.NOT_CARRIED:
                missing.setdefault(name, []).append(owner)
    ctx.facts["not_carried"] = spec.NOT_CARRIED
    if missing:
        raise StepFailed("missing on the GPU machine: " + "; ".join(
            f"{n} (needed by {', '.join(sorted(set(o)))})" for n, o in sorted(missing.items())))
    return f"{len(dists)} packages into {kit.site}; every requirement is carried or there"


def step_llama_src(kit: Kit, ctx: StepContext) -> str:
    info = kit.manifest.get("llama_cpp", {})
    archive = kit.bundle / str(info.get("file") or spec.LLAMA_SRC_ARCHIVE)
    if not archive.is_file():
        raise StepFailed(f"no {archive.name} in the bundle: run scripts/gpu_kit_prepare.py")
    stamp = kit.llama_src.parent / ".kit-sha256"
    sha = str(info.get("sha256", ""))
    if kit.llama_src.is_dir() and stamp.is_file() and stamp.read_text().strip() == sha and sha:
        return f"already extracted in {kit.llama_src.parent}"
    shutil.rmtree(kit.llama_src.parent, ignore_errors=True)
    kit.llama_src.parent.mkdir(parents=True)
    with tarfile.open(archive) as tar:
        members = [m for m in tar.getmembers() if m.isfile() or m.isdir()]
        extra: dict[str, Any] = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
        tar.extractall(kit.llama_src.parent, members=members, **extra)
    stamp.write_text(sha + "\n")
    n = sum(1 for m in members if m.isfile())
    ctx.facts.update(files=n, archive_bytes=archive.stat().st_size)
    return f"{n} files ({archive.stat().st_size / 2**20:.1f} MiB archive)"


def cpu_cmake_args() -> list[str]:
    """scripts/llama_cpp_cmake_args.py: this CPU's vector extensions, never AMX."""
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        from llama_cpp_cmake_args import cmake_args
    finally:
        sys.path.pop(0)
    return cmake_args().split()


def step_llama_configure(kit: Kit, ctx: StepContext) -> str:
    if kit.gpu and kit.llama_mode == "prebuilt":
        raise StepSkipped("not needed: the bundle carries llama.cpp's libraries, built off "
                          "the device (--llama build compiles them here instead)")
    args = ["cmake", "-S", str(kit.llama_src), "-B", str(kit.llama_build), "-G", "Ninja",
            "-DCMAKE_BUILD_TYPE=Release", "-DLLAVA_BUILD=OFF", "-Wno-dev",
            f"-DSKBUILD_PLATLIB_DIR={kit.site}",
            f"-DCMAKE_INSTALL_PREFIX={kit.work / 'llama-prefix'}", *cpu_cmake_args()]
    cuda = bool(kit.cuda_home)
    if cuda:
        args += ["-DGGML_CUDA=ON", "-DCMAKE_CUDA_ARCHITECTURES=90",
                 f"-DCMAKE_CUDA_COMPILER={Path(kit.cuda_home or '') / 'bin' / 'nvcc'}",
                 *kit.cmake_cuda]
        if not kit.gpu and not any("cublas_LIBRARY" in a for a in args) and \
                not toolkit_lib(Path(kit.cuda_home or ""), "libcublas"):
            # the rehearsal only configures: a path stands in for the missing libraries
            none = kit.work / "no-cuda-libs"
            args += [f"-DCUDA_cublas_LIBRARY={none / 'libcublas.so'}",
                     f"-DCUDA_cublasLt_LIBRARY={none / 'libcublasLt.so'}"]
            ctx.facts["placeholder_libs"] = "cuBLAS is not here: configured against a path"
        if not kit.gpu and not any("cuda_driver" in a or "NO_VMM" in a for a in args) and \
                not toolkit_lib(Path(kit.cuda_home or ""), "libcuda"):
            args.append(f"-DCUDA_cuda_driver_LIBRARY={kit.work / 'no-cuda-libs' / 'libcuda.so'}")
    else:
        args.append("-DGGML_CUDA=OFF")
    ctx.facts["cmake_args"] = args[3:]
    r = ctx.run(args, env=kit.cuda_env, limit=180, check=False)
    if r.returncode != 0:
        raise StepFailed(f"cmake configure failed (exit {r.returncode}): "
                         f"{last_error(tail_of(ctx.log_path, 400_000))}")
    ninja = (kit.llama_build / "build.ninja").read_text(errors="replace")
    cu = len(re.findall(r"^build \S+\.cu\.o:", ninja, re.M))
    cc = len(re.findall(r"^build \S+\.(?:c|cpp)\.o:", ninja, re.M))
    ctx.facts.update(cuda=cuda, cuda_units=cu, c_cpp_units=cc, seconds=round(r.seconds, 1))
    if cuda and cu == 0:
        raise StepFailed("configured with GGML_CUDA=ON but no CUDA sources were found")
    return f"GGML_CUDA={'ON' if cuda else 'OFF'}: {cu} CUDA + {cc} C/C++ units" + \
        (" (configure only: cuBLAS stands in by path)" if ctx.facts.get("placeholder_libs")
         else "")


def unpack_prebuilt(kit: Kit, ctx: StepContext) -> str:
    """--llama prebuilt: the libraries scripts/gpu_kit/prebuild_llama.py built off the
    device, unpacked where llama_install takes them from."""
    archive = prebuilt_archive(kit.bundle)
    if archive is None:
        raise StepFailed(f"--llama prebuilt, but {kit.bundle / spec.PREBUILT_DIR} holds no "
                         f"{spec.PREBUILT_GLOB}: run scripts/gpu_kit/prebuild_llama.py --all, "
                         "then scripts/gpu_kit_prepare.py")
    shutil.rmtree(kit.prebuilt_libs, ignore_errors=True)
    kit.prebuilt_libs.mkdir(parents=True)
    with tarfile.open(archive) as tar:
        members = [m for m in tar.getmembers() if m.isfile() or m.issym()]
        extra: dict[str, Any] = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
        tar.extractall(kit.prebuilt_libs, members=members, **extra)
    libs = sorted(p.name for p in kit.prebuilt_libs.rglob("*.so*"))
    if not any(n.startswith("libggml-cuda.so") for n in libs):
        raise StepFailed(f"{archive.name} has no libggml-cuda.so: {libs}")
    meta = archive.with_suffix("").with_suffix(".json")
    if meta.is_file():
        ctx.facts["prebuilt"] = json.loads(meta.read_text(encoding="utf-8"))
    ctx.facts.update(archive=archive.name, archive_bytes=archive.stat().st_size, libs=libs)
    return f"unpacked {len(libs)} libraries from {archive.name} " \
           f"({archive.stat().st_size / 2**20:.1f} MiB), built off the device"


def step_llama_build(kit: Kit, ctx: StepContext) -> str:
    if kit.llama_mode == "prebuilt":
        return unpack_prebuilt(kit, ctx)
    if not kit.gpu:
        raise StepSkipped("the CUDA build runs on the GPU machine (the configure step "
                          "checked the trimmed source here)")
    # nice 4: ExLlamaV2's smaller build (nice 0) finishes first and its conversion and
    # tests run while this one goes on; neither waits on the other's serial tail
    r = ctx.run(["cmake", "--build", str(kit.llama_build), "-j", str(kit.jobs)],
                env=kit.cuda_env, check=False, nice=LLAMA_NICE)
    if r.returncode != 0:
        raise StepFailed(f"the build failed (exit {r.returncode}): "
                         f"{last_error(tail_of(ctx.log_path, 400_000))}")
    steps = re.findall(r"\[(\d+)/(\d+)\]", r.tail)
    ctx.facts.update(seconds=round(r.seconds, 1), jobs=kit.jobs, nice=LLAMA_NICE,
                     ninja_edges=int(steps[-1][1]) if steps else None)
    return f"built with -j{kit.jobs} in {r.seconds:.0f} s"


DIST_INFO_METADATA = """Metadata-Version: 2.1
Name: llama_cpp_python
Version: {version}
Summary: Python bindings for the llama.cpp library (built by the localrun GPU kit: CUDA, sm_90)
Requires-Dist: typing-extensions>=4.5.0
Requires-Dist: numpy>=1.20.0
Requires-Dist: diskcache>=5.6.1
Requires-Dist: jinja2>=2.11.3
"""


#: Run after installing: what the built llama_cpp says about itself.
LLAMA_CHECK = ("import json, llama_cpp as l; print(json.dumps({'version': l.__version__, "
               "'gpu_offload': bool(l.llama_supports_gpu_offload()), "
               "'system_info': l.llama_print_system_info().decode()}))")


def write_dist_info(site: Path) -> Path:
    """The metadata pip would have written: localrun finds engines (and their versions)
    by distribution, never by importing them."""
    dist = site / f"llama_cpp_python-{spec.LLAMA_CPP_VERSION}.dist-info"
    dist.mkdir(parents=True, exist_ok=True)
    (dist / "METADATA").write_text(DIST_INFO_METADATA.format(version=spec.LLAMA_CPP_VERSION))
    (dist / "INSTALLER").write_text("localrun-gpu-kit\n")
    (dist / "RECORD").write_text("")
    return dist


def step_llama_install(kit: Kit, ctx: StepContext) -> str:
    if not kit.gpu:
        raise StepSkipped("installs what the CUDA build made (GPU machine only)")
    pkg = kit.site / "llama_cpp"
    if kit.llama_mode == "prebuilt":
        (pkg / "lib").mkdir(parents=True, exist_ok=True)
        for lib in kit.prebuilt_libs.rglob("*.so*"):
            shutil.copy2(lib, pkg / "lib" / lib.name, follow_symlinks=False)
        # built against the cuBLAS/cudart of PyPI's nvidia-* wheels: the loader finds
        # them in torch's copies (or the toolkit's)
        dirs = [str(d) for d in cuda_lib_dirs(kit)]
        old = kit.cuda_env.get("LD_LIBRARY_PATH") or os.environ.get("LD_LIBRARY_PATH", "")
        kit.cuda_env["LD_LIBRARY_PATH"] = os.pathsep.join([*dirs, old]).strip(os.pathsep)
        ctx.facts["ld_library_path"] = dirs
    else:
        ctx.run(["cmake", "--install", str(kit.llama_build)], limit=60)
    shutil.copytree(kit.llama_src / "llama_cpp", pkg, dirs_exist_ok=True)
    write_dist_info(kit.site)
    ctx.facts["libs"] = sorted(p.name for p in (pkg / "lib").glob("*.so"))
    r = ctx.run([kit.python, "-c", LLAMA_CHECK], env=kit.engine_env(), limit=60, capture=True)
    info = last_json(r.stdout)
    ctx.facts.update(info)
    if not info.get("gpu_offload"):
        raise StepFailed(f"llama_cpp imports but supports no GPU offload: {info}")
    return f"llama_cpp {info.get('version')} with GPU offload; {info.get('system_info', '')[:120]}"


def cuda_lib_dirs(kit: Kit) -> list[Path]:
    """Folders holding libcublas / libcudart .so.N: torch's nvidia-* wheels, the toolkit."""
    found: list[Path] = []
    for root in pip_cuda_dirs(kit.tools_python or kit.python):
        found += sorted({p.parent for p in root.glob("**/lib/libcu*.so*")})
    if kit.cuda_home:
        found += [d for d in (Path(kit.cuda_home) / "lib64", Path(kit.cuda_home) / "lib")
                  if d.is_dir()]
    return list(dict.fromkeys(found))


def clear_stale_lock(kit: Kit, engine: str) -> None:
    """A build killed at its limit leaves torch's lock file: the next import would wait on
    it forever. Only this kit builds here, so a lock present now is stale."""
    lock = kit.ext_dir / EXT_NAMES[engine] / "lock"
    if lock.exists():
        lock.unlink()


def step_ext_build(kit: Kit, ctx: StepContext, engine: str, nice: int = 0) -> str:
    if not kit.gpu:
        raise StepSkipped(f"{engine} compiles its CUDA extension on first import (GPU "
                          "machine only)")
    kit.ext_dir.mkdir(parents=True, exist_ok=True)
    cxx20 = kit.cxx20
    for attempt in (1, 2):
        clear_stale_lock(kit, engine)
        r = ctx.run([kit.python, "-c", BUILD_SNIPPET, engine, "1" if cxx20 else "0"],
                    env=kit.engine_env(), nice=nice, check=False)
        if r.returncode == 0:
            break
        if attempt == 1 and not cxx20 and CXX20_MARK in r.tail:
            ctx.log("[nvcc rejected torch's headers in C++17 mode: retrying with -std=c++20]")
            cxx20 = True
            continue
        raise StepFailed(f"{engine} extension build failed (exit {r.returncode}): "
                         f"{last_error(tail_of(ctx.log_path, 400_000))}")
    build_dir = kit.ext_dir / EXT_NAMES[engine]
    objs = len(list(build_dir.glob("*.o")))
    ctx.facts.update(seconds=round(r.seconds, 1), objects=objs, cxx20=cxx20,
                     max_jobs=kit.jobs, nice=nice)
    return f"{objs} objects, {r.seconds:.0f} s" + (" (-std=c++20)" if cxx20 else "")


def last_error(tail: str) -> str:
    """The line that says what went wrong: a compiler's first ``error:``, else the last
    exception or failure line, else the last line."""
    lines = [ln.strip() for ln in tail.splitlines()
             if ln.strip() and not ln.startswith(("[exit", "$ "))]
    for ln in lines:
        if (re.search(r"\berror\b\s*:", ln, re.I) or ln.startswith("CMake Error")) and \
                not ln.startswith("ninja:"):
            return ln[:300]
    for ln in reversed(lines):
        if re.search(r"Error|failed", ln):
            return ln[:300]
    return lines[-1][:300] if lines else ""


def step_model_hf(kit: Kit, ctx: StepContext) -> str:
    if not kit.tools_python:
        raise StepSkipped("no python with torch and transformers here (the fixtures venv "
                          "of scripts/make_test_models.py is missing)")
    done = kit.hf / ".kit-done.json"
    if done.is_file():
        ctx.facts.update(json.loads(done.read_text()))
        return f"already made: {kit.hf}"
    kit.models.mkdir(parents=True, exist_ok=True)
    r = ctx.run([kit.tools_python, str(REPO / "scripts/gpu_kit/make_models.py"),
                 "--tokenizer", str(kit.bundle / "tokenizer"), "--out", str(kit.hf)],
                env={"HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}, capture=True)
    facts = last_json(r.stdout)
    ctx.facts.update(facts)
    return f"{facts.get('params', 0) / 1e6:.1f} M parameters, greedy smoke: " \
           f"{facts.get('smoke_text', '')!r}"


def write_models_manifest(kit: Kit) -> None:
    """tests/models.py reads this: the tiny GGUF stands in for the gguf-q8_0 fixture."""
    kit.models.mkdir(parents=True, exist_ok=True)
    data = {"models": {"gguf-q8_0": str(kit.gguf)}, "note": "localrun GPU kit: tiny "
            "random-weight Llama, not SmolLM2"}
    (kit.models / "manifest.json").write_text(json.dumps(data, indent=1) + "\n")


def step_model_gguf(kit: Kit, ctx: StepContext) -> str:
    if not kit.tools_python:
        raise StepSkipped("no python with torch and transformers here")
    if kit.gguf.is_file():
        write_models_manifest(kit)
        return f"already made: {kit.gguf.name}"
    script = kit.llama_src / "vendor/llama.cpp/convert_hf_to_gguf.py"
    tmp = kit.gguf.with_name(kit.gguf.name + ".tmp")
    ctx.run([kit.tools_python, str(script), str(kit.hf), "--outtype", "q8_0",
             "--outfile", str(tmp)], env={"HF_HUB_OFFLINE": "1"})
    with tmp.open("rb") as fh:
        if fh.read(4) != b"GGUF":
            raise StepFailed(f"{tmp.name} is not a GGUF file")
    tmp.replace(kit.gguf)
    write_models_manifest(kit)
    ctx.facts["bytes"] = kit.gguf.stat().st_size
    return f"{kit.gguf.name}: {kit.gguf.stat().st_size / 2**20:.1f} MiB"


def quant_method(folder: Path) -> str | None:
    try:
        cfg = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return None
    q = cfg.get("quantization_config") or {}
    return str(q.get("quant_method")) if isinstance(q, dict) and q else None


def step_model_exl(kit: Kit, ctx: StepContext, engine: str) -> str:
    if not kit.gpu:
        raise StepSkipped(f"{engine}'s converter runs on CUDA (GPU machine only)")
    out = kit.exl2 if engine == "exllamav2" else kit.exl3
    if (out / ".kit-done").is_file():
        return f"already made: {out.name}"
    work = kit.work / f"{engine}-convert"
    shutil.rmtree(work, ignore_errors=True)
    shutil.rmtree(out, ignore_errors=True)
    work.mkdir(parents=True)
    bits = str(spec.EXL_BITS)
    if engine == "exllamav2":
        out.mkdir(parents=True)
        cmd = [kit.python, "-m", "exllamav2.conversion.convert_exl2", "-i", str(kit.hf),
               "-o", str(work), "-cf", str(out), "-b", bits, "-r", "16", "-mr", "4",
               "-l", "512", "-ml", "512"]
    else:
        cmd = [kit.python, "-m", "exllamav3.conversion.convert_model", "-i", str(kit.hf),
               "-o", str(out), "-w", str(work), "-b", bits, "-cr", "16", "-cc", "512"]
    r = ctx.run(cmd, env=kit.engine_env())
    tensors = sorted(p.name for p in out.glob("*.safetensors"))
    if not tensors or not (out / "config.json").is_file():
        raise StepFailed(f"the converter left no config.json + *.safetensors in {out}")
    (out / ".kit-done").write_text(now_iso() + "\n")
    method = quant_method(out)
    ctx.facts.update(seconds=round(r.seconds, 1), files=tensors, quant_method=method,
                     bytes=sum(p.stat().st_size for p in out.iterdir() if p.is_file()))
    return f"{out.name}: {method or 'no quantization_config'}, {len(tensors)} safetensors"
