#!/usr/bin/env bash
# The main job: set up .venv and run the fine-tuning demo (reference vs stock Trainer vs hf_gradfix).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
# shellcheck source=scripts/envs.sh
source scripts/envs.sh
start=$SECONDS
echo "== [demo +0s] 1/2 set up .venv (first run: a few minutes of pip; a line per package) =="
HF_GRADFIX_LOCK="$TF5_LOCK" bash scripts/setup_env.sh "$TF5_VENV" demo
echo "== [demo +$((SECONDS - start))s] 2/2 fine-tuning: reference, stock Trainer, hf_gradfix (a line per run) =="
"$TF5_VENV/bin/python" examples/finetune_demo.py "$@"
echo "== [demo +$((SECONDS - start))s] done =="
