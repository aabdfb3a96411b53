"""OpenMP worker pools of llama.cpp's CPU backend, given back by threads done with them.

ggml's CPU backend built with OpenMP (llama.cpp's default on Linux: GNU libgomp) runs
each graph in a parallel region of the calling thread and a pool of workers that libgomp
keeps *for that calling thread* until it exits. So every thread that ever decoded keeps
a pool: the caller's thread of a lone call (``Session.generate``), the thread that built
the batcher (its calibration decodes), the driver's engine thread. Once the pools'
threads outnumber the CPUs, libgomp stops spinning at its barriers in every pool
(``gomp_throttled_spin_count_var``: about 100 spins, then a futex sleep), and a decode
step crosses hundreds of barriers: a batch decoded on the engine thread ran much slower
beside another thread's idle pool (docs/results/llama_batch.md, "Latest"). A thread
that is done with llama.cpp for now therefore gives its pool back
(``omp_pause_resource_all(omp_pause_soft)``: libgomp joins and frees the calling
thread's pool); the next region on that thread starts a new one (a thread per worker,
well under a millisecond). The engine thread keeps its own between
steps and gives it back as it starts waiting for more (``Batcher.idle``).

Other OpenMP runtimes (LLVM's libomp, MSVC's vcomp) and builds without OpenMP (Metal,
ggml's own threadpool) are left alone: :func:`release_pool` does nothing there.
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Callable

#: omp_pause_resource_kind: release the calling thread's resources (its thread pool)
OMP_PAUSE_SOFT = 1

_lock = threading.Lock()
_pauses: list[Callable[[int], int]] | None = None  # None: not looked up yet


def _mapped_libgomp() -> list[str]:
    """Paths of the GNU OpenMP runtimes loaded in this process (a wheel may bundle its
    own copy beside the system's; each keeps its own pools)."""
    paths: list[str] = []
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            for line in maps:
                path = line.rpartition(" ")[2].strip()
                if os.path.basename(path).startswith("libgomp") and path not in paths:
                    paths.append(path)
    except OSError:  # not Linux: no libgomp to look for
        pass
    return paths


def _find() -> list[Callable[[int], int]]:
    found: list[Callable[[int], int]] = []
    for path in _mapped_libgomp():
        try:
            fn = ctypes.CDLL(path).omp_pause_resource_all  # GCC 9+ (OpenMP 5.0)
        except (OSError, AttributeError):
            continue
        fn.argtypes = [ctypes.c_int]
        fn.restype = ctypes.c_int
        found.append(fn)
    return found


def release_pool() -> None:
    """Give back the calling thread's OpenMP worker pool, if it has one. Call it on a
    thread that has just finished its llama.cpp work (never inside a parallel region:
    ggml's calls return only once theirs has ended). Looked up once, after llama.cpp's
    library has loaded libgomp."""
    global _pauses
    pauses = _pauses
    if pauses is None:
        with _lock:
            if _pauses is None:
                _pauses = _find()
            pauses = _pauses
    for pause in pauses:
        pause(OMP_PAUSE_SOFT)
