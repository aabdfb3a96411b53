"""Hardware detection: parsers on real-format samples, this machine, failures as notes, JSON."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from localrun import hardware as hw
from localrun.errors import LocalrunError
from localrun.hardware import HardwareProfile, detect_hardware

PROFILES = Path(__file__).parent / "profiles"

X86 = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 7763 64-Core Processor
physical id\t: 0
core id\t\t: 0
flags\t\t: fpu sse avx avx2 fma f16c avx512f avx512_vnni

processor\t: 1
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 7763 64-Core Processor
physical id\t: 0
core id\t\t: 0
flags\t\t: fpu sse avx avx2 fma f16c avx512f avx512_vnni

processor\t: 2
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 7763 64-Core Processor
physical id\t: 0
core id\t\t: 1
flags\t\t: fpu sse avx avx2 fma f16c avx512f avx512_vnni
"""

ARM = """processor\t: 0
BogoMIPS\t: 108.00
Features\t: fp asimd evtstrm crc32 cpuid asimddp
CPU implementer\t: 0x41
CPU part\t: 0xd0b

processor\t: 1
Features\t: fp asimd evtstrm crc32 cpuid asimddp
CPU implementer\t: 0x41

Model\t\t: Raspberry Pi 5 Model B Rev 1.0
"""


def test_parse_cpuinfo_x86() -> None:
    c = hw.parse_cpuinfo(X86, "x86_64")
    assert (c.vendor, c.model, c.physical_cores, c.logical_cores) == (
        "AuthenticAMD", "AMD EPYC 7763 64-Core Processor", 2, 3)
    assert c.is_amd and not c.is_intel
    assert {"avx2", "avx512f", "avx512_vnni"} <= set(c.flags) and "amx_tile" not in c.flags


def test_parse_cpuinfo_arm() -> None:
    c = hw.parse_cpuinfo(ARM, "aarch64")
    assert c.vendor == "ARM" and c.model == "Raspberry Pi 5 Model B Rev 1.0"
    assert {"neon", "asimd", "asimddp"} <= set(c.flags)


def test_parse_meminfo() -> None:
    total, avail = hw.parse_meminfo("MemTotal:  16384 kB\nMemFree: 100 kB\nMemAvailable: 8192 kB\n")
    assert (total, avail) == (16384 * 1024, 8192 * 1024)


def test_parse_nvidia_smi_with_na_values() -> None:
    out = ("0, GPU-1, NVIDIA GeForce RTX 4090, 8.9, 570.86, 24564, 23000\n"
           "1, GPU-2, NVIDIA GB10, 12.1, 580.1, [N/A], [N/A]\n")
    a, b = hw.parse_nvidia_smi(out)
    assert (a.name, a.compute_capability, a.memory_total, a.driver) == (
        "NVIDIA GeForce RTX 4090", "8.9", 24564 * 1024**2, "570.86")
    assert a.cc == (8, 9) and not a.integrated
    assert b.memory_total is None and b.integrated  # unified-memory part


def test_gfx_target_decoding() -> None:
    assert hw.gfx_target(110001) == "gfx1101"
    assert hw.gfx_target(90010) == "gfx90a"
    assert hw.gfx_target(90402) == "gfx942"


def _cpuinfo_by_hand(text: str) -> tuple[str | None, str | None, int, int | None]:
    """(vendor, model, logical CPUs, physical cores) read with plain string operations,
    independently of hw.parse_cpuinfo: what the tests compare detect_hardware() with."""
    blocks = [b for b in text.split("\n\n") if b.strip()]
    fields = [dict((k.strip(), v.strip()) for k, _, v in
                   (line.partition(":") for line in b.splitlines())) for b in blocks]
    cpus = [f for f in fields if "processor" in f]
    first = cpus[0] if cpus else {}
    # physical cores: distinct (physical id, core id) pairs (x86); ARM lists none
    cores = {(f.get("physical id", "0"), f["core id"]) for f in cpus if "core id" in f}
    model = first.get("model name") or next(
        (f["Model"] for f in fields if "Model" in f), None)
    return first.get("vendor_id"), model, len(cpus), len(cores) or None


def test_cpuinfo_by_hand_reads_the_samples() -> None:
    """Guard for the independent reader: right on the known samples above."""
    assert _cpuinfo_by_hand(X86) == ("AuthenticAMD", "AMD EPYC 7763 64-Core Processor", 3, 2)
    assert _cpuinfo_by_hand(ARM) == (None, "Raspberry Pi 5 Model B Rev 1.0", 2, None)


def test_this_machine_matches_proc_cpuinfo() -> None:
    if not Path("/proc/cpuinfo").exists():
        pytest.skip("no /proc/cpuinfo on this OS")
    vendor, model, logical, physical = _cpuinfo_by_hand(Path("/proc/cpuinfo").read_text())
    p = detect_hardware()
    assert (p.cpu.vendor, p.cpu.model) == (vendor, model)
    assert p.cpu.logical_cores == logical
    if physical is not None:
        assert p.cpu.physical_cores == physical
    # /proc/cpuinfo lists every CPU the kernel brought online; so does os.cpu_count()
    assert logical == os.cpu_count()
    meminfo = Path("/proc/meminfo").read_text().splitlines()
    total_kb = int(next(line.split()[1] for line in meminfo if line.startswith("MemTotal:")))
    assert p.ram_total == total_kb * 1024
    assert detect_hardware() is p  # cached per process


def test_cuda_without_gpu_is_not_a_gpu() -> None:
    p = detect_hardware()
    nvml_ok = not any("NVML unavailable" in n for n in p.notes)
    if nvml_ok and p.nvidia_gpus:
        pytest.skip("this machine has a working NVIDIA GPU")
    assert p.nvidia_gpus == ()
    assert any("NVIDIA" in n for n in p.notes), p.notes


def test_a_failing_probe_becomes_a_note(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(notes: object) -> list[object]:
        raise RuntimeError("driver exploded")

    from localrun.hardware import accelerators, host

    monkeypatch.setattr(accelerators, "probe_nvidia", boom)
    monkeypatch.setattr(host, "probe_cpu_linux", lambda arch, notes: 1 / 0)
    detect_hardware.cache_clear()
    try:
        p = detect_hardware()
    finally:
        detect_hardware.cache_clear()
    assert any("NVIDIA GPU probe failed: RuntimeError: driver exploded" in n for n in p.notes)
    if p.os == "Linux":
        assert any("CPU probe failed: ZeroDivisionError" in n for n in p.notes)
        assert p.cpu.model is None


def test_json_round_trip_for_this_machine_and_every_profile() -> None:
    p = detect_hardware()
    assert HardwareProfile.from_json(p.to_json()) == p
    for f in PROFILES.glob("*.json"):
        q = HardwareProfile.load(f)
        assert HardwareProfile.from_json(q.to_json()) == q, f.name


def test_bad_profile_files() -> None:
    with pytest.raises(LocalrunError, match="not valid JSON"):
        HardwareProfile.from_json("{")
    with pytest.raises(LocalrunError, match="Not a hardware profile"):
        HardwareProfile.from_json('{"gpus": [{"nope": 1}]}')
