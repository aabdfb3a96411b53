"""Each engine's facts live in its own package (backends/<engine>/facts.py), collected in
one table (localrun.backends.BACKENDS): every engine there has every fact, and every other
per-engine table is derived from it or agrees with it, so an engine added to one table
only (or a fact changed in one place only) fails here."""

from __future__ import annotations

import dataclasses
import importlib.util
import re
import sys
import typing
from pathlib import Path

import pytest

from localrun.backends import (
    BACKEND_ALIASES,
    BACKENDS,
    ENGINE_OPTIONS,
    canonical_backend,
    compat,
    engine_options,
    install_hint,
    not_installed,
)
from localrun.backends.spec import BackendName, BackendSpec
from localrun.errors import EngineNotInstalledError
from localrun.formats.names import FORMAT_TITLES
from localrun.install import pip_install
from localrun.planning import hosts, selection

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

ROOT = Path(__file__).resolve().parent.parent
EXTRAS: dict[str, list[str]] = tomllib.loads(
    (ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
KINDS = {"int", "bool", "number", "numbers", "text", "switch"}


def _dist(requirement: str) -> str:
    """'mlx[cpu]>=0.31; sys_platform == "linux"' -> 'mlx'."""
    name = re.match(r"[A-Za-z0-9_.-]+", requirement)
    assert name is not None, requirement
    return name.group(0).lower()


def test_every_fact_is_required() -> None:
    """No field has a default: a new engine that leaves a fact out cannot be built."""
    for f in dataclasses.fields(BackendSpec):
        assert f.default is dataclasses.MISSING, f.name
        assert f.default_factory is dataclasses.MISSING, f.name
    with pytest.raises(TypeError, match="convert"):
        BackendSpec(**{f.name: getattr(BACKENDS["onnx"], f.name)  # type: ignore[arg-type]
                       for f in dataclasses.fields(BackendSpec) if f.name != "convert"})


def test_the_table_names_every_backend_once() -> None:
    assert tuple(BACKENDS) == typing.get_args(BackendName)
    assert all(name == spec.name for name, spec in BACKENDS.items())


@pytest.mark.parametrize("name", list(BACKENDS))
def test_every_engine_has_every_fact(name: str) -> None:
    spec = BACKENDS[name]
    assert spec.title and spec.convert and spec.dists and spec.formats
    assert importlib.util.find_spec(spec.module) is not None, spec.module  # no engine import
    # one folder per engine: its session module and its facts live in it
    package = spec.module.rsplit(".", 1)[0]
    assert package.count(".") == 2 and package.startswith("localrun.backends."), package
    assert importlib.util.find_spec(package + ".facts") is not None, package
    assert set(spec.loads) <= set(FORMAT_TITLES) and not set(spec.loads) & set(spec.formats)
    assert set(spec.conditions) <= set(spec.formats) | set(spec.loads), name
    if spec.embedder is not None:
        assert spec.embedder.startswith(package + "."), spec.embedder
        assert importlib.util.find_spec(spec.embedder) is not None, spec.embedder
    if spec.home == "here":
        # the extra exists and installs every distribution the engine needs
        assert spec.extra in EXTRAS, spec.extra
        assert set(spec.dists) <= {_dist(r) for r in EXTRAS[spec.extra]}
        assert spec.quant and spec.target_bpw
    else:
        assert spec.extra is None  # vLLM has its own environment; remote, none
    for build in spec.builds:
        assert {_dist(r) for r in EXTRAS[build.extra]} == {build.dist}
    if spec.min_compute is not None:
        major, minor = spec.min_compute
        assert 3 <= major <= 12 and 0 <= minor <= 9
    for option, (kind, why) in spec.options.items():
        assert why, option
        assert kind in KINDS or (isinstance(kind, tuple) and all(kind)), (option, kind)


def test_aliases_are_unique_and_never_shadow_a_name() -> None:
    every = [a for spec in BACKENDS.values() for a in spec.aliases]
    assert len(every) == len(set(every))
    assert not set(every) & set(BACKENDS)
    for spec in BACKENDS.values():
        for alias in spec.aliases:
            assert canonical_backend(alias.upper()) == spec.name


def test_derived_tables_agree_with_the_spec() -> None:
    derived: dict[str, tuple[object, object]] = {
        "BACKEND_ALIASES": (BACKEND_ALIASES,
                            {a: s.name for s in BACKENDS.values() for a in s.aliases}),
        "ENGINE_OPTIONS": (ENGINE_OPTIONS, {n: dict(s.options) for n, s in BACKENDS.items()}),
        "compat.CONVERT": (compat.CONVERT, {n: s.convert for n, s in BACKENDS.items()}),
        "compat.NATIVE_FORMAT": (compat.NATIVE_FORMAT,
                                 {n: s.formats[0] for n, s in BACKENDS.items()}),
        "hosts.MIN_COMPUTE": (hosts.MIN_COMPUTE, {n: s.min_compute for n, s in BACKENDS.items()
                                                  if s.min_compute is not None}),
        "selection.QUANT_PREFERENCE": (selection.QUANT_PREFERENCE,
                                       {n: s.quant for n, s in BACKENDS.items()
                                        if s.quant is not None}),
    }
    for table, (got, want) in derived.items():
        assert got == want, table
    for name, spec in BACKENDS.items():
        assert engine_options(name) == {k: why for k, (_, why) in spec.options.items()}


def test_the_compat_table_agrees_with_each_engines_formats() -> None:
    """COMPAT (format -> engine -> support, the pairing rules) names the same native
    formats as each engine's ``formats``, and no engine the spec lacks."""
    for name, spec in BACKENDS.items():
        natives = {f for f, row in compat.COMPAT.items() if row.get(name) == "native"}
        assert natives == set(spec.formats) - {"remote"}, name
    assert {b for row in compat.COMPAT.values() for b in row} <= set(BACKENDS)
    assert {b for _, b in compat.CONDITIONS} <= set(BACKENDS)
    for (fmt, backend), cond in compat.CONDITIONS.items():
        cc = BACKENDS[backend].min_compute
        if "compute capability" in cond.note:  # written from the spec, never by hand
            assert cc is not None and f">= {cc[0]}.{cc[1]}" in cond.note, (fmt, backend)


def test_the_selection_rules_name_only_known_engines() -> None:
    rules = [c for cs in selection.RULES.values() for c in cs]
    rules += [*selection.EMBED, *selection.EXPLICIT_ONLY, *selection.FALLBACKS]
    assert {c.backend for c in rules} <= set(BACKENDS)
    # every engine installed here is tried somewhere: none is planned by name only
    planned = {c.backend for c in rules}
    assert {n for n, s in BACKENDS.items() if s.home != "nowhere"} <= planned
    assert set(hosts.DEVICE_FITS) == set(typing.get_args(hosts.DeviceKind))


def test_each_engine_states_its_memory() -> None:
    """Each memory row is the engine's own fact, found by name for the memory model
    (which imports no engine table: the row is passed in)."""
    from localrun import memory
    from localrun.backends import engine_memory

    for name, spec in BACKENDS.items():
        assert set(spec.memory) <= {"cpu", "*"}, name
        assert spec.default_device in ("cpu", "*"), name
        for kind, row in spec.memory.items():
            assert engine_memory(name, kind if kind != "*" else "cuda:0") is row
    assert engine_memory("no-such-engine") is memory.UNKNOWN_ENGINE


def test_install_hints_come_from_the_spec() -> None:
    # the command itself (a clone's `pip install -e`, or the PyPI name) is
    # tests/test_packaging.py's
    assert install_hint("llama.cpp") == pip_install("llama-cpp")
    assert install_hint("onnx", "cuda:0") == pip_install("onnx-cuda")
    assert install_hint("onnx", "cpu") == pip_install("onnx")
    assert "its own environment" in install_hint("vllm")
    # vLLM is never pip-installed into localrun's environment: no [vllm] extra
    err = not_installed("vllm")
    assert "[vllm]" not in (err.hint or "") and "vLLM" in str(err)
    assert not_installed("ort").hint == pip_install("onnx")


def test_vllm_needs_its_minimum_compute_capability() -> None:
    """vLLM's GPUs are checked against its min_compute (7.0), like the other engines'."""
    from localrun.hardware import HardwareProfile
    from localrun.planning.selection import PlanRequest, select

    gpu = {"vendor": "nvidia", "name": "Tesla P100-PCIE-16GB", "memory_total": 16 * 2**30,
           "compute_capability": "6.0", "source": "test"}
    profile = HardwareProfile.from_dict({
        "os": "Linux", "arch": "x86_64", "cpu": {"vendor": "AuthenticAMD", "flags": ["avx2"]},
        "ram_total": 64 * 2**30,
        "gpus": [dict(gpu, index=0), dict(gpu, index=1)]})
    plan = select(profile, {"vllm": "0.11.0"}, PlanRequest(model="org/m-7B", backend="vllm"))
    assert any("compute capability 6.0; vllm needs >= 7.0" in n for n in plan.notes), plan


def test_the_hub_targets_come_from_the_spec() -> None:
    from localrun.hub.fit import DEFAULT_TARGET, DEFAULT_TARGET_NAMES
    from localrun.hub.variants import GGUF_BPW

    want = {s.formats[0]: s.target_bpw for s in BACKENDS.values() if s.target_bpw is not None}
    assert want == DEFAULT_TARGET
    assert set(DEFAULT_TARGET_NAMES) == set(want)
    # llama.cpp's target is the bits per weight of the quant it names
    spec = BACKENDS["llama.cpp"]
    assert spec.quant is not None and GGUF_BPW[spec.quant] == spec.target_bpw
    assert (DEFAULT_TARGET_NAMES["gguf"], DEFAULT_TARGET_NAMES["exl2"]) == ("Q4_K_M",
                                                                            "largest bpw")


def test_the_exllama_tables_come_from_the_spec() -> None:
    from localrun.backends.exllama import options

    for engine in options.ENGINES:
        spec = BACKENDS[engine]
        assert options.title(engine) == spec.title
        assert options.OPTIONS[engine] == engine_options(engine)
        # its parser's kv_cache words are the spec's kind for kv_cache
        assert spec.options["kv_cache"][0] == options.KV_CACHE_CHOICES
    assert set(options.ENGINES) == {n for n, s in BACKENDS.items() if s.module.startswith(
        "localrun.backends.exllama.v")}


def test_engine_modules_name_a_missing_engine_from_the_table() -> None:
    """Every "engine not installed" error is built by installed.missing() (an engine's
    own modules, from their facts) or not_installed() (by name) from the table's title
    and install command: no engine module spells its own (they had drifted: "llama.cpp"
    vs the table's "llama.cpp (llama-cpp-python)")."""
    pkg = ROOT / "localrun"
    spelled = [f"{f.relative_to(ROOT)}:{n}" for f in sorted(pkg.rglob("*.py"))
               if f.name != "errors.py" and f != pkg / "backends" / "installed.py"
               for n, line in enumerate(f.read_text().splitlines(), 1)
               if "EngineNotInstalledError(" in line]
    assert spelled == []


def test_a_broken_engine_import_names_the_engine_as_the_table_does(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from localrun.backends.base import LoadRequest
    from localrun.backends.llama_cpp.session import LlamaCppSession

    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # `import llama_cpp` raises ImportError
    with pytest.raises(EngineNotInstalledError) as e:
        LlamaCppSession(LoadRequest("never-read.gguf", "gguf"))
    assert e.value.backend == BACKENDS["llama.cpp"].title
    assert e.value.hint == install_hint("llama.cpp") == pip_install("llama-cpp")
    assert str(e.value).startswith("The llama.cpp (llama-cpp-python) engine cannot be used: ")
