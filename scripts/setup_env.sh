#!/usr/bin/env bash
# Create (or reuse) a virtualenv and install hf_gradfix into it.
#   scripts/setup_env.sh VENV_DIR EXTRAS [EXTRA_PIP_ARGS...]
# torch is installed first, pinned (HF_GRADFIX_TORCH, default torch==2.13.0; it may carry pip options, e.g.
# HF_GRADFIX_TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu" for PyTorch's CPU-only build).
# A torch already importable in the venv is kept as it is.
# HF_GRADFIX_LOCK: a lock file (requirements/lock-*.txt) passed to pip as constraints (-c), so that every other
# package gets the version CI tested; empty: no lock, pip resolves the newest releases the ranges allow.
# Progress: one "[setup +Ns]" line per step, and pip's own lines for what it downloads and installs.
set -euo pipefail
venv="$1"; extras="$2"; shift 2
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python_bin="${PYTHON:-python3}"
start=$SECONDS
step() { echo "[setup +$((SECONDS - start))s] $*"; }
if [ ! -x "$venv/bin/python" ]; then
    step "creating virtualenv $venv ($python_bin)"
    "$python_bin" -m venv "$venv"
fi
# pipefail (set above) keeps pip's exit status. The filter drops this machine's noisy index warnings and pip's
# "already satisfied" lines, and keeps a line per package it collects, downloads and installs.
pip_progress() {
    "$venv/bin/python" -m pip install --disable-pip-version-check --progress-bar off "$@" 2>&1 \
        | { grep -v -e "^WARNING: Location" -e "^Requirement already satisfied" -e "^  Using cached" -e "^Looking in" \
                   -e "^  Stored in directory" -e "^  Created wheel" || true; } \
        | sed -u 's/^/    /'
}
if "$venv/bin/python" -c "import torch" 2>/dev/null; then
    step "torch $("$venv/bin/python" -c 'import torch; print(torch.__version__)') already installed: kept"
else
    torch_spec="${HF_GRADFIX_TORCH:-torch==2.13.0}"
    step "installing $torch_spec (the largest download; pip lists each package below) ..."
    # shellcheck disable=SC2086  # HF_GRADFIX_TORCH may carry pip options (e.g. --index-url): split on purpose
    pip_progress $torch_spec
fi
lock="${HF_GRADFIX_LOCK:-}"
if [ -n "$lock" ]; then
    [ -f "$lock" ] || { echo "setup_env.sh: HF_GRADFIX_LOCK=$lock: no such file; fix: run from the repository root, or unset it to install the newest releases" >&2; exit 2; }
    step "installing hf_gradfix[$extras] ${*:+$* }(transformers, accelerate, ...) at the versions of $lock ..."
    pip_progress -e "$root[$extras]" "$@" -c "$lock"
else
    step "installing hf_gradfix[$extras] ${*:+$* }(transformers, accelerate, ...): newest releases, no lock ..."
    pip_progress -e "$root[$extras]" "$@"
fi
step "checking the install ..."
"$venv/bin/python" -c "import sys, torch, transformers, hf_gradfix; print(f'[setup] {sys.prefix}: torch {torch.__version__}, transformers {transformers.__version__}, hf_gradfix {hf_gradfix.__version__}')"
step "done"
