#!/usr/bin/env bash
# The tinker-cookbook's offline recipes, unmodified, against a local OpenTinker server on CPU.
#
#   make install-cookbook          # tinker-cookbook 0.6.1 and what its recipes import
#   examples/tinker/cookbook_recipes.sh
#
# Starts `opentinker-server serve` on 127.0.0.1 (a fresh data dir), makes a user and key with
# the admin CLI, then runs through the official `tinker` SDK:
#   (a) supervised learning: the cookbook's supervised.train loop on its bundled
#       example_data/conversations.jsonl (examples/tinker/sl_conversations.py), and
#   (b) RL: `python -m tinker_cookbook.recipes.math_rl.train env=arithmetic ...`.
# The model is the embedded tiny model, named by its folder: the cookbook loads the tokenizer
# from there and the server maps the folder to the model it serves. Both recipes get an
# explicit renderer (the cookbook's renderer table only knows hosted models): role_colon for SL,
# which works with any tokenizer; qwen3_instruct for RL, because it renders exactly the ChatML
# the tiny model was warmed up on. Under role_colon the tiny model answers no arithmetic
# problem right, so every group's rewards are equal and RL has nothing to learn from.
# On 2 CPU cores (busy with other work too) (a) took 1 minute and (b) 6-7 minutes. The RL
# reward rises slowly on this model (math_rl's arithmetic env always puts a few-shot turn before
# the question, which the tiny model was never shown): RL_ARGS="max_steps=80" shows it best.
#
# Settings (environment):
#   VENV=.venv  OUT_DIR=<new temp dir>  PORT=<a free one>  RECIPES="sl rl"
#   SL_ARGS="..."   more chz overrides for sl_conversations.py (e.g. learning_rate=3e-4)
#   RL_LOSS=importance_sampling (or ppo, cispo, dro, stable_reinforce: math_rl's own default)
#   RL_RENDERER=qwen3_instruct
#   RL_ARGS="..."   more math_rl.train overrides (e.g. max_steps=80 learning_rate=5e-4)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
VENV="${VENV:-$ROOT/.venv}"
PY="$VENV/bin/python"
RECIPES="${RECIPES:-sl rl}"
RL_LOSS="${RL_LOSS:-importance_sampling}"
OUT_DIR="${OUT_DIR:-$(mktemp -d -t opentinker-cookbook.XXXXXX)}"
mkdir -p "$OUT_DIR"
OUT_DIR="$(cd "$OUT_DIR" && pwd)"

"$PY" -c "import tinker_cookbook" 2>/dev/null || {
    echo "tinker-cookbook is not installed in $VENV: run 'make install-cookbook' first" >&2; exit 1; }

export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TINKER_TELEMETRY=0
export TINKER_COOKBOOK_RUNS_DIR="$OUT_DIR/runs"

PORT="${PORT:-$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}"
DATA_DIR="$(mktemp -d -t opentinker-server.XXXXXX)"
SERVER_LOG="$OUT_DIR/server.log"
BASE_URL="http://127.0.0.1:$PORT"
SERVER_PID=""

cleanup() {
    local rc=$?
    if [[ -n "$SERVER_PID" ]] && kill -0 "$SERVER_PID" 2>/dev/null; then
        echo "== stopping the server (pid $SERVER_PID)"
        kill -INT "$SERVER_PID" 2>/dev/null || true
        for _ in $(seq 1 60); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 0.5; done
        kill -KILL "$SERVER_PID" 2>/dev/null || true
        wait "$SERVER_PID" 2>/dev/null || true
    fi
    rm -rf "$DATA_DIR"
    echo "== outputs in $OUT_DIR (server log: $SERVER_LOG)"
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

TINY="$("$PY" -c 'from opentinker.tiny import ensure_tiny_model; print(ensure_tiny_model())')"
echo "== tiny model: $TINY"

echo "== starting opentinker-server on $BASE_URL (data: $DATA_DIR, log: $SERVER_LOG)"
"$VENV/bin/opentinker-server" serve --host 127.0.0.1 --port "$PORT" --data-dir "$DATA_DIR" \
    --log-level warning >"$SERVER_LOG" 2>&1 &
SERVER_PID=$!

"$VENV/bin/opentinker-server" admin create-user --data-dir "$DATA_DIR" cookbook >/dev/null
KEY="$("$VENV/bin/opentinker-server" admin create-key --data-dir "$DATA_DIR" cookbook | tail -n 1)"
export TINKER_BASE_URL="$BASE_URL" TINKER_API_KEY="tml-$KEY"

for i in $(seq 1 240); do
    curl -fsS "$BASE_URL/v1/health" >/dev/null 2>&1 && break
    kill -0 "$SERVER_PID" 2>/dev/null || { echo "the server exited; its log:" >&2; cat "$SERVER_LOG" >&2; exit 1; }
    [[ $i == 240 ]] && { echo "the server did not answer /v1/health in 120 s" >&2; exit 1; }
    sleep 0.5
done
echo "== server is up"

# first -> last value of a metric in a cookbook metrics.jsonl (rows without it are skipped),
# and the means of the first and last 10 (one RL step's reward is noisy)
summarize() {
    "$PY" - "$@" <<'EOF'
import json, sys
path, keys = sys.argv[1], sys.argv[2:]
rows = [json.loads(line) for line in open(path) if line.strip()]
print(f"   {path}: {len(rows)} rows")
for key in keys:
    seen = [(r.get("step"), r[key]) for r in rows if isinstance(r.get(key), (int, float))]
    if seen:
        (s0, v0), (s1, v1) = seen[0], seen[-1]
        line = f"   {key}: {v0:.4f} (step {s0}) -> {v1:.4f} (step {s1}) over {len(seen)} rows"
        if len(seen) >= 20:
            first, last = [v for _, v in seen[:10]], [v for _, v in seen[-10:]]
            line += f"; mean of first 10 {sum(first) / 10:.4f} -> last 10 {sum(last) / 10:.4f}"
        print(line)
EOF
}

if [[ " $RECIPES " == *" sl "* ]]; then
    SL_LOG="$OUT_DIR/sl_conversations"
    echo "== (a) supervised: cookbook supervised.train on example_data/conversations.jsonl -> $SL_LOG"
    start=$SECONDS
    # shellcheck disable=SC2086
    "$PY" "$ROOT/examples/tinker/sl_conversations.py" model_name="$TINY" renderer_name=role_colon \
        log_path="$SL_LOG" learning_rate=1e-3 lora_rank=16 num_epochs=3 eval_every=5 ${SL_ARGS:-}
    echo "== (a) done in $((SECONDS - start)) s; metrics: $SL_LOG/metrics.jsonl"
    summarize "$SL_LOG/metrics.jsonl" train_mean_nll test/nll
fi

if [[ " $RECIPES " == *" rl "* ]]; then
    RL_LOG="$OUT_DIR/math_rl_arithmetic_$RL_LOSS"
    echo "== (b) RL: tinker_cookbook.recipes.math_rl.train env=arithmetic loss_fn=$RL_LOSS -> $RL_LOG"
    start=$SECONDS
    # shellcheck disable=SC2086
    "$PY" -m tinker_cookbook.recipes.math_rl.train env=arithmetic model_name="$TINY" \
        renderer_name="${RL_RENDERER:-qwen3_instruct}" loss_fn="$RL_LOSS" lora_rank=16 learning_rate=1e-3 \
        groups_per_batch=16 group_size=16 max_tokens=8 max_steps=40 eval_every=0 save_every=0 \
        log_path="$RL_LOG" behavior_if_log_dir_exists=delete base_url="$BASE_URL" ${RL_ARGS:-}
    echo "== (b) done in $((SECONDS - start)) s; metrics: $RL_LOG/metrics.jsonl"
    summarize "$RL_LOG/metrics.jsonl" env/all/reward/total env/all/correct env/all/format
fi
