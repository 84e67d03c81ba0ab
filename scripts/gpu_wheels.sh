#!/usr/bin/env bash
# Download, HERE (with network), the pure-Python wheels the offline GPU machine lacks, for scripts/gpu_check.sh.
#
#   bash scripts/gpu_wheels.sh               # downloads scripts/gpu_wheels.txt into .gpu-wheels/, prints sizes
#   bash scripts/gpu_wheels.sh --dry-run     # prints the pip command and checks the size of what is there
#   bash scripts/gpu_wheels.sh --check-only  # only the size check of the folder
#
# The folder is git-ignored and travels to the GPU machine through the device tool's `carry` (docs/testing.md).
# What travels (the repository's tracked and untracked-not-ignored files, plus carried paths) must stay under
# 64 MiB: the script fails when the folder plus the repository exceed it.
# Environment: GPU_WHEELS_DIR (folder, default .gpu-wheels), GPU_WHEELS_REQUIREMENTS (default
# scripts/gpu_wheels.txt), GPU_CARRY_LIMIT_BYTES (default 67108864), PYTHON (default python3).
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dir="${GPU_WHEELS_DIR:-$root/.gpu-wheels}"
reqs="${GPU_WHEELS_REQUIREMENTS:-$root/scripts/gpu_wheels.txt}"
limit="${GPU_CARRY_LIMIT_BYTES:-67108864}"
py="${PYTHON:-python3}"
mode="download"
case "${1:-}" in
    --dry-run) mode="dry-run" ;;
    --check-only) mode="check-only" ;;
    "") ;;
    *) echo "gpu_wheels: error: unknown option '$1' (use --dry-run or --check-only)"; exit 2 ;;
esac

# The GPU machine: CPython 3.12 on x86-64 Linux. Pure-Python wheels match "any"; the manylinux tags let pip accept
# a binary wheel should one be listed (none is: binary wheels are too large to carry).
pip_cmd=("$py" -m pip download --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12
         --implementation cp --abi cp312 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64
         --platform manylinux_2_28_x86_64 --platform any -d "$dir" -r "$reqs")

if [ "$mode" = "dry-run" ]; then
    echo "gpu_wheels: would run: ${pip_cmd[*]}"
elif [ "$mode" = "download" ]; then
    mkdir -p "$dir"
    "${pip_cmd[@]}" || { echo "gpu_wheels: error: pip download failed (network? a pin without a py3.12 wheel?)"; exit 1; }
fi

# ---- the size check: the wheels plus what the device tool sends of the repository
wheels_bytes=0
if [ -d "$dir" ]; then
    wheels_bytes=$(find "$dir" -type f -printf '%s\n' | awk '{s+=$1} END {print s+0}')
    # two versions of one package stop `pip install --no-index` there: refuse them here
    dups=$(find "$dir" -maxdepth 1 -name '*.whl' -printf '%f\n' | sed 's/-[0-9].*//' | tr 'A-Z-' 'a-z_' | sort | uniq -d)
    if [ -n "$dups" ]; then
        echo "gpu_wheels: error: several versions of: $dups in $dir; keep one of each"; exit 1
    fi
fi
repo_bytes=0
if git -C "$root" rev-parse --git-dir >/dev/null 2>&1; then
    repo_bytes=$(cd "$root" && git ls-files -z --cached --others --exclude-standard \
                 | xargs -0 -r stat -c '%s' 2>/dev/null | awk '{s+=$1} END {print s+0}')
fi
total=$((wheels_bytes + repo_bytes))
mib() { awk -v b="$1" 'BEGIN {printf "%.2f MiB", b / 1048576}'; }
count=$(find "$dir" -maxdepth 1 -name '*.whl' 2>/dev/null | wc -l)
echo "gpu_wheels: $dir: $count wheels, $(mib "$wheels_bytes"); repository $(mib "$repo_bytes"); together $(mib "$total") of the $(mib "$limit") carry limit"
if [ "$total" -gt "$limit" ]; then
    echo "gpu_wheels: error: over the carry limit by $(mib $((total - limit))); drop wheels from $reqs"
    exit 1
fi
