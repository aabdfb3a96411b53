from __future__ import annotations

from pathlib import Path

import pytest

from localrun import memory
from localrun.backends import engine_memory
from localrun.formats.gguf import metadata_from_bytes
from localrun.memory import ModelShape
from tests.hubserver import gguf_bytes

QWEN = ModelShape(n_layers=24, n_kv_heads=2, head_dim=64, trained_context=32768)


#: SmolLM2-135M-Instruct (its config.json: 30 layers, 9 heads of which 3 KV heads,
#: hidden 576 -> head_dim 64, 8192 positions), the model of the test fixtures
SMOLLM2 = ModelShape(n_layers=30, n_kv_heads=3, head_dim=64, trained_context=8192)


def test_kv_cache_formula() -> None:
    # 2 (K and V) x 30 layers x 3 KV heads x 64 head dim x 2 bytes (f16) = 23,040 B/token
    assert memory.kv_cache_bytes(SMOLLM2, 1) == 23_040
    assert memory.kv_cache_bytes(SMOLLM2, 8192) == 188_743_680  # 180 MiB
    assert memory.kv_cache_bytes(SMOLLM2, 8192) == 180 * 2**20
    assert memory.kv_cache_bytes(SMOLLM2, 8192, 4) == 360 * 2**20  # f32 elements
    # Qwen2.5-0.5B: 2 x 24 x 2 x 64 x 2 B = 12,288 B/token
    assert memory.kv_cache_bytes(QWEN, 1000) == 12_288_000
    est = memory.estimate(10**9, SMOLLM2, 4096)
    assert est.kv_cache_bytes == 90 * 2**20
    # overhead: 256 MiB fixed + 5% of the weights
    assert est.overhead_bytes == 256 * 2**20 + 50_000_000
    assert est.total_bytes == 10**9 + 90 * 2**20 + 256 * 2**20 + 50_000_000


def test_smollm2_shape_read_from_the_real_gguf(default_gguf: Path) -> None:
    """The shape the formula above uses is what the embedded GGUF's header says."""
    with default_gguf.open("rb") as f:
        head = f.read(4 << 20)
    meta = metadata_from_bytes(head)
    assert memory.shape_from_gguf_metadata(meta) == SMOLLM2


def test_max_context() -> None:
    w = 500 * 2**20
    budget = w + memory.overhead_bytes(w) + QWEN.kv_bytes_per_token() * 5000
    ctx = memory.max_context(w, QWEN, budget, limit=32768)
    assert ctx == 5000 // 256 * 256
    assert memory.estimate(w, QWEN, ctx).total_bytes <= budget
    assert memory.max_context(w, QWEN, 10**12, limit=32768) == 32768
    assert memory.max_context(w, QWEN, w) == 0


def test_shapes_from_gguf_and_configs() -> None:
    meta = metadata_from_bytes(gguf_bytes())
    assert memory.shape_from_gguf_metadata(meta) == QWEN
    with pytest.raises(EOFError):
        metadata_from_bytes(gguf_bytes()[:60])
    cfg = {"num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
           "hidden_size": 896, "max_position_embeddings": 32768}
    assert memory.shape_from_config(cfg) == QWEN
    genai = {"model": {"context_length": 4096, "decoder": {
        "num_hidden_layers": 32, "num_key_value_heads": 8, "head_size": 96}}}
    assert memory.shape_from_config(genai) == ModelShape(32, 8, 96, 4096)


def test_available_ram() -> None:
    assert memory.available_ram_bytes() > 0


# -- what each engine allocates (its facts' memory rows) ---------------------------------

MiB = 2**20


@pytest.mark.parametrize(("backend", "device", "kv_mib", "fixed_mib"), [
    # SmolLM2 at 8192 tokens: 23,040 B/token in f16 = 180 MiB, 360 MiB in f32
    ("llama.cpp", "cpu", 180, 64),
    ("llama.cpp", "cuda:0", 180, 256),
    ("llama.cpp", None, 180, 256),  # llama.cpp's default is the GPU when there is one
    ("mlx", "cpu", 180, 128),
    ("mlx", "metal", 180, 256),
    ("openvino", "CPU", 360, 320),  # localrun loads it with KV_CACHE_PRECISION=f32
    ("openvino", None, 360, 320),  # OpenVINO's default device is the CPU
    ("openvino", "GPU.1", 180, 256),
    ("openvino", "NPU", 180, 256),
    ("onnx", "cpu", 360, 160),  # the builder's CPU variants keep f32 past_key_values
    ("onnx", None, 360, 160),
    ("onnx", "cuda:1", 180, 256),
    ("onnx", "dml", 180, 256),
    ("exllamav2", "cuda:0", 180, 256),
    (None, None, 180, 256),  # engine unknown: f16
])
def test_estimate_follows_the_engine_and_device(backend: str | None, device: str | None,
                                                kv_mib: int, fixed_mib: int) -> None:
    est = memory.estimate(10**8, SMOLLM2, 8192, engine=engine_memory(backend, device))
    assert est.kv_cache_bytes == kv_mib * MiB
    assert est.overhead_bytes == fixed_mib * MiB + 5_000_000
    assert est.total_bytes == 10**8 + kv_mib * MiB + fixed_mib * MiB + 5_000_000


def test_mlx_kv_follows_the_model_dtype() -> None:
    """mlx-lm keeps K and V in the model's own dtype: bf16 in MLX repos, f32 in a model
    saved in f32 (the SmolLM2 fixture); config.json says which (dtype or torch_dtype)."""
    cfg = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
           "hidden_size": 576, "max_position_embeddings": 8192}
    for dtype, kv_mib in (("bfloat16", 180), ("float16", 180), ("float32", 360), (None, 180)):
        for key in ("torch_dtype", "dtype"):
            shape = memory.shape_from_config({**cfg, key: dtype} if dtype else cfg)
            assert shape is not None and shape.kv_bytes_per_token(1) == 11_520
            est = memory.estimate(10**8, shape, 8192, engine=engine_memory("mlx", "metal"))
            assert est.kv_cache_bytes == kv_mib * MiB, (dtype, key)
            # the engines with a KV type of their own do not follow the model's dtype
            assert memory.estimate(10**8, shape, 8192, engine=engine_memory(
                "llama.cpp", "cpu")).kv_cache_bytes == 180 * MiB


def test_max_context_counts_what_the_engine_allocates() -> None:
    """OpenVINO on a CPU fits half the context llama.cpp fits in the same KV room."""
    w = 10**8
    room = 90 * MiB  # 4096 f16 tokens of SmolLM2, 2048 f32 ones
    for backend, want in (("llama.cpp", 4096), ("openvino", 2048), ("onnx", 2048)):
        engine = engine_memory(backend, "cpu")
        budget = w + memory.overhead_bytes(w, engine.overhead_fixed) + room
        ctx = memory.max_context(w, SMOLLM2, budget, engine=engine)
        assert ctx == want, backend
        assert memory.estimate(w, SMOLLM2, ctx, engine=engine).total_bytes == budget


def test_intel_host_plans_openvino_with_its_f32_kv_cache(monkeypatch: pytest.MonkeyPatch,
                                                          tmp_path: Path) -> None:
    """Auto mode on an Intel CPU host picks OpenVINO; its plan counts the f32 KV cache
    OpenVINO will allocate there (Qwen2.5-0.5B: 2 x 24 layers x 2 KV heads x 64 x 4 B)."""
    from localrun.hardware import HardwareProfile
    from localrun.planning.plan import plan
    from tests.hubserver import BASE, start

    profile = HardwareProfile.load(Path(__file__).parent / "profiles" / "xeon-cpu.json")
    for _ in start(monkeypatch, tmp_path):
        p = plan(BASE, hardware=profile, installed={"openvino": "2026.4.1",
                                                    "llama.cpp": "0.3.36"}, context=4096)
        assert (p.backend, p.format) == ("openvino", "openvino")
        assert p.memory["kv_cache_bytes"] == 2 * 24 * 2 * 64 * 4 * 4096  # 96 MiB
        # OpenVINO's CPU overhead: 320 MiB + 5% of the weights
        assert abs(p.memory["overhead_bytes"] - 320 * MiB - p.memory["weights_bytes"] / 20) <= 1


def test_gguf_quant_is_the_nearest_to_q4_k_m_that_fits(monkeypatch: pytest.MonkeyPatch,
                                                      tmp_path: Path) -> None:
    """The rule the README states: Q4_K_M when it fits, even with room for Q8_0 or F16
    (not the largest that fits); else the quant nearest to it that does (Q4_K_S here)."""
    from localrun import hub
    from tests.hubserver import BASE, start

    for _ in start(monkeypatch, tmp_path):
        roomy = hub.plan_fetch(f"{BASE}-GGUF", backend="llama.cpp", device="cpu",
                               memory_budget_bytes=8 * 2**30, context=256)
        assert roomy.quant == "Q4_K_M"
        need = {o.quant: o.needed_bytes for o in roomy.options}
        assert need["F16"] is not None and need["Q4_K_M"] is not None
        assert need["F16"] < 8 * 2**30  # the largest fits too, and is not the choice
        tight = hub.plan_fetch(f"{BASE}-GGUF", backend="llama.cpp", device="cpu",
                               memory_budget_bytes=need["Q4_K_M"] - 1, context=256)
        assert tight.quant == "Q4_K_S" and tight.fits


def test_an_openvino_ir_without_config_json_has_its_kv_shape_in_its_state() -> None:
    """An IR folder without config.json (the test fixture's GGUF export, some community
    repos) still shows its KV cache: the IR's state variables, a ``?,kv_heads,?,head_dim``
    key and value per layer (SmolLM2: 30 layers of 3 heads of 64)."""
    from tests.models import test_model

    ir = test_model("openvino-int4")
    assert not (ir / "config.json").exists()
    xml = (ir / "openvino_model.xml").read_text("utf-8")
    shape = memory.shape_from_openvino_ir(xml)
    assert shape == ModelShape(SMOLLM2.n_layers, SMOLLM2.n_kv_heads, SMOLLM2.head_dim)
    # K and V of other sizes: the larger counts; a state without a token axis: none
    state = ('<data variable_id="past_key_values.0.key" variable_type="f32" '
             'variable_shape="?,2,?,128" /><data variable_id="past_key_values.0.value" '
             'variable_type="f32" variable_shape="?,2,?,96" />'
             '<data variable_id="conv.0" variable_shape="?,1024,4" />')
    assert memory.shape_from_openvino_ir(state) == ModelShape(1, 2, 128)
    assert memory.shape_from_openvino_ir("<net><layers/></net>") is None


def test_a_local_model_is_estimated_from_its_own_files(tmp_path: Path) -> None:
    """memory.local_estimate: a model on disk, from its path alone: the weights' bytes,
    the shape its files give, the default context rule, the engine's own memory row."""
    import json

    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(
        {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
         "hidden_size": 576, "max_position_embeddings": 8192, "torch_dtype": "bfloat16"}))
    (folder / "model.safetensors").write_bytes(b"\0" * 4096)
    (folder / "notes.txt").write_text("not a weight")
    est = memory.local_estimate(folder, None, engine=engine_memory("mlx", "cpu"))
    assert est.weights_bytes == 4096 and est.context == 8192
    assert est.kv_cache_bytes == memory.kv_cache_bytes(SMOLLM2, 8192, 2)  # bf16, MLX's row
    assert est.overhead_bytes == memory.overhead_bytes(
        4096, engine_memory("mlx", "cpu").overhead_fixed)
    est = memory.local_estimate(folder, 2048, engine=engine_memory("openvino", "CPU"))
    assert est.context == 2048 and est.kv_cache_bytes == memory.kv_cache_bytes(SMOLLM2, 2048, 4)
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "model.safetensors").write_bytes(b"\0" * 10)
    est = memory.local_estimate(bare, None)
    assert not est.kv_known and est.context == memory.DEFAULT_CONTEXT_CAP


def test_one_budget_policy_for_the_server_and_llama_cpps_batch_context() -> None:
    """``memory.budget``: under a limit (``serve --max-memory``) the limit less what is
    counted, else what the OS shows plus what unloading freed and what of the model is
    in memory already; an optional reserve (llama.cpp's batch context) a quarter of that
    at most, within its cap. llama.cpp's batch slots and the server's fit check are its
    answers, not rules of their own."""
    from localrun.backends.llama_cpp.memory import KV_BUDGET, MAX_CAPACITY, batch_capacity

    gib = 1 << 30
    assert memory.budget(8 * gib, freed=gib, resident=gib) == 10 * gib
    assert memory.budget(8 * gib, limit=6 * gib, used=4 * gib, freed=gib) == 2 * gib
    assert memory.budget(4 * gib, reserve=KV_BUDGET) == gib  # a quarter of the room
    assert memory.budget(64 * gib, reserve=KV_BUDGET) == KV_BUDGET  # within its cap
    assert memory.budget(None, reserve=KV_BUDGET) == KV_BUDGET  # RAM unknown
    for available in (None, 3 * gib, 8 * gib, 64 * gib):
        for stream in (64 << 20, 300 << 20, gib):
            room = memory.budget(available, reserve=KV_BUDGET)
            assert batch_capacity(stream, available) == min(MAX_CAPACITY, room // stream)

    pytest.importorskip("fastapi", reason="the serve extra is not installed "
                        "(pip install -e '.[serve]')")
    from localrun.server.config import ServerConfig
    from localrun.server.manager import ModelManager
    from localrun.server.metrics import Metrics

    free = ModelManager(ServerConfig(), Metrics(), available_memory=lambda: 8 * gib)
    assert free._fits(10 * gib, gib, loaded=gib) and not free._fits(10 * gib + 1, gib,
                                                                    loaded=gib)
    capped = ModelManager(ServerConfig(max_memory=6 * gib), Metrics(),
                          available_memory=lambda: 64 * gib)  # the OS is not asked
    assert capped._fits(6 * gib, 0, loaded=gib) and not capped._fits(6 * gib + 1, gib)
