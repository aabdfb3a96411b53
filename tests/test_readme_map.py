"""tests/README.md maps README claims to tests: every test it names must exist."""

from __future__ import annotations

import re
from pathlib import Path

TESTS = Path(__file__).resolve().parent
#: `tests/test_x.py::test_name` or `tests/test_x.py` (a whole file)
REF = re.compile(r"`(tests/[\w/]+\.py)(?:::(\w+))?`")


def test_every_test_named_in_the_map_exists() -> None:
    text = (TESTS / "README.md").read_text(encoding="utf-8")
    refs = REF.findall(text)
    assert len(refs) > 100  # the table was read
    missing = []
    for path, name in refs:
        file = TESTS.parent / path
        if not file.is_file():
            missing.append(path)
        elif name and not re.search(rf"^(?:async )?def {name}\(", file.read_text(
                encoding="utf-8"), re.M):
            missing.append(f"{path}::{name}")
    assert not missing, f"tests/README.md names tests that do not exist: {missing}"
