"""What is installed of an engine, read from its facts and the installed distributions'
metadata, never by importing the engine; and the error, with its install command, for
one that is missing. An engine's own modules ask here about themselves (their ``SPEC``);
everyone else asks :mod:`localrun.backends` by name."""

from __future__ import annotations

from importlib import metadata

from localrun.backends.spec import BackendSpec, Build
from localrun.errors import EngineNotInstalledError
from localrun.install import pip_install


def installed_build(spec: BackendSpec) -> Build | None:
    """The GPU build installed in place of the engine's plain distribution, if any."""
    for build in spec.builds:
        try:
            metadata.version(build.dist)
        except metadata.PackageNotFoundError:
            continue
        return build
    return None


def installed_version(spec: BackendSpec) -> str | None:
    """The installed version of an engine of this environment (``home`` "here"): its main
    distribution's, read from metadata only; None when one of its distributions is
    missing.

    A GPU build stands in for the plain distribution and is named as a local version
    label, as torch names its builds: ``0.8.0+cuda`` for onnxruntime-genai-cuda 0.8.0.
    """
    versions = []
    build = installed_build(spec)
    for i, dist in enumerate(spec.dists):
        if i == 0 and build is not None:
            versions.append(f"{metadata.version(build.dist)}+{build.device}")
            continue
        try:
            versions.append(metadata.version(dist))
        except metadata.PackageNotFoundError:
            return None
    return versions[0] if versions else None


def pip_hint(spec: BackendSpec, device: str = "cpu") -> str:
    """The command that installs an engine of this environment: its GPU build's extra for
    ``device`` where it has one ("cuda:0" -> onnx-cuda); the ``pip install`` itself comes
    from :func:`localrun.install.pip_install` (a clone or a wheel)."""
    if spec.extra is None:
        return f"nothing to install: the {spec.title} runs the model"
    kind = device.split(":")[0]
    extra = next((b.extra for b in spec.builds if b.device == kind), spec.extra)
    return pip_install(extra)


def missing(spec: BackendSpec, *, reason: str | None = None, hint: str | None = None
            ) -> EngineNotInstalledError:
    """The error for an engine that is missing (or fails to import), with the command
    that installs it (``hint``, else :func:`pip_hint`)."""
    error = EngineNotInstalledError(spec.title, spec.extra or spec.name, reason=reason)
    error.hint = hint if hint is not None else pip_hint(spec)
    return error
