#!/usr/bin/env bash
# Set up and run every test: the full suite on transformers 5.x, then the loss, packing, optimizer-integration and
# ND-refusal tests on transformers 4.57.x. Both environments are set up first (a 5.x test checks the 4.57 refusal),
# at the versions of the lock files in requirements/ (what CI tested; scripts/lock.sh regenerates them).
#
#   bash scripts/test.sh              # the README's test command (CI runs it): locked versions, every test
#   bash scripts/test.sh --quick      # a subset for iteration, under 5 minutes once the venvs exist (5.x only)
#   bash scripts/test.sh --latest     # the newest releases, no lock, in .venv-latest*: prints how they drift from
#                                     # the lock and which tests fail on them (how the lock gets bumped; not in CI)
#   bash scripts/test.sh --under-load 4   # any of the above beside 4 busy processes (scripts/under_load.sh starts
#                                     # and ends them): the suite as a shared, loaded machine runs it (docs/testing.md)
# Any other argument goes to pytest (e.g. -k packing, -x).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
# shellcheck source=scripts/envs.sh
source scripts/envs.sh
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
mode=locked
pytest_args=()
under_load=""
under_load_given=0
while [ $# -gt 0 ]; do
    case "$1" in
        --quick) mode=quick ;;
        --latest) mode=latest ;;
        --under-load) under_load_given=1 under_load="${2:-}"; shift $(( $# > 1 ? 1 : 0 )) ;;
        --under-load=*) under_load_given=1 under_load="${1#*=}" ;;
        *) pytest_args+=("$1") ;;
    esac
    shift
done
if [ "$under_load_given" = 1 ]; then
    if ! [[ "$under_load" =~ ^[0-9]+$ ]]; then
        echo "scripts/test.sh: --under-load '$under_load': expects a number of busy processes; e.g. --under-load 4" >&2
        exit 2
    fi
    # the same test command, beside N busy processes that scripts/under_load.sh starts and ends (even on failure)
    again=()
    [ "$mode" = locked ] || again+=("--$mode")
    exec bash scripts/under_load.sh "$under_load" bash scripts/test.sh "${again[@]}" "${pytest_args[@]}"
fi
start=$SECONDS
phase() { echo "== [test +$((SECONDS - start))s] $* =="; }

# The 4.57 phase: the modules whose behaviour differs between transformers 4.57 and 5.x (TRL needs 5.x: -k "not trl").
TF457_TESTS=(tests/trainer/test_harness_selfcheck.py tests/loss/test_exactness.py tests/loss/test_vlm_images.py
    tests/parallel/test_ddp.py tests/trainer/test_entry_points.py tests/packing/test_packing_trainer.py
    tests/packing/test_packing_collator.py tests/packing/test_packing_attention.py tests/packing/test_packing_guard.py
    tests/packing/test_packing_validate.py tests/packing/test_packing_stream.py tests/optim/test_optim_trainer.py
    tests/parallel/test_nd_parallel.py tests/diagnostics/test_noise_scale.py tests/plan/test_plan.py
    tests/diagnostics/test_memory_timeline.py tests/trainer/test_ecosystem.py tests/trainer/test_trainer_contract.py
    tests/trainer/test_nonfinite.py tests/config/test_conflicts.py tests/project/test_lock.py
    tests/parallel/test_pipeline.py tests/trainer/test_stock_parity.py tests/trainer/test_trainer_matrix.py
    tests/moe/test_moe.py tests/packing/test_packing_hybrid.py tests/loss/test_lean_head.py
    tests/packing/test_packing_vlm_rope.py)
# The 5.x suite runs as two pytest processes: these files after the 4.57 phase (in its stream), the rest beside them
# from the start, so that both cores stay busy to the end (one 5.x process left the second core mostly idle for the
# last 20 minutes). Chosen from per-file times (HF_GRADFIX_TIMINGS_DIR=DIR writes them; docs/testing.md): the two
# streams should end together. Every file runs exactly once: the first stream ignores these.
TF5_SECOND_STREAM=(tests/parallel/test_deepspeed.py tests/parallel/test_context_parallel.py
    tests/verify/test_verify.py tests/rl/test_rl.py tests/rl/test_rl_async.py tests/parallel/test_ep.py
    tests/optim/test_optim_distributed.py tests/trainer/test_compile.py tests/plan/test_plan_lean_head.py)
# --quick: pure math, configuration, the packer, the optimizers against their references, the loss fix against the
# ground truth (harness self-check, TokenWindow), the lock, the layout and the time bounds; no process launches (the
# distributed marker) and no docs build. Measured in docs/testing.md.
QUICK_TESTS=(tests/loss/test_loss_math.py tests/config/test_config.py tests/packing/test_packing_binpack.py
    tests/packing/test_packing_sampler.py tests/packing/test_packing_collator.py tests/optim/test_optim_unit.py
    tests/parallel/test_parallel_dims.py tests/trainer/test_harness_selfcheck.py tests/loss/test_token_window.py
    tests/project/test_lock.py tests/project/test_layout.py tests/project/test_time_bounds.py)

case "$mode" in
quick)
    phase "1/2 set up .venv (transformers 5.x, locked)"
    HF_GRADFIX_LOCK="$TF5_LOCK" bash scripts/setup_env.sh "$TF5_VENV" "$TF5_EXTRAS" "${TF5_ARGS[@]}"
    phase "2/2 quick subset on transformers 5.x (no process launches; the full run is bash scripts/test.sh)"
    "$TF5_VENV/bin/python" -m pytest -q -p no:cacheprovider -m "not distributed" "${QUICK_TESTS[@]}" "${pytest_args[@]}"
    phase "done: the quick subset passed"
    ;;
locked)
    phase "1/3 set up: $TF5_VENV (transformers 5.x) and $TF457_VENV (transformers 4.57.x), at the locked versions"
    # The two installs side by side (each is mostly one pip process; serially they took 6 min of the budget); the
    # 4.57 one's output is printed when both are done.
    setup_log=$(mktemp)
    ( HF_GRADFIX_LOCK="$TF457_LOCK" bash scripts/setup_env.sh "$TF457_VENV" "$TF457_EXTRAS" "${TF457_ARGS[@]}" \
        >"$setup_log" 2>&1; echo $? >"$setup_log.rc" ) &
    setup5=0
    HF_GRADFIX_LOCK="$TF5_LOCK" bash scripts/setup_env.sh "$TF5_VENV" "$TF5_EXTRAS" "${TF5_ARGS[@]}" || setup5=$?
    wait
    cat "$setup_log"
    setup457=$(cat "$setup_log.rc" 2>/dev/null || echo 1)
    rm -f "$setup_log" "$setup_log.rc"
    if [ "$setup5" != 0 ] || [ "$setup457" != 0 ]; then
        phase "FAILED: set-up of $TF5_VENV exit $setup5, of $TF457_VENV exit $setup457"
        exit 1
    fi

    # The two phases run side by side: each pytest is one thread (OMP_NUM_THREADS=1) and spends much of its time
    # waiting on launched processes, so on 2 cores the pair takes about as long as the 5.x phase alone (serially
    # they took 35 min of CI's 40-minute budget). Each phase has its own datasets / inductor caches; the 4.57
    # phase's output is kept in a log and printed when it ends.
    scratch=$(mktemp -d)
    log457="$scratch/tf457.log"
    log5b="$scratch/tf5-second.log"
    phase "2/3 + 3/3 side by side: (a) transformers 5.x, the full suite but ${#TF5_SECOND_STREAM[@]} files (a dot per test); (b) transformers 4.57.x (loss, ecosystem, packing, optimizer-integration, ND, noise-scale tests), then those ${#TF5_SECOND_STREAM[@]} files on 5.x, then a fresh venv from the README's install lines (output at the end)"
    status457=0
    # Inside this subshell `set -e` still holds: each step records its exit code with `&& ... || ...` (a bare
    # `cmd; echo $?` ended the subshell at the first failing phase, and the later ones never ran or printed).
    ( HF_DATASETS_CACHE="$scratch/datasets-457" TORCHINDUCTOR_CACHE_DIR="$scratch/inductor-457" \
        "$TF457_VENV/bin/python" -m pytest -q -p no:cacheprovider -rfE "${TF457_TESTS[@]}" -k "not trl" "${pytest_args[@]}" \
        >"$log457" 2>&1 && echo 0 >"$scratch/tf457.rc" || echo $? >"$scratch/tf457.rc"
      echo "== [test +$((SECONDS - start))s] transformers 4.57.x phase ended; the second 5.x stream starts ==" >"$log5b"
      HF_DATASETS_CACHE="$scratch/datasets-5b" TORCHINDUCTOR_CACHE_DIR="$scratch/inductor-5b" \
        "$TF5_VENV/bin/python" -m pytest -q -p no:cacheprovider -rfE "${TF5_SECOND_STREAM[@]}" "${pytest_args[@]}" \
        >>"$log5b" 2>&1 && echo 0 >"$scratch/tf5b.rc" || echo $? >"$scratch/tf5b.rc"
      echo "== [test +$((SECONDS - start))s] the second 5.x stream ended ==" >>"$log5b"
      # A fresh venv from the README's Install lines alone runs the README / quickstart snippets, the plan
      # --timeline example and the first CLI commands (~4 min, mostly pip; HF_GRADFIX_SKIP_FRESH_INSTALL=1 skips).
      if [ "${HF_GRADFIX_SKIP_FRESH_INSTALL:-0}" = 1 ]; then
          echo "== fresh-install check skipped (HF_GRADFIX_SKIP_FRESH_INSTALL=1) ==" >>"$log5b"; echo 0 >"$scratch/fresh.rc"
      else
          python3 scripts/fresh_install_check.py --newest-canary >>"$log5b" 2>&1 && echo 0 >"$scratch/fresh.rc" || echo $? >"$scratch/fresh.rc"
      fi ) &
    pid457=$!
    trap 'pkill -P "$pid457" 2>/dev/null; kill "$pid457" 2>/dev/null; exit 130' INT TERM
    status5=0
    ignore_second=()
    for f in "${TF5_SECOND_STREAM[@]}"; do ignore_second+=("--ignore=$f"); done
    HF_DATASETS_CACHE="$scratch/datasets-5" TORCHINDUCTOR_CACHE_DIR="$scratch/inductor-5" \
        "$TF5_VENV/bin/python" -m pytest -q -p no:cacheprovider -rfE --doctest-modules hf_gradfix tests \
        "${ignore_second[@]}" "${pytest_args[@]}" || status5=$?
    phase "2/3 transformers 5.x first stream ended (exit $status5); waiting for the 4.57.x phase and the second 5.x stream"
    wait "$pid457" || true
    status457=$(cat "$scratch/tf457.rc" 2>/dev/null || echo 1)
    status5b=$(cat "$scratch/tf5b.rc" 2>/dev/null || echo 1)
    status_fresh=$(cat "$scratch/fresh.rc" 2>/dev/null || echo 1)
    phase "3/3 transformers 4.57.x phase (exit $status457), its output:"
    cat "$log457"
    phase "the second transformers 5.x stream (exit $status5b) and the fresh-install check (exit $status_fresh), their output:"
    cat "$log5b"
    rm -rf "$scratch"
    if [ "$status5" -ne 0 ] || [ "$status5b" -ne 0 ] || [ "$status457" -ne 0 ] || [ "$status_fresh" -ne 0 ]; then
        phase "FAILED: transformers 5.x exit $status5 (first stream) and $status5b (second), transformers 4.57.x exit $status457, fresh install exit $status_fresh"
        exit 1
    fi
    phase "done: every phase passed"
    ;;
latest)
    # Fresh venvs every time: pip keeps what is installed, so only a new venv resolves the newest releases.
    latest5=.venv-latest latest457=.venv-latest-tf457
    phase "1/4 set up fresh $latest5 and $latest457 with the newest releases (no lock)"
    rm -rf "$latest5" "$latest457"
    HF_GRADFIX_LOCK= bash scripts/setup_env.sh "$latest5" "$TF5_EXTRAS" "${TF5_ARGS[@]}"
    HF_GRADFIX_LOCK= bash scripts/setup_env.sh "$latest457" "$TF457_EXTRAS" "${TF457_ARGS[@]}"
    phase "2/4 how the newest releases drift from the lock"
    python3 scripts/lockfile.py drift "$latest5" "$TF5_LOCK"
    python3 scripts/lockfile.py drift "$latest457" "$TF457_LOCK"
    log5=$(mktemp) log457=$(mktemp)
    phase "3/4 transformers 5.x, newest releases: full suite"
    status5=0
    HF_GRADFIX_LATEST=1 HF_GRADFIX_TF457_PYTHON="$root/$latest457/bin/python" "$latest5/bin/python" -m pytest -q -p no:cacheprovider -rfE \
        --doctest-modules hf_gradfix tests "${pytest_args[@]}" 2>&1 | tee "$log5" || status5=$?
    phase "4/4 transformers 4.57.x, newest 4.57 release"
    status457=0
    HF_GRADFIX_LATEST=1 "$latest457/bin/python" -m pytest -q -p no:cacheprovider -rfE "${TF457_TESTS[@]}" -k "not trl" "${pytest_args[@]}" \
        2>&1 | tee "$log457" || status457=$?
    phase "summary of the newest releases (the lock is bumped when both pass: bash scripts/lock.sh)"
    python3 scripts/lockfile.py drift "$latest5" "$TF5_LOCK"
    python3 scripts/lockfile.py drift "$latest457" "$TF457_LOCK"
    for log in "$log5" "$log457"; do
        grep -E "^(FAILED|ERROR) " "$log" | sed 's/^/[latest] /' || true
        tail -n 1 "$log" | sed 's/^/[latest] /'
    done
    rm -f "$log5" "$log457"
    if [ "$status5" -ne 0 ] || [ "$status457" -ne 0 ]; then
        phase "the newest releases FAIL tests above (5.x exit $status5, 4.57 exit $status457): keep the lock, fix the tests or the code"
        exit 1
    fi
    phase "done: the newest releases pass; bash scripts/lock.sh moves the lock to them"
    ;;
esac
