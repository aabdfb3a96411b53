#!/usr/bin/env python3
"""GPU verification kit: prove localrun's NVIDIA paths on a bare GPU machine, in one go.

On the GPU machine (no network; the bundle from scripts/gpu_kit_prepare.py carried):

    PYTHONUNBUFFERED=1 python3 scripts/gpu_kit/run.py --bundle .gpu_kit --out "$OUT"

Here, without CUDA, the rehearsal goes through every step that needs no GPU:

    .venv/bin/python scripts/gpu_kit/run.py --dry-run        # (--cpu is the same)

Steps (each with its own time limit and time; a failed step never stops the others; a
step whose inputs failed is skipped with the reason): record the machine; prove the
kit's own rules there (proof_*: nice orders the kit's commands, a hanging test is
stopped at --timeout); install the carried wheels into a target folder (PYTHONPATH, no
network); extract the trimmed llama.cpp source, configure and build it with
GGML_CUDA=on for sm_90 (or, with --llama prebuilt, the default when the bundle carries
them, unpack the libraries scripts/gpu_kit/prebuild_llama.py built off the device) and
install llama-cpp-python from it; compile ExLlamaV2's extension (TORCH_CUDA_ARCH_LIST=9.0,
one job per core; ExLlamaV3's too with --with-exllamav3, niced, counted only if it
finishes inside the budget); make a tiny random-weight Llama (HF safetensors) and convert
it with each engine's own converter (GGUF Q8_0, EXL2 and EXL3 at 4.0 bpw); run the GPU
tests (tests/test_gpu.py, the GPU tests of tests/test_exllama.py, the llama.cpp cases of
tests/test_conformance.py on the tiny GGUF) one engine at a time, each test under
pytest-timeout's --timeout; a test step whose GPU tests all skip fails ("GPU: 0 passed,
N skipped"); measure each engine once (a bench that ran on the CPU fails). Results:
``gpu_kit.json`` (every step's status, time, facts and test outcomes; the machine's
facts: autogroup, CPU model, driver and CUDA; the builds' ninja logs summed per kind of
unit) and ``gpu_kit.log`` (every command's output) in --out, written after every step
and in a ``finally`` (a budget overrun or SIGTERM included); a table last on stdout.

The rehearsal installs the wheels for CPython 3.12 (pip's --platform), checks that every
requirement is on the GPU machine or carried, configures the trimmed llama.cpp (with
CUDA when nvcc is here, cuBLAS standing in by path), makes the tiny model and its GGUF
with the fixtures venv of scripts/make_test_models.py (torch, CPU), runs the llama.cpp
conformance cases on that GGUF on the CPU, collects every pytest selection the GPU run
uses (none may be empty: pytest's exit code 5 is a failure here), and proves the rules
the GPU run depends on: proof_nice (two CPU-bound commands at nice 0 and 15 on one CPU),
proof_all_skipped (the real test_nvml selection, all skipped here, fails under the GPU
rule), proof_test_timeout (a hanging test stopped at 3 s).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import signal
import sys
import tarfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))

from gpu_kit import proofs, spec  # noqa: E402
from gpu_kit.cuda import (  # noqa: E402
    capture,
    find_cuda_home,
    find_libcuda,
    find_pip_cublas,
    pip_cuda_dirs,
    toolkit_lib,
)
from gpu_kit.facts import autogroup_enabled, machine_facts, ninja_summary  # noqa: E402
from gpu_kit.report import (  # noqa: E402
    Report,
    count_outcomes,
    now_iso,
    parse_junit,
    render_markdown,
    table,
)
from gpu_kit.runner import (  # noqa: E402
    FAILED,
    OK,
    SKIPPED,
    TIMEOUT,
    Runner,
    Step,
    StepContext,
    StepFailed,
    StepSkipped,
    StepTimeout,
    overall_ok,
    tail_of,
)

LLAMA_TOP = f"llama_cpp_python-{spec.LLAMA_CPP_VERSION}"
#: tests/test_conformance.py cases that run on the tiny GGUF: all of llama.cpp's on the
#: Q8_0 fixture except those that need sensible answers, which random weights never give:
#: the one that judges answers, and the four-thread one (it first requires that 8 prompts
#: get at least 6 different replies; the tiny model's noise gave 4).
CONFORMANCE_K = ("(gguf-q8_0 and not greedy_answers_are_mostly_right and not "
                 "four_threads_share_one_model) or cli_auto_picks_llama_cpp")
#: --quick (the rehearsal in CI): of those, the ones that run on the CPU here.
QUICK_K = "info_names or stop_string or stream_equals or cancel_mid_stream or cli_auto"
#: The tests of tests/test_exllama.py that need a GPU (the rest run on fakes anywhere).
EXL_GPU_K = ("test_gpu_chat_greedy or test_gpu_quantized_kv or test_gpu_split_caps or "
             "test_gpu_exllamav2_tensor_parallel")


@dataclass(frozen=True)
class Selection:
    """One pytest invocation of a test step. ``gpu``: its tests are GPU tests, which the
    all-skipped rule counts (a step whose GPU tests all skip has proven nothing)."""

    args: tuple[str, ...]
    gpu: bool = True


#: pytest invocations per test step (paths relative to the repo).
PYTEST: dict[str, list[Selection]] = {
    "test_nvml": [Selection(("tests/test_gpu.py", "-k", "nvml"))],
    "test_llama_cpp": [Selection(("tests/test_gpu.py", "-k", "llama_cpp")),
                       Selection(("tests/test_conformance.py", "-k", CONFORMANCE_K), gpu=False)],
    "test_exllamav2": [Selection(("tests/test_gpu.py", "-k", "exllamav2")),
                       Selection(("tests/test_exllama.py", "-k", f"exllamav2 and ({EXL_GPU_K})")),
                       Selection(("tests/test_exllama.py", "-k", f"not ({EXL_GPU_K})"), gpu=False)],
    "test_exllamav3": [Selection(("tests/test_gpu.py", "-k", "exllamav3")),
                       Selection(("tests/test_exllama.py", "-k", f"exllamav3 and ({EXL_GPU_K})"))],
}
#: Seconds one GPU test may take (pytest-timeout), set up and torn down included: above
#: test_gpu.py's 60 s hang check, far below a test step's limit.
TEST_TIMEOUT_S = 90
#: Steps ExLlamaV3 adds (177 CUDA units: it does not fit the first run's 10 minutes
#: beside llama.cpp's build); --with-exllamav3 brings them back.
EXL3_STEPS = ("exl3_build", "model_exl3", "test_exllamav3", "bench_exllamav3")
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


class Kit:
    """Paths, mode and the environment the steps share."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.gpu = not args.dry_run
        self.quick = bool(args.quick) and not self.gpu
        self.repo = REPO
        self.bundle = Path(args.bundle).resolve()
        self.work = Path(args.work).resolve()
        self.out = Path(args.out).resolve()
        self.site = self.work / "site"
        self.models = self.work / "models"
        self.logs = self.work / "logs"
        self.junit = self.work / "junit"
        self.ext_dir = self.work / "torch-extensions"
        self.llama_src = self.work / "llama-src" / LLAMA_TOP
        self.llama_build = self.work / "llama-build"
        self.plugins = self.work / "pytest-plugins"  # the rehearsal's pytest-timeout
        self.prebuilt_libs = self.work / "llama-prebuilt"
        self.jobs = args.jobs or os.cpu_count() or 1
        self.with_exl3 = bool(getattr(args, "with_exllamav3", False))
        self.test_timeout = int(getattr(args, "test_timeout", TEST_TIMEOUT_S) or 0)
        self.llama_mode = resolve_llama_mode(getattr(args, "llama", "auto"), self.bundle)
        self.python = sys.executable
        self.tools_python = args.tools_python or (self.python if self.gpu else
                                                  find_fixture_python())
        self.manifest: dict[str, Any] = {}
        # filled by the env step
        self.cuda_home: str | None = None
        self.cuda_env: dict[str, str] = {}
        self.cmake_cuda: list[str] = []
        self.cxx20 = False

    def pythonpath(self, site: bool = True) -> str:
        parts = ([str(self.site)] if site else []) + [str(self.repo)]
        old = os.environ.get("PYTHONPATH")
        return os.pathsep.join(parts + ([old] if old else []))

    def engine_env(self) -> dict[str, str]:
        """Environment for anything that imports an engine or torch's cpp_extension."""
        env = {"PYTHONPATH": self.pythonpath(), "MAX_JOBS": str(self.jobs),
               "TORCH_CUDA_ARCH_LIST": "9.0", "TORCH_EXTENSIONS_DIR": str(self.ext_dir),
               "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", **self.cuda_env}
        if self.cuda_home:
            env["CUDA_HOME"] = self.cuda_home
        return env

    def test_env(self, step: str = "") -> dict[str, str]:
        """The tests' environment: each test step names only its own engine's model, so
        no step loads another engine (ExLlamaV3 may still be compiling meanwhile)."""
        env = self.engine_env()
        if not self.gpu:  # the rehearsal tests run in this venv, not the target folder,
            # with the carried pytest-timeout beside it (the dev venv need not have it)
            env["PYTHONPATH"] = os.pathsep.join([str(self.plugins),
                                                 self.pythonpath(site=False)])
        env.update({"LOCALRUN_TEST_MODELS": str(self.models), "LOCALRUN_BUILD_TEST_MODELS": "0"})
        for var in ("LOCALRUN_GPU_GGUF", "LOCALRUN_EXL2_MODEL", "LOCALRUN_EXL3_MODEL"):
            env[var] = ""
        model = {"test_llama_cpp": ("LOCALRUN_GPU_GGUF", self.gguf),
                 "test_exllamav2": ("LOCALRUN_EXL2_MODEL", self.exl2),
                 "test_exllamav3": ("LOCALRUN_EXL3_MODEL", self.exl3)}.get(step)
        if model:
            env[model[0]] = str(model[1])
        return env

    @property
    def hf(self) -> Path:
        return self.models / "hf"

    @property
    def gguf(self) -> Path:
        return self.models / "tiny-q8_0.gguf"

    @property
    def exl2(self) -> Path:
        return self.models / "tiny-exl2"

    @property
    def exl3(self) -> Path:
        return self.models / "tiny-exl3"


def prebuilt_archive(bundle: Path) -> Path | None:
    """The llama.cpp libraries built off the device (scripts/gpu_kit/prebuild_llama.py),
    if the bundle carries them."""
    found = sorted((bundle / spec.PREBUILT_DIR).glob(spec.PREBUILT_GLOB))
    return found[-1] if found else None


def resolve_llama_mode(asked: str, bundle: Path) -> str:
    """"build" (compile llama.cpp on the device) or "prebuilt" (unpack the carried
    libraries); "auto" takes the prebuilt ones when the bundle has them: they are carried
    only when the build would not fit the run."""
    if asked == "auto":
        return "prebuilt" if prebuilt_archive(bundle) else "build"
    return asked


def find_fixture_python() -> str | None:
    """The converters' venv of scripts/make_test_models.py (torch CPU, transformers)."""
    env = os.environ.get("LOCALRUN_TEST_MODELS")
    root = Path(env).expanduser() if env else Path.home() / ".cache/localrun/test-models"
    py = root / "venv-tools" / "bin" / "python"
    return str(py) if py.exists() else None


def last_json(text: str) -> dict[str, Any]:
    for line in reversed(text.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                data = json.loads(line)
            except ValueError:
                continue
            if isinstance(data, dict):
                return data
    return {}


# -- steps -------------------------------------------------------------------------------

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


def collect(kit: Kit, ctx: StepContext, args: Sequence[str], step: str = "") -> int:
    """How many tests a selection collects; a selection that collects none fails."""
    r = ctx.run([kit.python, "-m", "pytest", *args, "--collect-only", "-q",
                 "-p", "no:cacheprovider"], env=kit.test_env(step or ctx.step.name),
                check=False, limit=120, capture=True)
    m = re.search(r"(\d+)(?:/\d+)? tests? (?:collected|selected)", r.stdout)
    n = int(m.group(1)) if m else len([ln for ln in r.stdout.splitlines() if "::" in ln])
    if r.returncode == 5 or n == 0:
        raise StepFailed(f"pytest {' '.join(args)} selects no tests (exit {r.returncode})")
    if r.returncode != 0:
        raise StepFailed(f"pytest {' '.join(args)} --collect-only exited {r.returncode}: "
                         f"{last_error(r.stdout + r.tail)}")
    return n


#: Prints whether pytest-timeout is importable (under the tests' environment).
HAS_TIMEOUT = "import importlib.util as u; print(u.find_spec('pytest_timeout') is not None)"


def timeout_args(kit: Kit, ctx: StepContext, env: dict[str, str],
                 seconds: int | None = None) -> list[str]:
    """``--timeout N`` where pytest-timeout is there (the GPU machine's image has it; the
    rehearsal installs the carried wheel), else nothing and a fact saying so."""
    seconds = kit.test_timeout if seconds is None else seconds
    if seconds <= 0:
        ctx.facts["test_timeout_s"] = None
        return []
    r = ctx.run([kit.python, "-c", HAS_TIMEOUT], env=env, check=False, limit=60,
                capture=True)
    if "True" not in r.stdout:
        ctx.facts["test_timeout_s"] = None
        ctx.facts["test_timeout_missing"] = "pytest-timeout is not installed: only the " \
            "step's own limit bounds a hung test"
        return []
    ctx.facts["test_timeout_s"] = seconds
    return ["--timeout", str(seconds)]


def running_test(log_text: str) -> str | None:
    """The test pytest -v had started and not finished when the step was stopped."""
    last = None
    for ln in log_text.splitlines():
        m = re.match(r"(\S+::\S+)(?: (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)\b)?", ln)
        if m:
            last = None if m.group(2) else m.group(1)
    return last


def judge_tests(cases: Sequence[dict[str, Any]], *, gpu_rule: bool) -> str:
    """The step's verdict on its test cases: raises StepFailed for a failure, or (with
    ``gpu_rule``, on the GPU machine) when the GPU tests all skipped; else the detail.
    The detail starts "GPU: x passed, y skipped" whenever GPU tests ran."""
    gpu = [c for c in cases if c.get("gpu")]
    g = count_outcomes(gpu)
    a = count_outcomes(cases)
    gpu_note = f"GPU: {g['passed']} passed, {g['skipped']} skipped" + \
        (f", {g['failed'] + g['error']} failed" if g["failed"] + g["error"] else "")
    every = f"all: {a['passed']} passed, {a['skipped']} skipped of {len(cases)}"
    bad = [c for c in cases if c["outcome"] in ("failed", "error")]
    if bad:
        raise StepFailed(f"{gpu_note}; {len(bad)} of {len(cases)} failed; first: "
                         f"{bad[0]['id']}: {bad[0].get('message', '')}")
    if gpu_rule and gpu and g["passed"] == 0:
        first = next((c.get("message", "") for c in gpu if c["outcome"] == "skipped"), "")
        raise StepFailed(f"{gpu_note}: every GPU test skipped, nothing was proven; first "
                         f"reason: {first}")
    if gpu_rule and cases and not gpu:
        raise StepFailed(f"GPU: no GPU tests ran ({every})")
    return f"{gpu_note}; {every}" if gpu else every


def step_pytest(kit: Kit, ctx: StepContext, name: str, run_here: Sequence[int] = (),
                gpu_rule: bool | None = None) -> str:
    """Run the step's pytest selections; in the rehearsal, collect them (and run those in
    ``run_here``, which need no GPU). ``gpu_rule`` (default: on the GPU machine): a step
    whose GPU tests all skip fails."""
    selections = PYTEST[name]
    cases: list[dict[str, Any]] = []
    collected = []
    kit.junit.mkdir(parents=True, exist_ok=True)
    env = kit.test_env(name)
    limit_args: list[str] | None = None
    for i, sel in enumerate(selections):
        args = list(sel.args)
        n = collect(kit, ctx, args, name)
        collected.append(n)
        if not kit.gpu and i not in run_here:
            continue
        if limit_args is None:
            limit_args = timeout_args(kit, ctx, env)
        xml = kit.junit / f"{ctx.step.name}-{i}.xml"
        xml.unlink(missing_ok=True)
        if kit.quick and "-k" in args and not sel.gpu:
            k = args.index("-k") + 1
            args = [*args[:k], f"({args[k]}) and ({QUICK_K})", *args[k + 1:]]
        start = len(tail_of(ctx.log_path, 10**9))
        try:
            r = ctx.run([kit.python, "-m", "pytest", *args, "-v", "-rs", "-p",
                         "no:cacheprovider", *limit_args, f"--junitxml={xml}",
                         "-o", "junit_family=xunit2"], env=env, check=False)
        except StepTimeout as e:
            hung = running_test(tail_of(ctx.log_path, 10**9)[start:])
            ctx.tests = {**count_outcomes(cases), "collected": sum(collected),
                         "cases": cases, "running_when_stopped": hung}
            raise StepTimeout(f"{e}" + (f"; running: {hung}" if hung else "")) from None
        got = [{**c, "gpu": sel.gpu} for c in parse_junit(xml)]
        cases += got
        if r.returncode == 5:
            raise StepFailed(f"pytest {' '.join(args)} selected no tests")
        if r.returncode not in (0, 1) and not got:
            raise StepFailed(f"pytest {' '.join(args)} exited {r.returncode}: "
                             f"{last_error(r.tail)}")
    ctx.tests = {**count_outcomes(cases), "collected": sum(collected), "cases": cases,
                 "gpu": count_outcomes([c for c in cases if c.get("gpu")])}
    if not cases:
        return f"collected {sum(collected)} tests in {len(selections)} selections " \
               "(they run on the GPU machine)"
    detail = judge_tests(cases, gpu_rule=kit.gpu if gpu_rule is None else gpu_rule)
    return detail + ("" if kit.gpu else f" (CPU; {sum(collected)} collected in all)")


# -- proofs: the kit's own rules, shown on the machine it runs on --------------------------

def step_proof_nice(kit: Kit, ctx: StepContext) -> str:
    """Two CPU-bound commands at nice 0 and 15 on one CPU, started as the runner starts
    every command: the nice-0 one must get most of it. For contrast, the same pair each
    in a session of its own (the runner's old way), which autogroup shares evenly."""
    cpu = proofs.pick_cpu()
    ctx.facts["sched_autogroup_enabled"] = autogroup_enabled()
    same = proofs.measure(ctx, new_session=False, cpu=cpu)
    ctx.facts["one_session"] = same
    apart = proofs.measure(ctx, new_session=True, cpu=cpu)
    ctx.facts["separate_sessions"] = apart
    ctx.facts["min_share"] = proofs.MIN_SHARE
    if not same["conclusive"]:
        raise StepFailed(f"inconclusive: CPU {cpu} was too busy ({proofs.describe(same)})")
    if not proofs.nice_works(same):
        raise StepFailed(f"nice has no effect between the kit's commands: "
                         f"{proofs.describe(same)}; the builds' priorities do nothing here")
    contrast = f"; in separate sessions (the old runner) {proofs.describe(apart)}" \
        if apart["conclusive"] else ""
    return f"nice works between steps: {proofs.describe(same)}{contrast}; autogroup " \
           f"{'on' if ctx.facts['sched_autogroup_enabled'] else 'off or absent'}"


def step_proof_all_skipped(kit: Kit, ctx: StepContext) -> str:
    """The all-skipped rule on a real run: here (no GPU) test_nvml's GPU tests all skip,
    so under the GPU machine's rule that step must fail, saying 'GPU: 0 passed, N
    skipped'."""
    if kit.gpu:
        raise StepSkipped("proven in the CPU rehearsal (there every GPU test skips); here "
                          "the GPU tests run for real")
    try:
        detail = step_pytest(kit, ctx, "test_nvml", run_here=(0,), gpu_rule=True)
    except StepFailed as e:
        if re.match(r"GPU: 0 passed, [1-9]\d* skipped: every GPU test skipped", str(e)):
            return f"a test step whose GPU tests all skip fails: {e}"
        raise StepFailed(f"the step failed for another reason: {e}") from None
    raise StepFailed(f"the all-skipped rule did not fire: {detail}")


PROOF_TIMEOUT_S = 3
#: A test that hangs, for the per-test timeout proof.
HANGING_TEST = """
import time


def test_hangs_past_the_timeout():
    time.sleep(120)
"""


def step_proof_test_timeout(kit: Kit, ctx: StepContext) -> str:
    """A test that hangs is stopped at --timeout and reported failed, and pytest goes on:
    the same pytest invocation the test steps use, with a PROOF_TIMEOUT_S timeout."""
    folder = kit.work / "proof-timeout"
    folder.mkdir(parents=True, exist_ok=True)
    test = folder / "test_kit_hangs.py"
    test.write_text(HANGING_TEST, encoding="utf-8")
    env = kit.test_env(ctx.step.name)
    args = timeout_args(kit, ctx, env, seconds=PROOF_TIMEOUT_S)
    if not args:
        raise StepFailed(ctx.facts.get("test_timeout_missing", "no pytest-timeout"))
    xml = folder / "junit.xml"
    t0 = time.monotonic()
    ctx.run([kit.python, "-m", "pytest", str(test), "-v", "-p", "no:cacheprovider",
             "--rootdir", str(folder), "-c", os.devnull, *args, f"--junitxml={xml}"],
            env=env, check=False, limit=60, cwd=folder)
    seconds = time.monotonic() - t0
    cases = parse_junit(xml)
    ctx.facts.update(seconds=round(seconds, 1), cases=cases)
    if len(cases) != 1 or cases[0]["outcome"] != "failed" or \
            "Timeout" not in cases[0].get("message", ""):
        raise StepFailed(f"the hanging test was not stopped by pytest-timeout: {cases}")
    return f"a hanging test failed at its {PROOF_TIMEOUT_S} s timeout in {seconds:.0f} s " \
           f"({cases[0]['message'][:60]}); " \
           f"GPU tests get {kit.test_timeout} s each"


def judge_bench(engine: str, data: dict[str, Any], *, gpu: bool) -> str:
    """The bench step's verdict: on the GPU machine it fails unless the engine ran on the
    GPU (it reports a device that is not the CPU, or, where it reports none, as the
    ExLlamas do, the model took VRAM); the detail names tokens/s, TTFT and VRAM."""
    device = data.get("device")
    vram = data.get("vram_mib")
    numbers = (f"decode {data.get('decode_tps', 0):.0f} tok/s, prefill "
               f"{data.get('prefill_tps', 0):.0f} tok/s, TTFT {data.get('ttft_ms', 0):.1f} ms, "
               + (f"{vram:.0f} MiB VRAM" if vram is not None else "VRAM not read"))
    on_cpu = isinstance(device, str) and device.strip().lower().startswith("cpu")
    if gpu and on_cpu:
        raise StepFailed(f"{engine} reports the device {device!r}: it ran on the CPU, not "
                         f"the GPU ({numbers})")
    if gpu and not device and not (vram and vram > 0):
        raise StepFailed(f"{engine} reports no device and no VRAM use: nothing shows it ran "
                         f"on the GPU ({numbers})")
    note = "" if gpu else " (CPU numbers, not recorded; the GPU run fails a bench on the CPU)"
    return f"{device or 'GPU (by its VRAM)'}: {numbers}{note}"


def step_bench(kit: Kit, ctx: StepContext, engine: str, model: Path) -> str:
    if not kit.gpu and engine != "llama.cpp":
        raise StepSkipped(f"{engine} runs on CUDA only")
    if not model.exists():
        raise StepSkipped(f"no {model.name}")
    out = kit.work / f"bench-{engine}.json"
    out.unlink(missing_ok=True)
    env = kit.engine_env() if kit.gpu else {"PYTHONPATH": kit.pythonpath(site=False)}
    size = [] if kit.gpu else ["--tokens", "32", "--runs", "1"]  # the CPU: a check only
    ctx.run([kit.python, str(REPO / "scripts/gpu_kit/bench.py"), "--backend", engine,
             "--model", str(model), "--json", str(out), *size], env=env)
    data = json.loads(out.read_text())
    ctx.facts.update(data)
    return judge_bench(engine, data, gpu=kit.gpu)


def build_steps(kit: Kit) -> list[Step]:
    def s(name: str, what: str, fn: Any, **kw: Any) -> Step:
        return Step(name, what, lambda ctx: fn(kit, ctx), **kw)

    def ext(engine: str, nice: int) -> Any:
        return lambda k, ctx: step_ext_build(k, ctx, engine, nice)

    def conv(engine: str) -> Any:
        return lambda k, ctx: step_model_exl(k, ctx, engine)

    def tests(name: str, run_here: Sequence[int] = ()) -> Any:
        return lambda k, ctx: step_pytest(k, ctx, name, run_here)

    def bench(engine: str, model: Path) -> Any:
        return lambda k, ctx: step_bench(k, ctx, engine, model)

    gpu = kit.gpu
    prebuilt = kit.llama_mode == "prebuilt"
    return [
        s("env", "the machine: GPU, driver, CUDA toolkit, cuBLAS, torch, compilers", step_env,
          limit_s=90),
        # one pinned CPU for ~10 s: whether the builds' priorities hold on this kernel
        s("proof_nice", "nice works between the kit's commands (one session, autogroup)",
          step_proof_nice, limit_s=60, optional=gpu),
        s("proof_all_skipped", "a test step whose GPU tests all skip is reported failed",
          step_proof_all_skipped, limit_s=120),
        s("install_wheels", "carried wheels into a target folder; every requirement met",
          step_install, limit_s=120),
        s("proof_test_timeout", "a hanging test is stopped at pytest-timeout's --timeout",
          step_proof_test_timeout, deps=("install_wheels",), limit_s=60, optional=gpu),
        s("llama_src", "extract the trimmed llama.cpp source", step_llama_src, limit_s=60),
        s("llama_configure", "cmake configure: GGML_CUDA=ON, CMAKE_CUDA_ARCHITECTURES=90",
          step_llama_configure, deps=("env", "llama_src"), limit_s=180),
        s("llama_build", "unpack llama.cpp's libraries built off the device (CUDA, sm_90)"
          if prebuilt else "build llama.cpp with CUDA for sm_90", step_llama_build,
          deps=("env",) if prebuilt else ("llama_configure",), limit_s=480, min_s=60),
        s("exl2_build", "compile ExLlamaV2's CUDA extension (TORCH_CUDA_ARCH_LIST=9.0)",
          ext("exllamav2", EXL2_NICE), deps=("env", "install_wheels"), limit_s=480, min_s=60),
        # niced (EXL3_NICE): it takes the cores the builds above leave idle, and counts
        # only if it is done in time (the steps after it need about two minutes)
        s("exl3_build", "compile ExLlamaV3's CUDA extension (niced, if time allows)",
          ext("exllamav3", EXL3_NICE), deps=("env", "install_wheels"), limit_s=540, min_s=60,
          reserve_s=120, optional=True),
        s("model_hf", "tiny random-weight Llama as HF safetensors (SmolLM2's tokenizer)",
          step_model_hf, limit_s=180),
        s("model_gguf", "GGUF Q8_0 with llama.cpp's convert_hf_to_gguf.py", step_model_gguf,
          deps=("model_hf", "llama_src"), limit_s=180),
        s("llama_install", "install llama-cpp-python from the build; GPU offload on",
          step_llama_install, deps=("llama_build", "install_wheels", "llama_src"), limit_s=90),
        s("test_nvml", "NVML VRAM readings against nvidia-smi", tests("test_nvml"),
          deps=("env",), limit_s=120, gpu=gpu),
        s("test_llama_cpp", "llama.cpp on CUDA: full and partial offload, flash attention, "
          "the conformance cases", tests("test_llama_cpp", run_here=(1,)),
          deps=(("llama_install",) if gpu else ()) + ("model_gguf",), limit_s=240, min_s=30,
          gpu=gpu),
        s("bench_llama_cpp", "llama.cpp: TTFT and tokens/s on the tiny GGUF, on the GPU",
          bench("llama.cpp", kit.gguf), deps=(("llama_install",) if gpu else ()) +
          ("model_gguf",), limit_s=120, min_s=20, gpu=gpu),
        # the ExLlamaV2 steps hold the GPU for at most 150 + 180 s: llama.cpp's tests,
        # ready once its longer build is done, never wait longer than that
        s("model_exl2", "EXL2 4.0 bpw with exllamav2's convert_exl2", conv("exllamav2"),
          deps=("exl2_build", "model_hf"), limit_s=150, gpu=gpu),
        s("test_exllamav2", "ExLlamaV2: load, greedy, stops, streaming, cancel, batch of 8, "
          "failing job, test_exllama.py", tests("test_exllamav2"), deps=("model_exl2",)
          if gpu else ("install_wheels",), limit_s=180, min_s=30, gpu=gpu),
        s("bench_exllamav2", "ExLlamaV2: TTFT and tokens/s, on the GPU",
          bench("exllamav2", kit.exl2), deps=("model_exl2",), limit_s=90, min_s=20, gpu=gpu),
        s("model_exl3", "EXL3 4.0 bpw with exllamav3's convert_model", conv("exllamav3"),
          deps=("exl3_build", "model_hf"), limit_s=180, gpu=gpu, optional=True),
        s("test_exllamav3", "ExLlamaV3: the same tests", tests("test_exllamav3"),
          deps=("model_exl3",) if gpu else ("install_wheels",), limit_s=180, min_s=30,
          gpu=gpu, optional=gpu),
        s("bench_exllamav3", "ExLlamaV3: TTFT and tokens/s, on the GPU",
          bench("exllamav3", kit.exl3), deps=("model_exl3",), limit_s=90, min_s=20, gpu=gpu,
          optional=True),
    ]


def build_summaries(kit: Kit) -> dict[str, Any]:
    """The ninja logs of the builds so far: llama.cpp's (CMake) and torch's extension
    builds. Read at every report update and in the kit's ``finally``."""
    out: dict[str, Any] = {}
    for name, log in (("llama_cpp", kit.llama_build / ".ninja_log"),
                      *((engine, kit.ext_dir / ext / ".ninja_log")
                        for engine, ext in EXT_NAMES.items())):
        try:
            summary = ninja_summary(log)
        except Exception as e:  # a reading only: never stop the report over it
            summary = {"error": f"{type(e).__name__}: {e}"}
        if summary is not None:
            out[name] = summary
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bundle", default=str(REPO / spec.BUNDLE_DIR),
                    help="the folder scripts/gpu_kit_prepare.py made (default: .gpu_kit)")
    ap.add_argument("--out", default=os.environ.get("OUT") or None,
                    help="where gpu_kit.json and gpu_kit.log go (default: $OUT, else "
                         "WORK/out)")
    ap.add_argument("--work", default=None, help="builds, models, logs (default: "
                    "/tmp/localrun-gpu-kit, or /tmp/localrun-gpu-kit-rehearsal)")
    ap.add_argument("--budget", type=float, default=spec.DEFAULT_BUDGET_S,
                    help=f"seconds for everything (default {spec.DEFAULT_BUDGET_S}; one "
                         "device command may run 600)")
    ap.add_argument("--jobs", type=int, default=0, help="compile jobs (default: all cores)")
    ap.add_argument("--dry-run", "--cpu", dest="dry_run", action="store_true",
                    help="CPU rehearsal: every step that needs no GPU")
    ap.add_argument("--quick", action="store_true",
                    help="with --dry-run: run only a few of the conformance cases on the CPU "
                         "(every selection is still collected)")
    ap.add_argument("--tools-python", default=None,
                    help="python with torch + transformers for the test model (default: "
                         "this one on the GPU machine, the fixtures venv in the rehearsal)")
    ap.add_argument("--skip", default="", help="comma-separated steps to leave out")
    ap.add_argument("--with-exllamav3", action="store_true",
                    help="bring ExLlamaV3 back (its build, model, tests, bench): left out "
                         "by default, its 177 CUDA units do not fit the first run")
    ap.add_argument("--test-timeout", type=int, default=TEST_TIMEOUT_S,
                    help=f"seconds per GPU test, pytest-timeout (default {TEST_TIMEOUT_S}; "
                         "0: none)")
    ap.add_argument("--llama", choices=("auto", "build", "prebuilt"), default="auto",
                    help="llama.cpp: build it here, or unpack the libraries built off the "
                         "device (scripts/gpu_kit/prebuild_llama.py); auto: prebuilt when "
                         "the bundle carries them")
    ap.add_argument("--render", metavar="GPU_KIT_JSON", default=None,
                    help="print a results file as the Markdown tables of docs/results/gpu.md")
    args = ap.parse_args(argv)
    if args.render:
        print(render_markdown(json.loads(Path(args.render).read_text(encoding="utf-8"))),
              end="")
        return 0
    if args.work is None:
        args.work = "/tmp/localrun-gpu-kit" + ("-rehearsal" if args.dry_run else "")
    if args.out is None:
        args.out = str(Path(args.work) / "out")
    # this python's bin folder first: its cmake, ninja (torch's extension builds run
    # `ninja`) and console scripts, even when that venv is not activated
    bin_dir = str(Path(sys.executable).parent)
    if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = os.pathsep.join([bin_dir, os.environ.get("PATH", "")])
    kit = Kit(args)
    report = Report(kit.out, kit.gpu, args.budget,
                    sys.argv[1:] if argv is None else argv)
    manifest_path = kit.bundle / spec.BUNDLE_MANIFEST
    try:
        kit.manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        print(f"error: no readable {manifest_path} ({e}): run scripts/gpu_kit_prepare.py "
              "first, and carry the folder", file=sys.stderr)
        return 2
    if kit.manifest.get("kit_version") != spec.KIT_VERSION:
        print(f"error: the bundle is kit version {kit.manifest.get('kit_version')}, this kit "
              f"is {spec.KIT_VERSION}: rerun scripts/gpu_kit_prepare.py", file=sys.stderr)
        return 2
    steps = build_steps(kit)
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    unknown = skip - {s.name for s in steps}
    if unknown:
        print(f"error: unknown steps {sorted(unknown)} (steps: "
              f"{', '.join(s.name for s in steps)})", file=sys.stderr)
        return 2

    def left_out(ctx: StepContext) -> str:
        raise StepSkipped("left out (--skip)")

    def no_exl3(ctx: StepContext) -> str:
        raise StepSkipped("left out of the first run: its build does not fit beside "
                          "llama.cpp's (--with-exllamav3 brings it back)")

    for st in steps:
        if st.name in skip:
            st.fn = left_out
        elif st.name in EXL3_STEPS and not kit.with_exl3:
            st.fn = no_exl3
    kit.work.mkdir(parents=True, exist_ok=True)
    report.extra["options"] = {"llama": kit.llama_mode, "with_exllamav3": kit.with_exl3,
                               "test_timeout_s": kit.test_timeout, "jobs": kit.jobs}
    report.extra["machine"] = machine_facts()  # first, so that even a killed run has them
    report.builds = lambda: build_summaries(kit)
    runner = Runner(steps, budget_s=args.budget, log_dir=kit.logs, echo=report.echo,
                    on_result=report.update, max_parallel=8)

    def stop(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, stop)
    results: list[Any] = []
    stopped = ""
    try:
        results = runner.run()
    except KeyboardInterrupt as e:
        stopped = f"the kit was stopped ({e or 'interrupt'}) while this step ran"
        results = runner.abort(stopped)
    finally:
        # even on a timeout or a signal: what the next run is planned from
        report.extra["machine"] = {**report.extra["machine"], **machine_facts()}
        report.extra["stopped"] = stopped or None
        report.update(results or runner.abort("the kit stopped"), finished=True)
    print("\n" + table(results))
    ok = overall_ok(results) and not stopped
    bad = [r.name for r in results if r.status in (FAILED, TIMEOUT)]
    print(f"\n{'OK' if ok else 'NOT OK'}: {sum(r.status == OK for r in results)} ok, "
          f"{sum(r.status == SKIPPED for r in results)} skipped, "
          f"{len(bad)} failed or out of time{': ' + ', '.join(bad) if bad else ''}; "
          f"results in {kit.out / spec.RESULT_JSON}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
