#!/usr/bin/env bash
# Regenerate the lock files in requirements/ from clean resolves: a fresh venv per environment of the test command,
# installed without any lock (the newest releases the ranges in pyproject.toml allow), then `pip freeze` of it
# (scripts/lockfile.py freeze). Run the test command afterwards; commit the locks when it passes.
#   bash scripts/lock.sh            # both locks (requirements/lock-tf5.txt, requirements/lock-tf457.txt)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
# shellcheck source=scripts/envs.sh
source scripts/envs.sh
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
echo "[lock] fresh resolve for $TF5_LOCK"
HF_GRADFIX_LOCK= bash scripts/setup_env.sh "$work/tf5" "$TF5_EXTRAS" "${TF5_ARGS[@]}"
python3 scripts/lockfile.py freeze "$work/tf5" "$TF5_LOCK"
echo "[lock] fresh resolve for $TF457_LOCK"
HF_GRADFIX_LOCK= bash scripts/setup_env.sh "$work/tf457" "$TF457_EXTRAS" "${TF457_ARGS[@]}"
python3 scripts/lockfile.py freeze "$work/tf457" "$TF457_LOCK"
echo "[lock] done; now run: bash scripts/test.sh"
