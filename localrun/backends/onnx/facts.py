"""ONNX Runtime GenAI's facts: its entry in the engine table, which formats it runs, what
it allocates, its options and GPU builds. Pure data: importing it imports no engine."""

from __future__ import annotations

from localrun.backends.spec import BackendSpec, Build, Condition, EngineMemory, MiB

SPEC = BackendSpec(
    name="onnx", title="ONNX Runtime GenAI", module="localrun.backends.onnx.session",
    dists=("onnxruntime-genai",), extra="onnx", home="here",
    formats=("onnx",), loads=(),
    conditions={"onnx": Condition(
        "the execution provider the model was built for (cpu, cuda, dml) must be in the "
        "installed onnxruntime-genai build")},
    quant="int4", target_bpw=4.0,
    convert="python -m onnxruntime_genai.models.builder -i MODEL_DIR -o OUT -p int4 "
            "-e cpu",
    min_compute=None,  # the CUDA build follows ONNX Runtime's; localrun checks none
    options={
        "SETTLE": ("bool", "with exact=True: recompute a finished reply's KV rows as a "
                           "prefill in the background, so that the next turn reuses them "
                           "with exact output (default true)"),
    },
    aliases=("onnxruntime-genai", "onnxruntime_genai", "ort", "onnx-genai"),
    builds=(Build("onnxruntime-genai-cuda", "cuda", "onnx-cuda"),
            Build("onnxruntime-genai-directml", "dml", "onnx-directml")),
    # the model's I/O type for the KV cache: f32 in the builder's CPU variants (fp16 in
    # its GPU ones); the CPU overhead measured as llama.cpp's (tests/test_memory_rss.py)
    memory={"cpu": EngineMemory(4, 160 * MiB), "*": EngineMemory(2)},
    default_device="cpu",
    embedder=None,
)
