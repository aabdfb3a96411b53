"""LoRA adapters and a tiny Qwen2.5-VL for scripts/make_test_models.py (issues 31 and 32).

Imported by make_test_models.py (standard library only at import time, like it); the
``step_*`` functions run inside the converters' environments, where numpy, safetensors,
torch and transformers exist.

LoRA adapters for SmolLM2-135M-Instruct (the ``hf`` fixture), random with a fixed seed:

    lora-peft, lora-peft-b  PEFT's format (adapter_config.json + adapter_model.safetensors),
                            for vLLM and for llama.cpp's converter. PEFT initialises B to
                            zero (a no-op adapter); here A and B are both random, A ~ N(0,
                            1/in) and B ~ N(0, LORA["std_b"]^2), scaled alpha/r = 2: enough
                            to change SmolLM2's greedy reply at scale 1 and keep it text.
    lora-gguf, lora-gguf-b  llama.cpp's convert_lora_to_gguf.py --outtype f16 of each.
    lora-mlx                mlx-lm's own format of lora-peft (adapter_config.json with
                            fine_tune_type/num_layers/lora_parameters{rank,scale,dropout,
                            keys}, adapters.safetensors with model.layers.N.self_attn.
                            q_proj.lora_a [in, r] / lora_b [r, out]: PEFT's A and B
                            transposed), for mlx_lm.load(path, adapter_path=...).

A tiny Qwen2.5-VL (random weights, fixed seed), SmolLM2's tokenizer plus the five vision
tokens, Qwen2-VL's chat template:

    vl-hf        the transformers folder (+ preprocessor_config.json written here: no
                 image processor is instantiated, so neither PIL nor torchvision is needed)
    vl-gguf      convert_hf_to_gguf.py twice: the text model and ``--mmproj`` the projector
    vl-openvino  optimum-intel's main_export (image-text-to-text, fp32) in <root>/venv-optimum
                 (below), then the tokenizer IRs (openvino_tokenizers) and the
                 preprocessor_config.json that the export does not write

Traps met and avoided here: the vision depth must be >= 3 (llama.cpp maps
visual.merger.mlp.{bid} only for bid < depth); the LM head is untied (tied random
embeddings make greedy output all newlines); no token has an all-zero embedding row
(transformers zeroes the padding_idx row, and llama.cpp's qwen2vl graph turns such a token
into NaN logits for it and every later token: an empty reply).

venv-optimum: optimum-intel's Qwen2.5-VL export caps transformers at 5.0 while the fixtures
environment has 5.24, and optimum-intel itself wants huggingface-hub < 1.22. Rather than a
second torch + OpenVINO (about 1.3 GB and minutes), venv-optimum is a small venv (about
150 MB, about 20 s) whose own site-packages holds only OPTIMUM_REQUIREMENTS and what they
add, and which sees the fixtures environment's packages (torch, openvino,
openvino-tokenizers, numpy) through a .pth file placed after its own: its transformers
5.0.0 shadows the 5.24 there. optimum-intel is installed without its dependencies: nncf
(only for weight compression) and torchvision (only for its runtime classes) are not used
by an fp32 export.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

#: The LoRA adapters' recipe (in their fixture key: change anything, they are rebuilt).
LORA: dict[str, Any] = {
    "version": 1, "rank": 8, "alpha": 16, "std_b": 0.08,
    "targets": ["q_proj", "v_proj"], "seeds": {"lora-peft": 1, "lora-peft-b": 2},
    "base": "HuggingFaceTB/SmolLM2-135M-Instruct",
}
#: The tiny Qwen2.5-VL's recipe (in its fixture key).
VL: dict[str, Any] = {
    "version": 1, "seed": 0, "init_std": 0.02,
    "text": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2,
             "mrope_section": [2, 3, 3], "rope_theta": 1000000.0,
             "max_position_embeddings": 4096, "rms_norm_eps": 1e-6},
    "vision": {"depth": 4, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
               "fullatt_block_indexes": [1, 3], "window_size": 112, "patch_size": 14,
               "spatial_merge_size": 2, "temporal_patch_size": 2},
    # Qwen2.5-VL's own image preprocessing, but at most ~1 MP (1280 image tokens): what
    # OpenVINO GenAI resizes to; mtmd applies its own limits
    "preprocessor": {"min_pixels": 3136, "max_pixels": 1003520, "patch_size": 14,
                     "temporal_patch_size": 2, "merge_size": 2,
                     "image_mean": [0.48145466, 0.4578275, 0.40821073],
                     "image_std": [0.26862954, 0.26130258, 0.27577711],
                     "image_processor_type": "Qwen2VLImageProcessor",
                     "processor_class": "Qwen2_5_VLProcessor"},
}
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>",
                 "<|video_pad|>")
#: optimum-intel's exporter and what its Qwen2.5-VL config accepts (<= 5.0).
OPTIMUM_REQUIREMENTS = ("optimum-intel==2.2.0", "optimum==2.3.0", "transformers==5.0.0",
                        "huggingface-hub==1.21.0")

LORA_GGUF = {"lora-gguf": "SmolLM2-135M-Instruct-lora-a.F16.gguf",
             "lora-gguf-b": "SmolLM2-135M-Instruct-lora-b.F16.gguf"}
VL_NAME = "Tiny-Qwen2.5-VL"
VL_GGUF = f"{VL_NAME}.F16.gguf"
VL_MMPROJ = f"mmproj-{VL_NAME}.F16.gguf"

#: format -> (what it is built from, the files its folder must hold)
FORMATS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "lora-peft": (("hf",), ("adapter_config.json", "adapter_model.safetensors")),
    "lora-peft-b": (("hf",), ("adapter_config.json", "adapter_model.safetensors")),
    "lora-gguf": (("hf", "lora-peft"), (LORA_GGUF["lora-gguf"],)),
    "lora-gguf-b": (("hf", "lora-peft-b"), (LORA_GGUF["lora-gguf-b"],)),
    "lora-mlx": (("lora-peft",), ("adapter_config.json", "adapters.safetensors")),
    "vl-hf": (("hf",), ("config.json", "model.safetensors", "tokenizer.json",
                        "tokenizer_config.json", "preprocessor_config.json",
                        "generation_config.json", "chat_template.jinja")),
    "vl-gguf": (("vl-hf",), (VL_GGUF, VL_MMPROJ)),
    "vl-openvino": (("vl-hf",), (
        "openvino_language_model.xml", "openvino_language_model.bin",
        "openvino_text_embeddings_model.xml", "openvino_vision_embeddings_model.xml",
        "openvino_vision_embeddings_merger_model.xml", "openvino_tokenizer.xml",
        "openvino_detokenizer.xml", "preprocessor_config.json", "config.json",
        "generation_config.json")),
}
#: Written into every folder built here: its recipe and key (a stale one is rebuilt).
STAMP = "fixture.json"


# --- keys ----------------------------------------------------------------------------------

def recipe(fmt: str, lora: Mapping[str, Any] | None = None,
           vl: Mapping[str, Any] | None = None,
           optimum: Sequence[str] | None = None) -> dict[str, Any]:
    """What a fixture is made from, beyond the models' build key (source, converter pins)."""
    if fmt.startswith("lora-"):
        return {"lora": dict(lora if lora is not None else LORA)}
    out: dict[str, Any] = {"vl": dict(vl if vl is not None else VL)}
    if fmt == "vl-openvino":
        out["optimum"] = list(optimum if optimum is not None else OPTIMUM_REQUIREMENTS)
    return out


def fixture_key(fmt: str, build_key: str, **overrides: Any) -> str:
    """The key of one fixture: the models' build key plus its own recipe."""
    blob = json.dumps({"fmt": fmt, "build_key": build_key, **recipe(fmt, **overrides)},
                      sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def stamp_ok(folder: Path, fmt: str, build_key: str) -> bool:
    try:
        data = json.loads((folder / STAMP).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and data.get("key") == fixture_key(fmt, build_key)


def write_stamp(folder: Path, fmt: str, build_key: str) -> None:
    data = {"format": fmt, "key": fixture_key(fmt, build_key), **recipe(fmt)}
    (folder / STAMP).write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


# --- building (called by make_test_models.build_one) -----------------------------------------

Run = Callable[..., None]


def build(fmt: str, key_dir: Path, out: Path, py: Path, root: Path, *, script: Path,
          llama_src: Callable[[], Path], run: Run, env: Mapping[str, str],
          log: Callable[[str], None]) -> None:
    """Build one format of this module into ``out`` (a folder that does not exist yet)."""
    hf = key_dir / "hf"

    def step(name: str, src: Path, python: Path = py) -> None:
        run([str(python), str(script), "--step", name, str(src), str(out)], env=env)

    if fmt in ("lora-peft", "lora-peft-b"):
        step(fmt, hf)
    elif fmt in LORA_GGUF:
        peft = key_dir / ("lora-peft" if fmt == "lora-gguf" else "lora-peft-b")
        converter = llama_src().with_name("convert_lora_to_gguf.py")
        out.mkdir()
        run([str(py), str(converter), "--base", str(hf), "--outtype", "f16",
             "--outfile", str(out / LORA_GGUF[fmt]), str(peft)], env=env)
    elif fmt == "lora-mlx":
        step("lora-mlx", key_dir / "lora-peft")
    elif fmt == "vl-hf":
        step("vl-hf", hf)
    elif fmt == "vl-gguf":
        converter = llama_src()
        src = key_dir / "vl-hf"
        out.mkdir()
        for extra, name in (((), VL_GGUF), (("--mmproj",), VL_MMPROJ)):
            run([str(py), str(converter), str(src), *extra, "--outtype", "f16",
                 "--outfile", str(out / name), "--model-name", VL_NAME], env=env)
    elif fmt == "vl-openvino":
        step("vl-openvino", key_dir / "vl-hf", ensure_optimum_venv(root, py, run, log))
    else:  # pragma: no cover
        raise ValueError(f"no recipe for {fmt}")
    write_stamp(out, fmt, key_dir.name)


def ensure_optimum_venv(root: Path, tools_py: Path, run: Run,
                        log: Callable[[str], None]) -> Path:
    """<root>/venv-optimum: OPTIMUM_REQUIREMENTS over the fixtures environment (a .pth)."""
    venv = root / "venv-optimum"
    py = venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    tools_site = _purelib(tools_py)
    tools_stamp = tools_py.parent.parent / ".localrun-requirements.json"
    want = {"requirements": list(OPTIMUM_REQUIREMENTS), "tools_site": tools_site,
            "tools": tools_stamp.read_text() if tools_stamp.is_file() else ""}
    stamp = venv / ".localrun-requirements.json"
    if py.exists() and stamp.is_file():
        try:
            if json.loads(stamp.read_text()) == want:
                return py
        except (OSError, ValueError):
            pass
    t0 = time.monotonic()
    log(f"creating {venv}: " + " ".join(OPTIMUM_REQUIREMENTS) + " over the converters' "
        "environment")
    base = subprocess.run([str(tools_py), "-c", "import sys; print(sys._base_executable)"],
                          capture_output=True, text=True, check=True).stdout.strip()
    run([base, "-m", "venv", "--clear", str(venv)])
    # after its own site-packages: what is installed here shadows the fixtures' versions
    Path(_purelib(py), "_localrun_fixtures_env.pth").write_text(tools_site + "\n")
    intel, *rest = OPTIMUM_REQUIREMENTS
    run([str(py), "-m", "pip", "install", "--quiet", "--no-deps", intel])
    run([str(py), "-m", "pip", "install", "--quiet", *rest])
    stamp.write_text(json.dumps(want))
    log(f"{venv.name} ready in {time.monotonic() - t0:.1f} s")
    return py


def _purelib(py: Path) -> str:
    return subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()"
                           "['purelib'])"], capture_output=True, text=True,
                          check=True).stdout.strip()


# --- steps run inside the converters' environments (make_test_models.py --step) ------------

def step_lora_peft(fmt: str, hf: Path, out: Path) -> None:
    """A PEFT LoRA adapter for the hf fixture: A and B random from the format's seed."""
    import numpy as np
    from safetensors.numpy import save_file

    cfg = json.loads((hf / "config.json").read_text())
    hidden, layers = int(cfg["hidden_size"]), int(cfg["num_hidden_layers"])
    head_dim = int(cfg.get("head_dim") or hidden // int(cfg["num_attention_heads"]))
    out_dims = {"q_proj": int(cfg["num_attention_heads"]) * head_dim,
                "k_proj": int(cfg["num_key_value_heads"]) * head_dim,
                "v_proj": int(cfg["num_key_value_heads"]) * head_dim, "o_proj": hidden}
    r = int(LORA["rank"])
    rng = np.random.default_rng(int(LORA["seeds"][fmt]))
    tensors = {}
    for i in range(layers):
        for target in LORA["targets"]:
            prefix = f"base_model.model.model.layers.{i}.self_attn.{target}"
            a = rng.standard_normal((r, hidden)) / np.sqrt(hidden)
            b = rng.standard_normal((out_dims[target], r)) * float(LORA["std_b"])
            tensors[f"{prefix}.lora_A.weight"] = a.astype(np.float32)
            tensors[f"{prefix}.lora_B.weight"] = b.astype(np.float32)
    out.mkdir(parents=True)
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": LORA["base"],
        "r": r, "lora_alpha": LORA["alpha"], "lora_dropout": 0.0, "bias": "none",
        "target_modules": list(LORA["targets"]), "fan_in_fan_out": False,
        "inference_mode": True, "init_lora_weights": True, "modules_to_save": None,
        "use_dora": False, "use_rslora": False,
    }
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")


def step_lora_mlx(peft: Path, out: Path) -> None:
    """mlx-lm's adapter format of a PEFT adapter (same numbers, its names and layout)."""
    import numpy as np
    from safetensors.numpy import load_file, save_file

    cfg = json.loads((peft / "adapter_config.json").read_text())
    tensors, layers = {}, set()
    for name, value in load_file(str(peft / "adapter_model.safetensors")).items():
        mlx = (name.removeprefix("base_model.model.").replace(".lora_A.weight", ".lora_a")
               .replace(".lora_B.weight", ".lora_b"))
        tensors[mlx] = np.ascontiguousarray(value.T)  # mlx: x @ lora_a @ lora_b
        layers.add(int(mlx.split(".")[2]))
    out.mkdir(parents=True)
    save_file(tensors, str(out / "adapters.safetensors"), metadata={"format": "mlx"})
    config = {"fine_tune_type": "lora", "num_layers": len(layers),
              "lora_parameters": {"rank": cfg["r"], "scale": cfg["lora_alpha"] / cfg["r"],
                                  "dropout": 0.0,
                                  "keys": [f"self_attn.{t}" for t in cfg["target_modules"]]}}
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")


QWEN2_VL_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}<|im_end|>\n{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture "
    "{{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}Video "
    "{{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def step_vl_hf(hf: Path, out: Path) -> None:
    """The tiny Qwen2.5-VL in transformers' format, and a smoke test of both paths."""
    import torch
    from tokenizers import AddedToken
    from transformers import (
        AutoTokenizer,
        GenerationConfig,
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
    )

    tok = AutoTokenizer.from_pretrained(hf)
    tok.add_tokens([AddedToken(t, special=True, normalized=False) for t in VISION_TOKENS],
                   special_tokens=True)
    ids = {t: tok.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    text, vision = dict(VL["text"]), dict(VL["vision"])
    rope = {"rope_type": "default", "rope_theta": text.pop("rope_theta"),
            "mrope_section": text.pop("mrope_section")}
    config = Qwen2_5_VLConfig(
        # pad_token_id None: no padding_idx, so no all-zero embedding row (NaN in llama.cpp)
        text_config={**text, "vocab_size": len(tok), "rope_parameters": rope,
                     "bos_token_id": tok.bos_token_id, "eos_token_id": eos,
                     "pad_token_id": None, "tie_word_embeddings": False},
        vision_config={**vision, "out_hidden_size": text["hidden_size"], "in_channels": 3},
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=False)
    model = Qwen2_5_VLForConditionalGeneration(config).eval()
    # every weight from one generator, in name order: independent of transformers' init
    gen = torch.Generator().manual_seed(int(VL["seed"]))
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith(".bias"):
                p.zero_()
            elif p.ndim == 1:  # RMSNorm / LayerNorm weights
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * float(VL["init_std"]))
    emb = model.get_input_embeddings().weight
    if bool((emb.abs().sum(dim=1) == 0).any()):
        raise RuntimeError("an all-zero embedding row: llama.cpp would give NaN logits")
    model.generation_config = GenerationConfig(bos_token_id=tok.bos_token_id,
                                               eos_token_id=eos, pad_token_id=eos)
    model.save_pretrained(out, safe_serialization=True)
    tok.chat_template = QWEN2_VL_TEMPLATE
    tok.save_pretrained(out)
    (out / "chat_template.jinja").write_text(QWEN2_VL_TEMPLATE, encoding="utf-8")
    tcfg = json.loads((out / "tokenizer_config.json").read_text(encoding="utf-8"))
    for k in ("is_local", "local_files_only"):
        tcfg.pop(k, None)
    tcfg["chat_template"] = QWEN2_VL_TEMPLATE  # older loaders and ORT GenAI look here
    (out / "tokenizer_config.json").write_text(json.dumps(tcfg, indent=2) + "\n")
    (out / "preprocessor_config.json").write_text(json.dumps(VL["preprocessor"], indent=2)
                                                  + "\n")
    n = sum(p.numel() for p in model.parameters())
    # smoke test from the saved folder: text only, then 4 image tokens (a 56x56 image)
    m2 = Qwen2_5_VLForConditionalGeneration.from_pretrained(out).eval()
    tok2 = AutoTokenizer.from_pretrained(out)
    chat = tok2.apply_chat_template([{"role": "user", "content": "Describe this."}],
                                    add_generation_prompt=True, tokenize=False)
    with_image = chat.replace("Describe", "<|vision_start|>" + "<|image_pad|>" * 4
                              + "<|vision_end|>Describe")
    pixels = torch.randn((16, 3 * 2 * 14 * 14), generator=gen)
    replies = []
    for prompt, extra in ((chat, {}), (with_image, {
            "pixel_values": pixels, "image_grid_thw": torch.tensor([[1, 4, 4]])})):
        enc = tok2(prompt, return_tensors="pt")
        with torch.no_grad():
            ids_out = m2.generate(**enc, **extra, max_new_tokens=8, do_sample=False)
        replies.append(tok2.decode(ids_out[0, enc["input_ids"].shape[1]:]))
    print(f"vl-hf: {n} parameters; smoke test {replies!r}")
    if not replies[0].strip() or replies[0] == replies[1]:
        raise RuntimeError(f"the tiny VL model's smoke test failed: {replies!r}")


def step_vl_openvino(src: Path, out: Path) -> None:
    """optimum-intel's export (in venv-optimum), the tokenizer IRs, the preprocessor."""
    import transformers
    from optimum.exporters.openvino import main_export

    print(f"vl-openvino: exporting with transformers {transformers.__version__}")
    main_export(str(src), output=str(out), task="image-text-to-text", weight_format="fp32",
                library_name="transformers")
    _tokenizer_irs(src, out)
    shutil.copy2(src / "preprocessor_config.json", out / "preprocessor_config.json")
    shutil.copy2(src / "chat_template.jinja", out / "chat_template.jinja")
    # smoke test: OpenVINO GenAI's own VLM pipeline, with an image
    import numpy as np
    import openvino as ov
    import openvino_genai

    pipe = openvino_genai.VLMPipeline(str(out), "CPU")
    cfg = openvino_genai.GenerationConfig()
    cfg.max_new_tokens = 8
    img = np.zeros((1, 56, 84, 3), np.uint8)
    img[0, :, :, 0] = np.arange(84, dtype=np.uint8)[None, :] * 3
    texts = [pipe.generate("Describe this.", generation_config=cfg, **kw).texts[0]
             for kw in ({}, {"images": [ov.Tensor(img)]})]
    print(f"vl-openvino smoke test: {texts!r}")
    if not texts[0].strip() or texts[0] == texts[1]:
        raise RuntimeError(f"the exported VLM IR's smoke test failed: {texts!r}")


def _tokenizer_irs(src: Path, out: Path) -> None:
    """optimum-intel converts the tokenizer only from a loadable processor, which needs an
    image processor (PIL or torchvision): convert the tokenizer alone."""
    import openvino as ov
    import openvino_tokenizers
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(src)
    t, d = openvino_tokenizers.convert_tokenizer(tok, with_detokenizer=True,
                                                 skip_special_tokens=True)
    ov.save_model(t, out / "openvino_tokenizer.xml")
    ov.save_model(d, out / "openvino_detokenizer.xml")


def run_step(name: str, src: Path, out: Path) -> bool:
    """make_test_models.py --step NAME SRC OUT for this module's steps; False if not ours."""
    if name in ("lora-peft", "lora-peft-b"):
        step_lora_peft(name, src, out)
    elif name == "lora-mlx":
        step_lora_mlx(src, out)
    elif name == "vl-hf":
        step_vl_hf(src, out)
    elif name == "vl-openvino":
        step_vl_openvino(src, out)
    else:
        return False
    return True


if __name__ == "__main__":  # pragma: no cover - a module of make_test_models.py
    sys.exit("run scripts/make_test_models.py")
