"""Hub discovery, quant choice, memory fit and downloads against a local fake Hub.

The real huggingface_hub client talks to tests/hubserver.py over 127.0.0.1; nothing
here touches the internet.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from localrun import hub, memory
from localrun.errors import (
    FormatMismatchError,
    HubNotFoundError,
    ModelGatedError,
    ModelTooLargeError,
    NoVariantError,
    OfflineMissingError,
)
from localrun.formats.gguf import read_gguf
from tests.hubserver import BASE, GATED_TOKEN, FakeFile, FakeRepo, HubFixture, start

GiB = 2**30
GGUF_REPO = f"{BASE}-GGUF"
Q4 = "qwen2.5-0.5b-instruct-q4_k_m.gguf"


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[HubFixture]:
    yield from start(monkeypatch, tmp_path)


def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def _served(fake: HubFixture, repo: str, path: str) -> bytes:
    data = fake.hub.repos[repo].branches["main"][path].data
    assert data is not None
    return data


def test_alias_to_repo_to_file(fake: HubFixture) -> None:
    plan = hub.plan_fetch("qwen2.5:0.5b", backend="llama.cpp", memory_budget_bytes=8 * GiB)
    assert (plan.repo, plan.quant, plan.format) == (GGUF_REPO, "Q4_K_M", "gguf")
    assert [f.path for f in plan.files] == [Q4]
    assert plan.fits and plan.files[0].sha256
    assert plan.memory.kv_known  # the GGUF header was read for the KV-cache size
    path = hub.fetch(plan)
    assert path.name == Q4 and path.is_file()
    assert read_gguf(path).quantization == "Q4_K_M"
    assert _sha(path) == plan.files[0].sha256


def test_base_repo_ranks_own_org_then_quantizers(fake: HubFixture) -> None:
    plan = hub.plan_fetch(BASE, backend="llama.cpp", memory_budget_bytes=8 * GiB)
    assert plan.repo == GGUF_REPO and plan.quant == "Q4_K_M"
    # An explicit repo of another publisher keeps its own files and naming.
    plan = hub.plan_fetch("bartowski/Qwen2.5-0.5B-Instruct-GGUF", backend="llama.cpp")
    assert [f.path for f in plan.files] == ["Qwen2.5-0.5B-Instruct-Q4_K_M.gguf"]


@pytest.mark.parametrize(
    ("ref", "backend", "repo", "quant", "revision"),
    [
        (f"{GGUF_REPO}:Q8_0", "llama.cpp", GGUF_REPO, "Q8_0", "main"),
        (f"{GGUF_REPO}:q6_k", "llama.cpp", GGUF_REPO, "Q6_K", "main"),
        ("qwen2.5:0.5b:Q5_K_M", "llama.cpp", GGUF_REPO, "Q5_K_M", "main"),
        (f"{BASE}:4bit", "mlx", "mlx-community/Qwen2.5-0.5B-Instruct-4bit", "4bit", "main"),
        (f"{BASE}:8bit", "mlx", "mlx-community/Qwen2.5-0.5B-Instruct-8bit", "8bit", "main"),
        (f"{BASE}:int4", "openvino", "OpenVINO/Qwen2.5-0.5B-Instruct-int4-ov", "int4", "main"),
        (f"{BASE}:int8", "openvino", "OpenVINO/Qwen2.5-0.5B-Instruct-int8-ov", "int8", "main"),
        ("turboderp/Llama-3.2-1B-Instruct-exl2:4.0bpw", "exllamav2",
         "turboderp/Llama-3.2-1B-Instruct-exl2", "4.0bpw", "4.0bpw"),
        ("bartowski/Qwen2.5-7B-Instruct-exl2:6.5", "exllamav2",
         "bartowski/Qwen2.5-7B-Instruct-exl2", "6_5", "6_5"),
    ],
)
def test_quant_tags(fake: HubFixture, ref: str, backend: str, repo: str, quant: str,
                    revision: str) -> None:
    plan = hub.plan_fetch(ref, backend=backend, memory_budget_bytes=8 * GiB)
    assert (plan.repo, plan.quant, plan.revision) == (repo, quant, revision)


def test_exl2_default_is_largest_bpw_that_fits(fake: HubFixture) -> None:
    plan = hub.plan_fetch("bartowski/Qwen2.5-7B-Instruct-exl2", backend="exllamav2",
                          memory_budget_bytes=8 * GiB)
    assert plan.revision == "8_0" and plan.format == "exl2"
    assert "measurement.json" not in {f.path for f in plan.files}
    path = hub.fetch(plan)
    assert (path / "output.safetensors").is_file() and (path / "config.json").is_file()


def test_onnx_variant_folder(fake: HubFixture) -> None:
    plan = hub.plan_fetch("microsoft/Phi-3.5-mini-instruct-onnx", backend="onnx",
                          memory_budget_bytes=8 * GiB)
    assert plan.subfolder == "cpu_and_mobile/cpu-int4-awq-block-128-acc-level-4"
    assert plan.quant == "int4"
    assert all(f.path.startswith(plan.subfolder) for f in plan.files)
    assert plan.memory.kv_known  # from genai_config.json
    gpu = hub.plan_fetch("microsoft/Phi-3.5-mini-instruct-onnx", backend="onnx", device="cuda")
    assert gpu.subfolder == "gpu/gpu-int4-awq-block-128"
    path = hub.fetch(plan)
    assert (path / "genai_config.json").is_file() and path.name.startswith("cpu-int4")


def test_mmproj_and_imatrix_ignored(fake: HubFixture) -> None:
    """The repo also holds an .imatrix and (added here) mmproj-...-f16.gguf, a vision
    projector: neither is a quant of the model, so F16 is not offered; the imatrix is
    never planned, the projector comes with the model it serves (issue 32: a vision GGUF
    is the pair; tests/test_images_hub.py loads one)."""
    from tests.hubserver import FakeFile, gguf_bytes

    repo = fake.hub.repos["bartowski/Qwen2.5-0.5B-Instruct-GGUF"]
    repo.branches["main"]["mmproj-Qwen2.5-0.5B-Instruct-f16.gguf"] = FakeFile(
        gguf_bytes(quant="F16", pad=50))
    plan = hub.plan_fetch("bartowski/Qwen2.5-0.5B-Instruct-GGUF", backend="llama.cpp",
                          memory_budget_bytes=8 * GiB)  # a budget: every quant is listed
    assert sorted(o.quant for o in plan.options) == ["Q4_K_M", "Q6_K", "Q8_0"]
    assert [f.path for f in plan.files] == ["Qwen2.5-0.5B-Instruct-Q4_K_M.gguf",
                                            "mmproj-Qwen2.5-0.5B-Instruct-f16.gguf"]
    with pytest.raises(NoVariantError) as info:
        hub.plan_fetch("bartowski/Qwen2.5-0.5B-Instruct-GGUF:F16", backend="llama.cpp")
    assert info.value.tried == ["bartowski/Qwen2.5-0.5B-Instruct-GGUF"]
    assert info.value.hint == "no F16 file; available: Q4_K_M, Q6_K, Q8_0"


def test_sharded_quant_downloaded_together(fake: HubFixture) -> None:
    plan = hub.plan_fetch("Qwen/Qwen2.5-7B-Instruct-GGUF", backend="llama.cpp",
                          memory_budget_bytes=8 * GiB)
    assert plan.quant == "Q4_K_M"
    names = [f.path for f in plan.files]
    assert names == ["qwen2.5-7b-instruct-q4_k_m-00001-of-00002.gguf",
                     "qwen2.5-7b-instruct-q4_k_m-00002-of-00002.gguf"]
    path = hub.fetch(plan)
    assert path.name == names[0]
    assert (path.parent / names[1]).is_file()


def test_mlx_plan_for_apple_silicon_budget(fake: HubFixture) -> None:
    plan = hub.plan_fetch(BASE, backend="mlx", memory_budget_bytes=16 * GiB)
    assert plan.repo == "mlx-community/Qwen2.5-0.5B-Instruct-4bit"
    assert plan.format == "mlx" and plan.quant == "4bit" and plan.fits


def test_fit_refusal_before_any_download(fake: HubFixture) -> None:
    plan = hub.plan_fetch("bigorg/Huge-70B-GGUF", backend="llama.cpp",
                          memory_budget_bytes=16 * GiB, context=4096)
    assert not plan.fits
    with pytest.raises(ModelTooLargeError) as err:
        hub.fetch(plan)
    e = err.value
    assert e.available_bytes == 16 * GiB and e.needed_bytes > 16 * GiB
    assert e.max_context == 0 and "GiB" in str(e)
    assert fake.hub.resolve_requests() == []  # not one byte of any file was asked for


def test_context_refusal_names_largest_context(fake: HubFixture) -> None:
    budget = 300 * 2**20
    plan = hub.plan_fetch(f"{GGUF_REPO}:Q4_K_M", backend="llama.cpp",
                          memory_budget_bytes=budget, context=32768)
    assert not plan.fits
    # 24 layers x 2 KV heads x 64 dims x 2 (K, V) x 2 bytes = 12 KiB per token.
    assert plan.memory.kv_cache_bytes == 12288 * 32768
    assert 256 <= (plan.max_context or 0) < 32768
    with pytest.raises(ModelTooLargeError, match=f"--context {plan.max_context}"):
        plan.require_fit()
    ok = hub.plan_fetch(f"{GGUF_REPO}:Q4_K_M", backend="llama.cpp",
                        memory_budget_bytes=budget, context=plan.max_context)
    assert ok.fits
    # Only the header was read (Range requests), no weights were downloaded.
    gets = fake.hub.resolve_requests("GET")
    assert gets and all("Range" in r["headers"] for r in gets)


def test_unknown_trained_context_is_planned_at_the_window_engines_load(
        fake: HubFixture) -> None:
    """A config.json without max_position_embeddings: the engines load the model at
    memory.context_window(None, None) tokens, and the plan's KV cache counts as many."""
    cfg = {"num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
           "hidden_size": 256, "torch_dtype": "bfloat16",
           "quantization": {"group_size": 64, "bits": 4}}
    fake.hub.add(FakeRepo("mlx-community/NoContext-4bit", {"main": {
        "config.json": FakeFile(json.dumps(cfg).encode(), lfs=False),
        "model.safetensors": FakeFile(b"\1" * 4096, lfs=True)}}, tags=["mlx"]))
    plan = hub.plan_fetch("mlx-community/NoContext-4bit", backend="mlx",
                          memory_budget_bytes=8 * GiB)
    window = memory.context_window(None, None)
    assert plan.memory.kv_known and plan.context == plan.memory.context == window
    # 4 layers x 2 KV heads x 64 dims (256 / 4) x 2 (K, V) x 2 bytes (bf16) per token
    assert plan.memory.kv_cache_bytes == 4 * 2 * 64 * 2 * 2 * window


def test_a_context_past_the_trained_one_is_planned_as_the_engine_loads_it(
        fake: HubFixture) -> None:
    """Asked for more than the model was trained for (32768 in this header), the engines
    load the trained context (memory.context_window): the plan counts that, not more."""
    plan = hub.plan_fetch(f"{GGUF_REPO}:Q4_K_M", backend="llama.cpp", context=65536)
    assert plan.context == memory.context_window(65536, 32768) == 32768
    assert plan.memory.kv_cache_bytes == 12288 * 32768


def test_resume_after_dropped_connection(fake: HubFixture) -> None:
    plan = hub.plan_fetch(f"{GGUF_REPO}:Q4_K_M", backend="llama.cpp")
    fake.hub.drop_once.add((GGUF_REPO, Q4))  # after the plan: its header read is a GET too
    fake.hub.requests.clear()
    seen: list[hub.DownloadProgress] = []
    path = hub.fetch(plan, progress=seen.append)
    gets = [r for r in fake.hub.cdn_requests("GET") if r["path"].endswith(Q4)]
    assert len(gets) == 2
    assert "Range" not in gets[0]["headers"]
    half = len(_served(fake, GGUF_REPO, Q4)) // 2
    start = int(gets[1]["headers"]["Range"].removeprefix("bytes=").rstrip("-"))
    assert start == half  # every byte that arrived was kept
    assert _sha(path) == plan.files[0].sha256
    assert seen and seen[-1].done == seen[-1].total == plan.files[0].size
    assert all(p.delta > 0 for p in seen)  # nothing counted twice, nothing taken back


def test_corrupted_download_is_refetched(fake: HubFixture) -> None:
    plan = hub.plan_fetch(f"{GGUF_REPO}:Q4_K_M", backend="llama.cpp")
    fake.hub.corrupt_once.add((GGUF_REPO, Q4))  # after the plan's header read
    fake.hub.requests.clear()
    path = hub.fetch(plan)
    gets = [r for r in fake.hub.cdn_requests("GET") if r["path"].endswith(Q4)]
    assert len(gets) == 2  # the corrupt copy, then the good one
    assert _sha(path) == plan.files[0].sha256
    assert path.read_bytes() == _served(fake, GGUF_REPO, Q4)


def test_offline_uses_cache(fake: HubFixture) -> None:
    first = hub.fetch(hub.plan_fetch("qwen2.5:0.5b", backend="llama.cpp"))
    fake.offline()
    fake.hub.requests.clear()
    plan = hub.plan_fetch("qwen2.5:0.5b", backend="llama.cpp", memory_budget_bytes=8 * GiB)
    assert plan.source == "cache" and plan.quant == "Q4_K_M" and plan.fits
    assert hub.fetch(plan) == first
    assert fake.hub.requests == []
    with pytest.raises(OfflineMissingError, match="Q8_0") as err:
        hub.plan_fetch("qwen2.5:0.5b:Q8_0", backend="llama.cpp")
    assert "Q4_K_M" in (err.value.hint or "")


def test_offline_without_cache_says_what_is_missing(fake: HubFixture) -> None:
    fake.offline()
    with pytest.raises(OfflineMissingError) as err:
        hub.plan_fetch("qwen2.5:0.5b", backend="llama.cpp")
    msg = str(err.value)
    assert "HF_HUB_OFFLINE" in msg and GGUF_REPO in msg
    with pytest.raises(OfflineMissingError, match=GGUF_REPO):
        hub.plan_fetch(f"{GGUF_REPO}:Q4_K_M", backend="llama.cpp")
    assert fake.hub.requests == []


def test_hub_unreachable_falls_back_to_cache(fake: HubFixture) -> None:
    from huggingface_hub import constants

    first = hub.fetch(hub.plan_fetch(f"{GGUF_REPO}:Q4_K_M", backend="llama.cpp"))
    dead = "http://127.0.0.1:9"  # discard port: connection refused
    fake.monkeypatch.setattr(constants, "ENDPOINT", dead)
    fake.monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE",
                             dead + "/{repo_id}/resolve/{revision}/{filename}")
    plan = hub.plan_fetch(f"{GGUF_REPO}:Q4_K_M", backend="llama.cpp")
    assert plan.source == "cache" and any("cannot be reached" in r for r in plan.reasons)
    assert hub.fetch(plan) == first


def test_gated_repo_needs_token(fake: HubFixture) -> None:
    plan = hub.plan_fetch("gatedorg/Gated-1B-GGUF", backend="llama.cpp")
    assert plan.gated and any("HF_TOKEN" in r for r in plan.reasons)
    with pytest.raises(ModelGatedError) as err:
        hub.fetch(plan)
    assert "HF_TOKEN" in (err.value.hint or "")
    fake.monkeypatch.setenv("HF_TOKEN", GATED_TOKEN)
    assert hub.fetch(plan).is_file()


def test_not_found_and_format_mismatch(fake: HubFixture) -> None:
    with pytest.raises(HubNotFoundError):
        hub.plan_fetch("nobody/NoSuchModel-GGUF", backend="llama.cpp")
    with pytest.raises(FormatMismatchError):
        hub.plan_fetch("mlx-community/Qwen2.5-0.5B-Instruct-4bit", backend="llama.cpp")


def test_list_and_remove_one_quant(fake: HubFixture) -> None:
    hub.fetch(hub.plan_fetch(f"{GGUF_REPO}:Q4_K_M", backend="llama.cpp"))
    q8 = hub.fetch(hub.plan_fetch(f"{GGUF_REPO}:Q8_0", backend="llama.cpp"))
    names = {m.name: m for m in hub.cached_models()}
    assert {f"{GGUF_REPO}:Q4_K_M", f"{GGUF_REPO}:Q8_0"} <= set(names)
    assert names[f"{GGUF_REPO}:Q4_K_M"].format == "gguf"
    removal = hub.plan_removal(f"{GGUF_REPO}:Q4_K_M")
    assert len(removal.files) == 1 and removal.freed_bytes > 0
    hub.remove(removal)
    left = {m.name for m in hub.cached_models()}
    assert f"{GGUF_REPO}:Q4_K_M" not in left and f"{GGUF_REPO}:Q8_0" in left
    assert q8.is_file()
    hub.remove(hub.plan_removal(GGUF_REPO))
    assert not any(m.repo == GGUF_REPO for m in hub.cached_models())
