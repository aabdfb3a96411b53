"""No module in localrun/ is over 600 lines unless it says why (issue 12).

A module that must stay long says so in its docstring, on a line containing
"over 600 lines because" followed by the reason.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import ROOT

LIMIT = 600
REASON = "over 600 lines because"


def oversized(root: Path = ROOT / "localrun", limit: int = LIMIT) -> list[str]:
    """Modules over ``limit`` lines whose docstring gives no reason, as "path: N lines"."""
    out = []
    for path in sorted(root.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        n = len(text.splitlines())
        if n <= limit:
            continue
        doc = ast.get_docstring(ast.parse(text, str(path))) or ""
        if not any(REASON in line for line in doc.splitlines()):
            out.append(f"{path.relative_to(root.parent)}: {n} lines")
    return out


def test_no_module_over_600_lines_without_a_reason() -> None:
    found = oversized()
    assert not found, (f"modules over {LIMIT} lines; split them by job, or say why at the "
                       f"top (a docstring line with {REASON!r}):\n  " + "\n  ".join(found))


def test_the_size_check_reads_docstrings(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    body = "x = 1\n" * 10
    (pkg / "long.py").write_text('"""Long."""\n' + body)
    (pkg / "excused.py").write_text(f'"""Long.\n\nIt is {REASON} it must be.\n"""\n' + body)
    (pkg / "short.py").write_text('"""Short."""\nx = 1\n')
    assert oversized(pkg, limit=5) == ["pkg/long.py: 11 lines"]
