#!/usr/bin/env bash
# Prove the CUDA paths in one command: bash scripts/gpu_check.sh [benchmarks/gpu_check.py options, e.g. --quick]
#
# On a machine without CUDA: prints one line ("gpu_check: skipped: ...") and exits 0, writing nothing.
# On a CUDA machine (bare, with Python >= 3.10):
#   1. creates or reuses .venv-gpu (HF_GRADFIX_GPU_VENV) with --system-site-packages, so a torch already installed
#      for this GPU is reused;
#   2. installs torch only if no CUDA-enabled torch imports (HF_GRADFIX_TORCH overrides; else the PyTorch index
#      matching the driver's CUDA version from nvidia-smi);
#   3. installs hf_gradfix[dev] (transformers, accelerate, TRL, galore-torch, pytest...), never touching torch;
#   4. installs flash-attn from a prebuilt wheel only where one matches the installed torch / CUDA / Python / C++ ABI
#      (FLASH_ATTN_WHEEL=path-or-URL overrides); otherwise says so, and the FA2 checks report "skipped";
#   5. runs benchmarks/gpu_check.py, which writes benchmarks/results/gpu-check.md (markdown + a JSON block).
# Installs that fail (e.g. no network) are reported and the run goes on with what imports.
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python_bin="${PYTHON:-python3}"

# ---- 1. is there a CUDA device at all? (no venv, no install before this answer)
has_cuda=0
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    has_cuda=1
elif "$python_bin" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" >/dev/null 2>&1; then
    has_cuda=1
fi
if [ "$has_cuda" = 0 ]; then
    echo "gpu_check: skipped: no CUDA device (nvidia-smi found no GPU and torch.cuda.is_available() is False); nothing written"
    exit 0
fi

log() { echo "[gpu_check] $*"; }
venv="${HF_GRADFIX_GPU_VENV:-$root/.venv-gpu}"
if [ ! -x "$venv/bin/python" ]; then
    log "creating $venv (--system-site-packages: reuses a preinstalled CUDA torch)"
    "$python_bin" -m venv --system-site-packages "$venv" || { echo "gpu_check: error: cannot create $venv"; exit 1; }
fi
py="$venv/bin/python"
# short timeouts: a machine without network should fail over to "go on with what imports" quickly
pip_i() { "$py" -m pip install --disable-pip-version-check -q --retries 1 --timeout 20 "$@"; }

# ---- 2. torch with CUDA
if ! "$py" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" >/dev/null 2>&1; then
    if [ -n "${HF_GRADFIX_TORCH:-}" ]; then
        spec="$HF_GRADFIX_TORCH"
    else
        # the newest PyTorch CUDA build this driver can run
        drv="$(nvidia-smi 2>/dev/null | sed -n 's/.*CUDA Version: *\([0-9]*\)\.\([0-9]*\).*/\1\2/p' | head -1)"
        drv="${drv:-0}"
        if   [ "$drv" -ge 128 ]; then spec="torch --index-url https://download.pytorch.org/whl/cu128"
        elif [ "$drv" -ge 126 ]; then spec="torch --index-url https://download.pytorch.org/whl/cu126"
        elif [ "$drv" -ge 124 ]; then spec="torch --index-url https://download.pytorch.org/whl/cu124"
        elif [ "$drv" -ge 121 ]; then spec="torch --index-url https://download.pytorch.org/whl/cu121"
        else spec="torch --index-url https://download.pytorch.org/whl/cu118"; fi
    fi
    log "installing $spec"
    # shellcheck disable=SC2086  # spec may carry pip options
    pip_i $spec || log "torch install failed"
fi
if ! "$py" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" >/dev/null 2>&1; then
    echo "gpu_check: error: a GPU is present but no CUDA-enabled torch imports in $venv (set HF_GRADFIX_TORCH)"
    exit 1
fi
torch_ver="$("$py" -c "import torch; print(torch.__version__.split('+')[0])")"
constraint="$(mktemp)"; echo "torch==$torch_ver" > "$constraint"

# ---- 3. hf_gradfix and its test dependencies (torch pinned to what is installed)
if ! PYTHONPATH="$root" "$py" -c "import hf_gradfix, transformers, accelerate, trl, galore_torch, pytest" >/dev/null 2>&1; then
    log "installing hf_gradfix[dev] (torch kept at $torch_ver)"
    pip_i -c "$constraint" -e "$root[dev]" || log "hf_gradfix[dev] install failed; going on with what imports"
fi

# ---- 4. flash-attn: a prebuilt wheel that matches, or nothing
if ! "$py" -c "import flash_attn" >/dev/null 2>&1; then
    if [ -n "${FLASH_ATTN_WHEEL:-}" ]; then
        wheels=("$FLASH_ATTN_WHEEL")
    else
        mapfile -t wheels < <(PYTHONPATH="$root" "$py" "$root/benchmarks/gpu_check.py" --flash-attn-wheels)
    fi
    fa_done=0
    for w in "${wheels[@]}"; do
        if pip_i --no-deps "$w" >/dev/null 2>&1 && "$py" -c "import flash_attn" >/dev/null 2>&1; then
            log "flash-attn installed from $w"; fa_done=1; break
        fi
    done
    if [ "$fa_done" = 0 ]; then
        log "flash-attn: no prebuilt wheel matches this machine (tried: ${wheels[*]}); FA2 checks will be skipped" \
            "(set FLASH_ATTN_WHEEL to a wheel built for torch $torch_ver)"
    fi
fi
rm -f "$constraint"

# ---- 5. run
cd "$root" || exit 1
log "running benchmarks/gpu_check.py $*"
PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false \
    exec "$py" benchmarks/gpu_check.py "$@"
