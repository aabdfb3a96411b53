"""A machine's hardware as data: :class:`HardwareProfile` and its parts, to and from
JSON (``localrun doctor --json``, ``localrun plan --hardware PROFILE.json``), and the
example machines shipped in ``profiles/`` (``localrun plan --hardware mac-m2-16gb``)."""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from os import PathLike
from pathlib import Path
from typing import Any, Literal

SCHEMA_VERSION = 1
GiB = 1024**3
MiB = 1024**2

GPUVendor = Literal["nvidia", "amd", "intel", "apple", "other"]


@dataclass(frozen=True)
class CPUInfo:
    vendor: str | None = None  # "GenuineIntel", "AuthenticAMD", "ARM", "Apple"
    model: str | None = None
    arch: str = ""  # "x86_64", "arm64", "aarch64"
    physical_cores: int | None = None
    logical_cores: int | None = None
    usable_cores: int | None = None  # affinity and cgroup quota applied
    flags: tuple[str, ...] = ()

    @property
    def is_intel(self) -> bool:
        return (self.vendor or "").lower() in ("genuineintel", "intel")

    @property
    def is_amd(self) -> bool:
        return (self.vendor or "").lower() in ("authenticamd", "amd")


@dataclass(frozen=True)
class GPUInfo:
    vendor: GPUVendor
    name: str
    index: int = 0  # position among GPUs of the same vendor
    memory_total: int | None = None  # bytes; None when unknown or unified
    memory_free: int | None = None
    compute_capability: str | None = None  # NVIDIA, "8.6"
    driver: str | None = None  # NVIDIA driver version or the Linux kernel driver
    integrated: bool = False
    arch_target: str | None = None  # AMD gfx target, e.g. "gfx1100"
    pci_id: str | None = None  # "0x8086:0x56a0"
    source: str = ""  # nvml, nvidia-smi, kfd, sysfs, openvino, profile

    @property
    def cc(self) -> tuple[int, int] | None:
        if not self.compute_capability:
            return None
        m = re.match(r"(\d+)\.(\d+)", self.compute_capability)
        return (int(m.group(1)), int(m.group(2))) if m else None


@dataclass(frozen=True)
class NPUInfo:
    vendor: str
    name: str
    driver: str | None = None
    pci_id: str | None = None
    source: str = ""


@dataclass(frozen=True)
class AppleInfo:
    chip: str  # "Apple M2 Pro"
    unified_memory: int  # bytes
    performance_cores: int | None = None
    efficiency_cores: int | None = None
    rosetta: bool = False  # this Python runs translated (x86_64 on arm64)


@dataclass(frozen=True)
class HardwareProfile:
    os: str  # "Linux", "Darwin", "Windows"
    os_version: str
    arch: str
    cpu: CPUInfo
    ram_total: int | None = None  # bytes, after the container limit
    ram_available: int | None = None
    ram_limit: int | None = None  # the cgroup limit when one applies
    gpus: tuple[GPUInfo, ...] = ()
    npus: tuple[NPUInfo, ...] = ()
    apple: AppleInfo | None = None
    notes: tuple[str, ...] = ()  # failed probes and things worth knowing
    name: str | None = None  # a label for described (not detected) machines

    # -- views -------------------------------------------------------------------------
    def gpus_of(self, vendor: GPUVendor) -> tuple[GPUInfo, ...]:
        return tuple(g for g in self.gpus if g.vendor == vendor)

    @property
    def nvidia_gpus(self) -> tuple[GPUInfo, ...]:
        return self.gpus_of("nvidia")

    @property
    def is_apple_silicon(self) -> bool:
        return self.apple is not None

    # -- JSON --------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        return {"schema": SCHEMA_VERSION, **d}

    def to_json(self, *, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> HardwareProfile:
        """Build a profile from ``to_dict()`` output (or a hand-written description).

        Unknown keys are ignored; missing ones take their defaults.
        """
        from localrun.errors import LocalrunError

        try:
            d = dict(data)
            d.pop("schema", None)
            cpu = _build(CPUInfo, d.pop("cpu", None) or {})
            gpus = tuple(_build(GPUInfo, g) for g in d.pop("gpus", None) or ())
            npus = tuple(_build(NPUInfo, n) for n in d.pop("npus", None) or ())
            apple_d = d.pop("apple", None)
            apple = _build(AppleInfo, apple_d) if apple_d else None
            d["notes"] = tuple(d.get("notes") or ())
            d.setdefault("os", "Linux")
            d.setdefault("os_version", "")
            d.setdefault("arch", cpu.arch)
            profile: HardwareProfile = _build(
                cls, {**d, "cpu": cpu, "gpus": gpus, "npus": npus, "apple": apple})
            return profile
        except (TypeError, ValueError, AttributeError) as e:
            raise LocalrunError(
                f"Not a hardware profile: {e}",
                hint="write one with: localrun doctor --json > profile.json",
            ) from e

    @classmethod
    def from_json(cls, text: str, *, source: str = "the text") -> HardwareProfile:
        from localrun.errors import LocalrunError

        try:
            data = json.loads(text)
        except (ValueError, RecursionError) as e:  # also: nested too deep, a huge integer
            raise LocalrunError(f"Not a hardware profile: {source} is not valid JSON "
                                f"({str(e)[:120]})",
                                hint="write one with: localrun doctor --json > profile.json"
                                ) from e
        if not isinstance(data, dict):
            raise LocalrunError(f"Not a hardware profile: {source} must be a JSON object",
                                hint="write one with: localrun doctor --json > profile.json")
        return cls.from_dict(data)

    @classmethod
    def load(cls, path: str | PathLike[str]) -> HardwareProfile:
        from localrun.errors import LocalrunError

        p = Path(path).expanduser()
        try:
            text = p.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:  # a model file, an image: not what doctor writes
            raise LocalrunError(
                f"Not a hardware profile: {p} is not text (byte 0x{e.object[e.start]:02x} at "
                f"offset {e.start} is not UTF-8); a profile is the JSON `localrun doctor "
                "--json` prints", hint="write one with: localrun doctor --json > profile.json, "
                "then pass --hardware profile.json") from None
        except OSError as e:
            raise LocalrunError(
                f"Cannot read the hardware profile {p}: {e.strerror or e}",
                hint="pass a profile name (" + ", ".join(profile_names()) + ") or write one "
                "with: localrun doctor --json > profile.json") from e
        return cls.from_json(text, source=str(p))

    @classmethod
    def find(cls, name_or_path: str) -> HardwareProfile:
        """A profile by the name of one shipped with localrun (``mac-m2-16gb``, see
        :func:`profile_names`) or by the path of a JSON file."""
        from localrun.errors import LocalrunError

        p = Path(name_or_path).expanduser()
        try:
            found = p.exists()
        except (OSError, ValueError):  # too long, a NUL: no such file
            found = False
        if found:
            return cls.load(p)
        shipped = PROFILES / f"{name_or_path.removesuffix('.json')}.json"
        if "/" not in name_or_path and shipped.is_file():
            return cls.load(shipped)
        raise LocalrunError(
            f"No hardware profile {name_or_path!r}: no such file, nor a profile name",
            hint="profile names: " + ", ".join(profile_names()) + "; or write one for a "
            "machine with: localrun doctor --json > profile.json")


#: Example machines shipped with localrun, one JSON file each (``plan --hardware NAME``).
PROFILES = Path(__file__).parent / "profiles"


def profile_names() -> list[str]:
    """The names ``--hardware`` accepts besides a file path."""
    try:
        return sorted(f.name.removesuffix(".json") for f in PROFILES.iterdir()
                      if f.name.endswith(".json"))
    except OSError:
        return []


def _build(cls: type[Any], data: Mapping[str, Any]) -> Any:
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs = {k: v for k, v in data.items() if k in names}
    for k in ("flags",):
        if k in kwargs and kwargs[k] is not None:
            kwargs[k] = tuple(kwargs[k])
    return cls(**kwargs)
