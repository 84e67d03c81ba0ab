#!/usr/bin/env bash
# Create (or reuse) a virtualenv and install hf_gradfix into it.
#   scripts/setup_env.sh VENV_DIR EXTRAS [EXTRA_PIP_ARGS...]
# torch is installed first, pinned (HF_GRADFIX_TORCH, default torch==2.13.0): a bare `torch` requirement
# would pull a multi-GB CUDA build on a machine that has none.
set -euo pipefail
venv="$1"; extras="$2"; shift 2
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python_bin="${PYTHON:-python3}"
if [ ! -x "$venv/bin/python" ]; then
    "$python_bin" -m venv "$venv"
fi
# pipefail (set above) keeps pip's exit status; the grep only drops this machine's noisy index warnings.
pip_q() { "$venv/bin/python" -m pip install --disable-pip-version-check -q "$@" 2>&1 | { grep -v "^WARNING: Location" || true; }; }
# shellcheck disable=SC2086  # HF_GRADFIX_TORCH may carry pip options (e.g. --index-url)
"$venv/bin/python" -c "import torch" 2>/dev/null || pip_q ${HF_GRADFIX_TORCH:-torch==2.13.0}
pip_q -e "$root[$extras]" "$@"
"$venv/bin/python" -c "import sys, torch, transformers, hf_gradfix; print(f'[setup] {sys.prefix}: torch {torch.__version__}, transformers {transformers.__version__}, hf_gradfix {hf_gradfix.__version__}')"
