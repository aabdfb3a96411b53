"""MLX's facts: its entry in the engine table, which formats it runs, what it allocates.
Pure data: importing it imports no engine."""

from __future__ import annotations

from localrun.backends.spec import BackendSpec, Condition, EngineMemory, MiB

SPEC = BackendSpec(
    name="mlx", title="MLX (mlx-lm)", module="localrun.backends.mlx.session",
    dists=("mlx-lm", "mlx"), extra="mlx", home="here",
    formats=("mlx",), loads=("gptq", "awq", "hf"),
    conditions={
        "mlx": Condition("Metal on Apple Silicon; CPU only (slow) on Linux with mlx[cpu]"),
        "gptq": Condition("mlx-lm converts some GPTQ checkpoints on load"),
        "awq": Condition("mlx-lm converts some AWQ checkpoints on load"),
        "hf": Condition("runs unquantized; the MLX 4-bit/8-bit variant is much faster"),
    },
    quant="4bit", target_bpw=4.0, convert="mlx_lm.convert --hf-path MODEL -q",
    min_compute=None,  # Metal or the CPU
    options={}, aliases=("mlx-lm", "mlx_lm"), builds=(),
    # the KV cache in the model's own dtype (None: bf16/f16 in MLX repos, f32 in a model
    # saved in f32); the CPU overhead measured as llama.cpp's (tests/test_memory_rss.py)
    memory={"cpu": EngineMemory(None, 128 * MiB), "*": EngineMemory(None)},
    default_device="*",
    embedder=None,
)
