"""Which engine runs which format: the table, and the check that refuses mismatches.

"native": the engine has optimized kernels for the format. "loads": it works, but it
is not the engine's fast path; localrun requires an explicit opt-in and warns.
Anything absent is "no": refuse, and say which engine runs it and how to get the
variant the chosen engine wants. The check runs before any engine is imported.

Every row is an engine's own fact (its ``formats``, ``loads`` and ``conditions`` in
``backends/<engine>/facts.py``); this module only collects and reads them. The formats
themselves, and their titles, are :mod:`localrun.formats.names`'.
"""

from __future__ import annotations

from localrun.backends import BACKENDS
from localrun.backends.spec import Condition, Support
from localrun.errors import FormatMismatchError
from localrun.formats.names import FORMAT_TITLES, NOT_SERVED, title

__all__ = ["COMPAT", "CONDITIONS", "CONVERT", "FORMAT_TITLES", "NATIVE_FORMAT", "NOT_SERVED",
           "Condition", "Support", "check", "native_backends", "refusal_hint", "support",
           "title"]

#: format -> {backend: support}, for every format localrun knows; a backend not listed
#: cannot load the format.
COMPAT: dict[str, dict[str, Support]] = {
    fmt: {name: "native" if fmt in spec.formats else "loads"
          for name, spec in BACKENDS.items() if fmt in spec.formats or fmt in spec.loads}
    for fmt in FORMAT_TITLES}

#: (format, backend) -> the engine versions / architectures the pairing depends on.
CONDITIONS: dict[tuple[str, str], Condition] = {
    (fmt, name): cond for name, spec in BACKENDS.items()
    for fmt, cond in spec.conditions.items()}

#: The format each backend wants: what to ask for instead of a mismatching file.
NATIVE_FORMAT: dict[str, str] = {b: spec.formats[0] for b, spec in BACKENDS.items()}

#: How to turn a model into each backend's format yourself (one command, for hints).
CONVERT: dict[str, str] = {b: spec.convert for b, spec in BACKENDS.items()}


def support(format: str, backend: str, *, architecture: str | None = None,
            quantization: str | None = None) -> Support:
    """The table's verdict, narrowed by the pairing's conditions when the facts are known."""
    level = COMPAT.get(format, {}).get(backend, "no")
    cond = CONDITIONS.get((format, backend))
    if level != "no" and cond is not None:
        if architecture and cond.architectures and architecture not in cond.architectures:
            return "no"
        if quantization and cond.quantizations and quantization not in cond.quantizations:
            return "no"
    return level


def native_backends(format: str) -> list[str]:
    return [b for b, s in COMPAT.get(format, {}).items() if s == "native"]


def check(
    format: str,
    backend: str,
    *,
    model: str,
    allow_unoptimized: bool = False,
    architecture: str | None = None,
    quantization: str | None = None,
) -> Support:
    """Return the support level, or raise FormatMismatchError unless ``backend`` may run it.

    Every refusal names the format, the engine, the engines that run it natively and
    the exact command or argument that fixes it. Happens before any engine import.
    """
    level = support(format, backend, architecture=architecture, quantization=quantization)
    if level == "native" or (level == "loads" and allow_unoptimized):
        return level
    natives = native_backends(format)
    fmt = title(format)
    cond = CONDITIONS.get((format, backend))
    hint = refusal_hint(format, backend, model=model)
    if level == "loads":
        loads_msg = (f"{backend} can load {fmt} models but has no optimized kernels for them "
                     f"(engines that run {fmt} natively: {', '.join(natives) or 'none'})")
        if cond is not None:
            loads_msg += f"; {backend} + {fmt}: {cond.note}"
        hint += "; or accept the slow path with --allow-unoptimized (allow_unoptimized=True)"
        raise FormatMismatchError(format=fmt, backend=backend, native_backends=natives,
                                  hint=hint, message=loads_msg)
    message: str | None = None
    if COMPAT.get(format, {}).get(backend, "no") != "no" and cond is not None:
        facts = ", ".join(f for f in (architecture, quantization) if f)
        message = (f"{backend} cannot run this {fmt} model ({facts}): {cond.note} "
                   f"(engines that run {fmt} natively: {', '.join(natives) or 'none'})")
    elif not natives:
        message = (f"{backend} cannot run {fmt} models and no engine localrun drives runs "
                   f"them natively: {NOT_SERVED.get(format, 'localrun does not serve it')}")
    raise FormatMismatchError(format=fmt, backend=backend, native_backends=natives,
                              hint=hint, message=message)


def refusal_hint(format: str, backend: str, *, model: str) -> str:
    """The ways out of a mismatch, as commands and arguments."""
    natives = native_backends(format)
    want = title(NATIVE_FORMAT.get(backend, ""))
    fixes = []
    if natives:
        fixes.append(f"run it with {natives[0]}: localrun run {model} --backend {natives[0]} "
                     f"(Python: backend=\"{natives[0]}\")")
    if backend in NATIVE_FORMAT:
        fixes.append(f"or, for {backend}, use the {want} variant of this model: "
                     f"localrun plan <model name> --backend {backend} shows which one; "
                     f"to convert it yourself: {CONVERT[backend]}")
    return "; ".join(fixes)
