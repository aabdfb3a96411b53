from __future__ import annotations

from pathlib import Path

import pytest

from localrun import catalog
from localrun.errors import UnknownModelError
from localrun.refs import parse_ref


@pytest.mark.parametrize(("text", "kind", "repo", "quant", "revision"), [
    ("Qwen/Qwen2.5-0.5B-Instruct-GGUF", "repo", "Qwen/Qwen2.5-0.5B-Instruct-GGUF", None, None),
    ("Qwen/Qwen2.5-0.5B-Instruct-GGUF:Q4_K_M", "repo", "Qwen/Qwen2.5-0.5B-Instruct-GGUF",
     "Q4_K_M", None),
    ("org/model-exl2:4.0bpw@dev", "repo", "org/model-exl2", "4.0bpw", "dev"),
    ("hf.co/org/m:int4", "repo", "org/m", "int4", None),
    ("https://huggingface.co/org/m/tree/6_5", "repo", "org/m", None, "6_5"),
])
def test_repo_refs(text: str, kind: str, repo: str, quant: str | None,
                   revision: str | None) -> None:
    r = parse_ref(text)
    assert (r.kind, r.repo, r.quant, r.revision) == (kind, repo, quant, revision)


def test_alias_and_quant() -> None:
    r = parse_ref("qwen2.5:0.5b")
    assert r.kind == "alias" and r.entry is not None
    assert r.entry.base == "Qwen/Qwen2.5-0.5B-Instruct"
    r = parse_ref("Qwen2.5:0.5B:Q8_0")
    assert (r.alias, r.quant) == ("qwen2.5:0.5b", "Q8_0")
    assert parse_ref("llama3.2:1b:4bit").quant == "4bit"


def test_default_path_and_stores(tmp_path: Path) -> None:
    assert parse_ref("smollm2:135m").kind == "default"
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF")
    assert parse_ref(str(f)).path == f
    assert parse_ref("ollama:qwen2.5:0.5b").alias == "qwen2.5:0.5b"
    assert parse_ref("lmstudio:pub/repo:Q4_K_M").repo == "pub/repo"


def test_unknown_names_suggest() -> None:
    with pytest.raises(UnknownModelError) as err:
        parse_ref("qwen2.5:0.5")
    assert "qwen2.5:0.5b" in err.value.suggestions
    with pytest.raises(UnknownModelError, match="no such file"):
        parse_ref("./missing.gguf")


def test_catalog_is_data_with_evidence() -> None:
    entries = catalog.entries()
    assert 15 <= len(entries) <= 30
    for e in entries.values():
        assert "/" in e.base
        for v in e.variants:
            assert v.evidence in ("V", "R", "C") and "/" in v.repo
    # Names the research marked as probably invented never appear.
    invented = {"microsoft/Phi-4-mini-instruct-GGUF", "meta-llama/Llama-3.2-1B-Instruct-GGUF",
                "Qwen/Qwen2.5-7B-Instruct-EXL2", "OpenVINO/Llama-3.2-1B-Instruct-int4-ov"}
    assert not invented & {v.repo for e in entries.values() for v in e.variants}
    q = catalog.lookup("qwen2.5:0.5b")
    assert q is not None
    gguf = q.variants_for("gguf")
    assert gguf[0].repo == "Qwen/Qwen2.5-0.5B-Instruct-GGUF" and gguf[0].verified
    ov = q.variants_for("openvino")
    assert ov and not ov[0].verified  # (C) evidence only
