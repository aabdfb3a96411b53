#!/usr/bin/env python3
"""Make a virtual environment with lm-evaluation-harness, for tests/test_lm_eval.py.

lm-eval brings datasets, evaluate, scikit-learn, sacrebleu and their pins (fsspec,
huggingface_hub, pyarrow, ...), which must not move the versions localrun itself is
tested with: it gets this environment, and the test runs ``lm_eval`` from it as a
subprocess against ``localrun serve``.

    python scripts/make_lmeval_env.py            # create or refresh; prints the Python
    python scripts/make_lmeval_env.py --check    # exit 0 iff the environment works

What it installs (pyproject.toml's ``lm-eval`` extra, read from there), and why:
  lm-eval[api]==0.4.13   the harness and its OpenAI-compatible API models
                         (local-completions); its core needs no torch
  transformers==5.24.0   the Hugging Face tokenizer lm-eval's tokenized requests use
                         (AutoTokenizer runs on the tokenizers library, without torch)
No torch: a bare torch requirement would pull a multi-GB CUDA build, and nothing here
needs it (the smoke test below checks that torch is absent). About 0.9 GB; 80 s on a
2-core machine with PyPI reachable.

Folder: $LOCALRUN_LMEVAL_ENV, else ~/.cache/localrun/lmeval-env. Only the standard
library is imported here. The test finds it the same way (or LOCALRUN_LMEVAL_PYTHON).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SMOKE = ("import importlib.util, lm_eval, transformers; "
         "import lm_eval.models.openai_completions; "
         "assert importlib.util.find_spec('torch') is None, 'torch came in'; "
         "from importlib.metadata import version; "
         "print(version('lm-eval'), transformers.__version__)")


def requirements() -> list[str]:
    """pyproject.toml's ``lm-eval`` extra (one list of what the test runs with)."""
    import tomllib  # Python 3.11+

    data = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    return list(data["project"]["optional-dependencies"]["lm-eval"])


def env_dir() -> Path:
    return Path(os.environ.get("LOCALRUN_LMEVAL_ENV")
                or Path.home() / ".cache" / "localrun" / "lmeval-env")


def python_of(venv: Path) -> Path:
    return venv / "bin" / "python"


def log(msg: str) -> None:
    print(f"[make_lmeval_env] {msg}", file=sys.stderr, flush=True)


def run(cmd: list[str]) -> None:
    log(" ".join(cmd))
    subprocess.run(cmd, check=True, stdout=sys.stderr)


def works(py: Path) -> bool:
    if not py.exists():
        return False
    r = subprocess.run([str(py), "-c", SMOKE], capture_output=True, text=True)
    if r.returncode == 0:
        log(f"lm-eval and transformers {r.stdout.strip()} work in {py}")
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
        run([str(py), "-m", "pip", "install", "--quiet", *requirements()])
        if not works(py):
            log("lm-eval does not import in the new environment; see the pip output above")
            return 1
    print(py)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
