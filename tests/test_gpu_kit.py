"""The GPU verification kit, checked on the CPU: its step runner, its bundle, its rehearsal.

scripts/gpu_kit_prepare.py assembles what travels to a GPU machine; scripts/gpu_kit/run.py
runs there. Here: the runner's time limits and failure isolation, the llama.cpp trim
rules, the requirement check, the pytest selections the GPU run uses (none may collect
nothing), and, end to end, a bundle under the 64 MiB limit and the CPU rehearsal
(``run.py --dry-run --quick``), which needs the package registry (or the download cache)
and, for its model steps, the fixtures venv of scripts/make_test_models.py.
"""

from __future__ import annotations

import importlib.util
import io
import json
import os
import re
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.conftest import ROOT

sys.path.insert(0, str(ROOT / "scripts"))

from gpu_kit import facts, proofs, runner, spec
from gpu_kit import run as kit_run
from gpu_kit.runner import Step, StepContext


def _load_prepare() -> ModuleType:
    path = ROOT / "scripts" / "gpu_kit_prepare.py"
    mod_spec = importlib.util.spec_from_file_location("gpu_kit_prepare", path)
    assert mod_spec and mod_spec.loader
    mod = importlib.util.module_from_spec(mod_spec)
    sys.modules.setdefault("gpu_kit_prepare", mod)
    mod_spec.loader.exec_module(mod)
    return mod


prepare = _load_prepare()


def _run(steps: list[Step], tmp_path: Path, budget: float = 30.0,
         grace: float = 15.0) -> dict[str, runner.StepResult]:
    r = runner.Runner(steps, budget_s=budget, log_dir=tmp_path / "logs", echo=lambda _: None,
                      grace_s=grace)
    return {res.name: res for res in r.run()}


def _cmd(*argv: str) -> Any:
    return lambda ctx: ctx.run(list(argv)) and None


# -- the step runner ---------------------------------------------------------------------

def test_a_step_past_its_limit_is_killed_with_its_children(tmp_path: Path) -> None:
    pidfile = tmp_path / "grandchild.pid"
    slow = Step("slow", "sleeps", _cmd("sh", "-c", f"sleep 30 & echo $! > {pidfile}; wait"),
                limit_s=1.0)
    after = Step("after", "runs anyway", _cmd("true"))
    dependent = Step("dependent", "needs slow", _cmd("true"), deps=("slow",))
    t0 = time.monotonic()
    res = _run([slow, after, dependent], tmp_path)
    assert time.monotonic() - t0 < 15
    assert res["slow"].status == runner.TIMEOUT and res["slow"].seconds < 8
    assert "time limit" in res["slow"].detail
    assert res["after"].status == runner.OK
    assert res["dependent"].status == runner.SKIPPED
    assert res["dependent"].detail.startswith("needs slow (timeout")
    pid = int(pidfile.read_text())
    time.sleep(0.2)
    assert not _alive(pid), "the background sleep outlived its step"


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for a reaper does not count)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_failures_say_why_and_the_budget_is_kept(tmp_path: Path) -> None:
    fails = Step("fails", "exits 3", _cmd("sh", "-c", "echo the real reason; exit 3"))

    def skips(ctx: StepContext) -> str:
        raise runner.StepSkipped("no CUDA here")

    def bug(ctx: StepContext) -> str:
        return str(1 / 0)

    late = Step("late", "needs more time than is left", _cmd("true"), min_s=60.0)
    res = _run([fails, Step("skips", "", skips), Step("bug", "", bug), late], tmp_path,
               budget=20.0)
    assert res["fails"].status == runner.FAILED
    assert res["fails"].detail == "sh -c echo the real reason; exit 3 exited 3: the real reason"
    assert res["skips"].status == runner.SKIPPED and res["skips"].detail == "no CUDA here"
    assert res["bug"].status == runner.FAILED and "ZeroDivisionError" in res["bug"].detail
    assert res["late"].status == runner.SKIPPED and "out of time" in res["late"].detail
    assert "the real reason" in Path(res["fails"].log).read_text()
    assert not runner.overall_ok(list(res.values()))


def test_gpu_steps_take_turns_and_others_overlap(tmp_path: Path) -> None:
    spans: dict[str, tuple[float, float]] = {}

    def timed(name: str) -> Any:
        def fn(ctx: StepContext) -> str:
            t0 = time.monotonic()
            ctx.run(["sleep", "0.6"])
            spans[name] = (t0, time.monotonic())
            return ""
        return fn

    steps = [Step("g1", "", timed("g1"), gpu=True), Step("g2", "", timed("g2"), gpu=True),
             Step("c1", "", timed("c1")), Step("c2", "", timed("c2"))]
    res = _run(steps, tmp_path)
    assert all(r.status == runner.OK for r in res.values())
    (a0, a1), (b0, b1) = spans["g1"], spans["g2"]
    assert a1 <= b0 or b1 <= a0, "two GPU steps ran at once"
    (c0, c1), (d0, d1) = spans["c1"], spans["c2"]
    assert c0 < d1 and d0 < c1, "CPU steps should overlap"


def test_a_step_stuck_in_python_is_abandoned(tmp_path: Path) -> None:
    def stuck(ctx: StepContext) -> str:
        time.sleep(5)
        return "never reported"

    t0 = time.monotonic()
    res = _run([Step("stuck", "", stuck, limit_s=0.3), Step("next", "", _cmd("true"))],
               tmp_path, grace=0.3)
    assert time.monotonic() - t0 < 4
    assert res["stuck"].status == runner.TIMEOUT and "abandoned" in res["stuck"].detail
    assert res["next"].status == runner.OK


def test_optional_steps_do_not_fail_the_run() -> None:
    ok = runner.StepResult("a", "", runner.OK)
    late = runner.StepResult("b", "", runner.TIMEOUT, optional=True)
    assert runner.overall_ok([ok, late])
    assert not runner.overall_ok([ok, runner.StepResult("c", "", runner.FAILED)])


# -- the llama.cpp trim ------------------------------------------------------------------

KEPT = ("CMakeLists.txt", "pyproject.toml", "llama_cpp/llama.py", "llama_cpp/llama_cpp.py",
        "vendor/llama.cpp/CMakeLists.txt", "vendor/llama.cpp/src/llama-model.cpp",
        "vendor/llama.cpp/ggml/src/ggml-cuda/fattn.cu",
        "vendor/llama.cpp/ggml/src/ggml-cuda/template-instances/mmq-instance-q4_0.cu",
        "vendor/llama.cpp/ggml/src/ggml-cpu/arch/x86/quants.c",
        "vendor/llama.cpp/ggml/src/CMakeLists.txt", "vendor/llama.cpp/convert_hf_to_gguf.py",
        "vendor/llama.cpp/gguf-py/gguf/constants.py",
        "vendor/llama.cpp/vendor/miniaudio/CMakeLists.txt")
DROPPED = (".git/modules/x", "docs/index.md", "tests/test_llama.py", "examples/server/x.py",
           "vendor/llama.cpp/docs/ops/CUDA.csv", "vendor/llama.cpp/models/ggml-vocab-qwen2.gguf",
           "vendor/llama.cpp/tools/ui/index.html", "vendor/llama.cpp/common/chat.cpp",
           "vendor/llama.cpp/tests/test-backend-ops.cpp",
           "vendor/llama.cpp/ggml/src/ggml-vulkan/ggml-vulkan.cpp",
           "vendor/llama.cpp/ggml/src/ggml-hip/CMakeLists.txt",
           "vendor/llama.cpp/ggml/src/ggml-cpu/arch/arm/quants.c",
           "vendor/llama.cpp/gguf-py/tests/test_quants.py",
           "vendor/llama.cpp/vendor/miniaudio/miniaudio.h",
           "vendor/llama.cpp/vendor/cpp-httplib/httplib.h")


@pytest.mark.parametrize("path", KEPT)
def test_trim_keeps_what_a_cuda_build_reads(path: str) -> None:
    assert spec.keep_sdist_member(path)


@pytest.mark.parametrize("path", DROPPED)
def test_trim_drops_the_rest(path: str) -> None:
    assert not spec.keep_sdist_member(path)


def _sdist(tmp_path: Path, cmake: str) -> Path:
    top = f"llama_cpp_python-{spec.LLAMA_CPP_VERSION}/"
    path = tmp_path / spec.LLAMA_SDIST
    files = {"CMakeLists.txt": cmake, "llama_cpp/__init__.py": "x = 1\n",
             "vendor/llama.cpp/docs/big.md": "d" * 5000,
             "vendor/llama.cpp/ggml/src/ggml-cuda/a.cu": "// cuda\n"}
    with tarfile.open(path, "w:gz") as tar:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(top + name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def test_trim_patches_out_the_common_library(tmp_path: Path) -> None:
    old, new = spec.CMAKE_PATCH
    sdist = _sdist(tmp_path, f"project(x)\n{old}\n")
    out = tmp_path / "trimmed.tar.gz"
    stats = prepare.trim_sdist(sdist, out)
    assert stats["kept_files"] == 3 and stats["dropped_bytes"] == 5000
    with tarfile.open(out) as tar:
        names = sorted(m.name.split("/", 1)[1] for m in tar.getmembers())
        f = tar.extractfile(f"llama_cpp_python-{spec.LLAMA_CPP_VERSION}/CMakeLists.txt")
        assert f is not None
        cmake = f.read().decode()
    assert names == ["CMakeLists.txt", "llama_cpp/__init__.py",
                     "vendor/llama.cpp/ggml/src/ggml-cuda/a.cu"]
    assert new in cmake and old not in cmake


def test_trim_refuses_a_source_it_does_not_know(tmp_path: Path) -> None:
    sdist = _sdist(tmp_path, "project(x)\n# no LLAMA_BUILD_COMMON line\n")
    with pytest.raises(prepare.PrepareError, match="CMAKE_PATCH"):
        prepare.trim_sdist(sdist, tmp_path / "out.tar.gz")


def test_wheel_names_match_their_pins() -> None:
    assert prepare.wheel_matches("pydantic_core-2.50.5-cp312-cp312-manylinux2014_x86_64.whl",
                                 "pydantic-core==2.50.5")
    assert not prepare.wheel_matches("pydantic_core-2.50.4-cp312-cp312-x.whl",
                                     "pydantic-core==2.50.5")
    assert not prepare.wheel_matches("pydantic-2.50.5-py3-none-any.whl", "pydantic-core==2.50.5")


# -- requirements on the GPU machine -----------------------------------------------------

def test_requirement_markers_are_those_of_the_gpu_machine() -> None:
    pytest.importorskip("packaging")
    m = dict(spec.DEVICE_MARKERS)
    assert kit_run.requirement_needed("Pandas>=1.5", m) == "pandas"
    assert kit_run.requirement_needed('triton-windows; platform_system == "Windows"', m) is None
    assert kit_run.requirement_needed('datasets; extra == "eval"', m) is None
    assert kit_run.requirement_needed("tomli>=1.1; python_version < '3.11'", m) is None
    assert kit_run.requirement_needed("Typing_Extensions>=4.16", m) == "typing-extensions"


def test_every_carried_wheel_is_named_once() -> None:
    names = [spec.canonical(w.partition("==")[0]) for w in spec.WHEELS]
    assert len(names) == len(set(names))
    assert not set(names) & set(spec.NOT_CARRIED)


# -- the pytest selections of the GPU run ------------------------------------------------

@pytest.mark.parametrize("step", sorted(kit_run.PYTEST))
def test_each_gpu_selection_collects_tests(step: str) -> None:
    """pytest exits 5 when a selection matches nothing: the GPU run must never do that.
    A GPU selection collects only GPU tests (tests/test_gpu.py, or test_exllama.py's
    test_gpu_* that need a CUDA device): the all-skipped rule counts them."""
    for sel in kit_run.PYTEST[step]:
        proc = subprocess.run([sys.executable, "-m", "pytest", *sel.args, "--collect-only",
                               "-q", "-p", "no:cacheprovider"], cwd=ROOT, capture_output=True,
                              text=True, timeout=120)
        assert proc.returncode == 0, f"{sel}: exit {proc.returncode}\n{proc.stdout[-2000:]}"
        ids = [ln for ln in proc.stdout.splitlines() if "::" in ln]
        assert ids, sel
        if sel.gpu:
            assert all("test_gpu.py::" in i or "::test_gpu_" in i for i in ids), ids
            assert not any("test_gpu_split_decisions" in i for i in ids), ids


def test_junit_is_read_into_outcomes(tmp_path: Path) -> None:
    xml = tmp_path / "j.xml"
    xml.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.test_gpu" name="test_a[exllamav2]" time="1.5"/>'
        '<testcase classname="tests.test_gpu" name="test_b" time="0.1">'
        '<failure message="assert 1 == 2">trace</failure></testcase>'
        '<testcase classname="tests.test_gpu" name="test_c" time="0">'
        '<skipped message="no NVIDIA GPU">x</skipped></testcase>'
        "</testsuite></testsuites>")
    cases = kit_run.parse_junit(xml)
    assert cases[0] == {"id": "tests/test_gpu.py::test_a[exllamav2]", "outcome": "passed",
                        "seconds": 1.5}
    assert cases[1]["outcome"] == "failed" and cases[1]["message"] == "assert 1 == 2"
    assert kit_run.count_outcomes(cases) == {"passed": 1, "failed": 1, "error": 0,
                                             "skipped": 1}


def test_cuda_home_is_found_through_a_wrapper_script(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    home = tmp_path / "cuda-13.0"
    (home / "bin").mkdir(parents=True)
    (home / "include").mkdir()
    (home / "bin" / "nvcc").write_text("#!/bin/sh\n")
    (home / "bin" / "nvcc").chmod(0o755)
    (home / "include" / "cuda_runtime.h").write_text("")
    wrappers = tmp_path / "bin"
    wrappers.mkdir()
    (wrappers / "nvcc").write_text(f'#!/bin/sh\nexec {home}/bin/nvcc "$@"\n')
    (wrappers / "nvcc").chmod(0o755)
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setenv("PATH", f"{wrappers}{os.pathsep}/usr/bin:/bin")
    assert kit_run.find_cuda_home() == str(home)


# -- end to end: the bundle and the CPU rehearsal -----------------------------------------

@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    if prepare.fixture_tokenizer_dir() is None:
        pytest.skip("no SmolLM2 hf fixture for the tokenizer "
                    "(python scripts/make_test_models.py --only hf)")
    out = tmp_path_factory.mktemp("kit") / spec.BUNDLE_DIR
    try:
        manifest = prepare.prepare(out, prepare.default_cache(), None, offline=False)
    except prepare.PrepareError as e:
        if "pip download" in str(e):
            pytest.skip(f"the bundle needs the package registry or a filled cache: {e}")
        raise
    return out, manifest


def test_the_bundle_fits_and_says_what_it_holds(bundle: tuple[Path, dict[str, Any]]) -> None:
    out, manifest = bundle
    sizes = manifest["sizes"]
    measured = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    assert sizes["bundle_bytes"] == measured
    assert sizes["travel_bytes"] == measured + sizes["tree_bytes"]
    assert sizes["travel_bytes"] < spec.TRAVEL_LIMIT
    assert len(manifest["wheels"]) == len(spec.WHEELS)
    assert {p.name for p in (out / "wheels").iterdir()} == {w["file"] for w in manifest["wheels"]}
    llama = manifest["llama_cpp"]
    assert (out / llama["file"]).stat().st_size == llama["bytes"]
    assert llama["kept_bytes"] < llama["dropped_bytes"]  # most of the 76 MB sdist stays home
    assert (out / "tokenizer" / "tokenizer.json").is_file()
    assert prepare.run_command(spec.BUNDLE_DIR).startswith("PYTHONUNBUFFERED=1 python3 ")


def test_cpu_rehearsal_passes(bundle: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    out_dir, work = tmp_path / "out", tmp_path / "work"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts/gpu_kit/run.py"), "--dry-run",
                           "--quick", "--bundle", str(bundle[0]), "--work", str(work),
                           "--out", str(out_dir), "--budget", "240"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    data = json.loads((out_dir / spec.RESULT_JSON).read_text())
    steps = {s["name"]: s for s in data["steps"]}
    assert proc.returncode == 0 and data["ok"], proc.stdout[-3000:]
    assert data["mode"] == "rehearsal" and data["finished"]
    for name in ("env", "install_wheels", "llama_src", "llama_configure", "test_nvml",
                 "test_exllamav2", "proof_nice", "proof_all_skipped", "proof_test_timeout"):
        assert steps[name]["status"] == "ok", steps[name]
    assert steps["llama_configure"]["facts"]["c_cpp_units"] > 0
    for name in ("llama_build", "exl2_build"):
        assert steps[name]["status"] == "skipped" and "GPU machine" in steps[name]["detail"]
    # ExLlamaV3 is out of the first run unless asked for
    for name in kit_run.EXL3_STEPS:
        assert steps[name]["status"] == "skipped", steps[name]
        assert "--with-exllamav3" in steps[name]["detail"], steps[name]
    # the proofs, on this machine: priorities between steps, the all-skipped rule
    nice = steps["proof_nice"]["facts"]["one_session"]
    assert nice["share_low_nice"] >= proofs.MIN_SHARE, nice
    assert re.match(r"a test step whose GPU tests all skip fails: GPU: 0 passed, 2 skipped",
                    steps["proof_all_skipped"]["detail"]), steps["proof_all_skipped"]
    assert steps["proof_test_timeout"]["facts"]["cases"][0]["outcome"] == "failed"
    # what plans the next run, written whatever happens
    machine = data["machine"]
    assert {"sched_autogroup_enabled", "cpu_model", "cores", "nvcc"} <= set(machine)
    assert "builds" in data and data["options"]["with_exllamav3"] is False
    for s in data["steps"]:
        assert s["status"] in ("ok", "skipped"), s
        assert s["status"] == "ok" or s["detail"], s  # a skip always says why
        if s.get("started_at_s") is not None:
            assert s["seconds"] <= s["limit_s"] + 1
    log = (out_dir / spec.RESULT_LOG).read_text()
    assert "######## install_wheels: ok" in log
    if kit_run.find_fixture_python() is None:
        assert steps["model_hf"]["status"] == "skipped"
        assert "fixtures venv" in steps["model_hf"]["detail"]
        pytest.skip("the model steps need the fixtures venv (python scripts/make_test_models.py)")
    for name in ("model_hf", "model_gguf", "test_llama_cpp", "bench_llama_cpp"):
        assert steps[name]["status"] == "ok", steps[name]
    tests = steps["test_llama_cpp"]["tests"]
    assert tests["passed"] >= 4 and tests["failed"] == tests["error"] == 0


# -- steps against stand-ins ---------------------------------------------------------------

def _kit(tmp_path: Path, *, dry_run: bool) -> Any:
    import argparse

    args = argparse.Namespace(bundle=str(tmp_path / "bundle"), work=str(tmp_path / "work"),
                              out=str(tmp_path / "out"), jobs=2, dry_run=dry_run,
                              quick=False, tools_python=sys.executable)
    return kit_run.Kit(args)


def _ctx(tmp_path: Path, name: str = "step", limit: float = 60.0) -> StepContext:
    step = Step(name, "", lambda ctx: None)
    log = tmp_path / f"{name}.log"
    log.write_text("")
    return StepContext(step, time.monotonic() + limit, log, os.environ)


def _wheel(folder: Path, name: str, requires: list[str]) -> Path:
    import zipfile

    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}-1.0-py3-none-any.whl"
    dist = f"{name}-1.0.dist-info"
    meta = f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n" + "".join(
        f"Requires-Dist: {r}\n" for r in requires)
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{name}/__init__.py", "")
        z.writestr(f"{dist}/METADATA", meta)
        z.writestr(f"{dist}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: "
                   "true\nTag: py3-none-any\n")
        z.writestr(f"{dist}/RECORD", "")
    return path


def test_install_names_a_requirement_the_gpu_machine_lacks(tmp_path: Path) -> None:
    kit = _kit(tmp_path, dry_run=True)
    wheels = kit.bundle / "wheels"
    _wheel(wheels, "kitfake", ["numpy>=1", "not-on-the-gpu-box>=2",
                               'winonly; platform_system == "Windows"'])
    with pytest.raises(runner.StepFailed) as info:
        kit_run.step_install(kit, _ctx(tmp_path))
    assert str(info.value) == ("missing on the GPU machine: not-on-the-gpu-box (needed by "
                               "kitfake)")
    assert (kit.site / "kitfake" / "__init__.py").is_file()  # installed for cp312 all the same


def test_extension_build_retries_in_cxx20_and_clears_a_stale_lock(tmp_path: Path) -> None:
    """nvcc 13.1+ rejects torch's headers in C++17 mode: the build goes again in C++20."""
    kit = _kit(tmp_path, dry_run=False)
    fake = tmp_path / "python"
    calls = tmp_path / "calls"
    fake.write_text(f"#!/bin/sh\necho \"$3 $4\" >> {calls}\n"
                    f"if [ \"$4\" = 1 ]; then echo built; exit 0; fi\n"
                    "echo \"List_inl.h:202:52: error: need 'typename' before 'decltype'\" >&2\n"
                    "exit 1\n")
    fake.chmod(0o755)
    kit.python = str(fake)
    lock = kit.ext_dir / "exllamav2_ext" / "lock"
    lock.parent.mkdir(parents=True)
    lock.write_text("")
    detail = kit_run.step_ext_build(kit, _ctx(tmp_path), "exllamav2")
    assert calls.read_text().split("\n")[:2] == ["exllamav2 0", "exllamav2 1"]
    assert detail.endswith("(-std=c++20)") and not lock.exists()


def test_extension_build_failure_names_the_error(tmp_path: Path) -> None:
    kit = _kit(tmp_path, dry_run=False)
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho 'q_gemm.cu(12): error: identifier \"x\" is undefined' >&2\n"
                    "echo 'ninja: build stopped: subcommand failed.' >&2\nexit 1\n")
    fake.chmod(0o755)
    kit.python = str(fake)
    with pytest.raises(runner.StepFailed, match=r'exit 1\): .*error: identifier "x"'):
        kit_run.step_ext_build(kit, _ctx(tmp_path), "exllamav3")


def test_build_snippet_adds_cxx20_to_the_engines_load_call(tmp_path: Path) -> None:
    """The snippet the GPU run imports each engine's extension with, against stand-ins
    for torch's cpp_extension and an engine whose ext.py calls load() as exllamav2's
    does (``from torch.utils.cpp_extension import load`` at import)."""
    (tmp_path / "torch" / "utils").mkdir(parents=True)
    (tmp_path / "torch" / "__init__.py").write_text("")
    (tmp_path / "torch" / "utils" / "__init__.py").write_text("")
    (tmp_path / "torch" / "utils" / "cpp_extension.py").write_text(
        "def load(**kw):\n    return type('Ext', (), {'__file__': repr(kw)})\n")
    (tmp_path / "fakeeng").mkdir()
    (tmp_path / "fakeeng" / "__init__.py").write_text("")
    (tmp_path / "fakeeng" / "ext.py").write_text(
        "from torch.utils.cpp_extension import load\n"
        "ext_c = load(name='fakeeng_ext', sources=[], extra_cuda_cflags=['-O3'])\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    for flag, expected in (("0", "['-O3']"), ("1", "['-O3', '-std=c++20']")):
        proc = subprocess.run([sys.executable, "-c", kit_run.BUILD_SNIPPET, "fakeeng", flag],
                              capture_output=True, text=True, env=env, timeout=60)
        assert proc.returncode == 0, proc.stderr
        assert f"'extra_cuda_cflags': {expected}" in proc.stdout, proc.stdout


def test_built_llama_cpp_is_found_by_its_metadata(tmp_path: Path) -> None:
    from importlib import metadata

    kit_run.write_dist_info(tmp_path)
    dists = list(metadata.distributions(path=[str(tmp_path)]))
    assert [(spec.canonical(d.metadata["Name"]), d.version) for d in dists] == \
        [("llama-cpp-python", spec.LLAMA_CPP_VERSION)]
    assert any("diskcache" in r for d in dists for r in d.requires or [])


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None,
                    reason="llama-cpp-python is not installed here")
def test_llama_check_reads_a_llama_cpp_build() -> None:
    proc = subprocess.run([sys.executable, "-c", kit_run.LLAMA_CHECK], capture_output=True,
                          text=True, timeout=120)
    info = kit_run.last_json(proc.stdout)
    assert proc.returncode == 0, proc.stderr
    assert info["version"] and isinstance(info["gpu_offload"], bool)
    assert "CPU" in info["system_info"]


# -- priorities: one session, so nice works (issue 26) -----------------------------------

def test_each_command_gets_its_own_group_in_the_kits_session(tmp_path: Path) -> None:
    """A process group of its own (a time limit kills its children), but the kit's
    session: under autogroup, nice weighs processes only inside one session."""
    r = _ctx(tmp_path).run([sys.executable, "-c", "import os; print(os.getpid(), "
                            "os.getpgrp(), os.getsid(0))"], capture=True)
    pid, pgid, sid = map(int, r.stdout.split())
    assert pgid == pid, "the command leads no process group of its own"
    assert sid == os.getsid(0), "the command left the kit's session: nice does nothing"


def test_nice_orders_two_cpu_bound_commands_in_one_session(tmp_path: Path) -> None:
    """Two CPU-bound children at nice 0 and 15, pinned to one CPU, started as the runner
    starts commands: the nice-0 one gets most of it (idle: ~97 %; asked: 75 %). Started
    each in a session of its own, as the runner once did, autogroup splits the CPU
    evenly whatever their nice: that half shows the old way failing."""
    ctx = _ctx(tmp_path, limit=120)
    cpu = proofs.pick_cpu()
    same = proofs.measure(ctx, new_session=False, cpu=cpu)
    if not same["conclusive"]:
        pytest.skip(f"CPU {cpu} too busy to measure twice in a row: {same}")
    assert proofs.nice_works(same), proofs.describe(same)
    if not facts.autogroup_enabled():
        pytest.skip("autogroup is off here: separate sessions share by nice too")
    apart = proofs.measure(ctx, new_session=True, cpu=cpu)
    if apart["conclusive"]:
        assert apart["share_low_nice"] < proofs.MIN_SHARE, proofs.describe(apart)


# -- the all-skipped rule, the bench's device rule ------------------------------------------

def _case(test: str, outcome: str, gpu: bool, message: str = "") -> dict[str, Any]:
    return {"id": f"tests/{test}", "outcome": outcome, "seconds": 0.1, "gpu": gpu,
            **({"message": message} if message else {})}


def test_a_step_whose_gpu_tests_all_skip_fails() -> None:
    cpu_ok = [_case(f"test_exllama.py::test_cpu_{i}", "passed", False) for i in range(62)]
    skipped = [_case(f"test_gpu.py::test_exllama_{i}[exllamav2]", "skipped", True,
                     "no NVIDIA GPU on this host") for i in range(9)]
    with pytest.raises(runner.StepFailed) as info:
        kit_run.judge_tests(cpu_ok + skipped, gpu_rule=True)
    assert str(info.value).startswith("GPU: 0 passed, 9 skipped: every GPU test skipped")
    assert "no NVIDIA GPU on this host" in str(info.value)
    # one GPU test passing is evidence; the detail still counts the skips
    one = [_case("test_gpu.py::test_x", "passed", True), *skipped[1:]]
    assert kit_run.judge_tests(cpu_ok + one, gpu_rule=True).startswith(
        "GPU: 1 passed, 8 skipped; all: 63 passed, 8 skipped of 71")
    # a step with no GPU tests at all proves nothing on the GPU either
    with pytest.raises(runner.StepFailed, match="no GPU tests ran"):
        kit_run.judge_tests(cpu_ok, gpu_rule=True)
    # the rehearsal: skips are expected there
    assert kit_run.judge_tests(cpu_ok + skipped, gpu_rule=False).startswith("GPU: 0 passed")
    failed = [*one, _case("test_gpu.py::test_y", "failed", True, "assert 1 == 2")]
    with pytest.raises(runner.StepFailed, match=r"^GPU: 1 passed, 8 skipped, 1 failed; 1 of"):
        kit_run.judge_tests(failed, gpu_rule=True)


def test_the_bench_fails_on_the_cpu_and_names_its_numbers() -> None:
    numbers = {"decode_tps": 812.4, "prefill_tps": 9000.0, "ttft_ms": 2.5}
    with pytest.raises(runner.StepFailed, match="reports the device 'cpu': it ran on the CPU"):
        kit_run.judge_bench("llama.cpp", {**numbers, "device": "cpu"}, gpu=True)
    with pytest.raises(runner.StepFailed, match="no device and no VRAM use"):
        kit_run.judge_bench("exllamav2", {**numbers, "device": None}, gpu=True)
    assert kit_run.judge_bench("llama.cpp", {**numbers, "device": "cuda:0", "vram_mib": 301.0},
                               gpu=True) == ("cuda:0: decode 812 tok/s, prefill 9000 tok/s, "
                                             "TTFT 2.5 ms, 301 MiB VRAM")
    # the ExLlamas report no device: their VRAM shows where they ran
    assert kit_run.judge_bench("exllamav2", {**numbers, "vram_mib": 412.0}, gpu=True) \
        .startswith("GPU (by its VRAM): decode 812 tok/s")
    assert "not recorded" in kit_run.judge_bench("llama.cpp", {**numbers, "device": "cpu"},
                                                 gpu=False)


def test_the_test_running_when_a_step_was_stopped_is_named() -> None:
    log = ("tests/test_gpu.py::test_a PASSED                  [ 33%]\n"
           "tests/test_gpu.py::test_b[exllamav2] SKIPPED (no GPU) [ 66%]\n"
           "tests/test_gpu.py::test_c[exllamav2] \n")
    assert kit_run.running_test(log) == "tests/test_gpu.py::test_c[exllamav2]"
    assert kit_run.running_test(log + "PASSED\n") == "tests/test_gpu.py::test_c[exllamav2]"
    assert kit_run.running_test(log.rsplit("\n", 2)[0]) is None


# -- what plans the next run ---------------------------------------------------------------

def test_a_ninja_log_becomes_core_seconds_per_kind(tmp_path: Path) -> None:
    cuda = "ggml/src/ggml-cuda/CMakeFiles/ggml-cuda.dir"
    log = tmp_path / ".ninja_log"
    log.write_text(
        "# ninja log v5\n"
        f"0\t19000\t1\t{cuda}/template-instances/mmq-instance-q4_0.cu.o\tabc\n"
        f"0\t60000\t1\t{cuda}/template-instances/fattn-tile-instance-dkq64.cu.o\tabc\n"
        f"100\t7100\t1\t{cuda}/argmax.cu.o\tabc\n"
        f"200\t2200\t1\tsrc/CMakeFiles/llama.dir/llama.cpp.o\tabc\n"
        f"60000\t61000\t1\tbin/libggml-cuda.so\tabc\n"
        # a resumed build appends: the last record of an output counts
        f"61000\t61500\t1\t{cuda}/argmax.cu.o\tabc\n")
    s = facts.ninja_summary(log)
    assert s is not None
    assert s["units"] == 5 and s["core_s"] == 19 + 60 + 0.5 + 2 + 1
    assert s["by_kind"]["fattn-tile"] == {"units": 1, "core_s": 60.0, "mean_s": 60.0}
    assert s["by_kind"]["c/c++"]["units"] == 1 and s["by_kind"]["link"]["units"] == 1
    assert s["slowest"][0] == ["fattn-tile-instance-dkq64.cu.o", 60.0]
    assert s["wall_s"] == 61.5 and s["parallelism"] == round(82.5 / 61.5, 1)
    assert facts.ninja_summary(tmp_path / "missing") is None
    assert facts.unit_kind("exllamav2_ext/q_gemm.cuda.o") == "cuda"
    assert facts.unit_kind("exllamav2_ext/ext_bindings.o") == "c/c++"


def test_the_prebuild_estimate_bounds_each_kind() -> None:
    from gpu_kit import prebuild_llama

    objs = [f"x/template-instances/mmq-instance-{i}.cu.o" for i in range(22)] + \
        [f"x/template-instances/mmf-instance-ncols_{i}.cu.o" for i in range(16)] + \
        [f"x/op{i}.cu.o" for i in range(10)] + [f"y/f{i}.cpp.o" for i in range(4)]
    measured = [{"unit": "mmf-instance-ncols_1.cu.o", "kind": "mmf", "wall_s": 40.0,
                 "cpu_s": 30.0, "object_bytes": 4 * 2**20, "object_xz_bytes": 2**20},
                {"unit": "ggml-cuda.cu.o", "kind": "cuda", "wall_s": 90.0, "cpu_s": 70.0,
                 "object_bytes": 2 * 2**20, "object_xz_bytes": 2**19}]
    ref = prebuild_llama.REFERENCE_S
    est = prebuild_llama.extrapolate(objs, measured)
    assert est["units"] == {"mmq": 22, "mmf": 16, "cuda": 10, "c/c++": 4}
    assert est["plan"]["mmf"]["s_per_unit"] == [min(30.0, *ref["mmf"]), 30.0]
    assert est["plan"]["cuda"]["s_per_unit"] == [min(ref["cuda"]), 70.0]
    assert est["plan"]["mmq"]["source"] == "reference"
    assert est["plan"]["cuda"]["source"] == "measured here + reference"
    low = 22 * min(ref["mmq"]) + 16 * min(30.0, *ref["mmf"]) + 10 * min(ref["cuda"]) + 4 * 10
    high = 22 * max(ref["mmq"]) + 16 * 30 + 10 * 70 + 4 * 10
    assert est["core_s"] == [round(low), round(high)]
    assert est["size"]["cuda_objects_mib"] == 48 * 3.0 and est["size"]["xz_ratio"] == 0.25


def test_the_kit_uses_prebuilt_llama_libraries_when_carried(tmp_path: Path) -> None:
    kit = _kit(tmp_path, dry_run=False)
    assert kit.llama_mode == "build"
    kit.llama_mode = "prebuilt"
    with pytest.raises(runner.StepFailed, match=r"prebuild_llama\.py --all"):
        kit_run.step_llama_build(kit, _ctx(tmp_path))
    folder = kit.bundle / spec.PREBUILT_DIR
    folder.mkdir(parents=True)
    archive = folder / f"llama-cuda-sm90-{spec.LLAMA_CPP_VERSION}.tar.xz"
    with tarfile.open(archive, "w:xz") as tar:
        for name in ("libggml-cuda.so", "libllama.so", "libggml-base.so"):
            info = tarfile.TarInfo(f"lib/{name}")
            info.size = 4
            tar.addfile(info, io.BytesIO(b"\x7fELF"))
    (folder / f"llama-cuda-sm90-{spec.LLAMA_CPP_VERSION}.json").write_text('{"nvcc": "13.0"}')
    assert kit_run.resolve_llama_mode("auto", kit.bundle) == "prebuilt"
    assert kit_run.resolve_llama_mode("build", kit.bundle) == "build"
    ctx = _ctx(tmp_path, "llama_build")
    assert kit_run.step_llama_build(kit, ctx).startswith("unpacked 3 libraries")
    assert (kit.prebuilt_libs / "lib" / "libggml-cuda.so").is_file()
    assert ctx.facts["prebuilt"] == {"nvcc": "13.0"}


def test_a_stopped_run_still_writes_its_report(bundle: tuple[Path, dict[str, Any]],
                                               tmp_path: Path) -> None:
    """SIGTERM mid-run (as a device command's end would send): the kit's ``finally``
    kills the running steps' commands and writes gpu_kit.json with the machine's facts,
    the builds' summaries and why it stopped."""
    out_dir = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, str(ROOT / "scripts/gpu_kit/run.py"),
                             "--dry-run", "--quick", "--bundle", str(bundle[0]), "--work",
                             str(tmp_path / "work"), "--out", str(out_dir)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    result = out_dir / spec.RESULT_JSON
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if json.loads(result.read_text())["steps"]:
                    break
            except (OSError, ValueError, KeyError):
                pass
            time.sleep(0.2)
        assert proc.poll() is None, "the rehearsal ended before it could be stopped"
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    data = json.loads(result.read_text())
    assert proc.returncode == 1, output[-2000:]
    assert data["finished"] and data["ok"] is False
    assert data["stopped"].startswith("the kit was stopped (signal 15)")
    assert {"sched_autogroup_enabled", "cpu_model", "kernel"} <= set(data["machine"])
    assert "builds" in data
    stopped = [s for s in data["steps"] if "stopped" in s["detail"]]
    assert stopped and all(s["status"] == "timeout" for s in stopped), data["steps"]


def test_prepare_carries_prebuilt_libraries_with_their_record(tmp_path: Path) -> None:
    src, dest = tmp_path / "out", tmp_path / "bundle" / spec.PREBUILT_DIR
    with pytest.raises(prepare.PrepareError, match=r"prebuild_llama\.py --all"):
        prepare.copy_prebuilt(src, dest)
    src.mkdir()
    name = f"llama-cuda-sm90-{spec.LLAMA_CPP_VERSION}"
    (src / f"{name}.tar.xz").write_bytes(b"xz")
    (src / f"{name}.json").write_text('{"build_s": 1800}')
    info = prepare.copy_prebuilt(src, dest)
    assert info["file"] == f"{name}.tar.xz" and info["built"] == {"build_s": 1800}
    assert kit_run.prebuilt_archive(dest.parent) == dest / f"{name}.tar.xz"


def test_with_exllamav3_brings_its_steps_back(bundle: tuple[Path, dict[str, Any]],
                                              tmp_path: Path) -> None:
    skip = "proof_nice,proof_all_skipped,proof_test_timeout,model_hf,model_gguf," \
        "llama_configure,test_nvml,test_llama_cpp,bench_llama_cpp,test_exllamav2"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts/gpu_kit/run.py"), "--dry-run",
                           "--with-exllamav3", "--bundle", str(bundle[0]), "--work",
                           str(tmp_path / "work"), "--out", str(tmp_path / "out"),
                           "--skip", skip], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    data = json.loads((tmp_path / "out" / spec.RESULT_JSON).read_text())
    steps = {s["name"]: s for s in data["steps"]}
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert data["options"]["with_exllamav3"] is True
    assert steps["test_exllamav3"]["status"] == "ok", steps["test_exllamav3"]
    assert steps["test_exllamav3"]["detail"].startswith("collected ")
    assert "GPU machine only" in steps["exl3_build"]["detail"]
