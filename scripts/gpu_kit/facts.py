"""What the next run is planned from: the machine, and how long each build unit took.

``machine_facts`` reads the scheduler's autogroup setting, the CPU model, the kernel,
the driver and CUDA versions (nvidia-smi, nvcc), each in a second or less, so the kit
writes them into gpu_kit.json at its start and again in its ``finally``.
``ninja_summary`` reads a ``.ninja_log`` (llama.cpp's CMake build, torch's extension
builds): core-seconds, the wall span, the slowest units and the time per kind of unit
(``unit_kind``: the mmq / fattn-* / mmf template instances, other CUDA units, C/C++),
which is what a per-unit time plan needs. Standard library only.
"""

from __future__ import annotations

import contextlib
import os
import platform
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from gpu_kit.cuda import capture, find_cuda_home

AUTOGROUP = Path("/proc/sys/kernel/sched_autogroup_enabled")


def read_text(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None


def autogroup_enabled(path: Path = AUTOGROUP) -> bool | None:
    """The kernel's autogroup scheduling: True, False, or None where it is not there."""
    text = read_text(path)
    return None if text is None or not text.strip() else text.strip() == "1"


def cpu_model(cpuinfo: str | None = None) -> str | None:
    text = read_text(Path("/proc/cpuinfo")) if cpuinfo is None else cpuinfo
    for line in (text or "").splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or None


def smi_facts() -> dict[str, Any]:
    """Driver, the CUDA version the driver supports, and the GPUs, from nvidia-smi."""
    out: dict[str, Any] = {}
    head = capture(["nvidia-smi"], timeout=15)
    m = re.search(r"CUDA Version:\s*([\d.]+)", head)
    if m:
        out["driver_cuda"] = m.group(1)
    rows = capture(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,"
                    "compute_cap", "--format=csv,noheader"], timeout=15)
    gpus = [r.strip() for r in rows.splitlines() if r.strip()]
    if gpus:
        out["gpus"] = gpus
        out["driver"] = gpus[0].split(",")[1].strip() if "," in gpus[0] else None
    return out


def nvcc_version(home: str | None) -> str | None:
    if not home:
        return None
    m = re.search(r"release (\d+\.\d+), V([\d.]+)",
                  capture([str(Path(home) / "bin" / "nvcc"), "--version"]))
    return m.group(2) if m else None


def machine_facts(smi: bool = True) -> dict[str, Any]:
    """The facts that plan the next run; none of them needs more than a second or two
    (``smi``: ask nvidia-smi too, which a wedged GPU could hold up to 30 s)."""
    try:
        allowed = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        allowed = None
    home = find_cuda_home()
    facts: dict[str, Any] = {
        "sched_autogroup_enabled": autogroup_enabled(),
        "cpu_model": cpu_model(),
        "cores": os.cpu_count(),
        "cores_allowed": allowed,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "cuda_home": home,
        "nvcc": nvcc_version(home),
    }
    with contextlib.suppress(OSError):
        facts["loadavg"] = [round(x, 2) for x in os.getloadavg()]
    if smi:
        facts.update(smi_facts())
    return facts


# -- ninja logs ----------------------------------------------------------------------------

#: Kinds of build unit, by the path of what they make: the first pattern that matches.
UNIT_KINDS = (
    ("mmq", re.compile(r"template-instances/mmq-instance[^/]*\.cu\.o$")),
    ("fattn-mma", re.compile(r"template-instances/fattn-mma[^/]*\.cu\.o$")),
    ("fattn-tile", re.compile(r"template-instances/fattn-tile[^/]*\.cu\.o$")),
    ("fattn-vec", re.compile(r"template-instances/fattn-vec[^/]*\.cu\.o$")),
    ("mmf", re.compile(r"template-instances/mmf-instance[^/]*\.cu\.o$")),
    ("cuda", re.compile(r"\.(cu|cuda)\.o$")),
    ("c/c++", re.compile(r"\.(c|cc|cpp|cxx)\.o$|\.o$")),
    ("link", re.compile(r"\.(so|a)(\.[\d.]+)?$")),
)


def unit_kind(output: str) -> str:
    for kind, pattern in UNIT_KINDS:
        if pattern.search(output):
            return kind
    return "other"


def read_ninja_log(path: Path) -> list[tuple[str, float]]:
    """(output, seconds) per build edge, the last record of each output (a rebuild or a
    resumed build appends). Formats v5 to v7 all start: start_ms, end_ms, mtime, output."""
    text = read_text(path)
    if not text:
        return []
    last: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        parts = line.split("\t")
        if len(parts) < 4:
            continue
        try:
            start, end = int(parts[0]), int(parts[1])
        except ValueError:
            continue
        last[parts[3]] = max(end - start, 0) / 1000.0
    return list(last.items())


def ninja_span(path: Path) -> float | None:
    """Wall seconds from the first edge's start to the last edge's end (one ninja run)."""
    text = read_text(path) or ""
    starts, ends = [], []
    for line in text.splitlines():
        parts = line.split("\t")
        if len(parts) >= 4 and parts[0].isdigit() and parts[1].isdigit():
            starts.append(int(parts[0]))
            ends.append(int(parts[1]))
    return (max(ends) - min(starts)) / 1000.0 if starts else None


def summarize_edges(edges: Iterable[tuple[str, float]], slowest: int = 10) -> dict[str, Any]:
    edges = list(edges)
    kinds: dict[str, dict[str, float]] = {}
    for out, secs in edges:
        k = kinds.setdefault(unit_kind(out), {"units": 0, "core_s": 0.0})
        k["units"] += 1
        k["core_s"] += secs
    for k in kinds.values():
        k["core_s"] = round(k["core_s"], 1)
        k["mean_s"] = round(k["core_s"] / k["units"], 1) if k["units"] else 0.0
    top = sorted(edges, key=lambda e: e[1], reverse=True)[:slowest]
    return {"units": len(edges), "core_s": round(sum(s for _, s in edges), 1),
            "by_kind": dict(sorted(kinds.items(), key=lambda kv: -kv[1]["core_s"])),
            "slowest": [[Path(o).name, round(s, 1)] for o, s in top]}


def ninja_summary(path: Path, expected_units: int | None = None) -> dict[str, Any] | None:
    """A build's ninja log as core-seconds, wall span, parallelism, slowest units, per
    kind; None where there is no log (the build never started)."""
    edges = read_ninja_log(path)
    if not edges and not path.is_file():
        return None
    out = summarize_edges(edges)
    span = ninja_span(path)
    out["log"] = str(path)
    if span:
        out["wall_s"] = round(span, 1)
        out["parallelism"] = round(out["core_s"] / span, 1) if span > 0 else None
    if expected_units is not None:
        out["expected_units"] = expected_units
    return out
