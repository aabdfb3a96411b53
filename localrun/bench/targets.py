"""What a benchmark runs: its configuration, and the (model, backend) pairs it names."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from localrun.bench.report import Skipped
from localrun.errors import BenchError

if TYPE_CHECKING:
    from localrun.formats.detect import DetectedModel


@dataclass(frozen=True)
class BenchConfig:
    models: tuple[str, ...] = ("smollm2:135m",)
    backend: str = "auto"  # "auto", "all", or a backend name
    prompt_tokens: tuple[int, ...] = (128, 512, 2048)
    gen_tokens: int = 128
    concurrency: tuple[int, ...] = (1, 4, 8)
    runs: int = 5
    warmup: int = 1
    shared_prefix: bool = False
    image: str | None = None  # --image FILE: an image request against the same text alone
    #: speculative modes compared at concurrency 1 (bench --speculative off,auto)
    speculative: tuple[str, ...] = ()
    bandwidth_bytes: int | None = None  # None: sized from the last-level cache
    exact: bool = False  # --exact: load(exact=True) (README, "Speed")

    def validate(self) -> None:
        def positive(name: str, values: Sequence[int], least: int = 1) -> None:
            if not values:
                raise BenchError(f"{name} needs at least one value")
            for v in values:
                if isinstance(v, bool) or not isinstance(v, int) or v < least:
                    raise BenchError(f"Invalid {name} value {v!r}: expected an integer >= "
                                     f"{least}")
        if not self.models:
            raise BenchError("No model to benchmark", hint="localrun bench smollm2:135m")
        positive("--prompt-tokens", self.prompt_tokens)
        positive("--gen-tokens", [self.gen_tokens])
        positive("--concurrency", self.concurrency)
        positive("--runs", [self.runs])
        positive("--warmup", [self.warmup], least=0)
        if self.image is not None:
            from localrun.images import read_image

            read_image(self.image, f"--image {self.image}")  # an ImageError names it


@dataclass(frozen=True)
class Target:
    reference: str
    detected: DetectedModel
    backend: str


def parse_int_list(text: str, flag: str) -> tuple[int, ...]:
    """'128,512, 2048' -> (128, 512, 2048); a bad item raises BenchError naming the flag."""
    out = []
    for part in text.split(","):
        part = part.strip()
        if not part.isdigit() or int(part) < 1:
            raise BenchError(f"Invalid {flag} value {part!r} in {text!r}",
                             hint=f"give positive integers separated by commas, e.g. "
                             f"{flag} 128,512")
        out.append(int(part))
    return tuple(dict.fromkeys(out))  # keep order, drop repeats


def locate(reference: str) -> DetectedModel:
    """A model reference (alias, file or folder) -> its detected format, no engine."""
    from localrun.formats.detect import detect
    from localrun.naming.refs import local_path
    from localrun.resolve import resolve_local

    path = local_path(reference)
    if path is None:  # resolve_local raises UnknownModelError with suggestions
        return detect(resolve_local(reference).path)
    return detect(path)


def plan_targets(models: Sequence[str], backend: str
                 ) -> tuple[list[Target], list[Skipped]]:
    """Which (model, backend) pairs to run. ``all``: every installed engine that runs
    the model's format natively; ``auto``: the engine localrun would pick."""
    from localrun.backends import (
        BACKENDS,
        canonical_backend,
        compat,
        install_hint,
        installed_backends,
    )
    from localrun.resolve import resolve_local

    targets: list[Target] = []
    skipped: list[Skipped] = []
    installed = installed_backends()
    for ref in models:
        found = locate(ref)
        if backend == "all":
            natives = [b for b in BACKENDS if compat.support(
                found.format, b, architecture=found.architecture,
                quantization=found.quantization) == "native"]
            usable = [b for b in natives if b in installed]
            for b in natives:
                if b not in installed:
                    skipped.append(Skipped(ref, b, f"engine not installed "
                                                    f"({install_hint(b)})"))
            if not natives:
                skipped.append(Skipped(ref, None, f"no engine runs "
                                       f"{compat.title(found.format)} natively"))
            targets += [Target(ref, found, b) for b in usable]
        else:
            name = backend if backend == "auto" else canonical_backend(backend)
            target = resolve_local(found.path, backend=name)
            targets.append(Target(ref, found, target.backend))
    return targets, skipped
