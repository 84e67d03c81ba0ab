"""Stock TRL beside hf_gradfix on the GRPO family and RLOO: each loss type's error against its own objective over the
real optimizer window (the conformance table of docs/rl.md).

    python benchmarks/rl_report.py            # ~3 min on 2 cores; writes benchmarks/results/rl-trl-<version>.md
    python benchmarks/rl_report.py -k dapo    # only rows whose name contains "dapo"

Every row trains the same tiny Qwen2 policy on the same prompts twice (``tests/support/rl_runs.py``: offline tokenizer, a
deterministic reward, no vLLM, completions of 1 to 10 tokens, SGD at lr 0), stock and under ``hf_gradfix.patch()``,
and reports the worst relative gradient error over the optimizer steps against the float64 window reference
recomputed from the tensors each run trained on (``tests/support/rl_reference.py``). The 2-process rows launch
``tests/support/rl_worker.py`` on gloo.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from _common import RESULTS, ROOT, on_path  # noqa: E402

on_path(ROOT / "tests" / "support")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import transformers  # noqa: E402

import harness as H  # noqa: E402
import rl_reference as R  # noqa: E402
import rl_runs  # noqa: E402

transformers.logging.set_verbosity_error()

LOSS_TYPES = ("dapo", "cispo", "vespo", "bnpo", "grpo", "sapo", "luspo", "dr_grpo")
# (row name, run_rl keyword arguments, reference entropy coefficient)
ROWS = [(f"{t} GA 2, spg = GA", dict(loss_type=t, ga=2, spg=2), 0.0) for t in LOSS_TYPES]
ROWS += [(f"{t} GA 2, spg = 2 x GA", dict(loss_type=t, ga=2, spg=4), 0.0) for t in LOSS_TYPES]
ROWS += [
    ("dapo GA 2, spg = 4 x GA", dict(loss_type="dapo", ga=2, spg=8, steps=2), 0.0),
    ("bnpo GA 4, spg = GA", dict(loss_type="bnpo", ga=4, spg=4), 0.0),
    ("dapo + entropy bonus 0.05, spg = GA", dict(loss_type="dapo", ga=2, spg=2, extra={"entropy_coef": 0.05}), 0.05),
    ("grpo + entropy bonus 0.05, spg = GA", dict(loss_type="grpo", ga=2, spg=2, extra={"entropy_coef": 0.05}), 0.05),
    ("RLOO GA 2, spg = 2 x GA", dict(kind="rloo", ga=2, spg=4), 0.0),
]


def worst_error(run, loss_type, coef) -> float:
    errors = []
    for k, window in enumerate(rl_runs.windows(run)):
        _, truth = R.window_gradient(run.initial, window, loss_type, run.config, entropy_coef=coef)
        errors.append(H.rel_err(run.grads[k], truth))
    return max(errors)


def two_process_rows() -> list[str]:
    """The 2-process cases of tests/support/rl_worker.py (gloo), stock and patched."""
    import pytest  # launch_cases reports a failed launch through pytest.fail

    from multiproc import launch_cases, worker_env

    names = ["dapo_spg4", "bnpo_spg2", "grpo_spg4"]
    errors = {}
    for mode in ("stock", "patch"):
        try:
            runs, _ = launch_cases("rl_worker.py", names, nproc=2, env=worker_env(HGF_RL_MODE=mode))
        except pytest.fail.Exception as err:  # noqa: PERF203
            raise SystemExit(f"the 2-process launch failed: {err}") from None
        for name, ranks in runs.items():
            rank_runs = [rl_runs.RLRun(**{k: r[k] for k in ("grads", "micro_batches", "logged", "config", "ga")},
                                       initial=r["initial"]) for r in ranks]
            loss_type = name.split("_")[0]
            worst = 0.0
            for k, window in enumerate(rl_runs.windows(rank_runs[0], rank_runs)):
                _, truth = R.window_gradient(rank_runs[0].initial, window, loss_type, rank_runs[0].config)
                worst = max(worst, H.rel_err(rank_runs[0].grads[k], truth))
            errors.setdefault(name, {})[mode] = worst
    rows = []
    for name in names:
        loss_type, spg = name.split("_")
        rows.append(f"| {loss_type} GA 2, {spg.replace('spg', 'spg ')}, 2 processes | {errors[name]['stock']:.1e} | "
                    f"{errors[name]['patch']:.1e} |")
        print(rows[-1], flush=True)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="markdown file (default: benchmarks/results/rl-trl-<version>.md)")
    parser.add_argument("-k", default="", help="only rows whose name contains this")
    args = parser.parse_args(argv)
    import trl

    lines = []
    for name, kw, coef in ROWS:
        if args.k not in name:
            continue
        started = time.time()
        loss_type = "rloo" if kw.get("kind") == "rloo" else kw["loss_type"]
        stock = worst_error(rl_runs.run_rl(mode="stock", **kw), loss_type, coef)
        ours = worst_error(rl_runs.run_rl(mode="patch", **kw), loss_type, coef)
        lines.append(f"| {name} | {stock:.1e} | {ours:.1e} |")
        print(lines[-1], f"({time.time() - started:.0f} s)", flush=True)
    header = [f"# GRPO family and RLOO: stock TRL {trl.__version__} vs hf_gradfix",
              "",
              f"`python benchmarks/rl_report.py` (transformers {transformers.__version__}, CPU, fp32, 1 process, 2 "
              "optimizer steps per row). Worst relative gradient error over the steps against the loss type's "
              "objective over the optimizer window (float64 reference from the tensors trained on).",
              "",
              "| loss type, setting | stock TRL | hf_gradfix |",
              "|---|---:|---:|"]
    if "2 processes".startswith(args.k) or args.k in "2 processes":
        lines += two_process_rows()
    out = Path(args.out) if args.out else RESULTS / f"rl-trl-{trl.__version__}.md"
    if not args.k:
        out.write_text("\n".join(header + lines) + "\n")
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
