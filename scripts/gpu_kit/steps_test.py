"""The GPU kit's test steps: pytest selections under the GPU machine's rules, the
proofs of the kit's own rules, the bench. The rules: every GPU test under pytest-timeout's
``--timeout``; a test step whose GPU tests all skip fails ("GPU: x passed, y skipped");
a bench that ran on the CPU fails.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpu_kit import proofs
from gpu_kit.facts import autogroup_enabled
from gpu_kit.kit import REPO, Kit
from gpu_kit.report import count_outcomes, parse_junit
from gpu_kit.runner import StepContext, StepFailed, StepSkipped, StepTimeout, tail_of
from gpu_kit.steps_build import last_error

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
