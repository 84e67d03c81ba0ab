#!/usr/bin/env bash
# The GPU check, run as-is on the offline GPU machine the device tool lends (docs/testing.md has the exact call):
#
#   bash scripts/gpu_check.sh                  # --profile full: every section in order of value (~5.5 min on an H100)
#   bash scripts/gpu_check.sh --profile rerun  # the smaller second call (~2.5 min)
#   bash scripts/gpu_check.sh --install-only   # steps 2-3 alone, on any machine (tests run it on CPU)
#   bash scripts/gpu_check.sh --real-size      # benchmarks/gpu_check_1b.py instead: the 1B-class check (~8 min)
#   (any other arguments go to benchmarks/gpu_check.py, e.g. --only packing,guard)
#
# On a machine without CUDA: prints one line ("gpu_check: skipped: ...") and exits 0, writing nothing.
# On a CUDA machine it downloads NOTHING (the lent machine has no network):
#   1. installs the wheels prepared here by scripts/gpu_wheels.sh (GPU_WHEELS_DIR, default .gpu-wheels/, carried
#      to the machine) with `pip install --no-index --no-deps --target` into a scratch folder (GPU_SITE, default
#      /tmp/hf_gradfix_site), and puts it on PYTHONPATH after the working tree: hf_gradfix is imported from the
#      tree, the preinstalled torch / transformers / accelerate / peft are used as they are;
#   2. says which imports work (a section whose package is missing reports "skipped", the rest runs);
#   3. runs benchmarks/gpu_check.py under `timeout`, writing gpu-check.md / gpu-check.json into $OUT (the device
#      tool's output folder; benchmarks/results/gpu-check/ elsewhere) after every section, and a log beside them.
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="${PYTHON:-python3}"

install_only=0
real_size=0
[ "${1:-}" = "--install-only" ] && { install_only=1; shift; }
[ "${1:-}" = "--real-size" ] && { real_size=1; shift; }

# ---- 1. is there a CUDA device at all? (nothing installed or written before this answer)
has_cuda=$install_only
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    has_cuda=1
elif "$py" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" >/dev/null 2>&1; then
    has_cuda=1
fi
if [ "$has_cuda" = 0 ]; then
    echo "gpu_check: skipped: no CUDA device (nvidia-smi found no GPU and torch.cuda.is_available() is False); nothing written"
    exit 0
fi

log() { echo "[gpu_check] $*"; }
out="${OUT:-$root/benchmarks/results/gpu-check}"
[ "$install_only" = 1 ] && out="${GPU_CHECK_LOG_DIR:-$(mktemp -d)}"
mkdir -p "$out"
wheels="${GPU_WHEELS_DIR:-$root/.gpu-wheels}"
site="${GPU_SITE:-/tmp/hf_gradfix_site}"
args=("$@")
[ "${#args[@]}" = 0 ] && args=(--profile full)
# the whole run's wall-clock bound (the profiles' section budgets sum to less; this catches a hang)
limit="${GPU_CHECK_TIMEOUT_S:-}"
if [ -z "$limit" ]; then
    case " ${args[*]} " in *" rerun "*) limit=170 ;; *) limit=470 ;; esac
fi
if [ "$real_size" = 1 ]; then
    [ "${#args[@]}" = 2 ] && [ "${args[0]}" = --profile ] && args=()  # the default profile is gpu_check.py's
    limit="${GPU_CHECK_TIMEOUT_S:-480}"
fi

{
# ---- 2. the carried wheels, offline
if compgen -G "$wheels/*.whl" >/dev/null; then
    if "$py" -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target "$site" "$wheels"/*.whl; then
        log "installed $(ls "$wheels"/*.whl | wc -l) wheels from $wheels into $site"
    else
        log "pip install --no-index from $wheels failed; going on with what imports"
    fi
else
    log "no wheels in $wheels (run scripts/gpu_wheels.sh where there is network, and carry the folder)"
fi
export PYTHONPATH="$root:$site${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1

# ---- 3. what imports here
"$py" - <<'PY'
import importlib, inspect
import os
names = os.environ.get("GPU_CHECK_IMPORTS", "torch transformers accelerate peft hf_gradfix datasets trl galore_torch "
                       "flash_attn fla causal_conv1d mamba_ssm").split()
for name in names:
    try:
        m = importlib.import_module(name)
        print(f"[gpu_check] import {name}: {getattr(m, '__version__', 'ok')} from {os.path.dirname(m.__file__ or '?')}")
    except Exception as e:
        print(f"[gpu_check] import {name}: FAILED ({type(e).__name__}: {str(e)[:160]})")
try:
    from torch.nn.attention.varlen import varlen_attn
    print(f"[gpu_check] varlen_attn{inspect.signature(varlen_attn)}")
except Exception as e:
    print(f"[gpu_check] torch.nn.attention.varlen.varlen_attn: {type(e).__name__}: {e}")
PY
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | sed 's/^/[gpu_check] gpu: /'
[ "$install_only" = 1 ] && exit 0

# ---- 4. run, bounded
cd "$root" || exit 1
if [ "$real_size" = 1 ]; then
    log "running benchmarks/gpu_check_1b.py ${args[*]} --out $out/gpu-check-1b.md (timeout ${limit} s)"
    timeout -k 10 "$limit" "$py" benchmarks/gpu_check_1b.py --out "$out/gpu-check-1b.md" "${args[@]}"
else
    log "running benchmarks/gpu_check.py ${args[*]} --out-dir $out (timeout ${limit} s)"
    timeout -k 10 "$limit" "$py" benchmarks/gpu_check.py --out-dir "$out" "${args[@]}"
fi
rc=$?
[ "$rc" = 124 ] && log "stopped at the ${limit} s bound: $out holds the sections that finished"
exit "$rc"
} 2>&1 | tee "$out/gpu-check.log"
exit "${PIPESTATUS[0]}"
