"""Finding the CUDA toolchain on the GPU machine: the toolkit, cuBLAS and libcuda.

The toolkit may sit behind a wrapper script (``/usr/local/bin/nvcc`` running
``exec /usr/local/cuda-13.0/bin/nvcc``, as on this project's CPU machine), and cuBLAS may
live only in torch's ``nvidia-*`` wheels. Standard library only.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path


def capture(cmd: Sequence[str], timeout: float = 30, env: dict[str, str] | None = None) -> str:
    """A quick command's stdout ('' if it is missing or fails): for facts, not steps."""
    try:
        full = {**os.environ, **(env or {})}
        p = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout, env=full)
    except (OSError, subprocess.SubprocessError):
        return ""
    return p.stdout if p.returncode == 0 else ""


def find_cuda_home() -> str | None:
    """The toolkit folder: CUDA_HOME/CUDA_PATH, else nvcc's (through a wrapper script)."""
    for var in ("CUDA_HOME", "CUDA_PATH"):
        home = os.environ.get(var)
        if home and (Path(home) / "bin" / "nvcc").exists():
            return home
    nvcc = shutil.which("nvcc")
    candidates: list[Path] = []
    if nvcc:
        real = Path(nvcc).resolve()
        candidates.append(real.parent.parent)
        try:  # /usr/local/bin/nvcc can be `exec /usr/local/cuda-13.0/bin/nvcc "$@"`
            text = real.read_text(errors="replace")[:2000] if real.stat().st_size < 4096 else ""
        except OSError:
            text = ""
        m = re.search(r"exec\s+(\S+/bin/nvcc)\b", text)
        if m:
            candidates.insert(0, Path(m.group(1)).parent.parent)
    candidates += [Path("/usr/local/cuda"), *sorted(Path("/usr/local").glob("cuda-*"),
                                                    reverse=True)]
    for c in candidates:
        if (c / "bin" / "nvcc").exists() and (c / "include" / "cuda_runtime.h").exists():
            return str(c)
    return None


def toolkit_lib(home: Path, stem: str) -> Path | None:
    for sub in ("lib64", "lib", "targets/x86_64-linux/lib", "lib64/stubs",
                "targets/x86_64-linux/lib/stubs"):
        found = sorted((home / sub).glob(f"{stem}.so*"))
        if found:
            return found[0]
    return None


def pip_cuda_dirs(python: str) -> list[Path]:
    """Folders of the nvidia-* wheels in that python (torch's cuBLAS lives there)."""
    out = capture([python, "-c", "import nvidia, json; print(json.dumps(list(nvidia.__path__)))"])
    try:
        return [Path(p) for p in json.loads(out.strip().splitlines()[-1])] if out else []
    except (ValueError, IndexError):
        return []


def find_pip_cublas(python: str) -> tuple[Path | None, Path | None]:
    """(include dir with cublas_v2.h, lib dir with libcublas.so*) from nvidia-* wheels."""
    inc = lib = None
    for root in pip_cuda_dirs(python):
        for h in sorted(root.glob("**/include/cublas_v2.h")):
            inc = inc or h.parent
        for so in sorted(root.glob("**/lib/libcublas.so*")):
            lib = lib or so.parent
    return inc, lib


def find_libcuda() -> Path | None:
    out = capture(["ldconfig", "-p"])
    for line in out.splitlines():
        if "libcuda.so" in line and "=>" in line and "x86-64" in line:
            return Path(line.split("=>")[-1].strip())
    for pattern in ("/usr/local/nvidia/lib64/libcuda.so*", "/usr/lib/x86_64-linux-gnu/libcuda.so*"):
        found = sorted(Path("/").glob(pattern.lstrip("/")))
        if found:
            return found[0]
    return None
