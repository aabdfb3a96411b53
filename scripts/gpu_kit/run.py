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

This file holds the plan (``build_steps``) and the run; the steps are in
gpu_kit/steps_build.py and gpu_kit/steps_test.py, their shared state in gpu_kit/kit.py,
the step runner in gpu_kit/runner.py, the proofs in gpu_kit/proofs.py, the facts for the
next run's plan in gpu_kit/facts.py.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))

# the steps live in gpu_kit.steps_build and gpu_kit.steps_test; the names tests and
# callers use are re-exported here (``from gpu_kit import run``)
from gpu_kit import spec  # noqa: E402
from gpu_kit.cuda import find_cuda_home  # noqa: E402, F401
from gpu_kit.facts import machine_facts, ninja_summary  # noqa: E402
from gpu_kit.kit import (  # noqa: E402, F401
    TEST_TIMEOUT_S,
    Kit,
    find_fixture_python,
    last_json,
    prebuilt_archive,
    resolve_llama_mode,
)
from gpu_kit.report import (  # noqa: E402, F401
    Report,
    count_outcomes,
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
    StepSkipped,
    overall_ok,
)
from gpu_kit.steps_build import (  # noqa: E402, F401
    BUILD_SNIPPET,
    EXL2_NICE,
    EXL3_NICE,
    EXT_NAMES,
    LLAMA_CHECK,
    requirement_needed,
    step_env,
    step_ext_build,
    step_install,
    step_llama_build,
    step_llama_configure,
    step_llama_install,
    step_llama_src,
    step_model_exl,
    step_model_gguf,
    step_model_hf,
    write_dist_info,
)
from gpu_kit.steps_test import (  # noqa: E402, F401
    PYTEST,
    Selection,
    judge_bench,
    judge_tests,
    running_test,
    step_bench,
    step_proof_all_skipped,
    step_proof_nice,
    step_proof_test_timeout,
    step_pytest,
)

#: Steps ExLlamaV3 adds (177 CUDA units: it does not fit the first run's 10 minutes
#: beside llama.cpp's build); --with-exllamav3 brings them back.
EXL3_STEPS = ("exl3_build", "model_exl3", "test_exllamav3", "bench_exllamav3")

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
        # (the driver's facts were read at the start: no nvidia-smi here, it could hang)
        report.extra["machine"] = {**report.extra["machine"], **machine_facts(smi=False)}
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
