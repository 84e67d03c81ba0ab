#!/usr/bin/env bash
# Set up and run every test: the full suite on transformers 5.x, then the loss, packing, optimizer-integration and
# ND-refusal tests on transformers 4.57.x. Both environments are set up first (a 5.x test checks the 4.57 refusal).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
start=$SECONDS
phase() { echo "== [test +$((SECONDS - start))s] $* =="; }

phase "1/3 set up: .venv (transformers 5.x) and .venv-tf457 (transformers 4.57.x)"
bash scripts/setup_env.sh .venv dev
bash scripts/setup_env.sh .venv-tf457 peft "transformers>=4.57,<4.58" "pytest>=8" "datasets>=3"

phase "2/3 transformers 5.x: full suite (about 12-20 min on 2 cores; pytest prints a dot per test and the percentage done)"
.venv/bin/python -m pytest -q -p no:cacheprovider --doctest-modules hf_gradfix tests "$@"

phase "3/3 transformers 4.57.x: loss, ecosystem, packing, optimizer-integration, ND, TokenWindow and noise-scale tests (about 7 min)"
.venv-tf457/bin/python -m pytest -q -p no:cacheprovider tests/test_harness_selfcheck.py tests/test_exactness.py tests/test_vlm_images.py tests/test_ddp.py tests/test_entry_points.py tests/test_packing_trainer.py tests/test_packing_collator.py tests/test_packing_attention.py tests/test_packing_guard.py tests/test_packing_validate.py tests/test_packing_stream.py tests/test_optim_trainer.py tests/test_nd_parallel.py tests/test_token_window.py tests/test_noise_scale.py tests/test_plan.py tests/test_memory_timeline.py tests/test_ecosystem.py tests/test_trainer_contract.py tests/test_nonfinite.py tests/test_conflicts.py -k "not trl" "$@"
phase "done: every phase passed"
