"""Every third-party module localrun imports is a declared dependency.

The suite runs in the ``dev`` install, which pulls in far more than README command 1
(`pip install -e '.[llama-cpp]'`): a module that only arrives through an
engine's own dependencies (huggingface_hub came with mlx-lm -> transformers) passes
every other test and fails a user on the first `localrun plan`. This test reads the
imports from the source (ast), so it cannot be fooled by what the environment has.
scripts/ci_fresh_install.sh checks the same promise by installing command 1's extras
alone into a fresh venv.
"""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

try:
    import tomllib
except ImportError:  # Python 3.10: the dev extra installs tomli there
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "localrun"

#: Modules an engine brings, imported only inside the functions that load or query that
#: engine (checked below), never by ``import localrun`` or a command that does not use
#: the engine. Each comes with an extra, not with [project].dependencies.
ENGINE_MODULES: dict[str, str] = {
    "llama_cpp": "llama.cpp engine: extra llama-cpp (llama-cpp-python)",
    "mlx": "MLX engine: extra mlx (mlx)",
    "mlx_lm": "MLX engine: extra mlx (mlx-lm)",
    "openvino_genai": "OpenVINO GenAI engine: extra openvino (openvino-genai)",
    "openvino": "OpenVINO runtime, a dependency of openvino-genai; hardware/accelerators.py "
                "asks it for devices only when it is installed",
    "onnxruntime_genai": "ONNX Runtime GenAI engine: extra onnx (onnxruntime-genai and "
                         "its CUDA/DirectML builds)",
    "exllamav2": "ExLlamaV2 engine: extra exllamav2",
    "exllamav3": "ExLlamaV3 engine: extra exllamav3",
    "torch": "a dependency of the ExLlama engines (installed by the user for their CUDA)",
    "PIL": "Pillow: decodes images (localrun/images.py) only when a message carries one; "
           "in the extras of the engines that take images (llama-cpp, openvino) and serve",
    "tokenizers": "the tokenizers library: OpenVINO's vision path streams replies through "
                  "it where it decodes like the model's OpenVINO detokenizer; extra openvino",
    "numpy": "a dependency of openvino-genai, onnxruntime-genai and mlx; imported only in "
             "their backends to build arrays for them",
}

#: Modules of the ``serve`` extra: imported only inside localrun/server/, which nothing
#: imports but the ``serve`` command's function (tests/test_server_unit.py checks that
#: ``import localrun`` and ``localrun --help`` leave them out). Declared in that extra.
SERVE_MODULES: dict[str, str] = {
    "fastapi": "fastapi", "starlette": "starlette", "uvicorn": "uvicorn",
    "prometheus_client": "prometheus-client", "pydantic": "pydantic",
}


@dataclass(frozen=True)
class Import:
    module: str  # the top-level name: "huggingface_hub" for huggingface_hub.errors
    file: str
    line: int
    lazy: bool  # inside a function body (runs only when that function is called)
    type_checking: bool  # under `if TYPE_CHECKING:` (never runs)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _visit(node: ast.AST, file: str, lazy: bool, tc: bool, out: list[Import]) -> None:
    if isinstance(node, ast.Import):
        for alias in node.names:
            out.append(Import(alias.name.split(".")[0], file, node.lineno, lazy, tc))
        return
    if isinstance(node, ast.ImportFrom):
        if node.level == 0 and node.module:  # relative imports are localrun's own
            out.append(Import(node.module.split(".")[0], file, node.lineno, lazy, tc))
        return
    if isinstance(node, ast.If) and _is_type_checking(node.test):
        for stmt in node.body:
            _visit(stmt, file, lazy, True, out)
        for stmt in node.orelse:
            _visit(stmt, file, lazy, tc, out)
        return
    inner = lazy or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
    for child in ast.iter_child_nodes(node):
        _visit(child, file, inner, tc, out)


def third_party_imports(package: Path = PACKAGE) -> list[Import]:
    """Every import in ``package`` of a module outside the stdlib and localrun itself."""
    out: list[Import] = []
    for path in sorted(package.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        _visit(tree, str(path.relative_to(package.parent)), False, False, out)
    return [i for i in out
            if i.module not in sys.stdlib_module_names and i.module not in ("localrun",)]


def normalize(name: str) -> str:
    """PEP 503 normalized distribution name."""
    return re.sub(r"[-_.]+", "-", name).lower()


def declared_dependencies(pyproject: Path = ROOT / "pyproject.toml") -> set[str]:
    """The distribution names in [project].dependencies, normalized."""
    data = tomllib.loads(pyproject.read_text(encoding="utf-8"))
    names = set()
    for req in data["project"]["dependencies"]:
        m = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", req)
        assert m, f"unreadable requirement {req!r} in pyproject.toml"
        names.add(normalize(m.group(1)))
    return names


def test_every_runtime_import_is_a_declared_dependency() -> None:
    declared = declared_dependencies()
    dists = importlib.metadata.packages_distributions()
    where: dict[str, list[str]] = {}
    for imp in third_party_imports():
        if imp.module in SERVE_MODULES and imp.file.startswith("localrun/server/"):
            continue
        if imp.module not in ENGINE_MODULES and not imp.type_checking:
            where.setdefault(imp.module, []).append(f"{imp.file}:{imp.line}")
    assert "huggingface_hub" in where and "typer" in where  # the walk found the imports
    missing: list[str] = []
    for module, places in sorted(where.items()):
        owners = dists.get(module)
        if not owners:
            missing.append(f"{module} (imported at {places[0]}): no installed distribution "
                           "provides it; install the dev extra, or declare it")
        elif not declared & {normalize(d) for d in owners}:
            missing.append(f"{module} (imported at {places[0]}) comes from "
                           f"{', '.join(sorted(owners))}, which [project].dependencies lacks")
    assert not missing, "\n".join(missing)


def test_serve_modules_stay_in_the_server_package_and_its_extra() -> None:
    found = [i for i in third_party_imports() if i.module in SERVE_MODULES]
    assert found, "the walk found no import of the server's web stack"
    outside = [f"{i.file}:{i.line} imports {i.module}" for i in found
               if not i.file.startswith("localrun/server/")]
    assert not outside, "\n".join(outside)
    data = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    serve = {normalize(re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", r).group(1))  # type: ignore[union-attr]
             for r in data["project"]["optional-dependencies"]["serve"]}
    assert {normalize(d) for d in SERVE_MODULES.values()} <= serve


def test_engine_modules_are_imported_only_lazily() -> None:
    """The exemption above holds only while these imports stay inside functions."""
    eager = [f"{i.file}:{i.line} imports {i.module} at module level"
             for i in third_party_imports()
             if i.module in ENGINE_MODULES and not i.lazy and not i.type_checking]
    assert not eager, "\n".join(eager)


def test_the_walk_sees_what_it_must(tmp_path: Path) -> None:
    """The checks above cannot pass by reading nothing."""
    found = {(i.module, i.lazy) for i in third_party_imports()}
    assert ("huggingface_hub", False) in found  # localrun/hub/, at the top
    assert ("llama_cpp", True) in found and ("llama_cpp", False) not in found
    pkg = tmp_path / "localrun"
    pkg.mkdir()
    (pkg / "m.py").write_text(
        "import os\nimport yaml.constructor\nfrom typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    import rich\nelse:\n    import jinja2\n"
        "def f():\n    from llama_cpp import Llama\n    from . import sibling\n",
        encoding="utf-8")
    got = {(i.module, i.lazy, i.type_checking) for i in third_party_imports(pkg)}
    assert got == {("yaml", False, False), ("rich", False, True), ("jinja2", False, False),
                   ("llama_cpp", True, False)}


@pytest.mark.parametrize("req, name", [("typer>=0.12", "typer"),
                                       ("huggingface_hub[cli] >= 1.0", "huggingface-hub"),
                                       ("mlx[cpu]>=0.31; sys_platform == 'linux'", "mlx")])
def test_requirement_names_are_read(tmp_path: Path, req: str, name: str) -> None:
    p = tmp_path / "pyproject.toml"
    p.write_text(f'[project]\nname = "x"\ndependencies = ["{req}"]\n', encoding="utf-8")
    assert declared_dependencies(p) == {name}
