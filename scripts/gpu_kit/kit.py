"""The GPU kit's shared state: paths, mode, options and the environment every step uses.

Standard library only (scripts/gpu_kit/run.py runs under the GPU machine's python3).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from gpu_kit import spec

REPO = Path(__file__).resolve().parents[2]
LLAMA_TOP = f"llama_cpp_python-{spec.LLAMA_CPP_VERSION}"
#: Seconds one GPU test may take (pytest-timeout), set up and torn down included: above
#: test_gpu.py's 60 s hang check, far below a test step's limit.
TEST_TIMEOUT_S = 90

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
