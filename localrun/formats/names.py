"""The model formats localrun knows, by the names users know them, and what runs those
that no engine here runs natively. Which engine runs which format is each engine's own
fact (``backends/<engine>/facts.py``), collected in :mod:`localrun.backends.compat`."""

from __future__ import annotations

#: Format names users know, for every format :func:`localrun.formats.detect` can find.
FORMAT_TITLES: dict[str, str] = {
    "gguf": "GGUF", "mlx": "MLX", "exl2": "EXL2", "exl3": "EXL3", "openvino": "OpenVINO IR",
    "onnx": "ONNX Runtime GenAI", "gptq": "GPTQ", "awq": "AWQ", "hf": "safetensors (fp16/bf16)",
    "fp8": "FP8", "compressed-tensors": "compressed-tensors", "bitsandbytes": "bitsandbytes",
    "mxfp4": "MXFP4 safetensors",
}

#: For formats no engine here runs natively: what does run them, and the way out.
NOT_SERVED: dict[str, str] = {
    "gptq": "GPTQ is a GPU serving format (vLLM, SGLang, transformers)",
    "awq": "AWQ is a GPU serving format (vLLM, SGLang, transformers)",
    "fp8": "FP8 checkpoints are for vLLM/SGLang/TensorRT-LLM on Hopper-class GPUs",
    "compressed-tensors": "compressed-tensors checkpoints are for vLLM",
    "bitsandbytes": "bitsandbytes checkpoints are for transformers with CUDA",
    "mxfp4": "MXFP4 safetensors checkpoints are for vLLM/transformers (GGUF MXFP4 runs on "
             "llama.cpp)",
    "hf": "plain fp16/bf16 weights are the source other formats are made from",
}


def title(format: str) -> str:
    """The format's name as users know it ("GGUF"); an unknown one as it is."""
    return FORMAT_TITLES.get(format, format)
