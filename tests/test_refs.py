from __future__ import annotations

from pathlib import Path

import pytest

from localrun.errors import UnknownModelError
from localrun.naming import catalog
from localrun.naming.refs import parse_ref


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
    # The OpenVINO org's 0.5B IR was never seen and answered 404 (catalog-check.md):
    # rejected, and replaced by the community IR an established project names.
    assert "OpenVINO/Qwen2.5-0.5B-Instruct-int4-ov" in catalog.rejected()
    assert not set(catalog.rejected()) & {v.repo for e in entries.values() for v in e.variants}
    ov = q.variants_for("openvino")
    assert [v.repo for v in ov] == ["llmware/qwen2.5-0.5b-instruct-ov"] and ov[0].verified


def test_catalog_corrections_from_the_check() -> None:
    """The entries catalog-check.md found doubtful, plausible or incomplete."""
    def variants(alias: str, fmt: str) -> list[catalog.Variant]:
        e = catalog.lookup(alias)
        assert e is not None
        return e.variants_for(fmt)

    # deepseek-r1:1.5b: the ONNX repo bundles the 1.5B and the 7B; the card's folder.
    (ds,) = variants("deepseek-r1:1.5b", "onnx")
    assert ds.subfolder == "deepseek-r1-distill-qwen-1.5B/cpu_and_mobile/" \
        "cpu-int4-rtn-block-32-acc-level-4" and ds.verified
    (ds7,) = variants("deepseek-r1:7b", "onnx")
    assert ds7.subfolder and ds7.subfolder.startswith("deepseek-r1-distill-qwen-7B/")
    assert not ds7.verified  # plausible only
    # turboderp's main holds no weights: every EXL entry names its branch.
    exl = [v for e in catalog.entries().values() for v in e.variants
           if v.format in ("exl2", "exl3")]
    assert exl and all(v.branch for v in exl), [v.repo for v in exl if not v.branch]
    # gemma3:4b on OpenVINO: the plain int4 IR for CPU/GPU first, the NPU-tuned one kept.
    assert [v.repo for v in variants("gemma3:4b", "openvino")] == [
        "OpenVINO/gemma-3-4b-it-int4-ov", "OpenVINO/gemma-3-4b-it-int4-cw-ov"]
    # Plausible only: demoted, or kept behind confirmed siblings.
    assert not variants("qwen2.5:7b", "exl2")[0].verified
    mlx = variants("smollm2:135m", "mlx")
    assert mlx[0].repo == "mlx-community/SmolLM2-135M-Instruct-8bit" and mlx[0].verified
    assert not next(v for v in mlx if v.repo.endswith("-4bit")).verified
    # Stronger than marked before.
    assert variants("phi4-mini", "mlx")[0].verified
    assert variants("mistral:7b", "exl2")[0].verified
    # Weaker: a file seen only in unrelated code carries its own mark.
    q = variants("qwen2.5:0.5b", "gguf")[0]
    assert q.file_evidence == "C" and q.verified
