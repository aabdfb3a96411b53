"""Make the kit's tiny test model: a Llama with random weights, saved as HF safetensors.

    python make_models.py --tokenizer DIR --out DIR [--seed N]

Runs under a python with torch and transformers (the GPU machine's python3, or the
fixtures venv of scripts/make_test_models.py for the CPU rehearsal), on the CPU, so the
weights are the same wherever it runs. The tokenizer is SmolLM2's (carried in the bundle):
a real one, so the engines' converters and localrun's chat templates take their usual
paths. The answers are noise: this model tests code paths, not quality.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpu_kit import spec

DONE = ".kit-done.json"


def make_hf(tokenizer_dir: Path, out: Path, seed: int) -> dict[str, object]:
    import torch
    from transformers import AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    ids: dict[str, Any] = {k: tok.convert_tokens_to_ids(getattr(tok, f"{k}_token"))
                           for k in ("bos", "eos", "pad") if getattr(tok, f"{k}_token", None)}
    config = LlamaConfig(vocab_size=len(tok), bos_token_id=ids.get("bos"),
                         eos_token_id=ids.get("eos"), pad_token_id=ids.get("pad"),
                         **spec.TINY_LLAMA)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float16).eval()
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.generation_config = GenerationConfig(  # type: ignore[no-untyped-call]
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id)
    model.save_pretrained(str(tmp), safe_serialization=True)
    for name in spec.TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy2(tokenizer_dir / name, tmp / name)
    # smoke test: the saved folder loads and greedy-decodes (fp32 on the CPU)
    m2 = LlamaForCausalLM.from_pretrained(str(tmp), dtype=torch.float32)
    prompt = tok("The capital of France is", return_tensors="pt")
    with torch.no_grad():
        gen = m2.generate(**prompt, max_new_tokens=8, do_sample=False)
    text = tok.decode(gen[0][prompt["input_ids"].shape[1]:], skip_special_tokens=True)
    params = sum(p.numel() for p in model.parameters())
    facts: dict[str, object] = {"params": params, "vocab": len(tok), "seed": seed,
                                "config": spec.TINY_LLAMA, "smoke_text": text,
                                "torch": torch.__version__}
    (tmp / DONE).write_text(json.dumps(facts, indent=1) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return facts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizer", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seed", type=int, default=spec.TINY_SEED)
    args = ap.parse_args(argv)
    t0 = time.monotonic()
    facts = make_hf(args.tokenizer, args.out, args.seed)
    facts["seconds"] = round(time.monotonic() - t0, 2)
    print(json.dumps(facts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
