"""ONNX Runtime GenAI devices: localrun's device names, the one a genai_config.json names,
and the build (CPU, CUDA, DirectML distribution) a device needs."""

from __future__ import annotations

import re
from typing import Any

from localrun.errors import EngineUnavailableError, LocalrunError
from localrun.install import pip_install

#: localrun device names -> ONNX Runtime GenAI execution providers. ``cuda:1`` / ``dml:1``
#: pick a GPU by index (the provider option ``device_id``).
PROVIDERS: dict[str, str] = {"cpu": "cpu", "cuda": "cuda", "gpu": "cuda", "dml": "dml",
                             "directml": "dml"}
_DEVICE = re.compile(r"^([a-z]+)(?::(\d+))?$")


def parse_device(device: str) -> tuple[str, int | None]:
    """``(provider, GPU index or None)`` for a device string."""
    m = _DEVICE.match(device.strip().lower())
    provider = PROVIDERS.get(m.group(1)) if m else None
    if m is None or provider is None or (provider == "cpu" and m.group(2)):
        raise LocalrunError(f"Unknown device {device!r} for ONNX Runtime GenAI",
                            hint="use one of: cpu, cuda, cuda:N, dml, dml:N")
    return provider, int(m.group(2)) if m.group(2) else None


def config_device(genai_config: dict[str, Any]) -> str:
    """Where genai_config.json runs the model: its first execution provider (and the
    device_id it names), "cpu" when it names none."""
    model = genai_config.get("model")
    decoder = model.get("decoder") if isinstance(model, dict) else None
    session = decoder.get("session_options") if isinstance(decoder, dict) else None
    entries = session.get("provider_options") if isinstance(session, dict) else None
    for entry in entries if isinstance(entries, list) else []:
        if isinstance(entry, dict) and entry:
            name, options = next(iter(entry.items()))
            provider = PROVIDERS.get(str(name).lower(), str(name).lower())
            index = options.get("device_id") if isinstance(options, dict) else None
            return f"{provider}:{index}" if index not in (None, "") else provider
    return "cpu"


def require_build(provider: str, device: str) -> None:
    """Refuse a GPU provider the installed distribution was not built with (the engine's
    own error would say only that the provider failed), naming what to install."""
    if provider == "cpu":
        return
    from localrun.backends.installed import installed_build
    from localrun.backends.onnx.facts import SPEC as spec

    needed = next((b for b in spec.builds if b.device == provider), None)
    have = installed_build(spec)
    if needed is None or (have is not None and have.device == provider):
        return
    current = have.dist if have is not None else spec.dists[0]
    raise EngineUnavailableError(
        "ONNX Runtime GenAI",
        f"device {device} needs the {needed.dist} build, and {current} is installed"
        + (" (CPU only)" if have is None else ""),
        hint=f"pip uninstall -y {current} && {pip_install(needed.extra)}, "
        "or load with device='cpu'")
