"""How this localrun was installed, and the one command that adds an extra to it.

The distribution is ``localrun-llm`` (the PyPI name ``localrun`` belongs to another
project); the import package and the command stay ``localrun``, as scikit-learn's stay
``sklearn``. Every ``pip install`` that localrun prints for itself comes from
:func:`pip_install`, so a hint cannot name another project's package: in a clone (an
editable install) it is ``pip install -e '.[EXTRA]'`` (the clone's path when the current
folder is elsewhere), otherwise ``pip install 'localrun-llm[EXTRA]'``.

Read from the distribution's metadata (PEP 610's ``direct_url.json``), never by importing
anything: standard library only, so ``localrun.errors`` can use it.
"""

from __future__ import annotations

import functools
import json
import shlex
from importlib import metadata
from pathlib import Path
from urllib.parse import unquote, urlsplit

#: This project's name on PyPI.
DISTRIBUTION = "localrun-llm"


@functools.lru_cache(maxsize=1)
def editable_root() -> Path | None:
    """The source folder of an editable install (``pip install -e``), or None.

    ``direct_url.json`` records where pip installed from; ``dir_info.editable`` is true
    for ``-e`` installs (PEP 610). A wheel from an index has no such file.
    """
    # Every copy of the metadata on sys.path, not the first: run from a clone's root,
    # `python -m localrun` also sees the clone's own localrun_llm.egg-info (setuptools
    # leaves it there), which has no direct_url.json.
    texts = [d.read_text("direct_url.json") for d in metadata.distributions(name=DISTRIBUTION)]
    text = next((t for t in texts if t), None)
    if text is None:
        return None
    try:
        info = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(info, dict) or not (info.get("dir_info") or {}).get("editable"):
        return None
    url = urlsplit(str(info.get("url", "")))
    if url.scheme != "file":
        return None
    root = Path(unquote(url.path))
    return root if (root / "pyproject.toml").is_file() else None


def pip_install(extra: str) -> str:
    """The command that adds ``extra`` to this installation of localrun."""
    root = editable_root()
    if root is None:
        return f"pip install {shlex.quote(f'{DISTRIBUTION}[{extra}]')}"
    try:
        here = Path.cwd().resolve() == root.resolve()
    except OSError:  # the current folder was removed
        here = False
    where = "." if here else str(root)
    return f"pip install -e {shlex.quote(f'{where}[{extra}]')}"
