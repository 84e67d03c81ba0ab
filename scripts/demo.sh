#!/usr/bin/env bash
# The main job: set up .venv and run the fine-tuning demo (reference vs stock Trainer vs hf_gradfix).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash scripts/setup_env.sh .venv demo
.venv/bin/python examples/finetune_demo.py "$@"
