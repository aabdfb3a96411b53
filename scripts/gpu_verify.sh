#!/usr/bin/env bash
# GPU verification of the ExLlamaV2 and ExLlamaV3 backends (issue 6).
#
# NOT RUN YET: written on a host without a GPU; nothing here has been executed on one.
# Run it on a Linux host with an NVIDIA GPU (ExLlamaV3 needs compute capability >= 8.0),
# a driver, and the CUDA toolkit (both engines build their extension on first import:
# set CUDA_HOME if nvcc is not on PATH). It:
#   1. makes its own virtual environment (.venv-gpu; never touches .venv) with localrun,
#      a CUDA build of torch, exllamav2 0.3.2 and exllamav3 (latest), pytest;
#   2. takes the SmolLM2-135M-Instruct HF folder built by scripts/make_test_models.py
#      (manifest ~/.cache/localrun/test-models/manifest.json, key models.hf; built if missing);
#   3. quantizes it to EXL2 (exllamav2's convert, 4.0 bpw) and EXL3 (exllamav3's convert);
#   4. runs tests/test_exllama.py (GPU tests included) and tests/test_conformance.py for
#      both backends;
#   5. prints tokens/s and TTFT per backend, with the GPU's name, for the docs.
#
#   bash scripts/gpu_verify.sh            # everything
#   SKIP_INSTALL=1 bash scripts/gpu_verify.sh    # reuse .venv-gpu
# Env: GPU_VENV (default .venv-gpu), TORCH_INDEX (pip index for torch, default PyPI's
# CUDA build), OUT (default ~/.cache/localrun/exllama-verify), BITS (default 4.0).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
VENV="${GPU_VENV:-$REPO/.venv-gpu}"
OUT="${OUT:-$HOME/.cache/localrun/exllama-verify}"
BITS="${BITS:-4.0}"
PY="$VENV/bin/python"
log() { printf '\n== %s\n' "$*" >&2; }

log "GPU"
nvidia-smi --query-gpu=index,name,compute_cap,memory.total,memory.free,driver_version \
    --format=csv,noheader || { echo "nvidia-smi failed: no usable NVIDIA GPU here" >&2; exit 2; }
GPU_NAME="$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n1)"

if [[ -z "${SKIP_INSTALL:-}" ]]; then
    log "virtual environment $VENV"
    python3 -m venv "$VENV"
    "$PY" -m pip install -q --upgrade pip
    if [[ -n "${TORCH_INDEX:-}" ]]; then
        "$PY" -m pip install -q torch --index-url "$TORCH_INDEX"
    else
        "$PY" -m pip install -q torch    # Linux PyPI wheels are CUDA builds
    fi
    "$PY" -m pip install -q -e ".[llama-cpp]" pytest "exllamav2==0.3.2" exllamav3
    # flash-attn is optional: without it ExLlamaV2 runs unpaged (one sequence at a time).
    "$PY" -m pip install -q flash-attn --no-build-isolation \
        || echo "flash-attn not installed: ExLlamaV2 will run with paged=False" >&2
fi
"$PY" - <<'EOF'
import torch
assert torch.cuda.is_available(), "torch sees no CUDA device"
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0))
EOF

log "source model (HF folder from scripts/make_test_models.py)"
hf_path() {
    python3 - <<'EOF'
import json, os, pathlib
root = pathlib.Path(os.environ.get("LOCALRUN_TEST_MODELS") or
                    pathlib.Path.home() / ".cache/localrun/test-models")
try:
    m = json.loads((root / "manifest.json").read_text())
except (OSError, ValueError):
    raise SystemExit(0)
p = (m.get("models") or {}).get("hf") or m.get("hf")
print(p or "")
EOF
}
HF="$(hf_path)"
if [[ -z "$HF" || ! -d "$HF" ]]; then
    python3 scripts/make_test_models.py --only hf
    HF="$(hf_path)"
fi
[[ -d "$HF" ]] || { echo "no HF folder of SmolLM2-135M-Instruct; see scripts/make_test_models.py" >&2; exit 3; }
echo "HF folder: $HF"

mkdir -p "$OUT"
EXL2="$OUT/smollm2-135m-exl2-${BITS}bpw"
EXL3="$OUT/smollm2-135m-exl3-${BITS}bpw"

if [[ ! -f "$EXL2/config.json" ]]; then
    log "EXL2 quantization (exllamav2 convert, $BITS bpw)"
    rm -rf "$OUT/work-exl2" "$EXL2"; mkdir -p "$OUT/work-exl2" "$EXL2"
    "$PY" -m exllamav2.conversion.convert_exl2 -i "$HF" -o "$OUT/work-exl2" -cf "$EXL2" \
        -b "$BITS"
fi
if [[ ! -f "$EXL3/config.json" ]]; then
    log "EXL3 quantization (exllamav3 convert, $BITS bpw)"
    rm -rf "$OUT/work-exl3" "$EXL3"; mkdir -p "$OUT/work-exl3"
    "$PY" -m exllamav3.conversion.convert_model -i "$HF" -o "$EXL3" -w "$OUT/work-exl3" \
        -b "$BITS"
fi
export LOCALRUN_EXL2_MODEL="$EXL2" LOCALRUN_EXL3_MODEL="$EXL3"
"$PY" -m localrun plan "$EXL2" || true

status=0
log "tests/test_exllama.py (pure parts and GPU tests)"
"$PY" -m pytest tests/test_exllama.py -v -rs || status=1
if [[ -f tests/test_conformance.py ]]; then
    log "conformance suite on both backends"
    "$PY" -m pytest tests/test_conformance.py -v -rs -k "exllamav2 or exllamav3" || status=1
else
    echo "tests/test_conformance.py is not in this checkout: conformance NOT run" >&2
    status=1
fi

log "tokens/s and TTFT ($GPU_NAME)"
GPU_NAME="$GPU_NAME" "$PY" - <<'EOF'
import os, statistics, localrun
gpu = os.environ["GPU_NAME"]
prompt = "Write a short story about a lighthouse keeper."
for backend, env in (("exllamav2", "LOCALRUN_EXL2_MODEL"), ("exllamav3", "LOCALRUN_EXL3_MODEL")):
    try:
        with localrun.load(os.environ[env], backend=backend, context=2048) as m:
            m.chat("Hi", temperature=0, max_tokens=8)  # warm-up
            runs = [m.chat(prompt, temperature=0, max_tokens=128) for _ in range(5)]
            ttft = statistics.median(r.timings.ttft for r in runs) * 1000
            tps = statistics.median(r.timings.decode_tps for r in runs)
            pps = statistics.median(r.timings.prefill_tps for r in runs)
            toks = runs[0].usage.completion_tokens
            print(f"{backend:10} {m.info.quantization or '?':8} {gpu}: decode {tps:8.1f} tok/s, "
                  f"prefill {pps:8.1f} tok/s, TTFT {ttft:7.2f} ms "
                  f"(median of 5, {toks} new tokens, prompt {runs[0].usage.prompt_tokens})")
    except Exception as e:  # report and go on to the other engine
        print(f"{backend:10} FAILED: {type(e).__name__}: {e}")
EOF
exit $status
