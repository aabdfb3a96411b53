"""`localrun plan Qwen/Qwen2.5-72B-Instruct --hardware 8xh100.json` (issue 16's Done-when
line) through the CLI, against the fake Hub serving the original bf16 repo: vLLM with the
smallest tensor-parallel group that holds it, the reasons, and no download. Also the
same name on one RTX 4090, and a name whose parameter count misleads (Mixtral-8x22B)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from localrun.hardware import HardwareProfile
from localrun.planning.hosts import VLLM_GPU_SHARE, VLLM_HEADROOM
from tests.hubserver import (
    MIXTRAL,
    MIXTRAL_BYTES,
    QWEN72B,
    QWEN72B_BYTES,
    QWEN72B_SHARDS,
    HubFixture,
    add_datacenter_models,
    start,
)

ROOT = Path(__file__).resolve().parent.parent
PROFILES = ROOT / "tests" / "profiles"
H100 = PROFILES / "8xh100.json"
RTX4090 = PROFILES / "rtx4090.json"
GiB = 2**30


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[HubFixture]:
    for f in start(monkeypatch, tmp_path):
        add_datacenter_models(f.hub)
        yield f


def _cli(fake: HubFixture, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", "from localrun.cli import main; main()", *args],
                          cwd=ROOT, env=fake.env(), capture_output=True, text=True, timeout=120)


def _plan_json(fake: HubFixture, *args: str) -> dict[str, Any]:
    r = _cli(fake, "plan", *args, "--json")
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    out: dict[str, Any] = json.loads(r.stdout)
    return out


def _downloaded_nothing(fake: HubFixture) -> None:
    """API calls and config.json only: no weight file asked for, nothing from the CDN
    (where LFS files are served), no weights in the cache."""
    gets = [q["path"] for q in fake.hub.resolve_requests()]
    assert not [p for p in gets if p.endswith((".safetensors", ".gguf", ".bin"))], gets
    assert fake.hub.cdn_requests() == []
    assert not [p for p in fake.home.rglob("*") if p.suffix in (".safetensors", ".incomplete")]


def _each_gpu(profile: Path) -> int:
    sizes = [g.memory_total for g in HardwareProfile.load(profile).nvidia_gpus]
    assert all(sizes)
    return min(s for s in sizes if s)


def test_qwen72b_on_8xh100_plans_vllm_on_the_smallest_tp_group_that_holds_it(
        fake: HubFixture) -> None:
    r = _cli(fake, "plan", QWEN72B, "--hardware", str(H100))
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    out = r.stdout
    assert "Plan: vllm on cuda:0,1,2,3 · hf bf16 · host kind datacenter" in out
    # why: the tensor-parallel size, the GPUs and the weights (the repo's, not the name's)
    assert ("chose vllm with tensor_parallel_size=4 on 4 × NVIDIA H100 80GB HBM3 (320.0 GiB; "
            f"~{QWEN72B_BYTES / GiB:.1f} GiB of weights, gpu_memory_utilization=0.9)") in out
    assert "vLLM uses 4 of the 8 GPUs: the smallest tensor-parallel group that holds the " \
           "model" in out
    assert f"{QWEN72B} is the safetensors (fp16/bf16) model vllm runs as it is" in out
    assert f"Repo: {QWEN72B}" in out
    assert "Fit: fits: needs" in out
    _downloaded_nothing(fake)

    plan = _plan_json(fake, QWEN72B, "--hardware", str(H100))
    assert (plan["backend"], plan["format"], plan["quantization"]) == ("vllm", "hf", "bf16")
    assert plan["device"] == "cuda:0,1,2,3" and plan["repo"] == QWEN72B
    shards = [f"model-{i:05d}-of-{QWEN72B_SHARDS:05d}.safetensors"
              for i in range(1, QWEN72B_SHARDS + 1)]
    assert set(shards) | {"config.json", "model.safetensors.index.json",
                          "tokenizer.json"} <= set(plan["files"])
    mem = plan["memory"]
    assert mem["weights_bytes"] == QWEN72B_BYTES and mem["fits"] is True
    # config.json was read: K and V × 80 layers × 8 KV heads × 128 dims × bf16 × context
    assert mem["kv_cache_bytes"] == 2 * 80 * 8 * 128 * 2 * mem["context"]
    # 4 is the smallest power of two whose GPUs (at vLLM's memory share) hold the weights
    # with vLLM's room for KV cache and activations; 2 do not
    each = _each_gpu(H100) * VLLM_GPU_SHARE
    need = QWEN72B_BYTES * VLLM_HEADROOM
    assert 2 * each < need <= 4 * each
    # the room is not idle: two GPUs do not hold the weights and the KV cache at the
    # model's trained context, 32768 tokens (vLLM's max_model_len when none is given)
    assert 2 * each < QWEN72B_BYTES + 2 * 80 * 8 * 128 * 2 * 32768
    _downloaded_nothing(fake)


def test_the_tp_group_is_sized_from_the_repo_not_the_name(fake: HubFixture) -> None:
    """"8x22B" reads as 22 B parameters (44 GB, one GPU); the repo holds 281 GB: the
    tensor-parallel group is sized from the Hub's weights, all eight GPUs."""
    plan = _plan_json(fake, MIXTRAL, "--hardware", str(H100))
    assert plan["backend"] == "vllm" and plan["device"] == "cuda:0,1,2,3,4,5,6,7"
    assert any(r.startswith("chose vllm with tensor_parallel_size=8 on 8 × NVIDIA H100")
               and f"~{MIXTRAL_BYTES / GiB:.1f} GiB of weights" in r for r in plan["reasons"])
    assert plan["memory"]["weights_bytes"] == MIXTRAL_BYTES and plan["memory"]["fits"] is True
    _downloaded_nothing(fake)


def test_qwen72b_on_one_rtx4090_says_no_variant_and_what_to_do(fake: HubFixture) -> None:
    """The fake Hub holds only the bf16 original (145 GB): no EXL2/GGUF/MLX/OpenVINO/ONNX
    variant for any engine this host would use. The plan keeps the engine choice and says,
    in one note, that the Hub has nothing for it and what to do next; no repo, no fit."""
    r = _cli(fake, "plan", QWEN72B, "--hardware", str(RTX4090))
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    out = r.stdout
    assert "Plan: exllamav2 on cuda:0 · exl2 4.0bpw · host kind nvidia" in out
    assert (f"Note: Hub step skipped: Found no exl2 variant of {QWEN72B} for exllamav2 "
            f"(looked at {QWEN72B}) (name a variant repo directly (org/name), or pick another "
            "engine with --backend)") in out
    assert "Repo:" not in out and "Fit:" not in out
    _downloaded_nothing(fake)


def test_explicit_vllm_on_one_rtx4090_points_at_the_gpu_and_refuses_with_numbers(
        fake: HubFixture) -> None:
    plan = _plan_json(fake, QWEN72B, "--hardware", str(RTX4090), "--backend", "vllm")
    assert plan["backend"] == "vllm" and plan["device"] == "cuda:0"  # was "cpu"
    assert any(n.startswith("warning: vllm the model needs about")
               and "on 1 GPU(s) of 24.0 GiB" in n and "will fail" in n for n in plan["notes"])
    mem = plan["memory"]
    assert mem["fits"] is False and "does NOT fit" in mem["verdict"]
    gpu = HardwareProfile.load(RTX4090).nvidia_gpus[0]
    assert mem["budget"] == gpu.memory_free  # the GPU's free memory, not the host's RAM
    _downloaded_nothing(fake)
