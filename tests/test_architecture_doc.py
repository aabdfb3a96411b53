"""docs/architecture.md's module list is the package's modules, no more and no fewer (issue
25 item 8), and the docs a contributor reads point inside the repository.

The "## Modules" section is read in parts: "Top level", then one part per package, each
opened by a line that starts with the package in backticks (`` `hub/` — ... ``). Every
backticked name ending in ``.py`` in a part names a module relative to that part's
package (`` `driver/sequence.py` `` in "Top level" is ``localrun/driver/sequence.py``).
Every ``.py`` file under ``localrun/`` must be named, but a subpackage's ``__init__.py``
(named when it holds more than the package's docstring and re-exports)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "architecture.md"
PACKAGE = ROOT / "localrun"
PART = re.compile(r"^`([\w/]+/)`")
MODULE = re.compile(r"`([\w/]+\.py)`")


def documented(text: str) -> dict[str, int]:
    """Module paths (relative to localrun/) the Modules section names -> the doc line."""
    lines = text.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.strip() == "## Modules")
    out: dict[str, int] = {}
    package = ""
    for i in range(start + 1, len(lines)):
        line = lines[i]
        if line.startswith("## "):
            break
        if line.startswith("Top level"):
            package = ""
        elif m := PART.match(line):
            package = m.group(1)
        for name in MODULE.findall(line):
            out.setdefault(package + name, i + 1)
    return out


def modules() -> set[str]:
    return {p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py")
            if "__pycache__" not in p.parts}


def optional(path: str) -> bool:
    return path.endswith("/__init__.py")


def test_the_module_list_names_every_module_and_only_those() -> None:
    named = documented(DOC.read_text(encoding="utf-8"))
    assert len(named) > 80, "the Modules section was not read"
    stale = [f"localrun/{p} (docs/architecture.md line {n})" for p, n in sorted(named.items())
             if p not in modules()]
    left_out = sorted(f"localrun/{p}" for p in modules() - named.keys() if not optional(p))
    assert not stale, f"docs/architecture.md names modules that do not exist: {stale}"
    assert not left_out, f"docs/architecture.md leaves out: {left_out} (add a line each)"


def test_the_reader_is_parsed_as_documented() -> None:
    text = ("# x\n## Modules\nTop level\n- `api.py` — a; `driver/sequence.py` b\n\n"
            "`hub/` — c\n- `plans.py` d, `fit.py` e\n`backends/` — f\n"
            "- `exllama/jobs.py` g\n## Adding\n`late.py`\n")
    assert documented(text) == {"api.py": 4, "driver/sequence.py": 4, "hub/plans.py": 7,
                                "hub/fit.py": 7, "backends/exllama/jobs.py": 9}


def test_contributor_docs_point_inside_the_repository() -> None:
    """Every relative path a doc names (a link, or a `../` in backticks) is a file of this
    repository, not of the machine it was written on."""
    for doc in (DOC, ROOT / "CONTRIBUTING.md"):
        text = doc.read_text(encoding="utf-8")
        targets = re.findall(r"\]\(([^)#\s]+)", text) + re.findall(r"`(\.\./[^`\s]+)`", text)
        for target in (t for t in targets if "://" not in t):
            path = (doc.parent / target).resolve()
            assert path.is_relative_to(ROOT) and path.exists(), \
                f"{doc.relative_to(ROOT)} points at {target}, not a file of this repository"
    assert "](../CONTRIBUTING.md)" in DOC.read_text(encoding="utf-8")


def test_each_engine_is_one_folder_and_the_places_an_engine_touches_are_listed() -> None:
    """Issue 29: per engine, the doc names the one folder that holds it (every module the
    engine table names lives there), and "Adding an engine" lists the places besides."""
    from localrun.backends import BACKENDS

    text = DOC.read_text(encoding="utf-8")
    for name, spec in BACKENDS.items():
        modules = [m for m in (spec.module, spec.embedder) if m]
        folders = {m.split(".")[2] for m in modules}
        assert all(m.startswith("localrun.backends.") for m in modules), name
        assert len(folders) == 1, f"{name} lives in several folders: {folders}"
        (folder,) = folders
        assert (PACKAGE / "backends" / folder / "facts.py").is_file(), name
        assert f"\n- `{folder}/` — " in text, f"docs/architecture.md names no folder for {name}"
    adding = text[text.index("## Adding an engine"):]
    for place in ("backends/<engine>/facts.py", "backends/<engine>/session.py",
                  "spec.BackendName", "ENGINES", "pyproject.toml", "planning/selection.py",
                  "planning/hosts.py", "DEVICE_KINDS"):
        assert place in adding, f"'Adding an engine' does not name {place}"
