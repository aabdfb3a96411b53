"""Check every entry of localrun's alias catalog against the Hugging Face Hub.

For maintainers, before a release (it needs the Hub; ``HF_ENDPOINT`` points it at another
server, ``HF_TOKEN`` lets it see gated repos' files):

    python scripts/check_catalog.py                      # every alias
    python scripts/check_catalog.py qwen2.5:0.5b gemma3:4b
    python scripts/check_catalog.py --json               # one JSON object per finding

For each alias it asks the Hub (``HfApi.model_info``, one call per repo and branch) whether
the base repo and every variant exist, and whether what the entry names is there: the GGUF
``file``, the EXL ``branch``, the ONNX ``subfolder`` (with its genai_config.json), and
weights the format's engine can load (an OpenVINO IR with its tokenizer IRs, …). It
prints one line per problem and exits 1 if there is any, 2 if the Hub cannot be reached,
0 when every entry checks out. A problem here is not fatal for users (a stale entry is
passed over at pull time, with a line saying so), but it costs them a Hub search.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from localrun.naming import catalog
from localrun.naming.catalog import CatalogEntry, Variant


@dataclass(frozen=True)
class Finding:
    """One thing the Hub does not have (or refuses) for a catalog entry."""

    alias: str
    format: str  # "base" for the base repo
    repo: str
    problem: str
    fatal: bool = True  # False: worth knowing (a gated repo), not a broken entry

    def line(self) -> str:
        mark = "MISSING" if self.fatal else "note"
        return f"{mark:7} {self.alias:18} {self.format:8} {self.repo}: {self.problem}"


class Unreachable(Exception):
    """The Hub did not answer at all (no network, wrong HF_ENDPOINT)."""


def _info(api: Any, repo: str, revision: str | None) -> tuple[Any | None, str | None]:
    """(model info, None) or (None, why): not found, no such branch, gated."""
    import httpx2
    from huggingface_hub.errors import (
        GatedRepoError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        return api.model_info(repo, revision=revision), None
    except GatedRepoError:
        return None, "gated"
    except RevisionNotFoundError:
        return None, f"branch {revision!r} not found"
    except RepositoryNotFoundError:
        return None, "repo not found (404, or private)"
    except (httpx2.ConnectError, httpx2.TimeoutException) as e:
        raise Unreachable(f"the Hub cannot be reached ({type(e).__name__})") from e


def _files(info: Any) -> set[str]:
    return {s.rfilename for s in (info.siblings or [])}


def weights_problem(fmt: str, files: set[str], subfolder: str | None) -> str | None:
    """Why the files hold nothing ``fmt``'s engine can load, or None."""
    from localrun.hub import GGUF_IGNORE, ov_missing

    prefix = f"{subfolder}/" if subfolder else ""
    mine = {f[len(prefix):] for f in files if f.startswith(prefix)}
    if fmt == "gguf":
        if not any(f.lower().endswith(".gguf") and not GGUF_IGNORE.search(f) for f in mine):
            return "no .gguf model file"
    elif fmt == "onnx":
        if not any(f.rsplit("/", 1)[-1] == "genai_config.json" for f in mine):
            return "no genai_config.json (not an ONNX Runtime GenAI model)"
    elif fmt == "openvino":
        missing = ov_missing(mine)
        if missing:
            return "OpenVINO GenAI cannot load it: lacks " + ", ".join(missing)
    elif fmt in ("mlx", "exl2", "exl3") and not any(f.endswith(".safetensors") for f in mine):
        return "no .safetensors weights"
    return None


def check_variant(api: Any, alias: str, v: Variant) -> list[Finding]:
    out: list[Finding] = []

    def found(problem: str, fatal: bool = True) -> None:
        out.append(Finding(alias, v.format, v.where, problem, fatal))

    info, why = _info(api, v.repo, v.branch)
    if info is None:
        if why == "gated":
            found("gated: files not checked (set HF_TOKEN with access)", fatal=False)
        else:
            found(why or "not found")
        return out
    files = _files(info)
    if v.file and v.file not in files:
        found(f"file {v.file!r} not found")
    if v.subfolder and not any(f.startswith(v.subfolder + "/") for f in files):
        found(f"subfolder {v.subfolder!r} not found")
        return out
    problem = weights_problem(v.format, files, v.subfolder)
    if problem:
        if v.format in ("exl2", "exl3") and not v.branch:
            problem += " on main, and the entry names no branch"
        found(problem)
    return out


def check_entry(api: Any, entry: CatalogEntry) -> list[Finding]:
    out: list[Finding] = []
    info, why = _info(api, entry.base, None)
    if info is None and why != "gated":
        out.append(Finding(entry.alias, "base", entry.base, why or "not found"))
    elif info is not None and bool(info.gated) != entry.gated:
        out.append(Finding(entry.alias, "base", entry.base,
                           f"the catalog says gated={entry.gated}, the Hub says "
                           f"gated={info.gated!r}", fatal=False))
    for v in entry.variants:
        out.extend(check_variant(api, entry.alias, v))
    return out


def check(api: Any, entries: Iterable[CatalogEntry]) -> list[Finding]:
    """Every problem of ``entries``; raises Unreachable when the Hub does not answer."""
    return [f for e in entries for f in check_entry(api, e)]


def main(argv: Sequence[str] | None = None, api: Any = None) -> int:
    ap = argparse.ArgumentParser(prog="check_catalog.py", description=__doc__.split("\n")[0])
    ap.add_argument("aliases", nargs="*", help="aliases to check (default: all)")
    ap.add_argument("--json", action="store_true", help="one JSON object per finding")
    args = ap.parse_args(argv)
    table = catalog.entries()
    unknown = [a for a in args.aliases if catalog.lookup(a) is None]
    if unknown:
        print(f"error: not in the catalog: {', '.join(unknown)} "
              f"(aliases: {', '.join(sorted(table))})", file=sys.stderr)
        return 2
    chosen = [catalog.lookup(a) for a in args.aliases] if args.aliases else list(table.values())
    if api is None:
        from huggingface_hub import HfApi

        api = HfApi()
    try:
        findings = check(api, [e for e in chosen if e is not None])
    except Unreachable as e:
        print(f"error: {e}; check the network or HF_ENDPOINT", file=sys.stderr)
        return 2
    for f in findings:
        print(json.dumps(asdict(f)) if args.json else f.line())
    n = sum(len(e.variants) + 1 for e in chosen if e is not None)
    bad = [f for f in findings if f.fatal]
    if not args.json:
        print(f"{n} entries checked: {len(bad)} problem(s), "
              f"{len(findings) - len(bad)} note(s)", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
