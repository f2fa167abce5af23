#!/usr/bin/env bash
# A real vLLM behind Kunlun on an NVIDIA GPU: the external-engine path end to end; first,
# the embedded engine's decode steps replayed from CUDA graphs against its eager path
# (scripts/graph_smoke.py: the same greedy tokens, and both decode rates).
#
# Starts kunlun-platform in a scratch KUNLUN_HOME, imports the demo model (a local file: no
# hub), submits it with `engine: vllm` on nvidia:0, waits until the node agent reports the
# replica ready (vLLM's /health), asks one chat completion through Kunlun's gateway, checks
# that vLLM's own metrics (vllm:*) appear in Kunlun's /metrics with the replica's labels, then
# stops the workload and the daemon. Exit 0 when all of that held; 77 (skip) when this
# machine has no NVIDIA GPU or no vLLM; 1 with the reason otherwise.
#
# usage: scripts/accelerator-smoke.sh [BIN_DIR]   (default .venv/bin; BIN_DIR holds
#        kunlun-platform, kunlun-cli and the python with vllm installed)
set -euo pipefail
BIN=${1:-.venv/bin}
PORT=${SMOKE_PORT:-18471}
TIMEOUT_S=${SMOKE_TIMEOUT_S:-600}

command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 || {
  echo "accelerator-smoke: no NVIDIA GPU here (nvidia-smi -L failed); skipped"; exit 77; }
graphs=0
"$BIN/python" "$(dirname "$0")/graph_smoke.py" || graphs=$?
[ "$graphs" -eq 0 ] || [ "$graphs" -eq 77 ] || {
  echo "accelerator-smoke: FAIL: decode steps from CUDA graphs differ from the eager path"; exit 1; }
"$BIN/python" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)" || {
  echo "accelerator-smoke: vllm is not importable by $BIN/python; skipped"; exit 77; }

home=$(mktemp -d)
trap 'kill "$daemon" 2>/dev/null || true; wait "$daemon" 2>/dev/null || true; rm -rf "$home"' EXIT
export KUNLUN_HOME=$home KUNLUN_ENDPOINT=http://127.0.0.1:$PORT
fail() { echo "accelerator-smoke: FAIL: $*"; tail -40 "$home"/logs/*.log 2>/dev/null || true; exit 1; }

"$BIN/kunlun-cli" model import-gguf --demo >/dev/null
"$BIN/kunlun-platform" --port "$PORT" >"$home/daemon.log" 2>&1 &
daemon=$!
for _ in $(seq 1 100); do
  curl -fs "$KUNLUN_ENDPOINT/healthz" >/dev/null && break
  sleep 0.2
done
printf 'model: smollm2\nengine: vllm\ndevice: nvidia:0\ndtype: bf16\nmax_model_len: 2048\nbatch_size: 16\n' >"$home/spec.yaml"
job=$("$BIN/kunlun-cli" workload submit --file "$home/spec.yaml" --json | "$BIN/python" -c \
  'import json, sys; print(json.load(sys.stdin)["workload_id"])') || fail "submit refused"
deadline=$((SECONDS + TIMEOUT_S))
until curl -fs "$KUNLUN_ENDPOINT/readyz" >/dev/null; do
  state=$("$BIN/kunlun-cli" workload describe "$job" --json | "$BIN/python" -c \
    'import json, sys; print(json.load(sys.stdin)["state"])')
  [ "$state" = FAILED ] && fail "workload $job FAILED"
  [ $SECONDS -gt $deadline ] && fail "no ready replica within $TIMEOUT_S s"
  sleep 2
done
answer=$(curl -fs "$KUNLUN_ENDPOINT/v1/chat/completions" -H 'Content-Type: application/json' \
  -d '{"model": "smollm2", "messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 16, "temperature": 0}') \
  || fail "the chat completion through the gateway failed"
echo "$answer" | grep -q '"content"' || fail "no answer: $answer"
curl -fs "$KUNLUN_ENDPOINT/metrics" | grep -q "^vllm:.*replica=\"$job-r0\"" \
  || fail "vLLM's metrics are not in Kunlun's /metrics"
"$BIN/kunlun-cli" workload stop "$job" >/dev/null
echo "accelerator-smoke: PASS (vLLM on nvidia:0 through Kunlun: $(echo "$answer" | head -c 200))"
