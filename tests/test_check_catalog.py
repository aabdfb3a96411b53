"""scripts/check_catalog.py: its checks, against the stand-in Hub (tests/hubserver.py)."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from localrun.naming.catalog import CatalogEntry, Variant
from tests.hubserver import BASE, HubFixture, start

ROOT = Path(__file__).resolve().parent.parent
PHI = "microsoft/Phi-3.5-mini-instruct-onnx"
PHI_CPU = "cpu_and_mobile/cpu-int4-awq-block-128-acc-level-4"


def _script() -> ModuleType:
    """scripts/ is no package: load the script as a module (once)."""
    if "check_catalog" not in sys.modules:
        spec = importlib.util.spec_from_file_location("check_catalog",
                                                      ROOT / "scripts" / "check_catalog.py")
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules["check_catalog"] = mod  # its dataclasses look their module up
        spec.loader.exec_module(mod)
    return sys.modules["check_catalog"]


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[HubFixture]:
    yield from start(monkeypatch, tmp_path)


def _entry(alias: str, base: str, *variants: Variant, gated: bool = False) -> CatalogEntry:
    return CatalogEntry(alias=alias, base=base, license="", gated=gated, names=(),
                        variants=variants)


def test_entries_that_match_the_hub_have_no_findings(fake: HubFixture) -> None:
    from huggingface_hub import HfApi

    ok = _entry("good", BASE,
                Variant(f"{BASE}-GGUF", "gguf", "V", file="qwen2.5-0.5b-instruct-q4_k_m.gguf"),
                Variant("bartowski/Qwen2.5-7B-Instruct-exl2", "exl2", "V", branch="6_5"),
                Variant("turboderp/Llama-3.2-1B-Instruct-exl2", "exl2", "V", branch="4.0bpw"),
                Variant(PHI, "onnx", "R", subfolder=PHI_CPU),
                Variant("OpenVINO/Qwen2.5-0.5B-Instruct-int4-ov", "openvino", "R"),
                Variant("mlx-community/Qwen2.5-0.5B-Instruct-4bit", "mlx", "R"))
    assert _script().check(HfApi(), [ok]) == []


def test_each_kind_of_stale_entry_is_named(fake: HubFixture) -> None:
    from huggingface_hub import HfApi

    ov = fake.hub.repos["OpenVINO/Qwen2.5-0.5B-Instruct-int8-ov"].branches["main"]
    del ov["openvino_detokenizer.xml"]
    bad = _entry("bad", "nobody/Missing-1B",
                 Variant("ghost/Missing-1B-GGUF", "gguf", "V"),
                 Variant(f"{BASE}-GGUF", "gguf", "V", file="qwen2.5-0.5b-instruct-q4_k_l.gguf"),
                 Variant("turboderp/Llama-3.2-1B-Instruct-exl2", "exl2", "V", branch="5.0bpw"),
                 Variant("turboderp/Llama-3.2-1B-Instruct-exl2", "exl2", "V"),
                 Variant(PHI, "onnx", "R", subfolder="cpu_and_mobile/cpu-int4-rtn-block-32"),
                 Variant("OpenVINO/Qwen2.5-0.5B-Instruct-int8-ov", "openvino", "R"),
                 Variant("gatedorg/Gated-1B-GGUF", "gguf", "R"))
    found = {(f.format, f.repo, f.problem, f.fatal) for f in _script().check(HfApi(), [bad])}
    assert found == {
        ("base", "nobody/Missing-1B", "repo not found (404, or private)", True),
        ("gguf", "ghost/Missing-1B-GGUF", "repo not found (404, or private)", True),
        ("gguf", f"{BASE}-GGUF", "file 'qwen2.5-0.5b-instruct-q4_k_l.gguf' not found", True),
        ("exl2", "turboderp/Llama-3.2-1B-Instruct-exl2@5.0bpw",
         "branch '5.0bpw' not found", True),
        ("exl2", "turboderp/Llama-3.2-1B-Instruct-exl2",
         "no .safetensors weights on main, and the entry names no branch", True),
        ("onnx", f"{PHI}/cpu_and_mobile/cpu-int4-rtn-block-32",
         "subfolder 'cpu_and_mobile/cpu-int4-rtn-block-32' not found", True),
        ("openvino", "OpenVINO/Qwen2.5-0.5B-Instruct-int8-ov",
         "OpenVINO GenAI cannot load it: lacks openvino_detokenizer.xml", True),
    }


def test_main_checks_the_real_catalog_and_exits_1(fake: HubFixture,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    rc = _script().main(["qwen2.5:0.5b", "deepseek-r1:1.5b"])
    out, err = capsys.readouterr()
    assert rc == 1
    # qwen2.5:0.5b's official GGUF and its 4-bit MLX are on the stand-in Hub; the rest not.
    assert "Qwen/Qwen2.5-0.5B-Instruct-GGUF" not in out
    assert "MISSING qwen2.5:0.5b" in out and "llmware/qwen2.5-0.5b-instruct-ov" in out
    assert "deepseek-r1:1.5b" in out and "entries checked" in err
    assert _script().main(["no-such-alias"]) == 2


def test_main_says_when_the_hub_is_unreachable(fake: HubFixture,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    from huggingface_hub import HfApi

    rc = _script().main(["qwen2.5:0.5b"], api=HfApi(endpoint="http://127.0.0.1:9"))
    assert rc == 2 and "cannot be reached" in capsys.readouterr().err
