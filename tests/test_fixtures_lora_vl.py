"""The LoRA and vision fixtures of scripts/make_test_models.py work on the real engines.

Issue 31 (LoRA): lora-gguf changes llama.cpp's greedy reply at scale 1 and leaves it at
scale 0, on the Q8_0 and Q4_1 bases; two adapters switch per request on one loaded model
(llama_set_adapters_lora, no reload); lora-mlx does the same on MLX; lora-peft is PEFT's
format. Issue 32 (images): vl-gguf answers a chat with a data-URI image through
llama-cpp-python's MTMDChatHandler, vl-openvino through OpenVINO GenAI's VLMPipeline; the
image changes the reply and raises the prompt token count. These tests use the engines'
own APIs (not localrun's): they are the evidence the engine work of those issues builds on.
"""

from __future__ import annotations

import base64
import ctypes
import importlib.util
import json
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.models import test_model

HAVE = {m: importlib.util.find_spec(m) is not None
        for m in ("llama_cpp", "mlx_lm", "openvino_genai", "safetensors", "numpy")}
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def needs(module: str, extra: str) -> None:
    if not HAVE[module]:
        pytest.skip(f"{module} is not installed (pip install -e '.[{extra}]')")


def png(width: int, height: int) -> bytes:
    """A small RGB gradient PNG, written with the standard library alone."""
    rows = b"".join(
        b"\x00" + b"".join(bytes((x * 255 // max(width - 1, 1), y * 255 // max(height - 1, 1),
                                  (x * 7 + y * 13) & 255)) for x in range(width))
        for y in range(height))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2,
                                                               0, 0, 0))
            + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b""))


# --- LoRA on llama.cpp ---------------------------------------------------------------------

def _llama_reply(base: Path, **kwargs: Any) -> str:
    from llama_cpp import Llama

    llm = Llama(str(base), n_ctx=512, verbose=False, seed=0, **kwargs)
    try:
        out = llm.create_chat_completion(QUESTION, max_tokens=12, temperature=0.0)
        return str(out["choices"][0]["message"]["content"])
    finally:
        llm.close()


@pytest.mark.parametrize("base_fmt", ["gguf-q8_0", "gguf-q4_1"])
def test_lora_gguf_changes_the_greedy_reply_at_scale_1_and_not_at_0(base_fmt: str) -> None:
    needs("llama_cpp", "llama-cpp")
    base, lora = test_model(base_fmt), test_model("lora-gguf")
    plain = _llama_reply(base)
    assert plain.strip()
    at_1 = _llama_reply(base, lora_path=str(lora), lora_scale=1.0)
    at_0 = _llama_reply(base, lora_path=str(lora), lora_scale=0.0)
    assert at_1.strip() and at_1 != plain, (plain, at_1)
    assert at_0 == plain, (plain, at_0)


def test_two_lora_adapters_switch_per_request_on_one_loaded_model() -> None:
    """What llama-server does per request: both adapters loaded once on the model, the set
    of (adapter, scale) chosen before each request; the KV cache is reset in between, or
    llama-cpp-python reuses the prompt's KV computed under the previous adapter."""
    needs("llama_cpp", "llama-cpp")
    import llama_cpp
    from llama_cpp import Llama

    base = test_model("gguf-q8_0")
    paths = {"a": test_model("lora-gguf"), "b": test_model("lora-gguf-b")}
    expected = {name: _llama_reply(base, lora_path=str(p)) for name, p in paths.items()}
    expected[""] = _llama_reply(base)
    assert len(set(expected.values())) == 3, expected  # base, a and b all differ

    llm = Llama(str(base), n_ctx=512, verbose=False, seed=0)
    try:
        adapters = {name: llama_cpp.llama_adapter_lora_init(llm.model, str(p).encode())
                    for name, p in paths.items()}
        assert all(adapters.values()), adapters

        def ask(name: str) -> str:
            chosen = [adapters[name]] if name else []
            arr = (llama_cpp.llama_adapter_lora_p_ctypes * max(len(chosen), 1))(*chosen)
            scales = (ctypes.c_float * max(len(chosen), 1))(*([1.0] * len(chosen)))
            assert llama_cpp.llama_set_adapters_lora(llm.ctx, arr, len(chosen), scales) == 0
            llm.reset()
            out = llm.create_chat_completion(QUESTION, max_tokens=12, temperature=0.0)
            return str(out["choices"][0]["message"]["content"])

        for name in ("a", "b", "", "b", "a", ""):  # interleaved, one model, no reload
            assert ask(name) == expected[name], name
    finally:
        llm.close()  # frees the adapters with the model


def test_lora_gguf_is_an_adapter_for_the_llama_architecture() -> None:
    from localrun.formats.gguf import read_gguf

    for fmt in ("lora-gguf", "lora-gguf-b"):
        info = read_gguf(test_model(fmt))
        assert info.architecture == "llama", info
        assert info.metadata.get("general.type") == "adapter", info.metadata
        assert info.metadata.get("adapter.type") == "lora", info.metadata
        assert info.metadata.get("adapter.lora.alpha") == 16.0, info.metadata


def test_lora_peft_is_peft_format_for_the_hf_model() -> None:
    needs("safetensors", "dev")
    needs("numpy", "dev")
    from safetensors import safe_open

    hf = test_model("hf")
    shapes = {}
    with safe_open(str(hf / "model.safetensors"), "np") as f:
        for k in f.keys():  # noqa: SIM118 - safe_open has no __iter__
            if k.endswith(("q_proj.weight", "v_proj.weight")):
                shapes[k] = f.get_slice(k).get_shape()
    for fmt in ("lora-peft", "lora-peft-b"):
        folder = test_model(fmt)
        cfg = json.loads((folder / "adapter_config.json").read_text())
        assert cfg["peft_type"] == "LORA" and cfg["r"] == 8 and cfg["lora_alpha"] == 16
        assert cfg["target_modules"] == ["q_proj", "v_proj"]
        with safe_open(str(folder / "adapter_model.safetensors"), "np") as f:
            keys = list(f.keys())
            assert len(keys) == 2 * len(shapes) == 120
            for k in keys:
                base = k.replace("base_model.model.", "").replace(".lora_A", "").replace(
                    ".lora_B", "")
                out_dim, in_dim = shapes[base]
                t = f.get_tensor(k)
                assert t.shape == ((8, in_dim) if ".lora_A." in k else (out_dim, 8)), k
                assert str(t.dtype) == "float32" and float(abs(t).max()) > 0, k  # B != 0


# --- LoRA on MLX ---------------------------------------------------------------------------

def test_lora_mlx_changes_the_greedy_reply_and_scale_0_restores_it() -> None:
    needs("mlx_lm", "mlx")
    from mlx_lm import generate, load
    from mlx_lm.tuner.lora import LoRALinear
    from mlx_lm.tuner.utils import load_adapters

    model, tok = load(str(test_model("mlx-4bit")))
    prompt = tok.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    plain = generate(model, tok, prompt, max_tokens=12)
    load_adapters(model, str(test_model("lora-mlx")))  # what load(adapter_path=...) does
    lora = [m for _, m in model.named_modules() if isinstance(m, LoRALinear)]
    assert len(lora) == 60  # q_proj and v_proj of 30 layers
    adapted = generate(model, tok, prompt, max_tokens=12)
    assert adapted.strip() and adapted != plain, (plain, adapted)
    for m in lora:
        m.scale = 0.0
    assert generate(model, tok, prompt, max_tokens=12) == plain


def test_lora_mlx_is_the_peft_adapter_transposed() -> None:
    needs("safetensors", "dev")
    from safetensors.numpy import load_file

    peft = load_file(str(test_model("lora-peft") / "adapter_model.safetensors"))
    mlx = load_file(str(test_model("lora-mlx") / "adapters.safetensors"))
    assert len(mlx) == len(peft)
    for k, v in peft.items():
        name = (k.removeprefix("base_model.model.").replace(".lora_A.weight", ".lora_a")
                .replace(".lora_B.weight", ".lora_b"))
        assert (mlx[name] == v.T).all(), name
    cfg = json.loads((test_model("lora-mlx") / "adapter_config.json").read_text())
    assert cfg["lora_parameters"]["scale"] == 16 / 8  # PEFT's alpha / r


# --- images on llama.cpp (mtmd) ------------------------------------------------------------

_QUIET: Any = None


@pytest.fixture(scope="module")
def vl_llama() -> Iterator[Any]:
    needs("llama_cpp", "llama-cpp")
    import llama_cpp
    import llama_cpp.mtmd_cpp as mtmd_cpp
    from llama_cpp import Llama
    from llama_cpp.llama_chat_format import MTMDChatHandler

    folder = test_model("vl-gguf")
    text = folder / "Tiny-Qwen2.5-VL.F16.gguf"
    mmproj = folder / "mmproj-Tiny-Qwen2.5-VL.F16.gguf"

    # mtmd ignores verbose=False: its own log callbacks silence it. The callback must
    # outlive every later mtmd call of this process: it is kept in a global, never freed.
    global _QUIET
    if _QUIET is None:
        _QUIET = llama_cpp.llama_log_callback(lambda level, text, user_data: None)
    mtmd_cpp.mtmd_log_set(_QUIET, None)
    mtmd_cpp.mtmd_helper_log_set(_QUIET, None)
    handler = MTMDChatHandler(clip_model_path=str(mmproj), verbose=False)
    llm = Llama(str(text), chat_handler=handler, n_ctx=2048, verbose=False, seed=0)
    try:
        yield llm
    finally:
        llm.close()  # explicitly: Llama.__del__ -> mtmd_free raises at interpreter exit


def _mtmd_chat(llm: Any, content: Any) -> tuple[str, int]:
    out = llm.create_chat_completion([{"role": "user", "content": content}], max_tokens=12,
                                     temperature=0.0)
    return str(out["choices"][0]["message"]["content"]), int(out["usage"]["prompt_tokens"])


def test_vl_gguf_answers_an_image_and_the_image_changes_the_reply(vl_llama: Any) -> None:
    uri = "data:image/png;base64," + base64.b64encode(png(112, 84)).decode()
    text_reply, text_tokens = _mtmd_chat(vl_llama, "Describe this.")
    image_reply, image_tokens = _mtmd_chat(vl_llama, [
        {"type": "image_url", "image_url": {"url": uri}},
        {"type": "text", "text": "Describe this."}])
    assert text_reply.strip() and image_reply.strip()
    assert image_reply != text_reply
    # 112x84 -> 8x6 patches of 14 -> 4x3 merged = 12 image embeddings; but llama-cpp-python
    # counts M-RoPE positions, and an image advances them by max(4, 3) = 4: + 2 for
    # <|vision_start|>/<|vision_end|>, + 4 (OpenVINO GenAI counts 12 + 2, below)
    assert image_tokens == text_tokens + 2 + 4, (text_tokens, image_tokens)
    two, two_tokens = _mtmd_chat(vl_llama, [
        {"type": "image_url", "image_url": {"url": uri}},
        {"type": "image_url", "image_url": {"url": uri}},
        {"type": "text", "text": "Describe this."}])
    assert two.strip() and two_tokens == image_tokens + 2 + 4, (image_tokens, two_tokens)


def test_vl_gguf_pair_is_a_qwen2vl_text_model_and_its_projector() -> None:
    from localrun.formats.gguf import read_gguf

    folder = test_model("vl-gguf")
    text = read_gguf(folder / "Tiny-Qwen2.5-VL.F16.gguf")
    proj = read_gguf(folder / "mmproj-Tiny-Qwen2.5-VL.F16.gguf")
    assert text.architecture == "qwen2vl" and proj.architecture == "clip"
    assert proj.metadata.get("clip.projector_type") == "qwen2.5vl_merger", proj.metadata
    assert proj.metadata.get("clip.vision.block_count") == 4
    assert proj.metadata.get("clip.vision.projection_dim") == 64


# --- images on OpenVINO GenAI --------------------------------------------------------------

def test_vl_openvino_answers_an_image_and_the_image_changes_the_reply() -> None:
    needs("openvino_genai", "openvino")
    needs("numpy", "openvino")
    import numpy as np
    import openvino as ov
    import openvino_genai

    pipe = openvino_genai.VLMPipeline(str(test_model("vl-openvino")), "CPU")
    cfg = openvino_genai.GenerationConfig()
    cfg.max_new_tokens = 12
    img = np.zeros((1, 84, 112, 3), np.uint8)  # [1, H, W, 3] uint8, as the pipeline takes
    img[0, :, :, 0] = np.arange(112, dtype=np.uint8)[None, :] * 2
    img[0, :, :, 1] = np.arange(84, dtype=np.uint8)[:, None] * 3
    results = [pipe.generate("Describe this.", generation_config=cfg, **kw)
               for kw in ({}, {"images": [ov.Tensor(img)]},
                          {"images": [ov.Tensor(img), ov.Tensor(img)]})]
    texts = [r.texts[0] for r in results]
    tokens = [r.perf_metrics.get_num_input_tokens() for r in results]
    assert texts[0].strip() and texts[1].strip() and texts[1] != texts[0], texts
    # OpenVINO GenAI counts tokens: 12 image embeddings + <|vision_start|>/<|vision_end|>
    assert tokens[1] == tokens[0] + 14 and tokens[2] == tokens[1] + 14, tokens


def test_vl_openvino_and_vl_gguf_are_the_same_model(vl_llama: Any) -> None:
    """The text-only greedy reply agrees across the two exports (F16 GGUF, fp32 IR)."""
    needs("openvino_genai", "openvino")
    import openvino_genai

    pipe = openvino_genai.VLMPipeline(str(test_model("vl-openvino")), "CPU")
    cfg = openvino_genai.GenerationConfig()
    cfg.max_new_tokens = 6
    ov_reply = pipe.generate("Describe this.", generation_config=cfg).texts[0]
    out = vl_llama.create_chat_completion([{"role": "user", "content": "Describe this."}],
                                          max_tokens=6, temperature=0.0)
    assert out["choices"][0]["message"]["content"] == ov_reply


def test_vl_folders_hold_what_their_engines_read() -> None:
    hf, ov_dir = test_model("vl-hf"), test_model("vl-openvino")
    cfg = json.loads((hf / "config.json").read_text())
    assert cfg["model_type"] == "qwen2_5_vl" and cfg["tie_word_embeddings"] is False
    assert cfg["vision_config"]["depth"] >= 3  # llama.cpp's converter maps merger.mlp < depth
    tok = json.loads((hf / "tokenizer.json").read_text())
    added = {t["content"]: t["id"] for t in tok["added_tokens"] if t["special"]}
    for name, key in (("<|vision_start|>", "vision_start_token_id"),
                      ("<|vision_end|>", "vision_end_token_id"),
                      ("<|image_pad|>", "image_token_id"), ("<|video_pad|>", "video_token_id")):
        assert added[name] == cfg[key], name
    assert "<|vision_pad|>" in added
    for folder in (hf, ov_dir):  # the processor's settings: written / copied, not exported
        pre = json.loads((folder / "preprocessor_config.json").read_text())
        assert pre["patch_size"] == 14 and pre["merge_size"] == 2
